"""A DCP folder to one .safetensors file in constant memory: the header from DCP's metadata, then each tensor's
bytes straight from its chunks.

A chunk that is a whole range of rows (every FSDP2 ``Shard(0)`` chunk, every unsharded tensor) is a contiguous
byte range of the full tensor: it is copied file to file (``copy_file_range``), never held in memory. Other
chunks (columns, 2-D meshes) are gathered one tensor at a time into a buffer of that tensor's size. Each chunk's
archive is read and CRC-checked by the same reader as a ``.pt`` file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

from ckptfix.checkpoint import Conversion, is_tensor
from ckptfix.errors import FormatError, OutputError
from ckptfix.formats import allowlist, inert
from ckptfix.formats.atomic import atomic_output
from ckptfix.formats.dcp import Chunk, TensorEntry, nest, read_dcp
from ckptfix.formats.dtypes import DTYPES, safetensors_code
from ckptfix.formats.safetensors import encode_header, split_checkpoint
from ckptfix.formats.torchfile import changed_while_reading, file_identity
from ckptfix.formats.torchzip import read_torch_zip
from ckptfix.stream.fallback import Fallback

_COPY = 1 << 26


@dataclass(eq=False)
class DcpTensor:
    """A full tensor of a DCP folder, known from the metadata: its bytes come from its chunks."""

    __ckptfix_tensor__: ClassVar[bool] = True
    key: str
    entry: TensorEntry

    @property
    def dtype(self) -> str:
        return self.entry.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape


class _Files:
    """The folder's data files, each opened once and checked unchanged at the end."""

    def __init__(self) -> None:
        self.open: dict[str, tuple[int, tuple[int, ...]]] = {}

    def fd(self, path: str) -> int:
        if path not in self.open:
            fd = os.open(path, os.O_RDONLY)
            self.open[path] = (fd, file_identity(fd))
        return self.open[path][0]

    def check_unchanged(self) -> None:
        for path, (fd, before) in self.open.items():
            if file_identity(fd) != before:
                raise changed_while_reading(path)

    def close(self) -> None:
        for fd, _ in self.open.values():
            os.close(fd)


def convert_dcp(
    src: str, dst: str, *, transform: Callable[[Any], Conversion], allow_globals: tuple[str, ...] = ()
) -> Conversion:
    """Write the one state dict of DCP folder ``src`` (after ``transform``) as ``dst`` (.safetensors)."""
    d = read_dcp(src)
    allowed = allowlist.allowed_names(allow_globals, source=src)
    files = _Files()
    try:
        flat: dict[str, Any] = {key: DcpTensor(key, entry) for key, entry in d.tensors.items()}
        for key, span in d.values.items():
            z = read_torch_zip(files.fd(span.path), span.path, allowed=allowed, verify=True, start=span.offset,
                               end=span.offset + span.length)  # fmt: skip
            if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert.walk(z.tree)):
                raise Fallback(f"value '{key}' holds tensors or objects, which the torch path rebuilds")
            flat[key] = z.tree
        conversion = transform(nest(flat, d.paths))
        state, meta = split_checkpoint(conversion.obj, out=dst)
        stored = [_stored(dst, key, t) for key, t in state.items()]
        copied = gathered = 0
        with atomic_output(dst) as out:
            out.write(encode_header(state, meta, stored, {}))
            for t in state.values():
                way = _write_tensor(out, t, files, allowed=allowed)
                copied += way == "copied"
                gathered += way == "gathered"
        files.check_unchanged()
    finally:
        files.close()
    conversion.notes.append(
        f"dcp -> safetensors: {len(stored)} tensors, {copied} copied as byte ranges, {gathered} gathered in memory"
    )
    return conversion


