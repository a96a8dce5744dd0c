"""A DCP folder's chunks are torch.save archives: torch's DCP reader ``torch.load``s each one, so a chunk's byte-order
record swaps its bytes and a conj or neg bit applies to its values. Every path of ckptfix gives those values:
``load`` (the torch path), ``diff`` and ``merge`` (a tensor read at a time), ``convert`` (the stream steps aside).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.diffing import diff_files
from ckptfix.torchcompat import dcp_save_local


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _byteswapped(t: torch.Tensor) -> torch.Tensor:
    width = t.element_size()
    return t.view(torch.uint8).reshape(-1, width).flip(-1).contiguous().view(t.dtype).reshape(t.shape)


def _values() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 6).reshape(2, 3), "i": torch.arange(-2, 3), "h": torch.ones(3).half()}


def _save(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "saving in a single process"
        dcp_save_local(state, checkpoint_id=str(folder))
    return folder


def _save_big_endian(folder: Path) -> Path:
    """The folder dcp.save writes on a big-endian machine: each chunk's ``byteorder`` record says ``big`` and its
    elements are byte-swapped (torch.load swaps them back here)."""
    real = sys.byteorder
    sys.byteorder = "big"  # type: ignore[misc]  # torch.save writes this into each chunk's byteorder record
    try:
        return _save(folder, {k: _byteswapped(v) for k, v in _values().items()})
    finally:
        sys.byteorder = real  # type: ignore[misc]


def _torch_reads(folder: Path) -> dict[str, torch.Tensor]:
    """What torch's own DCP reader gives, into plain tensors of the saved shapes and dtypes."""
    out = {k: torch.empty_like(v) for k, v in _values().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(folder))
    return out


def _assert_values(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    le, be = _save(tmp_path / "le", _values()), _save_big_endian(tmp_path / "be")
    assert (be / "__0_0.distcp").read_bytes().count(b"big") >= 3  # a byteorder record per chunk
    _assert_values(_torch_reads(be), _values())  # torch swaps each chunk's bytes back
    return le, be


def test_load_gives_what_torch_reads_from_big_endian_chunks(folders: tuple[Path, Path]) -> None:
    _, be = folders
    _assert_values(ckptfix.load(be), _values())


def test_diff_finds_a_big_endian_folder_equal_to_the_little_endian_one(folders: tuple[Path, Path]) -> None:
    le, be = folders
    assert diff_files(le, be).equal
    assert run("diff", le, be).exit_code == 0


@pytest.mark.parametrize("out_name", ["out.safetensors", "out.pt"])
@pytest.mark.parametrize("fast", [True, False])
def test_convert_writes_the_values_not_the_swapped_bytes(
    folders: tuple[Path, Path], tmp_path: Path, out_name: str, fast: bool
) -> None:
    _, be = folders
    out = tmp_path / out_name
    ckptfix.convert_file(be, out, fast=fast)
    _assert_values(ckptfix.load(out), _values())


def test_convert_into_a_dcp_folder_writes_the_values(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, be = folders
    out = tmp_path / "out"
    ckptfix.convert_file(be, f"{out}/")
    _assert_values(_torch_reads(out), _values())


def test_convert_cli_says_why_the_stream_steps_aside(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, be = folders
    out = tmp_path / "cli.safetensors"
    result = run("convert", be, out, "-v")
    assert result.exit_code == 0, result.output
    assert "big-endian" in result.output
    _assert_values(ckptfix.load(out), _values())


def test_merge_reads_big_endian_chunks_as_their_values(folders: tuple[Path, Path], tmp_path: Path) -> None:
    le, be = folders
    out = tmp_path / "merged.pt"
    result = run("merge", le, be, "-o", out)
    assert result.exit_code == 0, result.output
    _assert_values(ckptfix.load(out), _values())


MATH_BITS = {"neg": torch._neg_view, "conj": torch.conj}


@pytest.mark.parametrize("bit", list(MATH_BITS))
def test_a_math_bit_chunk_reads_as_torch_reads_it(bit: str, tmp_path: Path) -> None:
    base = torch.tensor([1 + 2j, -3 + 0.5j, 4j])
    view = MATH_BITS[bit](base)
    folder = _save(tmp_path / "bits", {"w": view})
    plain = _save(tmp_path / "plain", {"w": view.resolve_conj().resolve_neg()})
    out = {"w": torch.empty_like(base)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(folder))
    assert torch.equal(out["w"], view) and not torch.equal(out["w"], base)
    assert torch.equal(ckptfix.load(folder)["w"].resolve_conj().resolve_neg(), out["w"])
    assert diff_files(plain, folder).equal
    converted = tmp_path / "out.safetensors"
    assert run("convert", folder, converted).exit_code == 0
    assert torch.equal(ckptfix.load(converted)["w"], out["w"])
