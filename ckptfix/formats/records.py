"""What a tensor record is: a tensor known by its dtype and shape (and where its bytes are), not yet read.

Every reader that describes a checkpoint without torch puts records in place of tensors (a torch zip's
``InertTensor``, a safetensors byte range, a DCP tensor of chunks, a ZeRO run's pieces, …); the writers put
records of their own (a tensor to cast, one still to compute). Each is a :class:`TensorRecord`: its dtype (torch's
name, ``float32``), shape, size, what makes two names one tensor (:meth:`~TensorRecord.identity`) and what its bytes
live in (:meth:`~TensorRecord.storage_key`). The module functions answer the same for a real torch tensor too,
without importing torch. :func:`map_tree` is the one walk that copies a tree's containers with its tensors
replaced.

Stdlib only (with the dtype table and the errors), so every reader and writer can know what a tensor is;
``ckptfix.transforms.checkpoint.is_tensor`` (a layer below) knows a record by the class flag :class:`TensorRecord` sets.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ckptfix.errors import FormatError
from ckptfix.formats.dtypes import nbytes as _nbytes


@dataclass(frozen=True)
class Spec:
    """A tensor's dtype (torch's name, ``float32``) and shape, known without reading it."""

    dtype: str
    shape: tuple[int, ...]
    layout: str = "strided"  # sparse_coo, sparse_csr, …: a real tensor loaded by torch

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.numel)  # sub-byte dtypes (quint4x2) round up


class Holder(Protocol):
    """What a record's bytes are read through: the opened checkpoint that holds it (``ckptfix.formats.opened.Opened``),
    which owns the open files and remembers which zip records' CRCs were checked."""

    @property
    def source(self) -> str: ...  # the file or folder, for messages

    @property
    def allowed(self) -> frozenset[str]: ...  # the globals a pickle read on demand (a DCP chunk's) may name

    def storage_bytes(self, key: str, start: int, length: int) -> bytearray:
        """Bytes ``[start, start + length)`` of a torch zip's storage ``key``, its record's CRC checked once."""
        ...

    def storage_record(self, key: str) -> Any:
        """A torch zip's zip record of storage ``key`` (``data_offset``, ``size``, ``name``)."""
        ...

    def pread(self, offset: int, length: int) -> bytearray:
        """Bytes ``[offset, offset + length)`` of the file, unchecked (a safetensors file has no checksums)."""
        ...

    def file_fd(self, path: str) -> int:
        """A folder's data file ``path``, opened once."""
        ...

    @property
    def checked_records(self) -> set[tuple[str, str]] | None:
        """``(path, record)`` of each zip record of a folder's data files whose CRC was checked, added to as
        records are checked; None where they are not checked."""
        ...

    def part(self, index: int) -> Holder:
        """A folder's file ``index``, opened as a checkpoint of its own."""
        ...

    def tensor(self, value: Any) -> Any:
        """The tensor ``value`` (a record of this holder, or a real tensor) stands for."""
        ...

    def raw(self, value: Any) -> Any:
        """As :meth:`tensor`, a :class:`~ckptfix.formats.raw.RawTensor` where its bytes are its values."""
        ...


class RunReader(Protocol):
    """What a writer reads a record's bytes through into a tensor of its own (:meth:`TensorRecord.read_runs`): the
    files the stream holds open, and what preparing the records found."""

    @property
    def source(self) -> str: ...  # the input, for messages

    def fd(self, path: str) -> int:
        """The data file ``path``, opened once."""
        ...

    def located(self, chunk: Any) -> tuple[int, int]:
        """``(fd, offset)`` of a DCP chunk's bytes, found when its archive was parsed."""
        ...

    def storage_record(self, key: str) -> Any:
        """The input torch zip's zip record of storage ``key`` (``data_offset``, ``size``)."""
        ...

    def runs(
        self, runs: list[tuple[int, int, int]], dtype: str, shape: tuple[int, ...], *, key: str, cast: str | None = None
    ) -> Any:
        """The bytes of ``runs`` (file descriptor, offset, length), in order, as a tensor of ``dtype`` and
        ``shape`` in memory of its own (then cast to ``cast``)."""
        ...


class FileTable(Protocol):
    """What a record's bytes are copied through into an output (``ckptfix.formats.files.DataFiles``): each data file
    opened once, where each DCP chunk's bytes lie once its archive is parsed, and the CRC checks still to run."""

    located: dict[int, tuple[int, int]]  # id(chunk) -> (fd, offset of its bytes)
    checks: dict[str, list[Any]]  # path -> the zip records' CRC checks (``ckptfix.formats.output.crc.Check``)

    def fd(self, path: str) -> int: ...  # the local descriptor (copy_file_range, reflinks)

    def read(self, path: str, offset: int, length: int) -> bytearray: ...  # through the storage seam


