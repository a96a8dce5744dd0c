"""Compare two checkpoints after normalising their layouts: keys, shapes, dtypes, values, other entries."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import LayoutError
from ckptfix.formats.opened import Opened, in_memory
from ckptfix.formats.output.atomic import PathLike
from ckptfix.formats.pickles import inert
from ckptfix.formats.raw import as_tensor, resolved
from ckptfix.formats.records import is_record, spec
from ckptfix.formats.registry import read
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.torchio import opaque
from ckptfix.formats.torchio.opaque import OpaqueEntry
from ckptfix.reading import open_checkpoint
from ckptfix.transforms import layouts
from ckptfix.transforms.checkpoint import apply_maps, get_entry, is_state_dict, is_tensor, model_entries

if TYPE_CHECKING:
    import torch

_REPR_WIDTH = 60


@dataclass
class ValueDiff:
    """A tensor present in both with the same shape whose values differ beyond the tolerance."""

    key: str
    max_abs: float
    max_rel: float


@dataclass
class EntryDiff:
    """The differences of one model state dict (entry ``""`` is a bare state dict)."""

    entry_a: str
    entry_b: str
    layout_a: str
    layout_b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    shape: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    dtype: dict[str, tuple[str, str]] = field(default_factory=dict)
    values: list[ValueDiff] = field(default_factory=list)
    compared: int = 0

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.shape or self.dtype or self.values)


@dataclass
class OtherDiff:
    """A non-model entry (or part of one, ``optimizer.state.0.step``) that differs."""

    path: str
    a: str
    b: str


@dataclass
class DiffReport:
    """Everything :func:`diff` found; ``equal`` means equal within tolerance after layout normalisation."""

    a: str
    b: str
    atol: float
    rtol: float
    entries: list[EntryDiff] = field(default_factory=list)
    other: list[OtherDiff] = field(default_factory=list)
    others_compared: bool = True  # False when one model entry was picked (``entry=``): the rest is not compared
    not_loaded: dict[str, dict[str, str]] = field(default_factory=dict)  # "a"/"b" -> opaque entry -> what it holds

    @property
    def equal(self) -> bool:
        return not self.other and all(e.equal for e in self.entries)

    @property
    def layouts_differ(self) -> bool:
        return any(e.layout_a != e.layout_b for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "atol": self.atol,
            "rtol": self.rtol,
            "layouts_differ": self.layouts_differ,
            "entries": [
                {
                    "entry_a": e.entry_a,
                    "entry_b": e.entry_b,
                    "layout_a": e.layout_a,
                    "layout_b": e.layout_b,
                    "equal": e.equal,
                    "compared": e.compared,
                    "only_a": e.only_a,
                    "only_b": e.only_b,
                    "shape": {k: {"a": a, "b": b} for k, (a, b) in e.shape.items()},
                    "dtype": {k: {"a": a, "b": b} for k, (a, b) in e.dtype.items()},
                    "values": [
                        {"key": v.key, "max_abs": json_number(v.max_abs), "max_rel": json_number(v.max_rel)}
                        for v in e.values
                    ],
                }
                for e in self.entries
            ],
            "other": [{"path": o.path, "a": o.a, "b": o.b} for o in self.other],
            "others_compared": self.others_compared,
            "not_loaded": self.not_loaded,
        }

    def to_json(self) -> dict[str, Any]:
        """``diff --json`` (docs/json.md): :meth:`to_dict` and the exit code, 0 equal, 1 different."""
        return {
            **self.to_dict(),
            "atol": json_number(self.atol),
            "rtol": json_number(self.rtol),
            "exit_code": 0 if self.equal else 1,
        }


def json_number(x: float) -> float | str:
    """``x``, or ``"inf"``, ``"-inf"``, ``"nan"``: JSON has no such numbers, and strict JSON is what any language's
    parser reads."""
    return x if math.isfinite(x) else str(x)


@deep
def diff(
    a: Any,
    b: Any,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    names: Sequence[str] = ("A", "B"),
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
) -> DiffReport:
    """Compare two loaded checkpoints (state dicts or full checkpoints, any layouts).

    Model entries are compared key by key after converting both to the ``single`` layout; every other entry
    is compared as data. Tensors are equal when ``|a - b| <= atol + rtol·|b|`` everywhere and dtypes agree.
    ``entry`` compares only that model entry (on each side that has it; a side with one state dict uses it) and
    no other entries; each of ``strip_prefixes`` is removed from the side(s) whose every key starts with it, so a
    Lightning ``.ckpt`` (``model.`` keys under ``state_dict``) compares with its extracted weights.

    >>> report = ckptfix.diff(torch.load("a.pt"), torch.load("b.pt"), atol=1e-6)
    >>> report.equal
    """
    return compare(
        in_memory(a, source=names[0]),
        in_memory(b, source=names[1]),
        atol=atol,
        rtol=rtol,
        entry=entry,
        strip_prefixes=strip_prefixes,
    )


@deep
def diff_files(
    a: PathLike,
    b: PathLike,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
) -> DiffReport:
    """:func:`diff` of two files or folders, read one tensor at a time: memory stays at two tensors whatever the
    checkpoints' size.

    Byte-equal tensors are recognised without converting them; |Δ| is computed, in chunks, only for tensors
    whose bytes differ. Every tensor's zip record has its CRC checked as it is read. A folder (transformers
    shards or their index, an accelerate ``save_state`` folder, a DCP folder) is read file by file. Entries that
    need globals outside the allowlist (an mmengine ``message_hub``) are not loaded: they are compared as their
    pickle records, nothing run, and listed in the report's ``not_loaded``; the model entries must not be such.
    """
    allowed = tuple(allow_globals)
    with (
        open_checkpoint(a, allow_globals=allowed, unsafe=unsafe, opaque=True) as first,
        open_checkpoint(b, allow_globals=allowed, unsafe=unsafe, opaque=True) as second,
    ):
        for side in (first, second):  # the entries compared as models must be loaded ones
            opaque.require(side.tree, wanted=[entry] if entry is not None else None, source=side.source)
        if first.described != second.described:
            # an inert description and a loaded object spell allowlisted objects differently: load both
            first, second = (_loaded(x, allow_globals=allowed, unsafe=unsafe) for x in (first, second))
        report = compare(first, second, atol=atol, rtol=rtol, entry=entry, strip_prefixes=strip_prefixes)
        for name, side in (("a", first), ("b", second)):
            if found := opaque.not_loaded(side.tree):
                report.not_loaded[name] = found
        return report


def _loaded(opened: Opened, *, allow_globals: tuple[str, ...], unsafe: bool) -> Opened:
    if not opened.described:
        return opened
    obj = read(opened.source, fmt=opened.fmt, allow_globals=allow_globals, unsafe=unsafe, opaque=True)
    return Opened(source=opened.source, fmt=opened.fmt, tree=obj, note="compared with a file loaded with torch")


def compare(
    a: Opened,
    b: Opened,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
) -> DiffReport:
    """The comparison behind :func:`diff` and :func:`diff_files`, on two opened checkpoints."""
    from ckptfix.formats.rankfile import refuse_rank_file

    for side in (a, b):  # a lone ZeRO-3 module file: [0] placeholders would compare as weights
        refuse_rank_file(side.tree, source=side.source, model=False)
    report = DiffReport(a=a.source, b=b.source, atol=atol, rtol=rtol, others_compared=entry is None)
    pairs = _pairs(a, b, entry=entry)
    strips = _strips(a, b, pairs, list(strip_prefixes))
    for ea, eb in pairs:
        report.entries.append(_diff_entry(a, b, ea, eb, strips=strips, atol=atol, rtol=rtol))
    if entry is not None:
        return report
    paired_a, paired_b = {p[0] for p in pairs}, {p[1] for p in pairs}
    rest_a, rest_b = _rest(a.tree, paired_a), _rest(b.tree, paired_b)
    sides = _Sides(a, b, atol=atol, rtol=rtol)
    if not model_entries(a.tree) and not model_entries(b.tree):
        sides.compare(a.tree, b.tree, "", report.other)
    else:
        sides.compare(rest_a, rest_b, "", report.other)
    return report


def _rest(obj: Any, paired: set[str]) -> Any:
    if is_state_dict(obj) or not isinstance(obj, Mapping):
        return {}
    return {k: v for k, v in obj.items() if k not in paired}


def _pairs(a: Opened, b: Opened, *, entry: str | None) -> list[tuple[str, str]]:
    ents_a, ents_b = model_entries(a.tree), model_entries(b.tree)
    if entry is not None:
        found = [_named_entry(side, ents, entry) for side, ents in ((a, ents_a), (b, ents_b))]
        if found[0] is None and found[1] is None:
            listed = "; ".join(f"{side.source}: {_entry_list(ents)}" for side, ents in ((a, ents_a), (b, ents_b)))
            raise LayoutError(f"neither file has a model entry '{entry}' ({listed}); pick one that exists")
        for side, ents, got in ((a, ents_a, found[0]), (b, ents_b, found[1])):
            if got is None and len(ents) != 1:
                raise LayoutError(
                    f"{side.source}: no model entry '{entry}' and not one state dict to compare with it "
                    f"({_entry_list(ents)})"
                )
        return [(found[0] if found[0] is not None else ents_a[0], found[1] if found[1] is not None else ents_b[0])]
    pairs = [(e, e) for e in ents_a if e in ents_b]
    if not pairs and len(ents_a) == 1 and len(ents_b) == 1:
        pairs = [(ents_a[0], ents_b[0])]
    return pairs


def _named_entry(side: Opened, entries: list[str], name: str) -> str | None:
    obj = side.tree
    if name in entries:
        return name
    if isinstance(obj, Mapping) and name in obj and is_state_dict(obj[name]):
        return name  # a state dict under a name model_entries does not guess
    return None


def _entry_list(entries: list[str]) -> str:
    if entries == [""]:
        return "a bare state dict"
    return f"model entries: {', '.join(entries)}" if entries else "no model entry"


def _strips(a: Opened, b: Opened, pairs: list[tuple[str, str]], prefixes: list[str]) -> tuple[list[str], list[str]]:
    """Which prefixes to strip on each side: each one where every key of that side's entry starts with it."""
    out: tuple[list[str], list[str]] = ([], [])
    keys = [[list(get_entry(side.tree, p[i]).keys()) for p in pairs] for i, side in enumerate((a, b))]
    for prefix in prefixes:
        hit = False
        for i in (0, 1):
            if keys[i] and all(ks and all(k.startswith(prefix) for k in ks) for ks in keys[i]):
                out[i].append(prefix)
                keys[i] = [[k[len(prefix) :] for k in ks] for ks in keys[i]]
                hit = True
        if not hit:
            raise LayoutError(
                f"strip_prefixes='{prefix}' matches neither {a.source} nor {b.source}: every key of a side's "
                f"model entry must start with it"
            )
    return out


