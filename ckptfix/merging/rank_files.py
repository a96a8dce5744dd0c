"""FSDP rank files in a merge: telling them apart, and reading them as inputs whose shards are full tensors.

A merge's inputs are per-rank DDP files (full tensors, merged by :mod:`ckptfix.merging.policy`) or the rank files
of one sharded run: FSDP2's DTensor shards, FSDP1's ShardedTensors (SHARDED_STATE_DICT) or flat parameters
(LOCAL_STATE_DICT, split by the model that was wrapped). :func:`open_inputs` says which, once. Rank files are then
opened here (:func:`open_ranks`) as :class:`Rank` inputs: every shard record reads as the full tensor, assembled
from every rank's piece (:class:`Ranks`, one tensor at a time), so the merge policy runs over them unchanged.
FSDP1 sharded optimizer state beside the shards is found, checked and left out or consolidated by
:class:`RankOptimizer`, with the pure rules of :mod:`ckptfix.merging.sharded_optim`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import AverageError, UsageError
from ckptfix.formats.copyable import Fallback, Reason, foreign_byte_order
from ckptfix.formats.fsdp.fsdp1 import check_sharded, describe_fsdp1_rank, fsdp1_records
from ckptfix.formats.fsdp.ranks import (
    DTENSOR_GLOBALS,
    SHARDED_TENSOR_GLOBALS,
    RankFilesError,
    check_pieces,
    describe_rank,
    load_ranks,
    rank_records,
)
from ckptfix.formats.opened import Opened, in_memory
from ckptfix.formats.output.atomic import PathLike
from ckptfix.formats.records import is_record
from ckptfix.formats.registry import write
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.torchfile import file_identity
from ckptfix.merging.policy import (
    Merger,
    MergeResult,
    merged_in_memory,
    rank_order_note,
    stream_merged,
)
from ckptfix.merging.sharded_optim import (
    alone_message,
    check_beside_shards,
    consolidated,
    consolidated_note,
    in_entries,
    left_out_note,
    no_optimizer_message,
    outside_entries,
    without,
)
from ckptfix.reading import open_checkpoint
from ckptfix.transforms.checkpoint import model_entries
from ckptfix.writing import Placeholder, streamed_writer

if TYPE_CHECKING:
    import torch

RANK_FILES = {
    "dtensor": "DTensor shards (an FSDP2 rank file)",
    "sharded-tensor": "ShardedTensor shards (an FSDP1 rank file)",
}


def open_inputs(
    paths: list[str],
    stack: contextlib.ExitStack,
    *,
    allow_globals: tuple[str, ...],
    unsafe: bool,
    averaging: bool,
    optimizer: bool,
) -> tuple[list[Opened], str, list[Opened | None]]:
    """Each input opened (into ``stack``) once, and the kind of rank files they all are: ``(inputs, "", [])`` for
    full checkpoints, ``([], kind, read)`` for rank files of one sharded run (``"dtensor"``, ``"sharded-tensor"``),
    ``read`` holding each one's read. The kind is the registry's
    (:func:`.registry.rank_kind`), from that one read of each pickle. Rank files mixed with full checkpoints, files
    of both kinds, averaged rank files and ``optimizer`` without FSDP1 rank files are refused here."""
    inputs: list[Opened] = []
    sharded: dict[str, str] = {}  # rank file -> what its shards are ("dtensor", "sharded-tensor")
    read: list[Opened | None] = []
    for path in paths:
        opened = stack.enter_context(
            open_checkpoint(path, allow_globals=allow_globals, unsafe=unsafe, opaque=True, ranks=True)
        )
        if opened.rank_kind:
            sharded[path] = opened.rank_kind
            read.append(opened)
        else:
            inputs.append(opened)
    first, kind = next(iter(sharded.items()), ("", ""))
    what = RANK_FILES.get(kind, "")
    if sharded and inputs:
        raise RankFilesError(
            f"{first}: holds {what} but {inputs[0].source} holds full tensors; merge every rank file of one "
            f"sharded run together, or per-rank DDP files together"
        )
    if odd := next((p for p, k in sharded.items() if k != kind), None):
        raise RankFilesError(
            f"{odd}: holds {RANK_FILES[sharded[odd]]} but {first} holds {what}; these are files of two runs"
        )
    if sharded and averaging:
        raise AverageError(
            f"{first}: holds {what}; average full checkpoints: reassemble each run's rank files with "
            f"`ckptfix merge` first, then average the results"
        )
    if optimizer and kind != "sharded-tensor":
        raise UsageError(no_optimizer_message(first or paths[0]))
    return inputs, kind, read if sharded else []


def merge_rank_files(
    paths: list[str],
    out: PathLike,
    *,
    fmt: str,
    allow_globals: tuple[str, ...],
    options: dict[str, Any],
    fsdp1: bool = False,
    optimizer: bool = False,
    model: Any = None,
    read: list[Opened | None] | None = None,
) -> MergeResult:
    """FSDP2 rank files (or FSDP1 ones: ``fsdp1``) merged as DDP files are, each shard read as its full tensor
    (a :class:`Rank` input), one tensor at a time, and written at once. FSDP2 files the streaming writer cannot
    take are reassembled in memory. FSDP1 sharded optimizer state is left out, or consolidated (``optimizer``).
    FSDP1 LOCAL_STATE_DICT flat parameters are split by ``model``: one joined flat parameter is held at a time, each
    parameter cut from it. ``read``: each file's read by :func:`open_inputs` (its pickle not read again)."""
    with contextlib.ExitStack() as stack:
        ranks, full = open_ranks(paths, stack, allow_globals=allow_globals, fsdp1=fsdp1, model=model, read=read)
        result = _merge_ranks(
            ranks,
            full,
            stack,
            out,
            fmt=fmt,
            allow_globals=allow_globals,
            options=options,
            fsdp1=fsdp1,
            optimizer=optimizer,
        )
    result.base = full.paths[0]
    if note := rank_order_note(paths, full.paths):  # the files' own ranks decide which is rank 0
        result.notes.append(note)
    return result


