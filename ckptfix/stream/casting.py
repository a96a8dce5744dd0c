"""``--dtype`` on the streaming path: each floating-point tensor cast as it is written, a block at a time.

The rule of which tensors are cast is the torch path's (:func:`ckptfix.conversion.files.cast_floating`): the
floating-point tensors of the converted model entries, integer buffers kept, a tensor already of the dtype
copied as it is, a tensor under two names cast once. A cast is elementwise, so casting a block of a tensor's
bytes gives the bytes the whole tensor would: memory holds one block (or, for a tensor that must be gathered
first, that one tensor), never the model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.errors import FormatError
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.records import FileTable, RunReader, TensorRecord
from ckptfix.transforms.checkpoint import Conversion, is_tensor, replace_model_tensors

_BLOCK = 1 << 24  # bytes of the input cast at once: 16 MiB in, at most 32 MiB out (float16 to float32)


@dataclass(eq=False)
class CastTensor(TensorRecord):
    """Tensor record ``source`` (its bytes in ``stored``, read through ``via`` first where the reader casts, as
    a DeepSpeed half-precision buffer becomes float32) written as ``dtype``."""

    streamable: ClassVar[bool] = True

    key: str
    source: Any
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def requires_grad(self) -> bool:
        return bool(self.source.requires_grad)  # as Tensor.to keeps it

    @property
    def cast_from(self) -> Any:
        return self.source

    def read_runs(self, reader: RunReader, *, key: str) -> Any:
        """The source read whole, then cast: two tensors of this one held."""
        import torch

        return self.source.read_runs(reader, key=key).to(getattr(torch, self.dtype))

    streams_bytes: ClassVar[bool] = True

    def prepare_copy(self, files: FileTable, *, allowed: frozenset[str]) -> None:
        self.source.prepare_copy(files, allowed=allowed)

    def write_made(self, write: Callable[[Any], Any], files: FileTable) -> str:
        """Its bytes cast a block at a time from its source's runs (a DCP tensor of blocks gathered first); a
        source whose reader casts (a ZeRO half-precision buffer) is read through that cast first."""
        src = self.source
        via = src.dtype if src.stored_dtype != src.dtype else None
        pieces = src.stored_ranges(files)
        write_cast(
            write,
            self,
            stored=src.stored_dtype,
            via=via,
            pieces=pieces,
            fd_of=files.fd,
            whole=lambda: src.gathered(files),
        )
        return "cast"


def is_floating(dtype: str) -> bool:
    """True for the dtypes ``torch.Tensor.is_floating_point`` says are (float8 included); False for a name this
    torch does not have (no tensor of it can be loaded to cast on the torch path either)."""
    import torch

    found = getattr(torch, dtype, None)
    return isinstance(found, torch.dtype) and found.is_floating_point


def cast_records(conversion: Conversion, dtype: str) -> int:
    """Put a :class:`CastTensor` in place of each floating-point tensor record of the converted model entries
    whose dtype is not ``dtype``; returns how many tensors are cast."""
    count = 0

    def cast(key: str, t: Any) -> CastTensor | None:
        nonlocal count
        kind = getattr(t, "dtype", None)
        if not is_tensor(t) or not isinstance(kind, str) or kind == dtype or not is_floating(kind):
            return None
        count += 1
        return CastTensor(key, t, dtype)

    replace_model_tensors(conversion, cast)
    return count


def write_cast(
    write: Callable[[bytes | memoryview], Any],
    t: CastTensor,
    *,
    stored: str,
    via: str | None,
    pieces: Iterable[tuple[str, int, int]] | None,
    fd_of: Callable[[str], int],
    whole: Callable[[], Any],
) -> None:
    """Write ``t``'s cast bytes with ``write``: read from ``pieces`` ((path, offset, length) of its bytes in
    ``stored``, in order) a block at a time, or, when None, from ``whole()`` (the source tensor gathered)."""
    import torch

    from ckptfix.formats.safetensors.file import tensor_bytes

    target = getattr(torch, t.dtype)
    if pieces is None:
        write(tensor_bytes(whole().to(target)))
        return
    pieces = list(pieces)
    item, total = DTYPES[stored].itemsize, sum(length for _, _, length in pieces)
    if not total:
        return
    step = min(max(_BLOCK // item, 1), total // item) * item
    # one input and one output buffer for the whole tensor, reused block after block (no allocation per block)
    block = bytearray(step)
    values = torch.frombuffer(block, dtype=getattr(torch, stored))
    out = torch.empty(step // item, dtype=target)
    for path, offset, length in pieces:
        for at in range(0, length, step):
            n = min(step, length - at) // item
            _read(fd_of(path), offset + at, memoryview(block)[: n * item], path=path, key=t.key)
            cast = out[:n]
            cast.copy_(values[:n] if via is None else values[:n].to(getattr(torch, via)))  # as Tensor.to converts
            write(tensor_bytes(cast))


def _read(fd: int, offset: int, view: memoryview, *, path: str, key: str) -> None:
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise FormatError(f"{path}: ends inside '{key}'; it was truncated while reading: copy it again")
        done += got


__all__ = ["CastTensor", "cast_records", "is_floating", "write_cast"]
