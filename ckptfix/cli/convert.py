"""``ckptfix convert``: rewrite a checkpoint in another layout, dtype or format."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import click

from ckptfix.cli.options import architecture_option, force_option, json_option, model_flags, safety_options, to_option
from ckptfix.cli.render import Output, echo
from ckptfix.transforms.layouts import Layout

if TYPE_CHECKING:
    from ckptfix.transforms.checkpoint import Conversion


@click.command()
@click.argument("src", metavar="IN", type=click.Path())
@click.argument("dst", metavar="OUT", type=click.Path())
@to_option("Target key layout.")
@click.option("--keep-layout", is_flag=True, help="Do not change the layout (only rename, cast or change format).")
@click.option("--strip-prefix", multiple=True, metavar="P", help="Remove P from every key (all keys must have it).")
@click.option("--add-prefix", multiple=True, metavar="P", help="Put P in front of every key, after the layout change.")
@click.option("--rename", multiple=True, metavar="REGEX=REPL", help="Rename keys with re.sub (repeatable).")
@click.option("--entry", "entries", multiple=True, metavar="NAME", help="Model entry to convert (default: detected).")
@click.option("--model-only", is_flag=True, help="Keep only the model state dict, drop optimizer, epoch, …")
@click.option(
    "--optimizer",
    is_flag=True,
    help="DeepSpeed ZeRO run into a .pt file or a DCP folder/: write {model, optimizer, …}, the optimizer's state "
    "(Adam moments, step) consolidated into a full torch optimizer state dict, beside it the run's lr_scheduler, "
    "global_steps, client_state entries and an fp16 run's loss_scaler (off by default: it can be several times the "
    "model).",
)
@click.option(
    "--optimizer-form",
    type=click.Choice(["names", "indices"]),
    help="Key optimizer state by parameter names (set_optimizer_state_dict, FSDP2) or indices "
    "(optimizer.load_state_dict). Default: names into a DCP folder where the model entry says them, else indices.",
)
@click.option(
    "--model",
    "model_spec",
    metavar="MOD:FACTORY",
    help="The model, for --optimizer-form names where the "
    "checkpoint does not say which tensors are parameters (built on the meta device).",
)
@click.option(
    "--optimizer-factory",
    metavar="MOD:FN",
    help="With --model: FN(model) builds the optimizer as the run did; its param groups name the parameters of an "
    "optimizer whose groups record no param_names (needed for FSDP2 where it has several groups).",
)
@click.option("--dtype", metavar="DTYPE", help="Cast floating-point tensors (float16, bfloat16, float32, float64).")
@click.option("--no-fast", is_flag=True, help="Always load and save through torch (the reference path).")
@click.option(
    "--no-verify",
    is_flag=True,
    help="Fast .pt to .pt only: do not read the input for its CRCs. The output keeps them, so a corrupt record "
    "is still refused when the output is loaded.",
)
@click.option(
    "--shard-size",
    metavar="SIZE",
    callback=lambda ctx, param, value: None if value is None else _parse_size(value),
    help="Write transformers shards of at most SIZE (5GB, 500MB, 2GiB) and their index beside OUT (in OUT if it "
    "is a folder).",
)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["hf", "dcp", "safetensors", "pt"]),
    help="What a folder OUT holds: hf (a folder transformers' from_pretrained loads), dcp (a DCP folder, the "
    "default), safetensors or pt (model.safetensors or model.pt, or their shards with --shard-size).",
)
@click.option(
    "--config-from",
    metavar="DIR",
    type=click.Path(),
    help="--format hf: the folder of the model's config.json, generation_config.json and tokenizer files (default: "
    "IN's folder, then its parent).",
)
@architecture_option
@click.option(
    "--verify",
    "verify_hf",
    is_flag=True,
    help="--format hf: load OUT with transformers and compare logits on a fixed input with IN's weights.",
)
@click.option("-v", "--verbose", is_flag=True, help="Say which path ran, why, and what was shared or copied.")
@json_option("Print the result as JSON (schema: docs/json.md).")
@force_option
@safety_options
@model_flags()  # --model is built on the way: its errors name the flag
def convert(
    src: str,
    dst: str,
    to: str,
    keep_layout: bool,
    strip_prefix: tuple[str, ...],
    add_prefix: tuple[str, ...],
    rename: tuple[str, ...],
    entries: tuple[str, ...],
    model_only: bool,
    optimizer: bool,
    optimizer_form: str | None,
    model_spec: str | None,
    optimizer_factory: str | None,
    dtype: str | None,
    no_fast: bool,
    no_verify: bool,
    shard_size: int | None,
    out_format: str | None,
    config_from: str | None,
    architecture: str | None,
    verify_hf: bool,
    verbose: bool,
    output: Output,
    overwrite: bool,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
) -> None:
    """Convert checkpoint IN to layout --to and write OUT (format from OUT's extension).

    \b
    IN may be a folder: transformers shards (or their *.index.json), an accelerate save_state folder, or a
    torch.distributed.checkpoint (DCP) folder. OUT ending in / (or an empty folder) gets a DCP folder that
    torch.distributed.checkpoint.load reads; with --shard-size, transformers shards; --format chooses (hf: a
    folder from_pretrained loads). The "wrote" line says what a folder holds. An existing DCP folder or
    shard set is replaced only with --force, and only when it holds nothing but a checkpoint: the new one is
    written beside it and swapped in.

    \b
    Layouts: single (conv1.weight), dp/ddp (module.conv1.weight), compiled (_orig_mod.conv1.weight),
    ddp-compiled (module._orig_mod.…), compiled-ddp (_orig_mod.module.…).
    Full checkpoints keep every other entry (epoch, optimizer, …) untouched.

    \b
    Example: ckptfix convert ddp_run.pt model.safetensors --to single --model-only
    """
    from ckptfix.conversion.files import convert_file, float_dtype

    _refuse_conflicts(click.get_current_context(), keep_layout=keep_layout, no_fast=no_fast, no_verify=no_verify)
    if out_format == "hf" or config_from is not None or architecture is not None or verify_hf:
        from ckptfix.cli.export_hf import export

        return export(src, dst, click.get_current_context(), output=output, verbose=verbose)
    result = convert_file(
        src,
        dst,
        to=None if keep_layout else cast("Layout", to),
        dtype=dtype,
        unsafe=unsafe_pickle,
        allow_globals=allow_globals,
        fast=not no_fast,
        verify=not no_verify,
        shard_size=shard_size,
        strip_prefixes=strip_prefix,
        add_prefixes=add_prefix,
        renames=rename,
        entries=list(entries) if entries else None,
        model_only=model_only,
        overwrite=overwrite,
        optimizer=optimizer,
        format=out_format,
        optimizer_form=optimizer_form,
        model=model_spec,
        optimizer_factory=optimizer_factory,
    )
    dtype = float_dtype(dtype)  # as people write it (bf16) in the call, its name (bfloat16) in what is printed
    output.result(result.to_json(src, dst, dtype=dtype), lambda: _text(result, dst, dtype=dtype, verbose=verbose))


def _text(result: Conversion, dst: str, *, dtype: str | None, verbose: bool) -> None:
    for change in result.changes:
        where = f"'{change.entry}'" if change.entry else "state dict"
        echo(
            f"{where}: {change.layout_from} -> {change.layout_to}, {change.keys} keys ({change.renamed} renamed)"
            + (f", cast to {dtype}" if dtype else "")
        )
    if result.kept:
        echo(f"kept unchanged: {', '.join(result.kept)}")
    if result.dropped:
        echo(f"dropped (--model-only): {', '.join(result.dropped)}")
    from ckptfix.notes import Kind, Level, kind_of, level_of

    if verbose:  # every note but the tied names' in the path line
        path = "".join(f"; {note}" for note in result.notes if kind_of(note) is not Kind.TIES)
        echo(f"path: {result.method}{path}", err=True)
    # tied names on a line of their own; without --verbose, every note said whatever the verbosity
    for note in result.notes:
        if kind_of(note) is Kind.TIES or (not verbose and level_of(note) is Level.ALWAYS):
            echo(f"ckptfix: {note}", err=True)
    echo(f"wrote {dst}" + (f" ({result.wrote})" if result.wrote else ""))


def _refuse_conflicts(ctx: click.Context, *, keep_layout: bool, no_fast: bool, no_verify: bool) -> None:
    """Options that ask for opposite things: a usage error naming both, before any file is opened."""
    from ckptfix.errors import UsageError

    given = ctx.get_parameter_source("to") == click.core.ParameterSource.COMMANDLINE
    if keep_layout and given:
        raise UsageError(
            f"--to {ctx.params['to']} and --keep-layout ask for opposite things (a layout change, none); drop one"
        )
    if no_fast and no_verify:
        raise UsageError(
            "--no-verify is the fast path's and --no-fast turns it off (the torch path checks every CRC); drop one"
        )


def _parse_size(value: str) -> int:
    from ckptfix.formats.hf.folder import parse_size  # the folder module only when shards are asked for

    return parse_size(value)


COMMANDS: list[click.Command] = [convert]
