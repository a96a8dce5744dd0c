"""Worker processes for tests/distributed/test_distributed.py: each rank runs a list of scenarios on one gloo group.

Running many scenarios in one group keeps the suite fast (torch is imported once per process) and checks
that a failed ``load_for_ddp`` leaves every rank free for the next collective. Checkpoints are written by
the test under ``tmp/rank<src>/`` so that the file exists for the source rank only.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import signal
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import FileStore, TCPStore  # type: ignore[attr-defined]  # public, not in the stubs

import ckptfix
from ckptfix.distributed import load_for_ddp, save_for_ddp
from ckptfix.errors import CkptfixError
from tests.models import SmallNet


class Net(SmallNet):
    """The shared test model plus bf16 and bool buffers, so every dtype path of the broadcast is used."""

    def __init__(self, width: int = 8) -> None:
        super().__init__(classes=4, width=width, seed=int(torch.initial_seed()) % 2**31)
        self.register_buffer("scale", torch.randn(width).to(torch.bfloat16))
        self.register_buffer("mask", torch.rand(width) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x) * self.scale.float() * self.mask.float())  # type: ignore[no-any-return]


def build(seed: int, width: int = 8) -> Net:
    torch.manual_seed(seed)
    net = Net(width)
    norm = net.features[1]
    assert isinstance(norm, nn.BatchNorm2d) and norm.running_mean is not None and norm.num_batches_tracked is not None
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.num_batches_tracked.fill_(seed)
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
        import ckptfix.formats.registry

        ckptfix.formats.registry.read = lambda *a, **k: os._exit(17)  # what load_for_ddp reads the file with
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
    "hf_shards": _load("hf_shards"),  # folders: read on the source only, as a file is
    "dcp": _load("dcp", entry="model"),
    "subgroup": _subgroup,
    "save": _save,
    "fail_save": _save_fails,
    "src_dies_before_status": _src_dies_before_status,
    "src_dies_mid_broadcast": _src_dies_mid_broadcast,
}


def extras_values() -> dict[str, Any]:
    """The extra checkpoint entry of each ``extras_<kind>`` scenario: all load weights-only on the source."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized dtypes are deprecated, but checkpoints hold them
        quantized = torch.quantize_per_tensor(torch.linspace(-1, 1, 4), 0.1, 0, torch.qint8)
    return {
        # Cannot travel as plain data: every rank must refuse them before any tensor moves.
        "meta": torch.empty(3, 2, device="meta"),
        "quantized": quantized,
        "sparse": torch.eye(3).to_sparse(),
        "storage": torch.arange(4.0).untyped_storage(),
        # Inert values and tensors in unusual but plain forms: every rank must receive them equal.
        "inert": {
            "layout": torch.strided,
            "dtype": torch.bfloat16,
            "size": torch.Size([2, 3]),
            "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
            "expanded": torch.arange(3.0).expand(2, 3),
        },
    }


EXTRAS_KINDS = ("meta", "quantized", "sparse", "storage", "inert")

# A timeout short enough for fast tests, long enough for a loaded CI machine to finish a healthy phase.
HANG_TIMEOUT = 3.0
# How long a frozen rank stays stopped: longer than HANG_TIMEOUT, so the others give up first.
FREEZE_SECONDS = 5.0


