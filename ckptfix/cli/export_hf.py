"""``ckptfix convert IN OUT/ --format hf``: which of ``convert``'s options apply to an export, the export, its lines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from ckptfix.cli.render import Output, echo
from ckptfix.errors import UsageError
from ckptfix.notes import Kind, Level, kind_of, level_of

# convert's options that an export does not take: the keys are the model's, CRCs always checked
_NOT_FOR_HF = {
    "to": "--to",
    "keep_layout": "--keep-layout",
    "add_prefix": "--add-prefix",
    "optimizer": "--optimizer",
    "no_verify": "--no-verify",
}  # fmt: skip (--model-only is what an export does anyway)
_HF_ONLY = {"config_from": "--config-from", "architecture": "--architecture", "verify_hf": "--verify"}


def export(src: str, dst: str, ctx: click.Context, *, output: Output, verbose: bool) -> None:
    """Run :func:`ckptfix.exporting.folder.export_hf` with ``convert``'s options, and say what it wrote."""
    params = ctx.params
    refuse_hf_only(params)
    for name, flag in _NOT_FOR_HF.items():
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            why = "an export keeps the keys the model's config names" if name != "no_verify" else "CRCs are read"
            raise UsageError(f"{flag} does not apply to --format hf ({why}); drop it")
    from ckptfix.exporting.folder import export_hf

    result = export_hf(
        src,
        dst,
        config_from=params["config_from"],
        architecture=params["architecture"],
        dtype=params["dtype"],
        shard_size=params["shard_size"],
        verify=params["verify_hf"],
        overwrite=params["overwrite"],
        entry=params["entries"][0] if params["entries"] else None,
        strip_prefixes=params["strip_prefix"],
        renames=params["rename"],
        allow_globals=params["allow_globals"],
        unsafe=params["unsafe_pickle"],
        fast=not params["no_fast"],
        progress=not output.as_json,  # on a terminal only; stdout holds the JSON document
    )

    def text() -> None:
        for change in result.changes:
            where = f"'{change.entry}'" if change.entry else "state dict"
            echo(f"{where}: {change.layout_from} -> transformers keys, {change.keys} keys ({change.renamed} renamed)")
        if result.dropped:
            echo(f"left out the training state beside the model: {', '.join(result.dropped)}")
        for note in result.notes:
            if verbose or level_of(note) is Level.ALWAYS:
                echo(note if kind_of(note) is not Kind.ROUTE else f"path: {result.method}; {note}")
        if verbose and not any(kind_of(n) is Kind.ROUTE for n in result.notes):
            echo(f"path: {result.method}", err=True)
        echo(f"wrote {dst} ({result.wrote})")

    output.result(result.to_json(src, dst, dtype=result_dtype(params["dtype"])), text)


def refuse_hf_only(params: Mapping[str, Any]) -> None:
    """An option of ``--format hf`` given without it (``convert``, ``merge``): a usage error naming it."""
    given = [flag for name, flag in _HF_ONLY.items() if params.get(name) not in (None, False)]
    if params.get("out_format") != "hf" and given:
        raise UsageError(f"{given[0]} applies to --format hf (a folder from_pretrained loads); add --format hf")


def result_dtype(dtype: str | None) -> str | None:
    from ckptfix.conversion.files import float_dtype

    return float_dtype(dtype)
