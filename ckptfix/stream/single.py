"""One file read as the folder stream reads a folder: each tensor a :class:`StTensor` (a byte range of the
file), so that ``--dtype`` and ``--shard-size`` stream from a ``.safetensors`` or ``.pt`` file as they do from a
folder. A ``.pt`` file's records are CRC-checked as the copy runs; what the torch path would build rather than
copy (a view, a conj or neg bit, a tensor with hooks, any other object) steps aside for it (:class:`Fallback`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from ckptfix.formats.copyable import foreign_byte_order, values_as_stored
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.files import DataFiles
from ckptfix.formats.output.crc import Check
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.records import TensorRecord, is_record, map_tree
from ckptfix.formats.safetensors.file import StTensor, losses_note, tree_from_header
from ckptfix.formats.safetensors.header import read_header
from ckptfix.formats.torchio.opaque import describe
from ckptfix.formats.torchzip.archive import NO_CRC, stored_crc
from ckptfix.stream.fallback import Fallback, Reason


def file_tree(src: str, fmt: str, files: DataFiles, *, allowed: frozenset[str]) -> tuple[Any, str]:
    """The checkpoint of file ``src`` (``fmt``: ``safetensors`` or ``torch-zip``) with a :class:`StTensor`
    for each tensor (one record for a tensor stored once under two names), and its kind for the notes."""
    if fmt == "safetensors":
        return tree_from_header(read_header(src), source=src), "safetensors"
    z = describe(files.fd(src), src, allowed=allowed)  # an entry of refused globals kept opaque: carry() refuses it
    if order := foreign_byte_order(z):
        raise Fallback(Reason.BYTE_ORDER_TO_SAFETENSORS, order=order)
    files.checks[src] = [Check(r.name, r.data_offset, r.size, stored_crc(r)) for r in z.archive.records]
    located = _PtRecords(src, z)
    tree = map_tree(z.tree, located, leaf=(inert.InertTensor, inert.InertParameter))
    if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert_trees.walk(tree)):
        raise Fallback(Reason.OBJECTS)
    files.losses = located.losses
    if not z.archive.crc_stored:
        files.notes.append(f"{NO_CRC} in the input")
    return tree, "pt"


def copyable_tensor(value: TensorRecord) -> inert.InertTensor:
    """The torch zip tensor of ``value`` (a .pt's record) when its bytes are what the torch path would build: a
    Parameter without hooks or state, a tensor without hooks, extra state or a conj/neg bit; else
    :class:`Fallback`."""
    if value.parameter_state:
        raise Fallback(Reason.PARAMETER_HOOKS)
    t = value.zip_tensor
    if t is None or not values_as_stored(t):
        raise Fallback(Reason.TENSOR_HOOKS_OR_BITS)
    return t  # type: ignore[no-any-return]


class _PtRecords:
    """A :class:`StTensor` for each plain, contiguous tensor of a ``.pt`` file; tensors viewing the same bytes
    the same way (tied weights) get one, as the torch path stores them once. What each was (a Parameter, a view
    of a larger storage, requires_grad) is kept for :meth:`losses`."""

    def __init__(self, src: str, z: Any) -> None:
        self.src, self.z = src, z
        self.made: dict[Hashable, StTensor] = {}
        self.kinds: dict[int, tuple[bool, bool, bool]] = {}  # id(value) -> (Parameter, view, requires_grad)

    def __call__(self, value: Any) -> StTensor:
        param = value.is_parameter
        t = copyable_tensor(value)
        if not t.is_contiguous():
            raise Fallback(Reason.NON_CONTIGUOUS_TO_TORCH)
        width, nbytes = DTYPES[t.dtype].itemsize, math.prod(t.shape) * DTYPES[t.dtype].itemsize
        rec = self.z.archive.storage(t.storage.key)  # present and in bounds
        ident = t.identity()
        if ident not in self.made:
            start = rec.data_offset + t.offset * width
            self.made[ident] = StTensor(t.dtype, tuple(t.shape), start, start + nbytes, self.src)
        record = self.made[ident]
        grad = value.requires_grad
        self.kinds[id(record)] = self.kinds.get(id(record), (param, rec.size > nbytes, grad))
        return record

    def losses(self, obj: Any) -> str | None:
        """What a .safetensors copy of ``obj``'s model entries does not keep, counted key by key as the torch path
        counts its tensors (``safetensors_losses``): a tensor it casts is a new, plain one of its own storage."""
        from ckptfix.transforms.checkpoint import model_entries

        entries = model_entries(obj)
        states = [obj] if entries == [""] else [obj[e] for e in entries]
        params = views = grads = 0
        for value in (v for state in states for v in state.values()):
            source = value.cast_from if is_record(value) else None  # a cast: a new tensor of its own storage
            cast = source is not None
            kind = self.kinds.get(id(source if cast else value))
            if kind is not None:
                params += kind[0] and not cast
                views += kind[1] and not cast
                grads += kind[2]
        return losses_note(params=params, views=views, grads=grads)


__all__ = ["copyable_tensor", "file_tree"]