def _freeze_self() -> None:
    """Stop this process (SIGSTOP) and have a helper resume it later: a rank that hangs, then wakes up."""
    subprocess.Popen(["/bin/sh", "-c", f"sleep {FREEZE_SECONDS}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def _src_frozen_reading(ctx: Ctx) -> Any:
    if ctx.rank == 0:
        import ckptfix.formats.registry

        real = ckptfix.formats.registry.read  # what load_for_ddp reads the file with

        def frozen_load(*args: Any, **kwargs: Any) -> Any:
            _freeze_self()
            return real(*args, **kwargs)

        ckptfix.formats.registry.read = frozen_load
    return load_for_ddp(ctx.model(), ctx.path("full.pt"), timeout=HANG_TIMEOUT)


def _src_frozen_mid_broadcast(ctx: Ctx) -> Any:
    # Tiny buckets make several broadcasts; the source stops between the first and the second.
    if ctx.rank == 0:
        real = dist.broadcast
        calls: list[int] = []

        def frozen_on_second(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                _freeze_self()
            return real(*args, **kwargs)

        dist.broadcast = frozen_on_second
    return load_for_ddp(ctx.model(), ctx.path("full.pt"), bucket_mb=0.0005, timeout=HANG_TIMEOUT)


def _src_differs(ctx: Ctx) -> Any:
    # The file exists on both ranks, so each would read it and then broadcast from itself.
    return load_for_ddp(ctx.model(), ctx.path("plain.pt"), src=ctx.rank, timeout=HANG_TIMEOUT)


def _rank1_never_calls(ctx: Ctx) -> Any:
    if ctx.rank == 1:
        return "skipped"
    return load_for_ddp(ctx.model(), ctx.path("plain.pt"), timeout=HANG_TIMEOUT)


def _extras(name: str) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        model = ctx.model()
        extras = load_for_ddp(model, ctx.path(name), timeout=HANG_TIMEOUT)
        return {"state": _state(model), "extras": extras}

    return run


SCENARIOS.update(
    {
        "src_frozen_reading": _src_frozen_reading,
        "src_frozen_mid_broadcast": _src_frozen_mid_broadcast,
        "src_differs": _src_differs,
        "rank1_never_calls": _rank1_never_calls,
        **{f"extras_{kind}": _extras(f"extras_{kind}.pt") for kind in EXTRAS_KINDS},
    }
)
# After these the group may hold abandoned work (a broadcast or a store request to a frozen peer): skip the
# orderly destroy_process_group, which could wait on that work, and exit once the results are written.
LEAVE_GROUP_BROKEN = {"src_frozen_mid_broadcast", "src_frozen_reading", "src_differs", "rank1_never_calls"}


def start(tmp: Path, world: int, scenarios: list[str], *, store: str = "file") -> list[Any]:
    """Start ``world`` processes that run ``scenarios`` on one fresh gloo group; see :func:`main` for ``store``."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=main, args=(r, world, str(tmp), scenarios, store)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def collect(tmp: Path, procs: list[Any], *, limit: float = 240) -> list[dict[str, Any]]:
    """Wait up to ``limit`` seconds for ``procs``, kill what is left; each rank's records, ``{}`` if none."""
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for rank in range(len(procs)):
        out = tmp / f"result{rank}.pkl"
        results.append(pickle.loads(out.read_bytes()) if out.exists() else {})
    return results


def spawn(tmp: Path, world: int, scenarios: list[str], *, limit: float = 240) -> list[dict[str, Any]]:
    """:func:`start` then :func:`collect`."""
    return collect(tmp, start(tmp, world, scenarios), limit=limit)


def _tcp_store(rank: int, world: int, tmp: Path) -> Any:
    """A TCPStore hosted by rank 0, as ``env://`` or ``tcp://`` make it, on a port the OS picked (no collisions)."""
    timeout = timedelta(seconds=60)
    port_file = tmp / "store-port"
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
        (tmp / "store-port.tmp").write_text(str(store.port))
        (tmp / "store-port.tmp").rename(port_file)  # atomic: the others never read half a number
        return store
    deadline = time.monotonic() + 60
    while not port_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return TCPStore("127.0.0.1", int(port_file.read_text()), world, False, timeout)


def main(rank: int, world: int, tmp: str, scenarios: list[str], store_kind: str = "file") -> None:
    """Entry point of one spawned rank; writes ``result<rank>.pkl`` with one record per scenario.

    ``store_kind`` is ``"file"`` (a FileStore under ``tmp``: it lives on whatever happens to a rank, like
    torchrun's agent store) or ``"tcp"`` (hosted inside rank 0, so it stops when rank 0 is stopped).
    """
    torch.set_num_threads(1)
    store = _tcp_store(rank, world, Path(tmp)) if store_kind == "tcp" else FileStore(f"{tmp}/store", world)
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
    if LEAVE_GROUP_BROKEN.intersection(scenarios):
        os._exit(0)
    dist.destroy_process_group()