def _single(state: Mapping[str, Any], strips: list[str], *, source: str) -> tuple[str, Mapping[str, Any]]:
    staged = apply_maps(state, [layouts.strip_prefix(p) for p in strips], source=source)
    found, maps = layouts.conversion_maps(list(staged.keys()), to="single", source=source)
    return found.name, apply_maps(staged, maps, source=source)


def _diff_entry(
    a: Opened, b: Opened, ea: str, eb: str, *, strips: tuple[list[str], list[str]], atol: float, rtol: float
) -> EntryDiff:
    layout_a, sa = _single(get_entry(a.tree, ea), strips[0], source=f"{a.source}[{ea!r}]" if ea else a.source)
    layout_b, sb = _single(get_entry(b.tree, eb), strips[1], source=f"{b.source}[{eb!r}]" if eb else b.source)
    out = EntryDiff(entry_a=ea, entry_b=eb, layout_a=layout_a, layout_b=layout_b)
    out.only_a = [k for k in sa if k not in sb]
    out.only_b = [k for k in sb if k not in sa]
    for key, x in sa.items():
        if key not in sb:
            continue
        y = sb[key]
        out.compared += 1
        if not (is_tensor(x) and is_tensor(y)):
            if not _Sides(a, b, atol=atol, rtol=rtol).equal(x, y):
                out.values.append(ValueDiff(key, math.inf, math.inf))
            continue
        sx, sy = spec(x), spec(y)
        if sx.shape != sy.shape:
            out.shape[key] = (list(sx.shape), list(sy.shape))
            continue
        if sx.dtype != sy.dtype:
            out.dtype[key] = (sx.dtype, sy.dtype)
        found = tensor_diff(a.raw(x), b.raw(y), atol=atol, rtol=rtol)
        if found is not None:
            out.values.append(ValueDiff(key, *found))
    return out


