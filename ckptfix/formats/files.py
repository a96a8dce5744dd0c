"""The one table of open files a checkpoint is read through, and the one seam every byte a reader takes passes.

:class:`Storage` is that seam: a file's size, bytes at an offset, a folder's listing, a file written atomically.
:class:`LocalStorage` serves local files (``os.pread`` on a descriptor opened once; the copy paths also ask
:meth:`DataFiles.fd` for the descriptor itself, to keep ``copy_file_range`` and reflinks); an object store is one more
class with these four methods. :class:`DataFiles` is the table an opened checkpoint (``ckptfix.formats.opened``)
owns: each data file opened once and checked unchanged at the end, where each DCP chunk's bytes lie, the CRC checks
still to run, and what the reader had to say.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Protocol

from ckptfix.errors import FormatError
from ckptfix.formats.output.crc import Check
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Storage(Protocol):
    """Where a checkpoint's bytes live: all a reader asks of them."""

    def size(self, path: str) -> int:
        """Bytes in file ``path``."""
        ...

    def read(self, path: str, offset: int, length: int) -> bytearray:
        """Bytes ``[offset, offset + length)`` of file ``path``, all of them (a short file is refused)."""
        ...

    def listdir(self, path: str) -> list[str]:
        """The names in folder ``path``, sorted."""
        ...

    def open_atomic(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A file that becomes ``path`` only when its block completes (temp file, fsync, rename)."""
        ...


def pread_all(fd: int, offset: int, length: int, *, source: str) -> bytearray:
    """Bytes ``[offset, offset + length)`` of open file ``fd``, read in pieces of at most 1 GiB."""
    buf = bytearray(length)
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done : done + (1 << 30)]], offset + done)
        if n == 0:
            raise FormatError(
                f"{source}: ends before byte {offset + length}; it is truncated, re-download or re-save it"
            )
        done += n
    return buf


class LocalStorage:
    """The local file system: each file opened once (by its :class:`DataFiles` table), read with ``os.pread``."""

    def __init__(self, fd_of: Callable[[str], int]) -> None:
        self.fd_of = fd_of

    def size(self, path: str) -> int:
        return os.fstat(self.fd_of(path)).st_size

    def read(self, path: str, offset: int, length: int) -> bytearray:
        return pread_all(self.fd_of(path), offset, length, source=path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    @contextlib.contextmanager
    def open_atomic(self, path: str) -> Iterator[BinaryIO]:
        from ckptfix.formats.output.atomic import atomic_output

        with atomic_output(path) as out:
            yield out


class DataFiles:
    """The files a checkpoint is read from, each opened once and checked unchanged at the end; where each chunk's
    bytes are and the CRC checks of every record of their archives. Bytes are read through :attr:`storage`."""

    def __init__(self) -> None:
        self.open: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.located: dict[int, tuple[int, int]] = {}  # id(chunk) -> (fd, offset of its bytes)
        self.checks: dict[str, list[Check]] = {}
        self.notes: list[str] = []  # what the reader has to say of the folder (a DeepSpeed run's)
        # what a .safetensors output of the converted tree does not keep, where the input can say (a .pt's)
        self.losses: Callable[[Any], str | None] | None = None
        self.storage: Storage = LocalStorage(self.fd)

    def fd(self, path: str) -> int:
        """The local descriptor of ``path``, opened once (the copy paths' ``copy_file_range`` and reflinks)."""
        if path not in self.open:
            fd = os.open(path, os.O_RDONLY | _CLOEXEC)
            self.open[path] = (fd, file_identity(fd))
        return self.open[path][0]

    def read(self, path: str, offset: int, length: int) -> bytearray:
        return self.storage.read(path, offset, length)

    def check_unchanged(self) -> None:
        for path, (fd, before) in self.open.items():
            if file_identity(fd) != before:
                raise changed_while_reading(path)

    def close(self) -> None:
        opened, self.open = self.open, {}
        for fd, _ in opened.values():
            os.close(fd)
