"""Move byte ranges between files in the kernel, sharing blocks where the file system can, checking CRCs on the side.

A range whose source and destination offsets are congruent modulo the block size (the planners keep them so)
is copied as a head, a block-aligned middle and a tail. The middle is cloned (``FICLONERANGE``): on XFS with
reflink, btrfs, bcachefs or ZFS the output then shares the input's blocks and nothing is written. Where the file
system refuses (ext4, tmpfs, another device), ``os.copy_file_range`` copies without the bytes entering Python,
and where the kernel refuses that too, a buffered ``pread``/``pwrite`` loop with one reusable buffer takes over.
CRCs are computed by :class:`ckptfix.formats.output.crc.Verifier` threads meanwhile, so checking overlaps the copy.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

from ckptfix.errors import FormatError
from ckptfix.formats.output.crc import Check, Verifier
from ckptfix.formats.output.linux import libc
from ckptfix.formats.torchzip.archive import BLOCK

CHUNK = 16 << 20
CLONE_STEP = 1 << 30  # one ioctl per GiB shared: progress still moves, and each call returns in milliseconds
SHARE_MIN = 2 * BLOCK  # a congruent range this long holds at least one whole block to share
_WRITEBACK_MIN = 1 << 20
_JOIN_MAX = 64 << 10  # longer than any header torch writes (name, zip64 and padding fields)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}
_NO_CLONE = _NO_KERNEL_COPY | {errno.ENOTTY, errno.ETXTBSY, errno.EISDIR}
_FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range), Linux
_CLONE_ARGS = struct.Struct("qQQQ")  # src_fd, src_offset, src_length, dest_offset
Progress = Callable[[int], None]
_WINDOW = 1 << 20
_LOOKAHEAD = 64 << 10  # read past a gap between jobs: the next gaps come with it where the records between are small
# (a MiB past each gap read the 2.1 GB test file's 250 gaps as 500 MB from the page cache: 40 ms instead of 3)
_SMALL = 64 << 10  # a job this short is copied through memory: a syscall per tiny tensor costs more than its bytes

__all__ = ["Check", "Copier", "Job", "new_tuple", "start_writeback"]


class Job(NamedTuple):  # a tuple, not a frozen dataclass: one per record, a million of them is a second less
    """Copy ``length`` bytes from ``src`` to ``dst`` offsets."""

    src: int
    dst: int
    length: int


# new_tuple(Job, (src, dst, length)) skips a named tuple's Python-level __new__: a million jobs or checks, 0.3 s less
new_tuple = tuple.__new__


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, looked up on first use (a clone-only conversion never pays for ctypes)."""
    func = libc("sync_file_range")
    if func is None:
        return None
    import ctypes

    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return cast("Callable[[int, int, int, int], int]", func)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a just-copied range to disk now (Linux; a no-op elsewhere).

    The final fsync then finds most pages already written: disk write-back overlaps the copy instead of
    following it, which is most of the difference between ``cp && sync`` and a copy that is durable on return.
    """
    func = _sync_file_range()
    if func is not None:
        func(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class _Window:
    """Small reads served from one larger read (the gaps between small records, a window at a time)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.at, self.buf = fd, 0, b""

    def read(self, offset: int, n: int, span: int) -> bytes:
        rel = offset - self.at
        if rel < 0 or rel + n > len(self.buf):
            self.buf, self.at, rel = os.pread(self.fd, max(n, span), offset), offset, 0
        return self.buf[rel : rel + n]


