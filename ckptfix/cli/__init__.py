"""The ``ckptfix`` command: a thin click layer over the library.

Each command lives in its own module here, imported only when that command runs (``--help`` lists them from
:data:`_COMMANDS` without importing any), and each imports the library inside its body: start-up is Python and
click, so a conversion that shares its blocks takes milliseconds after it. Library errors become one line on
stderr and the exit code of DESIGN.md; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
import warnings
from typing import Any

import click

from ckptfix import __version__
from ckptfix.errors import CkptfixError, as_flags
from ckptfix.formats.output.atomic import TERMINATING, Terminated, completed_outputs, raise_terminated
from ckptfix.torchcompat import without_numpy_warning

# Each command is defined in the module of its name under ckptfix.cli; this is the first sentence of its help, for
# the list in --help (tests/cli/test_group.py checks that they agree).
_COMMANDS = {
    "convert": "Convert checkpoint IN to layout --to and write OUT (format from OUT's extension).",
    "diff": "Compare checkpoints A and B after normalising their layouts.",
    "inspect": "Show format, layout, sizes, dtypes, BatchNorm buffers, shared storage and grouped keys of PATH.",
    "merge": "Merge per-rank checkpoints of one DDP run (buffer sync off), or the rank files of an FSDP2 run, "
    "into OUT.",
    "sanitize": "Write OUT, a copy of torch checkpoint IN that torch.load(weights_only=True) opens, keeping what "
    "is data.",
    "train": "Train the reference model (single device, nn.DataParallel or DDP) and save checkpoints in OUT.",
    "validate": "Check that CKPT loads into the model built by --model with load_state_dict(strict=True).",
}

INTERNAL_ERROR = 3
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a program stopped by Ctrl-C; 128 + N for SIGTERM, SIGHUP
BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `yes | head -1`: the reader of stdout has gone


def _error(message: str) -> None:
    from ckptfix.cli.render import printable

    # One line whatever the message holds: a key with a newline or an escape sequence prints escaped.
    click.echo(printable(message), err=True)


def _stdout_to_devnull() -> None:
    """Send what is still buffered for stdout to /dev/null, so the flush at exit cannot fail once more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test runner's buffer): nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        if cmd_name not in self.commands:
            for command in importlib.import_module(f"ckptfix.cli.{cmd_name}").COMMANDS:
                self.add_command(command)
        return self.commands[cmd_name]

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in _COMMANDS:  # a typo: click's "did you mean" looks among the commands loaded
            for name in _COMMANDS:
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # The sentences shortened as click shortens a command's help (Group.format_commands), no module imported.
        limit = formatter.width - 6 - max(map(len, _COMMANDS))
        rows = [
            (name, click.Command(name, help=text).get_short_help_str(limit)) for name, text in sorted(_COMMANDS.items())
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        from ckptfix.formats.safety.depth import deep_enough

        debug = bool(ctx.params.get("debug"))
        try:
            with deep_enough(), warnings.catch_warnings():  # every command walks trees as deep as the readers accept
                if ctx.params.get("quiet"):  # the library's warnings too: -q leaves errors and --json output
                    warnings.simplefilter("ignore")
                return super().invoke(ctx)
        except CkptfixError as e:
            if debug:  # the traceback, then the same line and exit code as without --debug
                traceback.print_exc()
            _error(f"ckptfix: error: {as_flags(str(e))}")
            ctx.exit(e.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            _error(_stopped("interrupted"))
            ctx.exit(INTERRUPTED)
        except Terminated as e:
            _error(_stopped(str(e)))
            ctx.exit(128 + e.signum)
        except BrokenPipeError:
            # The reader of stdout has exited (`ckptfix diff A B | head -1`): nothing is wrong, stop quietly.
            if debug:
                raise
            _stdout_to_devnull()
            ctx.exit(BROKEN_PIPE)
        except Exception as e:
            if debug:
                traceback.print_exc()
            _error(f"ckptfix: internal error: {type(e).__name__}: {e} (rerun with --debug and report it)")
            ctx.exit(INTERNAL_ERROR)


def _stopped(what: str) -> str:
    # Every temp file has been removed on the way here: each output is complete, or as it was before.
    done = completed_outputs()  # a signal that came after the last rename: say what is there
    return (
        f"ckptfix: {what} after writing {', '.join(done)} in full"
        if done
        else f"ckptfix: {what}; no output was written"
    )


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="ckptfix")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors and --json output; exit codes stay.")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
def cli(quiet: bool, debug: bool) -> None:
    """Make PyTorch checkpoints portable between the ways a model is trained.

    \b
    Key layouts: one device, DataParallel, DDP, torch.compile and their nests.
    Reads .pt/.bin and .safetensors files, transformers and accelerate
    folders, DCP folders, FSDP rank files, DeepSpeed ZeRO runs and
    Megatron-Core torch_dist folders; writes .pt, .safetensors, shards, DCP
    folders and folders transformers' from_pretrained loads. Weights-only
    reads (a checkpoint never runs code), atomic writes.
    Every option, and shell completion: docs/cli.md.

    Exit codes: 0 success; 1 a check found a problem; 2 bad usage or an input that cannot be read safely;
    3 an internal error (a bug in ckptfix: please report it with --debug's traceback); 141 the output was closed
    early (a pipe such as `| head`); 128 + N killed by signal N (SIGTERM: 143), outputs left as they were.
    """


def main() -> None:
    """Console-script entry point."""
    # SIGTERM and SIGHUP (a job scheduler, a closed terminal) unwind like Ctrl-C instead of killing the process
    # mid-write: temp files are removed and the exit status is still 128 + the signal's number.
    for sig in TERMINATING:
        signal.signal(sig, raise_terminated)
    without_numpy_warning()
    try:
        cli.main(prog_name="ckptfix")
    except Terminated as e:  # arrived outside a command: while parsing, or exiting after the outputs are in place
        _error(_stopped(str(e)))
        sys.exit(128 + e.signum)
    finally:
        # Output to a pipe stays buffered until here; a reader that has gone shows up only at this flush.
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _stdout_to_devnull()
            sys.exit(BROKEN_PIPE)
