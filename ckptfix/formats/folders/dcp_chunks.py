"""A DCP folder read a tensor at a time, without torch's reader: each tensor a :class:`~.dcp.DcpTensor`, each chunk's
archive accepted only when it is the contiguous tensor the metadata says."""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.containers.torchzip import TorchZip, read_torch_zip
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.folders.dcp import Chunk, DcpTensor, TensorEntry, gather, nest, read_dcp
from ckptfix.formats.folders.hf import room_for_files
from ckptfix.formats.output.crc import check_crc
from ckptfix.formats.pickles import inert


def dcp_tree(src: str, fd_of: Callable[[str], int], *, allowed: frozenset[str]) -> tuple[Any, str | None]:
    """The checkpoint of DCP folder ``src`` with a :class:`DcpTensor` for each tensor and its small values read
    (``fd_of`` opens each data file once); or None and why the torch path must rebuild it."""
    d = read_dcp(src)
    room_for_files(len(d.files), source=src)  # each data file stays open until the end (checked unchanged then)
    flat: dict[str, Any] = {key: DcpTensor(key, entry) for key, entry in d.tensors.items()}
    for key, span in d.values.items():
        z = read_torch_zip(fd_of(span.path), span.path, allowed=allowed, verify=True, start=span.offset,
                           end=span.offset + span.length)  # fmt: skip
        if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert.walk(z.tree)):
            return None, f"value '{key}' holds tensors or objects, which the torch path rebuilds"
        flat[key] = z.tree
    return nest(flat, d.paths), None


def chunk_record(
    c: Chunk, fd_of: Callable[[str], int], *, entry: TensorEntry, key: str, allowed: frozenset[str]
) -> tuple[TorchZip, inert.InertTensor]:
    """The chunk's parsed archive and tensor record (its pickle checked); refused unless it is the tensor the
    metadata says."""
    z = read_torch_zip(fd_of(c.span.path), c.span.path, allowed=allowed, start=c.span.offset,
                       end=c.span.offset + c.span.length)  # fmt: skip
    t = z.tree
    if not isinstance(t, inert.InertTensor) or t.shape != c.sizes or t.dtype != entry.dtype or not t.is_contiguous():
        raise FormatError(
            f"{c.span.path}: chunk of '{key}' at {list(c.offsets)} is not a contiguous {entry.dtype} tensor of "
            f"shape {list(c.sizes)}; the folder mixes two checkpoints: copy it again"
        )
    return z, t


def rows(entry: TensorEntry, c: Chunk) -> bool:
    """True when the chunk is a whole range of rows: a contiguous byte range of the full tensor."""
    return all(o == 0 for o in c.offsets[1:]) and c.sizes[1:] == entry.shape[1:]


def read_dcp_tensor(t: DcpTensor, fd_of: Callable[[str], int], *, allowed: frozenset[str]) -> Any:
    """The full tensor ``t`` stands for, in memory of its own: each chunk's record read and CRC-checked, the
    chunks copied into place (a tensor stored whole is its one chunk)."""
    import torch

    entry = t.entry
    dtype = getattr(torch, entry.dtype)
    item = DTYPES[entry.dtype].itemsize

    def part(c: Chunk) -> Any:
        z, record = chunk_record(c, fd_of, entry=entry, key=t.key, allowed=allowed)
        rec = z.archive.storage(record.storage.key)
        data = bytearray(rec.size)
        if os.preadv(fd_of(c.span.path), [data], rec.data_offset) != rec.size:
            raise FormatError(f"{c.span.path}: ends inside chunk of '{t.key}'; it is truncated: copy the folder again")
        check_crc(c.span.path, rec.name, rec.crc, zlib.crc32(data))
        n = math.prod(c.sizes)
        start = record.offset * item
        out = (
            torch.frombuffer(data, dtype=torch.uint8)[start : start + n * item].view(dtype).reshape(c.sizes)
            if n
            else torch.empty(c.sizes, dtype=dtype)
        )
        if record.math_bits:  # a conj or neg view: copy_ (or the caller) sees its values
            torch._utils.set_tensor_metadata(out, record.math_bits)  # type: ignore[no-untyped-call]
        return out

    return gather(torch, entry, ((c, part(c)) for c in entry.chunks))


def chunking(t: DcpTensor) -> str:
    """How a DCP tensor is stored: ``2 row chunks in __0_0.distcp, __1_0.distcp`` (for ``inspect``)."""
    kind = "row" if all(rows(t.entry, c) for c in t.entry.chunks) else "block"
    files = sorted({os.path.basename(c.span.path) for c in t.entry.chunks})
    n = len(t.entry.chunks)
    return f"{n} {kind} chunk{'s' * (n != 1)} in {', '.join(files)}"
