"""The torch zip checkpoint (``torch.save`` since 1.6): its rules and its one inert description.

:func:`read_torch_zip` checks the container (every zip rule in :mod:`ckptfix.formats.torchzip.archive`), the
archive's shape (one folder, exactly one ``data.pkl``, no TorchScript), the pickle (every pickle rule in
:mod:`.pickles.inert`) and each storage record's size against the pickle, and optionally every CRC. Both the
torch path and the streaming path start from its :class:`TorchZip`, so they accept and refuse the same files.
"""

from __future__ import annotations

import os
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.output.crc import check_crc
from ckptfix.formats.pickles import inert, inert_trees, unpickling
from ckptfix.formats.torchzip.archive import (
    Archive,
    Record,
    damaged,
    read_archive,
    verify_records,
    without_crcs,
)

# The small records torch.save writes besides data.pkl and the storages, in its order.
HEAD = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
TAIL = (("version", b"3\n"),)


@dataclass(frozen=True)
class TorchZip:
    """A checked torch zip: its records, the inert tree of data.pkl, its storages and byte order."""

    archive: Archive
    tree: Any
    storages: dict[str, inert.StorageRef]
    byteorder: str
    pkl: Record


def read_torch_zip(
    fd: int,
    path: str,
    *,
    allowed: frozenset[str],
    verify: bool = False,
    start: int = 0,
    end: int | None = None,
    as_data: frozenset[str] = frozenset(),
    refused: list[str] | None = None,
    plain: bool = True,
    records: frozenset[str] = frozenset(),
) -> TorchZip:
    """Parse and check the archive (the file, or its ``start:end`` span) and its pickle; with ``verify`` also
    every record's CRC. ``as_data``, ``refused``, ``plain``, ``records``: see :func:`.unpickling.load`."""
    with inert_trees.gc_paused():  # a record per storage, then the tree: nothing to collect, only to rescan
        archive = read_archive(fd, path, start=start, end=end)
        pkl = _pickle_record(archive, path)
        data = os.pread(fd, pkl.size, pkl.data_offset)
        _check_pickle_crc(archive, pkl, data, path=path)
        (tree,), storages = unpickling.load(
            data, source=path, allowed=allowed, as_data=as_data, refused=refused, plain=plain, records=records
        )
    for key, ref in storages.items():
        rec = archive.get(f"data/{key}")
        if rec is None:
            raise FormatError(f"{path}: tensor storage 'data/{key}' is missing from the archive; it is damaged")
        if ref.nbytes != rec.size:
            # torch writes each storage record at exactly its size; anything else is damage or padding for abuse
            raise FormatError(
                f"{path}: record '{rec.name}' holds {rec.size} bytes but its storage needs {ref.nbytes}; "
                f"the file is corrupt"
            )
    if archive.crc_stored:
        _refuse_skipped_data(fd, path, archive, storages)
    order = archive.get("byteorder")
    byteorder = os.pread(fd, min(order.size, 16), order.data_offset).decode("ascii", "replace") if order else "little"
    if byteorder not in ("little", "big"):
        raise damaged(path, f"byteorder record says {byteorder!r}")
    if verify:
        verify_records(fd, path, archive.records)
    return TorchZip(archive, tree, storages, byteorder, pkl)


def _check_pickle_crc(archive: Archive, pkl: Record, data: bytes, *, path: str) -> None:
    """Check data.pkl's CRC, or mark the archive as saved without CRCs.

    ``torch.save`` with ``torch.utils.serialization.config.save.compute_crc32 = False`` writes 0 as the CRC of
    every record, and torch's reader never checks CRCs. Only that whole-file form counts: every record's CRC 0
    while data.pkl's bytes, always read, have another (a real CRC is 0 once in 2^32). A file with some CRCs 0 and
    others not is checked record by record, so a damaged or altered file cannot skip the check for some records;
    one with none is read unchecked, and says so (``inspect``, ``convert -v``).
    """
    actual = zlib.crc32(data)
    if _without_crcs(archive, pkl, actual):
        without_crcs(archive)
        return
    check_crc(path, pkl.name, pkl.crc, actual)


