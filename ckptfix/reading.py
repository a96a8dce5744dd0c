"""A checkpoint opened for reading its tensors one at a time: the description first, bytes only on demand.

``inspect``, ``diff`` and ``merge`` need a file's structure (keys, shapes, dtypes, other entries) before, or
instead of, its tensor bytes. :func:`open_checkpoint` gives the checked inert description the format readers build
(:func:`~.torchzip.read_torch_zip`, the safetensors header) without importing torch; :meth:`Opened.tensor`
then reads one tensor into memory of its own, its zip record's CRC checked, so memory follows the tensors in use,
not the file. Each format is opened by its registry row's ``open`` (:func:`~.registry.open_format`, the one call
``convert``'s streams make too), which returns one :class:`~ckptfix.formats.opened.Opened`: a folder (transformers
shards, an accelerate folder, DCP, DeepSpeed, Megatron-Core) as an :class:`OpenedFolder`. What no description can
serve (legacy torch files, ``unsafe=True``, quantized or sparse tensors, big-endian data when bytes are needed) is
loaded the usual way, and ``note`` says why.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ckptfix.conversion.plan import plan_reading
from ckptfix.formats.legacy.reader import check_legacy
from ckptfix.formats.opened import Opened, OpenOptions, Undescribed
from ckptfix.formats.output.atomic import PathLike
from ckptfix.formats.records import layout, spec
from ckptfix.formats.registry import detect, open_format, read
from ckptfix.formats.safety import allowlist


def stored_bytes(value: Any) -> int:
    """Bytes a tensor's data takes: a sparse tensor's indices and values, not the dense size its shape gives."""
    kind = layout(value)
    if kind == "strided":
        return spec(value).nbytes
    if kind == "sparse_coo":
        parts = [value._indices(), value._values()]
    elif kind in ("sparse_csr", "sparse_bsr"):
        parts = [value.crow_indices(), value.col_indices(), value.values()]
    elif kind in ("sparse_csc", "sparse_bsc"):
        parts = [value.ccol_indices(), value.row_indices(), value.values()]
    else:
        return 0  # a layout with no bytes of its own to count (never saved by torch.save today)
    return sum(spec(p).nbytes for p in parts)


def open_checkpoint(
    path: PathLike,
    *,
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
    need_bytes: bool = True,
    verify: bool = False,
    opaque: bool = False,
    ranks: bool = False,
) -> Opened:
    """Open ``path`` as its checked description, through its format's one opener (its registry row's ``open``);
    fall back to loading it with torch where that cannot serve (``note`` says why). ``path`` may be a folder or its
    index file: an :class:`OpenedFolder`, each of its files opened this way.

    ``need_bytes`` (diff, merge) also sends big-endian files to torch, which swaps their bytes. ``verify`` reads
    every record and checks its CRC now (a safetensors file, which has no checksums, is read through).
    ``opaque``: entries needing globals outside the allowlist come back as unbuilt ``OpaqueEntry`` records
    instead of a refusal (see :mod:`ckptfix.formats.torchio.opaque`).
    ``ranks`` (a merge's inputs, with ``opaque``): a torch zip holding one rank's shards comes back described, its
    ``rank_kind`` said, from the same read of its pickle (not refused, as it is otherwise).
    """
    source = os.fspath(path)
    found = detect(path)
    fmt = found.name
    options = OpenOptions(
        allow_globals=tuple(allow_globals),
        need_bytes=need_bytes,
        verify=verify,
        opaque=opaque,
        ranks=ranks,
        open_file=open_checkpoint,
    )
    if fmt == "folder" and not unsafe:
        try:
            return open_format(found, source, options)
        except Undescribed as e:  # its loader reads it, tensors and all
            tree = read(source, fmt="folder", allow_globals=options.allow_globals)
            return Opened(source=source, fmt="folder", tree=tree, note=e.note)
    reason = plan_reading(fmt, unsafe=unsafe).reason
    locations, crc_stored = None, True
    if reason is None:
        try:
            return open_format(found, source, options)
        except Undescribed as e:
            reason, locations, crc_stored = e.note, e.locations, e.crc_stored
    obj = read(path, fmt=fmt, unsafe=unsafe, allow_globals=allow_globals, opaque=opaque)
    if fmt == "torch-legacy" and not unsafe:  # its pickles again (not its storages): the device tags they name
        locations = check_legacy(source, allowed=allowlist.allowed_names(list(allow_globals), source=source))
    return Opened(source=source, fmt=fmt, tree=obj, note=reason, locations=locations, crc_stored=crc_stored)


__all__ = ["open_checkpoint", "stored_bytes"]
