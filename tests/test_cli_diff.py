"""``ckptfix diff`` through the real click group, on per-rank DDP checkpoints (the conftest rank_files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_diff_identical_layout_only_and_different(rank_files: list[Path], tmp_path: Path) -> None:
    assert run("diff", rank_files[0], rank_files[0]).exit_code == 0
    single = tmp_path / "rank0.safetensors"
    ckpt = ckptfix.load(rank_files[0])
    ckptfix.save(ckptfix.convert(ckpt["model"], to="single"), single)
    result = run("diff", rank_files[0], single)
    # the safetensors file holds the model only, so epoch/optimizer/rank exist only in A
    assert "layouts differ (ddp vs single): compared after converting both to single" in result.stdout
    assert "values differ" not in result.stdout and "other entries differ (3):" in result.stdout
    same = tmp_path / "rank0_single.pt"
    ckptfix.save({**ckpt, "model": ckptfix.convert(ckpt["model"], to="single")}, same)
    result = run("diff", rank_files[0], same)
    assert result.exit_code == 0 and result.stdout.endswith("equal\n")
    result = run("diff", rank_files[0], rank_files[1])
    assert result.exit_code == 1 and "values differ (4 of 16 tensors, atol 0, rtol 0):" in result.stdout
    assert "  rank: 0 -> 1" in result.stdout


def test_diff_json(rank_files: list[Path]) -> None:
    result = run("diff", rank_files[0], rank_files[1], "--json", "--atol", "1e-12")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["equal"] is False and report["exit_code"] == 1
    entry = report["entries"][0]
    assert sorted(v["key"] for v in entry["values"]) == [
        f"features.{i}.running_{s}" for i in (1, 4) for s in ("mean", "var")
    ]
    assert all(v["max_abs"] > 0 for v in entry["values"])
    assert report["other"] == [{"path": "rank", "a": "0", "b": "1"}]


def test_diff_prints_hostile_key_names_escaped(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(2), "evil\n\x1b[2Jequal": torch.zeros(2)}, a)
    torch.save({"model": {"w": torch.zeros(2)}, "note\r\nequal": 1}, b)
    result = run("diff", a, b)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert "\x1b" not in result.stdout and "\r" not in result.stdout and "equal" not in lines
    assert lines[2:4] == ["only in A (1):", r"  evil\n\x1b[2Jequal"]
    assert lines[-3:] == ["other entries differ (1):", r"  note\r\nequal: (absent) -> 1", "different"]
