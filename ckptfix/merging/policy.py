"""How a merge combines its inputs' values, key by key: the policy of :mod:`ckptfix.merging.files`.

Parameters must be equal on every rank (within ``atol``; bytes compared first, |Δ| only where they differ).
BatchNorm statistics are merged by the buffer strategy: ``pooled`` (means averaged, variances pooled: the mean of
the variances plus the variance of the means, as if the ranks' data shards had been one batch), ``mean``, or
``rank0``; ``num_batches_tracked`` is kept, or the maximum when ranks differ. Averaging (``weights``) makes every
floating tensor the weighted mean, accumulated in float64, and takes the rest from the last input. Inputs are
:class:`~ckptfix.formats.opened.Opened` (files, folders, rank files whose shards read as full tensors, or objects in
memory); :class:`Merger` reads one key from every input at a time and hands each result on, to memory
(:func:`merged_in_memory`) or to a streaming writer (:func:`stream_merged`).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.diffing import json_number, same_bytes, tensor_diff
from ckptfix.errors import AverageError, MergeError, UsageError
from ckptfix.formats.opened import Opened
from ckptfix.formats.raw import as_tensor
from ckptfix.formats.records import is_record, spec
from ckptfix.transforms import layouts
from ckptfix.transforms.checkpoint import apply_maps, is_tensor, model_entries, same_kind
from ckptfix.writing import Placeholder

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
    """What :func:`~ckptfix.merging.files.plan_merge` found and built; ``obj`` is None when ``diverged`` is not
    empty."""

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
    # the input the others are compared with and the other entries come from: rank 0 (as the files record it, see
    # _recorded_order and rank_files.in_rank_order; else the first given), or the last input when averaging
    base: str = ""

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

    def to_json(self, inputs: Sequence[str], output: str, *, layout: str, buffers: str, atol: float) -> dict[str, Any]:
        """``merge --json`` (docs/json.md): the facts of :meth:`to_dict` with what was merged into what, and how."""
        return {
            "inputs": list(inputs),
            "output": output,
            "written": not self.diverged,
            "layout": layout,
            "buffers": buffers,  # how differing BatchNorm statistics (and, with --model, other buffers) were combined
            "atol": json_number(atol),
            "parameters_match": not self.diverged,
            **self.to_dict(),
            # a non-tensor value that differs has max |Δ| inf, which JSON cannot hold: spelt "inf", as diff spells it
            "diverged": [{"key": d.key, "max_abs": json_number(d.max_abs), "ranks": d.ranks} for d in self.diverged],
        }


def merged_in_memory(merger: Merger) -> MergeResult:
    """Run the merge and keep every result: ``obj`` is the merged checkpoint, unless the merge diverged."""
    collected: dict[tuple[int, str], Any] = {}
    merger.run(lambda entry, key, value: collected.__setitem__((entry, key), value))
    if not merger.result.diverged:
        merger.result.obj = merger.assemble(lambda entry, key, value: collected[entry, key])
    return merger.finish()


def stream_merged(merger: Merger, writer: Any, *, then: Callable[[Any], None] | None = None) -> None:
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


class _Diverged(Exception):  # noqa: N818 - a signal, not an error
    """Raised inside the output's block so that nothing is written."""


def check_options(count: int, *, buffers: str, to: str) -> str:
    if buffers not in BUFFER_STRATEGIES:
        raise UsageError(f"buffers={buffers!r}: unknown buffer strategy; choose one of {', '.join(BUFFER_STRATEGIES)}")
    layout = layouts.parse_layout(to)  # a UsageError (exit 2) names the layouts; DDP is ddp
    if not count:
        raise UsageError("no inputs to merge; give one checkpoint per rank")
    return str(layout)


def weights_of(
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
    Weights are finite and not negative, at least one above zero; they come back scaled by a power of two (exact)
    so that the largest is in [0.5, 1): neither the products nor the sum overflow, and subnormal weights are not
    lost (``5e-324,5e-324`` is ``1,1``)."""
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
        raise AverageError(f"weights: {bad[0]:g} is not a finite number; give one finite weight per input")
    some = "give weights of zero or more, at least one of them above zero"
    if negative := [w for w in given if w < 0.0]:
        raise AverageError(f"weights: {negative[0]:g} is negative; {some} (each is divided by their sum)")
    if not any(given):
        raise AverageError(f"weights: all are zero; {some} (each is divided by their sum)")
    exponent = math.frexp(max(given))[1]
    return [math.ldexp(w, -exponent) for w in given]


def _recorded_order(inputs: Sequence[Opened]) -> list[int] | None:
    """The inputs' order by the rank each records (``rank`` and ``world_size`` entries, as ckptfix's trainer saves
    them beside ``model``), or None when one records none: DDP files do not have to, and are then taken in the
    order given, the first as rank 0. Ranks given twice or a subset of the world are warned about, not refused."""
    ranks = []
    for opened in inputs:
        tree = opened.tree
        rank, world = (tree.get("rank"), tree.get("world_size")) if isinstance(tree, Mapping) else (None, None)
        if not (type(rank) is int and type(world) is int and 0 <= rank < world):
            return None
        ranks.append(rank)
    return sorted(range(len(ranks)), key=ranks.__getitem__)  # stable: a rank given twice keeps its order


def rank_order_note(given: Sequence[str], ordered: Sequence[str]) -> str | None:
    """What a merge says when it took its inputs as the ranks they record rather than in the order given."""
    if list(given) == list(ordered):
        return None
    return f"took the rank files as the ranks they record (rank 0: {ordered[0]}), not in the order given"


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


def _from_ranks(value: Any) -> bool:
    """Whether ``value`` is assembled from every rank's piece (a rank file's DTensor or ShardedTensor, a parameter
    cut from an FSDP1 flat parameter): computed, never compared across ranks."""
    return is_record(value) and value.rank_piece() is not None


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


class Merger:
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
        note = None
        if weights is not None:
            inputs, labels = inputs[::-1], labels[::-1]
        elif (order := _recorded_order(inputs)) is not None:
            inputs, given, labels = [inputs[i] for i in order], labels, [labels[i] for i in order]
            note = rank_order_note(given, labels)
        self.inputs, self.labels, self.buffers, self.atol, self.buffer_keys = inputs, labels, buffers, atol, buffer_keys
        self.model_only = model_only
        self.twins_warn = weights is None  # a checkpoint given twice is simply weighted twice
        self.result = MergeResult(weights=[w / self.weight_sum for w in weights or []], base=labels[0])
        self.result.notes.extend([note] if note else [])
        if len(inputs) == 1:
            self.result.warnings.append(
                f"only one input ({labels[0]}): nothing to merge, the output is a converted copy"
            )
        from ckptfix.formats.deepspeed.files import CONVERT_THE_RUN
        from ckptfix.formats.rankfile import refuse_rank_file

        for opened in inputs:  # lone ZeRO rank files: [0] placeholders, flat slices; the run's folder is the whole
            refuse_rank_file(opened.tree, source=opened.source, instead=CONVERT_THE_RUN)
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
        computed |= {k for k, v in first.items() if _from_ranks(v)}
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
