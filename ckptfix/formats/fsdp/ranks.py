"""Sharded tensors inside single files: one rank's part of an FSDP2 / tensor-parallel model (DTensor), an FSDP1
local state dict (ShardedTensor) or FSDP1 flat parameters. Recognised without building them, never passed off as
a full model, and (DTensor) reassembled from every rank's file.

A DTensor pickles as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (global dtype, shape …),
{"_local_tensor": …, "_spec": DTensorSpec(mesh, placements, tensor_meta)})``. Its classes are read as data here
(allowed for this reader only, never called): the local tensor, the mesh's shape, this rank's coordinate on it and
the placements are all that reassembly needs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import FormatError, MergeError
from ckptfix.formats.dtypes import DTYPES, shape_problem
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import TensorRecord
from ckptfix.formats.safety.allowlist import DTENSOR_GLOBALS, SHARDED_TENSOR_GLOBALS, ShardedCheckpointError, explain

FLAT_PARAM = "_flat_param"


class RankFilesError(MergeError):
    """Rank files that do not make one sharded checkpoint: a rank missing or given twice, pieces that overlap or
    leave gaps, files of two runs. Bad input (exit 2), unlike ranks whose values disagree."""

    exit_code = 2


def flat_param_keys(state: Any) -> list[str]:
    """Keys of FSDP1 flat parameters (each rank's 1-D slice of many parameters), which no model loads."""
    if not isinstance(state, dict):
        return []
    return [k for k in state if isinstance(k, str) and (k.endswith(FLAT_PARAM) or ".flat_param" in k)]


def refuse_flat_params(obj: Any, *, source: str) -> None:
    """FSDP1 flat parameters are one rank's slices of many parameters: never pass them off as a model."""
    from ckptfix.transforms.checkpoint import model_entries

    for entry in model_entries(obj):
        if flat := flat_param_keys(obj if entry == "" else obj[entry]):
            raise ShardedCheckpointError(
                f"{source}: key '{flat[0]}' is an FSDP1 flat parameter (one rank's 1-D slice of many parameters "
                f"joined), which no model loads and which cannot be split without FSDP's own metadata; save a full "
                f"state dict instead (get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))",
                kind="flat-param",
            )


@dataclass(frozen=True)
class Piece:
    """One rank's local part of a DTensor and where it goes."""

    dtype: str
    shape: tuple[int, ...]  # the global (full) shape
    mesh: tuple[int, ...]
    coordinate: tuple[int, ...]
    placements: tuple[tuple[str, int], ...]  # ("shard", dim) or ("replicate", -1) per mesh dimension
    local: Any  # the inert local tensor


def piece(obj: Any, *, key: str, source: str) -> Piece | None:
    """The DTensor an inert record stands for, or None when it is not one."""
    if not (isinstance(obj, inert.Inert) and obj.func.full == "torch._tensor._rebuild_from_type_v2"):
        return None
    try:
        _func, cls, args, raw_state = obj.args
        if not getattr(cls, "full", "").endswith("DTensor"):
            return None
        state = _merged(raw_state)
        local = state["_local_tensor"]
        spec = object_state(state["_spec"])
        mesh = object_state(spec["mesh"])
        placements = tuple(_placement(p) for p in spec["placements"])
        shape = tuple(args[2])
        coordinate = tuple(mesh["_coordinate_on_dim"])
        dims = _mesh_shape(mesh)
        dtype = getattr(args[1], "full", "").removeprefix("torch.")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise FormatError(
            f"{source}: key '{key}' is a DTensor whose pickle ckptfix does not understand ({type(e).__name__}: "
            f"{e}); save a full state dict instead"
        ) from e
    if len(placements) != len(dims) or len(coordinate) != len(dims):
        raise FormatError(f"{source}: key '{key}': its DTensor placements do not match its mesh; the file is damaged")
    _check_piece(key, dtype=dtype, shape=shape, mesh=dims, coordinate=coordinate, placements=placements, source=source)
    return Piece(dtype, shape, dims, coordinate, placements, local)


def _check_piece(
    key: str,
    *,
    dtype: str,
    shape: tuple[Any, ...],
    mesh: tuple[Any, ...],
    coordinate: tuple[Any, ...],
    placements: tuple[tuple[str, int], ...],
    source: str,
) -> None:
    """What a rank file declares of a DTensor, proven before any of it decides memory or placement."""
    damaged = f"{source}: key '{key}': its DTensor"
    if dtype not in DTYPES:
        raise FormatError(f"{damaged} dtype is {dtype or 'not a dtype'}; the file is damaged or crafted")
    if not all(type(n) is int and 0 <= n < MAX_DIM for n in shape):
        raise FormatError(f"{damaged} shape {list(shape)} is not a list of sizes; the file is damaged or crafted")
    if problem := shape_problem(shape):
        raise FormatError(f"{damaged} shape {list(shape)} has {problem}; the file is damaged or crafted")
    if not all(type(n) is int and 1 <= n < MAX_DIM for n in mesh) or math.prod(mesh) > MAX_DIM:
        raise FormatError(f"{damaged} mesh {list(mesh)} is not a device mesh; the file is damaged or crafted")
    if not all(type(c) is int and 0 <= c < n for c, n in zip(coordinate, mesh, strict=True)):
        raise FormatError(
            f"{damaged} mesh coordinate {list(coordinate)} lies outside its mesh {list(mesh)}; the file is damaged "
            f"or crafted"
        )
    for kind, dim in placements:
        if kind == "shard" and not 0 <= dim < len(shape):
            raise FormatError(
                f"{damaged} is Shard({dim}) of a {len(shape)}-dimensional tensor; the file is damaged or crafted"
            )


MAX_DIM = 1 << 62  # no size or mesh past this: products of such numbers stay exact and cheap


def _mesh_shape(mesh: dict[str, Any]) -> tuple[int, ...]:
    """The mesh's shape: from its layout (torch >= 2.9; one per mesh dimension in ``axes``, or one layout whose
    top-level sizes are the dimensions as torch 2.11 pickles it), or from the shape of its mesh tensor (older)."""
    layout = mesh.get("_layout")
    if layout is None:
        return tuple(inert.tensor_of(mesh["mesh"]).shape)
    fields = object_state(layout)
    if "axes" in fields:
        return tuple(math.prod(_ints(object_state(axis)["shape"])) for axis in fields["axes"])
    top = fields["shape"]
    return tuple(math.prod(_ints(part)) for part in (top if isinstance(top, (tuple, list)) else (top,)))


def _ints(shape: Any) -> list[int]:
    """A layout's (possibly nested) tuple of sizes, flattened."""
    if type(shape) is int:
        return [shape]
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"expected sizes, found {shape!r}")
    return [n for part in shape for n in _ints(part)]


