"""``ckptfix merge``, ``ckptfix validate`` and ``ckptfix diff``: can I use this checkpoint, and if not, why."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import click

from ckptfix.cli.convert import safety_options
from ckptfix.keytree import group_keys
from ckptfix.layouts import TARGETS
from ckptfix.merging import BUFFER_STRATEGIES

_LIST_LIMIT = 12  # one-per-line items before the rest are only counted (--json has them all)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _warn(message: str) -> None:
    click.echo(f"ckptfix: warning: {message}", err=True)


def _lines(lines: Sequence[str], more: str = "more") -> None:
    """Up to ``_LIST_LIMIT`` indented lines, then how many were left out."""
    for line in lines[:_LIST_LIMIT]:
        click.echo(f"  {line}")
    if len(lines) > _LIST_LIMIT:
        click.echo(f"  … {len(lines) - _LIST_LIMIT} {more} (use --json for all)")


def _section(title: str, keys: Iterable[str]) -> None:
    keys = list(keys)
    if not keys:
        return
    click.echo(f"{title} ({len(keys)}):")
    _lines(group_keys(keys), "more groups")


def _by_change(title: str, changes: dict[str, tuple[Any, Any]], fmt: str) -> None:
    """Keys grouped by the change they share (``[3, 4] -> [5, 4]``), each group brace-compressed."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key, (a, b) in changes.items():
        shown = [list(x) if isinstance(x, tuple) else x for x in (a, b)]
        groups[fmt.format(a=shown[0], b=shown[1])].append(key)
    for change, keys in groups.items():
        _section(f"{title}, {change}", keys)


def _import_path() -> None:
    # A console script does not put the working folder on sys.path the way `python -m` does; factories
    # such as `mypkg.models:build` usually live right there.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


