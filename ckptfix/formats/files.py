"""The data files of a folder being read a tensor at a time: each opened once, and checked unchanged at the end."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ckptfix.formats.output.crc import Check
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity


class DataFiles:
    """The folder's data files, each opened once and checked unchanged at the end; where each chunk's bytes are
    and the CRC checks of every record of their archives."""

    def __init__(self) -> None:
        self.open: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.located: dict[int, tuple[int, int]] = {}  # id(chunk) -> (fd, offset of its bytes)
        self.checks: dict[str, list[Check]] = {}
        self.notes: list[str] = []  # what the reader has to say of the folder (a DeepSpeed run's)
        # what a .safetensors output of the converted tree does not keep, where the input can say (a .pt's)
        self.losses: Callable[[Any], str | None] | None = None

    def fd(self, path: str) -> int:
        if path not in self.open:
            fd = os.open(path, os.O_RDONLY)
            self.open[path] = (fd, file_identity(fd))
        return self.open[path][0]

    def check_unchanged(self) -> None:
        for path, (fd, before) in self.open.items():
            if file_identity(fd) != before:
                raise changed_while_reading(path)

    def close(self) -> None:
        for fd, _ in self.open.values():
            os.close(fd)
