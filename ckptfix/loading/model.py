"""Load a checkpoint into a model whatever its layout: pick the model entry, adapt the keys, check, load.

``load_into`` and ``check`` are the public use cases; ``adapt_to_model``, ``model_state_of``, ``primary_entry`` and
``ready_to_load`` are their steps, shared with ``ckptfix validate`` and ``load_for_ddp``. The model guides the
adaptation: its own layout (plain, DDP, compiled), then, when that is not enough, the one key prefix that makes the
checkpoint's keys exactly the model's (a LightningModule's ``model.``), and the tied parameters it shares.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import LayoutError
from ckptfix.formats.safety.depth import deep
from ckptfix.loading.report import KeyReport, compare_keys, filled_by_load, tied_keys
from ckptfix.signature import strict_keywords
from ckptfix.transforms import layouts
from ckptfix.transforms.checkpoint import (
    apply_maps,
    is_state_dict,
    is_tensor,
    model_entries,
    strip_key_prefixes,
)
from ckptfix.transforms.renames import format_rules, prefix_fits

if TYPE_CHECKING:
    import torch

Source = str | os.PathLike[str] | Mapping[str, Any]


def adapt_to_model(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    *,
    source: str = "state dict",
    strip_prefixes: Iterable[str] = (),
) -> tuple[Any, KeyReport]:
    """Convert ``state`` to ``model``'s own keys and check it; returns the converted dict and the report.

    ``strip_prefixes`` go first, as in ``convert``. Then the layout becomes the model's; if the keys still do not fit,
    the one prefix that makes them fit exactly, if there is exactly one, is stripped or added
    (``report.renamed_prefix``). Values are never read: tensor records serve as well as tensors.
    """
    metadata = getattr(state, "_metadata", None)
    if metadata is not None and not isinstance(metadata, Mapping):  # nothing can be renamed along with the keys
        return state, compare_keys(state, model, source=source)  # its bad_metadata says why it cannot load
    state = strip_key_prefixes(state, strip_prefixes, source=source)
    target = layouts.detect(model.state_dict().keys(), source="model")
    found = layouts.detect(state.keys(), source=source)
    adapted = apply_maps(state, layouts.maps_to(found, target.chain), source=source)
    report = compare_keys(adapted, model, source=source)
    if report.missing or report.unexpected:
        adapted, report = _with_prefix(state, model, found, target, source=source) or (adapted, report)
    report.layout_from, report.layout_to = found.name, target.name
    report.target_layout = layouts.layout_name(target.chain)
    report.source_prefix = layouts.chain_prefix(found.chain)
    report.target_prefix = layouts.chain_prefix(target.chain)
    if report.rename_rules and (found.chain != target.chain or found.inner):
        # convert applies --rename before the layout change, to the checkpoint's own keys; the wrapper prefix
        # must stay on every key so the layout is still detected (all-or-nothing) afterwards.
        if found.inner or target.chain:
            report.rename_rules = []
        else:
            report.rename_rules = format_rules(report.rename_swaps, layouts.chain_prefix(found.chain))
    return adapted, report


def _with_prefix(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    found: layouts.Detected,
    target: layouts.Detected,
    *,
    source: str,
) -> tuple[Any, KeyReport] | None:
    """The state with the one prefix change that makes it fit the model exactly, and its report; else None.

    Prefixes are compared under the layout prefixes (a DDP-saved LightningModule is ``module.model.…``), and the
    result is checked in full: a candidate that leaves any key missing or unexpected is not applied.
    """
    own = model.state_dict(keep_vars=True)
    outer = layouts.chain_prefix(target.chain)
    inner = apply_maps(state, layouts.maps_to(found, ()), source=source)
    may_lack = set(tied_keys(own)) | filled_by_load(model, None)
    fits = prefix_fits(inner.keys(), [k[len(outer) :] for k in own], may_lack={k[len(outer) :] for k in may_lack})
    if len(fits) != 1:
        return None  # none, or two that fit equally: never guess
    old, new = fits[0]
    change = layouts.strip_prefix(old) if old else layouts.add_prefix(new)
    adapted = apply_maps(inner, [change, *layouts.maps_to(layouts.Detected((), ()), target.chain)], source=source)
    report = compare_keys(adapted, model, source=source)
    if report.missing or report.unexpected:
        return None
    report.renamed_prefix = (old, new)
    return adapted, report


def model_state_of(obj: Any, *, source: str, entry: str | None = None) -> Mapping[str, Any]:
    """The primary model state dict of a loaded checkpoint (the object itself when it is one), or ``entry``.

    Raises :class:`LayoutError` when there is none: the input cannot be checked at all, which is not a mismatch;
    :class:`~ckptfix.formats.fsdp.ranks.ShardedCheckpointError` for FSDP1 flat parameters (one rank's slices).
    """
    from ckptfix.formats.fsdp.ranks import refuse_flat_params
    from ckptfix.formats.rankfile import refuse_rank_file

    refuse_rank_file(obj, source=source, model=not entry)
    state = _model_state(obj, source=source, entry=entry)
    refuse_flat_params(state, source=source)  # the chosen state's own: FSDP1 slices are no model
    return state


def _model_state(obj: Any, *, source: str, entry: str | None) -> Mapping[str, Any]:
    if entry:
        if not isinstance(obj, Mapping) or not is_state_dict(obj.get(entry)):
            names = ", ".join(repr(n) for n in model_entries(obj)) or "none"
            raise LayoutError(
                f"{source}: no model state dict under '{entry}' (model entries: {names}); pick one with entry="
            )
        return obj[entry]  # type: ignore[no-any-return]
    if is_state_dict(obj):
        return obj  # type: ignore[no-any-return]
    entries = model_entries(obj)
    if not entries:
        raise LayoutError(f"{source}: holds no model state dict; nothing to load into the model")
    return obj[entries[0]]  # type: ignore[no-any-return]


def primary_entry(obj: Any) -> str:
    """The name of the entry :func:`model_state_of` picks (``""`` for a bare state dict).

    Training weights come first (``state_dict``, ``model``, …), an EMA copy (``state_dict_ema``, ``model_ema``) only
    when there are none: resuming needs the trained weights. timm's ``load_checkpoint`` prefers the EMA copy
    (``use_ema=True`` by default); pass ``entry='state_dict_ema'`` for the same weights.
    """
    entries = model_entries(obj)
    return entries[0] if entries else ""


def ready_to_load(adapted: Mapping[str, Any], report: KeyReport, *, strict: bool = True) -> Any:
    """``adapted`` as ``load_state_dict`` takes it: each tied key added as its partner's tensor (loading the shared
    parameter twice from one tensor), and, when not strict, without the keys of the wrong shape (torch raises on
    those even with ``strict=False``). ``_metadata`` stays."""
    out: Any = OrderedDict((k, v) for k, v in adapted.items() if strict or k not in report.wrong_shape)
    for key, present in report.tied.items():
        out[key] = adapted[present]
    metadata = getattr(adapted, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


@strict_keywords
@deep
def load_into(
    model: torch.nn.Module,
    path_or_state: Source,
    *,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    strict: bool = True,
    unsafe: bool = False,
    source: str | None = None,
) -> KeyReport:
    """Load a checkpoint file or state dict into ``model``, adapting to the model's own keys.

    The model entry of a full checkpoint is found (or named with ``entry``, e.g. ``'state_dict_ema'``);
    ``strip_prefixes`` are removed first; the layout becomes the model's (plain, DDP-wrapped, compiled); a key
    prefix that alone makes the keys fit exactly (a LightningModule's ``model.``) is stripped or added
    (``report.renamed_prefix``); tied keys the checkpoint leaves out load through the key they share
    (``report.tied``). ``allow_globals`` and ``unsafe`` are :func:`ckptfix.load`'s. ``source`` names an already
    loaded checkpoint in messages. Everything is checked before the model is touched: a :class:`MismatchError`
    leaves it as it was.

    A ``.pt`` or ``.safetensors`` file is read straight into the model's own tensors (on a GPU through small
    pinned buffers): no second copy of the model in host or GPU memory (:mod:`ckptfix.loading.placing`).

    >>> report = ckptfix.load_into(model, "lightning.ckpt", allow_globals=["pathlib.PosixPath"])
    >>> report.renamed_prefix                                 # ('model.', '')
    """
    if not isinstance(path_or_state, Mapping) and not unsafe:
        from ckptfix.loading import placing

        if placing.eligible(model):
            placed = _place(
                model,
                path_or_state,
                allow_globals=allow_globals,
                entry=entry,
                strip_prefixes=strip_prefixes,
                strict=strict,
            )
            if placed is not None:
                return placed
    obj, name = _open(path_or_state, allow_globals=allow_globals, unsafe=unsafe, source=source)
    adapted, report = adapt_to_model(
        _loadable_state(obj, source=name, entry=entry), model, source=name, strip_prefixes=strip_prefixes
    )
    _note_entries(report, obj, entry=entry)
    report.raise_if_failed(strict=strict)
    model.load_state_dict(ready_to_load(adapted, report, strict=strict), strict=strict)
    return report


def _place(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    allow_globals: Iterable[str],
    entry: str | None,
    strip_prefixes: Iterable[str],
    strict: bool,
) -> KeyReport | None:
    """:func:`load_into` from the file's description, each tensor read into the model's own; None when the file is
    one that torch must load (legacy, quantized or sparse tensors, a folder)."""
    from ckptfix.formats.opened import OpenedFolder
    from ckptfix.loading import placing
    from ckptfix.reading import open_checkpoint

    name = os.fspath(path)
    with open_checkpoint(path, allow_globals=allow_globals, need_bytes=True, opaque=True) as opened:
        if not opened.described or isinstance(opened, OpenedFolder):
            return None
        adapted, report = adapt_to_model(
            _loadable_state(opened.tree, source=name, entry=entry), model, source=name, strip_prefixes=strip_prefixes
        )
        _note_entries(report, opened.tree, entry=entry)
        report.raise_if_failed(strict=strict)
        placing.place(model, ready_to_load(adapted, report, strict=strict), opened)
    return report


@strict_keywords
@deep
def check(
    path_or_state: Source,
    model: torch.nn.Module,
    *,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
    source: str | None = None,
) -> KeyReport:
    """How a checkpoint fits ``model``, as :func:`load_into` would load it, without touching the model.

    A file is read from its metadata only (the pickle or the header: keys, shapes, dtypes; no tensor byte; see
    :func:`ckptfix.reading.open_checkpoint`).
    ``report.ok``: :func:`load_into` loads it; ``report.loads_as_is``: plain ``load_state_dict(strict=True)`` does.

    >>> report = ckptfix.check("ddp_run.pt", model)
    >>> report.missing, report.unexpected, report.wrong_shape, report.tied, report.renamed_prefix
    """
    obj, name = _open(path_or_state, allow_globals=allow_globals, unsafe=unsafe, source=source, metadata=True)
    _, report = adapt_to_model(
        _loadable_state(obj, source=name, entry=entry), model, source=name, strip_prefixes=strip_prefixes
    )
    _note_entries(report, obj, entry=entry)
    return report


def _open(
    path_or_state: Source, *, allow_globals: Iterable[str], unsafe: bool, source: str | None, metadata: bool = False
) -> tuple[Any, str]:
    if isinstance(path_or_state, Mapping):
        return path_or_state, source or "state dict"
    # Entries needing globals outside the allowlist stay unbuilt (torchio/opaque.py): only the model entry is needed.
    name = os.fspath(path_or_state)
    if metadata:  # the checked description: tensor records (dtype, shape), no tensor byte read
        from ckptfix.reading import open_checkpoint

        with open_checkpoint(
            path_or_state, allow_globals=allow_globals, unsafe=unsafe, need_bytes=False, opaque=True
        ) as opened:
            return opened.tree, name
    from ckptfix.formats.registry import detect_format, read

    return read(
        path_or_state, fmt=detect_format(path_or_state), allow_globals=allow_globals, unsafe=unsafe, opaque=True
    ), name


def _loadable_state(obj: Any, *, source: str, entry: str | None) -> Mapping[str, Any]:
    """:func:`model_state_of`, refusing as :func:`ckptfix.load` would when the weights are in an opaque entry, or may
    be: an entry that would be taken for the model, unbuilt, must not let another one be picked silently."""
    from ckptfix.formats.torchio.opaque import require

    require(obj, wanted=[entry] if entry else None, source=source)
    return model_state_of(obj, source=source, entry=entry)


def _note_entries(report: KeyReport, obj: Any, *, entry: str | None) -> None:
    """The entry used and the entries left unbuilt, in the report."""
    from ckptfix.formats.torchio import opaque

    report.entry = entry or primary_entry(obj)
    report.not_loaded = opaque.not_loaded(obj)
    report.not_copyable = [e.name for e in opaque.entries(obj) if e.runs_code]


@dataclass
class Validation:
    """What ``ckptfix validate`` found: the report, the sizes it prints, and the checkpoint's model entries."""

    report: KeyReport
    keys: int
    model_keys: int
    entries: list[str] = field(default_factory=list)