_CHUNK = 1 << 20  # elements per step of the |Δ| computation: its float64 temporaries stay a few MB


def same_bytes(x: Any, y: Any) -> bool:
    """True when two tensors of one dtype and shape hold the same bytes (NaNs included), without converting them.

    ``memcmp`` on CPU: ``torch.equal`` compares values (NaN never equals itself) and on bytes is several times
    slower than the memory itself. Two :class:`~ckptfix.formats.raw.RawTensor` are compared without torch. A neg
    or conj view is compared by its values' bytes (:func:`~ckptfix.formats.raw.resolved`), as torch.load gives it.
    """
    if is_record(x) and (same := x.same_bytes(y)) is not None:
        return bool(same)
    import torch

    x, y = resolved(as_tensor(x)), resolved(as_tensor(y))  # a neg or conj view's bytes are not its values
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.device.type != "cpu" or y.device.type != "cpu":
        # On a GPU (or one tensor there, one here): the bits compared on x's device.
        return x.numel() == 0 or bool(torch.equal(_bits(x), _bits(y.to(x.device))))
    x, y = x.contiguous(), y.contiguous()
    n = x.numel() * x.element_size()
    return n == 0 or _memcmp(x.data_ptr(), y.data_ptr(), n) == 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _memcmp(a: int, b: int, n: int) -> int:
    global _MEMCMP
    if _MEMCMP is None:
        import ctypes

        func = ctypes.CDLL(None).memcmp
        func.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        func.restype = ctypes.c_int
        _MEMCMP = func
    return int(_MEMCMP(a, b, n))


