"""The training libraries as the tests import them (skipped, saying how to install them, where they are missing),
and the checkpoints they write, made with their own objects (``tests/test_frameworks.py``,
``tests/cli/test_folders.py``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.extras import FRAMEWORKS
from tests.models import make_net

_TORCHVISION_OPS: Any = None  # the library that declares torchvision's two op schemas, kept alive


def _usable_torchvision() -> None:
    """Let torchvision's Python side import under a CPU-only torch (timm imports it, and Lightning when present).

    PyPI has one torchvision per torch release, built for CUDA: under the CPU build of torch its C ops do not load,
    and then its import fails on two fake registrations it does not guard ("operator torchvision::nms does not
    exist"). Declaring those two schemas first lets the import finish; nothing here calls them.
    """
    global _TORCHVISION_OPS
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # type: ignore[import-untyped]
    except RuntimeError:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        _TORCHVISION_OPS = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
        for op in ("nms", "qnms"):
            _TORCHVISION_OPS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401


def library(name: str) -> ModuleType:
    _usable_torchvision()
    try:
        return importlib.import_module(name)
    except ImportError as e:
        why = "" if name != "timm" else "; timm needs torchvision, whose torch-2.13 build here is CUDA-only"
        pytest.skip(f"{name} cannot be imported ({e}){why}; the others: {FRAMEWORKS}")


def mmengine_checkpoint(tmp_path: Path, **meta: Any) -> Path:
    """What mmengine's ``Runner.save_checkpoint`` writes, made with mmengine's own objects.

    The Runner itself is out of reach of a test: mmengine-lite's ``mmengine.runner`` imports cv2 (and its
    visualizer matplotlib), which the lite package does not install. Its checkpoint is this dict, passed to
    ``torch.save``: ``meta``, the model's ``state_dict``, ``message_hub.state_dict()`` (``HistoryBuffer`` objects
    per logged scalar), ``optim_wrapper.state_dict()`` and each scheduler's ``state_dict()``.
    """
    mmengine = library("mmengine")
    logging = library("mmengine.logging")
    optim = library("mmengine.optim")

    model = make_net()
    model.train()
    wrapper = optim.OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scheduler = optim.MultiStepLR(wrapper, milestones=[2], by_epoch=False)
    hub = logging.MessageHub.get_instance(f"ckptfix-{tmp_path.name}")
    torch.manual_seed(0)
    for step in range(4):
        loss = model(torch.randn(8, 3, 6, 6)).square().mean()
        wrapper.update_params(loss)
        scheduler.step()
        hub.update_scalar("train/loss", loss.item())
        hub.update_scalar("train/lr", wrapper.get_lr()["lr"][0])
        hub.update_info("iter", step + 1)
    model.eval()
    info = {"epoch": 1, "iter": 4, "seed": 0, "experiment_name": "ckptfix", "mmengine_version": mmengine.__version__}
    checkpoint = {
        "meta": {**info, **meta},
        "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
        "message_hub": hub.state_dict(),
        "optimizer": wrapper.state_dict(),
        "param_schedulers": [scheduler.state_dict()],
    }  # fmt: skip
    path = tmp_path / "epoch_1.pth"
    torch.save(checkpoint, path)
    return path