def _merged(state: Any) -> dict[str, Any]:
    """Pickle's object state: a dict, or (dict or None, slots dict)."""
    if isinstance(state, tuple) and len(state) == 2:
        return {**(state[0] or {}), **(state[1] or {})}
    if not isinstance(state, dict):
        raise TypeError(f"expected fields, found {type(state).__name__}")
    return state


def object_state(obj: Any) -> dict[str, Any]:
    """The fields an inert record was built with (its pickled state), else TypeError."""
    if not isinstance(obj, inert.Inert):
        raise TypeError(f"expected an object with fields, found {obj!r}")
    return _merged(obj.state)


def _placement(obj: Any) -> tuple[str, int]:
    name = obj.func.full.rsplit(".", 1)[1] if isinstance(obj, inert.Inert) else type(obj).__name__
    if name == "Shard":
        return ("shard", int(object_state(obj)["dim"]))
    if name == "Replicate":
        return ("replicate", -1)
    raise ValueError(f"placement {name} is not supported (only Shard and Replicate)")


def region(p: Piece) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and sizes of ``p``'s local tensor in the full tensor, as torch.chunk splits each sharded dim."""
    offsets, sizes = [0] * len(p.shape), list(p.shape)
    for (kind, dim), parts, at in zip(p.placements, p.mesh, p.coordinate, strict=True):
        if kind != "shard":
            continue
        if not 0 <= at < parts or not 0 <= dim < len(p.shape):  # piece() refused these; never narrow() past them
            raise ValueError(f"Shard({dim}) at mesh coordinate {at} of {parts} does not place a piece")
        if offsets[dim] or sizes[dim] != p.shape[dim]:
            raise ValueError(f"dimension {dim} is sharded over two mesh dimensions, which ckptfix does not reassemble")
        step = math.ceil(p.shape[dim] / parts) if p.shape[dim] else 0
        offsets[dim] = min(at * step, p.shape[dim])
        sizes[dim] = max(0, min(step, p.shape[dim] - offsets[dim]))
    return tuple(offsets), tuple(sizes)