_MEMCMP: Any = None


def tensor_diff(x: Any, y: Any, *, atol: float, rtol: float) -> tuple[float, float] | None:
    """``(max |Δ|, max |Δ|/|y|)`` when same-shaped ``x`` and ``y`` differ beyond tolerance, else None.

    NaNs and infinities in the same places count as equal; a nonzero difference where ``y`` is 0 has relative
    difference inf. Equal bytes are recognised first (two :class:`~ckptfix.formats.raw.RawTensor` without torch);
    the difference itself is computed, with torch, in chunks.
    """
    if x.numel() == 0 or same_bytes(x, y):
        return None
    import torch

    x, y = as_tensor(x), as_tensor(y)
    if not (x.is_floating_point() or x.is_complex() or y.is_floating_point() or y.is_complex()):
        return _integer_diff(x.reshape(-1), y.reshape(-1), atol=atol, rtol=rtol)
    wide = torch.complex128 if (x.is_complex() or y.is_complex()) else torch.float64
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    within, worst, worst_rel = True, 0.0, 0.0
    for start in range(0, flat_x.numel(), _CHUNK):
        xa = flat_x[start : start + _CHUNK].to(wide)
        ya = flat_y[start : start + _CHUNK].to(device=xa.device, dtype=wide)
        # inf - inf is NaN, so equal infinities are found by ==, not by their difference.
        same = (xa == ya) | (torch.isnan(xa) & torch.isnan(ya))
        delta = (xa - ya).abs().to(torch.float64)
        # One NaN against a number is an infinite difference, not a NaN that comparisons would let through.
        delta = torch.where(torch.isnan(delta), torch.full_like(delta, float("inf")), delta)
        delta = torch.where(same, torch.zeros_like(delta), delta)
        scale = ya.abs().to(torch.float64)
        scale = torch.where(torch.isnan(scale), torch.zeros_like(scale), scale)
        within = within and bool((same | (delta <= atol + rtol * scale)).all())
        rel = torch.where(delta == 0, torch.zeros_like(delta), delta / scale)
        worst = _nan_max(worst, float(delta.max().item()))
        worst_rel = _nan_max(worst_rel, float(rel.max().item()))
    return None if within else (worst, worst_rel)


