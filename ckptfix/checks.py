"""Compare a state dict with a model: missing, unexpected, wrong-shape and wrong-dtype keys, as data.

Also the pieces ``ckptfix validate`` needs: likely renames (same shape, a unique suffix match), the exact
``ckptfix convert`` command that fixes a layout-only or rename-only difference, and building a model from a
``package.module:factory`` spec.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix import layouts
from ckptfix.checkpoint import apply_maps, is_state_dict, model_entries
from ckptfix.errors import CkptfixError, LayoutError, MismatchError

if TYPE_CHECKING:
    import torch


@dataclass
class KeyReport:
    """How a state dict fits a model; ``ok`` means ``load_state_dict(strict=True)`` would succeed.

    ``ok`` is judged after moving the state dict to the model's layout (what :func:`load_into` does);
    ``loads_as_is`` also requires the layouts to agree, as a plain ``model.load_state_dict`` would.
    """

    source: str
    layout_from: str = "single"
    layout_to: str = "single"
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    wrong_dtype: dict[str, tuple[str, str]] = field(default_factory=dict)
    # (checkpoint key, model key) pairs that look like a rename: same shape, the only suffix match both ways.
    renamed: list[tuple[str, str]] = field(default_factory=list)
    # ``--rename`` rules that turn every renamed pair into its model key and break nothing else.
    rename_rules: list[str] = field(default_factory=list)
    # The same rules as (old prefix, new prefix) pairs in the model's layout.
    rename_swaps: list[tuple[str, str]] = field(default_factory=list)
    target_layout: str = "single"
    entry: str = ""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype)

    @property
    def layout_differs(self) -> bool:
        return self.layout_from != self.layout_to

    @property
    def loads_as_is(self) -> bool:
        """True when ``model.load_state_dict(state, strict=True)`` works without any conversion."""
        return self.ok and not self.layout_differs

    @property
    def fixable_by_convert(self) -> bool:
        """True when ``ckptfix convert`` (a layout change and/or ``--rename`` rules) makes the state fit."""
        if self.wrong_shape or self.wrong_dtype:
            return False
        if self.ok:
            return self.layout_differs
        return bool(self.rename_rules)

    def summary(self) -> str:
        """One line naming the first problem of each kind and the counts."""
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (e.g. '{self.missing[0]}')")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (e.g. '{self.unexpected[0]}')")
        for key, (got, want) in list(self.wrong_shape.items())[:1]:
            parts.append(f"{len(self.wrong_shape)} wrong shape (e.g. '{key}': {list(got)} vs model {list(want)})")
        for key, (dtype_got, dtype_want) in list(self.wrong_dtype.items())[:1]:
            parts.append(f"{len(self.wrong_dtype)} wrong dtype (e.g. '{key}': {dtype_got} vs model {dtype_want})")
        return "; ".join(parts) if parts else "ok"

    def raise_if_failed(self) -> None:
        """Raise :class:`MismatchError` with a one-line summary unless the state dict fits."""
        if not self.ok:
            raise MismatchError(
                f"{self.source}: does not fit the model: {self.summary()}; run 'ckptfix validate' for the full report"
            )

    def strict(self) -> KeyReport:
        """Raise :class:`MismatchError` unless the state dict fits; returns the report for chaining.

        >>> report = ckptfix.check(state, model).strict()
        """
        self.raise_if_failed()
        return self

    def fix_command(self, path: str, *, out: str | None = None, allow_globals: Iterable[str] = ()) -> str | None:
        """The ``ckptfix convert`` command that makes ``path`` fit the model, or None when none does."""
        if not self.fixable_by_convert:
            return None
        if out is None:
            stem, ext = os.path.splitext(path)
            out = f"{stem}.{'fixed' if self.rename_rules else self.target_layout}{ext or '.pt'}"
        words = ["ckptfix", "convert", path, out, "--to", self.target_layout]
        for rule in self.rename_rules:
            words += ["--rename", rule]
        for name in allow_globals:
            words += ["--allow-global", name]
        return shlex.join(words)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (shapes as lists, pairs as two-item lists)."""
        return {
            "source": self.source,
            "entry": self.entry,
            "ok": self.ok,
            "loads_as_is": self.loads_as_is,
            "layout_from": self.layout_from,
            "layout_to": self.layout_to,
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "wrong_shape": {k: {"checkpoint": list(a), "model": list(b)} for k, (a, b) in self.wrong_shape.items()},
            "wrong_dtype": {k: {"checkpoint": a, "model": b} for k, (a, b) in self.wrong_dtype.items()},
            "renamed": [list(pair) for pair in self.renamed],
            "rename_rules": list(self.rename_rules),
        }


