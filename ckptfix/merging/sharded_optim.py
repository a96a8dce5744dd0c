"""FSDP1 sharded optimizer state in a merge: found, checked across ranks, then left out or consolidated.

``FSDP.optim_state_dict(model, opt)`` under ``SHARDED_STATE_DICT`` gives each rank ``{"state": {fqn: {"exp_avg":
ShardedTensor, …, "step": tensor}}, "param_groups": [{…, "params": [fqn, …]}]}``: the same as under
``FULL_STATE_DICT`` except that every per-parameter buffer is a ShardedTensor. Consolidating it is therefore the
model's reassembly applied to those ShardedTensors, plus a proof that what is not sharded (``step``,
``param_groups``) is the same on every rank, so that rank 0's copy stands for all. It can be several times the
model, so a merge leaves it out unless asked (``optimizer=True``).

The functions here are pure: trees in, trees (or a refusal) out; the merge (:mod:`ckptfix.merging.rank_files`) does the
reading and the writing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ckptfix.formats.fsdp.ranks import RankFilesError
from ckptfix.formats.records import is_record, map_tree, spec
from ckptfix.transforms.checkpoint import is_tensor
from ckptfix.writing import Placeholder

_WHAT = "FSDP1 sharded optimizer state"


def outside_entries(tree: Any, keys: Sequence[str], model_entries: Sequence[str]) -> list[str]:
    """The top-level entries of a rank file's checkpoint ``tree`` that hold ShardedTensors (``keys``, their paths
    joined by NUL) outside its ``model_entries``, in the checkpoint's order; ``[""]`` when it has no model entry
    (an optimizer state dict saved alone)."""
    if list(model_entries) == [""]:
        return []  # the file is the model state dict itself: every ShardedTensor is the model's
    if not model_entries:
        return [""] if keys else []
    found = {key.split("\0")[0] for key in keys} - set(model_entries)
    return [str(k) for k in tree if str(k) in found]


def in_entries(key: str, entries: Sequence[str]) -> bool:
    """Whether the ShardedTensor at ``key`` (NUL-joined path) lies in one of ``entries`` (``""``: anywhere)."""
    return "" in entries or key.split("\0")[0] in entries


def check_beside_shards(
    trees: Sequence[Any], raws: Sequence[Callable[[Any], Any]], paths: Sequence[str], *, entries: Sequence[str]
) -> None:
    """What ``entries`` hold besides ShardedTensors (``step`` tensors, ``param_groups``) is the same on every rank,
    so rank 0's copy is written once; else :class:`RankFilesError` naming the file and the key. ``raws[r]`` reads
    rank ``r``'s tensor records. The ShardedTensors themselves are checked by ``check_sharded``."""
    for entry in entries:
        first = trees[0] if entry == "" else trees[0][entry]
        for r in range(1, len(trees)):
            other = trees[r] if entry == "" else trees[r].get(entry)
            mismatch = _first_difference(first, other, raws[0], raws[r], path=entry)
            if mismatch is not None:
                key, detail = mismatch
                raise RankFilesError(
                    f"{paths[r]}: '{key}' {detail} {paths[0]}; the optimizer state beside the shards (step, "
                    f"param_groups) is the same on every rank of one job: these are files of two runs or steps"
                )


def _first_difference(
    a: Any, b: Any, raw_a: Callable[[Any], Any], raw_b: Callable[[Any], Any], *, path: str
) -> tuple[str, str] | None:
    """The first place where ``b`` differs from ``a`` (its dotted key and how), or None."""
    if _sharded(a) or _sharded(b):
        both = _sharded(a) and _sharded(b)
        return None if both else (path, "is a ShardedTensor in one file and not in")
    if is_tensor(a) or is_tensor(b):
        if not (is_tensor(a) and is_tensor(b)):
            return path, "is a tensor in one file and not in"
        mine, theirs = spec(a), spec(b)
        if mine != theirs:
            return path, f"is {list(theirs.shape)} torch.{theirs.dtype}, but {list(mine.shape)} torch.{mine.dtype} in"
        from ckptfix.diffing import same_bytes

        return None if same_bytes(raw_a(a), raw_b(b)) else (path, "holds other values than in")
    if isinstance(a, dict) and isinstance(b, dict):
        if odd := [k for k in a if k not in b] or [k for k in b if k not in a]:
            return _join(path, odd[0]), "is missing here but in" if odd[0] in a else "is here but not in"
        for k, v in a.items():
            if found := _first_difference(v, b[k], raw_a, raw_b, path=_join(path, k)):
                return found
        return None
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if found := _first_difference(x, y, raw_a, raw_b, path=_join(path, i)):
                return found
        return None
    return None if _equal(a, b) else (path, f"is {_short(b)}, but {_short(a)} in")


