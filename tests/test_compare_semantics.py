"""``diff`` and ``merge`` compare what ``torch.load`` gives, never a cheaper stand-in (issue 32).

A neg or conj view's bytes are not its values; a byte-order record torch finds (its lookup ignores case) swaps
every storage; integers are compared as integers, never after a cast to float64.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.diffing import diff_files
from tests import hostile


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


# -- math bits ------------------------------------------------------------------------------------------------


MATH_BITS = {
    "neg": (torch.arange(4.0), lambda x: torch._neg_view(x)),
    "conj": (torch.tensor([1 + 2j, 3 - 4j]), lambda z: z.conj()),
}


@pytest.mark.parametrize("bit", list(MATH_BITS))
def test_a_math_bit_view_is_compared_by_its_values(bit: str, tmp_path: Path) -> None:
    base, view = MATH_BITS[bit]
    plain = _save(tmp_path / "plain.pt", {"w": base})
    bits = _save(tmp_path / "bits.pt", {"w": view(base)})
    assert not torch.equal(torch.load(plain)["w"], torch.load(bits)["w"])
    report = diff_files(plain, bits)
    assert not report.equal
    assert report.entries[0].values[0].max_abs == pytest.approx(
        float((torch.load(plain)["w"] - torch.load(bits)["w"]).abs().max())
    )
    assert run("diff", plain, bits).exit_code == 1
    # the same values through the bit: equal
    same = _save(tmp_path / "same.pt", {"w": view(view(base).resolve_neg().resolve_conj())})
    assert torch.equal(torch.load(same)["w"], base)
    assert diff_files(plain, same).equal


@pytest.mark.parametrize("bit", list(MATH_BITS))
def test_merge_does_not_call_a_math_bit_view_equal(bit: str, tmp_path: Path) -> None:
    base, view = MATH_BITS[bit]
    plain = _save(tmp_path / "plain.pt", {"w": base})
    bits = _save(tmp_path / "bits.pt", {"w": view(base)})
    out = tmp_path / "merged.pt"
    result = run("merge", plain, bits, "-o", out, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["parameters_match"] is False and not out.exists()
    assert [d["key"] for d in report["diverged"]] == ["w"]


# -- byte order -----------------------------------------------------------------------------------------------


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


# -- integers -------------------------------------------------------------------------------------------------


def _int_dtypes() -> list[torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
    return [getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


def _extremes(dtype: torch.dtype) -> tuple[int, int]:
    if dtype is torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


@pytest.mark.parametrize("a, b", [(2**53, 2**53 + 1), (2**60, 2**60 + 1), (-(2**63), 2**63 - 1)])
def test_int64_values_are_compared_as_integers(a: int, b: int, tmp_path: Path) -> None:
    x = _save(tmp_path / "x.pt", {"w": torch.tensor([a, 0])})
    y = _save(tmp_path / "y.pt", {"w": torch.tensor([b, 0])})
    report = diff_files(x, y)
    assert not report.equal
    assert report.entries[0].values[0].max_abs == float(abs(a - b))
    assert run("diff", x, y).exit_code == 1
    out = tmp_path / "merged.pt"
    result = run("merge", x, y, "-o", out, "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["parameters_match"] is False


@pytest.mark.parametrize("dtype", _int_dtypes(), ids=str)
def test_every_integer_dtype_is_compared_exactly(dtype: torch.dtype, tmp_path: Path) -> None:
    low, high = _extremes(dtype)
    for a, b in [(high, high - 1), (low, high), (low, low + 1)]:
        x = _save(tmp_path / "x.pt", {"w": torch.tensor([a, low, high], dtype=dtype)})
        y = _save(tmp_path / "y.pt", {"w": torch.tensor([b, low, high], dtype=dtype)})
        report = diff_files(x, y)
        assert not report.equal, (dtype, a, b)
        assert report.entries[0].values[0].max_abs == float(abs(a - b)), (dtype, a, b)
        assert diff_files(x, x).equal
        # within a tolerance: integers too
        assert diff_files(x, y, atol=float(abs(a - b))).equal


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
