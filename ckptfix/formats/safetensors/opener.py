"""A safetensors file opened as its header's tensor records (its registry row's ``open``), read on demand through
the open file; ``verify`` reads it through (it has no checksums: what is checked is that every byte is there)."""

from __future__ import annotations

import os

from ckptfix.errors import FormatError
from ckptfix.formats.opened import Opened, OpenOptions
from ckptfix.formats.safetensors.file import read_header, tree_from_header
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity

_CHUNK = 1 << 24


def open_safetensors(source: str, options: OpenOptions) -> Opened:
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = file_identity(fd)
        header = read_header(source)
        if file_identity(fd) != before:
            raise changed_while_reading(source)
        if options.verify:
            _read_through(fd, header.data_start, os.fstat(fd).st_size, source=source)
        tree = tree_from_header(header, source=source)
    except BaseException:
        os.close(fd)
        raise
    return Opened(source=source, fmt="safetensors", tree=tree, fd=fd, before=before)


def _read_through(fd: int, start: int, end: int, *, source: str) -> None:
    at = start
    while at < end:
        n = len(os.pread(fd, min(_CHUNK, end - at), at))
        if n == 0:
            raise FormatError(f"{source}: ends before byte {end}; it is truncated, re-download or re-save it")
        at += n
