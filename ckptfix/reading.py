"""A checkpoint opened for reading its tensors one at a time: the description first, bytes only on demand.

``inspect``, ``diff`` and ``merge`` need a file's structure (keys, shapes, dtypes, other entries) before, or
instead of, its tensor bytes. :func:`open_checkpoint` gives the checked inert description the format readers build
(:func:`~.torchzip.read_torch_zip`, the safetensors header) without importing torch; :meth:`Opened.tensor`
then reads one tensor into memory of its own, its zip record's CRC checked, so memory follows the tensors in use,
not the file. A folder (transformers shards and their index, an accelerate ``save_state`` folder, a DCP folder) is
opened the same way, file by file (:class:`OpenedFolder`). Files the description cannot serve (legacy torch files,
``unsafe=True``, quantized or sparse tensors, big-endian data when bytes are needed) are loaded the usual way, and
``note`` says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.checkpoint import is_tensor
from ckptfix.errors import FormatError, UnsafeCheckpointError
from ckptfix.formats.containers.legacy import check_legacy
from ckptfix.formats.containers.safetensors import read_header, tree_from_header
from ckptfix.formats.containers.torchzip import TorchZip, read_torch_zip
from ckptfix.formats.containers.ziparchive import Record, stored_crc, verify_records
from ckptfix.formats.copyable import foreign_byte_order, not_as_stored, torch_rebuilt
from ckptfix.formats.folders.dcp import DcpTensor
from ckptfix.formats.folders.hf import FolderTensor
from ckptfix.formats.output.atomic import PathLike
from ckptfix.formats.output.crc import check_crc
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.records import FolderRecords, Holder, is_record, layout, map_tree, spec
from ckptfix.formats.registry import RANK_GLOBALS, Format, detect, detect_format, rank_kind, read
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import OpaqueEntry, describe, wrap, wrapped
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity
from ckptfix.plan import plan_reading

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 24


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


@dataclass
class Opened:
    """One checkpoint: ``tree`` holds tensor records (or real tensors when ``note`` says torch loaded it)."""

    source: str
    fmt: str
    tree: Any
    note: str | None = None  # why the file was loaded with torch instead of described
    fd: int | None = None
    zip: TorchZip | None = None
    before: tuple[int, ...] = ()
    verified: set[str] = field(default_factory=set)  # zip records whose CRC was checked
    # torch zips: how many storages each location tag names (``{"cuda:0": 120, "cpu": 3}``), kept when torch loads
    locations: dict[str, int] | None = None
    crc_stored: bool = True  # False: a torch zip saved without CRCs, read unchecked
    # read for a merge (``ranks``): one rank's file of a sharded run, its tree the inert pickle (registry.rank_kind)
    rank_kind: str = ""
    allowed: frozenset[str] = frozenset()  # the globals a pickle read on demand may name (a DCP chunk's)

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(check=exc[0] is None)

    def close(self, *, check: bool = True) -> None:
        """Close the file; the bytes read must be the bytes that were checked (the file did not change)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if check and file_identity(fd) != self.before:
                raise changed_while_reading(self.source)
        finally:
            os.close(fd)

    @property
    def described(self) -> bool:
        """True when no tensor was loaded: the tree holds records, read one at a time by :meth:`tensor`."""
        return self.note is None

    def tensor(self, value: Any) -> torch.Tensor:
        """The tensor ``value`` stands for, in memory of its own (a real tensor is returned as it is): the record
        reads itself (:meth:`~ckptfix.formats.records.TensorRecord.read`) through this file."""
        holder: Holder = self  # what a record reads through (mypy checks that this file is one)
        return value.read(holder) if is_record(value) else value  # type: ignore[no-any-return]

    def raw(self, value: Any) -> Any:
        """The tensor ``value`` stands for as a :class:`~ckptfix.formats.raw.RawTensor`, its bytes read without
        torch, where the record's bytes are its values as they are (a plain contiguous tensor record); else as
        :meth:`tensor` gives it (a strided view, a record only torch reads, a real tensor)."""
        found = value.read_raw(self) if is_record(value) else None
        return found if found is not None else self.tensor(value)

    def record(self, value: Any) -> Record:
        """The zip record holding a tensor record's storage."""
        return self.storage_record(inert.tensor_of(value).storage.key)

    def record_bytes(self, rec: Record, start: int = 0, length: int | None = None) -> bytearray:
        """Bytes ``[start, start + length)`` of a storage record; the record's CRC is checked once."""
        assert self.fd is not None  # records exist only while the file is open
        length = rec.size - start if length is None else length
        if start == 0 and length == rec.size and rec.name not in self.verified:
            data = _pread(self.fd, rec.data_offset, rec.size, source=self.source)
            check_crc(self.source, rec.name, stored_crc(rec), zlib.crc32(data))
            self.verified.add(rec.name)
            return data
        if rec.name not in self.verified:  # a view of part of a storage: check the whole record once, in chunks
            verify_records(self.fd, self.source, [rec])
            self.verified.add(rec.name)
        return _pread(self.fd, rec.data_offset + start, length, source=self.source)

    def pread(self, offset: int, length: int) -> bytearray:
        """Bytes ``[offset, offset + length)`` of the file, unchecked (the caller checks the record's CRC)."""
        assert self.fd is not None  # records exist only while the file is open
        return _pread(self.fd, offset, length, source=self.source)

    def storage_record(self, key: str) -> Record:
        assert self.zip is not None  # only InertTensors, which only zips hold, ask
        return self.zip.archive.storage(key)

    def storage_bytes(self, key: str, start: int, length: int) -> bytearray:
        return self.record_bytes(self.storage_record(key), start, length)

    def file_fd(self, path: str) -> int:
        raise AssertionError(f"{self.source}: a file of its own has no data files")  # only folders' records ask

    @property
    def checked_records(self) -> set[tuple[str, str]] | None:
        return None  # a file of its own has no data files

    def part(self, index: int) -> Opened:
        raise AssertionError(f"{self.source}: a file of its own has no parts")  # only folders' records ask


