"""Training runs that save on one setup and resume on another: one device, DDP, FSDP1 or FSDP2 on gloo.

Each run trains two copies of :class:`ResumeNet` side by side, one with AdamW (two param groups built from
``named_parameters()``: weights decayed, norms and biases not) and one with SGD with momentum (two param groups,
each a run of ``model.parameters()``, the second with its own learning rate), each with a StepLR schedule.
``train`` takes ``STEPS`` steps, saves the way its setup saves (a ``.pt`` of ``model.state_dict()`` and
``optimizer.state_dict()``; under FSDP2, and DDP as ``ddp_dcp``, ``dcp.save`` of ``get_state_dict``; under FSDP1
a file per rank of SHARDED_STATE_DICT, or of LOCAL_STATE_DICT as ``fsdp1local``, its optimizer's from
``FSDP.optim_state_dict``; each with the scheduler's state, the RNG state, a GradScaler's state and the step count),
records what it goes on from, then takes ``MORE`` steps and records their losses.
``resume`` loads the way its setup loads, records what it then holds, and takes the same ``MORE`` steps. Every
step uses one global batch, split evenly across the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS, MORE, BATCH = 3, 10, 8
OPTIMIZERS = ("adamw", "sgd")
DCP = ("fsdp2", "ddp_dcp")  # the setups that save a DCP folder of get_state_dict (DDP: full tensors, plain names)
# a mixed-precision run's torch.amp.GradScaler.state_dict(), none of it the defaults: carried as the scheduler is
SCALER = {"scale": 2.0**11, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7, "_growth_tracker": 5}


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


def build(seed: int = 0) -> ResumeNet:
    torch.manual_seed(seed)
    return ResumeNet()


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if kind == "adamw":
        # by name: FSDP1 shows each rank's flat slice of a parameter, whose ndim is 1
        decay = [(n, p) for n, p in named if n.endswith("weight") and "norm." not in n]
        rest = [(n, p) for n, p in named if not (n.endswith("weight") and "norm." not in n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)  # fmt: skip
    params = [p for _, p in named]
    return torch.optim.SGD([{"params": params[:3]}, {"params": params[3:], "lr": 0.05}], lr=0.1, momentum=0.9)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The SGD run's optimizer, as ``convert --optimizer-factory tests.resume_runs:sgd`` builds it."""
    return optimizer("sgd", model)


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


def go_on(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, rank: int, world: int) -> list[float]:
    """The losses of the ``MORE`` steps after the save, the schedule stepped after each."""
    losses = []
    for i in range(MORE):
        losses.append(_step(model, opt, STEPS + i, rank, world))
        sched.step()
    return losses


def _wrap(setup: str, model: nn.Module, world: int) -> nn.Module:
    if setup.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if setup == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    if setup.startswith("fsdp1"):  # the original parameters kept, so that the two param groups can be told apart
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    return model


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # the rate halves while the runs go on


def held(setup: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state by parameter name, and its groups' hyperparameters (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if setup.startswith("fsdp1"):
        state = _fsdp1_state(model, opt)
    elif setup == "fsdp2":
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # gathered onto rank 0 alone (cpu_offload), which writes the result
        state = {name: {k: v.clone() for k, v in s.items()} for name, s in full.get("state", {}).items()}
    else:
        inner = model.module if setup.startswith("ddp") else model
        state = {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in inner.named_parameters()}
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]
    return {"state": state, "groups": groups}


def rank_file(path: str, rank: int) -> Path:
    """Where FSDP1 rank ``rank`` saves (each rank its own file)."""
    return Path(f"{path}-rank{rank}.pt")


def _fsdp1_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """FSDP1's optimizer state gathered from the ranks' own slices (each rank steps its piece of every flattened
    parameter, in order): not through FULL_STATE_DICT, whose ``exp_avg`` here comes back equal to ``exp_avg_sq``
    (torch 2.13, CPU, ``use_orig_params``), where the sharded state agrees with the same DDP run's."""
    import torch.distributed as dist

    local = {name.replace("_fsdp_wrapped_module.", ""): {k: v.clone() for k, v in opt.state[p].items()}
             for name, p in model.named_parameters() if p in opt.state}  # fmt: skip
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    shapes = dict((n, p.shape) for n, p in build(0).named_parameters())
    state = {}
    for name, shape in shapes.items():
        pieces = [r[name] for r in ranks if name in r]
        state[name] = {k: pieces[0][k] if v.ndim == 0 else torch.cat([p[k].flatten() for p in pieces]).reshape(shape)
                       for k, v in pieces[0].items()}  # fmt: skip
    return state


