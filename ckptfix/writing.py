"""Write a checkpoint whose tensors arrive one at a time: the header first, then each tensor as it is computed.

``merge`` knows the whole output's structure (keys, dtypes, shapes, the other entries) before it has computed a
single tensor, so the safetensors header or the torch pickle is written first and every tensor follows the moment
it is ready; memory holds one tensor, not the checkpoint. The output tree holds the input's tensor records for
tensors kept as they are, and :class:`Placeholder` records for the ones to compute. Records of a torch zip input
that the writer is not handed (a view into a larger storage, the optimizer state of the other entries) are copied
from that input, their CRCs checked. A tree it cannot write this way (real tensors, objects only torch pickles)
raises :class:`CannotStream` before anything is written, and the caller writes with ``ckptfix.save``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

from ckptfix.formats.containers.safetensors import tensor_bytes
from ckptfix.formats.containers.torchzip import HEAD, TAIL, stand_ins, tensor_record
from ckptfix.formats.containers.ziparchive import Record, ZipWriter, stored_crc
from ckptfix.formats.output.atomic import PathLike, atomic_output
from ckptfix.formats.output.crc import check_crc
from ckptfix.formats.pickles import inert, pickling
from ckptfix.reading import FolderTensor, Opened, identity, spec
from ckptfix.stream.fallback import Fallback
from ckptfix.stream.folders import DcpTensor
from ckptfix.stream.st import StTensor, plan_safetensors

if TYPE_CHECKING:
    import contextlib

    import torch

_CHUNK = 1 << 24


@dataclass(eq=False)
class Placeholder:
    """A tensor of the output that is still to be computed: its dtype and shape, known in advance."""

    __ckptfix_tensor__: ClassVar[bool] = True
    dtype: str
    shape: tuple[int, ...]


class CannotStream(Exception):  # noqa: N818 - a signal to the caller, not an error
    """The tree cannot be written a tensor at a time; ``str(e)`` says why."""


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

    Raises :class:`CannotStream` when the tree holds something only ``ckptfix.save`` writes.
    """
    if fmt == "safetensors":
        return _Safetensors(tree, out)
    return _TorchZip(tree, out, base)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view[: 1 << 30], offset)
        view, offset = view[n:], offset + n


def _key(value: Any) -> Any:
    return ("new", id(value)) if isinstance(value, Placeholder) else identity(value)


class _Safetensors(StreamedWriter):
    def __init__(self, tree: Any, out: PathLike) -> None:
        super().__init__(out)

        def locate(value: Any) -> tuple[str, tuple[int, ...], int, int, Any]:
            if not isinstance(value, (Placeholder, StTensor, inert.InertTensor, inert.InertParameter, FolderTensor,
                                      DcpTensor)):  # fmt: skip
                raise Fallback("a tensor already in memory")
            found = spec(value)
            return found.dtype, found.shape, 0, found.nbytes, _key(value)

        try:
            self.plan = plan_safetensors(tree, out=self.out, locate=locate)
        except Fallback as e:
            raise CannotStream(str(e)) from e
        # where each stored tensor's bytes go: header, then the data in the order of the header
        self.offsets: dict[Any, int] = {}
        self.pending: set[Any] = set()
        state = _state_of(tree)
        at = len(self.plan.header)
        for value in state.values():
            key = _key(value)
            nbytes = spec(value).nbytes
            if key not in self.offsets or nbytes == 0:
                self.offsets.setdefault(key, at)
                at += nbytes
                if nbytes:
                    self.pending.add(key)

    def start(self) -> None:
        _pwrite_all(self.fd, self.plan.header, 0)

    def put(self, value: Any, tensor: torch.Tensor) -> None:
        key = _key(value)
        if key in self.pending:
            _pwrite_all(self.fd, tensor_bytes(tensor), self.offsets[key])
            self.pending.discard(key)

    def finish(self) -> None:
        if self.pending:  # every stored tensor must have been handed over: a bug otherwise
            raise RuntimeError(f"{len(self.pending)} tensor(s) of {self.out} were never written")


def _state_of(tree: Any) -> Any:
    from ckptfix.formats.containers.safetensors import split_checkpoint

    return split_checkpoint(tree, out="")[0]


