"""``ckptfix validate``: does this checkpoint load into my model, and if not, why and what fixes it."""

from __future__ import annotations

import click

from ckptfix.cli.options import model_from_options, safety_options
from ckptfix.cli.render import by_change, echo, echo_json, lines, section


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

    Prints missing, unexpected, wrong-shape and wrong-dtype keys, grouped; _metadata entries that make
    load_state_dict raise; likely renames; and, when a layout change or a rename is all that is wrong, the
    `ckptfix convert` command that fixes the file. When the keys fit, the state is loaded into the model for real.

    \b
    Exit codes: 0 it loads as is; 1 it does not; 2 the check cannot run.
    Example: ckptfix validate ddp_run.pt --model mypkg.models:ResNet --kwargs '{"depth": 18}'
    """
    from ckptfix.compare import module_name
    from ckptfix.formats import load
    from ckptfix.loading import adapt_to_model, model_state_of, primary_entry, trial_load

    model = model_from_options(model_spec, kwargs)
    model_keys = len(model.state_dict())
    obj = load(path, unsafe=unsafe_pickle, allow_globals=allow_globals)
    state = model_state_of(obj, source=path, entry=entry)
    adapted, report = adapt_to_model(state, model, source=path)
    if report.ok:  # the model was built for this check, so it may be loaded into
        report.load_error = trial_load(model, adapted)
    report.entry = entry or primary_entry(obj)
    code = 0 if report.loads_as_is or (any_layout and report.ok) else 1
    fix = report.fix_command(path, allow_globals=allow_globals)
    if as_json:
        echo_json({**report.to_dict(), "model": model_spec, "fix_command": fix, "exit_code": code})
        click.get_current_context().exit(code)
    where = f"entry '{report.entry}', " if report.entry else ""
    echo(f"checkpoint: {path} ({where}layout {report.layout_from}, {len(state)} keys)")
    echo(f"model:      {model_spec} (layout {report.layout_to}, {model_keys} keys)")
    section("missing from the checkpoint", report.missing)
    section("unexpected in the checkpoint", report.unexpected)
    by_change("wrong shape", report.wrong_shape, "checkpoint {a} vs model {b}")
    by_change("wrong dtype", report.wrong_dtype, "checkpoint {a} vs model {b}")
    if report.bad_metadata:
        echo(f"_metadata that load_state_dict refuses ({len(report.bad_metadata)}):")
        lines([f"{module_name(p)}: {problem}" for p, problem in report.bad_metadata.items()])
    if report.renamed:
        echo(f"likely renamed (checkpoint -> model, same shape, unique suffix match) ({len(report.renamed)}):")
        lines([f"{got} -> {want}" for got, want in report.renamed])
    if report.loads_as_is:
        echo("OK: loads with load_state_dict(strict=True)")
    elif report.ok:
        echo(
            f"layout only: the checkpoint is {report.layout_from}, the model {report.layout_to}; "
            f"ckptfix.load_into adapts it, or rewrite the file with:"
        )
        echo(f"  {fix}")
    elif fix:
        echo("renamed keys only: rewrite the file with:")
        echo(f"  {fix}")
    else:
        echo(f"FAIL: would not load with strict=True: {report.summary()}")
    click.get_current_context().exit(code)


COMMANDS: list[click.Command] = [validate]
