"""Input folders of every kind (transformers shards, accelerate, DCP), and the check that a refused command left
what it reads untouched (no output, no temp file)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.models import make_net, wrap


def _tree_hash(root: Path) -> dict[str, str]:
    """Every file under ``root`` (or ``root`` itself) and its SHA-256: what must not change."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _hf(folder: Path, name: str) -> Path:
    folder.mkdir()
    ckptfix.save(wrap("dp", make_net()).cpu().state_dict(), folder / name, shard_size=600)
    return folder


def _accelerate(folder: Path) -> Path:
    folder.mkdir()
    ckptfix.save(make_net().state_dict(), folder / "model.safetensors")
    torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, folder / "optimizer.bin")
    return folder


def _dcp(folder: Path) -> Path:
    ckptfix.save({"model": make_net().state_dict(), "epoch": 2}, str(folder) + "/")
    return folder


FOLDERS: dict[str, Callable[[Path], Path]] = {
    "hf-safetensors": lambda f: _hf(f, "model.safetensors"),
    "hf-bin": lambda f: _hf(f, "pytorch_model.bin"),
    "accelerate": _accelerate,
    "dcp": _dcp,
}


def _refused(args: list[str], *, reads: Path, out: str) -> str:
    before = _tree_hash(reads)
    listing = sorted(os.listdir(reads if reads.is_dir() else reads.parent))
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    message = result.output.strip()
    assert "\n" not in message and "Traceback" not in message
    assert _tree_hash(reads) == before
    assert sorted(os.listdir(reads if reads.is_dir() else reads.parent)) == listing  # no output, no temp file
    assert out in message
    return message
