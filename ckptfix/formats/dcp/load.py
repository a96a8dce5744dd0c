"""A DCP folder read the torch way: every chunk's archive materialised (mapped where it can be) and the chunked
tensors assembled, the nested dict ``dcp.save`` was given (the registry row's ``load``)."""

from __future__ import annotations

import io
import os
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.copyable import foreign_byte_order
from ckptfix.formats.dcp.reader import Chunk, Span, TensorEntry, gather, nest, read_dcp
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchzip.reader import read_torch_zip


def load_dcp(root: str, *, allow_globals: Any = (), mmap: bool = True, verify: bool = True) -> Any:
    """The checkpoint a DCP folder holds, as the nested dict ``dcp.save`` was given, with full (unsharded) tensors.

    Each chunk is read like a ``.pt`` file (structure, pickle allowlist, CRCs); a tensor stored whole is used
    as it is mapped, a chunked one is assembled into one tensor.
    """
    import torch

    from ckptfix.formats.hf.folder import room_for_files
    from ckptfix.formats.torchio.materialize import map_file, materialize
    from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity

    d = read_dcp(root)
    allowed = allowlist.allowed_names(list(allow_globals), source=root)
    room_for_files(2 * len(d.files), source=root)  # a descriptor and a mapping (which holds its own) per file
    files: dict[str, tuple[int, tuple[int, ...], Any]] = {}

    def item(span: Span) -> Any:
        if span.path not in files:
            fd = os.open(span.path, os.O_RDONLY)
            files[span.path] = (fd, file_identity(fd), None)
        fd, identity, mapped = files[span.path]
        z = read_torch_zip(
            fd, span.path, allowed=allowed, verify=verify, start=span.offset, end=span.offset + span.length
        )
        if z.storages and foreign_byte_order(z):  # torch's DCP reader torch.loads the chunk, which swaps bytes
            return torch.load(io.BytesIO(os.pread(fd, span.length, span.offset)), map_location="cpu", weights_only=True)
        if mmap and mapped is None and z.storages:  # one mapping per file, shared by its chunks' tensors
            mapped = map_file(fd)
            files[span.path] = (fd, identity, mapped)
        return materialize(z, fd, mmap=mmap, mapped=mapped)

    try:
        flat: dict[str, Any] = {}
        for key, entry in d.tensors.items():
            flat[key] = _assemble(torch, key, entry, item)
        for key, span in d.values.items():
            flat[key] = item(span)
        for path, (fd, before, _) in files.items():
            if file_identity(fd) != before:
                raise changed_while_reading(path)
    finally:
        for fd, _, _ in files.values():
            os.close(fd)
    return nest(flat, d.paths)


def _assemble(torch: Any, key: str, entry: TensorEntry, item: Any) -> Any:
    return gather(torch, entry, ((c, _checked(torch, key, entry, c, item(c.span))) for c in entry.chunks))


def _checked(torch: Any, key: str, entry: TensorEntry, c: Chunk, part: Any) -> Any:
    if not isinstance(part, torch.Tensor) or tuple(part.shape) != c.sizes or part.dtype != getattr(torch, entry.dtype):
        what = f"{part.dtype} {list(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
        raise FormatError(
            f"{c.span.path}: chunk of '{key}' at {list(c.offsets)} holds {what}, expected {entry.dtype} "
            f"{list(c.sizes)}; the folder mixes two checkpoints: copy it again"
        )
    return part
