"""CRC-32 of file ranges on threads (ckptfix.formats.output.crc): the same CRCs as zlib whatever the thread count and
however the ranges fall across pieces and windows, and the first bad record named."""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest

from ckptfix.errors import FormatError
from ckptfix.formats.output import crc
from ckptfix.formats.output.crc import Check, Verifier


@pytest.fixture
def data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, bytes]:
    # small pieces and windows, so that a few MB cross many of their boundaries
    monkeypatch.setattr(crc, "PIECE", 1 << 20)
    monkeypatch.setattr(crc, "SPAN", 1 << 20)
    data = os.urandom(5 * (1 << 20) + 12345)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _checks(data: bytes) -> list[Check]:
    mib = 1 << 20
    spans = [(0, 10), (10, mib - 10), (mib - 1, 2), (3, 3 * mib + 7), (4 * mib, len(data) - 4 * mib)]
    spans += [(o, 64) for o in range(1 << 20, 1 << 21, 4096)]  # small records, read in groups
    return [Check(f"r{i}", o, n, zlib.crc32(data[o : o + n])) for i, (o, n) in enumerate(spans)]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_every_thread_count_gives_zlibs_crcs(data_file: tuple[Path, bytes], workers: int) -> None:
    path, data = data_file
    checks = _checks(data)
    with open(path, "rb") as f:
        v = Verifier(f.fileno(), checks, source=str(path), workers=workers)
        v.start()
        assert v.join() == [c.crc for c in checks]


def test_a_second_thread_joins_for_a_cached_file_when_asked(data_file: tuple[Path, bytes]) -> None:
    # the copier asks once the file system shared the blocks: the copy then leaves both CPUs to the check
    path, data = data_file
    if not crc.FAST_CRC or (os.cpu_count() or 1) < 2 or not sys.platform.startswith("linux"):
        pytest.skip("two threads only with ISA-L's CRC, two CPUs and a way to ask the page cache (Linux)")
    checks = _checks(data)
    with open(path, "rb") as f:
        f.read()  # in the page cache now
        v = Verifier(f.fileno(), checks, source=str(path))
        assert len(v._threads) == 1
        v.start()
        v.more()
        assert len(v._threads) == 2
        assert v.join() == [c.crc for c in checks]


def test_the_first_bad_record_in_file_order_is_named(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    checks = _checks(data)
    broken = bytearray(data)
    broken[(1 << 20) + 4096 * 3 + 5] ^= 0xFF  # inside a small record, and inside record r3
    path.write_bytes(bytes(broken))
    for workers in (1, 2):
        with open(path, "rb") as f:
            v = Verifier(f.fileno(), checks, source=str(path), workers=workers)
            v.start()
            with pytest.raises(FormatError, match=rf"^{path}: record 'r3' fails its CRC check"):
                v.join()


def test_of_two_bad_small_records_in_one_span_the_first_is_named(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    checks = [Check(f"r{i}", o, 64, zlib.crc32(data[o : o + 64])) for i, o in enumerate(range(0, 1 << 16, 4096))]
    broken = bytearray(data)
    for record in (9, 7):  # small records r7 and r9, read in one span
        broken[checks[record].offset + 1] ^= 0xFF
    path.write_bytes(bytes(broken))
    with open(path, "rb") as f:
        v = Verifier(f.fileno(), checks, source=str(path))
        v.start()
        with pytest.raises(FormatError, match=rf"^{path}: record 'r7' fails its CRC check"):
            v.join()


@pytest.fixture
def small_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    # spans, parts and buffers of a few KB, so that small files cross many of their boundaries
    monkeypatch.setattr(crc, "SPAN", 1 << 16)
    monkeypatch.setattr(crc, "PIECE", 1 << 15)
    monkeypatch.setattr(crc, "BUFFER", 1 << 12)
    monkeypatch.setattr(crc, "_GAP", 1 << 12)


@pytest.mark.parametrize("fast", [True, False], ids=["isal-or-zlib", "zlib"])
@pytest.mark.parametrize("cached", [True, False], ids=["mapped", "read"])
def test_spans_give_zlibs_crc_around_every_boundary(
    tmp_path: Path, small_spans: None, monkeypatch: pytest.MonkeyPatch, fast: bool, cached: bool
) -> None:
    if not fast:  # the fallback where isal has no wheel
        monkeypatch.setattr(crc, "crc32", zlib.crc32)
        monkeypatch.setattr(crc, "FAST_CRC", False)
    if not cached:
        monkeypatch.setattr(crc, "cached", lambda fd, lo, hi: False)
    data = os.urandom(300_000)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    span, piece = crc.SPAN, crc.PIECE
    spans = [(0, 1), (1, piece - 1), (piece - 1, 2), (piece, piece), (span - 3, 7), (span, 3 * piece + 5)]
    spans += [(o, 100) for o in range(200_000, 240_000, 1_000)]  # neighbours in one span
    spans += [(250_000, 10), (260_000, 10)]  # a gap wider than _GAP between them: two spans
    spans += [(10, 200_000)]  # overlapping the others
    spans += [(299_990, 50)]  # past the end: the CRC of the bytes that are there
    checks = [Check(f"r{i}", o, n, zlib.crc32(data[o : o + n])) for i, (o, n) in enumerate(spans)]
    for workers in (1, 2, 3):
        with open(path, "rb") as f:
            v = Verifier(f.fileno(), checks, source=str(path), workers=workers)
            v.start()
            assert v.join() == [c.crc for c in checks]


def test_asking_the_page_cache_reads_nothing(tmp_path: Path) -> None:
    # a probe that reads (RWF_NOWAIT) starts readahead where it looks, 16 MiB ahead of the reader: a cold pass
    # took 0.75 s instead of 0.64; cachestat counts the cached pages without touching the file
    cachestat = crc._cachestat()
    if cachestat is None:
        pytest.skip("the page cache can be asked without reading only on Linux 6.5+ (cachestat)")
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as f:
        fd = f.fileno()
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cachestat(fd, 0, 8 << 20):
            pytest.skip("this file system keeps the file cached (tmpfs and the like)")
        assert not crc.cached(fd, 0, 8 << 20)
        assert not crc.cached(fd, (8 << 20) - 4096, 8 << 20)
        assert cachestat(fd, 0, 8 << 20) == 0  # still nothing read
        f.read(1 << 20)
        assert crc.cached(fd, 0, 1 << 20)


@pytest.mark.parametrize("kernel", ["cachestat", "before-6.5"])
def test_a_cached_file_is_told_from_a_cold_one_with_or_without_cachestat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    if not sys.platform.startswith("linux") or (kernel == "cachestat" and crc._cachestat() is None):
        pytest.skip("Linux only; cachestat from Linux 6.5")
    if kernel == "before-6.5":  # the one-byte RWF_NOWAIT reads at each end
        monkeypatch.setattr(crc, "_cachestat", lambda: None)
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(4 << 20))
    with open(path, "rb") as f:
        fd = f.fileno()
        os.fsync(fd)
        assert crc.cached(fd, 0, 4 << 20)  # just written
        assert not crc.cached(fd, 0, 5 << 20)  # past the end
        assert not crc.cached(fd, 10, 10)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        stat = crc._cachestat()
        if stat is not None and stat(fd, 0, 4 << 20):
            pytest.skip("this file system keeps the file cached (tmpfs and the like)")
        assert not crc.cached(fd, 1 << 20, 2 << 20)