def check(state: Mapping[str, Any], model: torch.nn.Module, *, source: str = "state dict") -> KeyReport:
    """Compare ``state`` (already in the model's layout) with ``model.state_dict()``.

    >>> report = ckptfix.check(torch.load("ckpt.pt")["model"], model)
    >>> report.missing, report.unexpected, report.wrong_shape, report.renamed
    """
    expected = model.state_dict()
    report = KeyReport(source=source)
    report.missing = [k for k in expected if k not in state]
    report.unexpected = [k for k in state if k not in expected]
    for key, want in expected.items():
        got = state.get(key)
        if got is None:
            continue
        if tuple(got.shape) != tuple(want.shape):
            report.wrong_shape[key] = (tuple(got.shape), tuple(want.shape))
        elif got.dtype != want.dtype:
            report.wrong_dtype[key] = (
                str(got.dtype).removeprefix("torch."),
                str(want.dtype).removeprefix("torch."),
            )
    if report.missing and report.unexpected:
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        shapes.update({k: tuple(v.shape) for k, v in expected.items() if k not in state})
        report.renamed = likely_renames(report.missing, report.unexpected, shapes)
        report.rename_swaps = _swaps_that_fix(report, state.keys(), expected.keys())
        report.rename_rules = _format_rules(report.rename_swaps)
    return report


def _suffix_len(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def likely_renames(
    missing: Sequence[str], unexpected: Sequence[str], shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, str]]:
    """Pair unexpected checkpoint keys with missing model keys of the same shape and longest dotted suffix.

    A pair counts only when each side is the other's single best match, so a guess is never ambiguous.
    Returns ``(checkpoint key, model key)`` pairs in model order.
    """

    def best(key: str, pool: Sequence[str]) -> str | None:
        parts = key.split(".")
        scored = [(_suffix_len(parts, o.split(".")), o) for o in pool if shapes.get(o) == shapes.get(key)]
        scored = [(n, o) for n, o in scored if n > 0]
        if not scored:
            return None
        top = max(n for n, _ in scored)
        winners = [o for n, o in scored if n == top]
        return winners[0] if len(winners) == 1 else None

    pairs = []
    for want in missing:
        got = best(want, unexpected)
        if got is not None and best(got, missing) == want:
            pairs.append((got, want))
    return pairs


def _format_rules(swaps: Sequence[tuple[str, str]], prefix: str = "") -> list[str]:
    """``--rename REGEX=REPL`` rules for prefix swaps, under a wrapper ``prefix`` that stays in place."""
    return [f"^{re.escape(prefix + old)}={prefix}{new}" for old, new in swaps]


def _swaps_that_fix(report: KeyReport, state_keys: Iterable[str], model_keys: Iterable[str]) -> list[tuple[str, str]]:
    """Prefix swaps (old, new) for the renamed pairs, when applying them makes the key sets equal."""
    if (
        not report.renamed
        or len(report.renamed) != len(report.missing)
        or len(report.renamed) != len(report.unexpected)
    ):
        return []
    swaps: dict[str, str] = {}
    for got, want in report.renamed:
        n = _suffix_len(got.split("."), want.split("."))
        old = ".".join(got.split(".")[:-n]) + "." if n < len(got.split(".")) else ""
        new = ".".join(want.split(".")[:-n]) + "." if n < len(want.split(".")) else ""
        if swaps.setdefault(old, new) != new:
            return []  # one prefix going to two places: a table of pairs, not a rule
    # Longest prefix first, so '^a\.b\.' is tried before '^a\.' and the rules compose like the pairs.
    ordered = sorted(swaps.items(), key=lambda kv: -len(kv[0]))

    def apply(key: str) -> str:
        for old, new in ordered:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    if sorted(apply(k) for k in state_keys) != sorted(model_keys):
        return []
    return ordered