def _pread(fd: int, offset: int, length: int, *, source: str) -> bytearray:
    buf = bytearray(length)
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done : done + (1 << 30)]], offset + done)
        if n == 0:
            raise FormatError(
                f"{source}: ends before byte {offset + length}; it is truncated, re-download or re-save it"
            )
        done += n
    return buf


def _truncated(source: str, end: int) -> FormatError:
    return FormatError(f"{source}: ends before byte {end}; it is truncated, re-download or re-save it")


def in_memory(obj: Any, *, source: str) -> Opened:
    """An object already in memory (``ckptfix.load``'s result, a state dict) behind the same interface."""
    return Opened(source=source, fmt="memory", tree=obj, note="already in memory")


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
    """Open ``path`` as its checked description; fall back to loading it with torch where that cannot serve.
    ``path`` may be a folder or its index file: an :class:`OpenedFolder`, each of its files opened this way.

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
    if fmt == "folder" and not unsafe:
        return _open_folder(
            source, found=found, allow_globals=tuple(allow_globals), need_bytes=need_bytes, verify=verify, opaque=opaque
        )
    reason = plan_reading(fmt, unsafe=unsafe).reason
    if reason is None:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            opened = _describe(fd, source, fmt, allow_globals=allow_globals, verify=verify, opaque=opaque, ranks=ranks)
            reason = None if opened.rank_kind else _torch_only(opened, need_bytes=need_bytes)
        except BaseException:
            os.close(fd)
            raise
        if reason is None:
            return opened
        os.close(fd)
        locations, crc_stored = opened.locations, opened.crc_stored
    else:
        locations, crc_stored = None, True
    obj = read(path, fmt=fmt, unsafe=unsafe, allow_globals=allow_globals, opaque=opaque)
    if fmt == "torch-legacy" and not unsafe:  # its pickles again (not its storages): the device tags they name
        locations = check_legacy(source, allowed=allowlist.allowed_names(list(allow_globals), source=source))
    return Opened(source=source, fmt=fmt, tree=obj, note=reason, locations=locations, crc_stored=crc_stored)


def _describe(
    fd: int,
    source: str,
    fmt: str,
    *,
    allow_globals: Iterable[str],
    verify: bool,
    opaque: bool = False,
    ranks: bool = False,
) -> Opened:
    before = file_identity(fd)
    if fmt == "safetensors":
        header = read_header(source)
        if file_identity(fd) != before:
            raise changed_while_reading(source)
        if verify:
            _read_through(fd, header.data_start, os.fstat(fd).st_size, source=source)
        tree = tree_from_header(header, source=source)
        return Opened(source=source, fmt=fmt, tree=tree, fd=fd, before=before)
    allowed = allowlist.allowed_names(allow_globals, source=source)
    kind = ""
    if (first := _read_once(fd, source, allowed=allowed, verify=verify) if ranks else None) is not None:
        z, kind = first
    else:
        z = describe(fd, source, allowed=allowed, verify=verify, keep=opaque)
        if opaque:  # shards of a sharded tensor are never passed off as unbuilt entries: say what the file is
            from ckptfix.formats.folders.fsdp import explain
            from ckptfix.formats.torchio.opaque import entries

            if sharded := explain({n for e in entries(z.tree) for n in e.needs}, source=source):
                raise sharded
    verified = {r.name for r in z.archive.records} if verify else set()
    locations = dict(Counter(ref.location for ref in z.storages.values()))
    return Opened(
        source=source,
        fmt=fmt,
        tree=z.tree,
        fd=fd,
        zip=z,
        before=before,
        verified=verified,
        locations=locations,
        crc_stored=z.archive.crc_stored,
        rank_kind=kind,
    )


def _read_once(fd: int, source: str, *, allowed: frozenset[str], verify: bool) -> tuple[TorchZip, str] | None:
    """A merge input's one read of its pickle, the sharded-tensor classes read as records: the archive described
    (a rank file's tree left as its pickle, any other's entries wrapped as :func:`describe` wraps them) and the kind
    of file it is (:func:`.registry.rank_kind`). None when the plain read must say it instead: this read failed
    (the plain read gives the refusal), or a file that is no rank file names getattr (read otherwise there)."""
    refused: list[str] = []
    try:
        z = read_torch_zip(fd, source, allowed=allowed, verify=verify, refused=refused, records=RANK_GLOBALS)
    except Exception:  # the plain read's refusal and message, as without ``ranks``
        return None
    if kind := rank_kind(refused, source=source):
        return z, kind
    if "builtins.getattr" in refused:  # resolved as the FSDP1 reader resolves it: not what the plain read builds
        return None
    return wrapped(z, refused, source=source), ""


def _torch_only(opened: Opened, *, need_bytes: bool) -> str | None:
    """Why the description cannot stand in for the loaded checkpoint, if it cannot."""
    if opened.zip is None:
        return None
    if need_bytes and (order := foreign_byte_order(opened.zip)):
        return f"a {order} file, whose bytes torch swaps"
    for obj in inert_trees.walk(opened.tree):
        if isinstance(obj, inert.InertTensor) and (why := not_as_stored(obj)):
            return why
        if type(obj) is inert.Inert and torch_rebuilt(obj.func.module):
            return f"{obj.func.full}(...): a quantized, sparse or subclass tensor"
        kids = list(obj.values()) if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        if any(isinstance(k, inert.StorageRef) for k in kids):
            return "a raw storage outside any tensor"
    return None


def _read_through(fd: int, start: int, end: int, *, source: str) -> None:
    at = start
    while at < end:
        n = len(os.pread(fd, min(_CHUNK, end - at), at))
        if n == 0:
            raise _truncated(source, end)
        at += n


# -- folders ------------------------------------------------------------------------------------------------


@dataclass
class OpenedFolder(Opened):
    """A folder opened file by file: ``tree`` holds :class:`FolderTensor` records (shards, accelerate folders)
    or :class:`~ckptfix.formats.folders.dcp.DcpTensor` records (DCP), each read on demand from its own file."""

    kind: str = ""  # "shards", "accelerate", "dcp", "deepspeed", or a registry row's kind (its ``records``)
    files: list[str] = field(default_factory=list)  # every file the checkpoint is made of, index included
    index: str | None = None
    parts: list[Opened] = field(default_factory=list)  # shards and accelerate folders: one per file
    dcp: Any = None  # DCP: the open data files
    zero: Any = None  # DeepSpeed: the run (ckptfix.formats.folders.deepspeed.ZeroRun)
    records: FolderRecords | None = None  # a format read by its registry row's ``records`` (Megatron-Core)
    zero_fds: dict[str, int] = field(default_factory=dict)  # DeepSpeed: each rank file opened once, when first read
    zero_verified: set[tuple[str, str]] | None = None  # DeepSpeed: (file, record) CRC-checked, when verifying
    owner: dict[int, int] = field(default_factory=dict)  # id of a record not wrapped (inside objects) -> part

    def close(self, *, check: bool = True) -> None:
        with contextlib.ExitStack() as stack:  # every file closed, whichever fails its check
            parts, self.parts, dcp, self.dcp = self.parts, [], self.dcp, None
            fds, self.zero_fds = self.zero_fds, {}
            for part in parts:
                stack.callback(part.close, check=check)
            for fd in fds.values():
                stack.callback(os.close, fd)
            if dcp is not None:
                stack.callback(dcp.close)
                if check:
                    stack.callback(dcp.check_unchanged)

    def tensor(self, value: Any) -> torch.Tensor:
        if id(value) in self.owner:  # a record not wrapped (inside an opaque entry): its part reads it
            return self.parts[self.owner[id(value)]].tensor(value)
        return super().tensor(value)

    def raw(self, value: Any) -> Any:
        if id(value) in self.owner:
            return self.parts[self.owner[id(value)]].raw(value)
        return super().raw(value)  # a DCP chunk's (its reader uses torch), a real tensor: as tensor() gives it

    def part(self, index: int) -> Opened:
        return self.parts[index]

    def file_fd(self, path: str) -> int:
        return self.dcp.fd(path) if self.dcp is not None else self._zero_fd(path)

    @property
    def checked_records(self) -> set[tuple[str, str]] | None:
        return self.zero_verified

    def _zero_fd(self, path: str) -> int:
        if path not in self.zero_fds:
            self.zero_fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return self.zero_fds[path]


def _open_folder(
    source: str, *, found: Format, allow_globals: tuple[str, ...], need_bytes: bool, verify: bool, opaque: bool
) -> Opened:
    """A folder or index file of the registry's ``kind`` as an :class:`OpenedFolder`, every file checked as it
    would be on its own and the folder's own rules (:mod:`ckptfix.formats.folders.hf`) on top."""
    from ckptfix.formats.folders.hf import describe as describe_folder

    kind = found.kind
    if found.records is not None:  # the row says how it is read as records
        return _open_records(source, found, allow_globals=allow_globals, verify=verify)
    if kind == "dcp":
        return _open_dcp(source, allow_globals=allow_globals, verify=verify)
    if kind == "deepspeed":
        return _open_deepspeed(source, allow_globals=allow_globals, verify=verify)
    if kind != "hf":  # a format with no description here: its loader reads it, tensors and all
        tree = read(source, fmt="folder", allow_globals=allow_globals)
        return Opened(source=source, fmt="folder", tree=tree, note=f"a {kind} checkpoint, read by its loader")
    folder = describe_folder(source)
    files = folder.files + ([folder.index] if folder.index else [])
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=None,
        kind="shards" if folder.flat else "accelerate",
        files=files,
        index=folder.index,
    )
    try:
        each = {"allow_globals": allow_globals, "need_bytes": need_bytes, "verify": verify}
        opened.tree = _shards(opened, folder, each) if folder.flat else _accelerate(opened, folder, each, opaque)
        for i, part in enumerate(opened.parts):
            for obj in inert_trees.walk(part.tree):
                if is_record(obj):  # a tensor record of a part: read from that part
                    opened.owner.setdefault(id(obj), i)
    except BaseException:
        opened.close(check=False)
        raise
    tagged = [p.locations for p in opened.parts if p.locations is not None]
    opened.locations = dict(sum((Counter(t) for t in tagged), Counter())) if tagged else None
    opened.crc_stored = all(p.crc_stored for p in opened.parts)
    notes = [f"{os.path.basename(p.source)} is {p.note}" for p in opened.parts if p.note]
    opened.note = notes[0] if notes else None
    return opened


