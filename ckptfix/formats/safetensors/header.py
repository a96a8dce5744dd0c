"""The .safetensors header: the strict reader and the one writer, stdlib only (the streaming path uses both).

The safetensors library accepts duplicate keys (the last wins) and NUL bytes in names; ckptfix refuses both,
along with holes, overlaps, trailing bytes and sizes that do not match dtype × shape, before a tensor byte is
touched. Tensors are listed in data order, by every reader of ckptfix. The header ckptfix writes records in
``__metadata__["ckptfix"]`` (JSON) what :mod:`ckptfix.formats.safetensors.file` splits off a checkpoint.
"""

from __future__ import annotations

import json
import json.encoder
import operator
import os
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.dtypes import DTYPES, FROM_SAFETENSORS, shape_problem
from ckptfix.formats.strict_json import Said, json_object

MAX_HEADER = 100 * 1024 * 1024
_span = operator.itemgetter(0, 1)  # (begin, end) of a (begin, end, name) triple
_json_string = json.encoder.encode_basestring_ascii  # what json.dumps writes a key with (ensure_ascii)


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


_HEADER_SAID = Said(
    duplicate="{e} in the header; the file was not written by a safetensors writer",
    invalid="safetensors header is not valid UTF-8 JSON ({e}); the file is corrupt",
    not_object="safetensors header is not a JSON object; the file is corrupt",
    too_deep="safetensors header nests JSON too deeply; the file is corrupt",
)


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
    parsed = json_object(raw, source=source, said=_HEADER_SAID, utf8=True)
    return _check(parsed, source=source, data_start=8 + length, data_size=size - 8 - length)


def _check(parsed: dict[str, Any], *, source: str, data_start: int, data_size: int) -> Header:
    metadata = parsed.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{source}: safetensors __metadata__ must map strings to strings; the file is corrupt")
    tensors = {name: _entry(name, value, source=source, data_size=data_size) for name, value in parsed.items()}
    # data order, whatever order the JSON lists them; tensors at one offset (zero-size ones) keep the JSON's order,
    # which is the key order ckptfix wrote (a stable sort: never by name)
    spans = sorted(((t.begin, t.end, name) for name, t in tensors.items()), key=_span)
    tensors = {name: tensors[name] for _, _, name in spans}
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
    if unstorable(name):
        raise FormatError(
            f"{source}: a tensor name is empty, contains a NUL byte or is not valid Unicode ({name!r}); refusing"
        )
    if not isinstance(value, dict):
        raise FormatError(f"{where}: entry is not an object; the file is corrupt")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in FROM_SAFETENSORS:
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
    if problem := shape_problem(shape):
        raise FormatError(f"{where}: shape {shape} has {problem}; the file is corrupt or crafted")
    numel = 1
    for d in shape:
        numel *= d
    if numel * _itemsize(dtype) != offsets[1] - offsets[0]:
        raise FormatError(
            f"{where}: {dtype} × {shape} needs {numel * _itemsize(dtype)} bytes but spans "
            f"{offsets[1] - offsets[0]}; the file is corrupt"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def all_storable(keys: Collection[str]) -> bool:
    # one encode for every key (a lone surrogate stays one when joined): a million keys without a call each
    try:
        joined = "/".join(keys)
        joined.encode("utf-8")
    except (UnicodeEncodeError, TypeError):
        return False
    return "\0" not in joined and "" not in keys


def unstorable(name: str) -> str:
    """Why a tensor name cannot be stored in a .safetensors header (that ckptfix reads), or ``""``."""
    if not name:
        return "is empty"
    if "\0" in name:
        return "holds a NUL"
    return "" if _encodable(name) else "is not valid Unicode"


def _itemsize(code: str) -> int:
    return DTYPES[FROM_SAFETENSORS[code]].itemsize


META_KEY = "ckptfix"


LIBRARY_MAX_HEADER = 100_000_000  # the safetensors library's own limit (MAX_HEADER_SIZE in its tensor.rs)


def encode_header(
    state: Mapping[str, Any],
    meta: dict[str, Any],
    stored: Iterable[tuple[str, str, tuple[int, ...], int]],
    aliases: Mapping[str, str],
    *,
    out: str,
    congruent_to: int | None = None,
) -> bytes:
    """The length prefix and padded JSON header for ``stored`` (key, torch dtype name, shape, bytes), in order.

    Shared by the torch writer and the streaming path, so both write byte-identical headers. ``congruent_to``
    (a multiple of 8) pads the header with up to 4 KiB of spaces so that the data buffer starts at an offset
    congruent to it modulo 4096: copied from a source at that offset, the data can share the file system's blocks.
    """
    meta["aliases"] = dict(aliases)
    if aliases:  # restoring aliases appends them; keep the original key order to put them back in place
        meta["keys"] = list(state.keys())
    versions = getattr(state, "_metadata", None)
    if versions is not None:
        meta["module_versions"] = {k: dict(v) for k, v in versions.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", META_KEY: json.dumps(meta)}}
    stored = list(stored)
    for key, _, shape, _ in stored:  # what a .pt output refuses, and a header the library would refuse
        if problem := shape_problem(shape):
            raise OutputError(f"{out}: key '{key}' has shape {list(shape)}, with {problem}; nothing was written")
    if any(key == "__metadata__" for key, *_ in stored):  # replaces the metadata in place: json.dumps decides
        offset = 0
        for key, dtype, shape, nbytes in stored:
            header[key] = {
                "dtype": DTYPES[dtype].safetensors,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
    else:
        # json.dumps(header, separators=(",", ":")) written entry by entry: the same bytes, without a dict and two
        # lists per tensor (keys escaped by json's own encoder; shapes and offsets are ints)
        parts = [json.dumps(header, separators=(",", ":"))[:-1]]
        offset = 0
        for key, dtype, shape, nbytes in stored:
            parts.append(
                f'{_json_string(key)}:{{"dtype":"{DTYPES[dtype].safetensors}","shape":[{",".join(map(str, shape))}],'
                f'"data_offsets":[{offset},{offset + nbytes}]}}'
            )
            offset += nbytes
        raw = (",".join(parts) + "}").encode()
    # The data buffer starts 64-byte aligned (safetensors pads to 8): tensors at multiples of 64 are then aligned
    # as torch.save aligns its records, so a .pt made from this file can share their blocks.
    raw += b" " * (-(8 + len(raw)) % 64)
    if congruent_to is not None and congruent_to % 8 == 0 and len(raw) + 4096 <= LIBRARY_MAX_HEADER:
        raw += b" " * ((congruent_to - 8 - len(raw)) % 4096)
    if len(raw) > LIBRARY_MAX_HEADER:
        raise OutputError(
            f"{out}: its safetensors header would take {len(raw)} bytes, over the {LIBRARY_MAX_HEADER} the "
            f"safetensors library reads; write a .pt file, or a sharded folder"
        )
    return struct.pack("<Q", len(raw)) + raw
