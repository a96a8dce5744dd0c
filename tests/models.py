"""The one test model, the few variants that particular checks need, its real wrapped forms, and a 2-rank DDP run.

Factories for ``--model``: ``tests.models:SmallNet``, ``…:small_net``, ``…:wrong_head``, ``…:RenamedNet``,
``…:Refusing``, ``…:ScaledHead``, ``…:TiedNet``, ``…:TiedLM``, ``…:Holder``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import ckptfix


class SmallNet(nn.Module):
    """A small CNN with two BatchNorm layers, like the models whose checkpoints users fix; seeded, so deterministic."""

    def __init__(self, classes: int = 3, width: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
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


# SmallNet's state dict keys, spelled out.
KEYS = {
    "features.0.weight",
    "features.0.bias",
    "features.1.weight",
    "features.1.bias",
    "features.1.running_mean",
    "features.1.running_var",
    "features.1.num_batches_tracked",
    "features.3.weight",
    "features.3.bias",
    "features.4.weight",
    "features.4.bias",
    "features.4.running_mean",
    "features.4.running_var",
    "features.4.num_batches_tracked",
    "head.weight",
    "head.bias",
}


def make_net(seed: int = 0) -> SmallNet:
    """SmallNet in eval mode with non-default BatchNorm statistics: a dropped or mangled buffer changes the output."""
    net = SmallNet(seed=seed)
    net.train()
    with torch.no_grad():
        net(torch.randn(16, 3, 6, 6))
    return net.eval()


PROBE = torch.linspace(-1, 1, 2 * 3 * 6 * 6).reshape(2, 3, 6, 6)


def small_net(classes: int = 3) -> nn.Module:
    """SmallNet from a factory function rather than a class."""
    return SmallNet(classes=classes)


def wrong_head() -> nn.Module:
    """SmallNet with 5 classes: head.{weight,bias} have the wrong shape."""
    return SmallNet(classes=5)


class RenamedNet(SmallNet):
    """SmallNet with ``features`` renamed to ``backbone`` (same shapes, same order), for rename detection."""

    def __init__(self) -> None:
        super().__init__()
        features, head = self.features, self.head
        del self.features, self.head
        self.backbone, self.head = features, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # type: ignore[no-any-return]


class Refusing(SmallNet):
    """SmallNet whose own ``_load_from_state_dict`` refuses every checkpoint, as a version check in user code does."""

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        error_msgs = args[-1]
        error_msgs.append("checkpoint too old:\n\tre-export it")


class ScaledHead(nn.Module):
    """Not a SmallNet: a linear head and a float buffer outside BatchNorm, under a submodule that happens to be named
    ``module`` (so the model's buffers alone look DDP-wrapped, and only the full key list tells the layout)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(2, 2)
        self.module = nn.Module()
        self.module.register_buffer("scale", torch.ones(2))


class TiedNet(SmallNet):
    """SmallNet with two linear layers sharing one weight (``tied.weight`` is ``mid.weight``) before the head, as
    language models tie their embedding and output weights."""

    def __init__(self, width: int = 4, seed: int = 0) -> None:
        super().__init__(width=width, seed=seed)
        self.mid = nn.Linear(width, width)
        self.tied = nn.Linear(width, width)
        self.tied.weight = self.mid.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tied(self.mid(self.features(x)).relu()))  # type: ignore[no-any-return]


# --- the real wrappers ------------------------------------------------------------------------------------------


def wrap(kind: str, net: nn.Module) -> nn.Module:
    """The wrapped model a training script would hold; its state_dict() is what users save (ddp needs a group)."""
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


# --- a 2-rank DDP run with buffer sync off: per-rank BatchNorm statistics, identical parameters -----------------

WORLD = 2
STEPS = 3


def inputs(rank: int, n: int = 8) -> torch.Tensor:
    """Per-rank data with a rank-dependent mean and scale, so BatchNorm statistics really differ."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 3, 8, 8, generator=gen) * (1 + rank) + 2.0 * rank


def _save_rank(out: Path, rank: int, wrapped: nn.Module, opt: torch.optim.Optimizer) -> Path:
    path = out / f"rank{rank}.pt"
    torch.save({"model": wrapped.state_dict(), "epoch": STEPS, "optimizer": opt.state_dict(), "rank": rank}, path)
    return path


def rank_files(out: Path) -> list[Path]:
    """The per-rank checkpoints that :func:`ddp_rank_files` saves, computed in this process in a fraction of the time.

    DDP gives every rank the sum of the ranks' gradients each scaled by 1/WORLD, and with buffer sync off each
    rank keeps the BatchNorm statistics of its own data; doing the same here gives the same bits
    (tests/merging/test_files.py checks that against a real gloo run).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the DDP workers run: the same summation order in the convolutions
    try:
        nets = [SmallNet() for _ in range(WORLD)]
        opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in nets]
        for step in range(STEPS):
            for rank, (net, opt) in enumerate(zip(nets, opts, strict=True)):
                loss = net(inputs(rank * 10 + step)).square().mean()
                opt.zero_grad()
                loss.backward()
            for params in zip(*(net.parameters() for net in nets), strict=True):
                grads = [p.grad * (1 / WORLD) for p in params if p.grad is not None]
                total = grads[0]
                for grad in grads[1:]:
                    total = total + grad
                for p in params:
                    p.grad = total.clone()
            for opt in opts:
                opt.step()
    finally:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    # DataParallel's state dict is DDP's: the same module. prefix and _metadata.
    return [_save_rank(out, rank, nn.DataParallel(net), opts[rank]) for rank, net in enumerate(nets)]


def _ddp_worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        # Buffers synced at start only; each rank then keeps its own BatchNorm running statistics.
        ddp = DistributedDataParallel(SmallNet(), forward_sync_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(STEPS):
            x = inputs(rank * 10 + step)
            loss = ddp(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        _save_rank(Path(out_dir), rank, ddp, opt)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def start_method() -> str:
    """fork: the children need no fresh torch import, most of a spawn's cost on a busy machine. A forked child
    would inherit an initialised default group (the session gloo_world fixture) or a CUDA context it cannot use
    (an earlier test ran on the GPU), so spawn then; and wherever a GPU is: ``torch.cuda.is_available()``, which
    torch's DCP writer calls on every save, starts the CUDA driver without ``is_initialized()`` saying so, and a
    forked child's first CUDA call (an optimizer step checks for graph capture) then fails."""
    import torch.distributed as dist

    busy = dist.is_initialized() or torch.cuda.is_initialized() or torch.cuda.is_available()
    return "spawn" if busy else "fork"


def ddp_rank_files(out: Path) -> list[Path]:
    """Per-rank checkpoints of a real 2-process gloo DDP run, saved under ``out``."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _ddp_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True, start_method=start_method()
    )
    return [out / f"rank{r}.pt" for r in range(WORLD)]


def make_file(tmp_path: Path, fmt: str) -> Path:
    state = {"model": make_net().state_dict(), "epoch": 1}
    path = tmp_path / f"good-{fmt}{'.safetensors' if fmt == 'safetensors' else '.pt'}"
    if fmt == "safetensors":
        ckptfix.save(state, path)
    else:
        torch.save(state, path, _use_new_zipfile_serialization=fmt == "zip")
    return path


class TiedLM(nn.Module):
    """A language model whose output layer is its input embedding, as GPT-2's ``lm_head`` is ``wte``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


class Holder(nn.Module):
    """A training wrapper that keeps the network as an attribute, as a LightningModule keeps ``self.net``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SmallNet(seed=3)
