"""``ckptfix inspect`` through the real click group: the summary as text and JSON, hostile key names escaped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from ckptfix.cli import cli
from tests.models import make_net


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def test_inspect_text_and_json(ddp_ckpt: Path) -> None:
    result = run("inspect", str(ddp_ckpt))
    assert result.exit_code == 0, result.output
    assert "model entry 'model': layout ddp, 16 tensors" in result.output
    assert "BatchNorm statistics: 6 buffers in 2 modules" in result.output
    assert "module.features.{1,4}.{weight,bias,running_mean,running_var,num_batches_tracked}" in result.output
    assert "entry 'epoch': int 4" in result.output
    data = json.loads(run("inspect", str(ddp_ckpt), "--json").output)
    assert data["format"] == "torch-zip"
    model = data["models"]["model"]
    assert model["layout"] == "ddp"
    assert model["tensors"] == 16
    assert model["parameters"] == sum(p.numel() for p in make_net().parameters())
    assert data["other_entries"]["epoch"] == "int 4"


def test_inspect_prints_hostile_key_names_escaped(tmp_path: Path) -> None:
    state = {"conv.weight": torch.zeros(2), "x\x1b]0;pwned\x07.weight": torch.zeros(2)}
    state["y\nentry 'forged'"] = torch.ones(1)
    path = tmp_path / "evil.pt"
    torch.save({"model": state, "note\r\nentry 'forged'": 1}, path)
    result = run("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert not any(c in result.output for c in "\x1b\x07\r")
    lines = result.output.splitlines()
    assert not any(line.startswith("entry 'forged'") for line in lines)
    assert r"entry 'note\r\nentry 'forged'': int 1" in lines
    grouped = r"  {conv,x\x1b]0;pwned\x07}.weight  "
    assert lines[2] == f"{grouped}2 × float32 [2]"
    assert lines[3] == r"  y\nentry 'forged'".ljust(len(grouped)) + "float32 [1]"  # aligned as printed
