"""Compare a state dict with a model: missing, unexpected, wrong-shape and wrong-dtype keys, as data."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix import layouts
from ckptfix.checkpoint import apply_maps, is_state_dict, model_entries
from ckptfix.errors import MismatchError

if TYPE_CHECKING:
    import torch


@dataclass
class KeyReport:
    """How a state dict fits a model; ``ok`` means ``load_state_dict(strict=True)`` would succeed."""

    source: str
    layout_from: str = "single"
    layout_to: str = "single"
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    wrong_dtype: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype)

    def summary(self) -> str:
        """One line naming the first problem of each kind and the counts."""
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (e.g. '{self.missing[0]}')")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (e.g. '{self.unexpected[0]}')")
        for key, (got, want) in list(self.wrong_shape.items())[:1]:
            parts.append(f"{len(self.wrong_shape)} wrong shape (e.g. '{key}': {list(got)} vs model {list(want)})")
        for key, (got, want) in list(self.wrong_dtype.items())[:1]:
            parts.append(f"{len(self.wrong_dtype)} wrong dtype (e.g. '{key}': {got} vs model {want})")
        return "; ".join(parts) if parts else "ok"

    def raise_if_failed(self) -> None:
        """Raise :class:`MismatchError` with a one-line summary unless the state dict fits."""
        if not self.ok:
            raise MismatchError(
                f"{self.source}: does not fit the model: {self.summary()}; "
                f"run 'ckptfix validate' for the full report"
            )


def check(state: Mapping[str, Any], model: torch.nn.Module, *, source: str = "state dict") -> KeyReport:
    """Compare ``state`` (already in the model's layout) with ``model.state_dict()``."""
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
            report.wrong_dtype[key] = (str(got.dtype).removeprefix("torch."), str(want.dtype).removeprefix("torch."))
    return report


def adapt_to_model(
    state: Mapping[str, Any], model: torch.nn.Module, *, source: str = "state dict"
) -> tuple[Any, KeyReport]:
    """Convert ``state`` to ``model``'s own layout and check it; returns the converted dict and the report."""
    target = layouts.detect(model.state_dict().keys(), source="model")
    found, maps = layouts.conversion_maps(list(state.keys()), to=None, source=source)
    if found.chain != target.chain or found.inner:
        maps = []
        if found.chain:
            maps.append(layouts.strip_prefix(layouts.chain_prefix(found.chain)))
        if found.inner:
            maps.append(layouts.remove_inner)
        if target.chain:
            maps.append(layouts.add_prefix(layouts.chain_prefix(target.chain)))
    adapted = apply_maps(state, maps, source=source)
    report = check(adapted, model, source=source)
    report.layout_from, report.layout_to = found.name, target.name
    return adapted, report


def model_state_of(obj: Any, *, source: str) -> Mapping[str, Any]:
    """The primary model state dict of a loaded checkpoint (the object itself when it is one)."""
    if is_state_dict(obj):
        return obj  # type: ignore[no-any-return]
    entries = model_entries(obj)
    if not entries:
        raise MismatchError(f"{source}: holds no model state dict; nothing to load into the model")
    return obj[entries[0]]  # type: ignore[no-any-return]


def load_into(
    model: torch.nn.Module,
    path_or_state: str | os.PathLike[str] | Mapping[str, Any],
    *,
    strict: bool = True,
) -> KeyReport:
    """Load a checkpoint file or state dict into ``model``, adapting to the model's own layout.

    >>> report = ckptfix.load_into(model, "ddp_run.pt")      # works for plain, DDP-wrapped, compiled models
    """
    if isinstance(path_or_state, Mapping):
        obj: Any = path_or_state
        source = "state dict"
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
