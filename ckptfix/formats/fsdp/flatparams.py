"""FSDP1 LOCAL_STATE_DICT flat parameters split back into the parameters they join, given the model that was wrapped.

Each FSDP unit (the module at a ``<prefix>._flat_param`` key) flattens its parameters into one 1-D tensor, which
a LOCAL_STATE_DICT saves as a ShardedTensor without the world-size padding. The file does not say which parameters
it joins; the model does, as ``torch/distributed/fsdp/_flat_param.py`` (``_init_flat_param_and_metadata``) lays
them out: the unit's parameters in ``named_modules(remove_duplicate=False)`` order, each module's own parameters,
a shared parameter at its first occurrence only, parameters of nested units (their own ``_flat_param``) left out.
With ``use_orig_params=True`` a parameter starts at a multiple of 16 bytes (of the elements of the mixed-precision
parameter dtype, when there is one) and the end is padded to a multiple of the world size. A layout is used only
when exactly one of these paddings gives the flat parameter's element count; else nothing is split.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.fsdp.ranks import FLAT_PARAM, RankFilesError, ShardedTensorRecord
from ckptfix.formats.records import TensorRecord
from ckptfix.transforms.checkpoint import is_tensor

_ALIGNMENT = 16  # bytes: FSDP's _get_aligned_numel (a TorchInductor constraint)
_HALF = 2  # the itemsize of bfloat16 and float16, MixedPrecision's usual param_dtype


@dataclass(frozen=True)
class Unit:
    """One FSDP unit of the model: its parameters in the order FSDP flattens them (full-state-dict keys)."""

    prefix: str  # the module's name ("" for the root)
    params: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ParamOwners:
    """The full state dict's keys in FULL_STATE_DICT's order, and where each parameter's values live."""

    units: dict[str, Unit]
    keys: tuple[str, ...]
    owner: dict[str, tuple[str, str]]  # parameter key (a shared one under each name) -> (unit prefix, primary key)


@dataclass(eq=False)
class FlatSliceRecord(TensorRecord):
    """One parameter of a rank file's flat parameter: its dtype and full shape, and where it lies in the flat
    parameter once every rank's shards are joined."""

    dtype: str
    shape: tuple[int, ...]
    sharding: str  # "ShardedTensor, 2 shard(s) over 2 rank(s), split from '_flat_param'"
    flat: ShardedTensorRecord  # the flat parameter in this rank's file
    offset: int
    key: str = ""  # its path in the checkpoint, parts joined by NUL

    # -- a parameter cut from a flat parameter, in a merge of the run's rank files (TensorRecord.rank_piece) -----

    def rank_piece(self) -> ShardedTensorRecord:
        return self.flat  # what the ranks' files must agree on, and what is assembled

    def from_piece(self, full: Any) -> Any:
        # a copy: the joined flat parameter is freed when the next is built
        return full.narrow(0, self.offset, math.prod(self.shape)).view(self.shape).clone()


def plan(model: Any, prefixes: Iterable[str], *, source: str) -> ParamOwners:
    """Which of ``model``'s parameters each FSDP unit (at ``prefixes``) flattens, and the full state dict's keys.

    Units are claimed innermost first, as FSDP wraps them: an outer unit skips what a nested one holds. The keys
    follow ``state_dict()`` with one change FSDP makes: unsharding re-registers a module's own parameters, then
    its shared ones, so a shared name comes after the module's other parameters (``tied.bias``, ``tied.weight``).
    """
    units: dict[str, Unit] = {}
    owner: dict[str, tuple[str, str]] = {}
    claimed: dict[int, tuple[str, str]] = {}  # id(parameter) -> (unit prefix, primary key)
    for prefix in sorted(prefixes, key=lambda p: -len(p.split(".")) if p else 0):
        module = _submodule(model, prefix, source=source)
        params: list[tuple[str, tuple[int, ...]]] = []
        for p, key in _parameters(module, prefix):
            if id(p) in claimed and claimed[id(p)][0] != prefix:
                other = claimed[id(p)][0]
                if not (key + ".").startswith(other + "."):
                    raise RankFilesError(
                        f"{source}: the model's parameter '{key}' is also '{claimed[id(p)][1]}' of the nested FSDP "
                        f"unit '{other}': a parameter shared across units, which ckptfix does not split; save "
                        f"FULL_STATE_DICT or SHARDED_STATE_DICT instead"
                    )
                continue
            if id(p) not in claimed:
                claimed[id(p)] = (prefix, key)
                params.append((key, tuple(p.shape)))
            owner[key] = claimed[id(p)]
        units[prefix] = Unit(prefix, tuple(params))
    for p, key in _parameters(model, ""):
        if id(p) not in claimed:
            raise RankFilesError(
                f"{source}: the model's parameter '{key}' is in none of the file's flat parameters "
                f"({', '.join(repr(_flat_key(u)) for u in units)}); pass the model that was wrapped"
            )
    return ParamOwners(units, tuple(_keys(model, owner)), owner)


