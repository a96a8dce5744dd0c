"""The zip container of torch checkpoints, read and written the way ``torch.save`` lays it out.

torch stores every record uncompressed with its data 64-byte aligned (the ``FB`` extra field pads the local
header), sizes in a data descriptor after the data, and zip64 extras once a size or an offset reaches 4 GiB.
``torch.load(mmap=True)`` maps tensors straight from those offsets, so a writer that loses the alignment
(Python's ``zipfile`` does) yields files that load silently wrong.

Every zip rule lives in :func:`read_archive`: the records must tile the file from byte 0 to the central
directory with nothing hidden between them (no prepended or concatenated archive, no two entries sharing
bytes), each local header must agree with its central entry (name, flags, method), names must be unique even
ignoring case (torch's reader looks names up case-insensitively), and nothing may be compressed or encrypted.
Stdlib only: no torch here.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter

from ckptfix.errors import FormatError
from ckptfix.formats.output.crc import Check, Verifier, cached

ALIGN = 64
BLOCK = 4096  # the file-system block: ranges congruent modulo it can share blocks when copied
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature .. extra length: 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_SIG_LOCAL, _SIG_CENTRAL, _SIG_EOCD = 0x04034B50, 0x02014B50, 0x06054B50
_SIG_EOCD64, _SIG_LOCATOR, _SIG_DESCRIPTOR = 0x06064B50, 0x07064B50, 0x08074B50
_ZIP64_ID, _PAD_ID = 0x0001, 0x4246  # "FB": torch's padding field
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
FLAG_DESCRIPTOR, FLAG_UTF8 = 0x0008, 0x0800
_FLAGS_MAY_DIFFER = FLAG_DESCRIPTOR | FLAG_UTF8  # writers set these on one header only
_MAX_VERSION = 63  # zip 6.3, as Python's zipfile


@dataclass(slots=True)  # one per storage: a million of them in a big state dict
class Record:
    """One stored file of the archive, as its central directory and local header describe it."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    method: int = 0
    flags: int = FLAG_DESCRIPTOR | FLAG_UTF8
    version_made: int = 0
    version_needed: int = 0
    mtime: int = 0
    mdate: int = 0
    internal_attr: int = 0
    external_attr: int = 0
    comment: bytes = b""
    crc_stored: bool = (
        True  # False in an archive saved without CRCs (see ckptfix.formats.torchzip.reader): never checked
    )


@dataclass
class Archive:
    """The records of a zip in file order, looked up by name in constant time, and the archive comment."""

    records: list[Record]
    comment: bytes = b""
    end: int = 0  # where the records end and the central directory starts
    crc_stored: bool = True  # False: saved without CRCs (every record's is 0), so none can be checked

    def __post_init__(self) -> None:
        first = self.records[0].name if self.records else ""
        self.prefix = first.split("/")[0] + "/" if "/" in first else ""
        self.by_name: dict[str, Record] = dict(zip(map(attrgetter("name"), self.records), self.records, strict=True))
        self._as_torch: dict[str, Record] | None = None

    def get(self, name: str) -> Record | None:
        """The record torch's reader finds for ``name`` (``prefix + name``, ASCII case ignored), if any."""
        found = self.by_name.get(self.prefix + name)
        if found is not None:
            return found
        if self._as_torch is None:  # only a name spelled otherwise than torch.save writes it gets here
            self._as_torch = {torch_name(r.name): r for r in self.records}
        return self._as_torch.get(torch_name(self.prefix + name))

    def storage(self, key: str) -> Record:
        """The record of a torch zip's storage ``key`` (``data/<key>``), found as :meth:`get` finds it."""
        found = self.get(f"data/{key}")
        if found is None:
            raise KeyError(f"data/{key}")  # a bug: read_torch_zip found every storage's record
        return found


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def torch_name(name: str) -> str:
    """The name as torch's reader matches it: miniz's ``mz_zip_reader_locate_file`` without
    ``MZ_ZIP_FLAG_CASE_SENSITIVE`` (how ``PyTorchStreamReader`` finds every record) folds ASCII letters only."""
    return name.translate(_ASCII_LOWER)


