"""CRC-32 of byte ranges of a file on threads, in bounded memory.

:func:`crc32` is ISA-L's (the ``isal`` package) where it is installed: the same CRC as zlib's, computed with
carry-less multiplication at about memory speed (34 GB/s on one thread here, 47 GB/s on two; zlib's 3.7), and
it releases the GIL. A file in the page cache is then hashed where it lies, mapped :data:`SPAN` bytes at a time,
on two threads when the copy beside it costs no CPU (:meth:`Verifier.more`); one that is not cached is read front
to back in 1 MiB pieces by one thread, which the kernel's readahead keeps ahead of (two threads reading different
places of a cold file took twice as long, and mapping it twice as long as ``cat``). Whether the page cache holds a
span is asked without reading it (``cachestat``, Linux 6.5 and later; :func:`cached` says what older kernels do).
With zlib's CRC, two to four threads. The CRC of a record cut in parts is put together with :func:`crc32_combine`
(zlib's algorithm, which the standard library does not expose). Memory stays at a span per thread whatever the
file size. When the copy itself costs nothing (the file system shares the blocks), this read is all the work a
verified conversion does. Each span is one mapping and one CRC call per record: every return from a call that
released the GIL waits for the converter's Python to yield it, so fewer calls per byte keep the threads at speed
beside it. (Starting the check as soon as the arguments are parsed gained nothing measurable on two CPUs, and
starting it before click is even imported made a 2.1 GB conversion slower, 141-155 ms against 110-125: its threads
wait for the GIL while the imports run, and the CRC needs both CPUs anyway.)
"""

from __future__ import annotations

import errno
import functools
import importlib
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ckptfix.errors import FormatError
from ckptfix.formats.output.atomic import Worker, wait_all
from ckptfix.formats.output.linux import libc

BUFFER = 1 << 20  # a span not in the page cache is read this much at a time
PIECE = 16 << 20  # a range longer than this is hashed in parts, by several threads where there are several
SPAN = 16 << 20  # neighbouring checks up to this many bytes are mapped (or read) by one thread at once
_GAP = 1 << 20  # unneeded bytes between checks that may be read with them rather than start another span
_POLY = 0xEDB88320
_CACHESTAT = 451  # the cachestat syscall's number, the same on every Linux architecture (6.5 and later)
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


def check_crc(path: str, name: str, stored: int | None, actual: int) -> None:
    """The one CRC rule and its message (``stored`` None: the archive stores no CRC to check)."""
    if stored is not None and actual != stored:
        raise FormatError(
            f"{path}: record '{name}' fails its CRC check (stored {stored:08x}, actual {actual:08x}); "
            f"the file is corrupt: re-download or re-save it"
        )


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


@functools.cache
def _cachestat() -> Callable[[int, int, int], int | None] | None:
    """``cachestat(fd, offset, length)``: how many pages of the range the page cache holds, asked without reading
    (Linux 6.5 and later; None elsewhere, and the function answers None once the kernel says it has no such call)."""
    syscall = libc("syscall")
    if syscall is None:
        return None
    import ctypes

    syscall.restype = ctypes.c_long
    missing = False

    def cachestat(fd: int, offset: int, length: int) -> int | None:
        nonlocal missing
        if missing:
            return None
        query, answer = (ctypes.c_uint64 * 2)(offset, length), (ctypes.c_uint64 * 5)()  # per call: two threads ask
        if syscall(ctypes.c_long(_CACHESTAT), ctypes.c_uint(fd), query, answer, ctypes.c_uint(0)) == 0:
            return int(answer[0])  # nr_cache, in pages
        missing = ctypes.get_errno() == errno.ENOSYS  # a kernel before 6.5
        return None

    return cachestat


