"""FSDP1 ``SHARDED_STATE_DICT`` rank files: each ShardedTensor read as a :class:`~.fsdp.ShardedTensorRecord`, the
ranks checked to make one job's checkpoint, and each tensor reassembled; a ``LOCAL_STATE_DICT``'s flat parameters
split by the model that was wrapped (:mod:`.flatparams`).

A ShardedTensor pickles as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (cls, dtype, size,
…), (local_shards, ShardedTensorMetadata, ProcessGroupState, sharding_spec, init_rrefs))`` (its __getstate__).
The metadata lists every rank's shard (offsets, sizes, placement "rank:R/device") and the full size; each local
Shard holds its tensor and its own offsets. That is all reassembly needs: no process group, nothing called.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.dtypes import DTYPES, shape_problem
from ckptfix.formats.fsdp.flatparams import split_state
from ckptfix.formats.fsdp.ranks import (
    MAX_DIM,
    RankFilesError,
    ShardedPiece,
    ShardedTensorRecord,
    flat_param_keys,
    object_state,
    owner,
)
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.safety.allowlist import SHARDED_TENSOR_GLOBALS, ShardedCheckpointError


def sharded_piece(obj: Any, *, key: str, source: str) -> ShardedPiece | None:
    """The FSDP1 ShardedTensor an inert record stands for, or None when it is not one."""
    if not (isinstance(obj, inert.Inert) and obj.func.full == "torch._tensor._rebuild_from_type_v2"):
        return None
    try:
        _func, cls, args, state = obj.args
        if not getattr(cls, "full", "").endswith(".ShardedTensor"):
            return None
        local_shards, metadata, group = state[0], object_state(state[1]), object_state(state[2])
        dtype = getattr(args[1], "full", "").removeprefix("torch.")
        shape = _sizes(metadata["size"])
        rank, world = group["global_rank"], group["global_world_size"]
        layout = tuple(_shard_box(m) for m in metadata["shards_metadata"])
        local = []
        for shard in local_shards:
            fields = object_state(shard)
            offsets, sizes, placed = _shard_box(fields["metadata"])
            if placed != rank:
                raise ValueError(f"a local shard placed on rank {placed} in the file of rank {rank}")
            local.append((offsets, sizes, fields["tensor"]))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise FormatError(
            f"{source}: key '{key}' is a ShardedTensor whose pickle ckptfix does not understand ({type(e).__name__}: "
            f"{e}); save a full state dict instead"
        ) from e
    damaged = f"{source}: key '{key}': its ShardedTensor"
    if dtype not in DTYPES:
        raise FormatError(f"{damaged} dtype is {dtype or 'not a dtype'}; the file is damaged or crafted")
    if problem := shape_problem(shape):
        raise FormatError(f"{damaged} shape {list(shape)} has {problem}; the file is damaged or crafted")
    if not (type(world) is int and 1 <= world < MAX_DIM and type(rank) is int and 0 <= rank < world):
        raise FormatError(f"{damaged} rank {rank!r} of {world!r} is not a rank of a job; the file is damaged")
    if tuple(args[2]) != shape or any(len(o) != len(shape) or not 0 <= r < world for o, _, r in layout):
        raise FormatError(f"{damaged} shards do not match its size {list(shape)}; the file is damaged or crafted")
    return ShardedPiece(dtype, shape, rank, world, layout, tuple(local))


def _sizes(value: Any) -> tuple[int, ...]:
    """A torch.Size record or a list of sizes, each a plain int in range."""
    if isinstance(value, inert.Inert) and value.func.full == "torch.Size" and value.args:
        value = value.args[0]
    if not isinstance(value, (tuple, list)) or not all(type(n) is int and 0 <= n < MAX_DIM for n in value):
        raise TypeError(f"expected sizes, found {value!r}")
    return tuple(value)


def _shard_box(obj: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A ShardMetadata record's offsets, sizes and placement rank."""
    fields = object_state(obj)
    offsets, sizes = _sizes(fields["shard_offsets"]), _sizes(fields["shard_sizes"])
    placed = object_state(fields["placement"])["_rank"]
    if len(offsets) != len(sizes) or type(placed) is not int:
        raise ValueError("a shard's offsets, sizes or placement are malformed")
    return offsets, sizes, placed


def describe_fsdp1_rank(
    fd: int, path: str, *, allowed: frozenset[str], verify: bool = False, model: Any = None
) -> tuple[Any, Any]:
    """The checked archive of an FSDP1 SHARDED_STATE_DICT rank file, and its checkpoint with each ShardedTensor as
    a :class:`ShardedTensorRecord` (``piece.local`` holding inert records, read on demand). ``allowed`` must hold
    :data:`SHARDED_TENSOR_GLOBALS`. A LOCAL_STATE_DICT (flat parameters) is split by ``model``, the model that was
    wrapped, into one :class:`~.flatparams.FlatSliceRecord` per parameter; without it, refused."""
    from ckptfix.formats.torchzip.reader import read_torch_zip

    z = read_torch_zip(fd, path, allowed=allowed, verify=verify, as_data=SHARDED_TENSOR_GLOBALS)
    return z, fsdp1_records(z.tree, path, model=model)


