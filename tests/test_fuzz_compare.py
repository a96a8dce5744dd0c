"""Fuzzing of the torch-free comparison: ``diff`` and merge's equality check must say what torch's values say.

Two files, each ``torch.save({"w": t})`` of a tensor built from drawn bytes: every dtype torch saves (floats,
bf16 and fp8 where this torch has them, complex, integers, bool), integer extremes and NaN payloads, contiguous,
offset and strided views, neg and conj views, and big-endian files (storages swapped, the byte-order record
edited, spelled in either case). The oracle is ``torch.load``: equal when ``torch.equal`` holds (NaNs in the same
places counting as equal, as ``diff`` documents), and otherwise the max |Δ| torch computes where it is finite.

CI runs a few dozen examples (seconds). A longer campaign:

    CKPTFIX_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/test_fuzz_compare.py -q
"""

from __future__ import annotations

import io
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptfix.diffing import diff_files
from ckptfix.merging.files import merge_files
from tests import hostile
from tests.fuzzing import FUZZ  # one campaign size for every fuzz target (CKPTFIX_FUZZ_EXAMPLES)
from tests.writers import torch_saves

_NAMES = ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "complex64", "complex128", "bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
          "uint32", "uint64"]  # fmt: skip
DTYPES = [getattr(torch, n) for n in _NAMES if torch_saves(n)]  # torch 2.4 and 2.5 cannot save uint16-uint64
NEGATABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
             torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}  # fmt: skip


def _extremes(dtype: torch.dtype) -> list[int]:
    if dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
        return []
    info = torch.iinfo(dtype)
    return [info.min, info.min + 1, -1, 0, 1, info.max - 1, info.max]


def _set(t: torch.Tensor, i: int, value: int) -> None:
    """``t[i] = value`` through its bytes (torch cannot assign uint64's upper half from a Python int)."""
    width = t.element_size()
    raw = value.to_bytes(width, "little", signed=value < 0)
    t.view(torch.uint8).reshape(-1, width)[i] = torch.tensor(list(raw), dtype=torch.uint8)


@st.composite
def _base(draw: Any, dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` elements from drawn bytes (NaN payloads, subnormals, infinities), some set to integer extremes."""
    width = torch.empty((), dtype=dtype).element_size()
    raw = bytearray(draw(st.binary(min_size=n * width, max_size=n * width)))
    if dtype is torch.bool:
        raw = bytearray(b & 1 for b in raw)  # torch's bools are 0 or 1
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).clone() if n else torch.empty(0, dtype=dtype)
    for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=2)) if n and _extremes(dtype) else ():
        _set(t, i, draw(st.sampled_from(_extremes(dtype))))
    return t


def _changed(draw: Any, base: torch.Tensor) -> torch.Tensor:
    """``base`` itself, or with one byte's bits flipped, or one element set to a neighbour or extreme."""
    out = base.clone()
    if not base.numel():
        return out
    how = draw(st.sampled_from(["same", "flip", "extreme", "step"]))
    i = draw(st.integers(0, base.numel() - 1))
    if how == "flip":
        raw = out.view(torch.uint8).reshape(-1)
        j = draw(st.integers(0, raw.numel() - 1))
        raw[j] ^= draw(st.integers(1, 1 if base.dtype is torch.bool else 255))
    elif how == "extreme" and _extremes(base.dtype):
        _set(out, i, draw(st.sampled_from(_extremes(base.dtype))))
    elif how == "step" and not (base.dtype.is_floating_point or base.dtype.is_complex or base.dtype is torch.bool):
        out.view(torch.uint8).reshape(-1, base.element_size())[i, 0] ^= 1  # the value one off, whatever its size
    return out


def _view(t: torch.Tensor, how: str) -> torch.Tensor:
    """A view of ``t``'s storage as drawn: all of it, from an offset, every other element, or transposed."""
    if how == "offset" and t.numel() > 1:
        return t[1:]
    if how == "strided" and t.numel() > 2:
        return t[::2]
    if how == "transposed" and t.numel() >= 4:
        return t[: t.numel() // 2 * 2].reshape(2, -1).t()
    return t


def _with_bit(values: torch.Tensor, bit: str) -> torch.Tensor:
    """A view with ``bit`` set whose values are ``values``'s: its storage holds them before the bit."""
    if bit == "neg" and values.dtype in NEGATABLE:
        return torch._neg_view(torch._neg_view(values).resolve_neg())
    if bit == "conj" and values.dtype.is_complex:
        return values.conj().resolve_conj().conj()
    return values


def _saved(t: torch.Tensor, *, big: str) -> bytes:
    """``torch.save({"w": t})``; ``big`` (a spelling of the record's name) makes it a big-endian file as torch
    would read it: every storage's elements swapped and the byte-order record saying ``big``."""
    buffer = io.BytesIO()
    torch.save({"w": t}, buffer)
    if not big:
        return buffer.getvalue()
    records = []
    for rec in hostile.read_records(buffer.getvalue()):
        if rec.name.endswith("/byteorder"):
            rec = replace(rec, name=rec.name[: -len("byteorder")] + big, data=b"big")
        elif "/data/" in rec.name and rec.data:
            storage = torch.UntypedStorage.from_buffer(bytearray(rec.data), dtype=torch.uint8)
            storage.byteswap(t.dtype)
            rec = replace(rec, data=bytes(storage))
        records.append(rec)
    return hostile.build_zip(records)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's equality, with NaNs in the same places equal (``diff``'s documented rule)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        wide = torch.complex128 if a.dtype.is_complex else torch.float64
        x, y = a.to(wide), b.to(wide)
        return bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())
    return torch.equal(a, b)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The max |Δ| torch computes, where it is a finite number (no NaN or infinity involved)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        wide = torch.complex128 if a.dtype.is_complex else torch.float64
        x, y = a.to(wide), b.to(wide)
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            return None
        found = float((x - y).abs().max())
        return found if math.isfinite(found) else None
    return float(max(abs(int(p) - int(q)) for p, q in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True)))


@FUZZ
@given(data=st.data())
def test_diff_and_merge_agree_with_torchs_values(data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 9))
    base = draw(_base(dtype, n))
    other = _changed(draw, base)
    how = draw(st.sampled_from(["whole", "offset", "strided", "transposed"]))
    sides = []
    for t in (base, other):
        view = _with_bit(_view(t, how), draw(st.sampled_from(["", "neg", "conj"])))
        sides.append(_saved(view, big=draw(st.sampled_from(["", "byteorder", "BYTEORDER", "ByteOrder"]))))
    with tempfile.TemporaryDirectory() as folder:
        fa, fb = Path(folder) / "a.pt", Path(folder) / "b.pt"
        fa.write_bytes(sides[0])
        fb.write_bytes(sides[1])
        a, b = torch.load(fa)["w"], torch.load(fb)["w"]
        expected = _equal(a, b)
        report = diff_files(fa, fb)
        assert report.equal == expected, (dtype, a, b)
        if not expected:
            found = report.entries[0].values[0].max_abs
            want = _max_abs(a, b)
            assert want is None or found == want, (dtype, a, b, found, want)
        merged = merge_files([fa, fb], Path(folder) / "m.pt")
        assert (not merged.diverged) == expected, (dtype, a, b)
