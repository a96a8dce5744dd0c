"""``ckptfix train`` through the real click group and as a command: one process, and a DDP worker's error."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.training import FIXTURES, SMALL_ARGS, ckptfix_process


def test_cli_train_single(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["train", "--out", str(tmp_path), "--epochs", "1", *SMALL_ARGS])
    assert result.exit_code == 0, result.output
    assert "global batch 32" in result.output
    assert ckptfix.load(tmp_path / "checkpoint.pt")["epoch"] == 1


@pytest.mark.slow
def test_ddp_worker_error_is_one_line_and_exit_code(tmp_path: Path) -> None:
    # The ckptfix.distributed loader refuses a checkpoint that does not fit, on every rank, promptly.
    args = ["--mode", "ddp", "--nproc-per-node", "2", "--out", str(tmp_path), "--norm", "none", *SMALL_ARGS]
    result = ckptfix_process("train", *args, "--resume", str(FIXTURES / "single.pt"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "ckptfix: error: ddp: " in result.stderr