def _merge_ranks(
    ranks: list[Rank],
    full: Ranks,
    stack: contextlib.ExitStack,
    out: PathLike,
    *,
    fmt: str,
    allow_globals: tuple[str, ...],
    options: dict[str, Any],
    fsdp1: bool,
    optimizer: bool,
) -> MergeResult:
    paths = full.paths  # in rank order
    optim = RankOptimizer.of(ranks, paths, wanted=optimizer, model_only=options["model_only"]) if fsdp1 else None
    if optim is not None and optim.alone:
        try:
            return optim.write_alone(full, out, fmt=fmt)
        except Fallback as e:
            raise unstreamable(paths[0], e) from e
    merger = Merger(list(ranks), paths, **options)
    merger.twins_warn = False  # reassembled tensors are one object in every tree: that is no duplicate rank
    try:
        check_little_endian(ranks)
        tree = merger.assemble(merger.template)
        writer = streamed_writer(optim.output(tree) if optim else tree, out, fmt=fmt, base=ranks[0])
    except Fallback as e:
        if fsdp1:
            raise unstreamable(paths[0], e) from e
        stack.close()
        return _merged_in_memory(paths, out, fmt=fmt, allow_globals=allow_globals, options=options)
    stream_merged(merger, writer, then=optim.filler(full) if optim else None)
    result = merger.finish()
    result.reassembled = reassembled(ranks)
    return optim.report(result) if optim else result


def _merged_in_memory(
    paths: list[str], out: PathLike, *, fmt: str, allow_globals: tuple[str, ...], options: dict[str, Any]
) -> MergeResult:
    found: dict[str, str] = {}
    trees = load_ranks(paths, allow_globals=allow_globals, found=found)
    merger = Merger([in_memory(t, source=p) for t, p in zip(trees, paths, strict=True)], paths, **options)
    merger.twins_warn = False
    result = merged_in_memory(merger)
    result.reassembled = found
    if result.obj is not None:
        write(result.obj, out, fmt=fmt)
        result.obj = None
    return result


def check_optimizer(out: PathLike, *, fmt: str, model_only: bool) -> None:
    """``optimizer=True``: the optimizer state with the model, into one ``.pt`` file (a usage error otherwise)."""
    if model_only:
        raise UsageError(
            "optimizer=True and model_only=True ask for opposite things (the optimizer state, the model "
            "alone); drop one"
        )
    if fmt != "torch":
        raise UsageError(
            f"optimizer=True writes the optimizer state into one .pt file, but {os.fspath(out)} asks for "
            f"{'a .safetensors file (tensors only)' if fmt == 'safetensors' else fmt}; write a .pt, or "
            f"drop optimizer=True"
        )