class TensorRecord:
    """Base of every tensor record; a subclass has ``dtype`` (torch's name) and ``shape``, and says where its bytes
    live by overriding :meth:`identity` and :meth:`_storage` (a record of its own, by default: a tensor to write)."""

    __slots__ = ()
    # what ckptfix.transforms.checkpoint.is_tensor looks for: the transforms sit below formats/, so they cannot import
    # this
    __ckptfix_tensor__: ClassVar[bool] = True
    # its tensor is made when a writer asks for it (read from the opened input that holds it, or computed and handed
    # over), not held: what writing.streamed_writer takes; a record of a format it does not read yet is not
    on_demand: ClassVar[bool] = False
    dtype: Any
    shape: Any

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes its data takes (sub-byte dtypes round up)."""
        return _nbytes(self.dtype, self.numel())

    def spec(self) -> Spec:
        return Spec(self.dtype, tuple(self.shape))

    @property
    def requires_grad(self) -> bool:
        """The flag of the tensor the torch path builds (a .pt's, kept by a cast); False for other inputs."""
        return False

    def identity(self) -> Hashable:
        """Equal for two names of one tensor (tied weights); a record is its own tensor unless it says otherwise."""
        return ("new", id(self))

    def storage_key(self) -> Hashable | None:
        """What its bytes live in, so tensors sharing storage can be found; None for an empty tensor."""
        return None if self.spec().numel == 0 else self._storage()

    def _storage(self) -> Hashable | None:
        return None  # a record of what a tensor is, with no bytes behind it

    def spread(self) -> tuple[str, str] | None:
        """How its tensor is spread over files or ranks, as ``inspect`` groups keys by it: ``("chunking", "2 row
        chunks in __0_0.distcp, __1_0.distcp")`` (a DCP tensor), ``("sharding", "Shard(0) on mesh [2]")`` (one
        rank's DTensor); None for a tensor stored whole."""
        return None

    @property
    def stored_dtype(self) -> str:
        """The dtype its stored bytes (:meth:`byte_ranges`) are in: its own, unless its reader casts them as it
        reads (a ZeRO run's half-precision buffer, which zero_to_fp32 makes float32)."""
        return str(self.dtype)

    def byte_ranges(self) -> list[tuple[str, int, int]] | None:
        """The runs ``(path, offset, length)`` of file bytes that are its values in order, as stored (a DeepSpeed
        buffer before its cast); None when its bytes are not runs of files as they are (to compute, to gather)."""
        return None

    def read(self, holder: Holder) -> Any:
        """The tensor it stands for, in memory of its own (a torch tensor), its bytes read through ``holder``; a
        record with no bytes behind it (a tensor still to write) is given back as it is."""
        return self

    def read_raw(self, holder: Holder) -> TensorRecord | None:
        """The tensor as a :class:`~ckptfix.formats.raw.RawTensor`, its bytes read without torch, where they are
        its values as they lie (a plain contiguous tensor); None where only :meth:`read` gives it."""
        return None

    def file_span(self, holder: Holder) -> tuple[int, int] | None:
        """``(offset, length)`` of the bytes of ``holder``'s file that are its values as they lie (a plain
        contiguous tensor, unchecked: the caller checks CRCs), for a copy straight into place; else None."""
        return None

    # What a writer asks of a record it copies, rebuilds or notes (the streams, ckptfix.writing, sanitize, convert's
    # notes), each answered by the class that differs: a writer never asks which class a record is.

    # its bytes are in the input a conversion stream opened, read by read_runs and copied from its byte ranges (a
    # safetensors range, a .pt's storage, DCP chunks, ZeRO pieces, a cast of one): a tensor to the DCP writers
    streamable: ClassVar[bool] = False

    @property
    def zip_tensor(self) -> Any:
        """The torch zip tensor whose storage holds its bytes (storage key, element offset, shape, strides, math
        bits), where it was read from a torch zip: itself, or the tensor a Parameter wraps; None for a record of
        any other format (its bytes are not a zip's storage record)."""
        return None

    @property
    def stored_span(self) -> tuple[int, int] | None:
        """``(offset, length)`` of its values in the file it names, where the record alone says (a safetensors
        tensor's ``[start, end)``); None where finding them takes the opened file (:meth:`file_span`)."""
        return None

    @property
    def is_parameter(self) -> bool:
        """Loaded as an ``nn.Parameter`` (what a .safetensors output does not keep)."""
        return False

    @property
    def parameter_state(self) -> bool:
        """Saved as a Parameter with backward hooks or state, which only torch's unpickler rebuilds."""
        return False

    @property
    def cast_from(self) -> TensorRecord | None:
        """The record whose values it is, cast to its dtype (``--dtype``: a new tensor of a storage of its own);
        None for a record that is not a cast."""
        return None

    def same_bytes(self, other: Any) -> bool | None:
        """Whether it and ``other`` hold the same bytes, where both are bytes in memory compared without torch
        (two :class:`~ckptfix.formats.raw.RawTensor`); None where only torch can tell."""
        return None

    def read_runs(self, reader: RunReader, *, key: str) -> Any:
        """The tensor it stands for, in memory torch allocated for it alone (a writer frees it once written), its
        bytes read through ``reader`` from the files the stream holds open: its :meth:`byte_ranges`, cast where
        its reader casts them (a ZeRO half-precision buffer). ``key`` names it in errors."""
        ranges = self.byte_ranges()
        if ranges is None:  # a record of something still to compute: no bytes to read
            raise FormatError(f"{reader.source}: tensor '{key}' has no bytes in the input to read")
        runs = [(reader.fd(path), at, n) for path, at, n in ranges]
        cast = self.dtype if self.stored_dtype != self.dtype else None
        return reader.runs(runs, self.stored_dtype, tuple(self.shape), key=key, cast=cast)

    # -- writing its bytes into an output (the streams, ckptfix.stream.folders): each record answers for itself --

    # a stream writes its bytes into a .safetensors output (a DCP tensor, a safetensors byte range, a ZeRO run's
    # pieces, a cast or rows of one); any other record there is refused, naming what to write instead
    streams_bytes: ClassVar[bool] = False

    def prepare_copy(self, files: FileTable, *, allowed: frozenset[str]) -> None:
        """Check what can be checked before its bytes are queued (the first byte written), and open the files they
        are copied from (the copy thread only reads the table): by default the files of :meth:`byte_ranges`."""
        for path, _, _ in self.byte_ranges() or ():
            files.fd(path)

    def stored_ranges(self, files: FileTable) -> list[tuple[str, int, int]] | None:
        """Once prepared, the runs ``(path, offset, length)`` that make it up in order, in :attr:`stored_dtype`;
        None when they are not runs of files (blocks to gather, a cast)."""
        return self.byte_ranges()

    def output_ranges(self, files: FileTable) -> list[tuple[str, int, int]] | None:
        """The runs whose copy, in order, is its bytes in the output; None when they are made in memory
        (:meth:`write_made`): a cast, a ZeRO buffer cast as zero_to_fp32 casts, a DCP tensor of blocks."""
        return None if self.stored_dtype != self.dtype else self.stored_ranges(files)

    def write_made(self, write: Callable[[Any], Any], files: FileTable) -> str:
        """Its bytes, made in memory where :meth:`output_ranges` is None, written through ``write``; what was done:
        ``cast`` (a block at a time) or ``gathered``."""
        raise AssertionError(f"{type(self).__name__}: its bytes are runs of files, never made in memory")

    def gathered(self, files: FileTable) -> Any:
        """Once prepared, the whole tensor in memory (a torch tensor) from the files of ``files``, where its bytes
        are not runs of files: a DCP tensor of blocks, rows of one."""
        raise AssertionError(f"{type(self).__name__}: only a tensor of blocks is gathered")

    # -- a sharded run's tensor (FSDP rank files): what a merge assembles from every rank's piece ---------------

    def rank_piece(self) -> TensorRecord | None:
        """The record of one rank's piece that a merge of a sharded run's rank files checks against every other
        rank's and assembles into the tensor this record stands for: itself for a DTensor or a ShardedTensor, the
        flat parameter for a parameter cut from one; None (the default) for a tensor stored whole."""
        return None

    def from_piece(self, full: Any) -> Any:
        """Its tensor, given ``full``, the tensor its :meth:`rank_piece` assembles into: that tensor itself (the
        default), or the part of it this record is (a parameter cut from a flat parameter)."""
        return full


def is_record(value: object) -> bool:
    """True for a tensor record of any reader or writer (not for a real tensor)."""
    return isinstance(value, TensorRecord)


def is_streamable(value: object) -> bool:
    """True for a tensor record whose bytes a conversion stream reads from its input
    (:attr:`TensorRecord.streamable`)."""
    return isinstance(value, TensorRecord) and value.streamable


def spec(value: Any) -> Spec:
    """Dtype and shape of a tensor or of a tensor record of any reader."""
    if isinstance(value, TensorRecord):
        return value.spec()
    return Spec(str(value.dtype).removeprefix("torch."), tuple(value.shape), layout(value))


def layout(value: Any) -> str:
    return str(getattr(value, "layout", "strided")).removeprefix("torch.")


def storage_of(value: Any) -> Hashable | None:
    """What a tensor's bytes live in, so tensors sharing storage can be found; None for an empty tensor."""
    if isinstance(value, TensorRecord):
        return value.storage_key()
    if spec(value).numel == 0 or not hasattr(value, "untyped_storage") or layout(value) != "strided":
        return None  # empty; an object with no bytes behind it; a sparse tensor, which has no storage
    return (str(value.device), value.untyped_storage().data_ptr())


def identity(value: Any) -> Hashable:
    """Equal for two names of one tensor (tied weights): same storage, offset, shape, strides and dtype."""
    if isinstance(value, TensorRecord):
        return value.identity()
    ptr = value.untyped_storage().data_ptr()
    return (ptr, value.storage_offset(), tuple(value.shape), tuple(value.stride()), str(value.dtype))


def torch_dtype(torch: Any, name: str, *, source: str) -> Any:
    """torch's dtype of that name (``torch`` passed in: this module never imports it)."""
    dtype = getattr(torch, name, None)
    if dtype is None:
        raise FormatError(f"{source}: a tensor has dtype {name}, which this torch cannot represent; upgrade torch")
    return dtype


def map_tree(
    tree: Any,
    fn: Callable[[Any], Any],
    *,
    leaf: type | tuple[type, ...] | Callable[[Any], bool] = TensorRecord,
    shared: bool = False,
    exact: bool = True,
) -> Any:
    """A copy of the containers of ``tree`` with ``fn(value)`` in place of each value that ``leaf`` picks (a tensor
    record by default; a class or tuple of classes: their instances). Dicts keep their kind (an ``OrderedDict``
    stays one, a plain dict is made of any other mapping) and their attributes (a state dict's ``_metadata``);
    lists and tuples are copied as such. With
    ``exact`` only a plain list or tuple is entered (a namedtuple, a list subclass: an object, kept as it is);
    without, any list is entered and any tuple becomes a plain tuple. ``shared`` keeps a dict or list reached
    twice one object in the copy (as the pickle it is written to shares it). Anything else is kept as it is."""
    done: dict[int, Any] = {}
    kinds = leaf if isinstance(leaf, (type, tuple)) else None  # checked inline: a million values, no call each
    picks: Callable[[Any], bool] = (lambda _: False) if isinstance(leaf, (type, tuple)) else leaf

    def walk(obj: Any) -> Any:
        if isinstance(obj, kinds) if kinds is not None else picks(obj):
            return fn(obj)
        if isinstance(obj, dict):
            if shared and id(obj) in done:
                return done[id(obj)]
            new: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
            if shared:
                done[id(obj)] = new
            for k, v in obj.items():
                new[k] = walk(v)
            for name, attr in getattr(obj, "__dict__", {}).items():  # an OrderedDict's _metadata
                setattr(new, name, attr)
            return new
        kind = type(obj)
        if kind is list or (not exact and isinstance(obj, list)):
            if shared and id(obj) in done:
                return done[id(obj)]
            out: list[Any] = []
            if shared:
                done[id(obj)] = out
            out.extend(walk(v) for v in obj)
            return out
        if kind is tuple or (not exact and isinstance(obj, tuple)):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(tree)


@dataclass
class FolderRecords:
    """A folder format's checkpoint as tensor records, what its registry row's ``records`` gives (no tensor byte
    read): ``tree`` holds records that read themselves through the folder's data files (``Holder.file_fd``, as a
    :class:`~ckptfix.formats.dcp.reader.DcpTensor` does); ``kind`` is the folder in the words of ``convert -v``;
    ``files`` every file the checkpoint is made of; ``notes`` what was left out; ``summary`` what ``inspect`` shows
    of it (under the format's kind in ``--json``)."""

    tree: Any
    kind: str
    files: list[str]
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None


__all__ = [
    "FileTable",
    "FolderRecords",
    "Holder",
    "RunReader",
    "Spec",
    "TensorRecord",
    "identity",
    "is_record",
    "is_streamable",
    "layout",
    "map_tree",
    "spec",
    "storage_of",
    "torch_dtype",
]
