"""The .pt side of the fast path: lay out a new torch zip around records copied from the input."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.output.crc import Check
from ckptfix.formats.pickles import inert_trees, pickling
from ckptfix.formats.torchzip.archive import ALIGN, BLOCK, ZipWriter, stored_crc
from ckptfix.formats.torchzip.layout import storage_name, write_head, write_tail
from ckptfix.formats.torchzip.reader import TorchZip
from ckptfix.stream.copy import SHARE_MIN, Job, new_tuple
from ckptfix.stream.fallback import Fallback, Reason


def _dump(tree: Any) -> tuple[bytes, list[str]]:
    try:
        return pickling.dump_ordered(tree)
    except TypeError as e:
        raise Fallback(Reason.UNPICKLABLE, error=e) from e


@dataclass
class ZipCopy:
    """What to write: headers already laid out by ``writer``, then ``jobs`` to copy and ``checks`` to verify."""

    writer: ZipWriter
    jobs: list[Job] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    crc_slots: list[int] = field(default_factory=list)  # records whose CRC the checks compute
    inlined: int = 0  # bytes of small storages read and written with their headers (not jobs)

    @property
    def copied(self) -> int:
        return sum(j.length for j in self.jobs)


@inert_trees.gc_paused()  # a record, a job and a check per storage: nothing to collect, only to rescan
def plan_torch_to_torch(inp: TorchZip, tree: Any, dst_fd: int) -> ZipCopy:
    """Lay out the new archive: a new data.pkl, then every kept record with its bytes copied verbatim.

    Records stay where they were modulo 4096, so the copy can share blocks: the first record after the new
    pickle takes up the shift in its header padding, and the records after it follow at the same distance: from
    where every record left is kept, the rest of the file is copied as one range, headers and all. torch computes
    where every storage after the first starts from the smallest padding, in the order the pickle refers to them,
    starting from storage "0"; when dropped storages break that order, ``.format_version`` is left out, as older
    torch versions wrote, and torch reads every storage's offset from its header.
    """
    pkl, order = _dump(tree)
    keep = set(order)
    records, data_dir = inp.archive.records, inp.archive.prefix + "data/"
    stored = [rec.name[len(data_dir) :] for rec in records if rec.name.startswith(data_dir)]
    computable = order[:1] in ([], ["0"]) and [key for key in stored if key in keep] == order
    dropped = {data_dir + key for key in stored if key not in keep}
    if not computable:
        dropped.add(inp.archive.prefix + ".format_version")
    plan = ZipCopy(ZipWriter(dst_fd, data_after_finish=True))  # the Copier runs after finish()
    verbatim = len(records)
    while verbatim > 0 and records[verbatim - 1] is not inp.pkl and records[verbatim - 1].name not in dropped:
        verbatim -= 1
    first_storage = True
    for i, rec in enumerate(records):
        shift = plan.writer.offset - rec.header_offset
        if i >= verbatim and shift % BLOCK == 0:
            # every record from here on is kept and stays where it was modulo 4096: one range, headers and all
            plan.writer.adopt(records[i:], shift=shift, end=inp.archive.end)
            plan.jobs.append(Job(rec.header_offset, rec.header_offset + shift, inp.archive.end - rec.header_offset))
            plan.checks += [new_tuple(Check, (r.name, r.data_offset, r.size, stored_crc(r))) for r in records[i:]]
            break
        if rec is inp.pkl:
            # an input saved without CRCs gives an output without them (0, as torch writes): a CRC computed over
            # bytes never checked would vouch for them
            plan.writer.add(rec.name, pkl, zlib.crc32(pkl) if inp.archive.crc_stored else 0, like=rec)
            continue
        if rec.name in dropped:
            continue
        storage = rec.name.startswith(data_dir)
        movable = first_storage or not storage or not computable
        first_storage = first_storage and not storage
        offset = plan.writer.begin(rec.name, rec.size, like=rec, congruent_to=rec.data_offset if movable else None)
        plan.writer.end(rec.crc)
        plan.jobs.append(new_tuple(Job, (rec.data_offset, offset, rec.size)))
        plan.checks.append(new_tuple(Check, (rec.name, rec.data_offset, rec.size, stored_crc(rec))))
    plan.writer.finish(inp.archive.comment)
    return plan


@dataclass
class Source:
    """Bytes ``[offset, offset + length)`` of the input file that become one storage record."""

    offset: int
    length: int


@inert_trees.gc_paused()
def plan_new_torch(
    tree: Any, sources: list[Source], dst_fd: int, *, src_fd: int | None = None, source: str = "input"
) -> ZipCopy:
    """A torch zip laid out as torch.save does, storage ``data/<i>`` copied from ``sources[i]``.

    A storage whose source is 64-byte aligned and long enough to gain is placed at its source offset modulo
    4096, so its copy can share blocks. torch.save's ``.format_version`` record lets torch compute where each
    storage after the first starts, from the smallest padding; when a later storage is padded more, that record
    is left out, as older torch versions wrote, and torch reads every storage's offset from its header.

    With ``src_fd``, a storage of at most 64 KiB that is not placed is read (a window at a time) and written with
    its header: a million tiny tensors then take a few thousand calls instead of four each.
    """
    pkl, _ = _dump(tree)
    plan = ZipCopy(ZipWriter(dst_fd))
    placed = [src.offset if src.length >= SHARE_MIN and src.offset % ALIGN == 0 else None for src in sources]
    write_head(plan.writer, pkl, format_version=all(p is None for p in placed[1:]))
    window = _Reader(src_fd, source) if src_fd is not None else None
    for i, src in enumerate(sources):
        if window is not None and placed[i] is None and src.length <= _INLINE:
            data = window.read(src.offset, src.length)
            plan.writer.add(storage_name(str(i)), data, zlib.crc32(data))
            plan.inlined += len(data)
            continue
        offset = plan.writer.begin(storage_name(str(i)), src.length, congruent_to=placed[i])
        plan.jobs.append(Job(src.offset, offset, src.length))
        # The CRC is known once the bytes have been read: set_crc() patches it in before finish().
        plan.checks.append(Check(storage_name(str(i)), src.offset, src.length, None))
        plan.crc_slots.append(len(plan.writer.records) - 1)
        plan.writer.end(0)
    write_tail(plan.writer)
    return plan


_INLINE = 64 << 10
_READ_AHEAD = 1 << 20


class _Reader:
    """Reads of small ranges in ascending order, served from one read per MiB."""

    def __init__(self, fd: int, source: str) -> None:
        self.fd, self.source, self.at, self.buf = fd, source, 0, b""

    def read(self, offset: int, n: int) -> bytes:
        rel = offset - self.at
        if rel < 0 or rel + n > len(self.buf):
            self.buf, self.at, rel = os.pread(self.fd, max(n, _READ_AHEAD), offset), offset, 0
        data = self.buf[rel : rel + n]
        if len(data) != n:
            raise FormatError(
                f"{self.source}: ends at byte {offset + len(data)} inside a tensor; the file is truncated"
            )
        return data