def _sharded(value: Any) -> bool:
    """One rank's piece of a sharded tensor (in an FSDP1 file: a ShardedTensor), which ``check_sharded`` checks."""
    return is_record(value) and value.rank_piece() is value


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # a value whose == raises or is ambiguous: not the same
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def consolidated(tree: Any, entries: Sequence[str]) -> tuple[Any, dict[str, Placeholder]]:
    """``tree`` with every ShardedTensor in ``entries`` replaced by a :class:`Placeholder` of the full tensor, and
    each placeholder under its ShardedTensor's key (to be filled from every rank's shards). The input is not
    changed: the containers on the way are copied."""
    placeholders: dict[str, Placeholder] = {}

    def full(obj: Any) -> Placeholder:
        if obj.key not in placeholders:  # one record under two names (a dict the pickle shares): one tensor
            placeholders[obj.key] = Placeholder(obj.dtype, obj.shape)
        return placeholders[obj.key]

    def walk(obj: Any) -> Any:
        return map_tree(obj, full, leaf=_sharded, exact=False)

    if "" in entries:
        return walk(tree), placeholders
    out = _same_kind(tree)
    for k, v in tree.items():
        out[k] = walk(v) if k in entries else v
    return out, placeholders


def without(tree: Any, entries: Sequence[str]) -> Any:
    """``tree`` without ``entries`` (a copy of the top-level dict)."""
    out = _same_kind(tree)
    for k, v in tree.items():
        if k not in entries:
            out[k] = v
    return out


def _same_kind(obj: dict[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
    for name, value in getattr(obj, "__dict__", {}).items():  # _metadata of an OrderedDict
        setattr(out, name, value)
    return out


def _named(entry: str) -> str:
    return f"'{entry}'" if entry else "the optimizer state dict"


def left_out_note(entry: str, count: int) -> str:
    """The note of a merge that did not write ``entry``'s sharded optimizer state."""
    return (
        f"left out {_named(entry)}: {_WHAT} ({count} ShardedTensor(s)); pass optimizer=True to consolidate it (off "
        f"by default: it can be several times the model)"
    )


def consolidated_note(entry: str, count: int) -> str:
    """The note of a merge that wrote ``entry``'s sharded optimizer state consolidated."""
    return (
        f"consolidated {_named(entry)}: {_WHAT}, {count} ShardedTensor(s) reassembled, step and param_groups equal "
        f"on every rank; keyed by parameter name, as FSDP.optim_state_dict gives it under FULL_STATE_DICT"
    )


def no_optimizer_message(path: str) -> str:
    """``optimizer=True`` on files that hold no sharded optimizer state: a usage error naming the file."""
    return (
        f"{path}: holds no {_WHAT} (ShardedTensors outside the model state dict); optimizer=True consolidates FSDP1 "
        f"SHARDED_STATE_DICT rank files' optimizer state: drop optimizer=True (other entries are kept as they are)"
    )


def alone_message(path: str) -> str:
    """Rank files holding only sharded optimizer state, merged without ``optimizer=True``."""
    return f"{path}: holds {_WHAT} alone (no model state dict); pass optimizer=True to consolidate it"


__all__ = [
    "alone_message",
    "check_beside_shards",
    "consolidated",
    "consolidated_note",
    "in_entries",
    "left_out_note",
    "no_optimizer_message",
    "outside_entries",
    "without",
]