class Copier:
    """Runs copy jobs from ``src_fd`` into ``dst_fd``; counts the bytes shared with the source and those copied."""

    def __init__(self, src_fd: int, dst_fd: int, *, source: str, progress: Progress | None = None) -> None:
        self.src_fd, self.dst_fd, self.source = src_fd, dst_fd, source
        self.progress = progress
        self.kernel = hasattr(os, "copy_file_range")
        self.clone = self.kernel  # Linux: where copy_file_range exists, so does the FICLONERANGE ioctl
        self.shared = 0  # bytes the file system reported sharing (a clone succeeded)
        self.copied = 0
        self._buf: bytearray | None = None
        # small jobs (a tensor of a few bytes) go through memory: read a window at a time, written back to back
        self._src = _Window(src_fd)
        self._out = bytearray()
        self._out_at = 0

    def run(self, jobs: Sequence[Job], *, checks: Sequence[Check] = ()) -> list[int]:
        """Copy every job while other threads compute the CRC of each check; raise on the first mismatch.

        The output is fsynced while the CRCs are still being computed: the disk write-back and the checksum
        then overlap instead of adding up (the atomic writer's own fsync finds nothing left).
        """
        verifier = Verifier(self.src_fd, checks, source=self.source) if checks else None
        if verifier is not None:
            verifier.start()
        try:
            more = verifier.more if verifier is not None else None
            for job in self._joined(jobs):
                self.copy(job)
                if more is not None and self.shared:  # the blocks are shared: the copy leaves the CPUs to the check
                    more()
                    more = None
            self._flush()
            os.fsync(self.dst_fd)
        except BaseException:
            if verifier is not None:
                verifier.cancel()
            raise
        return verifier.join() if verifier is not None else []

    def _joined(self, jobs: Sequence[Job]) -> list[Job]:
        """Join neighbouring jobs whose bytes between them are already the same in both files (zip headers).

        The joined range then shares the blocks that hold record headers and small records too, and takes
        one call instead of one per record. One loop without calls per job: a million tiny records pass here.
        """
        if not jobs:
            return []
        joined: list[Job] = []
        src_fd, dst_fd = self.src_fd, self.dst_fd
        src_buf = dst_buf = b""  # a window of each file: the gaps ahead are read in one call per window
        src_at = dst_at = 0
        run_src, run_dst, run_len = jobs[0]
        for job in jobs[1:]:
            src, dst, length = job
            gap = src - run_src - run_len
            if 0 <= gap <= _JOIN_MAX and dst - run_dst - run_len == gap:
                lo, dlo = src - gap, dst - gap
                if lo < src_at or src > src_at + len(src_buf):
                    src_buf, src_at = os.pread(src_fd, gap + _LOOKAHEAD, lo), lo
                if dlo < dst_at or dst > dst_at + len(dst_buf):
                    dst_buf, dst_at = os.pread(dst_fd, gap + _LOOKAHEAD, dlo), dlo
                if src_buf[lo - src_at : src - src_at] == dst_buf[dlo - dst_at : dst - dst_at] and (
                    src - src_at <= len(src_buf) and dst - dst_at <= len(dst_buf)  # both files hold the whole gap
                ):
                    run_len += gap + length
                    continue
            joined.append(new_tuple(Job, (run_src, run_dst, run_len)))
            run_src, run_dst, run_len = job
        joined.append(new_tuple(Job, (run_src, run_dst, run_len)))
        return joined

    def copy(self, job: Job) -> None:
        src, dst, length = job.src, job.dst, job.length
        if length <= _SMALL and (length < SHARE_MIN or not self.clone) and self._small(src, dst, length):
            return
        if self.clone and length >= SHARE_MIN and (src - dst) % BLOCK == 0:
            head = -dst % BLOCK
            middle = (length - head) // BLOCK * BLOCK
            self._copy(src, dst, head)
            shared = self._clone(src + head, dst + head, middle)
            src, dst, length = src + head + shared, dst + head + shared, length - head - shared
        self._copy(src, dst, length)

    def _small(self, src: int, dst: int, length: int) -> bool:
        """Copy a small job through memory (one read per window, one write per run of adjacent jobs)."""
        data = self._src.read(src, length, _WINDOW)
        if len(data) != length:
            return False  # past the end: the kernel path says so
        if dst != self._out_at + len(self._out) or len(self._out) >= _WINDOW:
            self._flush()
            self._out_at = dst
        self._out += data
        self.copied += length
        if self.progress is not None:
            self.progress(length)
        return True

    def _flush(self) -> None:
        view, at = memoryview(self._out), self._out_at
        while view:
            n = os.pwrite(self.dst_fd, view, at)
            view, at = view[n:], at + n
        view.release()
        self._out.clear()

    def _clone(self, src: int, dst: int, length: int) -> int:
        """Share ``length`` block-aligned bytes; returns how many were shared before the file system refused."""
        import fcntl

        done = 0
        while done < length and self.clone:
            step = min(length - done, CLONE_STEP)
            try:
                fcntl.ioctl(self.dst_fd, _FICLONERANGE, _CLONE_ARGS.pack(self.src_fd, src + done, step, dst + done))
            except OSError as e:
                if e.errno not in _NO_CLONE:
                    raise
                self.clone = False  # ext4, tmpfs, another device: copy from now on
                break
            done += step
            self.shared += step
            if self.progress is not None:
                self.progress(step)
        return done

    def _copy(self, src: int, dst: int, left: int) -> None:
        while left > 0:
            step = min(left, CHUNK)
            n = self._kernel_copy(src, dst, step) if self.kernel else 0
            if n == 0:
                n = self._buffered_copy(src, dst, step)
            if n >= _WRITEBACK_MIN:  # one syscall per tiny record costs more than it saves; fsync takes those
                start_writeback(self.dst_fd, dst, n)
            src, dst, left = src + n, dst + n, left - n
            self.copied += n
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
