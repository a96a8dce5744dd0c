"""A checkpoint folder to one .safetensors file in constant memory: the header from the folder's metadata, then each
tensor's bytes straight from the files that hold them.

- transformers/accelerate safetensors shards: each tensor is one byte range of one shard, copied as it is.
- DCP folders: a chunk that is a whole range of rows (every FSDP2 ``Shard(0)`` chunk, every unsharded tensor)
  is a contiguous byte range of the full tensor: it is copied file to file (``copy_file_range``), never held in
  memory. Other chunks (columns, 2-D meshes) are gathered one tensor at a time into a buffer of that tensor's
  size. Each chunk's archive is read and CRC-checked by the same reader as a ``.pt`` file.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.dtypes import safetensors_code
from ckptfix.formats.files import DataFiles
from ckptfix.formats.opened import OpenedFolder, OpenOptions
from ckptfix.formats.output.atomic import Worker, atomic_output
from ckptfix.formats.output.crc import Check, Verifier
from ckptfix.formats.records import TensorRecord, is_record
from ckptfix.formats.registry import detect, folder_format, open_format
from ckptfix.formats.safetensors.file import split_checkpoint, tensor_bytes
from ckptfix.formats.safetensors.header import encode_header
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import carry
from ckptfix.stream.casting import cast_records
from ckptfix.stream.copy import start_writeback
from ckptfix.stream.progress import progress_bar
from ckptfix.transforms.checkpoint import Conversion, is_tensor

_COPY = 1 << 26
Stored = TensorRecord  # a record whose bytes a folder stream writes (its class says so: ``streams_bytes``)


def convert_folder(
    src: str,
    dst: str,
    *,
    transform: Callable[[Any], Conversion],
    allow_globals: tuple[str, ...] = (),
    dtype: str | None = None,
    shard_size: int | None = None,
    overwrite: bool = False,
    check: Callable[[Callable[[Any], bytes]], None] | None = None,
    progress: bool = False,
) -> Conversion:
    """Write the one state dict of folder ``src`` (DCP, safetensors shards, a DeepSpeed run; or one .safetensors
    file) after ``transform`` as ``dst``. ``dtype`` casts its floating-point tensors as they are written;
    ``shard_size`` (bytes) writes transformers shards of at most that size beside ``dst`` with their index
    instead (an existing shard set of that name replaced only with ``overwrite``, as
    :func:`ckptfix.formats.hf.folder.save_sharded` does). ``check(read)``, before a byte is written, may read the
    values of the tensors it names (``read(t)``: :func:`value_bytes`). ``progress`` shows a bar on a terminal
    (:func:`ckptfix.stream.progress.progress_bar`)."""
    tree, kind, files, allowed = open_tree(src, allow_globals=allow_globals)
    try:
        conversion = transform(tree)
        if check is not None:
            check(lambda t: value_bytes(t, files, allowed=allowed))
        # a .pt's entry of refused globals, kept opaque, is refused here as ckptfix.load refuses it
        conversion.obj = carry(conversion.obj, out_fmt="safetensors", source=src, notes=conversion.notes)
        cast = cast_records(conversion, dtype) if dtype is not None else 0
        verifier = VerifyInTurn(files, files.checks)
        try:
            with progress_bar(_total(conversion.obj), enabled=progress) as bar:
                if shard_size is None:
                    ways, written = (
                        _write_file(dst, conversion.obj, files, allowed=allowed, verifier=verifier, advance=bar),
                        1,
                    )
                else:
                    ways, written = _write_shards(
                        dst,
                        conversion.obj,
                        files,
                        allowed=allowed,
                        verifier=verifier,
                        limit=shard_size,
                        overwrite=overwrite,
                        advance=bar,
                    )
        finally:
            verifier.cancel()
        files.check_unchanged()
    finally:
        files.close()
    conversion.notes.extend(files.notes)
    if files.losses is not None and (lost := files.losses(conversion.obj)):
        conversion.notes.append(lost)
    what = "safetensors" if shard_size is None else f"{written} safetensors shard{'s' * (written != 1)}"
    said = f", {cast} cast to {dtype} a block at a time" if dtype is not None else ""
    conversion.notes.append(
        f"{kind} -> {what}: {len(ways)} tensors, {ways.count('copied')} copied as byte ranges, "
        f"{ways.count('gathered')} gathered in memory{said}"
    )
    return conversion


def _total(obj: Any) -> int:
    """The bytes of the tensors of ``obj`` (a state dict, or a checkpoint of state dicts), each stored tensor once."""
    seen: dict[int, int] = {}
    for value in obj.values() if isinstance(obj, dict) else ():
        for t in value.values() if isinstance(value, dict) else [value]:
            seen[id(t)] = _record_size(t)[0]
    return sum(seen.values())


def _write_file(
    dst: str,
    obj: Any,
    files: DataFiles,
    *,
    allowed: frozenset[str],
    verifier: VerifyInTurn | None,
    advance: Callable[[int], None] | None = None,
) -> list[str]:
    """Write ``obj`` (one state dict, or a checkpoint with one model entry) as the .safetensors file ``dst``; how
    each stored tensor was written. ``verifier`` (the CRCs of every input record) is started once the last
    tensor is queued and joined before ``dst`` is put in place."""
    state, meta = split_checkpoint(obj, out=dst)
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    stored = []
    for key, t in state.items():
        if id(t) in first:  # tied: one tensor under two names, stored once as save_safetensors does
            aliases[key] = first[id(t)]
        else:
            first[id(t)] = key
            stored.append(_stored(dst, key, t))
    with atomic_output(dst) as out:
        out.write(encode_header(state, meta, stored, aliases, out=dst))
        out.flush()
        copier = InOrder(lambda t: _advanced(_write_tensor(out, t, files), t, advance))
        try:
            for key, *_ in stored:  # each tensor's chunk archives parsed (pickle checked) before its bytes
                prepare(state[key], files, allowed=allowed)
                copier.put(state[key])
            if verifier is not None:
                verifier.start()  # every record's CRC while the last bytes are copied: the input read once more
            ways: list[str] = copier.finish()
        finally:
            copier.cancel()
        os.fsync(out.fileno())  # the disk catches up while the CRCs finish (the final fsync is then free)
        if verifier is not None:
            verifier.join()  # a bad CRC raises here, and the output is discarded
    return ways


def _advanced(way: str, t: Any, advance: Callable[[int], None] | None) -> str:
    """``way``, once tensor ``t`` is written and counted on the progress bar (if one is shown)."""
    if advance is not None:
        advance(_record_size(t)[0])
    return way


def _write_shards(
    dst: str,
    obj: Any,
    files: DataFiles,
    *,
    allowed: frozenset[str],
    verifier: VerifyInTurn,
    limit: int,
    overwrite: bool,
    advance: Callable[[int], None] | None = None,
) -> tuple[list[str], int]:
    """Write ``obj`` as transformers shards of ``dst`` through the in-memory writer's own planning, staging and
    index (each shard a :func:`_write_file`); how each stored tensor was written, and how many shards."""
    from ckptfix.formats.hf.folder import plan_shards, save_sharded

    ways: list[str] = []
    # the CRCs are read while the last shard is copied: a DCP folder's checks are known once its chunks are parsed
    sizes = [(key, *_record_size(t)) for key, t in obj.items()] if isinstance(obj, dict) else []
    last = len(plan_shards(sizes, limit=limit))

    count = 0

    def write(sub: Any, path: str) -> None:
        nonlocal count
        count += 1
        ways.extend(
            _write_file(
                path, sub, files, allowed=allowed, verifier=verifier if count == last else None, advance=advance
            )
        )

    written = save_sharded(
        obj, dst, limit=limit, write=write, overwrite=overwrite, size=_record_size, before_commit=verifier.check
    )
    return ways, sum(not p.endswith(".index.json") for p in written)


def _record_size(t: Any) -> tuple[int, Any]:
    """A record's bytes and what makes two of them one stored tensor (itself; nothing when it is empty)."""
    nbytes = t.nbytes if is_tensor(t) else 0
    return nbytes, (t if nbytes else None)


