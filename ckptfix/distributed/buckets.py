"""Move many tensors from one rank to the others in a few bounded broadcasts, as raw bytes.

Every tensor is sent as its bytes, so one uint8 bucket carries any mix of dtypes (bool, bfloat16, float8,
complex) the same way over gloo and NCCL, and the received values are bitwise those of the source.
Small tensors share a bucket; a tensor larger than a bucket is broadcast straight into its destination.
The plan depends only on the manifest, which every rank holds in the same order, so every rank makes the
same broadcasts in the same order whatever its devices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Offsets inside a bucket are kept to this many bytes so that a slice can be viewed as any dtype.
_ALIGN = 64
DIRECT_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of the manifest: where it goes, its shape and dtype (a ``torch`` attribute name)."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> Entry:
        return cls(key, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            from ckptfix.errors import DistributedError

            raise DistributedError(f"tensor '{self.key}': dtype '{self.dtype}' is unknown to this rank's torch")
        return dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.torch_dtype().itemsize

    def meta(self) -> torch.Tensor:
        """A tensor with this shape and dtype that holds no memory, for checks against a model."""
        import torch

        return torch.empty(self.shape, dtype=self.torch_dtype(), device="meta")


@dataclass(frozen=True)
class TensorRef:
    """Stands in for the ``index``-th tensor of the manifest inside a broadcast object tree."""

    index: int


def strip_tensors(obj: Any, entries: list[Entry], tensors: list[torch.Tensor], path: str = "") -> Any:
    """Copy of ``obj`` with every tensor replaced by a :class:`TensorRef`; appends to ``entries``/``tensors``."""
    import torch

    if isinstance(obj, torch.Tensor):
        entries.append(Entry.of(path or "<root>", obj))
        tensors.append(obj)
        return TensorRef(len(tensors) - 1)
    if isinstance(obj, Mapping):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = strip_tensors(value, entries, tensors, f"{path}[{key!r}]")
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [strip_tensors(v, entries, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def fill_tensors(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`strip_tensors`: put ``tensors[ref.index]`` back in place of each reference."""
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    if isinstance(obj, Mapping):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = fill_tensors(value, tensors)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [fill_tensors(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


@dataclass(frozen=True)
class Transfer:
    """One broadcast: ``(index, offset, nbytes)`` slots of one bucket, or one tensor alone (``direct``)."""

    slots: tuple[tuple[int, int, int], ...]
    size: int
    direct: bool


def plan(entries: Sequence[Entry], bucket_bytes: int) -> list[Transfer]:
    """Pack small entries, in manifest order, into buckets of at most ``bucket_bytes``; larger ones go alone.

    A tensor of ``DIRECT_BYTES`` or more is broadcast straight from the source's tensor into the receiver's:
    no copy on either side, and at that size the cost of one more broadcast call is noise.
    """
    direct_bytes = min(bucket_bytes, DIRECT_BYTES)
    transfers: list[Transfer] = []
    slots: list[tuple[int, int, int]] = []
    used = 0
    for index, entry in enumerate(entries):
        nbytes = entry.nbytes
        if nbytes == 0:
            continue
        if nbytes >= direct_bytes:
            transfers.append(Transfer(((index, 0, nbytes),), nbytes, direct=True))
            continue
        if used + nbytes > bucket_bytes:
            transfers.append(Transfer(tuple(slots), used, direct=False))
            slots, used = [], 0
        slots.append((index, used, nbytes))
        used = -(-(used + nbytes) // _ALIGN) * _ALIGN
    if slots:
        transfers.append(Transfer(tuple(slots), used, direct=False))
    return transfers


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    # A weights-only load can return a conjugate or negative view (a bit, not values): send the values.
    return tensor.resolve_conj().resolve_neg().contiguous()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def run(
    transfers: Sequence[Transfer],
    tensors: Sequence[torch.Tensor],
    *,
    send: bool,
    device: torch.device,
    broadcast: Callable[[torch.Tensor], None],
) -> None:
    """Broadcast ``tensors`` (``send``) or overwrite them in place with what arrives (receivers).

    A receiver holds at most one bucket besides its own tensors; a tensor that is not contiguous on the
    communication device goes through a temporary of its own size.
    """
    import torch

    largest = max((t.size for t in transfers if not t.direct), default=0)
    bucket = torch.empty(largest, dtype=torch.uint8, device=device) if largest else None
    with torch.no_grad():
        for transfer in transfers:
            if transfer.direct:
                _run_direct(tensors[transfer.slots[0][0]], send=send, device=device, broadcast=broadcast)
                continue
            assert bucket is not None  # invariant of plan(): a bucket transfer has a size > 0
            flat = bucket[: transfer.size]
            if send:
                for index, offset, nbytes in transfer.slots:
                    flat[offset : offset + nbytes].copy_(_as_bytes(_plain(tensors[index])))
            broadcast(flat)
            if not send:
                for index, offset, nbytes in transfer.slots:
                    _receive(tensors[index], flat[offset : offset + nbytes])
    del bucket


def _run_direct(
    tensor: torch.Tensor, *, send: bool, device: torch.device, broadcast: Callable[[torch.Tensor], None]
) -> None:
    import torch

    if send:
        broadcast(_as_bytes(_plain(tensor.to(device))))
        return
    if tensor.device == device and tensor.is_contiguous():
        broadcast(_as_bytes(tensor))
        return
    staging = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8, device=device)
    broadcast(staging)
    _receive(tensor, staging)


def _receive(tensor: torch.Tensor, data: torch.Tensor) -> None:
    if tensor.is_contiguous():
        _as_bytes(tensor).copy_(data)
    else:
        tensor.copy_(data.view(tensor.dtype).view(tensor.shape))
