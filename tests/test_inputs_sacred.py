"""No output may be, or sit inside, anything a command reads: refused with exit 2 naming both, before anything is
written, for every folder kind, hard and symbolic links, in the CLI and the library."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import OutputError
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


@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_an_output_inside_an_input_folder_is_refused(tmp_path: Path, kind: str) -> None:
    folder = FOLDERS[kind](tmp_path / "in")
    victims = sorted(p for p in folder.iterdir() if p.is_file())
    for out in [*(str(p) for p in victims), str(folder / "new.pt"), str(folder / "new.safetensors")]:
        for extra in ([], ["--model-only"], ["--no-fast"]):
            message = _refused(["convert", str(folder), out, *extra], reads=folder, out=out)
            if out.endswith((".pt", ".bin", ".safetensors")):  # others (.metadata, .distcp): a bad extension first
                assert str(folder) in message and "inside the input folder" in message


def test_an_index_files_shards_are_inputs_too(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "in", "model.safetensors")
    (index,) = folder.glob("*.index.json")
    shard = next(p for p in sorted(folder.glob("*.safetensors")))
    message = _refused(["convert", str(index), str(shard)], reads=folder, out=str(shard))
    assert "which the input" in message and str(index) in message
    # beside the shards, a new file reads nothing it overwrites: allowed
    result = CliRunner().invoke(cli, ["convert", str(index), str(folder / "single.safetensors"), "--to", "single"])
    assert result.exit_code == 0, result.output


def test_merge_into_a_shard_of_an_input_folder_is_refused(tmp_path: Path) -> None:
    a, b = _hf(tmp_path / "a", "model.safetensors"), _hf(tmp_path / "b", "model.safetensors")
    shard = str(sorted(b.glob("*.safetensors"))[0])
    message = _refused(["merge", str(a), str(b), "-o", shard], reads=b, out=shard)
    assert str(b) in message


@pytest.mark.parametrize("command", ["convert", "sanitize", "merge"])
@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_link_to_the_input_is_the_input(tmp_path: Path, command: str, link: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, src)
    other = tmp_path / "other.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, other)
    out = tmp_path / "alias.pt"
    (os.link if link == "hard" else os.symlink)(src, out)
    args = {"convert": ["convert", str(src), str(out)], "sanitize": ["sanitize", str(src), str(out)],
            "merge": ["merge", str(other), str(src), "-o", str(out)]}[command]  # fmt: skip
    before = src.read_bytes()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert str(out) in result.output and "input" in result.output
    assert src.read_bytes() == before


def test_the_library_refuses_alike(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "in", "model.safetensors")
    before = _tree_hash(folder)
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, folder / "x.pt")
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, str(folder / "dcp") + "/")  # a DCP folder output
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, folder / "sub" / "m.safetensors", shard_size=600)
    with pytest.raises(OutputError, match="holds the input folder"):
        ckptfix.convert_file(folder, str(tmp_path) + "/")
    assert _tree_hash(folder) == before


@pytest.mark.parametrize("command", ["convert", "sanitize", "merge"])
def test_an_existing_output_is_replaced_only_when_asked(tmp_path: Path, command: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, src)
    out = tmp_path / "out.pt"
    out.write_bytes(b"precious")
    args = {"convert": ["convert", str(src), str(out)], "sanitize": ["sanitize", str(src), str(out)],
            "merge": ["merge", str(src), str(src), "-o", str(out)]}[command]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and f"{out}: already exists" in result.output and "--force" in result.output
    assert out.read_bytes() == b"precious"
    result = CliRunner().invoke(cli, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert any(k.endswith("head.weight") for k in torch.load(out, weights_only=True)["model"])


def test_the_library_refuses_an_existing_output_unless_overwrite(tmp_path: Path) -> None:
    src, out = tmp_path / "in.pt", tmp_path / "out.safetensors"
    torch.save(make_net().state_dict(), src)
    out.write_bytes(b"precious")
    for call in (lambda **kw: ckptfix.convert_file(src, out, **kw), lambda **kw: ckptfix.sanitize(src, out, **kw)):
        with pytest.raises(OutputError, match=r"already exists; write to a new path, or pass overwrite=True"):
            call()
        assert out.read_bytes() == b"precious"
    ckptfix.convert_file(src, out, overwrite=True)
    assert "head.weight" in ckptfix.load(out)
