"""What only a person at a terminal sees: verdicts in colour, and the progress bar's time remaining."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckptfix.cli import cli

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TRAINER = "ckptfix.trainer.model:build_model"
GREEN, RED, YELLOW = "\x1b[32m", "\x1b[31m", "\x1b[33m"

VERDICTS = {  # command line -> the colour of its verdict, the verdict's first word
    "validate-ok": (["validate", FIXTURES / "single.pt", "--model", TRAINER], GREEN, "OK"),
    "validate-layout": (["validate", FIXTURES / "ddp_rank0.pt", "--model", TRAINER], YELLOW, "layout only"),
    "validate-fail": (["validate", FIXTURES / "single.pt", "--model", "tests.models:wrong_head"], RED, "FAIL"),
    "diff-equal": (["diff", FIXTURES / "ddp_wrapped.pt", FIXTURES / "ddp_wrapped.pt"], GREEN, "equal"),
    "diff-different": (["diff", FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"], RED, "different"),
}


def run(args: list[str | Path], *, color: bool) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], color=color)


@pytest.mark.parametrize("case", VERDICTS)
def test_verdicts_are_coloured_on_a_terminal_only(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args, colour, label = VERDICTS[case]
    monkeypatch.delenv("NO_COLOR", raising=False)
    plain = run(args, color=False)  # stdout is not a terminal (a pipe, a file): no escape sequence at all
    assert "\x1b" not in plain.output
    verdicts = [line for line in plain.stdout.splitlines() if line.startswith(label)]
    assert len(verdicts) == 1
    coloured = run(args, color=True)  # as on a terminal
    assert coloured.exit_code == plain.exit_code
    assert f"{colour}\x1b[1m{label}\x1b[0m{verdicts[0][len(label) :]}" in coloured.stdout.splitlines()
    assert coloured.stdout.count("\x1b[0m") == 1  # the verdict's label alone
    monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org: even on a terminal
    assert run(args, color=True).output == plain.output


def test_json_is_never_coloured() -> None:
    result = CliRunner().invoke(cli, ["validate", str(FIXTURES / "single.pt"), "--model", TRAINER, "--json"],
                                color=True)  # fmt: skip
    assert result.exit_code == 0 and "\x1b" not in result.output


def test_the_progress_bar_shows_the_time_remaining(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ckptfix.stream import progress

    kinds = [type(c) for c in progress.columns()]
    assert {BarColumn, DownloadColumn, TransferSpeedColumn, TimeRemainingColumn} <= set(kinds)
    assert kinds[-1] is TimeRemainingColumn  # last, where a person looks for it
    shown: list[Progress] = []
    real = Progress

    def watched(*columns: object, **kwargs: object) -> Progress:
        bar = real(*columns, **kwargs)  # type: ignore[arg-type]
        shown.append(bar)
        return bar

    monkeypatch.setattr("rich.progress.Progress", watched)
    terminal = io.StringIO()
    terminal.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress.progress_bar(progress.THRESHOLD) as advance:
        assert advance is not None
        advance(progress.THRESHOLD // 2)
    (bar,) = shown
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)
    assert bar.console.stderr  # never on stdout, which holds what the command prints (--json)
    with progress.progress_bar(progress.THRESHOLD - 1) as advance:  # small: no bar
        assert advance is None
