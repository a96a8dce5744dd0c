"""CRC-32 of byte ranges of a file on threads, in bounded memory.

:func:`crc32` is ISA-L's (the ``isal`` package) where it is installed: the same CRC as zlib's, computed with
carry-less multiplication at about memory speed (12 GB/s here against zlib's 3.7). One thread then reads the
file front to back, which is also the fastest way through a file that is not in the page cache: two threads
reading different places of a cold file took twice as long. With zlib's, two to four threads hash different
pieces at once (it releases the GIL). The CRC of a range is put together from its pieces' CRCs with
:func:`crc32_combine` (zlib's algorithm, which the standard library does not expose). Each thread maps or reads
a window at a time (:func:`crc_range`), so memory stays at a few windows whatever the file size. When the copy
itself costs nothing (the file system shares the blocks), this read is all the work a verified conversion does.
"""

from __future__ import annotations

import importlib
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from ckptfix.errors import FormatError
from ckptfix.formats.ziparchive import check_crc

WINDOW = 16 << 20  # mapped, or read in pieces of BUFFER, at a time (see crc_range)
BUFFER = 1 << 20
PIECE = 64 << 20  # a range longer than this is hashed by several threads
_SMALL = 1 << 20  # checks shorter than this are read with their neighbours, one call for several
_GROUP = 1 << 20  # small checks whose bytes lie within this span are read in one call
_POLY = 0xEDB88320
_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux: a read that fails rather than wait for the disk

crc32: Callable[..., int]  # crc32(data, value=0), as zlib.crc32
try:  # by name: an optional package, which the type checker need not find
    crc32 = importlib.import_module("isal.isal_zlib").crc32
except ImportError:  # not installed, or no wheel for this platform
    crc32 = zlib.crc32
FAST_CRC = crc32 is not zlib.crc32


class Check(NamedTuple):  # a tuple, not a frozen dataclass: one per record
    """The bytes ``[offset, offset + length)`` of record ``name`` must have CRC-32 ``crc`` (None: compute it)."""

    name: str
    offset: int
    length: int
    crc: int | None


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reflected, as zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    p, k = 1 << 31, 3  # x^0; the length is in bytes, x^(8 * len2)
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def crc_range(fd: int, offset: int, length: int) -> int:
    """CRC-32 of a byte range, :data:`WINDOW` bytes at a time, in bounded memory.

    A window already in the page cache is mapped and hashed where it lies. Any other is read in 1 MiB pieces,
    which the kernel's readahead keeps ahead of: mapping a file that is not cached took twice as long as ``cat``,
    reading it as long, and reading a cached one took nearly twice as long as mapping it (a copy per byte). A
    range that runs past the end of the file gets the CRC of the bytes that are there.
    """
    end = min(offset + length, os.fstat(fd).st_size)
    crc = 0
    buf: memoryview | None = None
    while offset < end:
        n = min(end - offset, WINDOW)
        window = _map(fd, offset, n) if n >= BUFFER and _cached(fd, offset + n - 1) else None
        if window is not None:
            with window, memoryview(window) as view:
                crc = crc32(view[offset % mmap.ALLOCATIONGRANULARITY :], crc)
        else:
            buf = buf if buf is not None else memoryview(bytearray(min(BUFFER, n)))
            crc = _crc_read(fd, offset, n, crc, buf)
        offset += n
    return crc


def _cached(fd: int, at: int) -> bool:
    """Whether the byte at ``at`` is in the page cache (a read that must not wait); False where it cannot tell."""
    if _NOWAIT is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], at, _NOWAIT) == 1
    except OSError:  # BlockingIOError: it is not; EOPNOTSUPP and the like: the file system cannot say
        return False


