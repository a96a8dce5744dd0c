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

from ckptfix.checkpoint import Conversion
from ckptfix.formats import inert
from ckptfix.formats.atomic import atomic_output
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.torchzip import HEAD, TAIL, stand_ins, tensor_record
from ckptfix.formats.ziparchive import ZipWriter
from ckptfix.stream.copy import Copier, Job
from ckptfix.stream.crc import Check, crc32_combine
from ckptfix.stream.folders import DcpTensor, ShardTensor, _Files, _gather, _locate, _rows, open_tree

_PREFIX = "archive/"
# A piece of an output storage: (source file, offset, length) of the bytes copied into it.
Piece = tuple[str, int, int]


def convert_folder_to_torch(
    src: str, dst: str, *, transform: Callable[[Any], Conversion], allow_globals: tuple[str, ...] = ()
) -> Conversion:
    """Write the checkpoint of folder ``src`` (DCP, or safetensors shards) after ``transform`` as ``.pt`` ``dst``."""
    tree, kind, files, allowed = open_tree(src, allow_globals=allow_globals)
    try:
        conversion = transform(tree)
        new_tree, stored = _records(conversion.obj)
        for t in stored:  # every chunk archive parsed before the first byte out
            if isinstance(t, DcpTensor):
                for c in t.entry.chunks:
                    _locate(c, files, entry=t.entry, key=t.key, allowed=allowed)
        with atomic_output(dst) as out:
            copied, gathered = _write(out.fileno(), new_tree, stored, files)
        files.check_unchanged()
    finally:
        files.close()
    conversion.notes.append(
        f"{kind} -> torch: {len(stored)} storages, {copied} copied as byte ranges, {gathered} gathered in memory"
    )
    return conversion


def _records(obj: Any) -> tuple[Any, list[DcpTensor | ShardTensor]]:
    """``obj`` with each tensor record replaced by the inert tensor torch.save pickles; the storages in order (a
    tensor under two names, tied weights, is one storage, as torch.save writes it)."""
    glob = stand_ins()
    records: dict[int, inert.InertTensor] = {}
    stored: list[DcpTensor | ShardTensor] = []

    def convert(value: Any) -> Any:
        if isinstance(value, (DcpTensor, ShardTensor)):
            if id(value) not in records:
                nbytes = math.prod(value.shape) * DTYPES[value.dtype].itemsize
                records[id(value)] = tensor_record(value.dtype, value.shape, str(len(stored)), nbytes, glob=glob)
                stored.append(value)
            return records[id(value)]
        if isinstance(value, dict):
            new = type(value)((k, convert(v)) for k, v in value.items())
            for name, attr in getattr(value, "__dict__", {}).items():  # an OrderedDict's _metadata
                setattr(new, name, attr)
            return new
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        return value

    return convert(obj), stored


def _write(fd: int, tree: Any, stored: list[DcpTensor | ShardTensor], files: _Files) -> tuple[int, int]:
    """Lay out the archive, copy every storage's pieces, then fill in each record's CRC."""
    writer = ZipWriter(fd)
    pkl = inert.dump(tree)
    writer.add(_PREFIX + "data.pkl", pkl, zlib.crc32(pkl))
    for name, data in HEAD:
        writer.add(_PREFIX + name, data, zlib.crc32(data))
    jobs: dict[str, list[Job]] = {}
    pieces: list[tuple[int, list[Piece]]] = []  # (record slot, its pieces in order)
    direct: list[tuple[int, int]] = []  # (record slot, CRC) of gathered storages
    gathered = 0
    for i, t in enumerate(stored):
        nbytes = math.prod(t.shape) * DTYPES[t.dtype].itemsize
        at = writer.begin(f"{_PREFIX}data/{i}", nbytes)
        writer.end(0)  # the CRC is set below, once the pieces' CRCs are known
        slot = len(writer.records) - 1
        parts = _pieces(t, files)
        if parts is None:
            sink = _Sink(fd, at)
            _gather(sink, t, files)  # type: ignore[arg-type]
            direct.append((slot, sink.crc))
            gathered += 1
            continue
        for path, offset, length in parts:
            jobs.setdefault(path, []).append(Job(offset, at, length))
            at += length
        pieces.append((slot, parts))
    for name, data in TAIL:
        writer.add(_PREFIX + name, data, zlib.crc32(data))
    ident = b"%040d" % (int.from_bytes(os.urandom(17), "big") % 10**40)  # as torch.save: 40 digits (no secrets import)
    writer.add(_PREFIX + ".data/serialization_id", ident, zlib.crc32(ident))
    writer.flush()
    crcs = _copy(fd, jobs, files)
    for slot, parts in pieces:
        crc = 0
        for path, offset, length in parts:
            crc = crc32_combine(crc, crcs[path, offset, length], length)
        writer.set_crc(slot, crc)
    for slot, crc in direct:
        writer.set_crc(slot, crc)
    writer.finish()
    return len(pieces), gathered


def _pieces(t: DcpTensor | ShardTensor, files: _Files) -> list[Piece] | None:
    """The byte ranges that make up ``t`` in order; None when its chunks must be gathered."""
    if isinstance(t, ShardTensor):
        return [(t.path, t.start, t.nbytes)] if t.nbytes else []
    entry, item = t.entry, DTYPES[t.entry.dtype].itemsize
    if entry.nbytes == 0:
        return []
    if not all(_rows(entry, c) for c in entry.chunks):  # sorted by offsets: rows in order, tiling checked
        return None
    out = []
    for c in entry.chunks:
        fd, at = files.located[id(c)]
        out.append((_path_of(files, fd), at, math.prod(c.sizes) * item))
    return out


def _path_of(files: _Files, fd: int) -> str:
    return next(path for path, (opened, _) in files.open.items() if opened == fd)


def _copy(fd: int, jobs: dict[str, list[Job]], files: _Files) -> dict[tuple[str, int, int], int]:
    """Copy each file's jobs, verifying its records' CRCs meanwhile; the CRC of every copied piece.

    A piece that is exactly a record of the file takes that record's (checked) CRC; any other is read for one.
    """
    crcs: dict[tuple[str, int, int], int] = {}
    for path in sorted(set(jobs) | set(files.checks)):
        checks = list(files.checks.get(path, []))
        known = {(c.offset, c.length) for c in checks}
        wanted = {(j.src, j.length) for j in jobs.get(path, []) if j.length}
        checks += [Check(f"bytes {o}-{o + n}", o, n, None) for o, n in sorted(wanted - known)]
        copier = Copier(files.fd(path), fd, source=path)
        got = copier.run(jobs.get(path, []), checks=checks)
        for check, crc in zip(checks, got, strict=True):
            crcs[path, check.offset, check.length] = crc
    return crcs


class _Sink:
    """Where a gathered tensor's bytes go: written at the record's data offset, their CRC computed on the way."""

    def __init__(self, fd: int, at: int) -> None:
        self.fd, self.at, self.crc = fd, at, 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        while view:
            n = os.pwrite(self.fd, view, self.at)
            view, self.at = view[n:], self.at + n


__all__ = ["convert_folder_to_torch"]
