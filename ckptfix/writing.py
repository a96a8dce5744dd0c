"""Write a checkpoint whose tensors arrive one at a time: the header first, then each tensor as it is computed.

``merge`` knows the whole output's structure (keys, dtypes, shapes, the other entries) before it has computed a
single tensor, so the safetensors header or the torch pickle is written first and every tensor follows the moment
it is ready; memory holds one tensor, not the checkpoint. The output tree holds the input's tensor records for
tensors kept as they are, and :class:`Placeholder` records for the ones to compute. Records of a torch zip input
that the writer is not handed (a view into a larger storage, the optimizer state of the other entries) are copied
from that input, their CRCs checked. A tree it cannot write this way (real tensors, objects only torch pickles)
raises :class:`~ckptfix.formats.copyable.Fallback` before anything is written, and the caller writes with
``ckptfix.save``.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.formats.opened import Opened
from ckptfix.formats.output.atomic import PathLike, atomic_output
from ckptfix.formats.output.crc import check_crc
from ckptfix.formats.pickles import inert, inert_trees, pickling
from ckptfix.formats.records import TensorRecord, identity, is_record, map_tree, spec
from ckptfix.formats.safetensors.file import plan_safetensors, tensor_bytes
from ckptfix.formats.torchzip.archive import Record, ZipWriter, stored_crc
from ckptfix.formats.torchzip.layout import NewStorages, storage_name, write_head, write_tail
from ckptfix.transforms.checkpoint import is_tensor

if TYPE_CHECKING:
    import contextlib

    import torch

_CHUNK = 1 << 24


@dataclass(eq=False)
class Placeholder(TensorRecord):
    """A tensor of the output that is still to be computed: its dtype and shape, known in advance (a tensor of its
    own: :meth:`~ckptfix.formats.records.TensorRecord.identity` is the record's)."""

    on_demand: ClassVar[bool] = True

    dtype: str
    shape: tuple[int, ...]


class StreamedWriter:
    """Context manager: the header on entry, :meth:`put` for each tensor, the rest and the rename on exit."""

    def __init__(self, out: PathLike) -> None:
        self.out = os.fspath(out)
        self._ctx: contextlib.AbstractContextManager[BinaryIO] | None = None
        self.fd = -1

    def __enter__(self) -> StreamedWriter:
        self._ctx = atomic_output(self.out)
        self.fd = self._ctx.__enter__().fileno()
        try:
            self.start()
        except BaseException as e:  # __exit__ is not called when __enter__ fails: remove the temp file here
            if not self._ctx.__exit__(type(e), e, e.__traceback__):
                raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._ctx is not None  # entered
        if kind is None:
            try:
                self.finish()
            except BaseException as e:  # the temp file goes, and the error is the caller's
                if not self._ctx.__exit__(type(e), e, e.__traceback__):
                    raise
                return None
        return self._ctx.__exit__(kind, exc, tb)

    def start(self) -> None:
        raise NotImplementedError

    def put(self, value: Any, tensor: torch.Tensor) -> None:
        """Write ``tensor``, the value of the output tree's record ``value`` (a second name of it is skipped)."""
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


def streamed_writer(tree: Any, out: PathLike, *, fmt: str, base: Opened) -> StreamedWriter:
    """A writer of ``tree`` to ``out`` in format ``fmt``; records of ``base`` (a described input) are copied.

    Raises :class:`Fallback` when the tree holds something only ``ckptfix.save`` writes.
    """
    if fmt == "safetensors":
        return _Safetensors(tree, out)
    return _TorchZip(tree, out, base)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view[: 1 << 30], offset)
        view, offset = view[n:], offset + n


class _Safetensors(StreamedWriter):
    def __init__(self, tree: Any, out: PathLike) -> None:
        super().__init__(out)

        def locate(value: Any) -> tuple[str, tuple[int, ...], int, int, Any]:
            if not (is_record(value) and value.on_demand):
                raise Fallback(Reason.IN_MEMORY)
            found = spec(value)
            return found.dtype, found.shape, 0, found.nbytes, identity(value)

        self.plan = plan_safetensors(tree, out=self.out, locate=locate)
        # where each stored tensor's bytes go: header, then the data in the order of the header
        self.offsets: dict[Any, int] = {}
        self.pending: set[Any] = set()
        state = _state_of(tree)
        at = len(self.plan.header)
        for value in state.values():
            key = identity(value)
            nbytes = spec(value).nbytes
            if key not in self.offsets or nbytes == 0:
                self.offsets.setdefault(key, at)
                at += nbytes
                if nbytes:
                    self.pending.add(key)

    def start(self) -> None:
        _pwrite_all(self.fd, self.plan.header, 0)

    def put(self, value: Any, tensor: torch.Tensor) -> None:
        key = identity(value)
        if key in self.pending:
            _pwrite_all(self.fd, tensor_bytes(tensor), self.offsets[key])
            self.pending.discard(key)

    def finish(self) -> None:
        if self.pending:  # every stored tensor must have been handed over: a bug otherwise
            raise RuntimeError(f"{len(self.pending)} tensor(s) of {self.out} were never written")


