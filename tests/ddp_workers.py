"""Worker processes for tests/test_distributed.py: each rank runs a list of scenarios on one gloo group.

Running many scenarios in one group keeps the suite fast (torch is imported once per process) and checks
that a failed ``load_for_ddp`` leaves every rank free for the next collective. Checkpoints are written by
the test under ``tmp/rank<src>/`` so that the file exists for the source rank only.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ckptfix
from ckptfix.distributed import load_for_ddp, save_for_ddp
from ckptfix.errors import CkptfixError


class Net(nn.Module):
    """Conv, BatchNorm (int64 counter), Linear, and bf16 and bool buffers, so every dtype path is used."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.head = nn.Linear(width, 4)
        self.register_buffer("scale", torch.randn(width).to(torch.bfloat16))
        self.register_buffer("mask", torch.rand(width) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x).mean(dim=(2, 3)) * self.scale.float() * self.mask.float()
        return self.head(h)  # type: ignore[no-any-return]


def build(seed: int, width: int = 8) -> Net:
    torch.manual_seed(seed)
    net = Net(width)
    with torch.no_grad():
        net.features[1].running_mean.normal_()
        net.features[1].num_batches_tracked.fill_(seed)
    return net


INPUT = torch.linspace(-1, 1, 2 * 3 * 5 * 5).reshape(2, 3, 5, 5)


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    optimizer.zero_grad()
    model(INPUT).square().mean().backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Config:
    """A user class inside a checkpoint: the weights-only loader refuses it unless allowed."""

    lr: float = 0.1


@dataclass
class Ctx:
    rank: int
    world: int
    tmp: Path
    pair: Any = None

    def path(self, name: str) -> Path:
        """Where this rank looks for checkpoint ``name``: only the source's folder holds it."""
        return self.tmp / f"rank{self.rank}" / name

    def model(self, width: int = 8) -> Net:
        return build(seed=100 + self.rank, width=width)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load(name: str, *, wrap: str = "single", **kw: Any) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        model: nn.Module = ctx.model()
        if wrap == "compiled" or (wrap == "compiled-on-1" and ctx.rank == 1):
            model = torch.compile(model)  # type: ignore[assignment]
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        extras = load_for_ddp(model, ctx.path(name), **kw)
        return {"state": _state(model), "extras": extras}

    return run


def _resume(ctx: Ctx) -> Any:
    model = ctx.model()
    extras = load_for_ddp(model, ctx.path("full.pt"))
    received = copy.deepcopy(extras)  # Adam steps its loaded state in place
    optimizer = optimizer_for(model)
    optimizer.load_state_dict(extras["optimizer"])
    return {"state": _state(model), "extras": received, "stepped": one_step(model, optimizer)}


def _wrong_model_on_last(ctx: Ctx) -> Any:
    model = ctx.model(width=16 if ctx.rank == ctx.world - 1 else 8)
    return load_for_ddp(model, ctx.path("plain.pt"))


def _subgroup(ctx: Ctx) -> Any:
    # new_group is collective over the world; only ranks 0 and 2 then take part in the load.
    group = dist.new_group([0, 2])
    if ctx.rank == 1:
        return "not in group"
    model = ctx.model()
    extras = load_for_ddp(model, ctx.path("full.pt"), src=2, group=group)
    return {"state": _state(model), "extras": extras}


def _save(ctx: Ctx) -> Any:
    model = ctx.model()
    wrapped = torch.compile(model)
    out = ctx.tmp / "saved.pt"
    save_for_ddp({"model": wrapped, "epoch": 7}, out)
    # Every rank returns only once the file is complete, so every rank may read it now.
    return {"state": _state(model), "saved": ckptfix.load(out)}


def _save_fails(ctx: Ctx) -> Any:
    save_for_ddp(ctx.model(), ctx.tmp / "no-such-folder" / "x.pt")


def _src_dies_mid_broadcast(ctx: Ctx) -> Any:
    # Rank 2 posts a good status, then dies as the first tensor leaves: gloo sees the closed connection.
    if ctx.rank == 2:
        dist.broadcast = lambda *a, **k: os._exit(18)
    return load_for_ddp(ctx.model(), ctx.path("plain.pt"), src=2, timeout=3)


def _src_dies_before_status(ctx: Ctx) -> Any:
    # Rank 1 dies while reading; the store lives on, so rank 0 can only notice through the timeout.
    if ctx.rank == 1:
        import ckptfix.formats

        ckptfix.formats.load = lambda *a, **k: os._exit(17)
    if ctx.rank == 2:
        return "not in group"
    return load_for_ddp(ctx.model(), ctx.path("plain.pt"), src=1, timeout=3, group=ctx.pair)


SCENARIOS: dict[str, Callable[[Ctx], Any]] = {
    "plain": _load("plain.pt"),
    "ddp": _load("ddp.pt"),
    "compiled": _load("compiled.pt"),
    "into_compiled": _load("plain.pt", wrap="compiled"),
    "into_ddp": _load("compiled.pt", wrap="ddp"),
    "mixed_wrappers": _load("ddp.pt", wrap="compiled-on-1"),
    "full": _resume,
    "small_buckets": _load("full.pt", bucket_mb=0.0005),
    "src1": _load("ddp.pt", src=1),
    "no_model_broadcast": _load("full.pt", broadcast_model=False),
    "non_strict": _load("missing_key.pt", strict=False),
    "fail_missing_file": _load("does-not-exist.pt"),
    "fail_unsafe": _load("unsafe.pt"),
    "fail_truncated": _load("truncated.pt"),
    "fail_shape": _load("wide.pt"),
    "fail_missing_key": _load("missing_key.pt"),
    "fail_other_model": _wrong_model_on_last,
    "subgroup": _subgroup,
    "save": _save,
    "fail_save": _save_fails,
    "src_dies_before_status": _src_dies_before_status,
    "src_dies_mid_broadcast": _src_dies_mid_broadcast,
}


def main(rank: int, world: int, tmp: str, scenarios: list[str]) -> None:
    """Entry point of one spawned rank; writes ``result<rank>.pkl`` with one record per scenario."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    ctx = Ctx(rank, world, Path(tmp))
    if world == 3 and "src_dies_before_status" in scenarios:
        ctx.pair = dist.new_group([0, 1])  # collective over the world, so made while every rank is alive
    results: dict[str, Any] = {}
    out = Path(tmp) / f"result{rank}.pkl"
    for name in scenarios:
        start = time.monotonic()
        try:
            value = SCENARIOS[name](ctx)
            results[name] = {"ok": True, "value": value, "seconds": time.monotonic() - start}
        except CkptfixError as e:
            results[name] = {
                "ok": False, "kind": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start
            }  # fmt: skip
        except Exception as e:
            results[name] = {"ok": False, "kind": "crash", "message": traceback.format_exc(), "error": repr(e)}
        # Written after each scenario so that a rank killed later still leaves its earlier results.
        out.write_bytes(pickle.dumps(results))
    dist.destroy_process_group()
