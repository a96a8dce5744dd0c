"""The .safetensors side of the fast path: header in, header out, data ranges copied as they are.

The tree built from a header is the checkpoint ``safetensors.restore`` would return (aliases, key order,
``_metadata``, model entry and extras from the ``ckptfix`` metadata), with :class:`StTensor` records in place
of tensors; writing follows ``ckptfix.formats.containers.safetensors.save_safetensors`` byte for byte in its header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.checkpoint import is_tensor
from ckptfix.formats.containers.safetensors import Header, encode_header, restore, split_checkpoint
from ckptfix.formats.containers.ziparchive import BLOCK
from ckptfix.formats.dtypes import FROM_SAFETENSORS, safetensors_code
from ckptfix.formats.pickles.inert import gc_paused
from ckptfix.stream.fallback import Fallback


@dataclass(eq=False)
class StTensor:
    """A tensor of a safetensors file: its bytes are ``[start, end)`` of the file."""

    __ckptfix_tensor__: ClassVar[bool] = True
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def tree_from_header(header: Header, *, source: str) -> Any:
    """The checkpoint the slow reader returns, with StTensor records for tensors (header checked in full)."""
    base = header.data_start
    tensors = {
        key: StTensor(FROM_SAFETENSORS[t.dtype], t.shape, base + t.begin, base + t.end)
        for key, t in header.tensors.items()  # data order, as the torch path reads them
    }
    return restore(tensors, header.metadata, source=source)


@dataclass
class StOutput:
    """A safetensors file to write: its header bytes, then each tensor's bytes from a source range."""

    header: bytes
    ranges: list[tuple[int, int]]  # (source offset, length) in data order

    @property
    def size(self) -> int:
        return len(self.header) + sum(n for _, n in self.ranges)


@gc_paused()  # a range and a header entry per tensor: nothing to collect, only to rescan
def plan_safetensors(obj: Any, *, out: str, locate: Any, keep_offsets: bool = False) -> StOutput:
    """Header and data ranges for ``obj`` (a state dict or a checkpoint with one model entry).

    ``locate(value) -> (dtype, shape, source_offset, nbytes, identity)`` finds a tensor's bytes or raises
    Fallback. Mirrors ``save_safetensors``: tied tensors stored once and recorded as aliases. With
    ``keep_offsets`` the header is padded so that the most bytes keep their source offset modulo 4096 (all of
    them when the data keeps its order, as .safetensors to .safetensors does), for a copy that shares blocks.
    """
    state, meta = split_checkpoint(obj, out=out)
    ranges: list[tuple[int, int]] = []
    stored: list[tuple[str, str, tuple[int, ...], int]] = []
    aliases: dict[str, str] = {}
    seen: dict[Any, str] = {}
    for key, value in state.items():
        if not is_tensor(value):
            raise Fallback(f"key '{key}' holds a {type(value).__name__}, not a tensor")
        dtype, shape, src, nbytes, ident = locate(value)
        if safetensors_code(dtype) is None:
            raise Fallback(f"key '{key}' has dtype {dtype}, which the fast path does not write to safetensors")
        if nbytes > 0 and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        stored.append((key, dtype, tuple(shape), nbytes))
        ranges.append((src, nbytes))
    start = _best_data_start(ranges) if keep_offsets else None
    return StOutput(encode_header(state, meta, stored, aliases, out=out, congruent_to=start), ranges)


def _best_data_start(ranges: list[tuple[int, int]]) -> int | None:
    """The data buffer's start modulo 4096 that keeps the most bytes at their source offset modulo 4096."""
    gain: dict[int, int] = {}
    at = 0
    for src, nbytes in ranges:
        start = (src - at) % BLOCK
        if nbytes and start % 8 == 0:  # the buffer must stay 8-aligned
            gain[start] = gain.get(start, 0) + nbytes
        at += nbytes
    return max(sorted(gain), key=gain.__getitem__) if gain else None
