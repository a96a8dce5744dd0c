"""Compare two checkpoints after normalising their layouts: keys, shapes, dtypes, values, other entries."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix import layouts
from ckptfix.checkpoint import apply_maps, get_entry, is_state_dict, is_tensor, model_entries

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
                        {"key": v.key, "max_abs": _finite(v.max_abs), "max_rel": _finite(v.max_rel)} for v in e.values
                    ],
                }
                for e in self.entries
            ],
            "other": [{"path": o.path, "a": o.a, "b": o.b} for o in self.other],
        }


def _finite(x: float) -> float | str:
    # JSON has no inf/nan; spell them as strings so json.loads in any language reads the report.
    return x if math.isfinite(x) else str(x)


def diff(a: Any, b: Any, *, atol: float = 0.0, rtol: float = 0.0, names: Sequence[str] = ("A", "B")) -> DiffReport:
    """Compare two loaded checkpoints (state dicts or full checkpoints, any layouts).

    Model entries are compared key by key after converting both to the ``single`` layout; every other entry
    is compared as data. Tensors are equal when ``|a - b| <= atol + rtol·|b|`` everywhere and dtypes agree.

    >>> report = ckptfix.diff.diff(torch.load("a.pt"), torch.load("b.pt"), atol=1e-6)
    >>> report.equal
    """
    report = DiffReport(a=names[0], b=names[1], atol=atol, rtol=rtol)
    ents_a, ents_b = model_entries(a), model_entries(b)
    pairs = [(e, e) for e in ents_a if e in ents_b]
    if not pairs and len(ents_a) == 1 and len(ents_b) == 1:
        pairs = [(ents_a[0], ents_b[0])]
    for ea, eb in pairs:
        report.entries.append(_diff_entry(a, b, ea, eb, names=names, atol=atol, rtol=rtol))
    paired_a, paired_b = {p[0] for p in pairs}, {p[1] for p in pairs}
    rest_a = {} if is_state_dict(a) or not isinstance(a, Mapping) else {k: v for k, v in a.items() if k not in paired_a}
    rest_b = {} if is_state_dict(b) or not isinstance(b, Mapping) else {k: v for k, v in b.items() if k not in paired_b}
    if not ents_a and not ents_b:
        _compare(a, b, "", report.other, atol=atol, rtol=rtol)
    else:
        _compare(rest_a, rest_b, "", report.other, atol=atol, rtol=rtol)
    return report


def _single(state: Mapping[str, Any], *, source: str) -> tuple[str, Mapping[str, Any]]:
    found, maps = layouts.conversion_maps(list(state.keys()), to="single", source=source)
    return found.name, apply_maps(state, maps, source=source)


def _diff_entry(a: Any, b: Any, ea: str, eb: str, *, names: Sequence[str], atol: float, rtol: float) -> EntryDiff:
    layout_a, sa = _single(get_entry(a, ea), source=f"{names[0]}[{ea!r}]" if ea else names[0])
    layout_b, sb = _single(get_entry(b, eb), source=f"{names[1]}[{eb!r}]" if eb else names[1])
    out = EntryDiff(entry_a=ea, entry_b=eb, layout_a=layout_a, layout_b=layout_b)
    out.only_a = [k for k in sa if k not in sb]
    out.only_b = [k for k in sb if k not in sa]
    for key, x in sa.items():
        y = sb.get(key)
        if y is None:
            continue
        out.compared += 1
        if tuple(x.shape) != tuple(y.shape):
            out.shape[key] = (list(x.shape), list(y.shape))
            continue
        if x.dtype != y.dtype:
            out.dtype[key] = (_dtype(x), _dtype(y))
        found = tensor_diff(x, y, atol=atol, rtol=rtol)
        if found is not None:
            out.values.append(ValueDiff(key, *found))
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_diff(x: torch.Tensor, y: torch.Tensor, *, atol: float, rtol: float) -> tuple[float, float] | None:
    """``(max |Δ|, max |Δ|/|y|)`` when same-shaped ``x`` and ``y`` differ beyond tolerance, else None.

    NaNs and infinities in the same places count as equal; a nonzero difference where ``y`` is 0 has relative
    difference inf.
    """
    import torch

    if x.numel() == 0 or torch.equal(x, y):
        return None
    wide = torch.complex128 if (x.is_complex() or y.is_complex()) else torch.float64
    xa, ya = x.to(wide), y.to(wide)
    # inf - inf is NaN, so equal infinities are found by ==, not by their difference.
    same = (xa == ya) | (torch.isnan(xa) & torch.isnan(ya))
    delta = (xa - ya).abs().to(torch.float64)
    # One NaN against a number is an infinite difference, not a NaN that comparisons would let through.
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, float("inf")), delta)
    delta = torch.where(same, torch.zeros_like(delta), delta)
    scale = ya.abs().to(torch.float64)
    scale = torch.where(torch.isnan(scale), torch.zeros_like(scale), scale)
    if bool((same | (delta <= atol + rtol * scale)).all()):
        return None
    rel = torch.where(delta == 0, torch.zeros_like(delta), delta / scale)
    return float(delta.max().item()), float(rel.max().item())


def _short(value: Any) -> str:
    if is_tensor(value):
        return f"tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} of {len(value)} entries"
    if isinstance(value, (list, tuple)) and len(repr(value)) > _REPR_WIDTH:
        return f"{type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= _REPR_WIDTH else text[: _REPR_WIDTH - 1] + "…"


def _compare(x: Any, y: Any, path: str, out: list[OtherDiff], *, atol: float, rtol: float) -> None:
    """Append to ``out`` every leaf under ``path`` that differs between ``x`` and ``y``."""
    here = path or "(top level)"
    if is_tensor(x) and is_tensor(y):
        if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
            out.append(OtherDiff(here, _short(x), _short(y)))
        else:
            found = tensor_diff(x, y, atol=atol, rtol=rtol)
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
                _compare(x[key], y[key], sub, out, atol=atol, rtol=rtol)
        return
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        for i, (xi, yi) in enumerate(zip(x, y, strict=True)):
            _compare(xi, yi, f"{path}.{i}" if path else str(i), out, atol=atol, rtol=rtol)
        return
    try:
        same = bool(type(x) is type(y) and x == y)
    except Exception:  # objects whose == raises or is ambiguous (arrays): treat as different, show both
        same = False
    if not same:
        out.append(OtherDiff(here, _short(x), _short(y)))
