"""Move byte ranges between files in the kernel, checking zip CRCs on the side.

``os.copy_file_range`` copies without the bytes entering Python (and shares extents on file systems that can);
where the kernel refuses it, a buffered ``pread``/``pwrite`` loop with one reusable buffer takes over. The CRC
of each source record is computed in a second thread from the same (by then cached) pages, so on two cores
checking costs little wall time, and memory stays at two small buffers whatever the file size.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptfix.errors import FormatError
from ckptfix.formats.ziparchive import check_crc

CHUNK = 16 << 20
_WRITEBACK_MIN = 1 << 20
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}
Progress = Callable[[int], None]


@dataclass(frozen=True)
class Job:
    """Copy ``length`` bytes from ``src`` to ``dst`` offsets."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Check:
    """The bytes ``[offset, offset + length)`` of record ``name`` must have CRC-32 ``crc`` (None: compute it)."""

    name: str
    offset: int
    length: int
    crc: int | None


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _libc_sync_file_range() if os.name == "posix" else None
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a just-copied range to disk now (Linux; a no-op elsewhere).

    The final fsync then finds most pages already written: disk write-back overlaps the copy instead of
    following it, which is most of the difference between ``cp && sync`` and a copy that is durable on return.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def crc_range(fd: int, offset: int, length: int) -> int:
    """CRC-32 of a byte range, through a small sliding memory map (no copy into Python; RSS stays bounded)."""
    crc = 0
    if offset + length > os.fstat(fd).st_size:  # a map past the end would fault (SIGBUS), pread just stops
        return _crc_pread(fd, offset, length, crc)
    while length > 0:
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        n = min(length, CHUNK)
        try:
            window = mmap.mmap(fd, offset - base + n, offset=base, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return _crc_pread(fd, offset, length, crc)
        with window, memoryview(window) as view:
            crc = zlib.crc32(view[offset - base :], crc)
        offset += n
        length -= n
    return crc


def _crc_pread(fd: int, offset: int, length: int, crc: int) -> int:
    buf = bytearray(min(CHUNK, max(length, 1)))
    view = memoryview(buf)
    while length > 0:
        n = os.preadv(fd, [view[: min(length, len(buf))]], offset)
        if n <= 0:
            break
        crc = zlib.crc32(view[:n], crc)
        offset += n
        length -= n
    return crc


class _Verifier(threading.Thread):
    def __init__(self, fd: int, checks: Sequence[Check], source: str) -> None:
        super().__init__(name="ckptfix-crc", daemon=True)
        self.fd, self.checks, self.source = fd, checks, source
        self.error: FormatError | None = None
        self.crcs: list[int] = []

    def run(self) -> None:
        for check in self.checks:
            actual = crc_range(self.fd, check.offset, check.length)
            self.crcs.append(actual)
            if check.crc is not None:
                try:
                    check_crc(self.source, check.name, check.crc, actual)
                except FormatError as e:
                    self.error = e
                    return


class Copier:
    """Runs copy jobs from ``src_fd`` into ``dst_fd``; falls back to buffered I/O once the kernel refuses."""

    def __init__(self, src_fd: int, dst_fd: int, *, source: str, progress: Progress | None = None) -> None:
        self.src_fd, self.dst_fd, self.source = src_fd, dst_fd, source
        self.progress = progress
        self.kernel = hasattr(os, "copy_file_range")
        self._buf: bytearray | None = None

    def run(self, jobs: Sequence[Job], *, checks: Sequence[Check] = ()) -> list[int]:
        """Copy every job while a second thread computes the CRC of each check; raise on the first mismatch.

        The output is fsynced while the CRCs are still being computed: the disk write-back and the checksum
        then overlap instead of adding up (the atomic writer's own fsync finds nothing left).
        """
        verifier = _Verifier(self.src_fd, checks, self.source) if checks else None
        if verifier is not None:
            verifier.start()
        try:
            for job in jobs:
                self.copy(job)
            os.fsync(self.dst_fd)
        finally:
            if verifier is not None:
                verifier.join()
        if verifier is None:
            return []
        if verifier.error is not None:
            raise verifier.error
        return verifier.crcs

    def copy(self, job: Job) -> None:
        src, dst, left = job.src, job.dst, job.length
        while left > 0:
            step = min(left, CHUNK)
            n = self._kernel_copy(src, dst, step) if self.kernel else 0
            if n == 0:
                n = self._buffered_copy(src, dst, step)
            if n >= _WRITEBACK_MIN:  # one syscall per tiny record costs more than it saves; fsync takes those
                start_writeback(self.dst_fd, dst, n)
            src, dst, left = src + n, dst + n, left - n
            if self.progress is not None:
                self.progress(n)

    def _kernel_copy(self, src: int, dst: int, count: int) -> int:
        try:
            return os.copy_file_range(self.src_fd, self.dst_fd, count, src, dst)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
            self.kernel = False
            return 0

    def _buffered_copy(self, src: int, dst: int, count: int) -> int:
        if self._buf is None or len(self._buf) < count:
            self._buf = bytearray(max(count, 1 << 20))
        view = memoryview(self._buf)[:count]
        n = os.preadv(self.src_fd, [view], src)
        if n <= 0:
            raise FormatError(f"{self.source}: ends at byte {src} inside a record; the file is truncated")
        done = 0
        while done < n:
            done += os.pwrite(self.dst_fd, view[done:n], dst + done)
        return n