def load_ranks(
    paths: Sequence[str], *, allow_globals: Iterable[str] = (), found: dict[str, str] | None = None
) -> list[Any]:
    """Each rank file's checkpoint with its DTensors replaced by the full tensors reassembled from all files.

    Every rank of the mesh must be there exactly once; each local tensor must have the shape its placement gives
    it; the pieces of a tensor must tile it exactly; replicated copies must be equal byte for byte. Else
    :class:`RankFilesError`. ``found`` (if given) gets each reassembled key (dotted) and how it was sharded
    (``Shard(0) on mesh [2]``).

    >>> trees = load_ranks(["rank0.pt", "rank1.pt"])  # each rank's torch.save(model.state_dict()) under FSDP2
    """
    import torch

    from ckptfix.formats.safety import allowlist
    from ckptfix.formats.torchio.materialize import materialize
    from ckptfix.formats.torchzip.reader import read_torch_zip

    allowed = allowlist.allowed_names(list(allow_globals), source=paths[0]) | DTENSOR_GLOBALS
    trees: list[Any] = []
    locals_: list[dict[str, Piece]] = []
    for path in paths:
        with open(path, "rb") as f:
            z = read_torch_zip(f.fileno(), path, allowed=allowed, verify=True, as_data=DTENSOR_GLOBALS)
            pieces: dict[str, Piece] = {}
            tree = _swap_pieces(z.tree, pieces, source=path)
            built = materialize(_with_locals(z, tree, pieces), f.fileno(), mmap=False)
        trees.append(built)
        locals_.append({k: Piece(**{**p.__dict__, "local": built[_LOCAL][k]}) for k, p in pieces.items()})
        del built[_LOCAL]
    full = _assemble(torch, locals_, paths)
    if found is not None:
        for key, p in locals_[0].items():
            found[key.replace("\0", ".")] = _how(p)
    for tree in trees:
        for key, value in full.items():
            owner(tree, key)[key.split("\0")[-1]] = value  # one tensor object, shared by every rank's tree
    return trees


_LOCAL = "\0ckptfix-local"


def _how(p: Piece) -> str:
    """``Shard(0) on mesh [2]``, ``Replicate(), Shard(0) on mesh [2, 2]``."""
    how = ", ".join(f"Shard({d})" if kind == "shard" else "Replicate()" for kind, d in p.placements)
    return f"{how} on mesh {list(p.mesh)}"


@dataclass(eq=False)
class DTensorRecord(TensorRecord):
    """One rank's DTensor as ``inspect`` shows it: the full tensor's dtype and shape, and how it is sharded."""

    dtype: str
    shape: tuple[int, ...]
    sharding: str  # "Shard(0) on mesh [2]"
    coordinate: tuple[int, ...]  # this rank's place on the mesh
    key: str = ""  # its path in the checkpoint, parts joined by NUL
    piece: Piece | None = None  # with the inert record of the local tensor

    def spread(self) -> tuple[str, str]:
        return "sharding", self.sharding

    # -- one rank's piece, in a merge of the run's rank files (TensorRecord.rank_piece) -------------------------

    def rank_piece(self) -> DTensorRecord:
        return self

    def job_rank(self) -> tuple[int, int]:
        """This file's rank and the job's world size: its coordinate on the mesh, numbered row-major as
        ``init_device_mesh`` numbers the ranks."""
        assert self.piece is not None  # every DTensorRecord of a rank file holds its piece
        number = 0
        for coordinate, size in zip(self.piece.coordinate, self.piece.mesh, strict=True):
            number = number * size + coordinate
        return number, math.prod(self.piece.mesh)

    def read_local(self, read: Callable[[Any], Any]) -> Piece:
        """Its piece with the local tensor read (``read``: its rank file's reader)."""
        assert self.piece is not None
        return dataclasses.replace(self.piece, local=read(self.piece.local))

    def full_tensor(self, parts: list[Piece], paths: Sequence[str]) -> Any:
        """The full tensor from every rank's :meth:`read_local` piece, in the order of ``paths``."""
        return assemble(parts, paths, key=self.key)


