"""The .safetensors side of the fast path: header in, header out, data ranges copied as they are.

The tree built from a header is the checkpoint ``ckptfix.formats.st.restore`` would return (aliases, key order,
``_metadata``, model entry and extras from the ``ckptfix`` metadata), with :class:`StTensor` records in place
of tensors; writing follows ``ckptfix.formats.st.save_safetensors`` byte for byte in its header.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.checkpoint import is_tensor
from ckptfix.errors import FormatError
from ckptfix.formats.st import DTYPES, META_KEY, restore, split_checkpoint
from ckptfix.stream.fallback import Fallback
from ckptfix.stream.inert import ITEMSIZE

_CODES = {code: name for name, code in DTYPES.items()}
_MAX_HEADER = 100 << 20


@dataclass(eq=False)
class StTensor:
    """A tensor of a safetensors file: its bytes are ``[start, end)`` of the file."""

    __ckptfix_tensor__: ClassVar[bool] = True
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(fd: int, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The raw tensor entries (file order) and ``__metadata__`` of a safetensors file, checked against its size."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise FormatError(f"{path}: shorter than a safetensors header; the file is truncated")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise FormatError(f"{path}: safetensors header of {n} bytes runs past the end of the file; it is truncated")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: safetensors header is not valid JSON ({e}); re-download or re-save it") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object; re-download or re-save it")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    for key, entry in header.items():
        try:
            begin, stop = entry["data_offsets"]
            count = 1
            for s in entry["shape"]:
                count *= int(s)
            width = ITEMSIZE[_CODES[entry["dtype"]]]
        except (KeyError, TypeError, ValueError) as e:
            raise Fallback(f"tensor '{key}' has a header entry the fast path does not read ({e})") from e
        if not (0 <= begin <= stop and base + stop <= size and stop - begin == count * width):
            raise FormatError(
                f"{path}: tensor '{key}' has data offsets outside the file or of the wrong size; it is damaged"
            )
    return header, metadata


def tree_from_header(header: Mapping[str, Any], metadata: Mapping[str, str], base: int, *, source: str) -> Any:
    """The checkpoint the slow reader returns, with StTensor records for tensors."""
    entries = sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[1]["data_offsets"][1]))
    tensors = {
        key: StTensor(
            _CODES[e["dtype"]],
            tuple(int(s) for s in e["shape"]),
            base + e["data_offsets"][0],
            base + e["data_offsets"][1],
        )
        for key, e in entries
    }
    return restore(tensors, metadata, source=source)


@dataclass
class StOutput:
    """A safetensors file to write: its header bytes, then each tensor's bytes from a source range."""

    header: bytes
    ranges: list[tuple[int, int]]  # (source offset, length) in data order

    @property
    def size(self) -> int:
        return len(self.header) + sum(n for _, n in self.ranges)


def plan_safetensors(obj: Any, *, out: str, locate: Any) -> StOutput:
    """Header and data ranges for ``obj`` (a state dict or a checkpoint with one model entry).

    ``locate(value) -> (dtype, shape, source_offset, nbytes, identity)`` finds a tensor's bytes or raises
    Fallback. Mirrors ``save_safetensors``: tied tensors stored once and recorded as aliases.
    """
    state, meta = split_checkpoint(obj, out=out)
    ranges: list[tuple[int, int]] = []
    header: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    seen: dict[Any, str] = {}
    offset = 0
    entries: list[tuple[str, dict[str, Any]]] = []
    for key, value in state.items():
        if not is_tensor(value):
            raise Fallback(f"key '{key}' holds a {type(value).__name__}, not a tensor")
        dtype, shape, src, nbytes, ident = locate(value)
        if dtype not in DTYPES:
            raise Fallback(f"key '{key}' has dtype {dtype}, which the fast path does not write to safetensors")
        if nbytes > 0 and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        entries.append((key, {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}))
        ranges.append((src, nbytes))
        offset += nbytes
    meta["aliases"] = aliases
    if aliases:
        meta["keys"] = list(state.keys())
    versions = getattr(state, "_metadata", None)
    if versions is not None:
        meta["module_versions"] = {k: dict(v) for k, v in versions.items()}
    header["__metadata__"] = {"format": "pt", META_KEY: json.dumps(meta)}
    header.update(entries)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return StOutput(struct.pack("<Q", len(raw)) + raw, ranges)
