"""A checkpoint folder (DCP, safetensors shards) to one ``.pt`` file in constant memory.

The archive is laid out as ``torch.save`` lays it out (``data.pkl``, then ``data/<i>`` per storage); each storage's
bytes come straight from the folder's files through the same copier as the ``.pt`` fast path (a file system with
shared extents may share them). A zip record needs the CRC of its bytes, which the inputs give for free where they
can: a DCP chunk whose bytes are exactly its archive's storage record has that record's CRC, checked as the input
is verified, and the CRCs of a tensor's row chunks are combined (``crc32_combine``) without a second read. Only
bytes without a CRC (safetensors shards, part of a record) are read for one, on the verifier's threads while the
copy runs; chunks that are not whole rows are gathered one tensor at a time, as for a ``.safetensors`` output.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable
from typing import Any

from ckptfix.formats.dcp.reader import DcpTensor
from ckptfix.formats.deepspeed.tensors import ZeroTensor
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.files import DataFiles
from ckptfix.formats.output.atomic import atomic_output
from ckptfix.formats.output.crc import Check, crc32_combine
from ckptfix.formats.pickles import pickling
from ckptfix.formats.records import map_tree
from ckptfix.formats.safetensors.file import StTensor
from ckptfix.formats.torchzip.archive import ZipWriter
from ckptfix.formats.torchzip.layout import NewStorages, storage_name, write_head, write_tail
from ckptfix.stream.casting import CastTensor, cast_records
from ckptfix.stream.copy import Copier, Job
from ckptfix.stream.folders import InOrder, Stored, VerifyInTurn, copied_ranges, open_tree, prepare, write_made
from ckptfix.transforms.checkpoint import Conversion

# A piece of an output storage: (source file, offset, length) of the bytes copied into it.
Piece = tuple[str, int, int]


def convert_folder_to_torch(
    src: str,
    dst: str,
    *,
    transform: Callable[[Any], Conversion],
    allow_globals: tuple[str, ...] = (),
    optimizer: bool = False,
    dtype: str | None = None,
) -> Conversion:
    """Write the checkpoint of folder ``src`` (DCP, or safetensors shards) after ``transform`` as ``.pt`` ``dst``;
    ``optimizer`` (a DeepSpeed run): ``{"model": …, "optimizer": …}``; ``dtype`` casts the floating-point
    tensors of the model entries as they are written."""
    tree, kind, files, allowed = open_tree(src, allow_globals=allow_globals, optimizer=optimizer)
    try:
        conversion = transform(tree)
        cast = cast_records(conversion, dtype) if dtype is not None else 0
        new_tree, stored = _records(conversion.obj)
        with atomic_output(dst) as out:
            copied, gathered = _write(out.fileno(), new_tree, stored, files, allowed=allowed)
        files.check_unchanged()
    finally:
        files.close()
    conversion.notes.extend(files.notes)
    said = f", {cast} cast to {dtype} a block at a time" if dtype is not None else ""
    conversion.notes.append(
        f"{kind} -> torch: {len(stored)} storages, {copied} copied as byte ranges, {gathered - cast} gathered in "
        f"memory{said}"
    )
    return conversion


def _records(obj: Any) -> tuple[Any, list[Stored]]:
    """``obj`` with each tensor record replaced by the inert tensor torch.save pickles; the storages in order (a
    tensor under two names, tied weights, is one storage, as torch.save writes it)."""
    new = NewStorages(size=lambda t: math.prod(t.shape) * DTYPES[t.dtype].itemsize)
    out = map_tree(obj, new, leaf=(DcpTensor, StTensor, ZeroTensor, CastTensor), exact=False)
    return out, list(new.stored.values())


def _write(fd: int, tree: Any, stored: list[Stored], files: DataFiles, *, allowed: frozenset[str]) -> tuple[int, int]:
    """Lay out the archive (sizes come from the metadata), then parse each tensor's chunk archives while a thread
    copies the ones before it; every record's CRC is filled in once the pieces' CRCs are known."""
    writer = ZipWriter(fd)
    write_head(writer, pickling.dump(tree))
    places = []
    for i, t in enumerate(stored):
        places.append(writer.begin(storage_name(str(i)), math.prod(t.shape) * DTYPES[t.dtype].itemsize))
        writer.end(0)  # the CRC is set below, once the pieces' CRCs are known
    slots = range(len(writer.records) - len(stored), len(writer.records))
    write_tail(writer)
    writer.flush()
    copiers: dict[str, Copier] = {}
    pieces: dict[int, list[Piece]] = {}  # record slot -> its pieces in order
    gathers: list[int] = []  # record slots of gathered storages, in order: their CRCs come from the copy thread

    def work(item: tuple[list[Piece], int] | tuple[Stored, int]) -> int | None:
        what, at = item
        if not isinstance(what, list):  # --dtype's cast, a ZeRO buffer's cast, a DCP tensor gathered: from memory
            sink = Sink(fd, at)
            write_made(sink, what, files)
            return sink.crc
        for path, offset, length in what:
            if path not in copiers:
                copiers[path] = Copier(files.fd(path), fd, source=path)
            copiers[path].copy(Job(offset, at, length))
            at += length
        return None

    copy = InOrder(work)
    verifier: VerifyInTurn | None = None
    try:
        for slot, at, t in zip(slots, places, stored, strict=True):
            prepare(t, files, allowed=allowed)  # a DCP tensor's chunk archives parsed (pickle checked) first
            parts = copied_ranges(t, files)
            if parts is None:
                gathers.append(slot)
            else:
                pieces[slot] = parts
            copy.put((t, at) if parts is None else (parts, at))
        checks = piece_checks(files, pieces)
        verifier = VerifyInTurn(files, checks)
        verifier.start()  # every record's CRC, and those of pieces that are not records, while the copy goes on
        gathered = [crc for crc in copy.finish() if crc is not None]
        crcs = finish_pieces(copiers, verifier, checks)
    finally:
        copy.cancel()
        if verifier is not None:
            verifier.cancel()
    for slot, parts in pieces.items():
        crc = 0
        for path, offset, length in parts:
            crc = crc32_combine(crc, crcs[path, offset, length], length)
        writer.set_crc(slot, crc)
    for slot, crc in zip(gathers, gathered, strict=True):
        writer.set_crc(slot, crc)
    writer.finish()
    return len(pieces), len(gathers)


def finish_pieces(
    copiers: dict[str, Copier], verifier: VerifyInTurn, checks: dict[str, list[Check]]
) -> dict[tuple[str, int, int], int]:
    """Flush every copier (the small pieces it holds back written, the output fsynced), then the CRC of each checked
    piece, by ``(path, offset, length)``, once the verifier has read them all."""
    for copier in copiers.values():
        copier.run([])
    return {
        (path, c.offset, c.length): crc
        for path, got in verifier.join().items()
        for c, crc in zip(checks[path], got, strict=True)
    }


def piece_checks(files: DataFiles, pieces: dict[int, list[Piece]]) -> dict[str, list[Check]]:
    """Per file: its records' checks, and a check to compute for each copied piece that is not exactly a record
    (a piece that is takes that record's checked CRC)."""
    wanted: dict[str, set[tuple[int, int]]] = {}
    for parts in pieces.values():
        for path, offset, length in parts:
            if length:
                wanted.setdefault(path, set()).add((offset, length))
    out: dict[str, list[Check]] = {}
    for path in sorted(set(wanted) | set(files.checks)):
        checks = list(files.checks.get(path, []))
        known = {(c.offset, c.length) for c in checks}
        checks += [Check(f"bytes {o}-{o + n}", o, n, None) for o, n in sorted(wanted.get(path, set()) - known)]
        out[path] = checks
    return out


class Sink:
    """Where a gathered tensor's bytes go: written at the record's data offset, their CRC computed on the way."""

    def __init__(self, fd: int, at: int) -> None:
        self.fd, self.at, self.crc = fd, at, 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        while view:
            n = os.pwrite(self.fd, view, self.at)
            view, self.at = view[n:], self.at + n


__all__ = ["Sink", "convert_folder_to_torch", "piece_checks"]
