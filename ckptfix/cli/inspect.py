"""ckptfix inspect (being written)."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