def adapt_to_model(
    state: Mapping[str, Any], model: torch.nn.Module, *, source: str = "state dict"
) -> tuple[Any, KeyReport]:
    """Convert ``state`` to ``model``'s own layout and check it; returns the converted dict and the report."""
    target = layouts.detect(model.state_dict().keys(), source="model")
    found = layouts.detect(state.keys(), source=source)
    adapted = apply_maps(state, layouts.maps_to(found, target.chain), source=source)
    report = check(adapted, model, source=source)
    report.layout_from, report.layout_to = found.name, target.name
    report.target_layout = layouts.layout_name(target.chain)
    if report.rename_rules and (found.chain != target.chain or found.inner):
        # convert applies --rename before the layout change, to the checkpoint's own keys; the wrapper prefix
        # must stay on every key so the layout is still detected (all-or-nothing) afterwards.
        if found.inner or target.chain:
            report.rename_rules = []
        else:
            report.rename_rules = _format_rules(report.rename_swaps, layouts.chain_prefix(found.chain))
    return adapted, report


def model_state_of(obj: Any, *, source: str, entry: str | None = None) -> Mapping[str, Any]:
    """The primary model state dict of a loaded checkpoint (the object itself when it is one), or ``entry``.

    Raises :class:`LayoutError` when there is none: the input cannot be checked at all, which is not a mismatch.
    """
    if entry:
        if not isinstance(obj, Mapping) or not is_state_dict(obj.get(entry)):
            names = ", ".join(repr(n) for n in model_entries(obj)) or "none"
            raise LayoutError(f"{source}: no model state dict under '{entry}' (model entries: {names})")
        return obj[entry]  # type: ignore[no-any-return]
    if is_state_dict(obj):
        return obj  # type: ignore[no-any-return]
    entries = model_entries(obj)
    if not entries:
        raise LayoutError(f"{source}: holds no model state dict; nothing to load into the model")
    return obj[entries[0]]  # type: ignore[no-any-return]


def primary_entry(obj: Any) -> str:
    """The name of the entry :func:`model_state_of` picks (``""`` for a bare state dict)."""
    entries = model_entries(obj)
    return entries[0] if entries else ""


def load_into(
    model: torch.nn.Module,
    path_or_state: str | os.PathLike[str] | Mapping[str, Any],
    *,
    strict: bool = True,
    source: str | None = None,
) -> KeyReport:
    """Load a checkpoint file or state dict into ``model``, adapting to the model's own layout.

    ``source`` names an already loaded checkpoint in messages (a path is named by itself).

    >>> report = ckptfix.load_into(model, "ddp_run.pt")      # works for plain, DDP-wrapped, compiled models
    """
    if isinstance(path_or_state, Mapping):
        obj: Any = path_or_state
        source = source or "state dict"
    else:
        from ckptfix.formats import load

        source = os.fspath(path_or_state)
        obj = load(path_or_state)
    adapted, report = adapt_to_model(model_state_of(obj, source=source), model, source=source)
    if strict:
        report.raise_if_failed()
    else:  # load_state_dict raises on a shape mismatch even when not strict; skip those keys instead
        adapted = type(adapted)((k, v) for k, v in adapted.items() if k not in report.wrong_shape)
    model.load_state_dict(adapted, strict=strict)
    return report


def build_model(spec: str, *, kwargs: str | Mapping[str, Any] | None = None) -> torch.nn.Module:
    """Build a model from ``package.module:factory`` (a class or function) called with ``kwargs``.

    ``kwargs`` is a mapping or a JSON object string. ``factory`` may be dotted (``module:Outer.build``).

    >>> model = build_model("torch.nn:Linear", kwargs='{"in_features": 2, "out_features": 3}')
    """
    import torch

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CkptfixError(f"--model '{spec}': expected package.module:factory, e.g. torch.nn:Linear")
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise CkptfixError(f"--kwargs: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(kwargs, dict):
            raise CkptfixError("--kwargs: expected a JSON object such as '{\"in_features\": 2}'")
    try:
        factory: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise CkptfixError(
            f"--model '{spec}': cannot import '{module_name}' ({e}); run from the folder that holds it "
            f"or add it to PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise CkptfixError(f"--model '{spec}': module '{module_name}' has no attribute '{attr}'")
        factory = getattr(factory, part)
    if not callable(factory):
        raise CkptfixError(f"--model '{spec}': '{attr}' is not a class or function")
    try:
        model = factory(**dict(kwargs or {}))
    except Exception as e:  # the user's own code: any failure means the model cannot be built
        raise CkptfixError(f"--model '{spec}': building the model failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise CkptfixError(f"--model '{spec}': returned {type(model).__name__}, not a torch.nn.Module")
    return model
