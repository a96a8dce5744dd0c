"""formats/files.py: the one table of open files and the storage seam every byte a reader takes passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfix.errors import FormatError
from ckptfix.formats.files import DataFiles, LocalStorage


def test_each_file_is_opened_once_and_read_through_the_seam(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)))
    files = DataFiles()
    try:
        assert files.fd(str(path)) == files.fd(str(path))  # one descriptor per file, whoever asks
        assert files.read(str(path), 10, 4) == bytes([10, 11, 12, 13])
        assert files.storage.size(str(path)) == 256
        assert files.storage.listdir(str(tmp_path)) == ["data.bin"]
        with pytest.raises(FormatError, match="ends before byte 300; it is truncated"):
            files.read(str(path), 250, 50)
        files.check_unchanged()
        path.write_bytes(b"changed")
        with pytest.raises(FormatError):
            files.check_unchanged()
    finally:
        files.close()
    files.close()  # closing twice closes nothing twice


def test_a_storage_plugs_in_at_one_place(tmp_path: Path) -> None:
    """Bytes a reader takes come from the table's storage: another backend is one object with its four methods."""
    asked: list[tuple[str, int, int]] = []

    class Remote(LocalStorage):
        def read(self, path: str, offset: int, length: int) -> bytearray:
            asked.append((os.path.basename(path), offset, length))
            return super().read(path, offset, length)

    path = tmp_path / "blob"
    path.write_bytes(b"0123456789")
    files = DataFiles()
    files.storage = Remote(files.fd)
    try:
        assert files.read(str(path), 2, 3) == b"234"
    finally:
        files.close()
    assert asked == [("blob", 2, 3)]


def test_open_atomic_writes_the_file_only_when_complete(tmp_path: Path) -> None:
    storage = LocalStorage(lambda p: os.open(p, os.O_RDONLY))
    out = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), storage.open_atomic(str(out)) as f:
        f.write(b"half")
        raise RuntimeError("interrupted")
    assert not out.exists()
    with storage.open_atomic(str(out)) as f:
        f.write(b"whole")
    assert out.read_bytes() == b"whole"
