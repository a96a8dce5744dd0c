"""Models and a real 2-process gloo DDP run for the merge, validate and diff tests.

Factories for ``--model``: ``tests.checks_models:SmallCNN``, ``…:RenamedCNN``, ``…:ScaledHead``, ``…:wrong_head``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

WORLD = 2
STEPS = 3


def small_cnn(classes: int = 3) -> nn.Module:
    """The reference model of these tests as a factory function."""
    return SmallCNN(classes=classes)


class SmallCNN(nn.Module):
    """small_cnn as a class with a forward (DDP needs a real forward)."""

    def __init__(self, classes: int = 3, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3),
            nn.BatchNorm2d(width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


class RenamedCNN(nn.Module):
    """SmallCNN with ``features`` renamed to ``backbone`` (same shapes)."""

    def __init__(self) -> None:
        super().__init__()
        inner = SmallCNN()
        self.backbone = inner.features
        self.head = inner.head


class ScaledHead(nn.Module):
    """A linear head and a float buffer outside BatchNorm, under a submodule that happens to be named ``module``
    (so the model's buffers alone look DDP-wrapped, and only the full key list tells the layout)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(2, 2)
        self.module = nn.Module()
        self.module.register_buffer("scale", torch.ones(2))


def wrong_head() -> nn.Module:
    """SmallCNN with 5 classes: head.{weight,bias} have the wrong shape."""
    return SmallCNN(classes=5)


def inputs(rank: int, n: int = 8) -> torch.Tensor:
    """Per-rank data with a rank-dependent mean and scale, so BatchNorm statistics really differ."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 3, 8, 8, generator=gen) * (1 + rank) + 2.0 * rank


def _ddp_worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        # Buffers synced at start only; each rank then keeps its own BatchNorm running statistics.
        ddp = DistributedDataParallel(SmallCNN(), forward_sync_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(STEPS):
            x = inputs(rank * 10 + step)
            loss = ddp(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.save(
            {"model": ddp.state_dict(), "epoch": STEPS, "optimizer": opt.state_dict(), "rank": rank},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ddp_rank_files(base: Path) -> list[Path]:
    """Per-rank checkpoints of a real 2-process gloo DDP run (made once per test session under ``base``)."""
    out = base / "checks_ddp_run"
    files = [out / f"rank{r}.pt" for r in range(WORLD)]
    if all(f.exists() for f in files):
        return files
    import torch.distributed as dist
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    # fork: the children need no fresh torch import, most of a spawn's cost on a busy machine. A forked child
    # would inherit an initialised default group (the session gloo_world fixture), so spawn then.
    method = "spawn" if dist.is_initialized() else "fork"
    mp.start_processes(_ddp_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True, start_method=method)
    return files
