"""Merge per-rank checkpoints of one DDP run into one checkpoint.

With buffer broadcasting off (``DistributedDataParallel(m, broadcast_buffers=False)``) and no SyncBatchNorm,
every rank keeps its own BatchNorm running statistics while the parameters stay identical (the gradient
all-reduce keeps them so). Merging checks the parameters, then combines the statistics as if the ranks'
data shards had been one batch: means averaged, variances pooled.

Files are merged key by key (:func:`merge_files`): each key is read from every rank, one tensor at a time,
compared as bytes first (|Δ| is computed only where bytes differ), combined, and written at once, so memory holds
a few copies of one tensor, not the ranks' checkpoints. Inputs may be folders (per-rank transformers or accelerate
folders). FSDP2 rank files (DTensor shards) are not averaged: their full tensors are reassembled from every rank's
shards (:mod:`ckptfix.merging.rank_files` tells rank files apart and reads them), and what is left per rank (BatchNorm
statistics) is merged as for DDP. How values combine (parameters equal, buffer strategies, weighted means) is
:mod:`ckptfix.merging.policy`; this module opens the inputs, writes the output and says what happened.

``average=True`` (or ``weights``) merges checkpoints of one model from different steps or runs instead (timm's
``avg_checkpoints.py``, model soups): every floating tensor is the (weighted) mean of the files' values, accumulated
in float64 and stored in its own dtype; other tensors (``num_batches_tracked``) and every other entry come from
the last file, the newest when files are given oldest first. It streams the same way: one tensor of one file at
a time, plus the running sum.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ckptfix.conversion.plan import STREAM_MERGE, Plan
from ckptfix.conversion.run import run
from ckptfix.errors import MergeError
from ckptfix.formats.fsdp.ranks import refuse_flat_params
from ckptfix.formats.opened import Opened, in_memory
from ckptfix.formats.output.atomic import PathLike, check_output
from ckptfix.formats.paths import output_format
from ckptfix.formats.registry import detect_format, read, write
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.torchio import opaque
from ckptfix.merging import rank_files
from ckptfix.merging.policy import BUFFER_STRATEGIES as BUFFER_STRATEGIES
from ckptfix.merging.policy import Divergence as Divergence
from ckptfix.merging.policy import Merger, MergeResult, check_options, merged_in_memory, stream_merged, weights_of
from ckptfix.writing import streamed_writer

__all__ = ["BUFFER_STRATEGIES", "Divergence", "MergeResult", "merge", "merge_files", "plan_merge"]


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
    result = plan_merge(
        states, buffers=buffers, atol=atol, to=to, buffer_keys=buffer_keys, average=average, weights=weights
    )
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
    check_options(len(objs), buffers=buffers, to=to)
    scale = weights_of(len(objs), average=average, weights=weights, buffers=buffers, atol=atol, buffer_keys=keys)
    labels = list(names) if names is not None else [f"rank{i}" for i in range(len(objs))]
    inputs = [in_memory(obj, source=label) for obj, label in zip(objs, labels, strict=True)]
    merger = Merger(
        inputs, labels, buffers=buffers, atol=atol, to=to, buffer_keys=keys, model_only=model_only, weights=scale
    )
    return merged_in_memory(merger)


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

    >>> result = ckptfix.merging.files.merge_files(["rank0.pt", "rank1.pt"], "merged.pt")
    >>> result = ckptfix.merging.files.merge_files(["step1000.pt", "step2000.pt"], "soup.pt", weights=[0.3, 0.7])
    """
    to = check_options(len(paths), buffers=buffers, to=to)
    keys = set(buffer_keys)
    scale = weights_of(len(paths), average=average, weights=weights, buffers=buffers, atol=atol, buffer_keys=keys)
    fmt = output_format(out)
    if optimizer:
        rank_files.check_optimizer(out, fmt=fmt, model_only=model_only)
    check_output(out, inputs=tuple(paths), overwrite=overwrite)
    labels = [os.fspath(p) for p in paths]
    allowed = tuple(allow_globals)
    options: dict[str, Any] = {
        "buffers": buffers,
        "atol": atol,
        "to": to,
        "buffer_keys": keys,
        "model_only": model_only,
        "weights": scale,
    }
    with contextlib.ExitStack() as stack:
        inputs, kind, read = rank_files.open_inputs(
            labels, stack, allow_globals=allowed, unsafe=unsafe, averaging=scale is not None, optimizer=optimizer
        )
        if kind:  # each rank file's read goes on there (the files not taken over are closed here)
            return rank_files.merge_rank_files(
                labels,
                out,
                fmt=fmt,
                allow_globals=allowed,
                options=options,
                fsdp1=kind != "dtensor",
                optimizer=optimizer,
                model=model,
                read=read,
            )
        return _merge_opened(inputs, labels, out, fmt=fmt, options=options, allow_globals=allowed, unsafe=unsafe)


def _merge_opened(
    inputs: list[Opened],
    labels: list[str],
    out: PathLike,
    *,
    fmt: str,
    options: dict[str, Any],
    allow_globals: tuple[str, ...],
    unsafe: bool,
) -> MergeResult:
    """Merge opened files that are not one sharded run's rank files: streamed key by key into ``out``, or, where the
    stream does not apply (real tensors, records of folders, entries only ckptfix.save writes), loaded and merged in
    memory (:func:`~ckptfix.conversion.run.run`)."""
    for opened in inputs:
        refuse_flat_params(opened.tree, source=opened.source)  # FSDP1: slices that cannot be merged here
        opaque.require(opened.tree, wanted=None, source=opened.source)
    merger = Merger(inputs, labels, **options)

    def stream() -> MergeResult:
        tree = merger.assemble(merger.template)
        # the input the other entries come from: the first, or the last when averaging
        tree = opaque.carry(tree, out_fmt=fmt, source=merger.labels[0], notes=merger.result.notes)
        stream_merged(merger, streamed_writer(tree, out, fmt=fmt, base=merger.inputs[0]))
        return merger.finish()

    def in_memory() -> MergeResult:
        model_only = options["model_only"]
        loaded = [_loaded(i, allow_globals=allow_globals, unsafe=unsafe, model_only=model_only) for i in inputs]
        left_out = merger.finish().left_out  # what the description holds beyond the model (the load has less)
        result = merged_in_memory(Merger(loaded, labels, **options))
        if not result.diverged:
            result.left_out = left_out
        if result.obj is not None:
            opaque.refuse_left(result.obj, source=merger.labels[0])  # torch writes only values it built
            write(result.obj, out, fmt=fmt)
            result.obj = None
        return result

    return run(Plan(STREAM_MERGE), stream=stream, torch=in_memory).result


def _loaded(opened: Opened, *, allow_globals: tuple[str, ...], unsafe: bool, model_only: bool) -> Opened:
    """An input loaded with torch (mmap), for the in-memory merge: a description's records are not values.
    ``model_only`` leaves a folder's training-state files unread."""
    if not opened.described:
        return opened
    obj = read(
        opened.source,
        fmt=detect_format(opened.source),
        allow_globals=allow_globals,
        unsafe=unsafe,
        model_only=model_only,
        opaque=True,
    )
    return in_memory(obj, source=opened.source)
