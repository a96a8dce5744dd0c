"""The ``ckptfix`` command: a thin click layer over the library.

Each command lives in its own module here and imports torch only inside its body, so ``ckptfix --help`` is
instant. Library errors become one line on stderr and the exit code of DESIGN.md; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from ckptfix import __version__
from ckptfix.errors import CkptfixError

# Modules under ckptfix.cli that each define one or more commands in a list named COMMANDS.
_COMMAND_MODULES: list[str] = ["convert", "inspect", "train", "checks"]

INTERNAL_ERROR = 3


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        debug = bool(ctx.params.get("debug"))
        try:
            return super().invoke(ctx)
        except CkptfixError as e:
            if debug:
                raise
            click.echo(f"ckptfix: error: {e}", err=True)
            ctx.exit(e.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("ckptfix: interrupted; no output was written", err=True)
            ctx.exit(130)
        except Exception as e:
            if debug:
                raise
            click.echo(
                f"ckptfix: internal error: {type(e).__name__}: {e} (rerun with --debug and report it)",
                err=True,
            )
            ctx.exit(INTERNAL_ERROR)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="ckptfix")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
def cli(debug: bool) -> None:
    """Make PyTorch checkpoints portable between single-device, DataParallel, DDP and torch.compile.

    Exit codes: 0 success; 1 a check found a problem; 2 bad usage or an input that cannot be read safely.
    """


for _name in _COMMAND_MODULES:
    for _command in importlib.import_module(f"ckptfix.cli.{_name}").COMMANDS:
        cli.add_command(_command)


def main() -> None:
    """Console-script entry point."""
    cli.main(prog_name="ckptfix")
