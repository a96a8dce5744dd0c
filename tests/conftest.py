"""Shared test models and real wrapped state dicts (DataParallel, DDP on gloo, torch.compile)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn


class SmallNet(nn.Module):
    """A small CNN with BatchNorm, like the models whose checkpoints users fix."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def make_net(seed: int = 0) -> SmallNet:
    torch.manual_seed(seed)
    net = SmallNet()
    # Non-default BatchNorm statistics, so a dropped or mangled buffer changes the output.
    net.train()
    with torch.no_grad():
        net(torch.randn(16, 3, 6, 6))
    return net.eval()


PROBE = torch.linspace(-1, 1, 2 * 3 * 6 * 6).reshape(2, 3, 6, 6)


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


def wrap(kind: str, net: nn.Module) -> nn.Module:
    """The wrapped model a training script would hold; its state_dict() is what users save."""
    if kind == "single":
        return net
    if kind == "dp":
        return nn.DataParallel(net)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    if kind == "compiled":
        return torch.compile(net)  # type: ignore[return-value]
    if kind == "ddp-compiled":
        return nn.parallel.DistributedDataParallel(torch.compile(net))  # type: ignore[arg-type]
    if kind == "compiled-ddp":
        return torch.compile(nn.parallel.DistributedDataParallel(net))  # type: ignore[return-value]
    raise ValueError(kind)


WRAPPERS = ["single", "dp", "ddp", "compiled", "ddp-compiled", "compiled-ddp"]
PREFIX = {
    "single": "",
    "dp": "module.",
    "ddp": "module.",
    "compiled": "_orig_mod.",
    "ddp-compiled": "module._orig_mod.",
    "compiled-ddp": "_orig_mod.module.",
}


@pytest.fixture
def wrapped_state(gloo_world: None) -> Callable[[str], dict[str, torch.Tensor]]:
    """state_dict() of make_net() under a real wrapper of the given kind."""

    def make(kind: str) -> dict[str, torch.Tensor]:
        return wrap(kind, make_net()).state_dict()

    return make


@pytest.fixture(autouse=True)
def _no_force_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's shell may set this; tests that need it set it themselves.
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
