"""``ckptfix train``: run the reference trainer; DDP through PyTorch's elastic launcher, as torchrun does."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import click

from ckptfix.cli.render import quiet
from ckptfix.errors import CkptfixError
from ckptfix.trainer.config import MODES, build_parser

# Options ckptfix train declares itself; every other trainer option is passed through unchanged.
_OWN = {"--mode", "--epochs", "--out", "--local-rank"}


def _trainer_options_help() -> str:
    lines = ["\b", "Trainer options (passed through to python -m ckptfix.trainer):"]
    for action in build_parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or flags[0] in _OWN or action.help in (None, argparse.SUPPRESS) or flags[0] == "--help":
            continue
        if action.nargs == 0:
            metavar = ""
        elif action.choices:
            metavar = " " + "|".join(map(str, action.choices))
        else:
            metavar = {int: " N", float: " X"}.get(action.type, " TEXT")  # type: ignore[call-overload]
        lines.append(f"  {flags[0] + metavar:<24} {action.help}")
    return "\n".join(lines)


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog=_trainer_options_help(),
)
@click.option("--mode", type=click.Choice(MODES), default="single", show_default=True, help="Parallelism.")
@click.option("--epochs", type=int, default=2, show_default=True, help="Total epochs.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the checkpoints.")
@click.option(
    "--nproc-per-node",
    default="auto",
    show_default=True,
    help="DDP processes on this node: a number, 'auto' (one per GPU, else 2 sharing the CPU) or 'gpu'.",
)
@click.option("--nnodes", default="1", show_default=True, help="DDP nodes (MIN:MAX for elastic).")
@click.option("--node-rank", type=int, default=None, help="This node's rank (static multi-node setups).")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="Rendezvous for multi-node DDP.")
@click.option("--rdzv-id", default="ckptfix", show_default=True, help="Job id shared by all nodes.")
@click.pass_context
def train(
    ctx: click.Context,
    mode: str,
    epochs: int,
    out: str,
    nproc_per_node: str,
    nnodes: str,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    rdzv_id: str,
) -> None:
    """Train the reference model (single device, nn.DataParallel or DDP) and save checkpoints in OUT.

    \b
    ckptfix train --mode single --epochs 2 --out runs/single
    ckptfix train --mode ddp --nproc-per-node 2 --epochs 2 --out runs/ddp --save-layout wrapped
    ckptfix train --mode ddp --nproc-per-node 2 --epochs 3 --out runs/ddp2 --resume runs/ddp/checkpoint.pt
    Same as: torchrun --nproc-per-node 2 -m ckptfix.trainer --mode ddp --epochs 2 --out runs/ddp
    """
    from ckptfix.trainer.config import parse_args
    from ckptfix.trainer.launch import launch_trainer, launcher_args

    if mode != "ddp":  # the launcher's options mean nothing to a run in one process: asking for them is a mistake
        from ckptfix.errors import UsageError

        for name in ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                flag = "--" + name.replace("_", "-")
                raise UsageError(
                    f"{flag} is for --mode ddp and this run is --mode {mode}; drop {flag} or use --mode ddp"
                )
    argv = ["--mode", mode, "--epochs", str(epochs), "--out", out, *ctx.args]
    config = parse_args(argv, raising=True)
    if mode != "ddp":
        from ckptfix.trainer.loop import train as run_training

        with _quiet_stdout():
            run_training(config)
        return
    import torch

    if config.sync_bn and not torch.cuda.is_available():
        raise CkptfixError(
            "--sync-bn: DDP runs SyncBatchNorm only on GPU modules and this machine has no CUDA device; drop --sync-bn"
        )
    if nproc_per_node == "auto" and not torch.cuda.is_available():
        nproc_per_node = "2"
    launcher = launcher_args(
        nproc_per_node, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id
    )
    with _quiet_stdout():
        launch_trainer(argv, launcher)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Under ``ckptfix -q``, the trainer's progress lines go nowhere, its DDP workers' too (they inherit file
    descriptor 1); errors are on stderr."""
    if not quiet():
        yield
        return
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a test runner's buffer: no worker writes to it
        fd = -1
    saved = os.dup(fd) if fd >= 0 else -1
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        if saved >= 0:
            os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            if saved >= 0:
                os.dup2(saved, fd)
                os.close(saved)


COMMANDS: list[click.Command] = [train]