def prepare(t: Any, files: DataFiles, *, allowed: frozenset[str]) -> None:
    """Check what can be checked before ``t``'s bytes are queued (the first byte written): the record answers
    (:meth:`~ckptfix.formats.records.TensorRecord.prepare_copy`: its files opened, a DCP tensor's chunk archives
    parsed, a .pt tensor's kind checked)."""
    t.prepare_copy(files, allowed=allowed)


class VerifyInTurn:
    """The CRC of every check, file after file on one thread (each file by a :class:`Verifier`): a folder of a
    thousand rank files is read in turn, not by a thousand threads at once. :meth:`join` raises the first bad
    record; ``crcs`` then holds each file's CRCs in check order."""

    def __init__(self, files: DataFiles, checks: dict[str, list[Check]]) -> None:
        self.files, self.checks = files, checks
        self.crcs: dict[str, list[int]] = {}
        self.current: Verifier | None = None
        self.error: BaseException | None = None
        self.stopped = False
        self.lock = threading.Lock()
        self.thread = Worker(self._run, name="ckptfix-verify")

    def start(self) -> None:
        self.thread.start()

    def check(self) -> dict[str, list[int]]:
        """:meth:`join`, started first if it was not (every check read by now)."""
        if self.thread.ident is None:
            self.start()
        return self.join()

    def _run(self) -> None:
        for path in sorted(self.checks):
            with self.lock:
                if self.stopped:
                    return
                self.current = Verifier(self.files.fd(path), self.checks[path], source=path)
                self.current.start()
            try:
                self.crcs[path] = self.current.join()
            except BaseException as e:  # raised in the caller's thread by join()
                self.error = e
                return

    def join(self) -> dict[str, list[int]]:
        self.thread.wait(self.cancel_current)
        if self.error is not None:
            raise self.error
        return self.crcs

    def cancel(self) -> None:
        """Stop reading (the caller is failing, or done); idempotent."""
        self.cancel_current()
        self.thread.wait()

    def cancel_current(self) -> None:
        with self.lock:
            self.stopped = True
            if self.current is not None:
                self.current.cancel()