def cached(fd: int, lo: int, hi: int) -> bool:
    """Whether the page cache holds every byte of ``[lo, hi)``; False where the system cannot tell (read it).

    ``cachestat`` asks without reading. Kernels before 6.5 lack it and are asked with a one-byte read that must not
    wait (``RWF_NOWAIT``) at each end; such a read starts the kernel's readahead where it looks, 16 MiB ahead of
    the sequential reader, and made a cold 2.1 GB pass 15-20% slower (0.75 s against 0.64), but without it a cached
    file would be copied through a buffer on one thread instead of mapped on two (about twice as long)."""
    if hi <= lo:
        return False
    cachestat = _cachestat()
    held = cachestat(fd, lo, hi - lo) if cachestat is not None else None
    if held is None:
        return _nowait(fd, lo) and _nowait(fd, hi - 1)
    return held >= -(-hi // mmap.PAGESIZE) - lo // mmap.PAGESIZE


def _nowait(fd: int, at: int) -> bool:
    """Whether a one-byte read at ``at`` succeeds without waiting for the disk; False where it cannot tell."""
    if _NOWAIT is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], at, _NOWAIT) == 1
    except OSError:  # BlockingIOError: not cached; EOPNOTSUPP and the like: the file system cannot say
        return False


_Segment = tuple[int, int, int, int]  # start, end, check, part: part ``part`` of check ``check`` is [start, end)


