"""The training loop, in the order the PyTorch DDP guides teach it.

1. DDP: read RANK/WORLD_SIZE/LOCAL_RANK from the launcher, ``torch.cuda.set_device(local_rank)`` before any
   collective, NCCL on GPUs and gloo on CPU.
2. Seed, build the model, and with ``--resume`` load the checkpoint *before* wrapping (read on rank 0 only and
   broadcast, through :func:`ckptfix.distributed.load_for_ddp`).
3. Wrap (DataParallel or DDP), shard the data with ``DistributedSampler`` and ``set_epoch`` every epoch.
4. Only rank 0 logs and saves (atomically, through :func:`ckptfix.save`); ``--save-per-rank`` aside.
"""

from __future__ import annotations

import inspect
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptfix.errors import CkptfixError, as_flags
from ckptfix.trainer.config import TrainConfig, parse_args

if TYPE_CHECKING:
    import torch
    from torch import nn

CHECKPOINT_NAME = "checkpoint.pt"


def rank_checkpoint_name(rank: int) -> str:
    """File name of rank ``rank``'s own checkpoint under ``--save-per-rank``."""
    return f"checkpoint.rank{rank}.pt"


@dataclass
class Env:
    """Where this process sits in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class TrainResult:
    """What a finished run reports (on every rank; only rank 0 wrote ``checkpoint``)."""

    checkpoint: Path
    epochs_done: int
    steps: int
    loss: float
    val_accuracy: float
    rank: int
    world_size: int


def log(env: Env, message: str) -> None:
    if env.is_main:
        print(f"[ckptfix.trainer] {message}", flush=True)


def ddp_buffer_kwargs(sync: bool) -> dict[str, bool]:
    """DDP's switch for syncing buffers in forward, under the name this torch version uses.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` and deprecated the old name; older
    versions only know ``broadcast_buffers``. The new flag still syncs buffers once at construction, which
    is harmless here: every rank builds (or loads) identical buffers before wrapping.
    """
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: sync}


def setup(config: TrainConfig) -> Env:
    """Start the process group for DDP (a no-op for single and dp); pick the device."""
    import torch
    import torch.distributed as dist

    if config.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, read when its first handle is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cuda = torch.cuda.is_available()
    if config.mode != "ddp":
        return Env(device="cuda" if cuda else "cpu")
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise CkptfixError(
            "--mode ddp: RANK and WORLD_SIZE are not set; start it with 'ckptfix train --mode ddp "
            "--nproc-per-node N ...' or 'torchrun --nproc-per-node N -m ckptfix.trainer ...'"
        )
    if config.sync_bn and not cuda:
        raise CkptfixError(
            "--sync-bn: DDP runs SyncBatchNorm only on GPU modules and this run is on CPU; drop --sync-bn"
        )
    # The old torch.distributed.launch passes --local_rank instead of setting LOCAL_RANK.
    local_rank = config.local_rank
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env = Env(rank=int(os.environ["RANK"]), local_rank=local_rank, world_size=int(os.environ["WORLD_SIZE"]))
    # torchrun sets LOCAL_WORLD_SIZE; older launchers do not, and then this rank's own index is all we know.
    ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE") or local_rank + 1), torch.cuda.device_count() if cuda else 0
    if cuda and gpus < ranks:
        # NCCL needs a GPU of its own for every rank (two ranks on one GPU hang or fail in NCCL's setup).
        if config.sync_bn:
            raise CkptfixError(
                f"--sync-bn: {ranks} ranks on this node and {gpus} GPU(s); SyncBatchNorm needs one GPU per rank: "
                f"use --nproc-per-node {gpus} or drop --sync-bn"
            )
        log(env, f"{ranks} ranks on this node and {gpus} GPU(s): DDP runs on the CPU with gloo")
        cuda = False
    if cuda:
        # Before the first collective: NCCL binds each process to the current device.
        torch.cuda.set_device(local_rank)
        env.device, env.backend = f"cuda:{local_rank}", "nccl"
    else:
        env.backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=env.backend)
    return env


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Any) -> None:
    import torch

    if not isinstance(state, dict):
        return
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        python_state = state["python"]
        random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _resume(config: TrainConfig, model: nn.Module, env: Env) -> dict[str, Any]:
    """Load ``--resume`` into the unwrapped model; return the checkpoint's other entries on every rank."""
    import ckptfix
    from ckptfix.loading.model import primary_entry

    path = config.resume
    if path is None:
        return {}
    if config.mode == "ddp":
        from ckptfix.distributed import load_for_ddp

        return load_for_ddp(model, path, src=0, strict=True, allow_globals=tuple(config.allow_globals))
    obj = ckptfix.load(path, allow_globals=tuple(config.allow_globals))
    ckptfix.load_into(model, obj, strict=True, source=str(path))
    # As load_for_ddp returns them: everything but the model entry that was loaded (an EMA copy stays).
    primary = primary_entry(obj)
    return {k: v for k, v in obj.items() if k != primary} if primary else {}


