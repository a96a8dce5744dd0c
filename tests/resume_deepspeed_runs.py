"""DeepSpeed ZeRO runs that resume elsewhere: :class:`~tests.resume_runs.ResumeNet` trained by a ZeRO-1/2/3 engine
on 2 gloo ranks (DeepSpeed's CPU accelerator), then resumed from ``ckptfix convert``'s output on one device, DDP
or FSDP2.

``train`` runs ``python -m tests.resume_deepspeed_runs`` once per rank (a process each, as
:func:`tests.deepspeed_runs.make_run` does: DeepSpeed reads its rank from the environment). The engine wraps
torch's own ``AdamW`` (the client optimizer, two param groups as :func:`tests.resume_runs.optimizer` builds them,
weights decayed, norms and biases not), takes ``STEPS`` steps on :func:`tests.resume_runs.batch`'s global batches
and saves with ``engine.save_checkpoint``. It then records what DeepSpeed holds for each parameter, through
DeepSpeed's own API (``safe_get_full_optimizer_state`` gathers a moment from every rank's partition; the step is
the base optimizer's, one per flat group), takes ``MORE`` steps and records their losses.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests import deepspeed_runs, resume_runs
from tests.resume_runs import BATCH, MORE, OPTIMIZERS, STEPS, _wrap, batch, build, go_on, held, optimizer, scheduler


def train(out: Path, *, stage: int, record: Path, dtype: str = "fp32", kind: str = "adamw", world: int = 2,
          timeout: float = 600.0) -> dict[str, Any]:  # fmt: skip
    """Train a ZeRO-``stage`` run (``dtype`` fp32 or bf16; ``kind`` one of :data:`tests.resume_runs.OPTIMIZERS`)
    into ``out`` (a DeepSpeed run folder); what rank 0 recorded into ``record``."""
    args = ["-m", "tests.resume_deepspeed_runs", str(out), str(record), "--stage", str(stage), "--dtype", dtype,
            "--optimizer", kind]  # fmt: skip
    deepspeed_runs.launch(args, world=world, done=record, what=f"deepspeed run (stage {stage}, {dtype})",
                          timeout=timeout)  # fmt: skip
    return torch.load(record, weights_only=True)  # type: ignore[no-any-return]


def _groups(model: nn.Module, kind: str) -> list[dict[str, Any]]:
    """:func:`tests.resume_runs.optimizer`'s groups, of plain parameters (DeepSpeed's ZeRO optimizers take no
    (name, parameter) pairs); its hyperparameters from the same call."""
    named = optimizer(kind, model).param_groups
    return [{k: v for k, v in g.items() if k != "param_names"} for g in named]


def _worker(out: Path, record: Path, *, stage: int, dtype: str, kind: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(0)
    groups = _groups(model, kind)
    group_of = {name: next(i for i, g in enumerate(groups) if any(q is p for q in g["params"]))
                for name, p in model.named_parameters()}  # fmt: skip  # DeepSpeed replaces the groups' lists
    opt = torch.optim.AdamW(groups) if kind == "adamw" else torch.optim.SGD(groups)  # each group says its own
    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": dtype == "bf16"},
              "steps_per_print": 10**9}  # fmt: skip
    # the client's scheduler, stepped by the engine; saved by save_checkpoint as "lr_scheduler"
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, lr_scheduler=scheduler(opt))

    def step(i: int) -> float:
        x, y = batch(i, rank, world)
        if dtype == "bf16":  # the engine holds bf16 weights (the fp32 masters in the optimizer)
            x = x.bfloat16()
        loss = (engine(x).float() - y).square().mean()
        engine.backward(loss)
        engine.step()
        seen = loss.detach().clone()
        dist.all_reduce(seen)
        return float(seen / world)

    for i in range(STEPS):
        step(i)
    # what a training script keeps in client_state: the random stream (DeepSpeed saves none of its own)
    engine.save_checkpoint(str(out), client_state={"rng": torch.get_rng_state(), "epoch": 1})
    draws = torch.randint(9, (4,))  # the stream a resumed run must go on with (the steps draw nothing from it)
    schedule, progress = engine.lr_scheduler.state_dict(), [engine.global_steps, 1]
    # what DeepSpeed holds for each parameter: each moment gathered from the ranks' partitions by DeepSpeed itself
    base = engine.optimizer.optimizer  # the client optimizer, stepping the flat fp32 partitions
    zero = engine.optimizer
    if stage < 3:  # a flat fp32 partition per param group
        flats = dict(enumerate(zero.single_partition_of_fp32_groups))
    else:  # ZeRO-3 empties the groups' params between steps: its sub-groups' flat partitions, each in a group
        flats = {zero.sub_group_to_group_id[i]: f for i, f in enumerate(zero.fp32_partitioned_groups_flat)}
    steps = {g: base.state[f]["step"].clone() for g, f in flats.items() if "step" in base.state[f]}  # SGD has none
    if stage < 3:
        # DeepSpeed 0.19.8's ZeRO-1/2 links each parameter to its moments once, after the first group's first step,
        # when the later groups have no state yet (safe_get_full_optimizer_state then raises "exp_avg not found"):
        # linked again, by DeepSpeed's own method, now that every group has stepped
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state = {}
    for name, p in model.named_parameters():
        keys = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
        moments = {k: safe_get_full_optimizer_state(p, k).detach().clone() for k in keys}
        state[name] = {**moments, **({"step": steps[group_of[name]]} if steps else {})}
    hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in base.param_groups]
    losses = [step(STEPS + i) for i in range(MORE)]
    if rank == 0:
        torch.save({"held": {"state": state, "groups": hyper, "scheduler": schedule, "draws": draws,
                             "progress": progress}, "losses": losses}, record)  # fmt: skip
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    Path(f"{record}.done{rank}").touch()  # this rank's work is over (tests.deepspeed_runs.launch)


def resume(rank: int, world: int, store: str, setup: str, path: str, out: str, kind: str) -> None:
    """One rank of a resumed run: ``setup`` ``single``/``ddp`` load a ``.pt`` (``optimizer.load_state_dict``),
    ``fsdp2`` a DCP folder (``set_state_dict``); rank 0 writes what it holds and the next ``MORE`` losses."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if setup != "single":
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = build(99)  # every value must come from the checkpoint
        if setup == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            wrapped = _wrap(setup, model, world)
            opt = optimizer(kind, wrapped)
            sched = scheduler(opt)
            model_state, optim_state = get_state_dict(wrapped, opt)
            saved = {"model": model_state, "optimizer": optim_state, "lr_scheduler": sched.state_dict(),
                     "rng": torch.get_rng_state(), "global_steps": 0, "epoch": 0}  # fmt: skip
            dcp.load(saved, checkpoint_id=path)
            set_state_dict(wrapped, opt, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
        else:
            saved = torch.load(path, weights_only=True)
            model.load_state_dict(saved["model"])
            opt = optimizer(kind, model)
            opt.load_state_dict(saved["optimizer"])
            sched = scheduler(opt)
            wrapped = _wrap(setup, model, world)
        sched.load_state_dict(saved["lr_scheduler"])
        torch.set_rng_state(saved["rng"])
        held_now = {**held(setup, wrapped, opt), "scheduler": sched.state_dict(), "draws": torch.randint(9, (4,)),
                    "progress": [saved["global_steps"], saved["epoch"]]}  # fmt: skip
        result = {"held": held_now, "losses": go_on(wrapped, opt, sched, rank, world)}
        if rank == 0:
            torch.save(result, out)
        if setup != "single":
            dist.barrier()
    finally:
        if setup != "single":
            dist.destroy_process_group()
    Path(f"{out}.done{rank}").touch()  # this rank's work is over (as tests/resume_runs.py's run marks it)


def launch(setup: str, *, path: str, out: Path, kind: str = "adamw") -> dict[str, Any]:
    """Resume ``setup`` from ``path`` (``single`` in this process, the others on 2 spawned ranks)."""
    world = 1 if setup == "single" else 2
    args = (world, str(out.parent / f"{out.stem}.store"), setup, path, str(out), kind)
    return resume_runs.run_ranks(resume, args, in_process=setup == "single", world=world, out=out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("record", type=Path)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    args = parser.parse_args()
    _worker(args.out, args.record, stage=args.stage, dtype=args.dtype, kind=args.optimizer)


if __name__ == "__main__":
    main()
