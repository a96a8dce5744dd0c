"""Conversion at the speed of ``cp``: rename keys or drop entries without loading a single tensor.

The pickle (or safetensors header) is read inertly, the caller's transform runs on that tree, a new pickle or
header is written, and every tensor's bytes are copied in the kernel with their CRCs checked on the side.
Nothing here imports torch. Whenever the input is outside what this path handles, :class:`Fallback` is raised
before anything is written and the caller runs the torch path, which is the reference.

>>> from ckptfix.stream import fast_convert, Fallback
>>> conversion = fast_convert("ddp.pt", "plain.pt", transform=lambda tree: convert_checkpoint(tree, to="single"))
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from ckptfix.errors import OutputError
from ckptfix.formats.copyable import foreign_byte_order, hooks_or_state, math_bit_view
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.output.atomic import PathLike, atomic_output, check_output
from ckptfix.formats.output.crc import Check
from ckptfix.formats.paths import output_format
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.records import is_record, map_tree
from ckptfix.formats.registry import detect_format
from ckptfix.formats.safetensors.file import (
    losses_note,
    plan_safetensors,
    tree_from_header,
)
from ckptfix.formats.safetensors.header import read_header
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import carry, describe
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity
from ckptfix.formats.torchzip.archive import NO_CRC, stored_crc, verify_records
from ckptfix.formats.torchzip.layout import NewStorages
from ckptfix.formats.torchzip.reader import TorchZip
from ckptfix.stream.copy import Copier, Job, Progress, new_tuple
from ckptfix.stream.fallback import Fallback, Reason
from ckptfix.stream.progress import progress_bar
from ckptfix.stream.torchzip import Source, plan_new_torch, plan_torch_to_torch
from ckptfix.units import human_bytes

# Recipes the writers reproduce exactly; any other call (quantized, sparse, subclass) goes the torch way.
_WRITABLE = frozenset(
    {
        "torch.Size",
        "torch.device",
        "collections.Counter",
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.set",
        "builtins.complex",
        *allowlist.KNOWN_SAFE,
    }
)


def fast_convert(
    src: PathLike,
    dst: PathLike,
    *,
    in_fmt: str | None = None,
    out_fmt: str | None = None,
    transform: Callable[[Any], Any],
    allow_globals: tuple[str, ...] = (),
    progress: Progress | None = None,
    verify: bool = True,
) -> Any:
    """Convert ``src`` into ``dst`` by rewriting only the pickle or header; returns what ``transform`` returned.

    ``in_fmt``/``out_fmt`` are the formats when the caller already detected them (and checked the output).
    ``transform(tree)`` gets the checkpoint with inert tensor records and returns an object whose ``.obj`` is
    the tree to write (a ``ckptfix.transforms.checkpoint.Conversion``); a line on what was copied is added to its notes.
    ``verify=False`` skips reading the input for its CRCs where the output keeps them (.pt to .pt): a corrupt
    record then stays detectable in the output. A .safetensors output has no CRCs to keep, and a .pt made from
    a .safetensors needs the CRCs computed, so those still read the input.
    Raises :class:`Fallback` when the fast path does not apply, ``FormatError`` for a corrupt input,
    ``UnsafeCheckpointError`` for a dangerous pickle.
    """
    source, out = os.fspath(src), os.fspath(dst)
    if out_fmt is None:  # a caller that has not checked the output yet (convert_file has)
        out_fmt = output_format(dst)
        check_output(dst, inputs=(src,))
    in_fmt = in_fmt or detect_format(src)
    with open(source, "rb") as f, inert_trees.gc_paused():  # a million records: nothing to collect, only to rescan
        fd = f.fileno()
        before = file_identity(fd)
        inp: TorchZip | None = None
        if in_fmt == "torch-zip":
            allowed = allowlist.allowed_names(allow_globals, source=source)
            inp = describe(fd, source, allowed=allowed, plain=False)  # opaque entries kept; the tree is written back
            _check_writable(inp.tree)
            conversion = transform(inp.tree)
        elif in_fmt == "safetensors":
            conversion = transform(tree_from_header(read_header(source), source=source))
        else:
            raise Fallback(Reason.INPUT_FORMAT, fmt=in_fmt)
        tree = carry(conversion.obj, out_fmt=out_fmt, source=source, notes=conversion.notes)
        total = os.fstat(fd).st_size
        losses: list[str] = []
        with progress_bar(total, enabled=progress is None) as bar:
            report = _write(
                fd,
                inp,
                tree,
                out,
                out_fmt,
                source=source,
                progress=progress or bar,
                before=before,
                verify=verify,
                notes=losses,
            )
    kind = "pt" if inp is not None else "safetensors"
    conversion.notes += [f"{kind} -> {out_fmt}: {report}", *losses]
    return conversion


def _check_writable(tree: Any) -> None:
    for obj in inert_trees.records(tree):
        # a conj or neg bit is kept as it is in a .pt output (the .safetensors locator refuses it)
        if type(obj) is inert.InertTensor and hooks_or_state(obj):
            raise Fallback(Reason.HOOKS_OR_METADATA)
        if type(obj) is inert.Inert and obj.func.full not in _WRITABLE:
            raise Fallback(Reason.REBUILT_CALL, call=obj.func.full)


def _write(
    fd: int,
    inp: TorchZip | None,
    tree: Any,
    out: str,
    out_fmt: str,
    *,
    source: str,
    progress: Progress | None,
    before: tuple[int, ...],
    verify: bool,
    notes: list[str],
) -> str:
    """Write the output; returns what was done, in a few words (``notes`` gets what the output does not keep)."""

    def unchanged() -> None:
        # what was checked is what was copied: any write to the input since it was opened changes its ctime
        if file_identity(fd) != before:
            raise changed_while_reading(source)

    if out_fmt == "safetensors":
        locate = _PtLocator(inp) if inp is not None else _st_locate
        try:
            # a .pt input's records are not laid out like a data buffer: keep the torch path's bytes instead
            plan = plan_safetensors(tree, out=out, locate=locate, keep_offsets=inp is None)
        except OutputError:
            if inp is not None:  # a damaged input is reported before what the output cannot hold, as torch does
                verify_records(fd, source, inp.archive.records)
            raise
        checks = locate.checks() if isinstance(locate, _PtLocator) else []
        with atomic_output(out) as f:
            _pwrite_all(f.fileno(), plan.header, 0)
            jobs, at = [], len(plan.header)
            for offset, length in plan.ranges:
                jobs.append(new_tuple(Job, (offset, at, length)))
                at += length
            copier = Copier(fd, f.fileno(), source=source, progress=progress)
            copier.run(jobs, checks=checks)
            unchanged()
        if isinstance(locate, _PtLocator) and (lost := losses_note(params=locate.params, views=0, grads=locate.grads)):
            notes.append(lost)
        said = (", CRCs checked" if checks else "") + ("" if verify or not checks else " (.safetensors keeps none)")
        if inp is not None and not inp.archive.crc_stored:
            said = f", {NO_CRC}"
        return f"{len(plan.ranges)} tensors, {_moved(copier)}{said}"
    if inp is not None:
        with atomic_output(out) as f:
            zplan = plan_torch_to_torch(inp, tree, f.fileno())
            copier = Copier(fd, f.fileno(), source=source, progress=progress)
            copier.run(zplan.jobs, checks=zplan.checks if verify else ())
            unchanged()
        said = ", CRCs checked" if verify else ", CRCs not checked: the output keeps the input's CRCs"
        if not inp.archive.crc_stored:
            said = f", {NO_CRC} (the output stores none either)"
        return f"{len(zplan.jobs)} records, {_moved(copier)}{said}"
    new_tree, sources = _st_to_torch_tree(tree)
    with atomic_output(out) as f:
        zplan = plan_new_torch(new_tree, sources, f.fileno(), src_fd=fd, source=source)
        copier = Copier(fd, f.fileno(), source=source, progress=progress)
        crcs = copier.run(zplan.jobs, checks=zplan.checks)
        copier.copied += zplan.inlined
        for slot, crc in zip(zplan.crc_slots, crcs, strict=True):
            zplan.writer.set_crc(slot, crc)
        zplan.writer.finish()
        unchanged()
    return f"{len(sources)} tensors, {_moved(copier)}, CRCs computed"


def _moved(copier: Copier) -> str:
    """What the file system did: blocks shared with the input (nothing written) and bytes copied."""
    if copier.shared:
        return f"{human_bytes(copier.shared)} shared with the input, {human_bytes(copier.copied)} copied"
    return f"{human_bytes(copier.copied)} copied"


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _PtLocator:
    """Finds each tensor's bytes in the input's records; remembers which storages it was asked about."""

    def __init__(self, inp: TorchZip) -> None:
        if order := foreign_byte_order(inp):
            raise Fallback(Reason.BYTE_ORDER_TO_SAFETENSORS, order=order)
        self.inp, self.keys = inp, set[str]()
        self.params = self.grads = 0  # what a .safetensors output cannot keep (a view makes the fast path step aside)

    def __call__(self, value: Any) -> tuple[str, tuple[int, ...], int, int, Any]:
        t = getattr(value, "zip_tensor", None)  # a .pt's tensor, or the one a Parameter wraps (one call: per tensor)
        if t is None:
            raise Fallback(Reason.NOT_PLAIN_TENSOR)
        self.params += t is not value and value.is_parameter
        self.grads += value.requires_grad
        shape, stride, dtype = t.shape, t.stride, t.dtype
        if bits := math_bit_view(t):
            raise Fallback(Reason.MATH_BIT_VIEW, bits=bits)
        if not inert.contiguous(shape, stride):
            raise Fallback(Reason.NON_CONTIGUOUS)
        width = DTYPES[dtype].itemsize
        key, offset = t.storage.key, t.offset
        self.keys.add(key)
        rec = self.inp.archive.storage(key)  # present and in bounds
        return (
            dtype,
            shape,
            rec.data_offset + offset * width,
            math.prod(shape) * width,
            (key, offset, shape, stride, dtype),
        )

    def checks(self) -> list[Check]:
        """A check per storage asked about, in file order: the input is read front to back."""
        keys, data_dir = self.keys, self.inp.archive.prefix + "data/"
        n = len(data_dir)
        return [
            new_tuple(Check, (r.name, r.data_offset, r.size, stored_crc(r)))
            for r in self.inp.archive.records
            if r.name[n:] in keys and r.name.startswith(data_dir)
        ]


def _st_locate(value: Any) -> tuple[str, tuple[int, ...], int, int, Any]:
    span = value.stored_span if is_record(value) else None
    if span is None:
        raise Fallback(Reason.NOT_SAFETENSORS_TENSOR)
    return value.dtype, value.shape, *span, id(value)


def _st_to_torch_tree(tree: Any) -> tuple[Any, list[Source]]:
    """Replace a safetensors file's records by the records torch.save would write, storages numbered in pickling
    order."""
    new = NewStorages()
    out = map_tree(tree, new, exact=False)
    return out, [Source(*t.stored_span) for t in new.stored.values()]


__all__ = ["Fallback", "fast_convert"]