class Verifier:
    """Computes the CRC of every check on ``workers`` threads while the caller copies.

    By default one thread with ISA-L's CRC (it keeps up with memory and reads a cold file in order; see
    :meth:`more` for a second), else up to four. Neighbouring checks are hashed a span at a time (:data:`SPAN` bytes
    mapped, or read, in one go): each call that releases the GIL waits, on its return, for the caller's thread
    to give the GIL back, up to the switch interval (5 ms) while the caller runs Python (the pickle, the plan).
    Reading 16 MiB windows with five such calls each (fstat, a page-cache probe, mmap, the CRC, munmap), 2.1 GB
    took 101 ms beside 40 ms of Python in the caller against 64 ms alone; a span makes four plus one per record.

    :meth:`join` returns the CRCs in check order, or raises the mismatch of the first bad record in file order
    (once one is found, later records are no longer read).
    """

    def __init__(self, fd: int, checks: Sequence[Check], *, source: str, workers: int | None = None) -> None:
        self.fd, self.checks, self.source = fd, checks, source
        self.crcs: list[int] = [0] * len(checks)
        # checks longer than PIECE are hashed in parts, put together when the last one is in; the others (a
        # million tiny records) are checked as their CRC comes, without this bookkeeping
        self._parts = {i: [0] * -(-c.length // PIECE) for i, c in enumerate(checks) if c.length > PIECE}
        self._left = {i: len(p) for i, p in self._parts.items()}
        spans = _spans(checks)
        self._todo = iter(spans)
        self._lock = threading.Lock()
        self._first_bad = len(checks)
        self._errors: dict[int, BaseException] = {}
        count = min(workers or (1 if FAST_CRC else min(os.cpu_count() or 1, 4)), len(spans))
        self._threads = [Worker(self._work, name="ckptfix-crc") for _ in range(count)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def more(self) -> None:
        """A second ISA-L thread, for a caller whose copy has left the CPUs to the check (the file system shared
        the blocks), when the page cache holds the whole file: there the CRC itself is the limit.
        One thread otherwise: it reads a cold file in order, the fastest way through it (two readers at two places
        took twice as long), and beside a copy through memory a second one slowed the copy down more than it gained.
        """
        if not FAST_CRC or len(self._threads) != 1 or (os.cpu_count() or 1) < 2 or not self.checks:
            return
        first = min(c.offset for c in self.checks)
        if cached(self.fd, first, max(c.offset + c.length for c in self.checks)):
            thread = Worker(self._work, name="ckptfix-crc")
            self._threads.append(thread)
            thread.start()

    def join(self) -> list[int]:
        self._wait()
        if self._errors:
            raise self._errors[min(self._errors)]
        return self.crcs

    def cancel(self) -> None:
        """Stop reading and wait for the threads (the caller is already failing)."""
        self._stop()
        self._wait()

    def _wait(self) -> None:
        wait_all(self._threads, self._stop)

    def _stop(self) -> None:
        self._first_bad = -1

    def _work(self) -> None:
        buf: memoryview | None = None
        while True:
            with self._lock:
                span = next(self._todo, None)
            if span is None or min(s[2] for s in span) > self._first_bad:
                return
            try:
                mapped = _map_span(self.fd, span)
                if mapped is not None:
                    crcs = _crc_mapped(mapped, span)
                else:
                    buf = buf if buf is not None else memoryview(bytearray(BUFFER))
                    crcs = _crc_span_read(self.fd, span, buf)
            except BaseException as e:  # handed to join(), in the caller's thread
                self._fail(min(s[2] for s in span), e)
                return
            complete = []
            bad = None
            checks, results = self.checks, self.crcs
            with self._lock:  # once per span: a span may hold thousands of small records
                for (_, _, i, part), crc in zip(span, crcs, strict=True):
                    parts = self._parts.get(i)
                    if parts is None:  # a check in one part: its CRC is whole
                        results[i] = crc
                        if checks[i].crc not in (None, crc) and (bad is None or i < bad):
                            bad = i
                        continue
                    parts[part] = crc
                    self._left[i] -= 1
                    if not self._left[i]:
                        complete.append(i)
            if bad is not None:
                self._finish(bad)  # says which record, and why
            for i in complete:
                self._finish(i)

    def _finish(self, i: int) -> None:
        check, parts = self.checks[i], self._parts.get(i)
        crc = self.crcs[i] if parts is None else parts[0]
        for j, part in enumerate(parts[1:] if parts else (), 1):
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


def _spans(checks: Sequence[Check]) -> list[list[_Segment]]:
    """The checks' parts (:data:`PIECE` bytes at most) in file order, neighbours grouped: a group spans at most
    :data:`SPAN` bytes, and bytes no check needs (another's record, left out) of at most :data:`_GAP` lie inside.
    Plain tuples and one loop: a checkpoint of a million tiny tensors passes here."""
    piece, segments = PIECE, []
    for i, (_, offset, length, _) in enumerate(checks):
        if length <= piece:
            segments.append((offset, offset + length, i, 0))
            continue
        for j in range(-(-length // piece)):
            start = offset + j * piece
            segments.append((start, min(offset + length, start + piece), i, j))
    segments.sort()  # already in file order, as the checks of a zip usually are: one pass
    spans: list[list[_Segment]] = []
    span: list[_Segment] = []
    lo = hi = 0
    for segment in segments:
        start, end = segment[0], segment[1]
        if span and end - lo <= SPAN and start - hi <= _GAP:
            span.append(segment)
            hi = max(hi, end)
        else:
            span = [segment]
            spans.append(span)
            lo, hi = start, end
    return spans


def _map_span(fd: int, span: list[_Segment]) -> tuple[mmap.mmap, int] | None:
    """The span mapped, with the file offset of the mapping's first byte; None where its bytes are not all in
    the page cache (they are read instead), or the span is short or past the end."""
    lo, hi = span[0][0], max(s[1] for s in span)
    if hi - lo < BUFFER or not cached(fd, lo, hi):
        return None
    base = lo - lo % mmap.ALLOCATIONGRANULARITY
    try:
        return mmap.mmap(fd, hi - base, offset=base, access=mmap.ACCESS_READ), base
    except (OSError, ValueError):
        return None


def _crc_mapped(mapped: tuple[mmap.mmap, int], span: list[_Segment]) -> list[int]:
    window, base = mapped
    with window, memoryview(window) as view:
        return [crc32(view[start - base : end - base]) for start, end, _, _ in span]


def _crc_span_read(fd: int, span: list[_Segment], buf: memoryview) -> list[int]:
    """The span read front to back a buffer at a time, each buffer's bytes added to the segments it holds.

    A segment that runs past the end of the file gets the CRC of the bytes that are there."""
    crcs = [0] * len(span)
    at, hi = span[0][0], max(s[1] for s in span)
    first = 0  # segments before this one end before ``at``
    while at < hi:
        got = os.preadv(fd, [buf[: min(hi - at, len(buf))]], at)
        if got <= 0:
            break
        end = at + got
        while first < len(span) and span[first][1] <= at:
            first += 1
        for k in range(first, len(span)):
            start, stop = span[k][0], span[k][1]
            if start >= end:
                break
            if stop > at:
                crcs[k] = crc32(buf[max(start, at) - at : min(stop, end) - at], crcs[k])
        at = end
    return crcs
