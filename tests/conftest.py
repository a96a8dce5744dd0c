"""Shared fixtures: a one-process gloo group, real wrapped state dicts, per-rank DDP checkpoints (models: models.py)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.corpus import write_corpus

# Before any test touches CUDA: cuBLAS reads it once, and the trainer's --deterministic runs need it (GPU only).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="session")
def gloo_world() -> Iterator[None]:
    """A one-process gloo group, so DistributedDataParallel can wrap a CPU model for real."""
    if dist.is_initialized():
        yield
        return
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def wrapped_state(gloo_world: None) -> Callable[[str], dict[str, torch.Tensor]]:
    """state_dict() of make_net() under a real wrapper of the given kind, on the CPU."""

    def make(kind: str) -> dict[str, torch.Tensor]:
        # DataParallel moves its module to cuda:0 on a GPU machine; these tests compare wrappers' keys and values.
        return models.wrap(kind, models.make_net()).cpu().state_dict()

    return make


@pytest.fixture
def ddp_ckpt(tmp_path: Path, wrapped_state: Callable[[str], Any]) -> Path:
    """A full checkpoint (epoch, optimizer) whose model entry is a real DDP state dict."""
    path = tmp_path / "ddp.pt"
    torch.save({"epoch": 4, "model": wrapped_state("ddp"), "optimizer": {"state": {}, "param_groups": []}}, path)
    return path


@pytest.fixture(scope="session")
def rank_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Per-rank checkpoints of a 2-rank DDP run of SmallNet with buffer sync off (made once per session)."""
    return models.rank_files(tmp_path_factory.mktemp("ranks"))


@pytest.fixture(autouse=True)
def _no_force_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's shell may set this; tests that need it set it themselves.
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.fixture
def single(tmp_path: Path) -> Path:
    """A DCP folder written by one process (``tmp_path / "dcp"``): a model, a step counter and nested
    optimizer-like values."""
    from ckptfix.torchcompat import dcp_save_local

    state = {"model": models.SmallNet().state_dict(), "step": 3, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}
    dcp_save_local(state, checkpoint_id=str(tmp_path / "dcp"))  # one process, whatever group exists
    return tmp_path / "dcp"


@pytest.fixture
def pickle_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times ckptfix's pickle reader reads each file's pickle (by path), from now on."""
    from ckptfix.formats.pickles import unpickling

    counts: Counter[str] = Counter()
    real = unpickling.load

    def counted(data: Any, *, source: str, **kwargs: Any) -> Any:
        counts[source] += 1
        return real(data, source=source, **kwargs)

    monkeypatch.setattr(unpickling, "load", counted)
    return counts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))
