"""``ckptfix merge``: one checkpoint from the per-rank checkpoints of a DDP run."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from ckptfix.cli.export_hf import refuse_hf_only
from ckptfix.cli.options import (
    architecture_option,
    force_option,
    json_option,
    model_from_options,
    safety_options,
    to_option,
    tolerance_option,
)
from ckptfix.cli.render import LIST_LIMIT, Output, echo, section, warn
from ckptfix.keytree import group_keys

if TYPE_CHECKING:
    from ckptfix.merging.files import MergeResult
    from ckptfix.transforms.checkpoint import Conversion

# ckptfix.merging.files's BUFFER_STRATEGIES, spelled out so that --help does not import the merge
# (tests/cli/test_group.py)
BUFFER_STRATEGIES = ("pooled", "mean", "rank0")


@click.command()
@click.argument("inputs", metavar="RANK0 RANK1 …", nargs=-1, required=True, type=click.Path())
@click.option(
    "-o", "--output", "out", required=True, type=click.Path(), help="Merged checkpoint (a folder with --format hf)."
)
@to_option("Output key layout.")
@click.option(
    "--buffers",
    type=click.Choice(BUFFER_STRATEGIES),
    default="pooled",
    show_default=True,
    help="BatchNorm statistics: pooled (mean of means; mean of variances plus variance of means), mean, rank0.",
)
@tolerance_option("--atol", "Allowed |Δ| between ranks' parameters.")
@click.option(
    "--model",
    "model_spec",
    metavar="MOD:FACTORY",
    help="The model that was trained: tells buffers from parameters, and splits FSDP1 flat parameters (see below).",
)
@click.option("--kwargs", metavar="JSON", help="Keyword arguments for the --model factory, as a JSON object.")
@click.option("--model-only", is_flag=True, help="Write only the merged model state dict; drop RANK0's other entries.")
@click.option(
    "--optimizer",
    is_flag=True,
    help="FSDP1 SHARDED_STATE_DICT rank files into a .pt: consolidate their sharded optimizer state "
    "(FSDP.optim_state_dict) into the full one, keyed by parameter name (off by default: it can be several times "
    "the model, and is left out with a note).",
)
@click.option(
    "--average",
    is_flag=True,
    help="Average checkpoints of one model (other steps or runs): floating tensors are the mean, the rest is the "
    "last file's.",
)
@click.option(
    "--weights",
    metavar="W1,W2,…",
    callback=lambda ctx, param, value: _parse_weights(value),
    help="Weighted average (implies --average): one weight per file, divided by their sum.",
)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["hf"]),
    help="hf: write the merged model as a folder transformers' from_pretrained loads (config.json and the rest from "
    "--config-from, else RANK0's folder, then its parent), as convert --format hf does.",
)
@click.option(
    "--config-from", metavar="DIR", type=click.Path(), help="--format hf: the folder of the model's config.json."
)
@architecture_option
@click.option(
    "--verify",
    "verify_hf",
    is_flag=True,
    help="--format hf: load OUT with transformers and compare logits on a fixed input with the merged weights.",
)
@json_option("Print the merge report as JSON.")
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
    optimizer: bool,
    average: bool,
    weights: list[float] | None,
    output: Output,
    overwrite: bool,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
    out_format: str | None = None,
    config_from: str | None = None,
    architecture: str | None = None,
    verify_hf: bool = False,
) -> None:
    """Merge per-rank checkpoints of one DDP run (buffer sync off), or the rank files of an FSDP2 run, into OUT.

    Parameters must be equal on every rank (within --atol), else nothing is written and the differing keys
    are listed. BatchNorm running statistics are merged per --buffers; num_batches_tracked is kept, or the
    maximum when ranks differ. Other buffers must be equal; with --model, floating ones that differ follow
    --buffers (pooled and mean both average them). Non-model entries (epoch, optimizer, …) come from RANK0
    (--model-only drops them). Key by key, each read from every file and written at once: memory holds a few
    tensors, not the files. Inputs may be folders or index files (per-rank transformers or accelerate folders).
    Files that record their rank (FSDP rank files; DDP files holding "rank" and "world_size" entries, as ckptfix's
    trainer saves them) are taken as those ranks, in any order given; otherwise RANK0 is the first given (DDP
    itself records no rank). --buffers rank0 keeps the statistics of rank 0's file.

    FSDP2 rank files (each rank's torch.save(model.state_dict()), DTensor shards) are reassembled, not averaged:
    every rank's file must be given, and the shards must tile each tensor exactly (Shard(dim) on a 1-D or 2-D
    mesh, Replicate), and so are FSDP1 SHARDED_STATE_DICT rank files (ShardedTensors). FSDP1 LOCAL_STATE_DICT rank
    files (flat parameters) need --model, the model that was wrapped: it says which parameters each flat parameter
    joins (the file does not), and OUT holds FULL_STATE_DICT's keys. FSDP1 sharded optimizer state
    (FSDP.optim_state_dict under SHARDED_STATE_DICT) is left out, said in a note, unless --optimizer consolidates
    it (a .pt OUT; rank files holding the optimizer state alone too). Entries RANK0 holds that were not
    loaded (classes outside the allowlist) are copied as their pickle records into a .pt OUT, refused if they can
    run code or OUT is .safetensors: --model-only leaves them out.

    --average (or --weights) averages checkpoints of one model from different steps or runs instead (checkpoint
    averaging, model soups): every floating tensor is the mean, weighted by --weights (divided by their sum),
    computed in float64 and stored in its dtype; integer tensors (num_batches_tracked) and every other entry come
    from the last file. Keys, shapes and dtypes must match. Streamed: one tensor of one file at a time.

    \b
    Exit codes: 0 merged; 1 ranks disagree (nothing written); 2 an input or OUT cannot be used.
    Example: ckptfix merge ckpt_rank0.pt ckpt_rank1.pt -o merged.pt --to single
    Example: ckptfix merge fsdp2_rank0.pt fsdp2_rank1.pt -o full.safetensors
    Example: ckptfix merge fsdp2_rank0.pt fsdp2_rank1.pt -o hf_model/ --format hf
    Example: ckptfix merge fsdp1_rank0.pt fsdp1_rank1.pt -o full.pt --optimizer
    Example: ckptfix merge local0.pt local1.pt -o full.pt --model mypkg.models:build_model
    Example: ckptfix merge step8000.pt step9000.pt step10000.pt -o avg.pt --average
    Example: ckptfix merge soup_a.safetensors soup_b.safetensors -o soup.safetensors --weights 0.3,0.7
    """
    params = click.get_current_context().params  # every option as given, for the checks and the library's options
    averaging = average or weights is not None
    _check(params, averaging=averaging)
    model = _model(model_spec, kwargs) if model_spec else None
    options = _options(params, model)
    exported = None
    if out_format == "hf":
        from ckptfix.exporting.folder import merge_to_hf

        result, exported = merge_to_hf(
            inputs, out, config_from=config_from, architecture=architecture, verify=verify_hf, **options
        )
    else:
        from ckptfix.merging.files import merge_files

        result = merge_files(inputs, out, to=to, model_only=model_only, optimizer=optimizer, **options)
    _report(result, exported, inputs, out, output=output, to=to, buffers=buffers, atol=atol, averaging=averaging)


def _check(params: dict[str, Any], *, averaging: bool) -> None:
    """Before any file is read: --kwargs without --model refused, an input given twice warned of, the options of
    --format hf given without it (or --optimizer with it) refused."""
    if params["kwargs"] is not None and params["model_spec"] is None:
        from ckptfix.errors import UsageError

        raise UsageError("--kwargs are the --model factory's and no --model was given; add --model or drop --kwargs")
    inputs = params["inputs"]
    for j, later in enumerate(inputs):
        for earlier in inputs[:j]:
            if os.path.realpath(later) == os.path.realpath(earlier):
                counts = "counts twice in the average" if averaging else "counts as two ranks"
                warn(f"{later} is given twice; the same file {counts}")
    _check_format(params.get("out_format"), optimizer=params["optimizer"])


def _options(params: dict[str, Any], model: Any) -> dict[str, Any]:
    """The options :func:`~ckptfix.merging.files.merge_files` and :func:`~ckptfix.exporting.folder.merge_to_hf`
    both take, from the command's."""
    return {
        "buffers": params["buffers"],
        "atol": params["atol"],
        "buffer_keys": _buffer_keys(model) if model is not None else [],
        "average": params["average"],
        "weights": params["weights"],
        "model": model,
        "overwrite": params["overwrite"],
        "allow_globals": params["allow_globals"],
        "unsafe": params["unsafe_pickle"],
    }


