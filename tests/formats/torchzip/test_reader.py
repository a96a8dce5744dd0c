"""ckptfix.formats.torchzip.reader: a torch zip's storage records checked against the tensors that use them."""

from __future__ import annotations

import io
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.conversion.files import convert_file
from ckptfix.diffing import diff_files
from ckptfix.errors import FormatError
from tests import hostile
from tests.entry_points import Expect, refused_everywhere

# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


def with_storage_record(tmp_path: Path, tensor: torch.Tensor, edit: Any, name: str) -> Path:
    """A checkpoint of ``tensor`` whose first storage record's bytes went through ``edit``."""
    good = tmp_path / "good.pt"
    torch.save({"w": tensor}, good)
    src = zipfile.ZipFile(good)
    bad = tmp_path / name
    with zipfile.ZipFile(bad, "w") as zf:
        for info in src.infolist():
            data = src.read(info)
            zf.writestr(info.filename, edit(data) if info.filename.endswith("/data/0") else data)
    return bad


def test_storage_shorter_than_tensor_is_corrupt(tmp_path: Path) -> None:
    bad = with_storage_record(tmp_path, torch.arange(100.0), lambda data: data[:40], "short.pt")
    with pytest.raises(FormatError):
        ckptfix.load(bad)


def test_record_longer_than_its_storage_is_refused(tmp_path: Path) -> None:
    bad = with_storage_record(tmp_path, torch.arange(4.0), lambda data: data + b"\0" * 1_000_000, "padded.pt")
    with pytest.raises(FormatError, match=r"holds 1000016 bytes but its storage needs 16"):
        ckptfix.load(bad)
    with pytest.raises(FormatError):
        convert_file(bad, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


BYPASSES = hostile.storage_bypasses()


@pytest.mark.parametrize("name", list(BYPASSES))
def test_case3_storage_bypasses_are_refused(tmp_path: Path, name: str) -> None:
    refused_everywhere(tmp_path, BYPASSES[name], Expect(FormatError), secret=hostile.SECRET)


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.skipif(
    not hasattr(torch.serialization, "skip_data"), reason=f"torch {torch.__version__} has no serialization.skip_data"
)
def test_a_file_saved_under_skip_data_is_refused_as_what_it_is(tmp_path: Path) -> None:
    src = tmp_path / "skipped.pt"
    with torch.serialization.skip_data():
        torch.save({"w": torch.ones(3), "b": torch.ones(2)}, src)
    message = "saved with skip_data: no tensor bytes"
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out.pt")], ["convert", "--no-fast",
                 str(src), str(tmp_path / "out.safetensors")]):  # fmt: skip
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        assert message in result.output and "CRC" not in result.output
        assert result.output.count("\n") == 1
    with pytest.raises(ckptfix.FormatError, match=message):
        ckptfix.load(src)


# diff and merge compare what torch.load gives, never a cheaper stand-in: a neg or conj view's bytes are not its
# values; a byte-order record torch finds (its lookup ignores case) swaps every storage; integers are compared as
# integers, never after a cast to float64.


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


def _upper_case_big_endian(path: Path) -> Path:
    """A real torch.save file whose byte-order record is renamed ``BYTEORDER`` and says ``big``."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buffer)
    records = hostile.read_records(buffer.getvalue())
    renamed = [
        replace(r, name=r.name[: -len("byteorder")] + "BYTEORDER", data=b"big") if r.name.endswith("/byteorder") else r
        for r in records
    ]
    path.write_bytes(hostile.build_zip(renamed))
    return path


def test_a_byteorder_record_is_found_as_torch_finds_it(tmp_path: Path) -> None:
    le = _save(tmp_path / "le.pt", {"w": torch.arange(4.0)})
    be = _upper_case_big_endian(tmp_path / "be.pt")
    expected = torch.load(be)["w"]
    assert not torch.equal(expected, torch.arange(4.0))  # torch found the record and swapped the bytes
    assert not diff_files(le, be).equal
    assert run("diff", le, be).exit_code == 1
    assert torch.equal(ckptfix.load(be)["w"], expected)
    for fast in (True, False):
        out = tmp_path / f"out{fast}.safetensors"
        ckptfix.convert_file(be, out, fast=fast)
        assert torch.equal(ckptfix.load(out)["w"], expected), fast
    out = tmp_path / "cli.safetensors"
    assert run("convert", be, out).exit_code == 0
    assert torch.equal(ckptfix.load(out)["w"], expected)
    merged = tmp_path / "merged.pt"
    assert run("merge", le, be, "-o", merged).exit_code == 1 and not merged.exists()


def test_a_storage_record_spelled_in_upper_case_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "v": torch.ones(2)}, buffer)
    records = [replace(r, name=r.name.replace("/data/0", "/DATA/0")) for r in hostile.read_records(buffer.getvalue())]
    odd = tmp_path / "odd.pt"
    odd.write_bytes(hostile.build_zip(records))
    expected = torch.load(odd)
    plain = _save(tmp_path / "plain.pt", expected)
    assert diff_files(plain, odd).equal
    assert all(torch.equal(ckptfix.load(odd)[k], v) for k, v in expected.items())
    for fast in (True, False):
        out = tmp_path / f"out{fast}.safetensors"
        ckptfix.convert_file(odd, out, fast=fast)
        assert all(torch.equal(ckptfix.load(out)[k], v) for k, v in expected.items()), fast
