"""A strict reader of safetensors headers: every rule checked before a tensor byte is touched.

The safetensors library accepts duplicate keys (the last wins) and NUL bytes in names; ckptfix refuses both,
along with holes, overlaps, trailing bytes and sizes that do not match dtype × shape. Stdlib only, so the
streaming path uses it too.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import FormatError

MAX_HEADER = 100 * 1024 * 1024

# safetensors dtype code -> bytes per element
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: dtype code, shape and its byte span inside the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in file order, string metadata, and where the data buffer starts."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate key '{key}' in the header")
        out[key] = value
    return out


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and check the header of a .safetensors file; raise FormatError naming the first problem."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{source}: too short for a safetensors file ({size} bytes); it is truncated")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER:
                raise FormatError(f"{source}: safetensors header claims {length} bytes (limit {MAX_HEADER}); refusing")
            if 8 + length > size:
                raise FormatError(f"{source}: safetensors header runs past the end of the file; it is truncated")
            raw = f.read(length)
    except OSError as e:
        raise FormatError(f"{source}: cannot read it ({e.strerror})") from e
    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except FormatError as e:
        raise FormatError(f"{source}: {e}; the file was not written by a safetensors writer") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{source}: safetensors header is not valid UTF-8 JSON ({e}); the file is corrupt") from e
    if not isinstance(parsed, dict):
        raise FormatError(f"{source}: safetensors header is not a JSON object; the file is corrupt")
    return _check(parsed, source=source, data_start=8 + length, data_size=size - 8 - length)


def _check(parsed: dict[str, Any], *, source: str, data_start: int, data_size: int) -> Header:
    metadata = parsed.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{source}: safetensors __metadata__ must map strings to strings; the file is corrupt")
    tensors = {name: _entry(name, value, source=source, data_size=data_size) for name, value in parsed.items()}
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items())
    position = 0
    for begin, end, name in spans:
        if begin != position:
            problem = "overlaps the previous tensor" if begin < position else f"leaves a gap at byte {position}"
            raise FormatError(f"{source}: tensor '{name}' {problem}; the file is corrupt")
        position = end
    if position != data_size:
        raise FormatError(
            f"{source}: {data_size - position} bytes after the last tensor; the file is corrupt or was appended to"
        )
    return Header(tensors=tensors, metadata=dict(metadata), data_start=data_start)


def _entry(name: str, value: Any, *, source: str, data_size: int) -> TensorInfo:
    where = f"{source}: tensor '{name}'"
    if "\x00" in name or not name:
        raise FormatError(f"{source}: a tensor name is empty or contains a NUL byte ({name!r}); refusing")
    if not isinstance(value, dict):
        raise FormatError(f"{where}: entry is not an object; the file is corrupt")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise FormatError(f"{where}: unknown dtype {dtype!r}; the file is corrupt or from a newer safetensors")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FormatError(f"{where}: shape {shape!r} is not a list of non-negative integers; the file is corrupt")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise FormatError(f"{where}: data_offsets {offsets!r} fall outside the data buffer; the file is corrupt")
    numel = 1
    for d in shape:
        numel *= d  # Python ints do not overflow; a huge product simply fails the size check below
    if numel * ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise FormatError(
            f"{where}: {dtype} × {shape} needs {numel * ITEMSIZE[dtype]} bytes but spans "
            f"{offsets[1] - offsets[0]}; the file is corrupt"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])
