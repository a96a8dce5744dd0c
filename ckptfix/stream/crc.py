"""CRC-32 of byte ranges of a file on several threads, in bounded memory.

zlib's ``crc32`` releases the GIL on large buffers, so threads hashing different pieces of the file run at once;
the CRC of a range is put together from its pieces' CRCs with :func:`crc32_combine` (zlib's algorithm, which
the standard library does not expose). Each thread reads through a small sliding memory map, so memory stays at
a few windows whatever the file size. When the copy itself costs nothing (the file system shares the blocks),
this read is all the work a verified conversion does.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from ckptfix.errors import FormatError
from ckptfix.formats.ziparchive import check_crc

WINDOW = 16 << 20
PIECE = 64 << 20  # a range longer than this is hashed by several threads
_SMALL = 1 << 20  # below this one pread costs less than setting up a map
_GROUP = 1 << 20  # small checks whose bytes lie within this span are read in one call
_POLY = 0xEDB88320
_SEQUENTIAL = getattr(mmap, "MADV_SEQUENTIAL", None)


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


def crc_range(fd: int, offset: int, length: int, *, size: int | None = None) -> int:
    """CRC-32 of a byte range, through a small sliding memory map (no copy into Python; RSS stays bounded)."""
    size = os.fstat(fd).st_size if size is None else size
    if length < _SMALL or offset + length > size:  # a map past the end would fault (SIGBUS), pread just stops
        return _crc_pread(fd, offset, length)
    crc = 0
    while length > 0:
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        n = min(length, WINDOW)
        try:
            window = mmap.mmap(fd, offset - base + n, offset=base, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return crc32_combine(crc, _crc_pread(fd, offset, length), length)
        if _SEQUENTIAL is not None:  # a cold file: the kernel reads ahead further, as it does for read()
            window.madvise(_SEQUENTIAL)
        with window, memoryview(window) as view:
            crc = zlib.crc32(view[offset - base :], crc)
        offset += n
        length -= n
    return crc


def _crc_pread(fd: int, offset: int, length: int) -> int:
    crc = 0
    buf = bytearray(min(WINDOW, max(length, 1)))
    view = memoryview(buf)
    while length > 0:
        n = os.preadv(fd, [view[: min(length, len(buf))]], offset)
        if n <= 0:
            break
        crc = zlib.crc32(view[:n], crc)
        offset += n
        length -= n
    return crc


class Verifier:
    """Computes the CRC of every check on up to ``workers`` threads while the caller copies.

    :meth:`join` returns the CRCs in check order, or raises the mismatch of the first bad record in file order
    (once one is found, later records are no longer read).
    """

    def __init__(self, fd: int, checks: Sequence[Check], *, source: str, workers: int | None = None) -> None:
        self.fd, self.checks, self.source = fd, checks, source
        self.size = os.fstat(fd).st_size
        self.crcs: list[int] = [0] * len(checks)
        self._parts: list[list[int]] = [[0] * max(1, -(-c.length // PIECE)) for c in checks]
        self._left = [len(p) for p in self._parts]
        self._todo = self._pieces()
        self._lock = threading.Lock()
        self._first_bad = len(checks)
        self._errors: dict[int, BaseException] = {}
        pieces = sum(self._left)
        count = min(workers or min(os.cpu_count() or 1, 4), pieces)
        self._threads = [threading.Thread(target=self._work, name="ckptfix-crc", daemon=True) for _ in range(count)]

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
                crc = crc_range(self.fd, offset, length, size=self.size)
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
            self._parts[i][0] = zlib.crc32(data[check.offset - start : check.offset - start + check.length])
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
