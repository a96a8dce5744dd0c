"""A checkpoint into a DCP folder in bounded memory.

Without a cast, the folder is written without torch, each tensor's bytes copied as byte ranges
(:mod:`ckptfix.stream.dcp_writer`). With ``--dtype``, each tensor is read and cast, and torch's own DCP writer,
handed ``meta`` tensors, writes the folder:

DCP's planner needs of a tensor only its shape, dtype and properties, so it plans from a state dict of ``meta``
tensors, and torch writes the folder exactly as for the loaded checkpoint: the same ``.metadata``, the same
``.distcp`` bytes. Only the data differs in where it comes from: torch's ``FileSystemWriter`` asks the planner
for each tensor (``resolve_data``) as it writes it, and here that reads the tensor from the input (a ZeRO
partition's pieces, a DCP folder's chunks, a shard's byte range, a ``.pt`` storage record) into memory of its
own, and frees the one before. That holds because the writer is made to take one tensor at a time: one file, one
thread, no copy-ahead (``per_thread_copy_ahead=0`` picks torch's serial loader, which resolves each tensor only
after writing the one before, on every torch from 2.4 on, with or without a GPU). Torch 2.7 on keeps every written
tensor in a dict until the file is closed; the storage freed here is what that dict would otherwise hold.

Peak memory is then the largest tensor (twice for a half-precision ZeRO buffer cast to float32, or a DCP tensor
gathered from blocks) plus the writer's own: never the model. Every CRC of the input is checked on a thread as
the folder is written, and the folder is put in place only when they all match.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.copyable import foreign_byte_order
from ckptfix.formats.dcp.writer import save_dcp
from ckptfix.formats.files import DataFiles
from ckptfix.formats.output.crc import Check
from ckptfix.formats.output.linux import libc
from ckptfix.formats.records import is_streamable, map_tree, torch_dtype
from ckptfix.formats.safetensors.file import tree_from_header
from ckptfix.formats.safetensors.header import read_header
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import carry, describe
from ckptfix.formats.torchzip.archive import NO_CRC, stored_crc
from ckptfix.formats.torchzip.reader import TorchZip
from ckptfix.stream.casting import cast_records
from ckptfix.stream.dcp_writer import dcp_items, write_dcp_folder
from ckptfix.stream.fallback import Fallback, Reason
from ckptfix.stream.folders import VerifyInTurn, open_tree, prepare
from ckptfix.transforms.checkpoint import Conversion

# (file descriptor, offset, length) of a run of a tensor's bytes, in order
Run = tuple[int, int, int]
_TRIM = 1 << 20  # a tensor at least this large freed: the C heap trimmed


def convert_to_dcp(
    src: str,
    dst: str,
    *,
    in_fmt: str,
    transform: Callable[[Any], Conversion],
    allow_globals: tuple[str, ...] = (),
    overwrite: bool = False,
    dtype: str | None = None,
    optimizer: bool = False,
) -> Conversion:
    """Write checkpoint ``src`` (a folder, ``.pt`` or ``.safetensors``) after ``transform`` as DCP folder ``dst``,
    one tensor in memory at a time (none without ``dtype``: byte ranges copied). Raises :class:`Fallback` before
    anything is written where it does not apply (``dtype``: each floating-point tensor of the model entries read,
    then cast, one at a time, and written by torch's DCP writer)."""
    allowed = allowlist.allowed_names(allow_globals, source=src)
    tree, kind, files, z = _open(src, in_fmt=in_fmt, allow_globals=allow_globals, allowed=allowed, optimizer=optimizer)
    try:
        conversion = transform(tree)
        conversion.obj = carry(conversion.obj, out_fmt="dcp", source=src, notes=conversion.notes)  # refuses opaque
        if dtype is None:  # bytes as they are: written without torch, each tensor copied as byte ranges
            objects, copied, gathered = write_dcp_folder(
                conversion.obj, dst, files=files, z=z, source=src, allowed=allowed, overwrite=overwrite
            )
            said = f", {gathered} gathered in memory" if gathered else ""
            note = (
                f"{kind} -> dcp: {copied + gathered} tensors ({copied} copied as byte ranges{said}) and {objects} "
                "objects, without torch, CRCs checked"
            )
        else:
            note = _torch_writer(
                conversion, dst, src=src, kind=kind, files=files, z=z, allowed=allowed, dtype=dtype, overwrite=overwrite
            )
    finally:
        files.close()
    conversion.notes.extend(files.notes)
    if z is not None and not z.archive.crc_stored:
        conversion.notes.append(f"{NO_CRC} in the input")
    conversion.notes.append(note)
    return conversion


def _torch_writer(
    conversion: Conversion,
    dst: str,
    *,
    src: str,
    kind: str,
    files: DataFiles,
    z: TorchZip | None,
    allowed: frozenset[str],
    dtype: str,
    overwrite: bool,
) -> str:
    """Write the folder with torch's own writer, each tensor read (and cast to ``dtype``) when it asks for it;
    returns the note."""
    cast = cast_records(conversion, dtype)
    obj = conversion.obj
    metas, records = _meta_tree(obj, source=src)
    for record in {id(r): r for r in records.values()}.values():
        prepare(record, files, allowed=allowed)  # chunk archives parsed and their CRCs queued, before any write
    verifier = VerifyInTurn(files, files.checks)
    planner = streaming_planner(records, _Reader(src, files, z).read)

    def written() -> None:  # before the folder is put in place: a bad CRC or a changed input leaves nothing
        verifier.join()
        files.check_unchanged()

    verifier.start()
    try:
        save_dcp(metas, dst, overwrite=overwrite, planner=planner, written=written)
    finally:
        verifier.cancel()
    return (
        f"{kind} -> dcp: {planner.count} tensors, each read when torch's DCP writer asked for it, {cast} cast to "
        f"{dtype} as read"
    )


def _open(
    src: str, *, in_fmt: str, allow_globals: tuple[str, ...], allowed: frozenset[str], optimizer: bool = False
) -> tuple[Any, str, DataFiles, TorchZip | None]:
    """The checkpoint with tensor records, what it is (for the note), its open files (the caller closes them),
    and a ``.pt`` input's description."""
    if in_fmt == "folder":
        tree, kind, files, _ = open_tree(src, allow_globals=allow_globals, optimizer=optimizer)
        return tree, kind, files, None
    if in_fmt not in ("safetensors", "torch-zip"):
        raise Fallback(Reason.INPUT_FORMAT, fmt=in_fmt)
    files = DataFiles()
    try:
        fd = files.fd(src)
        if in_fmt == "safetensors":
            return tree_from_header(read_header(src), source=src), "safetensors", files, None
        z = describe(fd, src, allowed=allowed)
        if order := foreign_byte_order(z):
            raise Fallback(Reason.BYTE_ORDER, order=order)
        files.checks[src] = [Check(r.name, r.data_offset, r.size, stored_crc(r)) for r in z.archive.records]
        return z.tree, "pt", files, z
    except BaseException:
        files.close()
        raise


def _meta_tree(obj: Any, *, source: str) -> tuple[Any, dict[int, Any]]:
    """``obj`` with a ``meta`` tensor (shape, dtype, requires_grad) for each tensor record, and the record of each
    meta tensor by id. DCP flattens dicts and lists only: a tensor anywhere else would be pickled whole, which
    the torch path does with the tensor itself (Fallback, from the items DCP writes)."""
    import torch

    dcp_items(obj)
    records: dict[int, Any] = {}
    made: dict[int, Any] = {}  # one meta tensor per record: a tied tensor stays one object, as it was loaded

    def meta(record: Any) -> Any:
        if id(record) not in made:
            m = torch.empty(record.shape, dtype=torch_dtype(torch, record.dtype, source=source), device="meta")
            if record.requires_grad:  # DCP's metadata records the torch path's flag
                m.requires_grad_(True)
            made[id(record)] = m
            records[id(m)] = record
        return made[id(record)]

    return map_tree(obj, meta, leaf=is_streamable), records


class _Reader:
    """Reads one tensor record into a tensor of its own (storage torch allocated, so that it can be freed): the
    :class:`~ckptfix.formats.records.RunReader` each record reads itself through
    (:meth:`~ckptfix.formats.records.TensorRecord.read_runs`)."""

    def __init__(self, source: str, files: DataFiles, z: TorchZip | None) -> None:
        self.source, self.files, self.z = source, files, z

    def read(self, record: Any, *, key: str) -> Any:
        """The tensor of ``record`` (planned as ``key``) in memory of its own."""
        return record.read_runs(self, key=key)

    def fd(self, path: str) -> int:
        return self.files.fd(path)

    def located(self, chunk: Any) -> tuple[int, int]:
        return self.files.located[id(chunk)]

    def storage_record(self, key: str) -> Any:
        assert self.z is not None  # a .pt record comes from a .pt input
        return self.z.archive.storage(key)

    def runs(self, runs: list[Run], dtype: str, shape: tuple[int, ...], *, key: str, cast: str | None = None) -> Any:
        """The bytes of ``runs``, in order, as a tensor of ``dtype`` and ``shape`` (cast to ``cast``: a ZeRO
        half-precision buffer, as zero_to_fp32 casts)."""
        out = self._runs(runs, dtype, shape, key=key)
        if cast is None:
            return out
        import torch

        return out.to(getattr(torch, cast))

    def _runs(self, runs: list[Run], dtype: str, shape: tuple[int, ...], *, key: str) -> Any:
        import torch

        total = sum(n for _, _, n in runs)
        raw = torch.empty(total, dtype=torch.uint8)
        view = memoryview((ctypes.c_char * total).from_address(raw.data_ptr())).cast("B") if total else None
        at = 0
        for fd, offset, length in runs:
            done = 0
            while done < length:
                assert view is not None  # total > 0
                got = os.preadv(fd, [view[at + done : at + length]], offset + done)
                if got <= 0:
                    path = next((p for p, (f, _) in self.files.open.items() if f == fd), self.source)
                    raise FormatError(
                        f"{path}: ends inside tensor '{key}'; it was truncated while reading: copy it again"
                    )
                done += got
            at += length
        return raw.view(getattr(torch, dtype)).reshape(shape)


def streaming_planner(records: dict[int, Any], read: Callable[..., Any]) -> Any:
    """A ``DefaultSavePlanner`` (plan, metadata and pickled values as torch's) whose tensors are read when the writer
    asks for them: ``read(record, key=fqn)`` for the record of the meta tensor planned. The tensor read before is freed
    then (the serial loader has written it); ``count`` says how many were read."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingPlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__()
            self.held: Any = None
            self.count = 0

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)  # a value: pickled by torch as it is
            record = records[id(self.lookup_object(write_item.index))]
            self.release()
            self.held = read(record, key=write_item.index.fqn)
            self.count += 1
            return self.held

        def release(self) -> None:
            # the writer keeps (torch 2.7 on) a view of each tensor it wrote: freeing the storage frees the bytes
            if self.held is None:
                return
            storage, self.held = self.held.untyped_storage(), None
            size = storage.nbytes()
            storage.resize_(0)
            if size >= _TRIM and (trim := libc("malloc_trim")) is not None:
                # glibc raises its mmap threshold to the largest block freed, so tensors of that size come from
                # the heap after the first, and freed holes amid it stay resident: the RSS would grow by a
                # tensor per tensor. Trimming gives the free pages back (a heap walk: large tensors only).
                trim(0)

    return StreamingPlanner()


__all__ = ["convert_to_dcp", "streaming_planner"]
