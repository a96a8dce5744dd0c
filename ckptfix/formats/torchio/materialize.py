"""Build real tensors from a checked torch zip description: the torch path's consumer of :class:`TorchZip`.

Each storage record becomes a view of the file, mapped copy-on-write (as ``torch.load(mmap=True)``) or read into
memory; each tensor record becomes ``set_`` over its storage; containers and allowlisted calls are rebuilt with
shared objects kept shared. Nothing here parses the file again: it only uses what the reader already checked.
Recipes it does not rebuild (quantized, sparse, subclass tensors, raw storages, big-endian files) raise
:class:`NotBuilt`, and the caller hands the file to ``torch.load(weights_only=True)`` instead.
"""

from __future__ import annotations

import importlib
import mmap as mmap_module
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.copyable import foreign_byte_order, hooks_or_state, parameter_hooks_or_state, torch_rebuilt
from ckptfix.formats.pickles import inert
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio import devices
from ckptfix.formats.torchio.opaque import OpaqueEntry
from ckptfix.formats.torchzip.reader import TorchZip


class NotBuilt(Exception):  # noqa: N818 - a signal to the caller, not an error
    """The description holds a recipe this module does not rebuild; ``torch.load`` does."""


def materialize(
    z: TorchZip,
    fd: int,
    *,
    mmap: bool = True,
    tree: Any = None,
    leaf: Callable[[Any], Any] | None = None,
    mapped: mmap_module.mmap | None = None,
) -> Any:
    """The checkpoint ``torch.load(weights_only=True)`` would return, built from the description.

    ``tree`` replaces ``z.tree`` (a part of it, or a rewrite over the same storages); ``leaf(obj)`` builds objects
    that are none of the inert reader's (the sanitizer's numpy arrays). Opaque entries stay as they are.
    ``mapped`` is the file already mapped (copy-on-write) by a caller that reads many archives from one file.
    """
    import torch

    if order := foreign_byte_order(z):
        raise NotBuilt(f"a {order} file")
    builder = _Builder(torch, _storages(torch, z, fd, mmap=mmap, mapped=mapped), leaf)
    return builder.build(z.tree if tree is None else tree)


def map_file(fd: int) -> mmap_module.mmap:
    return mmap_module.mmap(fd, 0, access=mmap_module.ACCESS_COPY)  # private: writes never reach the file


def _storages(torch: Any, z: TorchZip, fd: int, *, mmap: bool, mapped: mmap_module.mmap | None) -> dict[str, Any]:
    if not mmap:
        mapped = None
    elif mapped is None and any(ref.nbytes for ref in z.storages.values()):
        mapped = map_file(fd)
    out: dict[str, Any] = {}
    for key in z.storages:
        rec = z.archive.storage(key)  # present and of the right size: the reader
        if rec.size == 0:
            out[key] = torch.UntypedStorage(0)
        elif mapped is not None:
            out[key] = torch.frombuffer(mapped, dtype=torch.uint8, count=rec.size, offset=rec.data_offset)
        else:
            buf = bytearray(rec.size)
            os.preadv(fd, [buf], rec.data_offset)
            out[key] = torch.frombuffer(buf, dtype=torch.uint8)
        if rec.size:
            out[key] = out[key].untyped_storage()
        devices.note(out[key], z.storages[key].location)
    return out


class _Builder:
    def __init__(self, torch: Any, storages: dict[str, Any], leaf: Callable[[Any], Any] | None = None) -> None:
        self.torch = torch
        self.storages = storages
        self.leaf = leaf
        self.done: dict[int, Any] = {}  # by id of the inert object: shared stays shared (tied weights)
        self.keep: list[Any] = []  # the inert objects, alive while their ids are keys

    def build(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return obj
        ident = id(obj)
        if ident in self.done:
            return self.done[ident]
        value = self._new(obj)
        self.done[ident] = value
        self.keep.append(obj)
        return value

    def _new(self, obj: Any) -> Any:
        if isinstance(obj, inert.InertParameter):
            return self._parameter(obj)
        if isinstance(obj, inert.InertTensor):
            return self._tensor(obj)
        if isinstance(obj, inert.StorageRef):
            raise NotBuilt("a raw storage")
        if isinstance(obj, type) and issubclass(obj, inert.Global):
            return _resolve(obj)
        if isinstance(obj, dict):
            return self._mapping(obj)
        if isinstance(obj, list):
            out: list[Any] = []
            self.done[id(obj)] = out  # before the items: a list may hold itself only via the memo, never here
            out.extend(self.build(v) for v in obj)
            return out
        if isinstance(obj, tuple):
            return tuple(self.build(v) for v in obj)
        if isinstance(obj, inert.Inert):
            return self._call(obj)
        if isinstance(obj, OpaqueEntry):
            return obj  # never built: the caller needs none of its values
        if self.leaf is not None:
            return self.leaf(obj)
        raise NotBuilt(f"a {type(obj).__name__}")

    def _mapping(self, obj: dict[Any, Any]) -> Any:
        out: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[self.build(key)] = self.build(value)
        for name, value in vars(obj).items() if isinstance(obj, OrderedDict) else ():
            setattr(out, name, self.build(value))  # _metadata: the module versions
        return out

    def _tensor(self, t: inert.InertTensor) -> Any:
        if hooks_or_state(t):
            raise NotBuilt("a tensor with backward hooks or extra state")
        bits = t.math_bits
        torch = self.torch
        dtype = getattr(torch, t.dtype)
        tensor = torch.empty((0,), dtype=dtype)
        tensor.set_(self.storages[t.storage.key], t.offset, t.shape, t.stride)
        if t.args[4]:
            tensor.requires_grad = True
        if bits:  # after requires_grad, as torch's _rebuild_tensor_v2: a conj or neg view, as torch.load gives it
            torch._utils.set_tensor_metadata(tensor, bits)
        return tensor

    def _parameter(self, p: inert.InertParameter) -> Any:
        if parameter_hooks_or_state(p):
            raise NotBuilt("a Parameter with hooks or state")
        return self.torch.nn.Parameter(self._tensor(p.data), requires_grad=bool(p.args[1]))

    def _call(self, obj: inert.Inert) -> Any:
        if torch_rebuilt(obj.func.module):
            raise NotBuilt(f"{obj.func.full}(...)")  # quantized, sparse, subclass and device tensors
        func = _resolve(obj.func)
        args = self.build(obj.args)
        value = func.__new__(func, *args) if obj.newobj else func(*args)
        if obj.has_state:
            state = self.build(obj.state)
            if hasattr(value, "__setstate__"):
                value.__setstate__(state)
            else:
                value.__dict__.update(state)
        return value


def _resolve(glob: type[inert.Global]) -> Any:
    """The real object behind an allowlisted stand-in (the reader refused, or left opaque, every other name)."""
    if allowlist.can_run_code(glob.full):  # never reached (opaque entries are not built); kept as a last guard
        raise FormatError(f"refusing to build {glob.full}, which can run code")
    value: Any = importlib.import_module(glob.module)
    for part in glob.name.split("."):
        value = getattr(value, part)
    return value