def _save(setup: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, path: str, rank: int) -> None:
    extra = {"scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "step": STEPS, "scaler": SCALER}
    if setup in DCP:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optimizer": optim_state, **extra}, checkpoint_id=path)
    elif setup.startswith("fsdp1"):  # each rank its shards (ShardedTensors) of weights and moments
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        # SHARDED_STATE_DICT: a tensor per parameter; LOCAL_STATE_DICT: one flat tensor of them all, its moments
        # from FSDP.optim_state_dict as under SHARDED_STATE_DICT
        kind = StateDictType.LOCAL_STATE_DICT if setup == "fsdp1local" else StateDictType.SHARDED_STATE_DICT
        with FullyShardedDataParallel.state_dict_type(model, kind):
            optim = FullyShardedDataParallel.optim_state_dict(model, opt)
            torch.save({"model": model.state_dict(), "optimizer": optim, **extra}, rank_file(path, rank))
    elif rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), **extra}, path)


def _load(setup: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, path: str) -> dict[str, Any]:
    """Load the run's state; what it holds for the GradScaler."""
    if setup in DCP:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optimizer": optim_state, "scheduler": sched.state_dict(),
                 "rng": torch.get_rng_state(), "scaler": torch.amp.GradScaler("cpu").state_dict()}  # fmt: skip
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:  # a .pt: loaded into the model before wrapping, as the DDP guides do
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["scaler"]  # type: ignore[no-any-return]


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
            path = paths[kind]
            scaler = torch.amp.GradScaler("cpu")  # only carried: its state goes where the run goes
            if phase == "resume" and setup not in DCP:
                opt = optimizer(kind, model)
                sched = scheduler(opt)
                scaler.load_state_dict(_load(setup, model, opt, sched, path))
                wrapped = _wrap(setup, model, world)
            else:
                wrapped = _wrap(setup, model, world)
                opt = optimizer(kind, wrapped)
                sched = scheduler(opt)
            if phase == "train":
                scaler.load_state_dict(SCALER)  # as a mixed-precision run would hold it at the save
                for step in range(STEPS):
                    _step(wrapped, opt, step, rank, world)
                    sched.step()
                _save(setup, wrapped, opt, sched, path, rank)
            elif setup in DCP:
                scaler.load_state_dict(_load(setup, wrapped, opt, sched, path))
            # what the run goes on from: the optimizer, the schedule, the random stream
            state = {**held(setup, wrapped, opt), "scheduler": sched.state_dict(), "draws": torch.randint(9, (4,)),
                     "scaler": scaler.state_dict()}  # fmt: skip
            result[kind] = {"held": state, "losses": go_on(wrapped, opt, sched, rank, world)}
        if rank == 0:
            torch.save(result, out)
        if setup != "single":
            dist.barrier()
    finally:
        if setup != "single":
            dist.destroy_process_group()
    Path(f"{out}.done{rank}").touch()  # this rank's work is over: what launch() asks of a rank that aborts on exit


def launch(setup: str, phase: str, *, world: int, paths: dict[str, str], out: Path) -> dict[str, Any]:
    """Run ``setup`` on ``world`` ranks (one device in this process); what rank 0 recorded."""
    args = (world, str(out.parent / f"{out.stem}.store"), setup, phase, dict(paths),
            str(out))  # fmt: skip
    return run_ranks(run, args, in_process=setup == "single", world=world, out=out)


def ckptfix(*args: object) -> str:
    """``ckptfix ARGS`` in this process (the conversion between a run and its resumption): what it said."""
    from click.testing import CliRunner

    from ckptfix.cli import cli

    done = CliRunner().invoke(cli, [str(a) for a in args])
    assert done.exit_code == 0, done.output
    return done.stderr + done.stdout


def run_ranks(target: Any, args: tuple[Any, ...], *, in_process: bool, world: int, out: Path) -> dict[str, Any]:
    """``target(rank, *args)`` in this process (``in_process``) or on ``world`` spawned ranks (:func:`spawn`, each
    marking ``{out}.done{rank}`` when its work is over); what rank 0 wrote to ``out``."""
    if in_process:
        threads = torch.get_num_threads()
        try:
            target(0, *args)
        finally:
            torch.set_num_threads(threads)
    else:
        spawn(target, args, world=world, done=out)
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


def spawn(target: Any, args: tuple[Any, ...], *, world: int, done: Path, start_method: str = "spawn") -> None:
    """``target(rank, *args)`` on ``world`` started ranks, each of which touches ``{done}.done{rank}`` when its work
    is over."""
    import torch.multiprocessing as mp

    # spawn by default: this process has run threads (convert's copier and verifier, the in-process run), and a
    # forked child can inherit a lock one of them held
    try:
        mp.start_processes(target, args=args, nprocs=world, join=True, start_method=start_method)
    except mp.ProcessExitedException as e:
        # gloo's threads can outlive a rank's process group and abort its exit ("terminate called without an
        # active exception", pytorch/pytorch#190489), after the rank is done: only a rank that had not finished
        # is a failure of the run
        finished = all(Path(f"{done}.done{rank}").exists() for rank in range(world))
        if e.signal_name != "SIGABRT" or not finished:
            raise