def _shards(opened: OpenedFolder, folder: Any, each: dict[str, Any]) -> Any:
    from ckptfix.formats.folders.hf import merge_shards

    def parts() -> Iterator[tuple[str, Any]]:
        for path in folder.files:
            opened.parts.append(open_checkpoint(path, **each))
            yield path, opened.parts[-1].tree

    return merge_shards(folder, parts(), record=lambda path, value: _wrapped(value, len(opened.parts) - 1))


def _accelerate(opened: OpenedFolder, folder: Any, each: dict[str, Any], opaque: bool) -> Any:
    """The model files as model entries, the training state (optimizer, scheduler, RNG) as other entries; with
    ``opaque``, a file needing globals outside the allowlist (numpy RNG state) is one unbuilt entry."""
    from ckptfix.formats.folders.hf import _MODEL_FILE

    tree: OrderedDict[str, Any] = OrderedDict()
    for entry, (path,) in folder.entries.items():
        model = bool(_MODEL_FILE.match(os.path.basename(path)))
        try:
            part = open_checkpoint(path, **each, opaque=opaque and not model)
        except UnsafeCheckpointError:
            if not opaque or model or detect_format(path) != "torch-zip":
                raise
            part = _opaque_file(path, entry, allow_globals=each["allow_globals"])
        opened.parts.append(part)
        tree[entry] = _wrapped(part.tree, len(opened.parts) - 1)
    return tree