def _state_of(tree: Any) -> Any:
    from ckptfix.formats.safetensors.file import split_checkpoint

    return split_checkpoint(tree, out="")[0]


class _TorchZip(StreamedWriter):
    def __init__(self, tree: Any, out: PathLike, base: Opened) -> None:
        super().__init__(out)
        self.base = base if base.zip is not None else None
        self.opened = base
        taken = set(base.zip.storages) if base.zip is not None else set()
        # a new record's storage key -> its value, read at the end if not handed in
        self.new = NewStorages(
            keys=(k for k in map(str, range(1 << 62)) if k not in taken), size=lambda value: spec(value).nbytes
        )

        def record(value: Any) -> Any:
            torch_zip = is_record(value) and value.zip_tensor is not None  # the format this writes
            if torch_zip and self.base is not None:
                return value  # kept: its storage record is copied, or written from the tensor handed in
            if torch_zip or not (is_record(value) and value.on_demand):
                raise Fallback(Reason.VALUE_TYPE, kind=type(value).__name__)
            return self.new(value)

        # a container reached twice stays one, as the pickle written shares it
        self.tree = map_tree(tree, record, leaf=is_tensor, shared=True, exact=False)
        try:
            self.pickle = pickling.dump(self.tree)
        except TypeError as e:
            raise Fallback(Reason.UNPICKLABLE, error=e) from e
        self.storages = {ref.key: ref for ref in inert_trees.walk(self.tree) if isinstance(ref, inert.StorageRef)}
        self.written: set[str] = set()

    def start(self) -> None:
        self.writer = ZipWriter(self.fd)
        write_head(self.writer, self.pickle)

    def put(self, value: Any, tensor: torch.Tensor) -> None:
        rec = self.new.made.get(id(value))
        if rec is None:
            t = value.zip_tensor
            assert self.base is not None  # a kept value comes from the base zip
            source = self.base.record(t)
            whole = t.offset == 0 and t.is_contiguous() and spec(t).nbytes == source.size
            if not whole or t.storage.key in self.written:
                return  # a view of a larger storage: copied whole from the input at the end
            self._record(t.storage.key, tensor_bytes(tensor), crc=stored_crc(source))  # None: computed
        elif rec.storage.key not in self.written:
            self._record(rec.storage.key, tensor_bytes(tensor))

    def _record(self, key: str, data: Any, *, crc: int | None = None) -> None:
        view = memoryview(data).cast("B")
        offset = self.writer.begin(storage_name(key), len(view))
        _pwrite_all(self.fd, view, offset)
        self.writer.end(zlib.crc32(view) if crc is None else crc)
        self.written.add(key)

    def finish(self) -> None:
        for key in self.storages:
            if key in self.written:
                continue
            value = self.new.stored.get(key)
            if value is None:
                self._copy(key)  # a storage of the base input
            else:  # a record not handed in (a folder's other entries): read from its input, one tensor at a time
                self._record(key, tensor_bytes(self.opened.raw(value)))
        write_tail(self.writer)
        self.writer.finish()

    def _copy(self, key: str) -> None:
        """Copy a storage record of the base input, in chunks, checking its CRC on the way."""
        if self.base is None or self.base.zip is None or self.base.fd is None:
            raise RuntimeError(f"{self.out}: storage '{key}' has no source")  # a bug: every record has one
        source: Record = self.base.zip.archive.storage(key)
        offset = self.writer.begin(storage_name(key), source.size)
        crc, done = 0, 0
        while done < source.size:
            data = self.base.pread(source.data_offset + done, min(_CHUNK, source.size - done))
            _pwrite_all(self.fd, data, offset + done)
            crc = zlib.crc32(data, crc)
            done += len(data)
        check_crc(self.base.source, source.name, stored_crc(source), crc)
        self.writer.end(crc)
        self.written.add(key)