@deep
def validate_file(
    path: str | os.PathLike[str],
    build: Callable[[str | None], torch.nn.Module],
    *,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
) -> Validation:
    """Check the checkpoint at ``path`` against a model made by ``build(device)`` for this check only.

    The keys, shapes and dtypes come from the file's metadata; the model is built on the meta device when its
    factory allows it (no memory, no initialisation). When the keys fit, a trial ``load_state_dict`` runs with
    meta tensors, so a refusal by the model's own ``_load_from_state_dict`` shows; if that trial raises, it is
    repeated with the real tensors on a real model, so a hook that reads values is judged on them.
    """
    name, strips = os.fspath(path), list(strip_prefixes)
    model = _build(build)
    obj, _ = _open(path, allow_globals=allow_globals, unsafe=unsafe, source=None, metadata=True)
    state = _loadable_state(obj, source=name, entry=entry)
    adapted, report = adapt_to_model(state, model, source=name, strip_prefixes=strips)
    if report.ok:
        report.load_error = trial_load(model, ready_to_load(adapted, report), assign=True)
    if report.load_error is not None and not _all_real(adapted):
        model = build(None)
        full, _ = _open(path, allow_globals=allow_globals, unsafe=unsafe, source=None)
        adapted, report = adapt_to_model(
            _loadable_state(full, source=name, entry=entry), model, source=name, strip_prefixes=strips
        )
        report.load_error = trial_load(model, ready_to_load(adapted, report))
    _note_entries(report, obj, entry=entry)
    return Validation(report, len(state), len(model.state_dict()), model_entries(obj))


