"""A tensor as its bytes, read without torch: what comparing and copying need, arithmetic aside.

``diff`` and ``merge`` mostly ask whether two tensors are the same bytes (equal bytes are equal tensors, bit for
bit) and copy tensors from an input to the output; neither needs torch, whose import takes seconds and 200 MB. A
:class:`RawTensor` is a contiguous tensor's values in row-major order, little-endian as every file ckptfix reads
without torch stores them; :func:`as_tensor` makes it a torch tensor (importing torch) only where values are
computed with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfix.errors import FormatError
from ckptfix.formats.records import TensorRecord

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class RawTensor(TensorRecord):
    """A contiguous tensor's bytes (``data``), its dtype (torch's name, ``float32``) and shape; ``source`` names
    the file it was read from, for errors."""

    dtype: str
    shape: tuple[int, ...]
    data: bytearray
    source: str = ""

    def numel(self) -> int:
        return math.prod(self.shape)

    def same_bytes(self, other: Any) -> bool | None:
        if not isinstance(other, RawTensor):
            return None  # a torch tensor: compared by torch
        return self.dtype == other.dtype and self.shape == other.shape and self.data == other.data

    def to_torch(self) -> torch.Tensor:
        """The tensor, in memory of its own (the bytes are not copied)."""
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise FormatError(
                f"{self.source}: a tensor has dtype {self.dtype}, which this torch cannot represent; upgrade torch"
            )
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(self.data, dtype=torch.uint8).view(dtype).reshape(self.shape)


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its conjugate and negative bits applied (``t.conj()``, ``torch._neg_view(t)``): a tensor whose
    storage holds its values, which is ``t`` itself when neither bit is set. A view with a bit shares the
    storage of the tensor it views, whose bytes are the values before the bit."""
    return t.detach().resolve_conj().resolve_neg()


def as_tensor(value: Any) -> Any:
    """``value`` as a torch tensor when it is a :class:`RawTensor`; anything else as it is."""
    return value.to_torch() if isinstance(value, RawTensor) else value