def _stored(out: str, key: str, t: Any) -> tuple[str, str, tuple[int, ...], int]:
    if not isinstance(t, DcpTensor):
        what = "a tensor stored as bytes" if is_tensor(t) else type(t).__name__
        raise OutputError(f"{out}: key '{key}' holds {what}, not a tensor; write a .pt file")
    if safetensors_code(t.dtype) is None:
        raise OutputError(f"{out}: key '{key}' has dtype {t.dtype}, which safetensors cannot store; write a .pt file")
    return key, t.dtype, t.shape, t.entry.nbytes


def _rows(entry: TensorEntry, c: Chunk) -> bool:
    """True when the chunk is a whole range of rows: a contiguous byte range of the full tensor."""
    return all(o == 0 for o in c.offsets[1:]) and c.sizes[1:] == entry.shape[1:]


def _chunk_bytes(c: Chunk, files: _Files, *, entry: TensorEntry, key: str, allowed: frozenset[str]) -> tuple[int, int]:
    """The file offset of the chunk's bytes (row-major, contiguous) in its data file, checked against the metadata."""
    fd = files.fd(c.span.path)
    z = read_torch_zip(fd, c.span.path, allowed=allowed, verify=True, start=c.span.offset,
                       end=c.span.offset + c.span.length)  # fmt: skip
    t = z.tree
    if not isinstance(t, inert.InertTensor) or t.shape != c.sizes or t.dtype != entry.dtype or not t.is_contiguous():
        raise FormatError(
            f"{c.span.path}: chunk of '{key}' at {list(c.offsets)} is not a contiguous {entry.dtype} tensor of "
            f"shape {list(c.sizes)}; the folder mixes two checkpoints: copy it again"
        )
    rec = z.archive.by_name[f"{z.archive.prefix}data/{t.storage.key}"]
    return fd, rec.data_offset + t.offset * DTYPES[entry.dtype].itemsize


def _write_tensor(out: BinaryIO, t: DcpTensor, files: _Files, *, allowed: frozenset[str]) -> str:
    entry, item = t.entry, DTYPES[t.entry.dtype].itemsize
    if entry.nbytes == 0:
        return "copied"
    if all(_rows(entry, c) for c in entry.chunks):  # sorted by offsets: rows in order, tiling checked
        for c in entry.chunks:
            fd, at = _chunk_bytes(c, files, entry=entry, key=t.key, allowed=allowed)
            _copy(fd, at, math.prod(c.sizes) * item, out)
        return "copied"
    _gather(out, t, files, allowed=allowed)
    return "gathered"


def _copy(fd: int, at: int, n: int, out: BinaryIO) -> None:
    out.flush()
    dst = out.fileno()
    pos = os.lseek(dst, 0, os.SEEK_CUR)
    while n:
        try:
            done = os.copy_file_range(fd, dst, min(n, _COPY), at, pos)
        except OSError:
            done = 0
        if done <= 0:  # not supported here (another file system): read and write
            data = os.pread(fd, min(n, _COPY), at)
            if not data:
                raise FormatError("a data file ended early while copying; it was truncated while reading")
            done = os.pwrite(dst, data, pos)
        at, pos, n = at + done, pos + done, n - done
    os.lseek(dst, pos, os.SEEK_SET)


def _gather(out: BinaryIO, t: DcpTensor, files: _Files, *, allowed: frozenset[str]) -> None:
    import torch

    from ckptfix.formats.safetensors import tensor_bytes

    entry = t.entry
    dtype = getattr(torch, entry.dtype)
    full = torch.empty(entry.shape, dtype=dtype)  # the bounded buffer: one tensor, never the whole folder
    for c in entry.chunks:
        fd, at = _chunk_bytes(c, files, entry=entry, key=t.key, allowed=allowed)
        buf = bytearray(math.prod(c.sizes) * DTYPES[entry.dtype].itemsize)
        if not buf:
            continue
        os.preadv(fd, [buf], at)
        region = full
        for dim, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True)):
            region = region.narrow(dim, o, s)
        region.copy_(torch.frombuffer(buf, dtype=dtype).reshape(c.sizes))
    out.write(tensor_bytes(full))


__all__ = ["DcpTensor", "convert_dcp"]
