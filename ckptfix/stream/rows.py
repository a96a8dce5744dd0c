"""A tensor made of row ranges of another tensor record: Megatron's fused QKV split per query group into q, k and v,
its ``[gate; up]`` split in two, its padded vocabulary cut (:mod:`ckptfix.exporting.megatron`); a Llama query or key
projection's rows reordered within each head (:mod:`ckptfix.exporting.llama`).

The rows of a row-major tensor are runs of its bytes, so where the source's bytes are runs of files (a DCP tensor
chunked by rows) the new tensor's are sub-runs of them: copied file to file, never held. Where they are not (a DCP
tensor of blocks), the source is gathered (one tensor in memory) and its rows taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.records import FileTable, TensorRecord, is_record


@dataclass(eq=False)
class RowsTensor(TensorRecord):
    """Rows ``spans`` (``[(start, stop), …]``, in order of the output) of tensor record ``source``."""

    key: str
    source: Any
    spans: tuple[tuple[int, int], ...]

    @property
    def dtype(self) -> str:
        return str(self.source.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(b - a for a, b in self.spans), *tuple(self.source.shape)[1:])

    @property
    def row_bytes(self) -> int:
        return int(math.prod(tuple(self.source.shape)[1:])) * DTYPES[self.dtype].itemsize

    streams_bytes: ClassVar[bool] = True

    def prepare_copy(self, files: FileTable, *, allowed: frozenset[str]) -> None:
        self.source.prepare_copy(files, allowed=allowed)

    def stored_ranges(self, files: FileTable) -> list[tuple[str, int, int]] | None:
        return rows_ranges(self, self.source.stored_ranges(files))

    def write_made(self, write: Callable[[Any], Any], files: FileTable) -> str:
        from ckptfix.formats.safetensors.file import tensor_bytes

        write(tensor_bytes(self.gathered(files)))
        return "gathered"

    def gathered(self, files: FileTable) -> Any:
        return rows_of(self, self.source.gathered(files))


def take_rows(t: Any, spans: list[tuple[int, int]]) -> Any:
    """The rows ``spans`` of tensor ``t``, in a tensor of their own (no storage shared with ``t``); of a tensor
    record, a record of them (its bytes copied as sub-ranges of the source's when written). The one way a name
    map (:mod:`ckptfix.exporting.megatron`, :mod:`ckptfix.exporting.llama`) splits or reorders a tensor's rows."""
    if len(spans) == 1 and spans[0] == (0, int(t.shape[0])):
        return t
    if is_record(t):
        return RowsTensor(str(getattr(t, "key", "")), t, tuple(spans))
    import torch

    return torch.cat([t[a:b] for a, b in spans]).clone()


def sub_ranges(ranges: list[tuple[str, int, int]], start: int, stop: int) -> list[tuple[str, int, int]]:
    """The runs ``(path, offset, length)`` that are bytes ``[start, stop)`` of the bytes ``ranges`` make in turn."""
    out, at = [], 0
    for path, offset, length in ranges:
        lo, hi = max(start, at), min(stop, at + length)
        if lo < hi:
            out.append((path, offset + lo - at, hi - lo))
        at += length
    return out


def rows_ranges(t: RowsTensor, ranges: list[tuple[str, int, int]] | None) -> list[tuple[str, int, int]] | None:
    """``t``'s bytes as runs of files, from its source's (``ranges``; None: they are not runs, nor are ``t``'s)."""
    if ranges is None:
        return None
    step = t.row_bytes
    return [r for a, b in t.spans for r in sub_ranges(ranges, a * step, b * step)]


def rows_of(t: RowsTensor, whole: Any) -> Any:
    """``t`` from its source's tensor ``whole`` (gathered), its rows in a tensor of their own."""
    import torch

    return torch.cat([whole[a:b] for a, b in t.spans]).contiguous()


__all__ = ["RowsTensor", "rows_of", "rows_ranges", "sub_ranges", "take_rows"]