class _TorchZip(StreamedWriter):
    def __init__(self, tree: Any, out: PathLike, base: Opened) -> None:
        super().__init__(out)
        self.base = base if base.zip is not None else None
        self.opened = base
        taken = set(base.zip.storages) if base.zip is not None else set()
        glob = stand_ins()
        self.new: dict[int, inert.InertTensor] = {}  # id of a value -> the record written for it
        self.values: dict[str, Any] = {}  # a new record's storage key -> its value, read at the end if not handed in
        counter = iter(range(1 << 62))

        def record(value: Any) -> Any:
            if isinstance(value, (inert.InertTensor, inert.InertParameter)) and self.base is not None:
                return value  # kept: its storage record is copied, or written from the tensor handed in
            if not isinstance(value, (Placeholder, StTensor, FolderTensor, DcpTensor)):
                raise CannotStream(f"a {type(value).__name__} value")
            if id(value) not in self.new:
                key = next(k for k in map(str, counter) if k not in taken)
                found = spec(value)
                self.new[id(value)] = tensor_record(found.dtype, found.shape, key, found.nbytes, glob=glob)
                self.values[key] = value
            return self.new[id(value)]

        self.tree = _replace(tree, record)
        try:
            self.pickle = pickling.dump(self.tree)
        except TypeError as e:
            raise CannotStream(str(e)) from e
        self.storages = {ref.key: ref for ref in inert.walk(self.tree) if isinstance(ref, inert.StorageRef)}
        self.written: set[str] = set()

    def start(self) -> None:
        self.writer = ZipWriter(self.fd)
        self.writer.add("archive/data.pkl", self.pickle, zlib.crc32(self.pickle))
        for name, data in HEAD:
            self.writer.add(f"archive/{name}", data, zlib.crc32(data))

    def put(self, value: Any, tensor: torch.Tensor) -> None:
        rec = self.new.get(id(value))
        if rec is None:
            t = inert.tensor_of(value)
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
        offset = self.writer.begin(f"archive/data/{key}", len(view))
        _pwrite_all(self.fd, view, offset)
        self.writer.end(zlib.crc32(view) if crc is None else crc)
        self.written.add(key)

    def finish(self) -> None:
        for key in self.storages:
            if key in self.written:
                continue
            value = self.values.get(key)
            if isinstance(value, (FolderTensor, DcpTensor)):  # a folder's other entries: read one tensor at a time
                self._record(key, tensor_bytes(self.opened.raw(value)))
            else:
                self._copy(key)
        for name, data in TAIL:
            self.writer.add(f"archive/{name}", data, zlib.crc32(data))
        ident = b"%040d" % (int.from_bytes(os.urandom(17), "big") % 10**40)  # 40 digits, as torch.save
        self.writer.add("archive/.data/serialization_id", ident, zlib.crc32(ident))
        self.writer.finish()

    def _copy(self, key: str) -> None:
        """Copy a storage record of the base input, in chunks, checking its CRC on the way."""
        if self.base is None or self.base.zip is None or self.base.fd is None:
            raise RuntimeError(f"{self.out}: storage '{key}' has no source")  # a bug: every record has one
        source: Record = self.base.zip.archive.by_name[f"{self.base.zip.archive.prefix}data/{key}"]
        offset = self.writer.begin(f"archive/data/{key}", source.size)
        crc, done = 0, 0
        while done < source.size:
            data = self.base.pread(source.data_offset + done, min(_CHUNK, source.size - done))
            _pwrite_all(self.fd, data, offset + done)
            crc = zlib.crc32(data, crc)
            done += len(data)
        check_crc(self.base.source, source.name, stored_crc(source), crc)
        self.writer.end(crc)
        self.written.add(key)


def _replace(tree: Any, record: Callable[[Any], Any]) -> Any:
    """A copy of the containers of ``tree`` with every tensor value replaced by ``record(value)``."""
    done: dict[int, Any] = {}

    def walk(obj: Any) -> Any:
        if getattr(obj, "__ckptfix_tensor__", False) or _is_real_tensor(obj):
            return record(obj)
        if not isinstance(obj, (dict, list, tuple)):
            return obj
        if id(obj) in done:
            return done[id(obj)]
        if isinstance(obj, dict):
            new: Any = type(obj)()
            done[id(obj)] = new
            for k, v in obj.items():
                new[k] = walk(v)
            for name, value in getattr(obj, "__dict__", {}).items():  # _metadata of an OrderedDict
                setattr(new, name, value)
            return new
        if isinstance(obj, list):
            out: list[Any] = []
            done[id(obj)] = out
            out.extend(walk(v) for v in obj)
            return out
        return tuple(walk(v) for v in obj)

    return walk(tree)


def _is_real_tensor(obj: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)