class InOrder:
    """Runs ``work(item)`` for each item put, in order, on a thread of its own, while the caller parses the next
    items' chunk archives: the parsing holds the GIL, the copies (``copy_file_range``, writes) do not, so the one
    hides behind the other. An error on the thread is raised in the caller's, at its next put or at finish."""

    def __init__(self, work: Callable[[Any], Any]) -> None:
        self.work = work
        self.todo: queue.SimpleQueue[tuple[Any] | None] = queue.SimpleQueue()
        self.results: list[Any] = []
        self.error: BaseException | None = None
        self.stopped = False
        self.thread = Worker(self._run, name="ckptfix-copy")
        self.thread.start()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            if self.error is None and not self.stopped:
                try:
                    self.results.append(self.work(item[0]))
                except BaseException as e:
                    self.error = e

    def put(self, item: Any) -> None:
        if self.error is not None:
            raise self.error
        self.todo.put((item,))

    def finish(self) -> list[Any]:
        self.todo.put(None)
        self.thread.wait(self._stop)
        if self.error is not None:
            raise self.error
        return self.results

    def cancel(self) -> None:
        """Stop after the item at work (a refusal or a signal in the caller); idempotent."""
        if not self.thread.ended.is_set():
            self._stop()
            self.thread.wait()

    def _stop(self) -> None:
        self.stopped = True
        self.todo.put(None)


def folder_tree(src: str, *, allow_globals: tuple[str, ...] = ()) -> tuple[Any, str]:
    """The checkpoint a folder holds with tensor records (:class:`DcpTensor`, :class:`StTensor`: dtype,
    shape, and where the bytes are) in place of tensors, and its kind (``dcp`` or ``shards``); no tensor byte is
    read (DCP's small non-tensor values are). Raises Fallback for folders it does not describe (accelerate
    folders, torch shards)."""
    tree, kind, files, _ = open_tree(src, allow_globals=allow_globals)
    files.close()
    return tree, kind


