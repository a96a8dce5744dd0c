"""Load a checkpoint into a model whatever its layout: pick the model entry, adapt the keys, check, load.

``load_into`` is the public use case; ``adapt_to_model``, ``model_state_of`` and ``primary_entry`` are its steps,
shared with ``ckptfix validate`` and ``load_for_ddp``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptfix import layouts
from ckptfix.checkpoint import apply_maps, is_state_dict, model_entries
from ckptfix.compare import KeyReport, check
from ckptfix.errors import LayoutError, MismatchError
from ckptfix.renames import format_rules

if TYPE_CHECKING:
    import torch


def adapt_to_model(
    state: Mapping[str, Any], model: torch.nn.Module, *, source: str = "state dict"
) -> tuple[Any, KeyReport]:
    """Convert ``state`` to ``model``'s own layout and check it; returns the converted dict and the report."""
    metadata = getattr(state, "_metadata", None)
    if metadata is not None and not isinstance(metadata, Mapping):  # nothing could be renamed along the keys
        raise MismatchError(
            f"{source}: its _metadata is a {type(metadata).__name__}, not a dict of module entries, and "
            f"load_state_dict raises on it: delete it"
        )
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
            report.rename_rules = format_rules(report.rename_swaps, layouts.chain_prefix(found.chain))
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

    ``source`` names an already loaded checkpoint in messages (a path is named by itself). Everything is
    checked before the model is touched: a :class:`MismatchError` leaves it as it was.

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
    report.raise_if_failed(strict=strict)
    if not strict:  # load_state_dict raises on a shape mismatch even when not strict; skip those keys instead
        adapted = _without(adapted, report.wrong_shape)
    model.load_state_dict(adapted, strict=strict)
    return report


def trial_load(model: torch.nn.Module, state: Mapping[str, Any]) -> str | None:
    """Run ``model.load_state_dict(state, strict=True)``; return what it raised, as one line, or None.

    It loads into ``model``: use a model built for the check (``ckptfix validate`` does). It catches what the key
    comparison cannot see, such as a custom module's ``_load_from_state_dict`` refusing its entries.
    """
    try:
        model.load_state_dict(state, strict=True)
    except Exception as e:  # any failure is the answer, not a crash: the check is what was asked for
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return None


def _without(state: Mapping[str, Any], keys: Mapping[str, Any]) -> Any:
    out: Any = type(state)((k, v) for k, v in state.items() if k not in keys)  # type: ignore[call-arg]
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out