def _opaque_file(path: str, entry: str, *, allow_globals: tuple[str, ...]) -> Opened:
    """A whole file as one :class:`OpaqueEntry` named ``entry``: its records, nothing built."""
    from ckptfix.formats.containers.torchzip import read_torch_zip

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = file_identity(fd)
        refused: list[str] = []
        z = read_torch_zip(fd, path, allowed=allowlist.allowed_names(allow_globals, source=path), refused=refused)
        tree = wrap({entry: z.tree}, refused, source=path)[entry]
    except BaseException:
        os.close(fd)
        raise
    return Opened(source=path, fmt="torch-zip", tree=tree, fd=fd, zip=z, before=before)


def _wrapped(obj: Any, part: int) -> Any:
    """``obj`` with each tensor (record) in it as a :class:`FolderTensor` of ``part``; containers copied."""

    def wrap(value: Any) -> Any:
        if isinstance(value, OpaqueEntry):
            return dataclasses.replace(value, records=_wrapped(value.records, part))
        return FolderTensor(part, value)

    return map_tree(obj, wrap, leaf=lambda v: is_tensor(v) or isinstance(v, OpaqueEntry))


def _open_dcp(source: str, *, allow_globals: tuple[str, ...], verify: bool) -> Opened:
    """A DCP folder as DcpTensor records."""
    from ckptfix.formats.folders.datafiles import DataFiles
    from ckptfix.formats.folders.dcp import METADATA
    from ckptfix.formats.folders.dcp_chunks import dcp_tree

    allowed = allowlist.allowed_names(allow_globals, source=source)
    files = DataFiles()
    try:
        tree, why = dcp_tree(source, files.fd, allowed=allowed)
    except BaseException:
        files.close()
        raise
    if why is not None:  # values holding tensors or objects: torch's DCP reader rebuilds them
        files.close()
        return Opened(
            source=source,
            fmt="folder",
            tree=read(source, fmt="folder", allow_globals=allow_globals),
            note=f"a DCP folder whose {why}",
        )
    spans = _spans(tree)
    data = sorted({span.path for span in spans} | set(files.open))
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=tree,
        kind="dcp",
        dcp=files,
        allowed=allowed,
        files=[os.path.join(source, METADATA), *data],
    )
    return _verified(opened, spans, data, verify=verify)


