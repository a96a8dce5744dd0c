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
from ckptfix.formats.dcp.reader import DcpTensor, chunk_region, rows
from ckptfix.formats.dcp.writer import save_dcp
from ckptfix.formats.deepspeed.run import ZeroTensor
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.files import DataFiles
from ckptfix.formats.output.crc import Check
from ckptfix.formats.output.linux import libc
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import is_record, map_tree, torch_dtype
from ckptfix.formats.safetensors.file import StTensor, read_header, tree_from_header
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import carry, describe
from ckptfix.formats.torchzip.archive import NO_CRC, stored_crc
from ckptfix.formats.torchzip.reader import TorchZip
from ckptfix.stream.casting import CastTensor, cast_records
from ckptfix.stream.dcp_writer import dcp_items, write_dcp_folder
from ckptfix.stream.fallback import Fallback
from ckptfix.stream.folders import VerifyInTurn, open_tree, prepare
from ckptfix.transforms.checkpoint import Conversion

_RECORDS = (CastTensor, DcpTensor, ZeroTensor, StTensor, inert.InertTensor, inert.InertParameter)
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
        raise Fallback(f"input is a {in_fmt} file")
    files = DataFiles()
    try:
        fd = files.fd(src)
        if in_fmt == "safetensors":
            return tree_from_header(read_header(src), source=src), "safetensors", files, None
        z = describe(fd, src, allowed=allowed)
        if order := foreign_byte_order(z):
            raise Fallback(f"input is {order}")
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

    dcp_items(obj, tensors=_RECORDS)
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

    return map_tree(obj, meta, leaf=_RECORDS), records


class _Reader:
    """Reads one tensor record into a tensor of its own (storage torch allocated, so that it can be freed)."""

    def __init__(self, source: str, files: DataFiles, z: TorchZip | None) -> None:
        self.source, self.files, self.z = source, files, z

    def read(self, record: Any, *, key: str) -> Any:
        """The tensor of ``record`` (planned as ``key``) in memory of its own."""
        import torch

        if isinstance(record, CastTensor):  # the source read whole, then cast: two tensors of this one held
            return self.read(record.source, key=key).to(getattr(torch, record.dtype))
        if isinstance(record, DcpTensor):
            return self._dcp(record, key=key)
        if is_record(record) and (ranges := record.byte_ranges()) is not None:  # safetensors, a ZeRO run's pieces
            runs = [(self.files.fd(path), at, n) for path, at, n in ranges]
            out = self._runs(runs, record.stored_dtype, record.shape, key=key)
            # a ZeRO half-precision buffer, cast as zero_to_fp32 casts
            return out.to(getattr(torch, record.dtype)) if record.stored_dtype != record.dtype else out
        t = inert.tensor_of(record)
        assert self.z is not None  # a .pt record comes from a .pt input
        rec = self.z.archive.storage(t.storage.key)
        item = DTYPES[t.dtype].itemsize
        n = item
        for d in t.shape:
            n *= d
        return self._runs(
            [(self.files.fd(self.source), rec.data_offset + t.offset * item, n)], t.dtype, t.shape, key=key
        )

    def _dcp(self, t: DcpTensor, *, key: str) -> Any:
        import torch

        entry, item = t.entry, DTYPES[t.entry.dtype].itemsize
        runs = [(*self.files.located[id(c)], _numel(c.sizes) * item) for c in entry.chunks]
        if all(rows(entry, c) for c in entry.chunks):  # sorted by offsets: the row ranges are the tensor in order
            return self._runs(runs, entry.dtype, entry.shape, key=key)
        full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))  # the one tensor, gathered from blocks
        for c, run in zip(entry.chunks, runs, strict=True):
            chunk_region(full, c).copy_(self._runs([run], entry.dtype, c.sizes, key=key))
        return full

    def _runs(self, runs: list[Run], dtype: str, shape: tuple[int, ...], *, key: str) -> Any:
        """The bytes of ``runs``, in order, as a tensor of ``dtype`` and ``shape``."""
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
