"""A checkpoint opened for reading its tensors one at a time: what every format's opener (its registry row's
``open``) returns, and what ``inspect``, ``diff``, ``merge``, ``load`` and every stream read through.

An :class:`Opened` is the tree of records (or real tensors, when ``note`` says torch loaded it), the file it holds
open with the CRCs already checked, and what to say of it; an :class:`OpenedFolder` adds the folder's parts (one
:class:`Opened` per file of transformers shards or an accelerate folder) or its one table of data files
(:class:`~ckptfix.formats.files.DataFiles`: DCP, DeepSpeed, Megatron-Core). Records read themselves through it
(:class:`~ckptfix.formats.records.Holder`).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.formats.copyable import Fallback
from ckptfix.formats.files import DataFiles, pread_all
from ckptfix.formats.output.crc import check_crc
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import FolderRecords, Holder, is_record
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity
from ckptfix.formats.torchzip.archive import Record, stored_crc, verify_records
from ckptfix.formats.torchzip.reader import TorchZip

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OpenOptions:
    """How a format's ``open`` reads (:func:`ckptfix.reading.open_checkpoint` says what each does)."""

    allow_globals: tuple[str, ...] = ()
    need_bytes: bool = True  # big-endian files go to torch, which swaps their bytes (diff, merge)
    verify: bool = False  # every record read and CRC-checked now
    opaque: bool = False  # entries needing globals outside the allowlist come back as unbuilt OpaqueEntry records
    ranks: bool = False  # a merge's input: a rank file comes back described, its rank_kind said
    optimizer: bool = False  # a DeepSpeed run: the tree is {"model", "optimizer", ...} (a stream's resume output)
    stream: bool = False  # for a stream (convert): transformers shards as the byte ranges of their files
    # how a folder's own files are opened, each as a checkpoint of its own (reading.open_checkpoint)
    open_file: Callable[..., Opened] | None = None


class Undescribed(Fallback):
    """The opener cannot describe the checkpoint as records: ``str(e)`` is why (the stream's reason); ``note`` is
    what ``inspect`` and the others say when they load it with torch instead, with what the description learnt
    (``locations``, ``crc_stored``: a torch zip's)."""

    def __init__(
        self,
        why: Fallback,
        *,
        note: str | None = None,
        locations: dict[str, int] | None = None,
        crc_stored: bool = True,
    ) -> None:
        Exception.__init__(self, str(why))
        self.reason = why.reason
        self.note = note if note is not None else str(why)
        self.locations, self.crc_stored = locations, crc_stored


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
            data = pread_all(self.fd, rec.data_offset, rec.size, source=self.source)
            check_crc(self.source, rec.name, stored_crc(rec), zlib.crc32(data))
            self.verified.add(rec.name)
            return data
        if rec.name not in self.verified:  # a view of part of a storage: check the whole record once, in chunks
            verify_records(self.fd, self.source, [rec])
            self.verified.add(rec.name)
        return pread_all(self.fd, rec.data_offset + start, length, source=self.source)

    def pread(self, offset: int, length: int) -> bytearray:
        """Bytes ``[offset, offset + length)`` of the file, unchecked (the caller checks the record's CRC)."""
        assert self.fd is not None  # records exist only while the file is open
        return pread_all(self.fd, offset, length, source=self.source)

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


def in_memory(obj: Any, *, source: str) -> Opened:
    """An object already in memory (``ckptfix.load``'s result, a state dict) behind the same interface."""
    return Opened(source=source, fmt="memory", tree=obj, note="already in memory")


@dataclass
class OpenedFolder(Opened):
    """A folder opened file by file: ``tree`` holds :class:`~ckptfix.formats.hf.folder.FolderTensor` records (shards,
    accelerate folders: each read by its file's own :class:`Opened`, a part) or records that read themselves through
    the folder's one table of data files (DCP, DeepSpeed, Megatron-Core)."""

    kind: str = ""  # "shards", "accelerate", "dcp", "deepspeed", or another registry row's kind ("megatron")
    files: list[str] = field(default_factory=list)  # every file the checkpoint is made of, index included
    index: str | None = None
    parts: list[Opened] = field(default_factory=list)  # shards and accelerate folders: one per file
    table: DataFiles = field(default_factory=DataFiles)  # the data files, each opened once (DCP, DeepSpeed, Megatron)
    label: str = ""  # the folder in the words of ``convert -v`` (``DeepSpeed ZeRO-3 (2 ranks)``)
    zero: Any = None  # DeepSpeed: the run (ckptfix.formats.deepspeed.run.ZeroRun), for ``inspect``
    records: FolderRecords | None = None  # what its reader says of it for ``inspect`` (Megatron-Core)
    checked: set[tuple[str, str]] | None = None  # (file, record) CRC-checked as read, where records are (DeepSpeed)
    owner: dict[int, int] = field(default_factory=dict)  # id of a record not wrapped (inside objects) -> part

    def close(self, *, check: bool = True) -> None:
        with contextlib.ExitStack() as stack:  # every file closed, whichever fails its check
            parts, self.parts = self.parts, []
            for part in parts:
                stack.callback(part.close, check=check)
            stack.callback(self.table.close)
            if check:
                stack.callback(self.table.check_unchanged)

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
        return self.table.fd(path)

    @property
    def checked_records(self) -> set[tuple[str, str]] | None:
        return self.checked


__all__ = ["OpenOptions", "Opened", "OpenedFolder", "Undescribed", "in_memory"]
