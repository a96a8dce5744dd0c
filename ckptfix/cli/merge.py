"""``ckptfix merge``: one checkpoint from the per-rank checkpoints of a DDP run."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from ckptfix.cli.options import force_option, model_from_options, safety_options, to_option
from ckptfix.cli.render import LIST_LIMIT, echo, echo_json, section, warn
from ckptfix.keytree import group_keys

if TYPE_CHECKING:
    from ckptfix.merging import MergeResult

# ckptfix.merging's BUFFER_STRATEGIES, spelled out so that --help does not import the merge (tests/test_cli.py)
BUFFER_STRATEGIES = ("pooled", "mean", "rank0")


@click.command()
@click.argument("inputs", metavar="RANK0 RANK1 …", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Merged checkpoint.")
@to_option("Output key layout.")
@click.option(
    "--buffers",
    type=click.Choice(BUFFER_STRATEGIES),
    default="pooled",
    show_default=True,
    help="BatchNorm statistics: pooled (mean of means; mean of variances plus variance of means), mean, rank0.",
)
@click.option("--atol", type=float, default=0.0, show_default=True, help="Allowed |Δ| between ranks' parameters.")
@click.option("--model", "model_spec", metavar="MOD:FACTORY", help="Tells buffers from parameters (see below).")
@click.option("--kwargs", metavar="JSON", help="Keyword arguments for the --model factory, as a JSON object.")
@click.option("--model-only", is_flag=True, help="Write only the merged model state dict; drop RANK0's other entries.")
@click.option("--json", "as_json", is_flag=True, help="Print the merge report as JSON.")
@force_option
@safety_options
def merge(
    inputs: tuple[str, ...],
    out: str,
    to: str,
    buffers: str,
    atol: float,
    model_spec: str | None,
    kwargs: str | None,
    model_only: bool,
    as_json: bool,
    overwrite: bool,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
) -> None:
    """Merge per-rank checkpoints of one DDP run (buffer sync off), or the rank files of an FSDP2 run, into OUT.

    Parameters must be equal on every rank (within --atol), else nothing is written and the differing keys
    are listed. BatchNorm running statistics are merged per --buffers; num_batches_tracked is kept, or the
    maximum when ranks differ. Other buffers must be equal; with --model, floating ones that differ follow
    --buffers (pooled and mean both average them). Non-model entries (epoch, optimizer, …) come from RANK0
    (--model-only drops them). Key by key, each read from every file and written at once: memory holds a few
    tensors, not the files. Inputs may be folders or index files (per-rank transformers or accelerate folders).

    FSDP2 rank files (each rank's torch.save(model.state_dict()), DTensor shards) are reassembled, not averaged:
    every rank's file must be given, and the shards must tile each tensor exactly (Shard(dim) on a 1-D or 2-D
    mesh, Replicate). Entries RANK0 holds that were not loaded (classes outside the allowlist) are copied as their
    pickle records into a .pt OUT, refused if they can run code or OUT is .safetensors: --model-only leaves them out.

    \b
    Exit codes: 0 merged; 1 ranks disagree (nothing written); 2 an input or OUT cannot be used.
    Example: ckptfix merge ckpt_rank0.pt ckpt_rank1.pt -o merged.pt --to single
    Example: ckptfix merge fsdp2_rank0.pt fsdp2_rank1.pt -o full.safetensors
    """
    from ckptfix.errors import MergeError
    from ckptfix.formats.atomic import check_output
    from ckptfix.merging import merge_files

    check_output(out, inputs=inputs, overwrite=overwrite)
    for j, later in enumerate(inputs):
        for earlier in inputs[:j]:
            if os.path.realpath(later) == os.path.realpath(earlier):
                warn(f"{later} is given twice; the same file counts as two ranks")
    buffer_keys = _buffer_keys(model_spec, kwargs) if model_spec else []
    result = merge_files(
        inputs,
        out,
        buffers=buffers,
        atol=atol,
        to=to,
        buffer_keys=buffer_keys,
        allow_globals=allow_globals,
        unsafe=unsafe_pickle,
        model_only=model_only,
        overwrite=overwrite,
    )
    for message in result.warnings:
        warn(message)
    if as_json:
        echo_json({**result.to_dict(), "output": out, "written": not result.diverged})
    elif result.diverged:
        echo(f"{len(result.diverged)} key(s) differ across ranks (atol {atol:g}):")
        for d in result.diverged[:LIST_LIMIT]:
            echo(f"  {d.key}  max |Δ| {d.max_abs:.3g}  on {', '.join(d.ranks)} (vs {inputs[0]})")
        section("  and", [d.key for d in result.diverged[LIST_LIMIT:]])
    else:
        _summary(result, inputs, out, to=to, buffers=buffers)
    if result.diverged:
        raise MergeError(
            f"{out}: not written: {len(result.diverged)} key(s) differ across ranks (e.g. "
            f"'{result.diverged[0].key}'); use files of the same step, or --atol if the drift is expected"
        )


def _summary(result: MergeResult, inputs: tuple[str, ...], out: str, *, to: str, buffers: str) -> None:
    echo(f"merged {len(inputs)} rank file(s) (layouts: {', '.join(sorted(set(result.layouts_from)))})")
    if result.reassembled:
        ways = sorted(set(result.reassembled.values()))
        echo(
            f"reassembled {len(result.reassembled)} DTensor tensor(s) from every rank's shards ({'; '.join(ways)}): "
            f"full tensors, not averaged"
        )
    if result.bn_modules:
        groups = group_keys(result.bn_modules)
        echo(f"BatchNorm statistics ({buffers}): {len(result.bn_modules)} module(s): {'; '.join(groups)}")
    if result.buffers_merged:
        echo(f"other buffers ({buffers}): {'; '.join(group_keys(result.buffers_merged))}")
    echo("parameters: equal on every rank")
    if result.kept_from_first:
        echo(f"taken from {inputs[0]}: {', '.join(result.kept_from_first)}")
    if result.left_out:
        echo(f"left out (--model-only): {', '.join(result.left_out)}")
    for note in result.notes:
        echo(note)
    echo(f"wrote {out} (layout {to})")


def _buffer_keys(model_spec: str, kwargs: str | None) -> list[str]:
    """Names of the model's buffers in the single layout."""
    from ckptfix import layouts
    from ckptfix.checkpoint import apply_maps

    model = model_from_options(model_spec, kwargs)
    # The layout is read from every key: buffers alone may all sit under a submodule that is named `module`.
    _, maps = layouts.conversion_maps(list(model.state_dict()), to="single", source="model")
    return list(apply_maps(dict(model.named_buffers()), maps, source="model"))


COMMANDS: list[click.Command] = [merge]
