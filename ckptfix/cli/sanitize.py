"""``ckptfix sanitize``: a copy of a checkpoint that plain ``torch.load(weights_only=True)`` opens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckptfix.cli.options import force_option, json_option
from ckptfix.cli.render import Output, echo

if TYPE_CHECKING:
    from ckptfix.sanitizing import Sanitized


@click.command()
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("dst", metavar="OUT", type=click.Path(dir_okay=False))
@json_option("Print the result as JSON (schema: docs/json.md).")
@force_option
def sanitize(src: str, dst: str, output: Output, overwrite: bool) -> None:
    """Write OUT, a copy of torch checkpoint IN that torch.load(weights_only=True) opens, keeping what is data.

    Nothing in IN is run: its pickle is read inertly. argparse.Namespace becomes a dict, pathlib paths strings,
    numpy arrays tensors and numpy scalars numbers (numpy is not called), Decimal, Fraction, UUID and datetime
    values strings, frozensets sets. Every other object (a class of the training code, anything that can run
    code) is dropped, and each drop is listed with its reason.

    \b
    Example: ckptfix sanitize epoch_12.pth epoch_12.clean.pth
    """
    from ckptfix.sanitizing import sanitize

    result = sanitize(src, dst, overwrite=overwrite)
    output.result(result.to_json(src, dst), lambda: _text(result, dst))


def _text(result: Sanitized, dst: str) -> None:
    for change, count in sorted(result.converted.items()):
        echo(f"rewrote {count} × {change}")
    for dropped in result.dropped:
        echo(f"dropped {dropped}")
    echo(f"wrote {dst}" + (f" ({len(result.dropped)} objects dropped)" if result.dropped else ""))


COMMANDS: list[click.Command] = [sanitize]