def _pread(fd: int, n: int, offset: int, *, path: str, what: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise FormatError(f"{path}: {what} runs past the end of the file; it is truncated, re-download or re-save it")
    return data


def damaged(path: str, what: str) -> FormatError:
    """The one refusal for a zip structure that torch.save never writes."""
    return FormatError(f"{path}: {what}; the archive is damaged or was altered, re-download or re-save it")


def _zip64_fields(extra: bytes, wanted: int) -> list[int]:
    """The first ``wanted`` 8-byte values of the zip64 extra field (sizes, then the header offset)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_ID:
            values = [struct.unpack_from("<Q", extra, pos + 4 + 8 * i)[0] for i in range(min(wanted, length // 8))]
            if len(values) == wanted:
                return values
            break
        pos += 4 + length
    raise ValueError("zip64 extra field missing or short")


def read_archive(fd: int, path: str, *, start: int = 0, end: int | None = None) -> Archive:
    """Parse the end records, the central directory and every local header, reading no record data.

    ``start``/``end`` bound an archive embedded in a larger file (a DCP ``.distcp`` holds one per tensor chunk):
    every rule applies inside the span, and records' offsets are the file's.
    """
    size = os.fstat(fd).st_size if end is None else end
    tail_len = min(size - start, _EOCD.size + _U16)
    tail = _pread(fd, tail_len, size - tail_len, path=path, what="zip end record")
    pos = tail.rfind(struct.pack("<I", _SIG_EOCD))
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise FormatError(
            f"{path}: zip end-of-archive record not found; the file is truncated, re-download or re-save it"
        )
    eocd_offset = size - tail_len + pos
    _, disk, cd_disk, _, count, cd_size, cd_offset, comment_len = _EOCD.unpack_from(tail, pos)
    comment = tail[pos + _EOCD.size : pos + _EOCD.size + comment_len]
    trailing = size - eocd_offset - _EOCD.size - comment_len
    if trailing < 0:  # a comment length past the end of the file: not "-N bytes follow"
        raise damaged(path, f"the zip end record's comment ({comment_len} bytes) runs past the end of the file")
    if trailing:
        raise damaged(path, f"{trailing} bytes follow the zip end record")
    cd_end = eocd_offset
    locator_at = eocd_offset - _LOCATOR.size
    # torch.save always writes the zip64 end records; other writers only when a field overflows
    has_locator = locator_at >= start and os.pread(fd, 4, locator_at) == struct.pack("<I", _SIG_LOCATOR)
    if has_locator or _U32 in (cd_size, cd_offset) or count == _U16:
        loc = _LOCATOR.unpack(_pread(fd, _LOCATOR.size, locator_at, path=path, what="zip64 locator"))
        if loc[0] != _SIG_LOCATOR:
            raise damaged(path, "zip64 locator missing")
        rec = _EOCD64.unpack(_pread(fd, _EOCD64.size, start + loc[2], path=path, what="zip64 end record"))
        if rec[0] != _SIG_EOCD64 or start + loc[2] + _EOCD64.size != locator_at:
            raise damaged(path, "zip64 end record missing or not where its locator says")
        disk, cd_disk, count, cd_size, cd_offset = rec[4], rec[5], rec[7], rec[8], rec[9]
        cd_end = start + loc[2]
    if disk or cd_disk:
        raise damaged(path, "multi-disk zip archive")
    cd_offset += start
    if cd_offset + cd_size != cd_end:
        # a prepended or concatenated archive, or bytes hidden before the end records
        raise damaged(path, f"central directory at byte {cd_offset} does not end where the end record starts")
    cd = _pread(fd, cd_size, cd_offset, path=path, what="central directory")
    records = _parse_central(fd, cd, count, path=path, cd_offset=cd_offset, base=start)
    records.sort(key=attrgetter("header_offset"))
    _check_tiling(records, cd_offset, path=path, start=start)
    return Archive(records=records, comment=comment, end=cd_offset)


def _check_tiling(records: list[Record], cd_offset: int, *, path: str, start: int) -> None:
    """Records must follow each other from byte 0 to the central directory: nothing hidden, nothing shared."""
    at = start
    seen: dict[str, str] = {}
    for rec in records:
        folded = torch_name(rec.name)
        if folded in seen:
            raise damaged(path, f"record names '{seen[folded]}' and '{rec.name}' are the same to torch's reader")
        seen[folded] = rec.name
        if rec.header_offset != at and not _descriptor_gap(rec.header_offset - at):
            raise damaged(path, f"record '{rec.name}' starts at byte {rec.header_offset}, expected {at}")
        at = rec.data_offset + rec.size
    if at != cd_offset and not _descriptor_gap(cd_offset - at):
        raise damaged(path, f"{cd_offset - at} unaccounted bytes before the central directory")


def _descriptor_gap(gap: int) -> bool:
    # a data descriptor after the data: crc and two sizes of 4 or 8 bytes, with or without its signature
    return gap in (12, 16, 20, 24)


def _parse_central(fd: int, cd: bytes, count: int, *, path: str, cd_offset: int, base: int) -> list[Record]:
    """Every central directory entry, checked against its local header.

    One loop without a call per entry beyond what each must do: a checkpoint of a million small tensors has a
    million of them. Only a record that breaks a rule, or needs its zip64 sizes, costs a call more.
    """
    entries = _central_entries(cd, count, path=path, cd_offset=cd_offset)
    headers = _LocalHeaders(fd, path, sorted([e[0][16] + base for e in entries]))
    unpack_local = _LOCAL.unpack_from
    records: list[Record] = []
    for fields, start in entries:
        made, needed, flags, method, mtime, mdate, crc, csize, usize, name_len, extra_len, comment_len = fields[1:13]
        iattr, eattr, offset = fields[14:]
        raw_name = cd[start : start + name_len]
        try:
            name = raw_name.decode("utf-8" if flags & FLAG_UTF8 else "cp437")
        except UnicodeDecodeError as e:
            raise damaged(path, f"a record name is not valid UTF-8 ({e})") from e
        if usize == _U32 or csize == _U32 or offset == _U32:
            extra = cd[start + name_len : start + name_len + extra_len]
            usize, csize, offset = _zip64_sizes(extra, usize, csize, offset, name=name, path=path)
        offset += base
        if method != 0 or csize != usize or flags & 0x1 or needed > _MAX_VERSION:
            raise _refusal(path, name, method=method, compressed=csize != usize, flags=flags, needed=needed)
        buf, rel = headers.buf, offset - headers.at
        if rel < 0 or rel + _LOCAL.size > len(buf):  # not in the window read last: read the next one
            headers.read(_LOCAL.size, offset, what=f"local header of record '{name}'")
            buf, rel = headers.buf, 0
        lsig, _, lflags, lmethod, _, _, _, _, _, lname_len, lextra_len = unpack_local(buf, rel)
        if lsig != _SIG_LOCAL:
            raise damaged(path, f"record '{name}' has no local header at byte {offset}")
        lname = buf[rel + _LOCAL.size : rel + _LOCAL.size + lname_len]
        if len(lname) != lname_len:
            lname = headers.read(lname_len, offset + _LOCAL.size, what=f"name of record '{name}'")
        # readers differ on which header they believe: any disagreement is a sign of tampering
        if lmethod != method or (lflags & ~_FLAGS_MAY_DIFFER) != (flags & ~_FLAGS_MAY_DIFFER) or lname != raw_name:
            raise _disagreement(path, name, flags=(lflags, flags), method=(lmethod, method), local_name=lname)
        data_offset = offset + _LOCAL.size + lname_len + lextra_len
        if data_offset + usize > cd_offset:
            raise FormatError(f"{path}: record '{name}' runs past the end of the data; the file is truncated")
        comment = cd[start + name_len + extra_len : start + name_len + extra_len + comment_len] if comment_len else b""
        records.append(
            Record(
                name, offset, data_offset, usize, crc, method, flags, made, needed, mtime, mdate, iattr, eattr, comment
            )
        )
    return records


def _central_entries(cd: bytes, count: int, *, path: str, cd_offset: int) -> list[tuple[tuple[int, ...], int]]:
    """The fields of each of the ``count`` central directory entries, and where its name starts in ``cd``."""
    entries: list[tuple[tuple[int, ...], int]] = []
    unpack_central = _CENTRAL.unpack_from
    pos, cd_len = 0, len(cd)
    for _ in range(count):
        if pos + _CENTRAL.size > cd_len:
            raise damaged(path, "central directory is shorter than its entry count")
        fields = unpack_central(cd, pos)
        if fields[0] != _SIG_CENTRAL:
            raise damaged(path, f"bad central directory entry at byte {cd_offset + pos}")
        entries.append((fields, pos + _CENTRAL.size))
        pos += _CENTRAL.size + fields[10] + fields[11] + fields[12]
    return entries


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int, *, name: str, path: str) -> tuple[int, int, int]:
    """The sizes and header offset with each one the central entry marks as wide (0xFFFFFFFF) read from ``extra``."""
    wide = [v for v in (usize, csize, offset) if v == _U32]
    try:
        values = iter(_zip64_fields(extra, len(wide)))
    except ValueError as e:
        raise damaged(path, f"record '{name}' lacks its zip64 sizes") from e
    usize = next(values) if usize == _U32 else usize
    csize = next(values) if csize == _U32 else csize
    offset = next(values) if offset == _U32 else offset
    return usize, csize, offset


def _refusal(path: str, name: str, *, method: int, compressed: bool, flags: int, needed: int) -> FormatError:
    """The first rule a record breaks of those torch.save never does: compressed, encrypted, a zip past 6.3."""
    if method != 0 or compressed:
        return FormatError(
            f"{path}: record '{name}' is compressed; torch.save never compresses, so the file was altered; "
            f"refusing it before decompressing"
        )
    if flags & 0x1:
        return FormatError(f"{path}: record '{name}' is encrypted; refusing it")
    return damaged(path, f"record '{name}' needs zip version {needed / 10:.1f}")


def _disagreement(
    path: str, name: str, *, flags: tuple[int, int], method: tuple[int, int], local_name: bytes
) -> FormatError:
    """A local header that says otherwise than its central entry (``flags`` and ``method``: local, central)."""
    return damaged(
        path,
        f"record '{name}': local header disagrees with the central directory (flags {flags[0]:#x} vs "
        f"{flags[1]:#x}, method {method[0]} vs {method[1]}, name {local_name!r})",
    )


class _LocalHeaders:
    """Local headers read a window at a time: the headers of small records share one read instead of two each.

    A window spans from the header asked for to the last header that starts within :data:`_WINDOW` bytes of it
    (plus room for its name), so the records of a big checkpoint cost one small read each, as before.
    """

    def __init__(self, fd: int, path: str, offsets: list[int]) -> None:
        self.fd, self.path, self.offsets = fd, path, offsets
        self.buf, self.at = b"", 0

    def read(self, n: int, offset: int, *, what: str) -> bytes:
        rel = offset - self.at
        if rel < 0 or rel + n > len(self.buf):
            i = bisect.bisect_right(self.offsets, offset + _WINDOW) - 1  # the last header within the window
            span = max(n, min(self.offsets[i] - offset + _HEADER_ROOM, _WINDOW) if i >= 0 else n)
            self.buf, self.at, rel = os.pread(self.fd, span, offset), offset, 0
        data = self.buf[rel : rel + n]
        if len(data) != n:
            raise FormatError(
                f"{self.path}: {what} runs past the end of the file; it is truncated, re-download or re-save it"
            )
        return data


_WINDOW = 64 << 10
_HEADER_ROOM = 1024  # a local header and a name of up to ~1 KB, read with the window


NO_CRC = "no CRC stored: bytes not verified"  # what inspect and convert -v say of an archive saved without CRCs


def stored_crc(rec: Record) -> int | None:
    """The CRC ``rec``'s bytes must have; None in an archive saved without CRCs (the bytes are read unchecked)."""
    return rec.crc if rec.crc_stored else None


def without_crcs(archive: Archive) -> None:
    """Mark ``archive`` as saved without CRCs: its records' bytes are read as torch reads them, unchecked."""
    archive.crc_stored = False
    for rec in archive.records:
        rec.crc_stored = False


def verify_records(fd: int, path: str, records: list[Record]) -> None:
    """Read every record once and check its CRC (on threads, mapped where the page cache holds the file: a
    1.6 GB checkpoint in 0.1 s here against 0.65 s through one zlib loop); the first bad record is named."""
    if not records:
        return
    # A file the page cache holds is hashed on up to four threads (nothing else runs meanwhile); a cold one is
    # read front to back by one, the fastest way through it.
    warm = cached(fd, min(r.data_offset for r in records), max(r.data_offset + r.size for r in records))
    checks = [Check(r.name, r.data_offset, r.size, stored_crc(r)) for r in records]
    verifier = Verifier(fd, checks, source=path, workers=min(os.cpu_count() or 1, 4) if warm else None)
    verifier.start()
    verifier.more()
    verifier.join()


class ZipWriter:
    """Write records torch's way at explicit offsets of an open file descriptor, then the central directory."""

    def __init__(self, fd: int, *, data_after_finish: bool = False, base: int = 0) -> None:
        """``data_after_finish``: every record's data is written after :meth:`finish` (as the pt→pt plan does), so
        the gaps left for small records may be filled with zeros meanwhile and the headers around them go out in
        one write instead of one each. ``base``: where the archive starts in the file (a DCP ``.distcp`` file holds
        one archive per tensor, one after the other); every offset here, and in the archive, is from there."""
        self.fd = fd
        self.base = base
        self.offset = 0
        self.records: list[Record] = []
        # headers, descriptors and the central directory are small and mostly back to back: they are gathered
        # and written in one call per run of adjacent bytes (a million records, a few thousand writes)
        self._pending = bytearray()
        self._pending_at = 0
        self._fill = _FILL_MAX if data_after_finish else 0

    def begin(self, name: str, size: int, *, like: Record | None = None, congruent_to: int | None = None) -> int:
        """Write the local header of a record of ``size`` bytes; returns the (64-aligned) data offset.

        ``congruent_to`` (a 64-aligned source offset) places the data at an offset congruent to it modulo 4096,
        with up to 4 KiB more padding, so that a copy from that source can share the file system's blocks. Only
        for records torch finds through their own header: it computes where every storage after the first one
        starts from the smallest padding (``torch.utils.serialization.config.load.calculate_storage_offsets``).
        """
        raw_name = name.encode("utf-8")
        zip64 = b""
        if size >= _U32:
            zip64 = struct.pack("<HHQQ", _ZIP64_ID, 16, size, 0)
        elif self.offset >= _U32:
            zip64 = struct.pack("<HHQ", _ZIP64_ID, 8, self.offset)
        start = self.offset + _LOCAL.size + len(raw_name) + len(zip64) + 4
        pad = -start % ALIGN
        if congruent_to is not None and congruent_to % ALIGN == 0:
            pad = (congruent_to - start) % BLOCK
        extra = zip64 + (_PAD_FIELDS.get(pad) or _pad_field(pad))
        base = like or _PLAIN
        flags = base.flags | FLAG_DESCRIPTOR
        header = _LOCAL.pack(
            _SIG_LOCAL, base.version_needed, flags, 0, base.mtime, base.mdate, 0, 0, 0, len(raw_name), len(extra)
        )
        self._write(header + raw_name + extra)
        data_offset = self.offset
        self.records.append(
            Record(
                name,
                data_offset - len(header) - len(raw_name) - len(extra),
                data_offset,
                size,
                0,
                0,
                flags,
                base.version_made,
                base.version_needed,
                base.mtime,
                base.mdate,
                base.internal_attr,
                base.external_attr,
                base.comment,
            )
        )
        return data_offset

    def end(self, crc: int) -> None:
        """Close the record whose data (``size`` bytes) was written at its data offset: the data descriptor."""
        rec = self.records[-1]
        rec.crc = crc
        self.offset = rec.data_offset + rec.size
        wide = rec.size >= _U32 or rec.header_offset >= _U32
        self._write((_DESCRIPTOR64 if wide else _DESCRIPTOR).pack(_SIG_DESCRIPTOR, crc, rec.size, rec.size))

    def adopt(self, records: list[Record], *, shift: int, end: int) -> None:
        """Take ``records`` whose headers, data and descriptors are copied verbatim, ``shift`` bytes further on.

        They must follow the last record written and end at ``end`` in their own file (its central directory);
        only their central entries are written here, by :meth:`finish`.
        """
        self.records += [
            Record(
                r.name,
                r.header_offset + shift,
                r.data_offset + shift,
                r.size,
                r.crc,
                r.method,
                r.flags,
                r.version_made,
                r.version_needed,
                r.mtime,
                r.mdate,
                r.internal_attr,
                r.external_attr,
                r.comment,
            )
            for r in records
        ]
        self.offset = end + shift

    def set_crc(self, index: int, crc: int) -> None:
        """Fill in the CRC of record ``index`` once its bytes are known (its descriptor is rewritten)."""
        rec = self.records[index]
        rec.crc = crc
        saved = self.offset
        self.offset = rec.data_offset + rec.size + 4
        self._write(struct.pack("<I", crc))
        self.offset = saved

    def add(self, name: str, data: bytes, crc: int, *, like: Record | None = None) -> None:
        """A small record written whole from memory."""
        self.begin(name, len(data), like=like)
        self._write(data)
        self.offset -= len(data)
        self.end(crc)

    def finish(self, comment: bytes = b"") -> int:
        """Write the central directory (zip64 where needed) and the end records; returns the file size."""
        for part in self._central(comment):
            self._write(part)  # a record's entry at a time: a million records are not one buffer
        self.flush()
        return self.offset

    def central(self, comment: bytes = b"") -> bytes:
        """The central directory and end records :meth:`finish` writes at the current offset (its length is known
        before the CRCs are: they change no length)."""
        return b"".join(self._central(comment))

    def _central(self, comment: bytes) -> Iterator[bytes]:
        cd_offset, cd_size = self.offset, 0
        for rec in self.records:
            raw_name = rec.name.encode("utf-8")
            wide_size = rec.size >= _U32
            zip64 = b""
            if wide_size or rec.header_offset >= _U32:
                values = [v for v in (rec.size, rec.size, rec.header_offset) if v >= _U32]
                zip64 = struct.pack(f"<HH{len(values)}Q", _ZIP64_ID, 8 * len(values), *values)
            usize = _U32 if wide_size else rec.size
            offset = _U32 if rec.header_offset >= _U32 else rec.header_offset
            entry = (
                _CENTRAL.pack(
                    _SIG_CENTRAL,
                    rec.version_made,
                    rec.version_needed,
                    rec.flags,
                    0,
                    rec.mtime,
                    rec.mdate,
                    rec.crc,
                    usize,
                    usize,
                    len(raw_name),
                    len(zip64),
                    len(rec.comment),
                    0,
                    rec.internal_attr,
                    rec.external_attr,
                    offset,
                )
                + raw_name
                + zip64
                + rec.comment
            )
            cd_size += len(entry)
            yield entry
        count = len(self.records)
        if cd_offset >= _U32 or cd_size >= _U32 or count >= _U16:
            eocd64_offset = cd_offset + cd_size
            yield _EOCD64.pack(_SIG_EOCD64, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
            yield _LOCATOR.pack(_SIG_LOCATOR, 0, eocd64_offset, 1)
        yield (
            _EOCD.pack(
                _SIG_EOCD,
                0,
                0,
                min(count, _U16),
                min(count, _U16),
                min(cd_size, _U32),
                min(cd_offset, _U32),
                len(comment),
            )
            + comment
        )

    def _write(self, data: bytes) -> None:
        gap = self.offset - self._pending_at - len(self._pending)
        if 0 < gap <= self._fill and self._pending:
            self._pending += bytes(gap)  # a small record's data, written over after finish()
        elif gap or len(self._pending) >= _PENDING_MAX:
            self.flush()
            self._pending_at = self.offset
        self._pending += data
        self.offset += len(data)

    def flush(self) -> None:
        """Write the gathered bytes (``finish`` does; others only before reading the file back)."""
        view, at = memoryview(self._pending), self._pending_at
        while view:
            n = os.pwrite(self.fd, view, self.base + at)
            at += n
            view = view[n:]
        view.release()
        self._pending.clear()
        self._pending_at = self.offset


_PENDING_MAX = 1 << 20
_FILL_MAX = 64 << 10
_DESCRIPTOR, _DESCRIPTOR64 = struct.Struct("<IIII"), struct.Struct("<IIQQ")
_PLAIN = Record("", 0, 0, 0, 0)  # what a record written without ``like`` takes its fields from
# torch's padding extra field by its length, for the 64 lengths that align a record (a block's worth are made anew)
_PAD_FIELDS = {pad: struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad for pad in range(ALIGN)}


def _pad_field(pad: int) -> bytes:
    return struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