def evaluate(model: nn.Module, dataset: Any, *, device: str, batch_size: int = 256) -> float:
    """Accuracy of ``model`` (eval mode) on ``dataset``."""
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    images, labels = dataset.tensors
    with torch.no_grad():
        for start in range(0, len(labels), batch_size):
            logits = model(images[start : start + batch_size].to(device))
            correct += int((logits.argmax(1).cpu() == labels[start : start + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, len(labels))


def train(config: TrainConfig) -> TrainResult:
    """Run one training job in this process (one rank of it under DDP)."""
    import torch
    import torch.distributed as dist

    env = setup(config)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if config.deterministic:
        torch.use_deterministic_algorithms(True)
    if env.device == "cpu":
        # This model is tiny: intra-op threads cost more than they save (5x slower with 2 threads on 2
        # busy cores). OMP_NUM_THREADS overrides it, as torchrun sets it for each DDP worker.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
    try:
        result = _train(config, env)
        if config.mode == "ddp" and dist.is_initialized():
            # Every rank leaves together: rank 0's last save is complete, and no rank tears the group down while
            # another still uses it (a rank that did left gloo aborting in teardown, 3 runs in 12 here).
            dist.barrier()
        return result
    finally:
        # A caller's process (a test, a notebook) gets its own settings back.
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        if config.mode == "ddp" and dist.is_initialized():
            dist.destroy_process_group()


def _build(config: TrainConfig, env: Env) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """The plain model, its wrapper (the model itself in single mode) and the resumed checkpoint's entries."""
    import torch
    from torch import nn

    from ckptfix.trainer.model import build_model

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model = build_model(norm=config.norm, width=config.width).to(env.device)
    # Before wrapping: DDP's constructor broadcasts rank 0's weights, and loading into the plain model keeps
    # the checkpoint's keys free of the wrapper's "module." prefix.
    extra = _resume(config, model, env)
    if config.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
    if config.mode == "dp":
        return model, nn.DataParallel(model), extra
    if config.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [env.local_rank] if env.device.startswith("cuda") else None
        buffers: dict[str, Any] = ddp_buffer_kwargs(config.buffer_sync)
        ddp = DistributedDataParallel(model, device_ids=device_ids, **buffers)
        return model, ddp, extra
    return model, model, extra


def _train(config: TrainConfig, env: Env) -> TrainResult:
    out = Path(config.out)
    # Every rank: on a multi-node run, per-rank files land on each node's own disk.
    out.mkdir(parents=True, exist_ok=True)
    run, extra = _prepare(config, env)
    start_epoch, step = _restore(run.optimizer, extra, steps_per_epoch=len(run.loader))
    _log_start(config, env, run, start_epoch=start_epoch, step=step)
    loss_value, accuracy, step = _epochs(config, env, run, start_epoch=start_epoch, step=step)
    if config.epochs <= start_epoch:
        log(env, f"nothing to do: {start_epoch} epochs are done and --epochs is {config.epochs}")
    else:
        log(env, f"saved {out / CHECKPOINT_NAME}")
    return TrainResult(out / CHECKPOINT_NAME, config.epochs, step, loss_value, accuracy, env.rank, env.world_size)


@dataclass
class _Run:
    """What the epochs of one training job work with."""

    model: nn.Module  # the plain model: evaluated and (in the single layout) saved
    wrapped: nn.Module  # what the steps run (DataParallel, DDP, or the model itself)
    optimizer: torch.optim.Optimizer
    sampler: Any  # a DistributedSampler
    loader: Any  # a DataLoader over the training set
    val_set: Any
    schedule: _Schedule


def _prepare(config: TrainConfig, env: Env) -> tuple[_Run, dict[str, Any]]:
    """The model (resumed and wrapped), the data, the schedule and the optimizer; the resumed checkpoint's entries."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from ckptfix.trainer.data import VAL_SEED, make_dataset

    model, wrapped, extra = _build(config, env)
    train_set = make_dataset(config.samples)
    val_set = make_dataset(config.val_samples, seed=VAL_SEED)
    # One sampler for every mode: the shuffle order depends only on (seed, epoch), so a resumed run and a
    # single-process run see exactly the batches a DDP run's ranks see together.
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=config.seed
    )
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler)
    scale = env.world_size if config.scale_lr else 1
    schedule = _Schedule(config.lr * scale, round(config.warmup_epochs * len(loader)))
    optimizer = torch.optim.SGD(
        model.parameters(), lr=schedule.base_lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    return _Run(model, wrapped, optimizer, sampler, loader, val_set, schedule), extra


def _restore(optimizer: torch.optim.Optimizer, extra: dict[str, Any], *, steps_per_epoch: int) -> tuple[int, int]:
    """The optimizer and RNG state of a resumed checkpoint restored; the epoch and global step to go on from."""
    start_epoch, step = 0, 0
    if extra:
        if "optimizer" in extra:
            optimizer.load_state_dict(extra["optimizer"])
        start_epoch = int(extra.get("epoch", 0))
        step = int(extra.get("step", start_epoch * steps_per_epoch))
        _set_rng_state(extra.get("rng"))
    return start_epoch, step


def _log_start(config: TrainConfig, env: Env, run: _Run, *, start_epoch: int, step: int) -> None:
    import torch

    where = f"{env.world_size} processes, {env.backend} backend" if config.mode == "ddp" else "1 process"
    if config.mode == "dp" and env.device == "cuda":
        where += f", batch split over {torch.cuda.device_count()} GPUs"
    params = sum(p.numel() for p in run.model.parameters())
    log(env, f"mode {config.mode} ({where}) on {env.device}; {params} params")
    log(
        env,
        f"batch size {config.batch_size} per process, global batch {config.batch_size * env.world_size}; "
        f"{len(run.loader)} steps/epoch",
    )
    lr_note = f" (= {config.lr} x {env.world_size}, linear scaling)" if config.scale_lr else ""
    log(env, f"lr {run.schedule.base_lr:g}{lr_note}; warm-up {run.schedule.warmup_steps} steps")
    if config.resume:
        log(env, f"resumed from {config.resume} at epoch {start_epoch}, step {step}")


def _epochs(config: TrainConfig, env: Env, run: _Run, *, start_epoch: int, step: int) -> tuple[float, float, int]:
    """Train from ``start_epoch`` to ``--epochs``, saving after each; the last epoch's loss and val accuracy (NaN
    if none ran) and the global step reached."""
    import torch
    import torch.distributed as dist

    loss_value, accuracy = float("nan"), float("nan")
    for epoch in range(start_epoch, config.epochs):
        run.sampler.set_epoch(epoch)
        started = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64, device=env.device)
        for batch in run.loader:
            step = _step(run.wrapped, run.optimizer, batch, env=env, schedule=run.schedule, step=step, totals=totals)
            if config.log_every and step % config.log_every == 0:
                log(env, f"step {step} loss {float(totals[0] / totals[1]):.4f} (epoch mean so far)")
        if config.mode == "ddp":
            dist.all_reduce(totals)
        loss_value = float(totals[0] / totals[1])
        if env.is_main:
            # The plain module, not the wrapper: DDP's forward may start a buffer broadcast the other
            # ranks would never join.
            accuracy = evaluate(run.model, run.val_set, device=env.device)
        took = time.perf_counter() - started
        log(env, f"epoch {epoch + 1}/{config.epochs} loss {loss_value:.4f} val acc {accuracy:.3f} ({took:.1f}s)")
        _save(config, env, run.model, run.wrapped, run.optimizer, epoch=epoch + 1, step=step)
    return loss_value, accuracy, step


@dataclass(frozen=True)
class _Schedule:
    base_lr: float
    warmup_steps: int

    def lr(self, step: int) -> float:
        # A pure function of the global step, so a resumed run continues the schedule exactly.
        if self.warmup_steps <= 0:
            return self.base_lr
        return self.base_lr * min(1.0, (step + 1) / self.warmup_steps)


def _step(
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[torch.Tensor],
    *,
    env: Env,
    schedule: _Schedule,
    step: int,
    totals: torch.Tensor,
) -> int:
    """One optimizer step; adds (loss sum, sample count) to ``totals``; returns the new global step."""
    import torch
    from torch.nn import functional

    images, labels = batch[0].to(env.device), batch[1].to(env.device)
    for group in optimizer.param_groups:
        group["lr"] = schedule.lr(step)
    optimizer.zero_grad(set_to_none=True)
    loss = functional.cross_entropy(wrapped(images), labels)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    count = torch.tensor(len(labels), dtype=torch.float64, device=env.device)
    totals += torch.stack([loss.detach().double() * count, count])
    return step + 1


def _save(
    config: TrainConfig,
    env: Env,
    model: nn.Module,
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    step: int,
) -> None:
    """Rank 0 writes the full checkpoint; with ``--save-per-rank`` every rank also writes its own model."""
    import torch

    import ckptfix

    out = Path(config.out)
    # "single" is what the guides advise (model.module.state_dict()); "wrapped" is what many scripts do.
    state = wrapped.state_dict() if config.save_layout == "wrapped" else model.state_dict()
    meta = {"epoch": epoch, "step": step, "world_size": env.world_size, "mode": config.mode}
    if env.is_main:
        full = {"model": state, "optimizer": optimizer.state_dict(), **meta, "rng": _rng_state()}
        full["config"] = config.to_dict()
        full["torch_version"] = str(torch.__version__)
        ckptfix.save(full, out / CHECKPOINT_NAME)
    if config.save_per_rank:
        ckptfix.save({"model": state, **meta, "rank": env.rank}, out / rank_checkpoint_name(env.rank))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckptfix.trainer``: run, and turn ckptfix errors into one line and an exit code."""
    try:
        train(parse_args(argv))
    except CkptfixError as e:
        print(f"ckptfix.trainer: error: {as_flags(str(e))}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0