def placement(values: Iterable[Any]) -> dict[str, Any] | None:
    """What ``inspect`` says of a rank file's place in its run: the first DTensor's mesh coordinate and sharding
    (None for a file with no DTensor)."""
    first = next((v for v in values if isinstance(v, DTensorRecord)), None)
    return None if first is None else {"coordinate": list(first.coordinate), "sharding": first.sharding}


def rank_tree(path: str, *, allow_globals: Iterable[str] = (), verify: bool = False) -> Any:
    """One rank file's checkpoint with each DTensor as a :class:`DTensorRecord` (nothing built, no tensor byte
    read unless ``verify``): what ``ckptfix inspect`` shows of a rank file."""
    from ckptfix.formats.safety import allowlist

    allowed = allowlist.allowed_names(list(allow_globals), source=path) | DTENSOR_GLOBALS
    with open(path, "rb") as f:
        return describe_rank(f.fileno(), path, allowed=allowed, verify=verify)[1]


def describe_rank(fd: int, path: str, *, allowed: frozenset[str], verify: bool = False) -> tuple[Any, Any]:
    """The checked archive of a rank file, and its checkpoint with each DTensor as a :class:`DTensorRecord`
    (``piece.local`` the inert record of its local tensor, read on demand). ``allowed`` must hold
    :data:`DTENSOR_GLOBALS`."""
    from ckptfix.formats.torchzip.reader import read_torch_zip

    z = read_torch_zip(fd, path, allowed=allowed, verify=verify, as_data=DTENSOR_GLOBALS)
    return z, rank_records(z.tree, path)


def rank_records(tree: Any, path: str) -> Any:
    """A rank file's inert checkpoint (its pickle read with :data:`DTENSOR_GLOBALS` as records) with each DTensor
    as a :class:`DTensorRecord`."""
    pieces: dict[str, Piece] = {}
    tree = _swap_pieces(tree, pieces, source=path)
    for key, p in pieces.items():
        owner(tree, key)[key.split("\0")[-1]] = DTensorRecord(p.dtype, p.shape, _how(p), p.coordinate, key, p)
    return tree


def assemble(parts: list[Piece], paths: Sequence[str], *, key: str) -> Any:
    """The full tensor ``key`` (parts joined by NUL) from every rank's piece (``local`` a real tensor, in the order
    of ``paths``), checked as :func:`load_ranks` checks it; :func:`check_pieces` first."""
    import torch

    return _tensor(torch, key.replace("\0", "."), parts, paths)


