"""A single checkpoint file opened as its checked description (the torch zip and safetensors rows' ``open``): every
tensor a record read on demand through the open file. A torch zip's pickle is read once, and what kind of ``.pt`` it
is (a rank file of a sharded run, with ``ranks``) is decided here; :class:`~ckptfix.formats.opened.Undescribed` where
the description cannot stand in for what torch loads. A safetensors file's header gives its records; ``verify`` reads
it through (it has no checksums: what is checked is that every byte is there)."""

from __future__ import annotations

import os
from collections import Counter

from ckptfix.errors import FormatError
from ckptfix.formats.copyable import Fallback, Reason, foreign_byte_order, not_as_stored, torch_rebuilt
from ckptfix.formats.opened import Opened, OpenOptions, Undescribed
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.safetensors.file import tree_from_header
from ckptfix.formats.safetensors.header import read_header
from ckptfix.formats.safety import allowlist
from ckptfix.formats.safety.allowlist import DTENSOR_GLOBALS, SHARDED_TENSOR_GLOBALS, explain
from ckptfix.formats.torchio.opaque import describe, entries, wrapped
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity
from ckptfix.formats.torchzip.reader import TorchZip, read_torch_zip

_RANK_GLOBALS = DTENSOR_GLOBALS | SHARDED_TENSOR_GLOBALS  # a merge's first read takes them as records (rank files)


def open_torch_zip(source: str, options: OpenOptions) -> Opened:
    """The file described, left open for its records to read through. ``verify`` checks every record's CRC now;
    ``opaque`` keeps entries needing globals outside the allowlist as unbuilt entries; ``ranks`` reads a rank file
    of a sharded run described, its ``rank_kind`` said (the kind of ``.pt`` it is, decided here, once)."""
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        opened = _describe(fd, source, options)
        reason = None if opened.rank_kind else _torch_only(opened, need_bytes=options.need_bytes)
    except BaseException:
        os.close(fd)
        raise
    if reason is None:
        return opened
    os.close(fd)
    raise Undescribed(reason, locations=opened.locations, crc_stored=opened.crc_stored)


def _describe(fd: int, source: str, options: OpenOptions) -> Opened:
    before = file_identity(fd)
    allowed = allowlist.allowed_names(options.allow_globals, source=source)
    kind = ""
    first = _read_once(fd, source, allowed=allowed, verify=options.verify) if options.ranks else None
    if first is not None:
        z, kind = first
    else:
        z = describe(fd, source, allowed=allowed, verify=options.verify, keep=options.opaque)
        # with opaque, shards of a sharded tensor are never passed off as unbuilt entries: say what the file is
        needs = {n for e in entries(z.tree) for n in e.needs} if options.opaque else set()
        if sharded := explain(needs, source=source):
            raise sharded
    return Opened(
        source=source,
        fmt="torch-zip",
        tree=z.tree,
        fd=fd,
        zip=z,
        before=before,
        verified={r.name for r in z.archive.records} if options.verify else set(),
        locations=dict(Counter(ref.location for ref in z.storages.values())),
        crc_stored=z.archive.crc_stored,
        rank_kind=kind,
    )


def _read_once(fd: int, source: str, *, allowed: frozenset[str], verify: bool) -> tuple[TorchZip, str] | None:
    """A merge input's one read of its pickle, the sharded-tensor classes read as records: the archive described
    (a rank file's tree left as its pickle, any other's entries wrapped as :func:`describe` wraps them) and the kind
    of file it is (``dtensor``, ``sharded-tensor``: what :func:`.registry.rank_kind` says of the same globals, or
    ``""``). None when the plain read must say it instead: this read failed (the plain read gives the refusal), or
    a file that is no rank file names getattr (read otherwise there)."""
    refused: list[str] = []
    try:
        z = read_torch_zip(fd, source, allowed=allowed, verify=verify, refused=refused, records=_RANK_GLOBALS)
    except Exception:  # the plain read's refusal and message, as without ``ranks``
        return None
    if (sharded := explain(refused, source=source)) is not None:
        return z, sharded.kind
    if "builtins.getattr" in refused:  # resolved as the FSDP1 reader resolves it: not what the plain read builds
        return None
    return wrapped(z, refused, source=source), ""


def _torch_only(opened: Opened, *, need_bytes: bool) -> Fallback | None:
    """Why the description cannot stand in for the loaded checkpoint, if it cannot."""
    assert opened.zip is not None  # a torch zip's
    if need_bytes and (order := foreign_byte_order(opened.zip)):
        return Fallback(Reason.FOREIGN_FILE, order=order)
    for obj in inert_trees.walk(opened.tree):
        if isinstance(obj, inert.InertTensor) and (why := not_as_stored(obj)):
            return Fallback(Reason.NOT_AS_STORED, why=why)
        if type(obj) is inert.Inert and torch_rebuilt(obj.func.module):
            return Fallback(Reason.TORCH_REBUILT_TENSOR, call=obj.func.full)
        kids = list(obj.values()) if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        if any(isinstance(k, inert.StorageRef) for k in kids):
            return Fallback(Reason.RAW_STORAGE)
    return None


_CHUNK = 1 << 24


def open_safetensors(source: str, options: OpenOptions) -> Opened:
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = file_identity(fd)
        header = read_header(source)
        if file_identity(fd) != before:
            raise changed_while_reading(source)
        if options.verify:
            _read_through(fd, header.data_start, os.fstat(fd).st_size, source=source)
        tree = tree_from_header(header, source=source)
    except BaseException:
        os.close(fd)
        raise
    return Opened(source=source, fmt="safetensors", tree=tree, fd=fd, before=before)


def _read_through(fd: int, start: int, end: int, *, source: str) -> None:
    at = start
    while at < end:
        n = len(os.pread(fd, min(_CHUNK, end - at), at))
        if n == 0:
            raise FormatError(f"{source}: ends before byte {end}; it is truncated, re-download or re-save it")
        at += n