def _without_crcs(archive: Archive, pkl: Record, actual: int) -> bool:
    return pkl.crc == 0 and actual != 0 and all(r.crc == 0 for r in archive.records)


def stores_crcs(path: str) -> bool:
    """Whether the torch zip at ``path`` (already read and checked) stores CRCs: the central directory and
    data.pkl read again, for a caller that loaded it with torch."""
    with open(path, "rb") as f:
        archive = read_archive(f.fileno(), path)
        pkl = _pickle_record(archive, path)
        return not _without_crcs(archive, pkl, zlib.crc32(os.pread(f.fileno(), pkl.size, pkl.data_offset)))


_ZERO_PREFIX = 64 << 10  # bytes of each storage read to tell skip_data's zero-filled placeholders from data


def _refuse_skipped_data(fd: int, path: str, archive: Archive, storages: dict[str, inert.StorageRef]) -> None:
    """Refuse a file saved under ``torch.serialization.skip_data()``: storage records of the right size, zero-filled,
    with CRC 0, beside records whose CRCs are real. A real storage's CRC is 0 once in 2^32, and then its bytes
    are not zero (the CRC of zeros is not 0): only the first 64 KiB of records whose CRC is 0 are read."""
    records = [rec for key in storages if (rec := archive.get(f"data/{key}")) is not None and rec.size]
    if not records or any(rec.crc for rec in records):
        return
    if all(not any(os.pread(fd, min(rec.size, _ZERO_PREFIX), rec.data_offset)) for rec in records):
        raise FormatError(
            f"{path}: saved with skip_data: no tensor bytes (its {len(records)} storage record(s) are zero-filled "
            f"placeholders of torch.serialization.skip_data()); save it again without skip_data"
        )


def _pickle_record(archive: Archive, path: str) -> Record:
    """The one ``<folder>/data.pkl`` record, refusing TorchScript, stray pickles and records outside the folder."""
    names = list(archive.by_name)
    if not names:
        raise FormatError(f"{path}: zip archive has no records; it is not a torch checkpoint")
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise FormatError(f"{path}: is a TorchScript archive, not a checkpoint; load it with torch.jit.load")
    pickles = [n for n in names if n.casefold().endswith(".pkl")]
    expected = archive.prefix + "data.pkl"
    if pickles != [expected] or expected.count("/") != 1:
        raise FormatError(
            f"{path}: expected exactly one data.pkl record, found {pickles or 'none'}; the archive was not "
            f"written by torch.save or has been tampered with"
        )
    if any(not n.startswith(archive.prefix) for n in names):
        raise FormatError(f"{path}: archive has records outside '{archive.prefix}'; refusing it")
    return archive.by_name[expected]


def stand_ins() -> Callable[[str, str], type[inert.Global]]:
    """A cache of new global stand-ins for one file being written."""
    cache: dict[tuple[str, str], type[inert.Global]] = {}

    def get(module: str, name: str) -> type[inert.Global]:
        if (module, name) not in cache:
            cache[module, name] = inert.make_global(module, name)
        return cache[module, name]

    return get


def tensor_record(
    dtype: str, shape: tuple[int, ...], key: str, nbytes: int, *, glob: Callable[[str, str], type[inert.Global]]
) -> inert.InertTensor:
    """The inert tensor torch.save would pickle for a contiguous CPU tensor stored whole in ``data/<key>``."""
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)  # torch's contiguous strides treat a zero-size dim as 1
    storage = DTYPES[dtype].storage
    hooks: OrderedDict[str, Any] = OrderedDict()
    if storage is not None:
        pid = ("storage", glob("torch", storage), key, "cpu", nbytes // DTYPES[dtype].itemsize)
        args: tuple[Any, ...] = (inert.StorageRef(pid), 0, tuple(shape), tuple(reversed(stride)), False, hooks)
        return inert.tensor(glob("torch._utils", "_rebuild_tensor_v2"), args)
    pid = ("storage", glob("torch.storage", "UntypedStorage"), key, "cpu", nbytes)
    args = (inert.StorageRef(pid), 0, tuple(shape), tuple(reversed(stride)), False, hooks, glob("torch", dtype))
    return inert.InertTensor(glob("torch._utils", "_rebuild_tensor_v3"), args)