def open_tree(
    src: str, *, allow_globals: tuple[str, ...] = (), optimizer: bool = False
) -> tuple[Any, str, DataFiles, frozenset[str]]:
    """:func:`folder_tree` with the data files left open for reading its tensors, and the allowlist to read
    them with; the caller closes them (``files.close()``). ``optimizer`` (a DeepSpeed run only): the tree is
    ``{"model": state dict, "optimizer": the consolidated optimizer state dict}``. A folder is opened by its format's
    one opener (its registry row's ``open``, as ``inspect`` opens it); :class:`Fallback` where it does not describe it
    as records a stream copies."""
    allowed = allowlist.allowed_names(allow_globals, source=src)
    found = detect(src)
    if found.name in ("safetensors", "torch-zip"):
        from ckptfix.stream.single import file_tree  # one file: cast or sharded a tensor at a time

        files = DataFiles()
        try:
            tree, kind = file_tree(src, found.name, files, allowed=allowed)
        except BaseException:
            files.close()
            raise
        return tree, kind, files, allowed
    if found.name != "folder":  # a file no stream reads (legacy torch): the transformers row says what it is not
        found = folder_format("hf") or found
    options = OpenOptions(allow_globals=allow_globals, optimizer=optimizer, stream=True)
    opened = open_format(found, src, options)
    assert isinstance(opened, OpenedFolder)  # a folder's opener gives one
    return opened.tree, opened.label, opened.table, allowed


def _stored(out: str, key: str, t: Any) -> tuple[str, str, tuple[int, ...], int]:
    if not (is_record(t) and t.streams_bytes):
        what = "a tensor stored as bytes" if is_tensor(t) else type(t).__name__
        raise OutputError(f"{out}: key '{key}' holds {what}, not a tensor; write a .pt file")
    if safetensors_code(t.dtype) is None:
        raise OutputError(
            f"{out}: key '{key}': not supported yet: dtype {t.dtype} in .safetensors (it has no code for it); "
            f"write a .pt file"
        )
    return key, t.dtype, t.shape, _record_size(t)[0]


def _write_tensor(out: BinaryIO, t: Stored, files: DataFiles) -> str:
    ranges = copied_ranges(t, files)
    if ranges is None:
        return write_made(out, t, files)
    for path, at, n in ranges:  # whole tensors, DeepSpeed partitions' slices, DCP row chunks: file to file
        _copy(files.fd(path), at, n, out)
    return "copied"


def value_bytes(t: Any, files: DataFiles, *, allowed: frozenset[str]) -> bytes:
    """The bytes ``t`` is written as, read into memory: one tensor's, for a check of its values."""
    from io import BytesIO

    if not is_record(t):
        return bytes(tensor_bytes(t))
    prepare(t, files, allowed=allowed)
    out, ranges = BytesIO(), copied_ranges(t, files)
    if ranges is None:
        write_made(out, t, files)
    for path, at, n in ranges or ():
        while n:
            data = os.pread(files.fd(path), n, at)
            if not data:
                raise FormatError(f"{path}: ended early while reading; it was truncated while reading")
            out.write(data)
            at, n = at + len(data), n - len(data)
    return out.getvalue()


def copied_ranges(t: Stored, files: DataFiles) -> list[tuple[str, int, int]] | None:
    """The byte ranges whose copy, in order, is ``t``'s bytes in the output; None when they are made in memory
    (:func:`write_made`)."""
    return t.output_ranges(files)


def write_made(out: Any, t: Stored, files: DataFiles) -> str:
    """``t``'s bytes, made in memory where :func:`copied_ranges` says so, written through ``out.write``; what was
    done: ``cast`` (a block at a time) or ``gathered``."""
    return t.write_made(out.write, files)


def _copy(fd: int, at: int, n: int, out: BinaryIO) -> None:
    out.flush()
    dst = out.fileno()
    pos = os.lseek(dst, 0, os.SEEK_CUR)
    while n:
        try:
            done = os.copy_file_range(fd, dst, min(n, _COPY), at, pos)
        except OSError:
            done = 0
        if done <= 0:  # not supported here (another file system): read and write
            data = os.pread(fd, min(n, _COPY), at)
            if not data:
                raise FormatError("a data file ended early while copying; it was truncated while reading")
            done = os.pwrite(dst, data, pos)
        if done >= 1 << 20:  # disk write-back overlaps the copy, as the single-file Copier does
            start_writeback(dst, pos, done)
        at, pos, n = at + done, pos + done, n - done
    os.lseek(dst, pos, os.SEEK_SET)


__all__ = [
    "convert_folder",
    "folder_tree",
    "open_tree",
    "prepare",
]
