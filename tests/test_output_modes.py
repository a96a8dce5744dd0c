"""Outputs get the mode the umask gives, as ``open``/``mkdir`` would (docs/safety.md): files 0666 & ~umask, folders
(a DCP checkpoint, written in a private staging folder and renamed into place) 0777 & ~umask; an existing empty
folder written into keeps its own mode (issue 32)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def source(tmp_path: Path) -> Path:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, src)
    return src


def convert(*args: str) -> None:
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 0, result.output


def test_file_outputs_follow_the_umask(umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    for name in ("out.safetensors", "out.pt"):
        convert(str(src), str(tmp_path / name))
        assert mode(tmp_path / name) == 0o666 & ~umask, name
    shards = tmp_path / "shards"
    shards.mkdir()
    convert(str(src), str(shards / "model.safetensors"), "--shard-size", "20")
    assert len(list(shards.iterdir())) > 2
    for f in shards.iterdir():
        assert mode(f) == 0o666 & ~umask, f.name


@pytest.mark.parametrize("how", ["convert", "save"])
def test_dcp_folders_follow_the_umask(how: str, umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    for name in ("run_dcp", "hf_dir"):
        out = tmp_path / name
        if how == "convert":  # streamed
            convert(str(src), f"{out}/")
        else:
            ckptfix.save(ckptfix.load(src), f"{out}/")
        assert mode(out) == 0o777 & ~umask, name
        assert os.listdir(out)
        for f in out.iterdir():
            assert mode(f) == 0o666 & ~umask, f.name
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".ckptfix-tmp")]


def test_an_existing_empty_folder_keeps_its_mode(umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    out = tmp_path / "run_dcp"
    out.mkdir()
    out.chmod(0o755)
    convert(str(src), str(out))
    assert mode(out) == 0o755
    out2 = tmp_path / "shared_dcp"
    out2.mkdir()
    out2.chmod(0o2770)  # setgid, group-writable: a team's folder stays one
    ckptfix.save(ckptfix.load(src), str(out2))
    assert mode(out2) == 0o2770
