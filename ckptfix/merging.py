"""Merge per-rank checkpoints of one DDP run into one checkpoint.

With buffer broadcasting off (``DistributedDataParallel(m, broadcast_buffers=False)``) and no SyncBatchNorm,
every rank keeps its own BatchNorm running statistics while the parameters stay identical (the gradient
all-reduce keeps them so). Merging checks the parameters, then combines the statistics as if the ranks'
data shards had been one batch: means averaged, variances pooled.

Files are merged key by key (:func:`merge_files`): each key is read from every rank, one tensor at a time,
compared as bytes first (|Δ| is computed only where bytes differ), combined, and written at once, so memory holds
a few copies of one tensor, not the ranks' checkpoints. Inputs may be folders (per-rank transformers or accelerate
folders). FSDP2 rank files (DTensor shards) are not averaged: their full tensors are reassembled from every rank's
shards (:func:`ckptfix.formats.folders.fsdp.load_ranks`), and what is left per rank (BatchNorm statistics) is merged as
for DDP.

``average=True`` (or ``weights``) merges checkpoints of one model from different steps or runs instead (timm's
``avg_checkpoints.py``, model soups): every floating tensor is the (weighted) mean of the files' values, accumulated
in float64 and stored in its own dtype; other tensors (``num_batches_tracked``) and every other entry come from
the last file, the newest when files are given oldest first. It streams the same way: one tensor of one file at
a time, plus the running sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix import layouts
from ckptfix.checkpoint import apply_maps, is_tensor, model_entries, same_kind
from ckptfix.diffing import same_bytes, tensor_diff
from ckptfix.errors import AverageError, MergeError, UsageError
from ckptfix.formats.folders.flatparams import FlatSliceRecord
from ckptfix.formats.folders.fsdp import DTensorRecord, RankFilesError, ShardedTensorRecord
from ckptfix.formats.output.atomic import PathLike, check_output
from ckptfix.formats.raw import as_tensor
from ckptfix.formats.registry import detect_format, output_format, read, write
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.torchio import opaque
from ckptfix.reading import Opened, in_memory, open_checkpoint, spec
from ckptfix.writing import CannotStream, Placeholder, streamed_writer

if TYPE_CHECKING:
    import torch

BUFFER_STRATEGIES: tuple[str, ...] = ("pooled", "mean", "rank0")
# one rank's part of a tensor, assembled from every rank (FlatSliceRecord: a parameter of an FSDP1 flat parameter)
_SHARD_RECORDS = (DTensorRecord, ShardedTensorRecord, FlatSliceRecord)
_MEAN, _VAR, _COUNT = "running_mean", "running_var", "num_batches_tracked"


@dataclass
class Divergence:
    """A key whose value differs across ranks beyond ``atol``."""

    key: str
    max_abs: float
    ranks: list[str]


@dataclass
class MergeResult:
    """What :func:`plan_merge` found and built; ``obj`` is None when ``diverged`` is not empty."""

    obj: Any = None
    entries: list[str] = field(default_factory=list)
    bn_modules: list[str] = field(default_factory=list)
    buffers_merged: list[str] = field(default_factory=list)
    diverged: list[Divergence] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    kept_from_first: list[str] = field(default_factory=list)
    layouts_from: list[str] = field(default_factory=list)
    reassembled: dict[str, str] = field(default_factory=dict)  # DTensor key -> how it was sharded
    left_out: list[str] = field(default_factory=list)  # entries of the first input not written (model_only)
    notes: list[str] = field(default_factory=list)
    averaged: list[str] = field(default_factory=list)  # average: the keys averaged (the rest from the last input)
    weights: list[float] = field(default_factory=list)  # average: each input's weight, normalised to sum 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "averaged": self.averaged,
            "weights": self.weights,
            "reassembled": self.reassembled,
            "left_out": self.left_out,
            "notes": self.notes,
            "entries": self.entries,
            "bn_modules": self.bn_modules,
            "buffers_merged": self.buffers_merged,
            "diverged": [{"key": d.key, "max_abs": d.max_abs, "ranks": d.ranks} for d in self.diverged],
            "warnings": self.warnings,
            "kept_from_first": self.kept_from_first,
            "layouts_from": self.layouts_from,
        }


@deep
def merge(
    states: Sequence[Any],
    *,
    buffers: str = "pooled",
    atol: float = 0.0,
    to: str = "single",
    buffer_keys: Iterable[str] = (),
    average: bool = False,
    weights: Sequence[float] | None = None,
) -> Any:
    """Merge per-rank state dicts or full checkpoints (any layout, mixed) into one, in layout ``to``.

    Parameters must agree within ``atol``; BatchNorm statistics are merged by ``buffers`` (``pooled``,
    ``mean`` or ``rank0``). Other keys named in ``buffer_keys`` (single-layout names) that differ follow
    ``buffers`` too when floating. Warnings (duplicate ranks, a lone input, differing step counts) are issued
    with :mod:`warnings`.

    ``average=True`` averages checkpoints of one model instead (``weights``, one per input, implies it; they are
    divided by their sum): floating tensors are the weighted mean (float64, stored in their dtype), the rest
    comes from the last input. Different keys, shapes or dtypes raise :class:`~ckptfix.errors.AverageError`.

    >>> merged = ckptfix.merge([torch.load(f"rank{r}.pt") for r in range(4)])
    >>> soup = ckptfix.merge([ckptfix.load(f) for f in ("step1000.pt", "step2000.pt")], weights=[0.3, 0.7])
    """
    result = plan_merge(states, buffers=buffers, atol=atol, to=to, buffer_keys=buffer_keys, average=average,
                        weights=weights)  # fmt: skip
    if result.diverged:
        first = result.diverged[0]
        raise MergeError(
            f"{len(result.diverged)} key(s) differ across ranks, e.g. '{first.key}' "
            f"(max |Δ| {first.max_abs:.3g} on {', '.join(first.ranks)}); parameters of one DDP run are "
            f"equal on every rank: check these are files of the same step, or pass a larger atol"
        )
    for message in result.warnings:
        warnings.warn(message, stacklevel=3)  # merge's caller, past the depth wrapper
    return result.obj


def plan_merge(
    objs: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    buffers: str = "pooled",
    atol: float = 0.0,
    to: str = "single",
    buffer_keys: Iterable[str] = (),
    model_only: bool = False,
    average: bool = False,
    weights: Sequence[float] | None = None,
) -> MergeResult:
    """Merge like :func:`merge`, but return divergences and warnings as data instead of raising/warning.

    ``names`` label the inputs in messages (file paths in the CLI; ``rank0``, ``rank1`` … by default).
    Raises :class:`MergeError` for inputs that cannot be merged at all (different keys, shapes, dtypes).
    ``model_only`` leaves out the first input's other entries (a lone model entry becomes the state dict itself).
    """
    keys = set(buffer_keys)
    _check_options(len(objs), buffers=buffers, to=to)
    scale = _weights(len(objs), average=average, weights=weights, buffers=buffers, atol=atol, buffer_keys=keys)
    labels = list(names) if names is not None else [f"rank{i}" for i in range(len(objs))]
    inputs = [in_memory(obj, source=label) for obj, label in zip(objs, labels, strict=True)]
    merger = _Merger(inputs, labels, buffers=buffers, atol=atol, to=to, buffer_keys=keys, model_only=model_only,
                     weights=scale)  # fmt: skip
    return _in_memory(merger)


def _in_memory(merger: _Merger) -> MergeResult:
    collected: dict[tuple[int, str], Any] = {}
    merger.run(lambda entry, key, value: collected.__setitem__((entry, key), value))
    if not merger.result.diverged:
        merger.result.obj = merger.assemble(lambda entry, key, value: collected[entry, key])
    return merger.finish()


@deep
def merge_files(
    paths: Sequence[PathLike],
    out: PathLike,
    *,
    buffers: str = "pooled",
    atol: float = 0.0,
    to: str = "single",
    buffer_keys: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
    model_only: bool = False,
    overwrite: bool = False,
    average: bool = False,
    weights: Sequence[float] | None = None,
    optimizer: bool = False,
    model: Any = None,
) -> MergeResult:
    """Merge per-rank files (or folders) into ``out`` key by key; nothing is written when parameters diverge.

    Each key is read from every file (one tensor at a time, CRC-checked), compared as bytes first, combined and
    written at once: memory stays at a few copies of the largest tensor whatever the files' size. The result's
    ``obj`` is None (the merged checkpoint is in ``out``); ``diverged`` and ``warnings`` are as :func:`plan_merge`
    gives them.

    FSDP2 rank files (each rank's ``torch.save(model.state_dict())``, DTensor shards) are reassembled into full
    tensors (``reassembled`` says which, and how they were sharded), never averaged; every rank's file must be
    there. The other entries come from the first input; one that was not loaded (it needs globals outside the
    allowlist, see :mod:`ckptfix.formats.torchio.opaque`) is copied as its pickle records into a ``.pt`` output (said in
    ``notes``), refused if it can run code or the output is ``.safetensors``; ``model_only`` leaves all of them out.
    FSDP1 LOCAL_STATE_DICT rank files (flat parameters) need ``model``, the model that was wrapped (unwrapped, on
    any device): it says which parameters each flat parameter joins, and the merge writes FULL_STATE_DICT's keys.

    FSDP1 SHARDED_STATE_DICT rank files holding the sharded optimizer state too (``FSDP.optim_state_dict``) leave
    it out, said in ``notes``; ``optimizer=True`` (a ``.pt`` output only) consolidates it instead: each ShardedTensor
    reassembled as the model's are, ``step`` and ``param_groups`` checked equal on every rank and written once,
    keyed by parameter name as ``FSDP.optim_state_dict`` gives it under FULL_STATE_DICT. Rank files holding the
    optimizer state alone merge only with ``optimizer=True``.

    ``average=True`` (or ``weights``) averages checkpoints of one model as :func:`merge` does, streamed the same
    way (one tensor of one file at a time, and the float64 sum); the other entries come from the last file.

    >>> result = ckptfix.merging.merge_files(["rank0.pt", "rank1.pt"], "merged.pt")
    >>> result = ckptfix.merging.merge_files(["step1000.pt", "step2000.pt"], "soup.pt", weights=[0.3, 0.7])
    """
    from ckptfix.formats.folders.fsdp import ShardedCheckpointError, refuse_flat_params

    to = _check_options(len(paths), buffers=buffers, to=to)
    keys = set(buffer_keys)
    scale = _weights(len(paths), average=average, weights=weights, buffers=buffers, atol=atol, buffer_keys=keys)
    fmt = output_format(out)
    if optimizer:
        _check_optimizer(out, fmt=fmt, model_only=model_only)
    check_output(out, inputs=tuple(paths), overwrite=overwrite)
    labels = [os.fspath(p) for p in paths]
    allowed = tuple(allow_globals)
    options: dict[str, Any] = {"buffers": buffers, "atol": atol, "to": to, "buffer_keys": keys,
                               "model_only": model_only, "weights": scale}  # fmt: skip
    with contextlib.ExitStack() as stack:
        inputs: list[Opened] = []
        sharded: dict[str, str] = {}  # rank file -> what its shards are ("dtensor", "sharded-tensor")
        for path in labels:
            try:
                inputs.append(stack.enter_context(open_checkpoint(path, allow_globals=allowed, unsafe=unsafe,
                                                                  opaque=True)))  # fmt: skip
            except ShardedCheckpointError as e:
                if e.kind not in _RANK_FILES:
                    raise
                sharded[path] = e.kind
        first, kind = next(iter(sharded.items()), ("", ""))
        what = _RANK_FILES.get(kind, "")
        if sharded and inputs:
            raise RankFilesError(
                f"{first}: holds {what} but {inputs[0].source} holds full tensors; merge every rank file of one "
                f"sharded run together, or per-rank DDP files together"
            )
        if odd := next((p for p, k in sharded.items() if k != kind), None):
            raise RankFilesError(
                f"{odd}: holds {_RANK_FILES[sharded[odd]]} but {first} holds {what}; these are files of two runs"
            )
        if sharded and scale is not None:
            raise AverageError(
                f"{first}: holds {what}; average full checkpoints: reassemble each run's rank files with "
                f"`ckptfix merge` first, then average the results"
            )
        if optimizer and kind != "sharded-tensor":
            from ckptfix.sharded_optim import no_optimizer_message

            raise UsageError(no_optimizer_message(first or labels[0]))
        if sharded:
            stack.close()
            return _merge_dtensor(labels, out, fmt=fmt, allow_globals=allowed, options=options, fsdp1=kind != "dtensor",
                                  optimizer=optimizer, model=model)  # fmt: skip
        for opened in inputs:
            refuse_flat_params(opened.tree, source=opened.source)  # FSDP1: slices that cannot be merged here
            opaque.require(opened.tree, wanted=None, source=opened.source)
        merger = _Merger(inputs, labels, **options)
        try:
            tree = merger.assemble(merger.template)
            # the input the other entries come from: the first, or the last when averaging
            tree = opaque.carry(tree, out_fmt=fmt, source=merger.labels[0], notes=merger.result.notes)
            writer = streamed_writer(tree, out, fmt=fmt, base=merger.inputs[0])
        except CannotStream:  # real tensors, records of folders, entries only ckptfix.save writes: in memory
            loaded = [_loaded(i, allow_globals=allowed, unsafe=unsafe, model_only=model_only) for i in inputs]
            left_out = merger.finish().left_out  # what the description holds beyond the model (the load has less)
            result = _in_memory(_Merger(loaded, labels, **options))
            if not result.diverged:
                result.left_out = left_out
            if result.obj is not None:
                opaque.refuse_left(result.obj, source=merger.labels[0])  # torch writes only values it built
                write(result.obj, out, fmt=fmt)
                result.obj = None
            return result
        _stream_merged(merger, writer)
    return merger.finish()


def _stream_merged(merger: _Merger, writer: Any, *, then: Callable[[Any], None] | None = None) -> None:
    """Run the merge into ``writer``, tensor by tensor, then ``then(writer)`` (tensors outside the model); a merge
    that diverged writes nothing (the temp file goes)."""
    with contextlib.suppress(_Diverged), writer:

        def put(entry: int, key: str, value: Any) -> None:
            template = merger.entries[entry].template[key]
            if is_tensor(template):
                writer.put(template, value)

        merger.run(put)
        if merger.result.diverged:
            raise _Diverged  # the temp file is removed, as for any error: nothing is written
        if then is not None:
            then(writer)


def _loaded(opened: Opened, *, allow_globals: tuple[str, ...], unsafe: bool, model_only: bool) -> Opened:
    """An input loaded with torch (mmap), for the in-memory merge: a description's records are not values.
    ``model_only`` leaves a folder's training-state files unread."""
    if not opened.described:
        return opened
    obj = read(opened.source, fmt=detect_format(opened.source), allow_globals=allow_globals, unsafe=unsafe,
               model_only=model_only, opaque=True)  # fmt: skip
    return in_memory(obj, source=opened.source)


_RANK_FILES = {"dtensor": "DTensor shards (an FSDP2 rank file)",
               "sharded-tensor": "ShardedTensor shards (an FSDP1 rank file)"}  # fmt: skip


def _merge_dtensor(
    paths: list[str],
    out: PathLike,
    *,
    fmt: str,
    allow_globals: tuple[str, ...],
    options: dict[str, Any],
    fsdp1: bool = False,
    optimizer: bool = False,
    model: Any = None,
) -> MergeResult:
    """FSDP2 rank files (or FSDP1 SHARDED_STATE_DICT ones: ``fsdp1``): full tensors reassembled from every rank's
    shards, one tensor at a time, and written at once; the rest merged as for DDP. FSDP2 files the streaming
    writer cannot take are reassembled in memory. FSDP1 sharded optimizer state is left out, or consolidated
    (``optimizer``). FSDP1 LOCAL_STATE_DICT flat parameters are split by ``model``: one joined flat parameter is
    held at a time, each parameter cut from it."""
    from ckptfix.formats.folders.fsdp import DTENSOR_GLOBALS, SHARDED_TENSOR_GLOBALS, check_pieces
    from ckptfix.formats.folders.fsdp1 import check_sharded
    from ckptfix.formats.safety import allowlist

    extra = SHARDED_TENSOR_GLOBALS if fsdp1 else DTENSOR_GLOBALS
    allowed = allowlist.allowed_names(allow_globals, source=paths[0]) | extra
    with contextlib.ExitStack() as stack:
        ranks: list[_Rank] = []
        for path in paths:
            ranks.append(_open_rank(path, allowed=allowed, fsdp1=fsdp1, model=model))
            stack.enter_context(ranks[-1])
        pieces = [{k: r.piece for k, r in rank.records.items()} for rank in ranks]
        (check_sharded if fsdp1 else check_pieces)(pieces, paths)  # before any write
        full = _Ranks(ranks, paths)  # each rank's DTensor records read through it
        optim = _Optimizer.of(ranks, paths, wanted=optimizer, model_only=options["model_only"]) if fsdp1 else None
        if optim is not None and optim.alone:
            try:
                return optim.write_alone(full, out, fmt=fmt)
            except CannotStream as e:
                raise _unstreamable(paths[0], e) from e
        merger = _Merger(list(ranks), paths, **options)
        merger.twins_warn = False  # reassembled tensors are one object in every tree: that is no duplicate rank
        try:
            _check_little_endian(ranks)
            tree = merger.assemble(merger.template)
            writer = streamed_writer(optim.output(tree) if optim else tree, out, fmt=fmt, base=ranks[0])
        except CannotStream as e:
            if fsdp1:
                raise _unstreamable(paths[0], e) from e
            stack.close()
            return _merge_dtensor_in_memory(paths, out, fmt=fmt, allow_globals=allow_globals, options=options)
        _stream_merged(merger, writer, then=optim.filler(full) if optim else None)
    result = merger.finish()
    found = ranks[0].split or ranks[0].records  # LOCAL_STATE_DICT: the parameters cut from flat parameters
    result.reassembled = {r.key.replace("\0", "."): r.sharding for r in found.values()}
    return optim.report(result) if optim else result


def _check_little_endian(ranks: list[_Rank]) -> None:
    if any(rank.zip is None or rank.zip.byteorder != "little" for rank in ranks):
        raise CannotStream("a big-endian rank file, whose bytes torch swaps")


def _unstreamable(path: str, e: CannotStream) -> RankFilesError:
    # FSDP1 files are torch.save's own little-endian zips: nothing else happens in practice
    return RankFilesError(f"{path}: these FSDP1 rank files cannot be streamed ({e}); re-save them")


@dataclass
class _Optimizer:
    """FSDP1 sharded optimizer state in rank files (ShardedTensors outside the model state dict): ``entries`` of
    the checkpoint (``[""]``: the file is the optimizer state dict alone), consolidated or left out."""

    ranks: list[_Rank]
    entries: list[str]
    consolidate: bool
    model_only: bool
    placeholders: dict[str, Placeholder] = field(default_factory=dict)  # ShardedTensor key -> its full tensor

    @classmethod
    def of(cls, ranks: list[_Rank], paths: list[str], *, wanted: bool, model_only: bool) -> _Optimizer | None:
        """The sharded optimizer state of FSDP1 rank files, checked across ranks when ``wanted`` (before any
        write); None when there is none (a usage error when ``wanted``)."""
        from ckptfix.sharded_optim import alone_message, check_beside_shards, no_optimizer_message, outside_entries

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
        from ckptfix.sharded_optim import consolidated, without

        if self.model_only:
            return tree  # the model alone: the entries are left out with the rest
        if not self.consolidate:
            return without(tree, self.entries)
        tree, self.placeholders = consolidated(tree, self.entries)
        return tree

    def filler(self, full: _Ranks) -> Callable[[Any], None]:
        """What hands the writer each consolidated tensor, reassembled one at a time from every rank."""

        def fill(writer: Any) -> None:
            for key, placeholder in self.placeholders.items():
                writer.put(placeholder, full.full(key))

        return fill

    def write_alone(self, full: _Ranks, out: PathLike, *, fmt: str) -> MergeResult:
        """Rank files holding the optimizer state alone: the consolidated optimizer state dict into ``out``."""
        _check_little_endian(self.ranks)
        writer = streamed_writer(self.output(self.ranks[0].tree), out, fmt=fmt, base=self.ranks[0])
        with writer:
            self.filler(full)(writer)
        return self.report(MergeResult())

    def report(self, result: MergeResult) -> MergeResult:
        """``result`` saying what became of the entries: their note, and only what was written as reassembled."""
        from ckptfix.sharded_optim import consolidated_note, in_entries, left_out_note

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


def _merge_dtensor_in_memory(
    paths: list[str], out: PathLike, *, fmt: str, allow_globals: tuple[str, ...], options: dict[str, Any]
) -> MergeResult:
    from ckptfix.formats.folders.fsdp import load_ranks

    found: dict[str, str] = {}
    trees = load_ranks(paths, allow_globals=allow_globals, found=found)
    merger = _Merger([in_memory(t, source=p) for t, p in zip(trees, paths, strict=True)], paths, **options)
    merger.twins_warn = False
    result = _in_memory(merger)
    result.reassembled = found
    if result.obj is not None:
        write(result.obj, out, fmt=fmt)
        result.obj = None
    return result


@dataclass
class _Rank(Opened):
    """One FSDP2 rank file, described: each DTensor a :class:`~ckptfix.formats.folders.fsdp.DTensorRecord` whose value
    is the full tensor, assembled from every rank's piece by the ranks' :class:`_Ranks`."""

    records: dict[str, Any] = field(default_factory=dict)  # NUL-joined key -> DTensorRecord / ShardedTensorRecord
    split: dict[str, FlatSliceRecord] = field(default_factory=dict)  # FSDP1 LOCAL_STATE_DICT: each parameter
    ranks: Any = None

    def tensor(self, value: Any) -> torch.Tensor:
        if isinstance(value, FlatSliceRecord):  # a copy: the joined flat parameter is freed when the next is built
            flat = self.ranks.full(value.flat.key)
            return flat.narrow(0, value.offset, math.prod(value.shape)).view(value.shape).clone()  # type: ignore[no-any-return]
        if isinstance(value, _SHARD_RECORDS):
            return self.ranks.full(value.key)  # type: ignore[no-any-return]
        return super().tensor(value)


def _open_rank(path: str, *, allowed: frozenset[str], fsdp1: bool = False, model: Any = None) -> _Rank:
    from ckptfix.formats.folders.fsdp import describe_rank
    from ckptfix.formats.folders.fsdp1 import describe_fsdp1_rank
    from ckptfix.formats.torchio.torchfile import file_identity

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = file_identity(fd)
        if fsdp1:
            z, tree = describe_fsdp1_rank(fd, path, allowed=allowed, model=model)
        else:
            z, tree = describe_rank(fd, path, allowed=allowed)
    except BaseException:
        os.close(fd)
        raise
    records: dict[str, Any] = {}
    split: dict[str, FlatSliceRecord] = {}
    stack = [tree]
    while stack:  # the DTensors sit in the (nested) dicts of the checkpoint, taken in its order (the model first)
        node = stack.pop()
        inner = []
        for value in node.values() if isinstance(node, dict) else ():
            if isinstance(value, FlatSliceRecord):  # its flat parameter is what the ranks' files must agree on
                records[value.flat.key], split[value.key] = value.flat, value
            elif isinstance(value, _SHARD_RECORDS):
                records[value.key] = value
            elif isinstance(value, dict):
                inner.append(value)
        stack.extend(reversed(inner))
    return _Rank(source=path, fmt="torch-zip", tree=tree, fd=fd, zip=z, before=before, records=records, split=split)


class _Ranks:
    """The rank files of one run: each DTensor's full tensor, assembled once for all ranks (the last one kept, as
    the merge reads a key from every rank in turn)."""

    def __init__(self, ranks: list[_Rank], paths: list[str]) -> None:
        self.ranks, self.paths = ranks, paths
        self.key: str | None = None
        self.value: Any = None
        for rank in ranks:
            rank.ranks = self

    def full(self, key: str) -> Any:
        from ckptfix.formats.folders.fsdp import assemble
        from ckptfix.formats.folders.fsdp1 import assemble_sharded

        if key != self.key:
            self.key, self.value = None, None  # the previous tensor freed before the next is built
            parts = []
            for rank in self.ranks:
                piece = rank.records[key].piece
                if isinstance(rank.records[key], ShardedTensorRecord):  # FSDP1: any number of shards per rank
                    local = tuple((o, s, rank.tensor(t)) for o, s, t in piece.local)
                    parts.append(dataclasses.replace(piece, local=local))
                else:
                    parts.append(dataclasses.replace(piece, local=rank.tensor(piece.local)))
            first = self.ranks[0].records[key]
            build = assemble_sharded if isinstance(first, ShardedTensorRecord) else assemble
            self.value = build(parts, self.paths, key=key)
            self.key = key
        return self.value


class _Diverged(Exception):  # noqa: N818 - a signal, not an error
    """Raised inside the output's block so that nothing is written."""


def _check_optimizer(out: PathLike, *, fmt: str, model_only: bool) -> None:
    """``optimizer=True``: the optimizer state with the model, into one ``.pt`` file (a usage error otherwise)."""
    if model_only:
        raise UsageError("optimizer=True and model_only=True ask for opposite things (the optimizer state, the model "
                         "alone); drop one")  # fmt: skip
    if fmt != "torch":
        raise UsageError(f"optimizer=True writes the optimizer state into one .pt file, but {os.fspath(out)} asks for "
                         f"{'a .safetensors file (tensors only)' if fmt == 'safetensors' else fmt}; write a .pt, or "
                         f"drop optimizer=True")  # fmt: skip


def _check_options(count: int, *, buffers: str, to: str) -> str:
    if buffers not in BUFFER_STRATEGIES:
        raise UsageError(f"buffers={buffers!r}: unknown buffer strategy; choose one of {', '.join(BUFFER_STRATEGIES)}")
    layout = layouts.parse_layout(to)  # a UsageError (exit 2) names the layouts; DDP is ddp
    if not count:
        raise UsageError("no inputs to merge; give one checkpoint per rank")
    return str(layout)


def _weights(
    count: int,
    *,
    average: bool,
    weights: Sequence[float] | None,
    buffers: str,
    atol: float,
    buffer_keys: set[str],
) -> list[float] | None:
    """Each input's weight when averaging (``weights`` implies it; 1.0 each without), None when merging ranks. The
    mean divides by their sum: ``3,7`` means ``0.3,0.7``, and a plain average is sum/N exactly as timm computes it.
    A negative weight is allowed (extrapolation) as long as the sum is positive: a sum of zero or less has no mean."""
    if weights is None and not average:
        return None
    if buffers != "pooled" or atol != 0.0 or buffer_keys:
        option = "buffers" if buffers != "pooled" else "atol" if atol != 0.0 else "buffer_keys"
        raise AverageError(
            f"{option} applies to merging ranks, not to averaging (every floating tensor is averaged, other tensors "
            f"come from the last input); leave it out"
        )
    if weights is None:
        return [1.0] * count
    given = [float(w) for w in weights]
    if len(given) != count:
        raise AverageError(f"weights: {len(given)} weight(s) for {count} input(s); give one weight per input, in order")
    if bad := [w for w in given if not math.isfinite(w)]:
        raise AverageError(f"weights: {bad[0]} is not a finite number; give one finite weight per input")
    total = math.fsum(given)
    if not total > 0.0:
        raise AverageError(f"weights: they sum to {total:g}; their sum must be positive (they are divided by it)")
    return given


def _entry_pairs(objs: Sequence[Any], labels: Sequence[str]) -> dict[str, list[Mapping[str, Any]]]:
    """Each model entry of the first input, from every input (a bare state dict matches a lone entry)."""
    found = [model_entries(obj) for obj in objs]
    for label, names in zip(labels, found, strict=True):
        if not names:
            raise MergeError(f"{label}: holds no model state dict (a mapping of names to tensors); nothing to merge")
    pairs: dict[str, list[Mapping[str, Any]]] = {}
    for entry in found[0]:
        column = []
        for obj, label, names in zip(objs, labels, found, strict=True):
            if entry in names:
                column.append(obj if entry == "" else obj[entry])
            elif len(found[0]) == 1 and len(names) == 1:
                column.append(obj if names[0] == "" else obj[names[0]])
            else:
                raise MergeError(
                    f"{label}: has model entries {names} but {labels[0]} has {found[0]}; merge files of the same kind"
                )
        pairs[entry] = column
    return pairs


def _bn_prefixes(keys: Iterable[str]) -> list[str]:
    present = set(keys)
    return [k[: -len(_MEAN)] for k in present if k.endswith(_MEAN) and k[: -len(_MEAN)] + _VAR in present]


def _floating(value: Any) -> bool:
    return is_tensor(value) and spec(value).dtype.startswith(("float", "bfloat"))


def _averaged(value: Any) -> bool:
    """Whether averaging computes ``value``'s mean: floating and complex tensors."""
    return is_tensor(value) and spec(value).dtype.startswith(("float", "bfloat", "complex"))


@dataclass
class _Entry:
    """One model entry to merge: each rank's state in the single layout, and what the output looks like."""

    name: str
    where: list[str]
    states: list[dict[str, Any]]  # each keeps its input's kind (dict or OrderedDict)
    maps: list[layouts.KeyMap]
    prefixes: list[str]
    stats: set[str]
    template: OrderedDict[str, Any]  # single-layout key -> the rank-0 value kept, or a Placeholder to compute


class _Merger:
    """The merge of opened inputs, key by key; ``result`` fills in as :meth:`run` goes."""

    def __init__(
        self,
        inputs: list[Opened],
        labels: list[str],
        *,
        buffers: str,
        atol: float,
        to: str,
        buffer_keys: set[str],
        model_only: bool = False,
        weights: list[float] | None = None,
    ) -> None:
        # averaging: the inputs last first, so that the last one is the base every "first input" rule reads (the
        # template, integer buffers, the other entries); ``weights`` follow them, the sum still runs in file order
        self.weights = weights[::-1] if weights is not None else None
        self.weight_sum = math.fsum(weights) if weights is not None else 1.0
        if weights is not None:
            inputs, labels = inputs[::-1], labels[::-1]
        self.inputs, self.labels, self.buffers, self.atol, self.buffer_keys = inputs, labels, buffers, atol, buffer_keys
        self.model_only = model_only
        self.twins_warn = weights is None  # a checkpoint given twice is simply weighted twice
        self.result = MergeResult(weights=[w / self.weight_sum for w in weights or []])
        if len(inputs) == 1:
            self.result.warnings.append(
                f"only one input ({labels[0]}): nothing to merge, the output is a converted copy"
            )
        from ckptfix.formats.folders.deepspeed import CONVERT_THE_RUN, refuse_optimizer_partition, refuse_placeholders

        for opened in inputs:  # lone ZeRO rank files: [0] placeholders, flat slices; the run's folder is the whole
            refuse_placeholders(opened.tree, source=opened.source, instead=CONVERT_THE_RUN)
            refuse_optimizer_partition(opened.tree, source=opened.source)
        pairs = _entry_pairs([i.tree for i in inputs], labels)
        self.result.entries = list(pairs)
        self.entries = [self._entry(name, states, to=to) for name, states in pairs.items()]

    def _entry(self, name: str, states: list[Mapping[str, Any]], *, to: str) -> _Entry:
        where = [f"{label}[{name!r}]" if name else label for label in self.labels]
        singles = []
        for state, label in zip(states, where, strict=True):
            found, maps = layouts.conversion_maps(list(state.keys()), to="single", source=label)
            self.result.layouts_from.append(found.name)
            singles.append(apply_maps(state, maps, source=label))
        _check_same_structure(singles, where, average=self.weights is not None)
        first = singles[0]
        prefixes: list[str] = []
        stats: set[str] = set()
        if self.weights is not None:  # every floating tensor computed: the weighted mean
            computed = {k for k, v in first.items() if _averaged(v)}
            if fp8 := [k for k in computed if spec(first[k]).dtype.startswith("float8")]:
                # a float8 value means something only with its scale, stored under another key: a mean of the
                # raw values of checkpoints with different scales would be wrong, and silently so
                raise AverageError(
                    f"{where[0]}: '{fp8[0]}' is torch.{spec(first[fp8[0]]).dtype}, whose values need their scales; "
                    f"average the checkpoints before quantising, or dequantise them first"
                )
        else:
            prefixes = sorted(_bn_prefixes(first.keys()))
            for prefix in prefixes:
                if not (_floating(first[prefix + _MEAN]) and _floating(first[prefix + _VAR])):
                    raise MergeError(f"{where[0]}: '{prefix}{_MEAN}' is not floating point; cannot merge statistics")
            stats = {p + s for p in prefixes for s in (_MEAN, _VAR, _COUNT)}
            computed = stats | {k for k in self.buffer_keys if k in first and _floating(first[k])}
        computed |= {k for k, v in first.items() if isinstance(v, _SHARD_RECORDS)}  # assembled from every rank
        template: OrderedDict[str, Any] = OrderedDict(
            (k, Placeholder(*_spec_args(v)) if k in computed and is_tensor(v) else v) for k, v in first.items()
        )
        _, maps = layouts.conversion_maps(list(first.keys()), to=to, source=where[0])
        return _Entry(name, where, singles, maps, prefixes, stats, template)

    def template(self, entry: int, key: str, value: Any) -> Any:
        return self.entries[entry].template[key]

    def assemble(self, value_of: Callable[[int, str, Any], Any]) -> Any:
        """The merged checkpoint, each model value given by ``value_of(entry index, key, rank-0 value)``."""
        merged: dict[str, Any] = {}
        for index, e in enumerate(self.entries):
            first = e.states[0]
            state = same_kind(first, ((k, value_of(index, k, v)) for k, v in first.items()))
            metadata = getattr(first, "_metadata", None)
            if metadata is not None:
                state._metadata = metadata  # type: ignore[attr-defined]
            merged[e.name] = apply_maps(state, e.maps, source=e.where[0])
        if list(merged) == [""]:
            return merged[""]
        if self.model_only:  # as convert --model-only: a lone model entry is the state dict itself
            return next(iter(merged.values())) if len(merged) == 1 else merged
        obj = self.inputs[0].tree
        out = type(obj)() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = merged.get(key, value)
        return out

    def finish(self) -> MergeResult:
        """The result, with the entries taken from the first input once the merge is known to be written."""
        obj = self.inputs[0].tree
        if not self.result.diverged and [e.name for e in self.entries] != [""]:
            names = {e.name for e in self.entries}
            rest = [str(k) for k in obj if k not in names]
            if self.model_only:
                self.result.left_out = rest
            else:
                self.result.kept_from_first = rest
        return self.result

    def run(self, put: Callable[[int, str, Any], None]) -> None:
        """Merge every key of every model entry, in order, handing each result to ``put(entry, key, tensor)``."""
        for index, e in enumerate(self.entries):
            self._run_entry(index, e, put)

    def _read(self, e: _Entry, rank: int, key: str) -> Any:
        value = e.states[rank][key]
        return self.inputs[rank].raw(value) if is_tensor(value) else value  # bytes, unless torch must read it

    def _run_entry(self, index: int, e: _Entry, put: Callable[[int, str, Any], None]) -> None:
        if self.weights is not None:
            for key, value in e.states[0].items():
                if _averaged(value):
                    put(index, key, self._weighted_mean(e, key, self.weights, total=self.weight_sum))
                    self.result.averaged.append(key)
                else:  # integer and bool tensors (num_batches_tracked), and non-tensors: the last input's
                    put(index, key, self._read(e, 0, key))
            return
        ranks = range(len(e.states))
        # pairs of ranks identical so far: the same file twice, or buffers that were synced after all
        twins = {(i, j) for j in ranks for i in range(j)}
        stats: dict[str, Any] = {}
        counts_differ: list[tuple[str, list[int]]] = []
        for key in e.states[0]:
            if key in e.stats:
                column = [self._read(e, r, key) for r in ranks]
                self._twins(e, key, twins, {r: column[r] for r in ranks})
                value = self._stat(e, key, column, stats, counts_differ)
            else:
                value = self._parameter(e, key, twins)
            put(index, key, value)
        if counts_differ:
            example, values = counts_differ[0]
            self.result.warnings.append(
                f"num_batches_tracked differs across ranks for {len(counts_differ)} module(s), e.g. '{example}' "
                f"{values}: kept the maximum"
            )
        self.result.bn_modules.extend(p[:-1] if p else "(root)" for p in e.prefixes)
        for j in ranks if self.twins_warn else ():
            i = next((i for i in range(j) if (i, j) in twins), None)
            if i is not None:
                self.result.warnings.append(
                    f"{self.labels[j]} is identical to {self.labels[i]} (the same file twice, or buffers were synced); "
                    f"it adds nothing to the merge"
                )

    def _twins(self, e: _Entry, key: str, twins: set[tuple[int, int]], held: dict[int, Any]) -> None:
        """Keep only the pairs of ranks whose values for ``key`` are the same bytes."""
        for i, j in sorted(twins):
            x = held[i] if i in held else self._read(e, i, key)
            y = held[j] if j in held else self._read(e, j, key)
            if not _same(x, y):
                twins.discard((i, j))

    def _parameter(self, e: _Entry, key: str, twins: set[tuple[int, int]]) -> Any:
        first = self._read(e, 0, key)
        bad: list[str] = []
        worst = 0.0
        equal = {0: True}
        for rank in range(1, len(e.states)):
            other = self._read(e, rank, key)
            equal[rank] = _same(other, first)
            if equal[rank]:
                continue
            found = tensor_diff(other, first, atol=self.atol, rtol=0.0) if is_tensor(first) else (float("inf"), 0.0)
            if found is not None:
                bad.append(self.labels[rank])
                worst = max(worst, found[0])
        # twins: rank 0 settles most pairs without another read
        for i, j in sorted(twins):
            if equal[i] != equal[j] or (not equal[i] and not _same(self._read(e, i, key), self._read(e, j, key))):
                twins.discard((i, j))
        if not bad:
            return first  # bit-identical to rank 0, as the issue promises for parameters
        if key in self.buffer_keys and _floating(first):
            self.result.buffers_merged.append(key)
            return first if self.buffers == "rank0" else self._mean(e, key).to(as_tensor(first).dtype)
        self.result.diverged.append(Divergence(key, worst, bad))
        return first

    def _weighted_mean(self, e: _Entry, key: str, weights: list[float], *, total: float) -> torch.Tensor:
        """sum(w_i * x_i) / sum(w_i) over the inputs in file order, in float64 (complex128), stored in the key's
        dtype. One input's tensor is read at a time and dropped before the next: memory holds it and the sum."""
        import torch

        found = spec(e.states[0][key])
        wide = torch.complex128 if found.dtype.startswith("complex") else torch.float64
        acc = torch.zeros(found.shape, dtype=wide)
        for rank in reversed(range(len(e.states))):  # the inputs are held last first
            acc += as_tensor(self._read(e, rank, key)).to(wide) * weights[rank]
        return (acc / total).to(getattr(torch, found.dtype))

    def _mean(self, e: _Entry, key: str) -> torch.Tensor:
        import torch

        total: torch.Tensor = as_tensor(self._read(e, 0, key)).to(torch.float64)
        for rank in range(1, len(e.states)):
            total = total + as_tensor(self._read(e, rank, key)).to(torch.float64)
        return total / len(e.states)

    def _stat(
        self,
        e: _Entry,
        key: str,
        column: list[Any],
        stats: dict[str, Any],
        counts_differ: list[tuple[str, list[int]]],
    ) -> Any:
        if key.endswith(_COUNT):
            if all(_same(v, column[0]) for v in column[1:]):
                return column[0]
            import torch

            column = [as_tensor(v) for v in column]
            counts_differ.append((key, [int(v.item()) for v in column]))
            return torch.stack(column).max(dim=0).values
        if key not in stats:
            prefix = key[: -len(_MEAN)] if key.endswith(_MEAN) else key[: -len(_VAR)]
            means = [self._read(e, r, prefix + _MEAN) for r in range(len(e.states))]
            variances = [self._read(e, r, prefix + _VAR) for r in range(len(e.states))]
            stats[prefix + _MEAN], stats[prefix + _VAR] = _merge_stats(means, variances, buffers=self.buffers)
        return stats.pop(key)


def _same(x: Any, y: Any) -> bool:
    if is_tensor(x) and is_tensor(y):
        return same_bytes(x, y)
    try:
        return bool(type(x) is type(y) and x == y)
    except Exception:  # a value whose == raises or is ambiguous: not the same
        return False


def _spec_args(value: Any) -> tuple[str, tuple[int, ...]]:
    found = spec(value)
    return found.dtype, found.shape


def _check_same_structure(states: list[dict[str, Any]], where: list[str], *, average: bool = False) -> None:
    first = states[0]
    error = AverageError if average else MergeError
    same = "checkpoints of one model" if average else "per-rank files of one run"
    for state, label in zip(states[1:], where[1:], strict=True):
        only_first = [k for k in first if k not in state]
        only_here = [k for k in state if k not in first]
        if only_first or only_here:
            detail = f"'{only_first[0]}' only in {where[0]}" if only_first else f"'{only_here[0]}' only in {label}"
            raise error(
                f"{label}: keys differ from {where[0]} ({len(only_first)} only there, "
                f"{len(only_here)} only here; {detail}); {same} hold the same keys"
            )
        for key, value in first.items():
            other = state[key]
            if is_tensor(value) != is_tensor(other):
                raise error(f"{label}: '{key}' is a tensor in one file and not in {where[0]}; cannot merge them")
            if not is_tensor(value):
                continue
            mine, theirs = spec(value), spec(other)
            if mine != theirs:
                raise error(
                    f"{label}: '{key}' is {list(theirs.shape)} torch.{theirs.dtype} but "
                    f"{list(mine.shape)} torch.{mine.dtype} in {where[0]}; {same} hold "
                    f"the same shapes and dtypes"
                )


def _merge_stats(
    means: Sequence[torch.Tensor], variances: Sequence[torch.Tensor], *, buffers: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running mean and variance of the union of equally sized shards, computed in float64 (with torch, imported
    only here: statistics equal on every rank are rank 0's bytes)."""
    if buffers == "rank0" or (
        all(same_bytes(m, means[0]) for m in means) and all(same_bytes(v, variances[0]) for v in variances)
    ):
        return means[0], variances[0]
    import torch

    means, variances = [as_tensor(m) for m in means], [as_tensor(v) for v in variances]
    stacked = torch.stack([m.to(torch.float64) for m in means])
    mean = stacked.mean(dim=0)
    var = torch.stack([v.to(torch.float64) for v in variances]).mean(dim=0)
    if buffers == "pooled":
        # law of total variance: within-shard variance plus the spread of the shard means
        var = var + ((stacked - mean) ** 2).mean(dim=0)
    return mean.to(means[0].dtype), var.to(variances[0].dtype)