def open_ranks(
    paths: list[str],
    stack: contextlib.ExitStack,
    *,
    allow_globals: tuple[str, ...],
    fsdp1: bool,
    model: Any,
    read: list[Opened | None] | None = None,
) -> tuple[list[Rank], Ranks]:
    """The rank files of one run opened (into ``stack``), their pieces checked to tile every tensor before anything
    is written, and the :class:`Ranks` that reads each full tensor from them."""

    extra = SHARDED_TENSOR_GLOBALS if fsdp1 else DTENSOR_GLOBALS
    allowed = allowlist.allowed_names(allow_globals, source=paths[0]) | extra
    ranks: list[Rank] = []
    for path, opened in zip(paths, read or [None] * len(paths), strict=True):
        ranks.append(_open_rank(path, allowed=allowed, fsdp1=fsdp1, model=model, opened=opened))
        stack.enter_context(ranks[-1])
    pieces = [{k: r.piece for k, r in rank.records.items()} for rank in ranks]
    (check_sharded if fsdp1 else check_pieces)(pieces, paths)  # before any write
    ranks = in_rank_order(ranks)
    return ranks, Ranks(ranks, [r.source for r in ranks])  # each rank's shard records read through it


def in_rank_order(ranks: list[Rank]) -> list[Rank]:
    """The rank files in the order of the ranks they record, whatever order they were given in: rank 0's is the one
    whose statistics ``--buffers rank0`` keeps and whose other entries are written. FSDP1 files record their global
    rank; an FSDP2 file its coordinate on the mesh, numbered row-major as ``init_device_mesh`` numbers the ranks.
    Files that are not ranks 0 to N-1 once each are refused."""
    recorded: dict[int, Rank] = {}
    world = 0
    for rank in ranks:
        number, world = next(iter(rank.records.values())).job_rank()
        recorded.setdefault(number, rank)
    if sorted(recorded) != list(range(world)) or len(ranks) != world:
        raise RankFilesError(
            f"{', '.join(r.source for r in ranks)}: they record rank(s) {sorted(recorded)} of a job of {world}; pass "
            f"every rank's file exactly once"
        )
    return [recorded[number] for number in range(world)]


def reassembled(ranks: list[Rank]) -> dict[str, str]:
    """Each tensor reassembled from the ranks' shards (its dotted key) and how it was sharded."""
    found = ranks[0].split or ranks[0].records  # LOCAL_STATE_DICT: the parameters cut from flat parameters
    return {r.key.replace("\0", "."): r.sharding for r in found.values()}


def check_little_endian(ranks: list[Rank]) -> None:
    if any(rank.zip is None or foreign_byte_order(rank.zip) for rank in ranks):
        raise Fallback(Reason.BIG_ENDIAN_RANK_FILE)


def unstreamable(path: str, e: Fallback) -> RankFilesError:
    # FSDP1 files are torch.save's own little-endian zips: nothing else happens in practice
    return RankFilesError(f"{path}: these FSDP1 rank files cannot be streamed ({e}); re-save them")


@dataclass
class RankOptimizer:
    """FSDP1 sharded optimizer state in rank files (ShardedTensors outside the model state dict): ``entries`` of
    the checkpoint (``[""]``: the file is the optimizer state dict alone), consolidated or left out."""

    ranks: list[Rank]
    entries: list[str]
    consolidate: bool
    model_only: bool
    placeholders: dict[str, Placeholder] = field(default_factory=dict)  # ShardedTensor key -> its full tensor

    @classmethod
    def of(cls, ranks: list[Rank], paths: list[str], *, wanted: bool, model_only: bool) -> RankOptimizer | None:
        """The sharded optimizer state of FSDP1 rank files, checked across ranks when ``wanted`` (before any
        write); None when there is none (a usage error when ``wanted``)."""

        tree = ranks[0].tree
        entries = outside_entries(tree, list(ranks[0].records), model_entries(tree))
        if not entries:
            if wanted:
                raise UsageError(no_optimizer_message(paths[0]))
            return None
        if entries == [""] and not wanted:
            raise UsageError(alone_message(paths[0]))
        if wanted:
            check_beside_shards([r.tree for r in ranks], [r.raw for r in ranks], paths, entries=entries)
        return cls(ranks, entries, consolidate=wanted, model_only=model_only)

    @property
    def alone(self) -> bool:
        return self.entries == [""]

    def output(self, tree: Any) -> Any:
        """The merged checkpoint to write: the entries consolidated (placeholders to fill) or left out."""

        if self.model_only:
            return tree  # the model alone: the entries are left out with the rest
        if not self.consolidate:
            return without(tree, self.entries)
        tree, self.placeholders = consolidated(tree, self.entries)
        return tree

    def filler(self, full: Ranks) -> Callable[[Any], None]:
        """What hands the writer each consolidated tensor, reassembled one at a time from every rank."""

        def fill(writer: Any) -> None:
            for key, placeholder in self.placeholders.items():
                writer.put(placeholder, full.full(key))

        return fill

    def write_alone(self, full: Ranks, out: PathLike, *, fmt: str) -> MergeResult:
        """Rank files holding the optimizer state alone: the consolidated optimizer state dict into ``out``."""
        check_little_endian(self.ranks)
        writer = streamed_writer(self.output(self.ranks[0].tree), out, fmt=fmt, base=self.ranks[0])
        with writer:
            self.filler(full)(writer)
        return self.report(MergeResult())

    def report(self, result: MergeResult) -> MergeResult:
        """``result`` saying what became of the entries: their note, and only what was written as reassembled."""
        records = self.ranks[0].records.values()
        written = [r for r in records if self.consolidate or not in_entries(r.key, self.entries)]
        result.reassembled = {r.key.replace("\0", "."): r.sharding for r in written}
        if self.model_only:  # left out with the other entries, as --model-only says
            return result
        result.kept_from_first = [k for k in result.kept_from_first if k not in self.entries]
        for entry in self.entries:
            count = sum(in_entries(r.key, [entry]) for r in records)
            result.notes.append((consolidated_note if self.consolidate else left_out_note)(entry, count))
        return result