@click.command()
@click.argument("path", metavar="CKPT", type=click.Path(dir_okay=False))
@click.option("--model", "model_spec", required=True, metavar="MOD:FACTORY", help="e.g. mypkg.models:build_model.")
@click.option("--kwargs", metavar="JSON", help="Factory keyword arguments as a JSON object, e.g. '{\"depth\": 18}'.")
@click.option("--entry", metavar="NAME", help="Model entry of a full checkpoint (default: detected).")
@click.option("--any-layout", is_flag=True, help="Exit 0 also when only the layout differs (load_into adapts it).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@safety_options
def validate(
    path: str,
    model_spec: str,
    kwargs: str | None,
    entry: str | None,
    any_layout: bool,
    as_json: bool,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
) -> None:
    """Check that CKPT loads into the model built by --model with load_state_dict(strict=True).

    Prints missing, unexpected, wrong-shape and wrong-dtype keys, grouped; likely renames; and, when a
    layout change or a rename is all that is wrong, the `ckptfix convert` command that fixes the file.

    \b
    Exit codes: 0 it loads as is; 1 it does not; 2 the check cannot run.
    Example: ckptfix validate ddp_run.pt --model mypkg.models:ResNet --kwargs '{"depth": 18}'
    """
    from ckptfix.checks import adapt_to_model, build_model, model_state_of, primary_entry
    from ckptfix.formats import load

    _import_path()
    model = build_model(model_spec, kwargs=kwargs)
    obj = load(path, unsafe=unsafe_pickle, allow_globals=allow_globals)
    state = model_state_of(obj, source=path, entry=entry)
    _, report = adapt_to_model(state, model, source=path)
    report.entry = entry or primary_entry(obj)
    code = 0 if report.loads_as_is or (any_layout and report.ok) else 1
    fix = report.fix_command(path, allow_globals=allow_globals)
    if as_json:
        _echo_json({**report.to_dict(), "model": model_spec, "fix_command": fix, "exit_code": code})
        click.get_current_context().exit(code)
    where = f"entry '{report.entry}', " if report.entry else ""
    click.echo(f"checkpoint: {path} ({where}layout {report.layout_from}, {len(state)} keys)")
    click.echo(f"model:      {model_spec} (layout {report.layout_to}, {len(model.state_dict())} keys)")
    _section("missing from the checkpoint", report.missing)
    _section("unexpected in the checkpoint", report.unexpected)
    _by_change("wrong shape", report.wrong_shape, "checkpoint {a} vs model {b}")
    _by_change("wrong dtype", report.wrong_dtype, "checkpoint {a} vs model {b}")
    if report.renamed:
        click.echo(f"likely renamed (checkpoint -> model, same shape, unique suffix match) ({len(report.renamed)}):")
        _lines([f"{got} -> {want}" for got, want in report.renamed])
    if report.loads_as_is:
        click.echo("OK: loads with load_state_dict(strict=True)")
    elif report.ok:
        click.echo(
            f"layout only: the checkpoint is {report.layout_from}, the model {report.layout_to}; "
            f"ckptfix.load_into adapts it, or rewrite the file with:"
        )
        click.echo(f"  {fix}")
    elif fix:
        click.echo("renamed keys only: rewrite the file with:")
        click.echo(f"  {fix}")
    else:
        click.echo(f"FAIL: would not load with strict=True: {report.summary()}")
    click.get_current_context().exit(code)


@click.command()
@click.argument("a", metavar="A", type=click.Path(dir_okay=False))
@click.argument("b", metavar="B", type=click.Path(dir_okay=False))
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance for values.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance for values.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@safety_options
def diff(
    a: str, b: str, atol: float, rtol: float, as_json: bool, allow_globals: tuple[str, ...], unsafe_pickle: bool
) -> None:
    """Compare checkpoints A and B after normalising their layouts.

    Lists keys only in A or only in B, shape and dtype changes, tensors whose values differ (max |Δ|, max
    relative) and other entries (epoch, optimizer, …) that differ. Tensors are equal when
    |a - b| <= atol + rtol·|b| everywhere.

    \b
    Exit codes: 0 equal within tolerance; 1 different; 2 an input cannot be read.
    Example: ckptfix diff ddp_run.pt converted.safetensors --atol 1e-6
    """
    from ckptfix.diff import diff as diff_checkpoints
    from ckptfix.formats import load

    objs = [load(p, unsafe=unsafe_pickle, allow_globals=allow_globals) for p in (a, b)]
    report = diff_checkpoints(objs[0], objs[1], atol=atol, rtol=rtol, names=(a, b))
    code = 0 if report.equal else 1
    if as_json:
        _echo_json({**report.to_dict(), "exit_code": code})
        click.get_current_context().exit(code)
    for e in report.entries:
        ea = f"entry '{e.entry_a}', " if e.entry_a else ""
        eb = f"entry '{e.entry_b}', " if e.entry_b else ""
        click.echo(f"A: {a} ({ea}layout {e.layout_a})")
        click.echo(f"B: {b} ({eb}layout {e.layout_b})")
        if e.layout_a != e.layout_b:
            click.echo(f"layouts differ ({e.layout_a} vs {e.layout_b}): compared after converting both to single")
        _section("only in A", e.only_a)
        _section("only in B", e.only_b)
        _by_change("shape changed", e.shape, "{a} -> {b}")
        _by_change("dtype changed", e.dtype, "{a} -> {b}")
        if e.values:
            click.echo(f"values differ ({len(e.values)} of {e.compared} tensors, atol {atol:g}, rtol {rtol:g}):")
            worst = sorted(e.values, key=lambda v: -v.max_abs)
            for v in worst[:_LIST_LIMIT]:
                click.echo(f"  {v.key}  max |Δ| {v.max_abs:.3g}  max rel {v.max_rel:.3g}")
            rest = [v.key for v in worst[_LIST_LIMIT:]]
            if rest:
                _section("  and smaller differences in", rest)
    if not report.entries:
        click.echo(f"A: {a}\nB: {b}\nno model state dict in common; compared as data")
    if report.other:
        click.echo(f"other entries differ ({len(report.other)}):")
        _lines([f"{o.path}: {o.a} -> {o.b}" for o in report.other])
    tolerance = f" within atol {atol:g}, rtol {rtol:g}" if atol or rtol else ""
    click.echo(f"equal{tolerance}" if report.equal else "different")
    click.get_current_context().exit(code)


@click.command()
@click.argument("inputs", metavar="RANK0 RANK1 …", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), help="Merged checkpoint.")
@click.option("--to", type=click.Choice(TARGETS), default="single", show_default=True, help="Output key layout.")
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
@click.option("--json", "as_json", is_flag=True, help="Print the merge report as JSON.")
@safety_options
def merge(
    inputs: tuple[str, ...],
    out: str,
    to: str,
    buffers: str,
    atol: float,
    model_spec: str | None,
    kwargs: str | None,
    as_json: bool,
    allow_globals: tuple[str, ...],
    unsafe_pickle: bool,
) -> None:
    """Merge per-rank checkpoints of one DDP run (buffer sync off) into OUT.

    Parameters must be equal on every rank (within --atol), else nothing is written and the differing keys
    are listed. BatchNorm running statistics are merged per --buffers; num_batches_tracked is kept, or the
    maximum when ranks differ. Other buffers must be equal; with --model, floating ones that differ follow
    --buffers (pooled and mean both average them). Non-model entries (epoch, optimizer, …) come from RANK0.

    \b
    Exit codes: 0 merged; 1 ranks disagree (nothing written); 2 an input or OUT cannot be used.
    Example: ckptfix merge ckpt_rank0.pt ckpt_rank1.pt -o merged.pt --to single
    """
    from ckptfix.errors import MergeError
    from ckptfix.formats import load, save
    from ckptfix.formats.atomic import check_output
    from ckptfix.merging import plan_merge

    check_output(out, inputs=inputs)
    for j, later in enumerate(inputs):
        for earlier in inputs[:j]:
            if os.path.realpath(later) == os.path.realpath(earlier):
                _warn(f"{later} is given twice; the same file counts as two ranks")
    buffer_keys = _buffer_keys(model_spec, kwargs) if model_spec else []
    objs = [load(p, unsafe=unsafe_pickle, allow_globals=allow_globals) for p in inputs]
    result = plan_merge(objs, names=inputs, buffers=buffers, atol=atol, to=to, buffer_keys=buffer_keys)
    for message in result.warnings:
        _warn(message)
    if not result.diverged:
        save(result.obj, out)
    if as_json:
        _echo_json({**result.to_dict(), "output": out, "written": not result.diverged})
    elif result.diverged:
        click.echo(f"{len(result.diverged)} key(s) differ across ranks (atol {atol:g}):")
        for d in result.diverged[:_LIST_LIMIT]:
            click.echo(f"  {d.key}  max |Δ| {d.max_abs:.3g}  on {', '.join(d.ranks)} (vs {inputs[0]})")
        if len(result.diverged) > _LIST_LIMIT:
            _section("  and", [d.key for d in result.diverged[_LIST_LIMIT:]])
    else:
        _merge_summary(result, inputs, out, to=to, buffers=buffers)
    if result.diverged:
        raise MergeError(
            f"{out}: not written: {len(result.diverged)} key(s) differ across ranks (e.g. "
            f"'{result.diverged[0].key}'); use files of the same step, or --atol if the drift is expected"
        )