def _report(
    result: MergeResult,
    exported: Conversion | None,
    inputs: tuple[str, ...],
    out: str,
    *,
    output: Output,
    to: str,
    buffers: str,
    atol: float,
    averaging: bool,
) -> None:
    """The merge's warnings, its result (text or JSON) with what an export said whatever the verbosity, and exit 1
    where the ranks disagree."""
    from ckptfix.errors import MergeError, as_flags
    from ckptfix.notes import Level, level_of

    wrote = out
    if exported is not None:  # what the export did, then where it wrote
        result.notes.extend(n for n in exported.notes if level_of(n) is Level.ALWAYS)
        wrote, to = f"{out} ({exported.wrote})", "transformers"  # the keys are the config's
    for message in result.warnings:
        warn(message)
    result.notes = [as_flags(note) for note in result.notes]  # the library's optimizer=True is --optimizer here
    document = result.to_json(inputs, out, layout=to, buffers=buffers, atol=atol)
    output.result(
        document, lambda: _text(result, inputs, wrote, to=to, buffers=buffers, atol=atol, averaging=averaging)
    )
    if result.diverged:
        raise MergeError(
            f"{out}: not written: {len(result.diverged)} key(s) differ across ranks (e.g. "
            f"'{result.diverged[0].key}'); use files of the same step, or --atol if the drift is expected"
        )