def _is_flat(key: str) -> bool:
    return key == FLAT_PARAM or key.endswith(f".{FLAT_PARAM}")


def _flat_key(prefix: str) -> str:
    return f"{prefix}.{FLAT_PARAM}" if prefix else FLAT_PARAM


def _submodule(model: Any, prefix: str, *, source: str) -> Any:
    try:
        return model.get_submodule(prefix) if prefix else model
    except AttributeError as e:
        raise RankFilesError(
            f"{source}: '{prefix}.{FLAT_PARAM}' is the flat parameter of an FSDP unit at '{prefix}', but the model "
            f"has no module '{prefix}'; pass the model that was wrapped"
        ) from e


def _parameters(module: Any, prefix: str) -> Iterable[tuple[Any, str]]:
    """``module``'s parameters with repeats, in FSDP's order: each module's own, modules in pre-order."""
    for name, sub in module.named_modules(remove_duplicate=False):
        for param_name, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            yield p, ".".join(part for part in (prefix, name, param_name) if part)


def _keys(model: Any, owner: Mapping[str, tuple[str, str]]) -> Iterable[str]:
    for name, module in model.named_modules(remove_duplicate=False):
        dotted = f"{name}." if name else ""
        params = [dotted + n for n, p in module._parameters.items() if p is not None]
        yield from (k for k in params if owner.get(k, ("", k))[1] == k)  # its own, then its shared ones
        yield from (k for k in params if owner.get(k, ("", k))[1] != k)
        skip = module._non_persistent_buffers_set
        yield from (dotted + n for n, b in module._buffers.items() if b is not None and n not in skip)


def offsets(shapes: Sequence[tuple[int, ...]], *, align: int, world: int) -> tuple[list[int], int]:
    """Each parameter's offset in the flat parameter and its unsharded size, as FSDP pads them: before a parameter
    to a multiple of ``align`` elements, at the end to a multiple of ``world`` (only when ``align``)."""
    found, total = [], 0
    for shape in shapes:
        if align and total % align:
            total += align - total % align
        found.append(total)
        total += math.prod(shape)
    if align and total % world:
        total += world - total % world
    return found, total