@dataclass
class Rank(Opened):
    """One FSDP2 rank file, described: each DTensor a :class:`~ckptfix.formats.fsdp.ranks.DTensorRecord` whose
    value is the full tensor, assembled from every rank's piece by the ranks' :class:`Ranks`."""

    records: dict[str, Any] = field(default_factory=dict)  # NUL-joined key -> each rank piece (DTensor, ShardedTensor)
    split: dict[str, Any] = field(default_factory=dict)  # FSDP1 LOCAL_STATE_DICT: each parameter cut from a piece
    ranks: Any = None

    def tensor(self, value: Any) -> torch.Tensor:
        piece = value.rank_piece() if is_record(value) else None
        if piece is None:
            return super().tensor(value)
        return value.from_piece(self.ranks.full(piece.key))  # type: ignore[no-any-return]


def _open_rank(
    path: str, *, allowed: frozenset[str], fsdp1: bool = False, model: Any = None, opened: Opened | None = None
) -> Rank:
    """One rank file described: from ``opened`` (the merge's read of it, whose file it takes over), or read now."""
    if opened is not None and opened.fd is not None and opened.zip is not None:
        (fd, opened.fd), z, before = (opened.fd, None), opened.zip, opened.before
    else:
        fd, z = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), None
    try:
        if z is None:
            before = file_identity(fd)
            z, tree = (
                describe_fsdp1_rank(fd, path, allowed=allowed, model=model)
                if fsdp1
                else describe_rank(fd, path, allowed=allowed)
            )
        else:
            tree = fsdp1_records(z.tree, path, model=model) if fsdp1 else rank_records(z.tree, path)
    except BaseException:
        os.close(fd)
        raise
    records: dict[str, Any] = {}
    split: dict[str, Any] = {}
    stack = [tree]
    while stack:  # the DTensors sit in the (nested) dicts of the checkpoint, taken in its order (the model first)
        node = stack.pop()
        inner = []
        for value in node.values() if isinstance(node, dict) else ():
            piece = value.rank_piece() if is_record(value) else None
            if piece is not None:  # the piece (a parameter's flat parameter) is what the ranks' files must agree on
                records[piece.key] = piece
                if piece is not value:
                    split[value.key] = value
            elif isinstance(value, dict):
                inner.append(value)
        stack.extend(reversed(inner))
    return Rank(source=path, fmt="torch-zip", tree=tree, fd=fd, zip=z, before=before, records=records, split=split)


class Ranks:
    """The rank files of one run: each DTensor's full tensor, assembled once for all ranks (the last one kept, as
    the merge reads a key from every rank in turn)."""

    def __init__(self, ranks: list[Rank], paths: list[str]) -> None:
        self.ranks, self.paths = ranks, paths
        self.key: str | None = None
        self.value: Any = None
        for rank in ranks:
            rank.ranks = self

    def full(self, key: str) -> Any:

        if key != self.key:
            self.key, self.value = None, None  # the previous tensor freed before the next is built
            parts = [rank.records[key].read_local(rank.tensor) for rank in self.ranks]
            self.value = self.ranks[0].records[key].full_tensor(parts, self.paths)
            self.key = key
        return self.value
