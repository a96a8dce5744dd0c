"""Merge per-rank checkpoints of one DDP run into one checkpoint.

With buffer broadcasting off (``DistributedDataParallel(m, broadcast_buffers=False)``) and no SyncBatchNorm,
every rank keeps its own BatchNorm running statistics while the parameters stay identical (the gradient
all-reduce keeps them so). Merging checks the parameters, then combines the statistics as if the ranks'
data shards had been one batch: means averaged, variances pooled.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix import layouts
from ckptfix.checkpoint import apply_maps, model_entries
from ckptfix.diff import tensor_diff
from ckptfix.errors import MergeError

if TYPE_CHECKING:
    import torch

BUFFER_STRATEGIES: tuple[str, ...] = ("pooled", "mean", "rank0")
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "bn_modules": self.bn_modules,
            "buffers_merged": self.buffers_merged,
            "diverged": [{"key": d.key, "max_abs": d.max_abs, "ranks": d.ranks} for d in self.diverged],
            "warnings": self.warnings,
            "kept_from_first": self.kept_from_first,
            "layouts_from": self.layouts_from,
        }


def merge(
    states: Sequence[Any],
    *,
    buffers: str = "pooled",
    atol: float = 0.0,
    to: str = "single",
    buffer_keys: Iterable[str] = (),
) -> Any:
    """Merge per-rank state dicts or full checkpoints (any layout, mixed) into one, in layout ``to``.

    Parameters must agree within ``atol``; BatchNorm statistics are merged by ``buffers`` (``pooled``,
    ``mean`` or ``rank0``). Other keys named in ``buffer_keys`` (single-layout names) that differ follow
    ``buffers`` too when floating. Warnings (duplicate ranks, a lone input, differing step counts) are issued
    with :mod:`warnings`.

    >>> merged = ckptfix.merge([torch.load(f"rank{r}.pt") for r in range(4)])
    """
    result = plan_merge(states, buffers=buffers, atol=atol, to=to, buffer_keys=buffer_keys)
    if result.diverged:
        first = result.diverged[0]
        raise MergeError(
            f"{len(result.diverged)} key(s) differ across ranks, e.g. '{first.key}' "
            f"(max |Δ| {first.max_abs:.3g} on {', '.join(first.ranks)}); parameters of one DDP run are "
            f"equal on every rank: check these are files of the same step, or pass a larger atol"
        )
    for message in result.warnings:
        warnings.warn(message, stacklevel=2)
    return result.obj


def plan_merge(
    objs: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    buffers: str = "pooled",
    atol: float = 0.0,
    to: str = "single",
    buffer_keys: Iterable[str] = (),
) -> MergeResult:
    """Merge like :func:`merge`, but return divergences and warnings as data instead of raising/warning.

    ``names`` label the inputs in messages (file paths in the CLI; ``rank0``, ``rank1`` … by default).
    Raises :class:`MergeError` for inputs that cannot be merged at all (different keys, shapes, dtypes).
    """
    if buffers not in BUFFER_STRATEGIES:
        raise MergeError(f"unknown buffer strategy '{buffers}': choose one of {', '.join(BUFFER_STRATEGIES)}")
    if to not in layouts.LAYOUTS:
        raise MergeError(f"unknown layout '{to}': choose one of {', '.join(layouts.TARGETS)}")
    if not objs:
        raise MergeError("no inputs to merge; give one checkpoint per rank")
    labels = list(names) if names is not None else [f"rank{i}" for i in range(len(objs))]
    result = MergeResult()
    if len(objs) == 1:
        result.warnings.append(f"only one input ({labels[0]}): nothing to merge, the output is a converted copy")
    pairs = _entry_pairs(objs, labels)
    merged: dict[str, Any] = {}
    for entry, states in pairs.items():
        where = [f"{label}[{entry!r}]" if entry else label for label in labels]
        singles = []
        for state, label in zip(states, where, strict=True):
            found, maps = layouts.conversion_maps(list(state.keys()), to="single", source=label)
            result.layouts_from.append(found.name)
            singles.append(apply_maps(state, maps, source=label))
        state = _merge_entry(singles, where, labels, result, buffers=buffers, atol=atol, buffer_keys=set(buffer_keys))
        _, maps = layouts.conversion_maps(list(state.keys()), to=to, source=where[0])
        merged[entry] = apply_maps(state, maps, source=where[0])
    result.entries = list(pairs)
    if result.diverged:
        return result
    if list(pairs) == [""]:
        result.obj = merged[""]
        return result
    first = objs[0]
    out = type(first)() if isinstance(first, OrderedDict) else {}
    for key, value in first.items():
        out[key] = merged.get(key, value)
        if key not in merged:
            result.kept_from_first.append(str(key))
    result.obj = out
    return result


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


def _merge_entry(
    states: list[OrderedDict[str, Any]],
    where: list[str],
    labels: list[str],
    result: MergeResult,
    *,
    buffers: str,
    atol: float,
    buffer_keys: set[str],
) -> OrderedDict[str, Any]:
    import torch

    first = states[0]
    _check_same_structure(states, where)
    prefixes = sorted(_bn_prefixes(first.keys()))
    stats = {p + s for p in prefixes for s in (_MEAN, _VAR, _COUNT)}
    out: OrderedDict[str, Any] = OrderedDict()
    counts_differ: list[str] = []
    for key, value in first.items():
        column = [s[key] for s in states]
        if key in stats:
            out[key] = value  # replaced below, module by module; keeps the key order
            if key.endswith(_COUNT) and not all(torch.equal(v, value) for v in column[1:]):
                counts_differ.append(key)
                out[key] = torch.stack(list(column)).max(dim=0).values
            continue
        off = [tensor_diff(v, value, atol=atol, rtol=0.0) for v in column[1:]]
        bad = [labels[i] for i, d in enumerate(off, start=1) if d is not None]
        if not bad:
            out[key] = value  # bit-identical to rank 0, as the issue promises for parameters
        elif key in buffer_keys and value.is_floating_point():
            out[key] = value if buffers == "rank0" else _mean(column).to(value.dtype)
            result.buffers_merged.append(key)
        else:
            result.diverged.append(Divergence(key, max(d[0] for d in off if d is not None), bad))
    for prefix in prefixes:
        means = [s[prefix + _MEAN] for s in states]
        variances = [s[prefix + _VAR] for s in states]
        if not (means[0].is_floating_point() and variances[0].is_floating_point()):
            raise MergeError(f"{where[0]}: '{prefix}{_MEAN}' is not floating point; cannot merge statistics")
        mean, var = _merge_stats(means, variances, buffers=buffers)
        out[prefix + _MEAN], out[prefix + _VAR] = mean, var
        result.bn_modules.append(prefix[:-1] if prefix else "(root)")
    if counts_differ:
        example = counts_differ[0]
        result.warnings.append(
            f"num_batches_tracked differs across ranks for {len(counts_differ)} module(s), e.g. '{example}' "
            f"{[int(s[example].item()) for s in states]}: kept the maximum"
        )
    result.warnings.extend(_duplicates(states, labels, stats))
    metadata = getattr(first, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _check_same_structure(states: list[OrderedDict[str, Any]], where: list[str]) -> None:
    first = states[0]
    for state, label in zip(states[1:], where[1:], strict=True):
        only_first = [k for k in first if k not in state]
        only_here = [k for k in state if k not in first]
        if only_first or only_here:
            detail = f"'{only_first[0]}' only in {where[0]}" if only_first else f"'{only_here[0]}' only in {label}"
            raise MergeError(
                f"{label}: keys differ from {where[0]} ({len(only_first)} only there, "
                f"{len(only_here)} only here; {detail}); per-rank files of one run hold the same keys"
            )
        for key, value in first.items():
            other = state[key]
            if tuple(other.shape) != tuple(value.shape) or other.dtype != value.dtype:
                raise MergeError(
                    f"{label}: '{key}' is {list(other.shape)} {other.dtype} but "
                    f"{list(value.shape)} {value.dtype} in {where[0]}; per-rank files of one run hold "
                    f"the same shapes and dtypes"
                )


def _mean(column: Sequence[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.stack([v.to(torch.float64) for v in column]).mean(dim=0)


def _merge_stats(
    means: Sequence[torch.Tensor], variances: Sequence[torch.Tensor], *, buffers: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running mean and variance of the union of equally sized shards, computed in float64."""
    import torch

    if buffers == "rank0" or (
        all(torch.equal(m, means[0]) for m in means) and all(torch.equal(v, variances[0]) for v in variances)
    ):
        return means[0], variances[0]
    stacked = torch.stack([m.to(torch.float64) for m in means])
    mean = stacked.mean(dim=0)
    var = _mean(variances)
    if buffers == "pooled":
        # law of total variance: within-shard variance plus the spread of the shard means
        var = var + ((stacked - mean) ** 2).mean(dim=0)
    return mean.to(means[0].dtype), var.to(variances[0].dtype)


def _duplicates(states: list[OrderedDict[str, Any]], where: list[str], stats: set[str]) -> list[str]:
    import torch

    # Statistics first: on real per-rank files they differ, so the comparison stops early.
    order = sorted(states[0], key=lambda k: k not in stats)
    found = []
    for j in range(1, len(states)):
        for i in range(j):
            if all(torch.equal(states[i][k], states[j][k]) for k in order):
                found.append(
                    f"{where[j]} is identical to {where[i]} (the same file twice, or buffers were synced); "
                    f"it adds nothing to the merge"
                )
                break
    return found