def fsdp1_records(tree: Any, path: str, *, model: Any = None) -> Any:
    """An FSDP1 rank file's inert checkpoint (its pickle read with :data:`SHARDED_TENSOR_GLOBALS` as records) as
    :func:`describe_fsdp1_rank` gives it: ShardedTensorRecords, a LOCAL_STATE_DICT split by ``model``."""
    records: dict[str, ShardedTensorRecord] = {}
    flat_in: dict[str, Any] = {}  # the state dicts holding flat parameters, by path (parts joined by NUL)
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:  # the ShardedTensors sit in the (nested) dicts of the checkpoint
        path_so_far, node = stack.pop()
        for k, v in node.items() if isinstance(node, dict) else ():
            key = f"{path_so_far}\0{k}" if path_so_far else str(k)
            found = sharded_piece(v, key=str(k), source=path)
            if found is None:
                stack.append((key, v))
                continue
            if flat_param_keys({str(k): None}):
                if model is None:
                    _refuse_local(path, key.replace("\0", "."), found)
                flat_in[path_so_far] = node
            node[k] = records[key] = ShardedTensorRecord(found.dtype, found.shape, found.sharding, key, found)
    _refuse_sharded_elsewhere(tree, source=path)
    return _split_local(tree, flat_in, model, source=path)


def _refuse_sharded_elsewhere(tree: Any, *, source: str) -> None:
    """A ShardedTensor the walk above did not reach (in a list, a tuple, an object) would be written as it is: one
    rank's shards in a file said to be merged. FSDP1 saves them in dicts only."""
    for name, value in tree.items() if isinstance(tree, dict) else [("", tree)]:
        if any(sharded_piece(obj, key=str(name), source=source) for obj in inert_trees.walk(value)):
            where = f"'{name}' holds" if name != "" else "holds"
            raise RankFilesError(
                f"{source}: {where} a ShardedTensor inside a list, tuple or object, where FSDP1 saves them in dicts "
                f"only (ckptfix reassembles those); the file is damaged or crafted: save FULL_STATE_DICT instead"
            )


def _split_local(tree: Any, flat_in: dict[str, Any], model: Any, *, source: str) -> Any:
    """``tree`` with each state dict holding flat parameters split into the full state dict's keys."""
    for where in sorted(flat_in, key=len, reverse=True):  # the checkpoint itself, when it is one, last
        split = split_state(flat_in[where], model, path=where, source=source)
        if not where:
            return split
        owner(tree, where)[where.split("\0")[-1]] = split
    return tree


def _refuse_local(path: str, name: str, p: ShardedPiece) -> None:
    raise ShardedCheckpointError(
        f"{path}: '{name}' is an FSDP1 LOCAL_STATE_DICT flat parameter ({p.shape[0]} elements of many parameters "
        f"joined), and the file does not record which parameters it joins: pass the model that was wrapped to "
        f"split it (ckptfix merge --model MOD:FACTORY, with --kwargs JSON for its arguments)",
        kind="flat-param",
    )


def check_sharded(ranks: list[dict[str, ShardedPiece]], paths: Sequence[str]) -> None:
    """FSDP1 rank files make one job's checkpoint: the same ShardedTensors (dtype, shape, shards) in every file,
    each rank's file there exactly once, and the shards of each tensor tiling it; else :class:`RankFilesError`."""
    from ckptfix.formats.dcp.reader import _check_tiling

    if not any(ranks):
        raise RankFilesError(f"{paths[0]}: holds no ShardedTensor; these are not FSDP1 SHARDED_STATE_DICT files")
    keys = list(ranks[0])
    owner: dict[int, str] = {}
    for path, pieces in zip(paths, ranks, strict=True):
        if list(pieces) != keys:
            odd = sorted(set(pieces) ^ set(keys))
            raise RankFilesError(f"{path}: its sharded keys differ from {paths[0]}'s ({odd[0]!r}…); files of two runs?")
        first = next(iter(pieces.values()))
        if any((p.rank, p.world) != (first.rank, first.world) for p in pieces.values()):
            raise RankFilesError(f"{path}: its ShardedTensors name different ranks; the file is damaged or crafted")
        if first.world != ranks[0][keys[0]].world:
            raise RankFilesError(
                f"{path}: saved by rank {first.rank} of {first.world}, but {paths[0]} by a job of "
                f"{ranks[0][keys[0]].world} ranks; the files are from different runs"
            )
        if first.rank in owner:
            raise RankFilesError(
                f"{path}: rank {first.rank} is given twice (also {owner[first.rank]}); pass every rank's file once"
            )
        owner[first.rank] = path
    for key in keys:
        parts = [r[key] for r in ranks]
        name, p0 = key.replace("\0", "."), parts[0]
        for p, path in zip(parts, paths, strict=True):
            if (p.dtype, p.shape, p.layout) != (p0.dtype, p0.shape, p0.layout):
                raise RankFilesError(
                    f"{path}: '{name}' is {p.dtype} {list(p.shape)} in {len(p.layout)} shard(s), but {paths[0]} has "
                    f"{p0.dtype} {list(p0.shape)} in {len(p0.layout)} shard(s) placed otherwise; the files are from "
                    f"different runs"
                )
        if missing := sorted({r for _, _, r in p0.layout} - set(owner)):
            raise RankFilesError(
                f"'{name}': the shards of rank(s) {missing} are missing ({len(paths)} file(s) for a job of "
                f"{p0.world} ranks); pass every rank's file exactly once"
            )
        try:  # the shards cover the tensor once, before any byte of it is written
            _check_tiling(name, p0.shape, [(o, s) for o, s, _ in p0.layout], source=os.path.dirname(paths[0]) or ".")
        except FormatError as e:
            raise RankFilesError(str(e)) from e
        for p, path in zip(parts, paths, strict=True):
            mine = sorted((o, s) for o, s, r in p0.layout if r == p.rank)
            if sorted((o, s) for o, s, _ in p.local) != mine:
                raise RankFilesError(
                    f"{path}: '{name}': rank {p.rank}'s local shards are not those the metadata places on it; the "
                    f"file is damaged"
                )