def _integer_diff(x: torch.Tensor, y: torch.Tensor, *, atol: float, rtol: float) -> tuple[float, float] | None:
    """:func:`tensor_diff` of integer (or bool) tensors, as integers: a cast to float64 would make 2^53 and
    2^53 + 1 one value. |Δ| is exact (computed from halves, so int64's extremes do not overflow); only the
    tolerance test and the relative difference are in float64."""
    import torch

    within, worst, worst_rel = True, 0, 0.0
    for start in range(0, x.numel(), _CHUNK):
        (xa, x0), (ya, y0) = (_as_int64(t[start : start + _CHUNK].to(x.device)) for t in (x, y))
        if x0 != y0:  # uint64 against a signed type: no common int64, Python's ints instead
            pairs = zip(x[start : start + _CHUNK].tolist(), y[start : start + _CHUNK].tolist(), strict=True)
            found = [abs(a - b) for a, b in pairs]
            delta = torch.tensor([float(d) for d in found], dtype=torch.float64, device=xa.device)
            worst = max(worst, *found)
        else:
            hi, lo = torch.maximum(xa, ya), torch.minimum(xa, ya)
            half, odd = (hi >> 1) - (lo >> 1), (hi & 1) - (lo & 1)  # hi - lo == 2 * half + odd
            top = half.max()
            worst = max(worst, 2 * int(top) + int(odd[half == top].max()))
            delta = half.to(torch.float64) * 2 + odd.to(torch.float64)
        scale = (ya.to(torch.float64) + y0).abs()
        within = within and bool((delta <= atol + rtol * scale).all())
        rel = torch.where(delta == 0, torch.zeros_like(delta), delta / scale)
        worst_rel = max(worst_rel, float(rel.max()))
    return None if within else (float(worst), worst_rel)


