"""A checkpoint into a DCP folder without torch: each tensor's bytes copied as byte ranges from its source file.

The folder is what torch's ``FileSystemWriter`` writes from one process with one thread (``__0_0.distcp`` and
``.metadata``): the items of DCP's flattening (:func:`~ckptfix.formats.dcp.metadata.flatten`), each object
as the ``torch.save`` archive of that object, then each tensor as the ``torch.save`` archive of that tensor, whole
and contiguous, one after the other, and the ``Metadata`` pickle that says where each one is. A tensor's archive is
laid out around its bytes (:mod:`~ckptfix.formats.torchzip.layout`), which come from the input's byte ranges
through the same copier as the other streamed routes (in the kernel; a file system with shared extents shares
them); a large tensor's archive starts on a block so that its bytes can keep the input's offset modulo 4096. Only a
DCP tensor stored in blocks and a half-precision ZeRO buffer (cast to float32 as ``zero_to_fp32`` casts) are
gathered in memory, one tensor at a time.

Every storage record's CRC comes from the input: a record copied whole takes the CRC the input stores (checked as
the input is verified), a part of one or a safetensors tensor is read for its CRC on the verifier's thread while
the copy runs, and a tensor of several ranges gets their combination. The folder is put in place only when every
CRC matched and no input changed.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from typing import Any

from ckptfix.formats.dcp.metadata import Item, Stored, TensorMeta, flatten, metadata_pickle
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.files import DataFiles
from ckptfix.formats.output.atomic import staged_folder
from ckptfix.formats.output.crc import crc32_combine
from ckptfix.formats.pickles import inert, inert_trees, pickling
from ckptfix.formats.records import is_streamable
from ckptfix.formats.torchzip.archive import ALIGN, BLOCK, ZipWriter
from ckptfix.formats.torchzip.layout import storage_name, write_head, write_tail
from ckptfix.formats.torchzip.reader import TorchZip, stand_ins, tensor_record
from ckptfix.stream.copy import SHARE_MIN, Copier, Job
from ckptfix.stream.fallback import Fallback, Reason
from ckptfix.stream.folder_torch import Sink, finish_pieces, piece_checks
from ckptfix.stream.folders import VerifyInTurn, copied_ranges, prepare, write_made

DATA_FILE = "__0_0.distcp"
Piece = tuple[str, int, int]


def dcp_items(obj: Any) -> list[Item]:
    """The items DCP writes for ``obj`` (a dict), in its order, its tensors the records a stream reads
    (:func:`~ckptfix.formats.records.is_streamable`; a cast, --dtype, goes through torch's writer: see to_dcp);
    :class:`Fallback` where an object holds a tensor or an object only torch rebuilds (a tuple of tensors, a custom
    class: DCP pickles them whole)."""
    if not isinstance(obj, dict):
        raise Fallback(Reason.NOT_A_DICT, kind=type(obj).__name__)
    items = flatten(obj, is_tensor=is_streamable)
    for item in items:
        if not is_streamable(item.value) and any(
            is_streamable(o) or isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert_trees.walk(item.value)
        ):
            raise Fallback(Reason.CONTAINER_OF_TENSORS, kind=type(item.value).__name__)
    return items


@dataclass
class _Archive:
    """One item's ``torch.save`` archive in the data file: its writer (at ``base``), its storage record's slot and
    data offset (tensors), and how its bytes come (``pieces`` copied, or gathered in memory when None)."""

    item: Item
    writer: ZipWriter
    base: int
    length: int
    meta: TensorMeta | None = None
    at: int = 0
    slot: int = 0
    pieces: list[Piece] | None = None


def write_dcp_folder(
    obj: Any,
    dst: str,
    *,
    files: DataFiles,
    z: TorchZip | None,
    source: str,
    allowed: frozenset[str],
    overwrite: bool = False,
) -> tuple[int, int, int]:
    """Write ``obj`` (a tree of tensor records from ``files``; a ``.pt`` input's are in ``z``) as DCP folder
    ``dst``. Returns how many objects, tensors copied and tensors gathered it wrote. Raises :class:`Fallback`
    before anything is written where the tree holds what only torch writes."""
    items = dcp_items(obj)
    for item in items:
        if is_streamable(item.value):
            prepare(item.value, files, allowed=allowed)  # views refused, chunk archives parsed, CRCs queued
    values = [i for i in items if not is_streamable(i.value)]  # objects first, as torch's writer puts them
    tensors = [i for i in items if is_streamable(i.value)]
    objects = [(i, _object_pickle(i)) for i in values]  # a value torch.save cannot write: before any write
    with staged_folder(dst, overwrite=overwrite) as tmp:
        fd = os.open(os.path.join(tmp, DATA_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            archives = _layout(fd, objects, tensors, files=files, z=z, source=source)
            _fill(fd, archives, files)
            os.fsync(fd)
        finally:
            os.close(fd)
        files.check_unchanged()
        where = {a.item.fqn: a for a in archives}  # the metadata lists the items in the tree's order, as torch's
        stored = [(i, where[i.fqn].meta, Stored(DATA_FILE, where[i.fqn].base, where[i.fqn].length)) for i in items]
        pkl = metadata_pickle(stored, checkpoint_id=os.path.abspath(dst), save_id=str(uuid.uuid4()))
        _write_file(os.path.join(tmp, ".metadata"), pkl)
    copied = sum(a.pieces is not None for a in archives if a.meta is not None)
    return len(objects), copied, len(tensors) - copied


def _object_pickle(item: Item) -> bytes:
    try:
        return pickling.dump(item.value)
    except TypeError as e:
        raise Fallback(Reason.UNPICKLABLE_ENTRY, name=item.fqn, error=e) from e


def _layout(
    fd: int,
    objects: list[tuple[Item, bytes]],
    tensors: list[Item],
    *,
    files: DataFiles,
    z: TorchZip | None,
    source: str,
) -> list[_Archive]:
    """Write every archive's head, records and tail, the objects' whole; each tensor's storage record is left for
    :func:`_fill` (its bytes, then its CRC and the central directory)."""
    archives: list[_Archive] = []
    end = 0
    for item, pkl in objects:
        writer = ZipWriter(fd, base=end)
        write_head(writer, pkl)
        write_tail(writer)
        length = writer.finish()
        archives.append(_Archive(item, writer, end, length))
        end += length
    glob = stand_ins()
    for item in tensors:
        t = item.value
        nbytes = math.prod(t.shape) * DTYPES[t.dtype].itemsize
        pieces = _pieces(t, files, z=z, source=source)
        congruent = None
        if pieces is not None and len(pieces) == 1 and nbytes >= SHARE_MIN and pieces[0][1] % ALIGN == 0:
            congruent = pieces[0][1] % BLOCK  # on a block boundary, the bytes keep the input's place in a block
            end += -end % BLOCK
        writer = ZipWriter(fd, base=end)
        write_head(writer, pickling.dump(tensor_record(t.dtype, t.shape, "0", nbytes, glob=glob)))
        at = writer.begin(storage_name("0"), nbytes, congruent_to=congruent)
        slot = len(writer.records) - 1
        writer.end(0)  # the CRC is set once the pieces' CRCs are known
        write_tail(writer)
        writer.flush()
        length = writer.offset + len(writer.central())
        meta = TensorMeta(t.dtype, tuple(t.shape), bool(t.requires_grad))
        archives.append(_Archive(item, writer, end, length, meta, end + at, slot, pieces))
        end += length
    return archives


def _pieces(t: Any, files: DataFiles, *, z: TorchZip | None, source: str) -> list[Piece] | None:
    """The byte ranges that are ``t``'s values in order; None where they are made in memory."""
    if (record := t.zip_tensor) is not None:  # a .pt's tensor: its bytes in the input's storage record
        assert z is not None  # a .pt record comes from a .pt input
        item = DTYPES[record.dtype].itemsize
        n = math.prod(record.shape) * item
        start = z.archive.storage(record.storage.key).data_offset + record.offset * item
        return [(source, start, n)] if n else []
    return copied_ranges(t, files)


def _fill(fd: int, archives: list[_Archive], files: DataFiles) -> None:
    """Copy or gather each tensor's bytes while a thread reads the inputs' CRCs; then set each storage record's CRC
    and finish its archive."""
    tensors = [a for a in archives if a.meta is not None]
    checks = piece_checks(files, {i: a.pieces for i, a in enumerate(tensors) if a.pieces is not None})
    verifier = VerifyInTurn(files, checks)
    verifier.start()
    gathered: dict[int, int] = {}
    copiers: dict[str, Copier] = {}
    try:
        for i, a in enumerate(tensors):
            if a.pieces is None:
                gathered[i] = _gather_into(fd, a.at, a.item.value, files)
                continue
            at = a.at
            for path, offset, length in a.pieces:
                if path not in copiers:
                    copiers[path] = Copier(files.fd(path), fd, source=path)
                copiers[path].copy(Job(offset, at, length))
                at += length
        crcs = finish_pieces(copiers, verifier, checks)
    finally:
        verifier.cancel()
    for i, a in enumerate(tensors):
        crc = gathered.get(i, 0)
        for path, offset, length in a.pieces or ():
            crc = crc32_combine(crc, crcs[path, offset, length], length)
        a.writer.set_crc(a.slot, crc)
        a.writer.finish()


def _gather_into(fd: int, at: int, t: Any, files: DataFiles) -> int:
    """Write a tensor that is not byte ranges (DCP blocks, a ZeRO buffer cast) at ``at``; returns its CRC."""
    sink = Sink(fd, at)
    write_made(sink, t, files)
    return sink.crc


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["dcp_items", "write_dcp_folder"]