def _merge_summary(result: Any, inputs: tuple[str, ...], out: str, *, to: str, buffers: str) -> None:
    click.echo(f"merged {len(inputs)} rank file(s) (layouts: {', '.join(sorted(set(result.layouts_from)))})")
    if result.bn_modules:
        groups = group_keys(result.bn_modules)
        click.echo(f"BatchNorm statistics ({buffers}): {len(result.bn_modules)} module(s): {'; '.join(groups)}")
    if result.buffers_merged:
        click.echo(f"other buffers ({buffers}): {'; '.join(group_keys(result.buffers_merged))}")
    click.echo("parameters: equal on every rank")
    if result.kept_from_first:
        click.echo(f"taken from {inputs[0]}: {', '.join(result.kept_from_first)}")
    click.echo(f"wrote {out} (layout {to})")


def _buffer_keys(model_spec: str, kwargs: str | None) -> list[str]:
    """Names of the model's buffers in the single layout."""
    from ckptfix import layouts
    from ckptfix.checkpoint import apply_maps
    from ckptfix.checks import build_model

    _import_path()
    model = build_model(model_spec, kwargs=kwargs)
    # The layout is read from every key: buffers alone may all sit under a submodule that is named `module`.
    _, maps = layouts.conversion_maps(list(model.state_dict()), to="single", source="model")
    return list(apply_maps(dict(model.named_buffers()), maps, source="model"))


COMMANDS: list[click.Command] = [merge, validate, diff]
