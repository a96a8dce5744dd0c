"""The legacy torch format (``torch.save(..., _use_new_zipfile_serialization=False)``, torch < 1.6).

Five pickles in a row (magic number, protocol version, system info, the object, the storage keys), then the
raw storages. Its pickles go through the same inert reader and allowlist as a zip's ``data.pkl``; torch then
reads the storages, checking each one's stored size itself.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from typing import IO, BinaryIO, cast

from ckptfix.formats.pickles import unpickling

# The legacy format opens with a pickled magic number (PROTO, maybe FRAME, then LONG1 of this value).
MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def check_legacy(path: str, *, allowed: frozenset[str]) -> dict[str, int]:
    """Read the five pickles inertly, every pickle rule applied; nothing is built. Returns how many storages
    carry each device tag (``cuda:0``), as :attr:`ckptfix.reading.Opened.locations` says for a zip."""
    with open(path, "rb") as f:
        _, storages = unpickling.load(
            cast("IO[bytes]", _Bounded(f)), source=path, allowed=allowed, count=5, legacy=True
        )
    return dict(Counter(ref.location for ref in storages.values()))


class _Bounded(io.RawIOBase):
    """A file whose reads never ask for more than what is left, so a forged length cannot allocate gigabytes."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f
        self._left = os.fstat(f.fileno()).st_size

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        n = self._left if n is None or n < 0 else min(n, self._left)
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._f.tell()

    def readline(self, limit: int | None = -1) -> bytes:
        line = self._f.readline(self._left if limit is None or limit < 0 else min(limit, self._left))
        self._left -= len(line)
        return line
