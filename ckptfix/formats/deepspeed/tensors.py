"""A ZeRO run's consolidated tensors as records: each a list of byte ranges of its rank files (:class:`Piece`),
computed from the shapes alone (:mod:`.run`, :mod:`.optimizer`), and read by :func:`read_zero_tensor`.

A flat partition is a storage record of an ordinary torch zip, whose bytes are a known range of the file: a
tensor's piece is a range inside one such record (CRC-checked as a whole, once, when it is read).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ckptfix.errors import FormatError
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import FileTable, Holder, TensorRecord, map_tree
from ckptfix.formats.torchzip.archive import Record

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of ``path``, inside storage record ``record`` (CRC-checked as a whole)."""

    path: str
    offset: int
    nbytes: int
    record: Record


@dataclass(eq=False)
class ZeroTensor(TensorRecord):
    """A consolidated tensor of a ZeRO run: its bytes are ``pieces`` in order (dtype ``stored``), cast to ``dtype``
    where zero_to_fp32 casts (a half-precision buffer becomes float32)."""

    streamable: ClassVar[bool] = True

    key: str
    stored: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    origin: str  # "fp32 master", "frozen" (no master copy exists), "buffer", "optimizer state" or "run state"
    cast: str | None = None

    @property
    def dtype(self) -> str:
        return self.cast or self.stored

    @property
    def stored_dtype(self) -> str:
        return self.stored

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def identity(self) -> Hashable:
        # tied names share the one record; the origin keeps a client_state entry apart from a parameter of its name
        return ("zero", self.origin, self.key)

    def _storage(self) -> Hashable:
        return ("zero", self.origin, self.key)

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        return [(p.path, p.offset, p.nbytes) for p in self.pieces if p.nbytes]  # in dtype ``stored``

    def read(self, holder: Holder) -> torch.Tensor:
        """Its pieces read from the rank files ``holder`` opened, each record touched CRC-checked once."""
        return read_zero_tensor(self, holder.file_fd, verified=holder.checked_records)

    streams_bytes: ClassVar[bool] = True

    def write_made(self, write: Callable[[Any], Any], files: FileTable) -> str:
        """A half-precision buffer, cast as zero_to_fp32 does (its CRCs are checked as the copy runs)."""
        from ckptfix.formats.safetensors.file import tensor_bytes

        write(tensor_bytes(read_zero_tensor(self, files.fd)))
        return "gathered"


def piece(t: inert.InertTensor, z: Any, *, path: str, start: int, count: int) -> Piece:
    """Elements ``[start, start + count)`` of contiguous tensor record ``t`` as a byte range of ``path``."""
    rec = z.archive.storage(t.storage.key)
    width = DTYPES[t.dtype].itemsize
    return Piece(path, rec.data_offset + (t.offset + start) * width, count * width, rec)


def check_bytes(tensors: Iterable[ZeroTensor], *, source: str, what: str) -> None:
    """Each tensor's pieces hold exactly its shape's bytes (``what`` names the kind in the message)."""
    for zt in tensors:
        if sum(p.nbytes for p in zt.pieces) != math.prod(zt.shape) * DTYPES[zt.stored].itemsize:
            raise FormatError(
                f"{source}: {what}'{zt.key}' gets {sum(p.nbytes for p in zt.pieces)} bytes "
                f"for shape {list(zt.shape)}; the rank files are from different runs"
            )


def tensors_in(tree: Any) -> list[ZeroTensor]:
    """The :class:`ZeroTensor` records of ``tree``, in order."""
    found: list[ZeroTensor] = []
    map_tree(tree, found.append, leaf=ZeroTensor)
    return found


def read_zero_tensor(t: ZeroTensor, fd_of: Any, *, verified: set[tuple[str, str]] | None = None) -> torch.Tensor:
    """The consolidated tensor in memory of its own: its pieces read and joined, cast where zero_to_fp32 casts.
    ``fd_of(path)`` gives an open file; with ``verified``, each storage record touched is CRC-checked once."""
    import torch

    from ckptfix.formats.torchzip.archive import verify_records

    data = bytearray(sum(p.nbytes for p in t.pieces))
    at = 0
    for p in t.pieces:
        fd = fd_of(p.path)
        if verified is not None and (p.path, p.record.name) not in verified:
            verify_records(fd, p.path, [p.record])
            verified.add((p.path, p.record.name))
        view = memoryview(data)[at : at + p.nbytes]
        done = 0
        while done < p.nbytes:
            n = os.preadv(fd, [view[done:]], p.offset + done)
            if n == 0:
                raise FormatError(f"{p.path}: ends inside '{t.key}'; it is truncated: copy the run folder again")
            done += n
        at += p.nbytes
    stored = getattr(torch, t.stored)
    out = torch.frombuffer(data, dtype=torch.uint8).view(stored) if data else torch.empty(0, dtype=stored)
    out = out.reshape(t.shape)
    return out.to(getattr(torch, t.cast)) if t.cast else out


__all__ = ["Piece", "ZeroTensor", "check_bytes", "piece", "read_zero_tensor", "tensors_in"]