def _as_int64(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``t`` as int64 and the offset its values are stored less: uint64 as its bits with the top one flipped
    (``v - 2^63``, in the same order and at the same distances), every other integer type as itself."""
    import torch

    if t.dtype == getattr(torch, "uint64", None):
        return t.view(torch.int64) ^ torch.iinfo(torch.int64).min, 2.0**63
    return t.to(torch.int64), 0.0


def _nan_max(a: float, b: float) -> float:
    # as torch.max over the whole tensor: a NaN anywhere is the maximum
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)


def _short(value: Any) -> str:
    if isinstance(value, OpaqueEntry):
        return f"not loaded ({value.what()})"
    if is_tensor(value):
        found = spec(value)
        return f"tensor{list(found.shape)} {found.dtype}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} of {len(value)} entries"
    if isinstance(value, (list, tuple)) and len(repr(value)) > _REPR_WIDTH:
        return f"{type(value).__name__} of {len(value)} items"
    text = _inert_repr(value) if isinstance(value, (inert.Inert, type)) else repr(value)
    return text if len(text) <= _REPR_WIDTH else text[: _REPR_WIDTH - 1] + "…"


def _inert_repr(value: Any) -> str:
    """How the object an inert record stands for prints (``Namespace(lr=0.1)``), as far as it matters here."""
    if isinstance(value, type):
        return value.full if issubclass(value, inert.Global) else repr(value)
    if not isinstance(value, inert.Inert):
        return repr(value)
    if value.func.full == "torch.Size" and value.args:
        return f"torch.Size({list(value.args[0])})"
    if value.func.full == "_codecs.encode" and len(value.args) == 2:
        return repr(str(value.args[0]).encode("latin1"))
    if value.newobj and not value.args and isinstance(value.state, dict):
        # a plain object rebuilt from its __dict__ prints its fields, as Namespace and dataclasses do
        fields = ", ".join(f"{k}={_inert_repr(v)}" for k, v in value.state.items())
        return f"{value.func.name}({fields})"
    return f"{value.func.name}({', '.join(_inert_repr(a) for a in value.args)})"


def _as_loaded(value: Any) -> Any:
    """The value loading builds, for the inert records whose value is plain data (torch.Size, bytes)."""
    if isinstance(value, inert.Inert) and not is_record(value) and not value.has_state:
        if value.func.full == "torch.Size" and len(value.args) == 1 and isinstance(value.args[0], (list, tuple)):
            return tuple(value.args[0])
        if value.func.full == "_codecs.encode" and len(value.args) == 2 and isinstance(value.args[0], str):
            return value.args[0].encode("latin1")
    return value


class _Sides:
    """Deep comparison of two checkpoints' other entries, tensors read from their own files."""

    def __init__(self, a: Opened, b: Opened, *, atol: float, rtol: float) -> None:
        self.a, self.b, self.atol, self.rtol = a, b, atol, rtol

    def equal(self, x: Any, y: Any) -> bool:
        found: list[OtherDiff] = []
        self.compare(x, y, "", found)
        return not found

    def compare(self, x: Any, y: Any, path: str, out: list[OtherDiff]) -> None:
        """Append to ``out`` every leaf under ``path`` that differs between ``x`` and ``y``."""
        here = path or "(top level)"
        x, y = _as_loaded(x), _as_loaded(y)
        if isinstance(x, OpaqueEntry) and isinstance(y, OpaqueEntry):
            x, y = x.records, y.records  # neither was built: the same records are the same value
        elif isinstance(x, OpaqueEntry) or isinstance(y, OpaqueEntry):
            out.append(OtherDiff(here, _short(x), _short(y)))  # one built, one not: nothing to compare them by
            return
        if is_tensor(x) and is_tensor(y):
            sx, sy = spec(x), spec(y)
            if sx != sy:
                out.append(OtherDiff(here, _short(x), _short(y)))
                return
            found = tensor_diff(self.a.raw(x), self.b.raw(y), atol=self.atol, rtol=self.rtol)
            if found is not None:
                out.append(OtherDiff(here, f"{_short(x)}", f"values differ (max |Δ| {found[0]:.3g})"))
            return
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            for key in [*x.keys(), *(k for k in y if k not in x)]:
                sub = f"{path}.{key}" if path else str(key)
                if key not in y:
                    out.append(OtherDiff(sub, _short(x[key]), "(absent)"))
                elif key not in x:
                    out.append(OtherDiff(sub, "(absent)", _short(y[key])))
                else:
                    self.compare(x[key], y[key], sub, out)
            return
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            for i, (xi, yi) in enumerate(zip(x, y, strict=True)):
                self.compare(xi, yi, f"{path}.{i}" if path else str(i), out)
            return
        if not self._same_leaf(x, y):
            out.append(OtherDiff(here, _short(x), _short(y)))

    def _same_leaf(self, x: Any, y: Any) -> bool:
        if isinstance(x, inert.Inert) and isinstance(y, inert.Inert):
            # an allowlisted object, never built: the same call with equal arguments and state
            return (
                x.func.full == y.func.full
                and x.newobj == y.newobj
                and self.equal(x.args, y.args)
                and self.equal(x.state, y.state)
            )
        if isinstance(x, type) and isinstance(y, type) and issubclass(x, inert.Global):
            return issubclass(y, inert.Global) and x.full == y.full
        try:
            return bool(type(x) is type(y) and x == y)
        except Exception:  # objects whose == raises or is ambiguous (arrays): treat as different, show both
            return False