def split_layout(unit: Unit, flat: ShardedTensorRecord, *, name: str, source: str) -> list[int]:
    """The offsets of ``unit``'s parameters in ``flat``, from the one padding that gives its element count."""
    assert flat.piece is not None  # every ShardedTensorRecord of a rank file holds its piece
    if len(flat.shape) != 1:  # a crafted shape: its first size would pass for the element count
        raise RankFilesError(
            f"{source}: '{name}' is a ShardedTensor of shape {list(flat.shape)}, but an FSDP flat parameter is 1-D; "
            f"the file is damaged or crafted"
        )
    numel, world = flat.shape[0], flat.piece.world
    size = DTYPES[flat.dtype].itemsize
    shapes = [shape for _, shape in unit.params]
    aligns = sorted({0, max(1, _ALIGNMENT // size), max(1, _ALIGNMENT // min(size, _HALF))})
    fits = {tuple(found) for found, total in (offsets(shapes, align=a, world=world) for a in aligns) if total == numel}
    if len(fits) == 1:
        return list(fits.pop())
    need = sum(math.prod(s) for s in shapes)
    where = f"'{unit.prefix}'" if unit.prefix else "root module"
    if fits:
        raise RankFilesError(
            f"{source}: '{name}': its {numel} elements fit the model's parameters of {where} with more than one of "
            f"FSDP's paddings, so ckptfix cannot tell where each parameter starts; save FULL_STATE_DICT or "
            f"SHARDED_STATE_DICT instead"
        )
    padded = offsets(shapes, align=max(1, _ALIGNMENT // size), world=world)[1]
    raise RankFilesError(
        f"{source}: '{name}' holds {numel} elements, but the {len(shapes)} parameter(s) of the model's {where} need "
        f"{need} ({padded} with use_orig_params=True padding); pass the model that was wrapped, built with the "
        f"same arguments"
    )


def split_state(state: Mapping[str, Any], model: Any, *, path: str, source: str) -> OrderedDict[str, Any]:
    """A LOCAL_STATE_DICT (flat parameters as :class:`ShardedTensorRecord`, buffers as they are) as the full state
    dict's keys in FULL_STATE_DICT's order: each parameter a :class:`FlatSliceRecord`, each buffer the file's own.
    ``path``: the state dict's place in the checkpoint (parts joined by NUL, "" for the top)."""
    flats = {k: v for k, v in state.items() if isinstance(v, ShardedTensorRecord) and _is_flat(k)}
    _check_one_per_unit(flats, source=source)
    found = plan(model, [k.removesuffix(FLAT_PARAM).removesuffix(".") for k in flats], source=source)
    starts: dict[str, tuple[ShardedTensorRecord, int]] = {}
    for key, flat in sorted(flats.items(), key=lambda kv: len(kv[0].split("."))):  # the outermost unit first
        unit = found.units[key.removesuffix(FLAT_PARAM).removesuffix(".")]
        for (param, _), offset in zip(unit.params, split_layout(unit, flat, name=key, source=source), strict=True):
            starts[param] = (flat, offset)
    shapes = {k: s for unit in found.units.values() for k, s in unit.params}
    for key, (_, primary) in found.owner.items():
        flat, offset = starts[primary]
        _check_view(state.get(key), flat, offset, math.prod(shapes[primary]), key=key, source=source)
    out: OrderedDict[str, Any] = OrderedDict()
    for key in found.keys:
        if key in found.owner:
            primary = found.owner[key][1]
            flat, offset = starts[primary]
            how = f"{flat.piece.sharding}, split from '{flat.key.split(chr(0))[-1]}'" if flat.piece else ""
            child = f"{path}\0{key}" if path else key
            out[key] = FlatSliceRecord(flat.dtype, shapes[primary], how, flat, offset, child)
        elif key in state:
            out[key] = state[key]
        else:
            raise RankFilesError(
                f"{source}: the model's state dict holds '{key}', which the file does not; pass the model that was "
                f"wrapped"
            )
    if extra := [k for k in state if k not in out and k not in flats]:
        raise RankFilesError(
            f"{source}: holds '{extra[0]}', which the model's state dict does not; pass the model that was wrapped"
        )
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _check_one_per_unit(flats: Mapping[str, Any], *, source: str) -> None:
    """Each unit has one flat parameter: two keys naming the same module (``._flat_param`` is the root's too) would
    split the model's parameters from one of them and leave the other unread."""
    seen: dict[str, str] = {}
    for key in flats:
        prefix = key.removesuffix(FLAT_PARAM).removesuffix(".")
        if prefix in seen:
            where = f"'{prefix}'" if prefix else "the root module"
            raise RankFilesError(
                f"{source}: '{key}' and '{seen[prefix]}' are both the flat parameter of {where}, and an FSDP unit has "
                f"one; the file is damaged or crafted"
            )
        seen[prefix] = key


def _check_view(view: Any, flat: ShardedTensorRecord, offset: int, numel: int, *, key: str, source: str) -> None:
    """With use_orig_params=True the file also holds each parameter's part on this rank (1-D): its size must be
    what the split puts in this rank's shard, a check of the split that costs no tensor byte."""
    if view is None or flat.piece is None or isinstance(view, ShardedTensorRecord):
        return
    if not is_tensor(view):
        raise RankFilesError(
            f"{source}: '{key}' is not a tensor ({type(view).__name__}), but a use_orig_params=True file holds the "
            f"parameter's part on rank {flat.piece.rank} there; the file is damaged or crafted"
        )
    held = sum(max(0, min(o[0] + s[0], offset + numel) - max(o[0], offset)) for o, s, _ in flat.piece.local)
    if math.prod(getattr(view, "shape", (-1,))) != held:
        raise RankFilesError(
            f"{source}: '{key}' holds {math.prod(view.shape)} elements on rank {flat.piece.rank}, but the model's "
            f"layout of '{flat.key.split(chr(0))[-1]}' puts {held} of its {numel} there; pass the model that was "
            f"wrapped"
        )
