"""The trainer's options: one dataclass, one argparse parser (torchrun passes ``--local-rank`` to it).

Stdlib only, so ``ckptfix train`` can check options before it starts any process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ckptfix.errors import CkptfixError

MODES = ("single", "dp", "ddp")
SAVE_LAYOUTS = ("single", "wrapped")


@dataclass
class TrainConfig:
    """Everything a run depends on; stored in every checkpoint as a plain dict under ``config``."""

    out: str
    mode: str = "single"
    epochs: int = 2
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    scale_lr: bool = False
    warmup_epochs: float = 0.0
    samples: int = 2048
    val_samples: int = 512
    seed: int = 0
    norm: str = "batch"
    width: int = 8
    sync_bn: bool = False
    buffer_sync: bool = True
    save_per_rank: bool = False
    save_layout: str = "single"
    resume: str | None = None
    allow_globals: list[str] = field(default_factory=list)
    deterministic: bool = False
    log_every: int = 0
    local_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (weights-only loadable) of the options that shape the run."""
        out = dataclasses.asdict(self)
        out.pop("local_rank")
        return out


class _RaisingParser(argparse.ArgumentParser):
    # Under ``ckptfix train`` a bad option must become the CLI's one-line error, not argparse's exit.
    def error(self, message: str) -> NoReturn:
        raise CkptfixError(f"trainer options: {message}; see 'python -m ckptfix.trainer --help'")


def build_parser(*, raising: bool = False) -> argparse.ArgumentParser:
    """The argparse parser of ``python -m ckptfix.trainer`` / ``torchrun -m ckptfix.trainer``."""
    p = (_RaisingParser if raising else argparse.ArgumentParser)(
        prog="python -m ckptfix.trainer",
        description="Reference trainer: single device, nn.DataParallel, or DDP (one process per device).",
        epilog="DDP: torchrun --nproc-per-node 2 -m ckptfix.trainer --mode ddp --out runs/ddp",
    )
    p.add_argument("--out", required=True, help="folder for checkpoint.pt (and checkpoint.rank<N>.pt)")
    p.add_argument("--mode", choices=MODES, default=None, help="default: ddp under torchrun, else single")
    p.add_argument("--epochs", type=int, default=2, help="total epochs (a resumed run counts the done ones)")
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate for one process's batch")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=0.0, help="SGD weight decay")
    p.add_argument("--scale-lr", action="store_true", help="linear scaling: lr x world size (Goyal et al.)")
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear LR warm-up length in epochs")
    p.add_argument("--samples", type=int, default=2048, help="training set size")
    p.add_argument("--val-samples", type=int, default=512, help="validation set size")
    p.add_argument("--seed", type=int, default=0, help="model init and shuffling seed")
    p.add_argument("--norm", choices=("batch", "none"), default="batch", help="BatchNorm or no norm layer")
    p.add_argument("--width", type=int, default=8, help="channels of the first conv layer")
    p.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (DDP on GPU)")
    p.add_argument(
        "--no-buffer-sync",
        dest="buffer_sync",
        action="store_false",
        help="DDP: each rank keeps its own BatchNorm statistics (no forward buffer sync)",
    )
    p.add_argument("--save-per-rank", action="store_true", help="every rank writes checkpoint.rank<N>.pt")
    p.add_argument(
        "--save-layout",
        choices=SAVE_LAYOUTS,
        default="single",
        help="single: model.module.state_dict() (default); wrapped: the wrapper's state_dict()",
    )
    p.add_argument("--resume", default=None, help="checkpoint of any layout and format to continue from")
    p.add_argument(
        "--allow-global",
        dest="allow_globals",
        action="append",
        default=[],
        help="pickle global the --resume checkpoint may use (e.g. argparse.Namespace); repeatable",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="bitwise-repeatable runs and resumes, GPUs included: deterministic kernels and a fixed cuBLAS workspace",
    )
    p.add_argument("--log-every", type=int, default=0, help="also log every N steps (0: once per epoch)")
    # torchrun sets LOCAL_RANK; the old torch.distributed.launch passes --local_rank (or --local-rank).
    p.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None, *, raising: bool = False) -> TrainConfig:
    """Parse trainer arguments into a checked :class:`TrainConfig` (``raising``: CkptfixError, not exit 2)."""
    ns = build_parser(raising=raising).parse_args(argv)
    values = vars(ns)
    if values["mode"] is None:
        values["mode"] = "ddp" if "WORLD_SIZE" in os.environ else "single"
    config = TrainConfig(**values)
    check_config(config)
    return config


def check_config(config: TrainConfig) -> None:
    """Refuse option combinations that cannot work, before any process or collective starts."""
    if config.mode not in MODES:
        raise CkptfixError(f"--mode '{config.mode}': choose one of {', '.join(MODES)}")
    if config.save_layout not in SAVE_LAYOUTS:
        raise CkptfixError(f"--save-layout '{config.save_layout}': choose one of {', '.join(SAVE_LAYOUTS)}")
    for name in ("epochs", "batch_size", "samples", "val_samples", "width"):
        if getattr(config, name) < 1:
            raise CkptfixError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(config, name)})")
    if config.sync_bn and config.mode != "ddp":
        raise CkptfixError("--sync-bn: SyncBatchNorm only works under DDP; use it with --mode ddp or drop it")
    if config.sync_bn and config.norm != "batch":
        raise CkptfixError("--sync-bn: the model has no BatchNorm (--norm none); drop one of the two options")
    if (config.save_per_rank or not config.buffer_sync) and config.mode != "ddp":
        raise CkptfixError("--save-per-rank and --no-buffer-sync are DDP options; use them with --mode ddp")
