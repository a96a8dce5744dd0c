"""Output of the ``ckptfix`` commands: one :class:`Output` per command, told once whether it prints JSON.

A command hands its result to :meth:`Output.result`: the JSON document (the shape the library's result type gives
with its ``to_json``), or, for people, the lines the command renders. Every line a command prints for people goes
through :func:`printable`: a key or path that holds a newline or a terminal escape sequence prints escaped
(``\\n``, ``\\x1b``), so it can neither forge an output line nor reach the terminal raw. ``--json`` output needs
none of it: JSON escapes control characters itself, and it is strict JSON (no ``NaN`` or ``Infinity``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click

from ckptfix.keytree import group_keys

LIST_LIMIT = 12  # one-per-line items before the rest are only counted (--json has them all)


def printable(text: object) -> str:
    """``text`` as one inert line: characters that are not printable are escaped the way ``repr`` does.

    >>> printable("conv.weight\\n\\x1b[2J")
    'conv.weight\\\\n\\\\x1b[2J'
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def quiet() -> bool:
    """Whether ``ckptfix -q`` asked for nothing but errors and ``--json`` output."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and bool(ctx.find_root().params.get("quiet"))


def echo(line: str = "", *, err: bool = False) -> None:
    """Print one line (escaped by :func:`printable`), unless ``-q``."""
    if not quiet():
        click.echo(printable(line), err=err)


def verdict(line: str, colour: str) -> None:
    """Print a command's verdict line with its label (``OK``, ``FAIL``, ``equal``: up to the first ``:``) in
    ``colour`` on a terminal. click leaves the colour out when stdout is not a terminal (a pipe, a file, a test's
    runner), and so does this when ``NO_COLOR`` is set (https://no-color.org)."""
    line = printable(line)
    if quiet():
        return
    if os.environ.get("NO_COLOR"):
        click.echo(line)
        return
    label, colon, rest = line.partition(":")
    click.echo(click.style(label, fg=colour, bold=True) + colon + rest)


def warn(message: str) -> None:
    echo(f"ckptfix: warning: {message}", err=True)


class Output:
    """Where one command's result goes, decided once from its ``--json`` flag: a JSON document on stdout (nothing
    else there), or lines for people (none under ``-q``). Warnings go to stderr either way (:func:`warn`)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def result(self, document: Any, text: Callable[[], None]) -> None:
        """Print ``document`` (a result's ``to_json()``) as JSON, or call ``text`` to print the lines for people."""
        if self.as_json:
            click.echo(json.dumps(document, indent=2, default=str, allow_nan=False))
        else:
            text()

    def finding(self, message: str) -> None:
        """A finding that takes the place of a result (exit 1): a line on stdout for people; on stderr under
        ``--json``, whose stdout holds a report or nothing (docs/json.md)."""
        echo(message, err=self.as_json)


def lines(items: Sequence[str], more: str = "more") -> None:
    """Up to ``LIST_LIMIT`` indented lines, then how many were left out."""
    for item in items[:LIST_LIMIT]:
        echo(f"  {item}")
    if len(items) > LIST_LIMIT:
        echo(f"  … {len(items) - LIST_LIMIT} {more} (use --json for all)")


def section(title: str, keys: Iterable[str]) -> None:
    """``title (n):`` and the keys, grouped (``features.{0,3}.{weight,bias}``); nothing when there are none."""
    keys = list(keys)
    if not keys:
        return
    echo(f"{title} ({len(keys)}):")
    lines(group_keys(keys), "more groups")


def by_change(title: str, changes: dict[str, tuple[Any, Any]], fmt: str) -> None:
    """Keys grouped by the change they share (``[3, 4] -> [5, 4]``), each group brace-compressed."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key, (a, b) in changes.items():
        shown = [list(x) if isinstance(x, tuple) else x for x in (a, b)]
        groups[fmt.format(a=shown[0], b=shown[1])].append(key)
    for change, keys in groups.items():
        section(f"{title}, {change}", keys)