def owner(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("\0")[:-1]:
        node = node[part]
    return node


def _swap_pieces(obj: Any, pieces: dict[str, Piece], *, source: str, path: str = "") -> Any:
    """The tree with each DTensor replaced by None, its piece recorded under its path (parts joined by NUL)."""
    if isinstance(obj, dict):
        out = type(obj)() if isinstance(obj, OrderedDict) else {}
        if isinstance(obj, OrderedDict) and hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        for k, v in obj.items():
            key = f"{path}\0{k}" if path else str(k)
            found = piece(v, key=str(k), source=source)
            if found is not None:
                pieces[key] = found
                out[k] = None
            else:
                out[k] = _swap_pieces(v, pieces, source=source, path=key)
        return out
    return obj


def _with_locals(z: Any, tree: Any, pieces: dict[str, Piece]) -> Any:
    if not isinstance(tree, dict):
        raise FormatError("a rank file's checkpoint is not a dict")
    tree[_LOCAL] = {k: p.local for k, p in pieces.items()}
    return dataclasses.replace(z, tree=tree)


def _assemble(torch: Any, ranks: list[dict[str, Piece]], paths: Sequence[str]) -> dict[str, Any]:
    check_pieces(ranks, paths)
    return {key: _tensor(torch, key.replace("\0", "."), [r[key] for r in ranks], paths) for key in ranks[0]}


def check_pieces(ranks: list[dict[str, Piece]], paths: Sequence[str]) -> None:
    """Every rank's file holds the same DTensors (dtype, shape, mesh, placements) and every rank of each mesh is
    there exactly once; else :class:`RankFilesError`. The local shapes are checked as each tensor is assembled."""
    if not any(ranks):
        raise RankFilesError(f"{paths[0]}: holds no DTensor; these are not FSDP2 / tensor-parallel rank files")
    keys = list(ranks[0])
    for path, pieces in zip(paths, ranks, strict=True):
        if list(pieces) != keys:
            odd = sorted(set(pieces) ^ set(keys))
            raise RankFilesError(f"{path}: its sharded keys differ from {paths[0]}'s ({odd[0]!r}…); files of two runs?")
    for key in keys:
        parts = [r[key] for r in ranks]
        mesh = parts[0].mesh
        name = key.replace("\0", ".")
        coords = sorted(p.coordinate for p in parts)
        if len(parts) != math.prod(mesh) or coords != sorted(set(coords)):
            # the coordinates not given, listed only for a mesh the files could cover (never enumerated past it)
            grid = itertools.product(*map(range, mesh)) if math.prod(mesh) <= 2 * len(parts) else iter(())
            missing = sorted(set(grid) - set(coords))
            twice = sorted({c for c in coords if coords.count(c) > 1})
            what = f"missing the rank at mesh coordinate(s) {[list(c) for c in missing]}" if missing else ""
            what += ("; " if what and twice else "") + (f"{[list(c) for c in twice]} given twice" if twice else "")
            raise RankFilesError(
                f"'{name}': {len(parts)} files for a mesh of {math.prod(mesh)} ranks {list(mesh)}, {what}; pass "
                f"every rank's file exactly once"
            )
        for p, path in zip(parts, paths, strict=True):
            if (p.dtype, p.shape, p.mesh, p.placements) != (parts[0].dtype, parts[0].shape, mesh, parts[0].placements):
                raise RankFilesError(
                    f"{path}: '{name}' is {p.dtype} {list(p.shape)} sharded {_how(p)}, but {paths[0]} has "
                    f"{parts[0].dtype} {list(parts[0].shape)} sharded {_how(parts[0])}; the files are from "
                    f"different runs"
                )


def _tensor(torch: Any, name: str, parts: list[Piece], paths: Sequence[str]) -> Any:
    first = parts[0]
    dtype = getattr(torch, first.dtype)
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Any, str]] = {}
    for p, path in zip(parts, paths, strict=True):
        try:
            box = region(p)
        except ValueError as e:
            raise RankFilesError(f"{path}: '{name}': {e}") from e
        if tuple(p.local.shape) != box[1] or p.local.dtype != dtype:
            raise RankFilesError(
                f"{path}: '{name}' local shard is {p.local.dtype} {list(p.local.shape)} where rank "
                f"{list(p.coordinate)} of mesh {list(p.mesh)} holds {list(box[1])} of {list(first.shape)}; the "
                f"files are from different runs or damaged"
            )
        if box in boxes:  # a replicated copy: must be the same bytes
            other, where = boxes[box]
            if not torch.equal(other, p.local):
                raise RankFilesError(f"'{name}': replicated copies differ between {where} and {path}")
            continue
        boxes[box] = (p.local, path)
    try:  # before the full tensor exists: no byte of it is left as torch.empty found it
        from ckptfix.formats.dcp.reader import _check_tiling

        _check_tiling(name, first.shape, list(boxes), source=os.path.dirname(paths[0]) or ".")
    except FormatError as e:
        raise RankFilesError(str(e)) from e
    out = torch.empty(first.shape, dtype=dtype)
    for box, (local, _) in boxes.items():
        target = out
        for dim, (o, s) in enumerate(zip(*box, strict=True)):
            target = target.narrow(dim, o, s)
        target.copy_(local)
    return out