def _open_records(source: str, found: Format, *, allow_globals: tuple[str, ...], verify: bool) -> Opened:
    """A folder its registry row reads as records (``found.records``: Megatron-Core's), read through its data
    files; ``verify`` reads and CRC-checks every DCP chunk its records are made of."""
    from ckptfix.formats.folders.datafiles import DataFiles

    assert found.records is not None  # asked by _open_folder only for such a row
    allowed = allowlist.allowed_names(allow_globals, source=source)
    files = DataFiles()
    try:
        got = found.records(source, allow_globals)
    except BaseException:
        files.close()
        raise
    spans = _spans(got.tree)
    data = sorted({span.path for span in spans} | set(files.open))
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=got.tree,
        kind=found.kind,
        dcp=files,
        allowed=allowed,
        files=got.files,
        records=got,
    )
    return _verified(opened, spans, data, verify=verify)


def _spans(tree: Any) -> set[Any]:
    """The data-file spans (chunk archives) of the DCP tensor records in ``tree``."""
    return {c.span for v in inert_trees.walk(tree) if isinstance(v, DcpTensor) for c in v.entry.chunks}


def _verified(opened: OpenedFolder, spans: set[Any], data: list[str], *, verify: bool) -> OpenedFolder:
    from ckptfix.formats.containers.torchzip import read_torch_zip

    try:
        if verify:  # every chunk's records read and CRC-checked (the values were, when they were read)
            for span in sorted(spans, key=lambda s: (s.path, s.offset)):
                read_torch_zip(
                    opened.dcp.fd(span.path),
                    span.path,
                    allowed=opened.allowed,
                    verify=True,
                    start=span.offset,
                    end=span.offset + span.length,
                )
            opened.verified.update(data)
    except BaseException:
        opened.close(check=False)
        raise
    return opened


def _open_deepspeed(source: str, *, allow_globals: tuple[str, ...], verify: bool) -> Opened:
    """A DeepSpeed ZeRO run as its consolidated state dict of :class:`~ckptfix.formats.folders.deepspeed.ZeroTensor`
    records: the rank files' pickles read, no tensor byte (``verify`` CRC-checks every record the tensors use)."""
    from ckptfix.formats.folders.deepspeed import describe_run

    run = describe_run(source, allow_globals=allow_globals)
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=run.state,
        kind="deepspeed",
        zero=run,
        files=[f.path for f in run.files],
        zero_verified=set(),
    )
    try:
        if verify:
            for path, records in sorted(run.records.items()):
                verify_records(opened._zero_fd(path), path, records)
                assert opened.zero_verified is not None  # set above
                opened.zero_verified.update((path, r.name) for r in records)
            opened.verified.update(run.records)
    except BaseException:
        opened.close(check=False)
        raise
    return opened
