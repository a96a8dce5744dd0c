"""``ckptfix validate``: does this checkpoint load into my model, and if not, why and what fixes it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckptfix.cli.options import json_option, model_from_options, safety_options
from ckptfix.cli.render import Output, by_change, echo, lines, section, verdict

if TYPE_CHECKING:
    from ckptfix.loading.model import Validation


@click.command()
@click.argument("path", metavar="CKPT", type=click.Path())
@click.option("--model", "model_spec", required=True, metavar="MOD:FACTORY", help="e.g. mypkg.models:build_model.")
@click.option("--kwargs", metavar="JSON", help="Factory keyword arguments as a JSON object, e.g. '{\"depth\": 18}'.")
@click.option("--entry", metavar="NAME", help="Model entry to check, e.g. state_dict_ema (default: detected).")
@click.option("--strip-prefix", multiple=True, metavar="P", help="Remove P from every key first (as convert does).")
@click.option("--any-layout", is_flag=True, help="Exit 0 also when only the layout or a prefix differs.")
@json_option("Print the report as JSON.")
@safety_options
def validate(
    path: str,
    model_spec: str,
    kwargs: str | None,
    entry: str | None,
    strip_prefix: tuple[str, ...],
    any_layout: bool,
    output: Output,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
) -> None:
    """Check that CKPT loads into the model built by --model with load_state_dict(strict=True).

    Reads only the checkpoint's metadata (keys, shapes, dtypes), never its tensor bytes. Prints missing, unexpected,
    wrong-shape and wrong-dtype keys, grouped; tied keys (left out, but the same tensor in the model as a key that is
    there); _metadata entries that make load_state_dict raise; likely renames; and, when a layout change, a key
    prefix or a rename is all that is wrong, the `ckptfix convert` command that fixes the file. When the keys fit,
    a trial load_state_dict runs on the model built for the check.

    \b
    Exit codes: 0 it loads as is; 1 it does not; 2 the check cannot run.
    Example: ckptfix validate ddp_run.pt --model mypkg.models:ResNet --kwargs '{"depth": 18}'
    """
    from ckptfix.formats.fsdp.ranks import ShardedCheckpointError
    from ckptfix.loading.model import validate_file

    try:
        found = validate_file(
            path,
            lambda device: model_from_options(model_spec, kwargs, device=device),
            entry=entry,
            strip_prefixes=strip_prefix,
            allow_globals=allow_globals,
            unsafe=unsafe_pickle,
        )
    except ShardedCheckpointError as e:  # one rank's shards: a finding about the file (1), not a failed check (2)
        output.finding(str(e))
        click.get_current_context().exit(1)
    report = found.report
    code = 0 if report.loads_as_is or (any_layout and report.ok) else 1
    fix = report.fix_command(
        path, entry=entry, strip_prefixes=strip_prefix, allow_globals=allow_globals, unsafe=unsafe_pickle
    )
    others = [e for e in found.entries if e not in ("", report.entry)]
    document = report.to_json(
        keys=found.keys,
        model=model_spec,
        model_keys=found.model_keys,
        other_entries=others,
        fix_command=fix,
        exit_code=code,
    )
    output.result(document, lambda: _text(found, path, model_spec, others=others, fix=fix))
    click.get_current_context().exit(code)


def _text(found: Validation, path: str, model_spec: str, *, others: list[str], fix: str | None) -> None:
    from ckptfix.loading.report import module_name

    report = found.report
    where = f"entry '{report.entry}', " if report.entry else ""
    echo(f"checkpoint: {path} ({where}layout {report.layout_from}, {found.keys} keys)")
    if others:
        echo(f"            also holds model entries {', '.join(repr(e) for e in others)} (check one with --entry NAME)")
    for name, what in report.not_loaded.items():  # entries needing globals outside the allowlist: left unbuilt
        echo(f"            entry '{name}': {what}")
    echo(f"model:      {model_spec} (layout {report.layout_to}, {found.model_keys} keys)")
    section("missing from the checkpoint", report.missing)
    section("unexpected in the checkpoint", report.unexpected)
    by_change("wrong shape", report.wrong_shape, "checkpoint {a} vs model {b}")
    by_change("wrong dtype", report.wrong_dtype, "checkpoint {a} vs model {b}")
    if report.tied:
        echo(f"tied: left out, the same tensor in the model as a key that is there ({len(report.tied)}):")
        lines([f"{key} = {present}" for key, present in report.tied.items()])
    if report.bad_metadata:
        echo(f"_metadata that load_state_dict refuses ({len(report.bad_metadata)}):")
        lines([f"{module_name(p)}: {problem}" for p, problem in report.bad_metadata.items()])
    if report.renamed:
        echo(f"likely renamed (checkpoint -> model, same shape, unique suffix match) ({len(report.renamed)}):")
        lines([f"{got} -> {want}" for got, want in report.renamed])
    fixable = report.ok or report.fixable_by_convert  # a layout, a prefix or renames: load_into or convert fix it
    verdict(report.verdict(), "green" if report.loads_as_is else "yellow" if fixable else "red")
    if fix and not report.loads_as_is:
        echo(f"  {fix}")


COMMANDS: list[click.Command] = [validate]
