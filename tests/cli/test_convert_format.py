"""``ckptfix convert IN OUT/ --format hf|dcp|safetensors|pt``: a folder OUT's format chosen, and named in "wrote"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.models import PROBE, make_net


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _fits(state: Any) -> None:
    net = make_net(seed=3)
    net.load_state_dict(state, strict=True)
    assert torch.equal(net(PROBE), make_net()(PROBE))


def test_a_folder_without_format_is_a_dcp_folder_and_says_so(tmp_path: Path, ddp_ckpt: Path) -> None:
    result = run("convert", ddp_ckpt, f"{tmp_path / 'out'}/")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"wrote {tmp_path / 'out'}/ (DCP folder)"
    assert (tmp_path / "out" / ".metadata").is_file()
    _fits(ckptfix.load(tmp_path / "out")["model"])


def test_format_safetensors_writes_one_file_in_the_folder(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "st"
    result = run("convert", ddp_ckpt, f"{out}/", "--format", "safetensors", "--model-only")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"wrote {out}/ (safetensors file model.safetensors in the folder)"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    _fits(ckptfix.load(out / "model.safetensors"))


@pytest.mark.parametrize(("fmt", "ext"), [("safetensors", "safetensors"), ("pt", "pt")])
def test_format_with_shard_size_writes_shards_and_an_exact_index(
    tmp_path: Path, ddp_ckpt: Path, fmt: str, ext: str
) -> None:
    out = tmp_path / "shards"
    result = run("convert", ddp_ckpt, f"{out}/", "--format", fmt, "--shard-size", "1kB", "--model-only")
    assert result.exit_code == 0, result.output
    shards = sorted(p.name for p in out.iterdir() if not p.name.endswith(".index.json"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.{ext}"
    index = json.loads((out / f"model.{ext}.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert result.output.splitlines()[-1] == (
        f"wrote {out}/ ({len(shards)} {'torch' if fmt == 'pt' else fmt} shards and their index model.{ext}.index.json)"
    )
    _fits(ckptfix.load(out))


def test_shard_size_alone_still_writes_safetensors_shards_and_names_them(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "hf"
    result = run("convert", ddp_ckpt, f"{out}/", "--shard-size", "1kB", "--model-only")
    assert result.exit_code == 0, result.output
    assert "safetensors shards and their index model.safetensors.index.json)" in result.output.splitlines()[-1]


@pytest.mark.parametrize(
    ("out", "extra", "message"),
    [
        ("x.pt", ["--format", "dcp"], "x.pt: --format dcp writes a folder; end OUT with /"),
        ("x.pt", ["--format", "hf"], "x.pt: --format hf writes a folder; end OUT with /"),
        ("x.pt", ["--format", "safetensors"], "x.pt: its extension says torch, --format says safetensors"),
        ("d/", ["--format", "dcp", "--shard-size", "1kB"], "--shard-size writes transformers shards, --format dcp"),
    ],
)
def test_a_format_that_contradicts_out_is_a_usage_error(
    tmp_path: Path, ddp_ckpt: Path, out: str, extra: list[str], message: str
) -> None:
    result = run("convert", ddp_ckpt, f"{tmp_path}/{out}", *extra)
    assert result.exit_code == 2
    assert message in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp.pt"]


def test_library_call_takes_the_format(tmp_path: Path, ddp_ckpt: Path) -> None:
    result = ckptfix.convert_file(ddp_ckpt, f"{tmp_path / 'lib'}/", format="safetensors", model_only=True)
    assert result.wrote == "safetensors file model.safetensors in the folder"
    _fits(ckptfix.load(tmp_path / "lib" / "model.safetensors"))
