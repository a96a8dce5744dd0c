"""What torch's DCP writer plans for a state dict, without torch: the flat items (``flatten_state_dict``) and the
``.metadata`` pickle (``Metadata`` and the dataclasses in it) that its ``FileSystemWriter`` writes for them.

The items are DCP's own flattening (``torch.distributed.checkpoint._traverse.traverse_state_dict``, torch 2.4 on):
dicts are entered (keys become ``str(key)``), a list is entered where it holds a tensor or a non-terminal dict or
list, anything else (a tuple, a list of numbers, an empty list) is one value, pickled whole; an empty dict is
nothing. The flat name is the path joined by dots.

The pickle names torch's classes by reference (``GLOBAL``) and gives each its fields as state, as ``pickle.dump``
does for a dataclass: ``NEWOBJ`` then ``BUILD`` with the instance dict (a tuple for ``TensorProperties``, whose
``__setstate__`` takes one). Loading sets each field by name, so a release whose dataclass lacks a field (torch 2.4-2.6:
no ``StorageMeta.modules``, no ``Metadata.version``) only gets an extra attribute, and a field it has that is not
written (``_StorageInfo.transform_descriptors``, left out as torch leaves it out) falls back to its class default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.formats.pickles import pickling
from ckptfix.formats.pickles.inert import Global, Inert, make_global

Path = tuple[str | int, ...]
_META = "torch.distributed.checkpoint.metadata"
DCP_VERSION = "1.0.0"  # filesystem.CURRENT_DCP_VERSION of the torch releases that write one (2.7 on)


@dataclass(frozen=True)
class Item:
    """One value DCP writes: its flat name, its path in the tree, and the value (a tensor record or an object)."""

    fqn: str
    path: Path
    value: Any


def flatten(tree: dict[Any, Any], *, is_tensor: Callable[[Any], bool]) -> list[Item]:
    """The items of ``tree`` in the order DCP plans them (``flatten_state_dict``); ``is_tensor`` picks the tensor
    records. A flat name met twice is :class:`Fallback` (torch's writer refuses it in its own words)."""
    items: list[Item] = []
    seen: set[str] = set()

    def terminal(value: Any) -> bool:
        if isinstance(value, dict):
            return False
        if type(value) is not list:
            return True
        return not any(((isinstance(v, dict) or type(v) is list) and not terminal(v)) or is_tensor(v) for v in value)

    def visit(path: Path, value: Any) -> Iterator[Item]:
        if isinstance(value, dict):
            for k, v in value.items():
                yield from visit((*path, str(k)), v)
        elif is_tensor(value) or terminal(value):
            yield Item(".".join(map(str, path)), path, value)
        else:  # a list holding tensors, or dicts or lists that are
            for i, v in enumerate(value):
                yield from visit((*path, i), v)

    for item in visit((), tree):
        if item.fqn in seen:
            raise Fallback(Reason.DCP_NAME_TWICE, fqn=item.fqn)
        seen.add(item.fqn)
        items.append(item)
    return items


@dataclass(frozen=True)
class Stored:
    """Where an item's bytes went: file name in the folder, offset, length (a ``_StorageInfo``)."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorMeta:
    """What ``TensorStorageMetadata`` says of a tensor written whole (one chunk)."""

    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool


class _Globals:
    def __init__(self) -> None:
        self.made: dict[tuple[str, str], type[Global]] = {}

    def __call__(self, module: str, name: str) -> type[Global]:
        if (module, name) not in self.made:
            self.made[module, name] = make_global(module, name)
        return self.made[module, name]


def _new(glob: type[Global], state: Any) -> Inert:
    """An instance as ``pickle`` writes a dataclass: ``cls.__new__(cls)``, then its state."""
    obj = Inert(glob, ())
    obj.newobj, obj.has_state, obj.state = True, True, state
    return obj


def metadata_pickle(
    items: list[tuple[Item, TensorMeta | None, Stored]], *, checkpoint_id: str | None, save_id: str
) -> bytes:
    """The ``.metadata`` pickle of a folder holding ``items``: each with its tensor's metadata (None for an object,
    written as bytes) and where it was stored."""
    g = _Globals()
    size = g("torch", "Size")
    layout = Inert(g("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Inert(g(_META, "_MEM_FORMAT_ENCODING"), (0,))  # TORCH_CONTIGUOUS_FORMAT

    def torch_size(dims: tuple[int, ...]) -> Inert:
        return Inert(size, (tuple(dims),))

    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    for item, meta, stored in items:
        if meta is None:
            state_dict_metadata[item.fqn] = _new(g(_META, "BytesStorageMetadata"), {})
            index = _new(g(_META, "MetadataIndex"), {"fqn": item.fqn, "offset": None, "index": None})
        else:
            properties = _new(
                g(_META, "TensorProperties"),
                (g("torch", meta.dtype), layout, meta.requires_grad, contiguous, False),  # pin_memory: a CPU file
            )
            zeros = torch_size((0,) * len(meta.shape))
            chunk = _new(g(_META, "ChunkStorageMetadata"), {"offsets": zeros, "sizes": torch_size(meta.shape)})
            state_dict_metadata[item.fqn] = _new(
                g(_META, "TensorStorageMetadata"),
                {"properties": properties, "size": torch_size(meta.shape), "chunks": [chunk]},
            )
            # the index hint torch's global plan gives the first chunk (create_default_global_save_plan)
            index = _new(g(_META, "MetadataIndex"), {"fqn": item.fqn, "offset": zeros, "index": 0})
        storage_data[index] = _new(
            g("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            {"relative_path": stored.relative_path, "offset": stored.offset, "length": stored.length},
        )
    storage_meta = _new(
        g(_META, "StorageMeta"), {"checkpoint_id": checkpoint_id, "save_id": save_id, "load_id": None, "modules": []}
    )
    metadata = _new(
        g(_META, "Metadata"),
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": {item.fqn: item.path for item, _, _ in items},
            "storage_data": storage_data,
            "storage_meta": storage_meta,
            "version": DCP_VERSION,
        },
    )
    return pickling.dump(metadata)


__all__ = ["DCP_VERSION", "Item", "Stored", "TensorMeta", "flatten", "metadata_pickle"]