def _build(build: Callable[[str | None], torch.nn.Module]) -> torch.nn.Module:
    try:
        return build("meta")
    except Exception:  # a factory that computes with values (``.item()``) cannot run on meta tensors
        return build(None)


def _all_real(state: Mapping[str, Any]) -> bool:
    import torch

    return all(isinstance(v, torch.Tensor) and not v.is_meta for v in state.values())


def trial_load(model: torch.nn.Module, state: Mapping[str, Any], *, assign: bool = False) -> str | None:
    """Run ``model.load_state_dict(state, strict=True)``; return what it raised, as one line, or None.

    It loads into ``model``: use a model built for the check (``ckptfix validate`` does). It catches what the key
    comparison cannot see, such as a custom module's ``_load_from_state_dict`` refusing its entries. Tensor
    records in ``state`` become meta tensors, so no byte is read; load those with ``assign=True`` (torch cannot
    copy out of a meta tensor), which leaves the model's parameters on the meta device.
    """
    try:
        model.load_state_dict(_as_tensors(state), strict=True, assign=assign)
    except Exception as e:  # any failure is the answer, not a crash: the check is what was asked for
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return None


def _as_tensors(state: Mapping[str, Any]) -> Any:
    import torch

    out: Any = OrderedDict()
    for key, value in state.items():
        if isinstance(value, torch.Tensor) or not is_tensor(value):
            out[key] = value
        else:
            out[key] = torch.empty(tuple(value.shape), dtype=getattr(torch, value.dtype), device="meta")
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out
