"""The .pt side of the fast path: read a torch zip's pickle inertly, write torch zips around copied records."""

from __future__ import annotations

import os
import secrets
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.safety import ITEMSIZE, STORAGE_DTYPES
from ckptfix.stream import inert
from ckptfix.stream.copy import Check, Job
from ckptfix.stream.fallback import Fallback
from ckptfix.stream.zipfmt import Archive, Record, ZipWriter, read_archive

# The small records torch.save writes besides data.pkl and the storages, in its order.
_HEAD = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_TAIL = (("version", b"3\n"),)


@dataclass
class TorchInput:
    """A torch zip checkpoint, its inert tree and what is needed to copy its records."""

    archive: Archive
    tree: Any
    byteorder: str
    pkl: Record


def _refuse_dangerous(name: str, pkl: bytes, source: str) -> None:
    from ckptfix.formats import safety

    if safety.never_allowable(name):
        needed = safety.scan_pickle(pkl).globals
        safety.refuse_unknown([g for g in needed if safety.never_allowable(g)], allowed=(), source=source)


def read_torch(fd: int, path: str) -> TorchInput:
    """Parse the archive and unpickle ``data.pkl`` inertly (its CRC checked); no tensor byte is read."""
    archive = read_archive(fd, path)
    if not archive.records:
        raise FormatError(f"{path}: zip archive has no records; it is not a torch checkpoint")
    names = [r.name for r in archive.records]
    first = archive.records[0]
    if not first.name.endswith("/data.pkl") or first.name.count("/") != 1:
        raise Fallback(f"data.pkl is not the first record (found '{first.name}')")
    if len(set(names)) != len(names) or any(not n.startswith(archive.prefix) for n in names):
        raise Fallback("archive has duplicated records or records outside its folder")
    if sum(n.endswith(".pkl") for n in names) != 1 or any("/code/" in n for n in names):
        raise Fallback("archive holds more than one pickle (TorchScript or tampered)")
    pkl = os.pread(fd, first.size, first.data_offset)
    if zlib.crc32(pkl) != first.crc:
        raise FormatError(
            f"{path}: record '{first.name}' fails its CRC check (stored {first.crc:08x}, actual "
            f"{zlib.crc32(pkl):08x}); the file is corrupt: re-download or re-save it"
        )
    tree, storages = inert.load(pkl, source=path, on_unknown=lambda name: _refuse_dangerous(name, pkl, path))
    order = archive.get("byteorder")
    byteorder = os.pread(fd, order.size, order.data_offset).decode("ascii", "replace") if order else "little"
    for key, ref in storages.items():
        rec = archive.get(f"data/{key}")
        if rec is None:
            raise FormatError(f"{path}: tensor storage 'data/{key}' is missing from the archive; it is damaged")
        if ref.nbytes != rec.size:
            # torch writes each storage record at exactly its size; anything else is damage or padding for abuse
            raise FormatError(
                f"{path}: record '{rec.name}' holds {rec.size} bytes but its storage needs {ref.nbytes}; "
                f"the file is corrupt"
            )
    return TorchInput(archive, tree, byteorder, first)


def referenced_storages(tree: Any) -> set[str]:
    """Keys of the storages the tree still refers to."""
    return {obj.key for obj in inert.walk(tree) if isinstance(obj, inert.StorageRef)}


@dataclass
class Plan:
    """What to write: headers already laid out by ``writer``, then ``jobs`` to copy and ``checks`` to verify."""

    writer: ZipWriter
    jobs: list[Job] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    crc_slots: list[int] = field(default_factory=list)  # records whose CRC the checks compute

    @property
    def copied(self) -> int:
        return sum(j.length for j in self.jobs)


def plan_torch_to_torch(inp: TorchInput, tree: Any, dst_fd: int) -> Plan:
    """Lay out the new archive: a new data.pkl, then every kept record with its bytes copied verbatim."""
    keep = referenced_storages(tree)
    pkl = inert.dump(tree)
    plan = Plan(ZipWriter(dst_fd))
    data_dir = inp.archive.prefix + "data/"
    for rec in inp.archive.records:
        if rec is inp.pkl:
            plan.writer.add(rec.name, pkl, zlib.crc32(pkl), like=rec)
            continue
        if rec.name.startswith(data_dir) and rec.name[len(data_dir) :] not in keep:
            continue
        offset = plan.writer.begin(rec.name, rec.size, like=rec)
        plan.writer.end(rec.crc)
        plan.jobs.append(Job(rec.data_offset, offset, rec.size))
        plan.checks.append(Check(rec.name, rec.data_offset, rec.size, rec.crc))
    plan.writer.finish(inp.archive.comment)
    return plan


# --- writing a torch zip from tensors held elsewhere (safetensors input) ---------------------------------------


@dataclass
class Source:
    """Bytes ``[offset, offset + length)`` of the input file that become one storage record."""

    offset: int
    length: int


def tensor_record(dtype: str, shape: tuple[int, ...], key: str, nbytes: int) -> inert.InertTensor:
    """The inert tensor torch.save would pickle for a contiguous CPU tensor stored whole in ``data/<key>``."""
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)  # torch's contiguous strides treat a zero-size dim as 1
    legacy = next((name for name, d in STORAGE_DTYPES.items() if d == dtype), None)
    if legacy is not None:
        pid = ("storage", inert.make_global("torch", legacy), key, "cpu", nbytes // ITEMSIZE[dtype])
        args: tuple[Any, ...] = (0, tuple(shape), tuple(reversed(stride)), False, OrderedDict())
        return inert.InertTensor(
            inert.make_global("torch._utils", "_rebuild_tensor_v2"), (inert.StorageRef(pid), *args)
        )
    pid = ("storage", inert.make_global("torch.storage", "UntypedStorage"), key, "cpu", nbytes)
    args = (0, tuple(shape), tuple(reversed(stride)), False, OrderedDict(), inert.make_global("torch", dtype))
    return inert.InertTensor(inert.make_global("torch._utils", "_rebuild_tensor_v3"), (inert.StorageRef(pid), *args))


def plan_new_torch(tree: Any, sources: list[Source], dst_fd: int) -> Plan:
    """A torch zip laid out as torch.save does, storage ``data/<i>`` copied from ``sources[i]``."""
    pkl = inert.dump(tree)
    plan = Plan(ZipWriter(dst_fd))
    prefix = "archive/"
    plan.writer.add(prefix + "data.pkl", pkl, zlib.crc32(pkl))
    for rec_name, data in _HEAD:
        plan.writer.add(prefix + rec_name, data, zlib.crc32(data))
    for i, src in enumerate(sources):
        offset = plan.writer.begin(f"{prefix}data/{i}", src.length)
        plan.jobs.append(Job(src.offset, offset, src.length))
        # The CRC is known once the bytes have been read: set_crc() patches it in before finish().
        plan.checks.append(Check(f"{prefix}data/{i}", src.offset, src.length, None))
        plan.crc_slots.append(len(plan.writer.records) - 1)
        plan.writer.end(0)
    for rec_name, data in _TAIL:
        plan.writer.add(prefix + rec_name, data, zlib.crc32(data))
    ident = "".join(secrets.choice("0123456789") for _ in range(40)).encode()
    plan.writer.add(prefix + ".data/serialization_id", ident, zlib.crc32(ident))
    return plan