def _map(fd: int, offset: int, n: int) -> mmap.mmap | None:
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        return mmap.mmap(fd, offset - base + n, offset=base, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def _crc_read(fd: int, offset: int, n: int, crc: int, buf: memoryview) -> int:
    while n > 0:
        got = os.preadv(fd, [buf[: min(n, len(buf))]], offset)
        if got <= 0:
            break
        crc = crc32(buf[:got], crc)
        offset += got
        n -= got
    return crc


class Verifier:
    """Computes the CRC of every check on ``workers`` threads while the caller copies.

    By default one thread with ISA-L's CRC (it keeps up with memory and reads a cold file in order), else up to
    four.

    :meth:`join` returns the CRCs in check order, or raises the mismatch of the first bad record in file order
    (once one is found, later records are no longer read).
    """

    def __init__(self, fd: int, checks: Sequence[Check], *, source: str, workers: int | None = None) -> None:
        self.fd, self.checks, self.source = fd, checks, source
        self.crcs: list[int] = [0] * len(checks)
        self._parts: list[list[int]] = [[0] * max(1, -(-c.length // PIECE)) for c in checks]
        self._left = [len(p) for p in self._parts]
        self._todo = self._pieces()
        self._lock = threading.Lock()
        self._first_bad = len(checks)
        self._errors: dict[int, BaseException] = {}
        pieces = sum(self._left)
        count = min(workers or self._workers(), pieces)
        self._threads = [threading.Thread(target=self._work, name="ckptfix-crc", daemon=True) for _ in range(count)]

    def _workers(self) -> int:
        """zlib's CRC: up to four threads. ISA-L's: one thread reading in order, which is also the fastest way
        through a file that is not in the page cache (two readers at two places of a cold file took twice as long);
        two when the file is cached (its start, middle and end are), where mapping pages is the limit, not the disk."""
        cpus = os.cpu_count() or 1
        if not FAST_CRC:
            return min(cpus, 4)
        if cpus < 2 or not self.checks:
            return 1
        first = min(c.offset for c in self.checks)
        last = max(c.offset + c.length for c in self.checks) - 1
        return 2 if all(_cached(self.fd, at) for at in (first, (first + last) // 2, last)) else 1

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> list[int]:
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[min(self._errors)]
        return self.crcs

    def cancel(self) -> None:
        """Stop reading and wait for the threads (the caller is already failing)."""
        self._first_bad = -1
        for thread in self._threads:
            thread.join()

    def _pieces(self) -> Iterator[tuple[int, int, int, int] | list[int]]:
        """Pieces of big checks; small checks in groups of neighbours (by offset) to read in one call each."""
        small = sorted((i for i, c in enumerate(self.checks) if c.length < _SMALL), key=lambda i: self.checks[i].offset)
        group: list[int] = []
        for i in small:
            check = self.checks[i]
            if group and check.offset + check.length - self.checks[group[0]].offset > _GROUP:
                yield group
                group = []
            group.append(i)
        if group:
            yield group
        for i, check in enumerate(self.checks):
            if check.length >= _SMALL:
                for j in range(len(self._parts[i])):
                    start = j * PIECE
                    yield i, j, check.offset + start, min(PIECE, check.length - start)

    def _work(self) -> None:
        while True:
            with self._lock:
                item = next(self._todo, None)
            if isinstance(item, list):
                if min(item) <= self._first_bad:
                    self._small(item)
                continue
            if item is None or item[0] > self._first_bad:
                return
            i, j, offset, length = item
            try:
                crc = crc_range(self.fd, offset, length)
            except BaseException as e:  # handed to join(), in the caller's thread
                self._fail(i, e)
                return
            with self._lock:
                self._parts[i][j] = crc
                self._left[i] -= 1
                complete = self._left[i] == 0
            if complete:
                self._finish(i)

    def _small(self, run: list[int]) -> None:
        """Checks of small records in one read: their CRCs from slices of it."""
        start = min(self.checks[i].offset for i in run)
        end = max(self.checks[i].offset + self.checks[i].length for i in run)
        try:
            data = memoryview(os.pread(self.fd, end - start, start))
        except BaseException as e:
            self._fail(run[0], e)
            return
        for i in run:
            check = self.checks[i]
            self._parts[i][0] = crc32(data[check.offset - start : check.offset - start + check.length])
            self._left[i] = 0
            self._finish(i)

    def _finish(self, i: int) -> None:
        parts, check = self._parts[i], self.checks[i]
        crc = parts[0]
        for j, part in enumerate(parts[1:], 1):
            crc = crc32_combine(crc, part, min(PIECE, check.length - j * PIECE))
        self.crcs[i] = crc
        if check.crc is not None:
            try:
                check_crc(self.source, check.name, check.crc, crc)
            except FormatError as e:
                self._fail(i, e)

    def _fail(self, i: int, error: BaseException) -> None:
        with self._lock:
            self._errors[i] = error
            self._first_bad = min(self._first_bad, i)
