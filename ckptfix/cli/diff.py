"""``ckptfix diff``: what differs between two checkpoints once their layouts are set aside."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckptfix.cli.options import json_option, safety_options, tolerance_option
from ckptfix.cli.render import LIST_LIMIT, Output, by_change, echo, lines, section, verdict

if TYPE_CHECKING:
    from ckptfix.diffing import DiffReport


@click.command()
@click.argument("a", metavar="A", type=click.Path())
@click.argument("b", metavar="B", type=click.Path())
@tolerance_option("--atol", "Absolute tolerance for values.")
@tolerance_option("--rtol", "Relative tolerance for values.")
@click.option("--entry", metavar="NAME", help="Compare only this model entry (of each side that has it).")
@click.option(
    "--strip-prefix",
    "strip_prefixes",
    multiple=True,
    metavar="PREFIX",
    help="Remove PREFIX from the keys of each side whose keys all start with it (repeatable).",
)
@json_option("Print the report as JSON.")
@safety_options
def diff(
    a: str,
    b: str,
    atol: float,
    rtol: float,
    entry: str | None,
    strip_prefixes: tuple[str, ...],
    output: Output,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
) -> None:
    """Compare checkpoints A and B after normalising their layouts.

    Lists keys only in A or only in B, shape and dtype changes, tensors whose values differ (max |Δ|, max
    relative) and other entries (epoch, optimizer, …) that differ. Tensors are equal when
    |a - b| <= atol + rtol·|b| everywhere. Files are read one tensor at a time; equal bytes are not converted.

    A and B may be folders or index files (transformers shards, accelerate save_state folders,
    torch.distributed.checkpoint folders), read file by file the same way. Entries that need classes outside
    the allowlist (an mmengine message_hub) are not loaded: they are compared as their pickle records and named.

    \b
    Exit codes: 0 equal within tolerance; 1 different; 2 an input cannot be read.
    Example: ckptfix diff ddp_run.pt converted.safetensors --atol 1e-6
    Example: ckptfix diff lightning.ckpt weights.safetensors --entry state_dict --strip-prefix model.
    Example: ckptfix diff hf_model/ consolidated.safetensors
    """
    from ckptfix.diffing import diff_files

    report = diff_files(
        a,
        b,
        atol=atol,
        rtol=rtol,
        entry=entry,
        strip_prefixes=strip_prefixes,
        allow_globals=allow_globals,
        unsafe=unsafe_pickle,
    )
    output.result(report.to_json(), lambda: _text(report, a, b, entry=entry))
    click.get_current_context().exit(0 if report.equal else 1)


def _text(report: DiffReport, a: str, b: str, *, entry: str | None) -> None:
    atol, rtol = report.atol, report.rtol
    for e in report.entries:
        ea = f"entry '{e.entry_a}', " if e.entry_a else ""
        eb = f"entry '{e.entry_b}', " if e.entry_b else ""
        echo(f"A: {a} ({ea}layout {e.layout_a})")
        echo(f"B: {b} ({eb}layout {e.layout_b})")
        if e.layout_a != e.layout_b:
            echo(f"layouts differ ({e.layout_a} vs {e.layout_b}): compared after converting both to single")
        section("only in A", e.only_a)
        section("only in B", e.only_b)
        by_change("shape changed", e.shape, "{a} -> {b}")
        by_change("dtype changed", e.dtype, "{a} -> {b}")
        if e.values:
            echo(f"values differ ({len(e.values)} of {e.compared} tensors, atol {atol:g}, rtol {rtol:g}):")
            worst = sorted(e.values, key=lambda v: -v.max_abs)
            for v in worst[:LIST_LIMIT]:
                echo(f"  {v.key}  max |Δ| {v.max_abs:.3g}  max rel {v.max_rel:.3g}")
            section("  and smaller differences in", [v.key for v in worst[LIST_LIMIT:]])
    if not report.entries:
        echo(f"A: {a}")
        echo(f"B: {b}")
        echo("no model state dict in common; compared as data")
    if report.other:
        echo(f"other entries differ ({len(report.other)}):")
        lines([f"{o.path}: {o.a} -> {o.b}" for o in report.other])
    if not report.others_compared:
        echo(f"other entries not compared (--entry {entry})")
    for side in ("a", "b"):
        how = "; compared as their pickle records, nothing run" if report.others_compared else ""
        for key, what in report.not_loaded.get(side, {}).items():
            echo(f"{side.upper()}: entry '{key}': {what}{how}")
    tolerance = f" within atol {atol:g}, rtol {rtol:g}" if atol or rtol else ""
    verdict(f"equal{tolerance}" if report.equal else "different", "green" if report.equal else "red")


COMMANDS: list[click.Command] = [diff]
