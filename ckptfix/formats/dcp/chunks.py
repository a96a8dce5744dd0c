"""A DCP folder read a tensor at a time, without torch's reader: each tensor a :class:`~.dcp.DcpTensor` (which reads
itself, each chunk's archive accepted by :func:`~.dcp.chunk_record`), its small values read now."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.formats.dcp.reader import DcpTensor, nest, read_dcp
from ckptfix.formats.hf.folder import room_for_files
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.torchzip.reader import read_torch_zip


def dcp_tree(src: str, fd_of: Callable[[str], int], *, allowed: frozenset[str]) -> tuple[Any, Fallback | None]:
    """The checkpoint of DCP folder ``src`` with a :class:`DcpTensor` for each tensor and its small values read
    (``fd_of`` opens each data file once); or None and why the torch path must rebuild it."""
    d = read_dcp(src)
    room_for_files(len(d.files), source=src)  # each data file stays open until the end (checked unchanged then)
    flat: dict[str, Any] = {key: DcpTensor(key, entry) for key, entry in d.tensors.items()}
    for key, span in d.values.items():
        z = read_torch_zip(
            fd_of(span.path), span.path, allowed=allowed, verify=True, start=span.offset, end=span.offset + span.length
        )
        if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert_trees.walk(z.tree)):
            return None, Fallback(Reason.DCP_VALUE_REBUILT, key=key)
        flat[key] = z.tree
    return nest(flat, d.paths), None
