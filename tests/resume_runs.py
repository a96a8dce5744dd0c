"""Training runs that save on one setup and resume on another: one device, DDP or FSDP2 (``fully_shard``) on gloo.

Each run trains two copies of :class:`ResumeNet` side by side, one with AdamW (two param groups built from
``named_parameters()``: weights decayed, norms and biases not) and one with SGD with momentum (two param groups,
each a run of ``model.parameters()``, the second with its own learning rate). ``train`` takes ``STEPS`` steps,
saves the way its setup saves (a ``.pt`` of ``model.state_dict()`` and ``optimizer.state_dict()``; under FSDP2
``dcp.save`` of ``get_state_dict``), records the optimizer state it holds, then takes ``MORE`` steps and records
their losses. ``resume`` loads the way its setup loads, records the optimizer state it then holds, and takes the
same ``MORE`` steps. Every step uses one global batch, split evenly across the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.models import start_method

STEPS, MORE, BATCH = 3, 10, 8
OPTIMIZERS = ("adamw", "sgd")


class ResumeNet(nn.Module):
    """A projection, a LayerNorm, and two linear layers sharing one weight (as language models tie theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.out.weight = self.mid.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.norm(self.proj(x))).relu())  # type: ignore[no-any-return]


def build(seed: int) -> ResumeNet:
    torch.manual_seed(seed)
    return ResumeNet()


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "adamw":
        decay = [(n, p) for n, p in named if p.ndim > 1]
        rest = [(n, p) for n, p in named if p.ndim <= 1]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)  # fmt: skip
    params = [p for _, p in named]
    return torch.optim.SGD([{"params": params[:3]}, {"params": params[3:], "lr": 0.05}], lr=0.1, momentum=0.9)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 8, generator=gen)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    x, y = batch(step, rank, world)
    opt.zero_grad(set_to_none=True)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    seen = loss.detach().clone()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(seen)
        seen /= world
    return float(seen)


def _wrap(setup: str, model: nn.Module, world: int) -> nn.Module:
    if setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if setup == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def held(setup: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state by parameter name, and its groups' hyperparameters (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if setup == "fsdp2":
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # gathered onto rank 0 alone (cpu_offload), which writes the result
        state = {name: {k: v.clone() for k, v in s.items()} for name, s in full.get("state", {}).items()}
    else:
        inner = model.module if setup == "ddp" else model
        state = {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in inner.named_parameters()}
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]
    return {"state": state, "groups": groups}


def _save(setup: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path, rank: int) -> None:
    if setup == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optimizer": optim_state, "step": STEPS}, checkpoint_id=str(path))
    elif rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": STEPS}, path)


def _load(setup: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    if setup == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:  # a .pt: loaded into the model before wrapping, as the DDP guides do
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])


def run(rank: int, world: int, store: str, setup: str, phase: str, paths: dict[str, str], out: str) -> None:
    """One rank of a run (``world`` 1 with ``setup`` ``single`` needs no process group); rank 0 writes ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if setup != "single":
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {}
        for kind in OPTIMIZERS:
            model = build(0 if phase == "train" else 99)  # resumed: every value must come from the checkpoint
            path = Path(paths[kind])
            if phase == "resume" and setup != "fsdp2":
                wrapped, opt = None, optimizer(kind, model)
                _load(setup, model, opt, path)
                wrapped = _wrap(setup, model, world)
            else:
                wrapped = _wrap(setup, model, world)
                opt = optimizer(kind, wrapped)
            if phase == "train":
                for step in range(STEPS):
                    _step(wrapped, opt, step, rank, world)
                _save(setup, wrapped, opt, path, rank)
            else:
                if setup == "fsdp2":
                    _load(setup, wrapped, opt, path)
            state = held(setup, wrapped, opt)
            losses = [_step(wrapped, opt, STEPS + i, rank, world) for i in range(MORE)]
            result[kind] = {"held": state, "losses": losses}
        if rank == 0:
            torch.save(result, out)
        if setup != "single":
            dist.barrier()
    finally:
        if setup != "single":
            dist.destroy_process_group()


def launch(setup: str, phase: str, *, world: int, paths: dict[str, str], out: Path) -> dict[str, Any]:
    """Run ``setup`` on ``world`` ranks (one device in this process); what rank 0 recorded."""
    args = (world, str(out.parent / f"{out.stem}.store"), setup, phase, dict(paths),
            str(out))  # fmt: skip
    if setup == "single":
        threads = torch.get_num_threads()
        try:
            run(0, *args)
        finally:
            torch.set_num_threads(threads)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(run, args=args, nprocs=world, join=True, start_method=start_method())
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]