# --- FSDP1: ShardedTensor (read by :mod:`.fsdp1`) -------------------------------------------------------------


@dataclass(frozen=True)
class ShardedPiece:
    """One rank's part of an FSDP1 ShardedTensor: where every rank's shards go, and this rank's own."""

    dtype: str
    shape: tuple[int, ...]  # the full tensor's
    rank: int  # this file's global rank (ProcessGroupState)
    world: int  # the job's world size
    layout: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # every shard: offsets, sizes, rank
    local: tuple[tuple[tuple[int, ...], tuple[int, ...], Any], ...]  # this rank's: offsets, sizes, tensor

    @property
    def sharding(self) -> str:
        """``ShardedTensor, 2 shard(s) over 2 rank(s)``."""
        return f"ShardedTensor, {len(self.layout)} shard(s) over {self.world} rank(s)"


@dataclass(eq=False)
class ShardedTensorRecord(TensorRecord):
    """One rank's ShardedTensor in a merge: the full tensor's dtype and shape, and the rank's piece."""

    dtype: str
    shape: tuple[int, ...]
    sharding: str  # "ShardedTensor, 2 shards over 2 ranks"
    key: str = ""  # its path in the checkpoint, parts joined by NUL
    piece: ShardedPiece | None = None

    # -- one rank's piece, in a merge of the run's rank files (TensorRecord.rank_piece) -------------------------

    def rank_piece(self) -> ShardedTensorRecord:
        return self

    def job_rank(self) -> tuple[int, int]:
        """This file's global rank and the job's world size, as the ShardedTensor records them."""
        assert self.piece is not None  # every ShardedTensorRecord of a rank file holds its piece
        return self.piece.rank, self.piece.world

    def read_local(self, read: Callable[[Any], Any]) -> ShardedPiece:
        """Its piece with each of this rank's shards read (any number of them; ``read``: its file's reader)."""
        assert self.piece is not None
        return dataclasses.replace(self.piece, local=tuple((o, s, read(t)) for o, s, t in self.piece.local))

    def full_tensor(self, parts: list[ShardedPiece], paths: Sequence[str]) -> Any:
        """The full tensor from every rank's :meth:`read_local` piece, in the order of ``paths``."""
        return assemble_sharded(parts, paths, key=self.key)


def assemble_sharded(parts: list[ShardedPiece], paths: Sequence[str], *, key: str) -> Any:
    """The full tensor ``key`` from every rank's pieces (``local`` tensors real, in the order of ``paths``), after
    :func:`~.fsdp1.check_sharded`: each local tensor must have its shard's shape and the tensor's dtype."""
    import torch

    name, first = key.replace("\0", "."), parts[0]
    dtype = getattr(torch, first.dtype)
    for p, path in zip(parts, paths, strict=True):  # before the full tensor is allocated: the shards, read from
        for _, sizes, local in p.local:  # the files, tile it, so its size is bounded by theirs
            if tuple(local.shape) != sizes or local.dtype != dtype:
                raise RankFilesError(
                    f"{path}: '{name}' local shard is {local.dtype} {list(local.shape)} where its metadata says "
                    f"{first.dtype} {list(sizes)}; the file is damaged"
                )
    out = torch.empty(first.shape, dtype=dtype)
    for p in parts:
        for offsets, sizes, local in p.local:
            target = out
            for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                target = target.narrow(dim, o, s)
            target.copy_(local)
    return out


__all__ = [
    "DTENSOR_GLOBALS",
    "SHARDED_TENSOR_GLOBALS",
    "DTensorRecord",
    "RankFilesError",
    "ShardedCheckpointError",
    "ShardedTensorRecord",
    "assemble",
    "assemble_sharded",
    "check_pieces",
    "describe_rank",
    "explain",
    "flat_param_keys",
    "load_ranks",
    "placement",
    "rank_records",
    "rank_tree",
    "refuse_flat_params",
]