def _check_format(out_format: str | None, *, optimizer: bool) -> None:
    from ckptfix.errors import UsageError

    refuse_hf_only(click.get_current_context().params)
    if out_format == "hf" and optimizer:
        raise UsageError("--optimizer does not apply to --format hf (the folder holds the model alone); drop it")


def _text(
    result: MergeResult, inputs: tuple[str, ...], out: str, *, to: str, buffers: str, atol: float, averaging: bool
) -> None:
    if result.diverged:
        echo(f"{len(result.diverged)} key(s) differ across ranks (atol {atol:g}):")
        for d in result.diverged[:LIST_LIMIT]:
            echo(f"  {d.key}  max |Δ| {d.max_abs:.3g}  on {', '.join(d.ranks)} (vs {result.base or inputs[0]})")
        section("  and", [d.key for d in result.diverged[LIST_LIMIT:]])
    elif averaging:
        _average_summary(result, inputs, out, to=to)
    else:
        _summary(result, inputs, out, to=to, buffers=buffers)


def _summary(result: MergeResult, inputs: tuple[str, ...], out: str, *, to: str, buffers: str) -> None:
    found = f" (layouts: {', '.join(sorted(set(result.layouts_from)))})" if result.layouts_from else ""
    echo(f"merged {len(inputs)} rank file(s){found}")
    if result.reassembled:
        ways = sorted(set(result.reassembled.values()))
        kind = "ShardedTensor" if any(w.startswith("ShardedTensor") for w in ways) else "DTensor"  # FSDP1 or FSDP2
        echo(
            f"reassembled {len(result.reassembled)} {kind} tensor(s) from every rank's shards ({'; '.join(ways)}): "
            f"full tensors, not averaged"
        )
    if result.bn_modules:
        groups = group_keys(result.bn_modules)
        echo(f"BatchNorm statistics ({buffers}): {len(result.bn_modules)} module(s): {'; '.join(groups)}")
    if result.buffers_merged:
        echo(f"other buffers ({buffers}): {'; '.join(group_keys(result.buffers_merged))}")
    if result.entries:  # else the files hold optimizer state alone (merge --optimizer)
        echo("parameters: equal on every rank")
    _tail(result, out, to=to, source=result.base or inputs[0])


def _average_summary(result: MergeResult, inputs: tuple[str, ...], out: str, *, to: str) -> None:
    weights = ", ".join(f"{w:.4g}" for w in result.weights)
    found = ", ".join(sorted(set(result.layouts_from)))
    echo(f"averaged {len(inputs)} checkpoint(s) (weights {weights}; layouts: {found})")
    echo(f"floating tensors averaged: {len(result.averaged)}; other tensors and entries from {inputs[-1]}")
    _tail(result, out, to=to, source=inputs[-1])


def _tail(result: MergeResult, out: str, *, to: str, source: str) -> None:
    """What came from ``source`` besides the model, what was left out, notes, and the output."""
    if result.kept_from_first:
        echo(f"taken from {source}: {', '.join(result.kept_from_first)}")
    if result.left_out:
        echo(f"left out (--model-only): {', '.join(result.left_out)}")
    for note in result.notes:
        echo(note)
    echo(f"wrote {out}" + (f" (layout {to})" if result.entries and to != "transformers" else ""))


def _parse_weights(value: str | None) -> list[float] | None:
    """``0.3,0.7`` as numbers; whether they fit (count, finite, not negative, not all zero) is the library's check."""
    if value is None:
        return None
    try:
        return [float(part) for part in value.split(",")]
    except ValueError:
        message = f"'{value}' is not a list of numbers; give one weight per file, e.g. 0.3,0.7"
        raise click.BadParameter(message) from None


def _model(model_spec: str, kwargs: str | None) -> Any:
    """The --model factory's model, on the meta device when the factory allows (as validate builds it): the merge
    reads its names and shapes only, so a large model costs no memory."""
    from ckptfix.loading.model import _build

    return _build(lambda device: model_from_options(model_spec, kwargs, device=device))


def _buffer_keys(model: Any) -> list[str]:
    """Names of the model's buffers in the single layout."""
    from ckptfix.transforms import layouts
    from ckptfix.transforms.checkpoint import apply_maps

    # The layout is read from every key: buffers alone may all sit under a submodule that is named `module`.
    _, maps = layouts.conversion_maps(list(model.state_dict()), to="single", source="model")
    return list(apply_maps(dict(model.named_buffers()), maps, source="model"))


COMMANDS: list[click.Command] = [merge]
