"""Folders used carelessly or crafted: files that are not regular files are never opened, names that cannot be
paths are refused by name, in one line with exit 2 and within seconds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.models import make_net


def _sharded(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    ckptfix.save(make_net().state_dict(), folder / "model.safetensors", shard_size=600)
    return folder


def _convert(*args: object) -> tuple[int, str, float]:
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["convert", *map(str, args)])
    return result.exit_code, result.output.strip(), time.perf_counter() - started


def test_a_fifo_named_like_an_index_is_never_opened(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    os.mkfifo(folder / "stray.index.json")  # opening it for reading would wait for a writer forever
    code, output, seconds = _convert(folder, tmp_path / "out.pt")
    assert code == 0, output
    assert seconds < 30
    code, output, _ = _convert(folder / "stray.index.json", tmp_path / "out2.pt")
    assert code == 2 and "\n" not in output and "stray.index.json" in output, output


def test_a_shard_that_is_a_fifo_is_refused_by_name(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    code, output, seconds = _convert(folder, tmp_path / "out.pt")
    assert code == 2 and "\n" not in output and "not a regular file" in output and shard.name in output, output
    assert seconds < 30 and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("name", ["model\u0000.safetensors", "model-\ud800.safetensors"], ids=["nul", "surrogate"])
def test_a_shard_name_that_cannot_be_a_path_is_refused_by_name(tmp_path: Path, name: str) -> None:
    folder = _sharded(tmp_path)
    (index,) = folder.glob("*.index.json")
    data = json.loads(index.read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = name
    index.write_text(json.dumps(data))  # json escapes both: \u0000, \ud800
    for command in (["convert", str(folder), str(tmp_path / "out.pt")], ["inspect", str(folder)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2, result.output
        assert "a name no file can have" in result.output and key in result.output
        assert result.output.count("\n") == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, "not a JSON index"), ('{"weight_map": [1, 2]}', "has no 'weight_map' dict; the index is damaged")],
    ids=["truncated", "weight-map-not-a-dict"],
)
def test_a_damaged_index_is_named_not_called_missing(tmp_path: Path, text: str | None, message: str) -> None:
    folder = _sharded(tmp_path)
    (index,) = folder.glob("*.index.json")
    index.write_text(index.read_text()[:-5] if text is None else text)
    result = CliRunner().invoke(cli, ["inspect", str(folder)])
    assert result.exit_code == 2 and message in result.output and index.name in result.output, result.output
