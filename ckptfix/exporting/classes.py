"""Which transformers model a checkpoint is exported for, decided from its keys before the model is built.

A ``config.json`` that ``model.config.save_pretrained`` writes names no ``architectures``; transformers' Auto classes
then pick the class from ``model_type``. So does an export: of the classes transformers' auto mappings list for that
``model_type`` (``MODEL_MAPPING_NAMES``, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, …), the one whose keys the checkpoint
fills exactly (a causal LM's where it holds the head: the bare model then lacks its keys), each tried on the meta
device; none or several is refused naming them and ``--architecture``. A config of more layers than the checkpoint
holds is refused first, from the keys alone, before a model of that size is built (a 12,000-layer one takes a minute).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ckptfix.errors import MismatchError, UsageError
from ckptfix.exporting.model import (
    Exported,
    export_state,
    fit,
    meta_model,
    model_class,
    quiet_transformers,
    require_transformers,
)
from ckptfix.notes import always

if TYPE_CHECKING:
    import torch

    from ckptfix.loading.report import KeyReport

# what building a model class of transformers' from a config it does not suit raises (a field it lacks, a size)
_UNBUILT = (ValueError, KeyError, TypeError, AttributeError, ImportError)
_NUMBERED = re.compile(r"(.+?)\.(\d+)(?:\.|$)")  # a key's first numbered module list: 'model.layers' of layer 3


def export_for(
    state: Mapping[str, Any],
    config: Any,
    *,
    architecture: str | None,
    source: str,
    config_path: str,
    strip_prefixes: Iterable[str] = (),
) -> Exported:
    """:func:`~ckptfix.exporting.model.export_state` for the model :func:`fitting_model` finds; its notes say a class
    chosen."""
    model, chosen = fitting_model(
        state, config, architecture=architecture, source=source, config_path=config_path, strip_prefixes=strip_prefixes
    )
    exported = export_state(state, model, source=source, config_path=config_path, strip_prefixes=strip_prefixes)
    exported.notes[:0] = chosen
    return exported


def fitting_model(
    state: Mapping[str, Any],
    config: Any,
    *,
    architecture: str | None,
    source: str,
    config_path: str,
    strip_prefixes: Iterable[str] = (),
) -> tuple[torch.nn.Module, list[str]]:
    """The meta model ``state`` is exported for, and a note where its class was chosen: ``architecture``, else the
    config's ``architectures``, else the one class of transformers' for its ``model_type`` whose keys ``state``
    fills. A config of more layers than ``state`` holds is refused before a model of that size is built."""
    refuse_missing_layers(state, config, source=source, config_path=config_path)
    if architecture or getattr(config, "architectures", None):
        return meta_model(model_class(config, config_path=config_path, architecture=architecture), config), []
    return chosen_model(state, config, source=source, config_path=config_path, strip_prefixes=strip_prefixes)


def held_layers(keys: Iterable[object]) -> tuple[str, set[int]]:
    """The numbered module list of ``keys`` with the most entries (``model.layers``), and the numbers held."""
    lists: dict[str, set[int]] = {}
    for key in keys:
        if isinstance(key, str) and (m := _NUMBERED.match(key)):
            lists.setdefault(m.group(1), set()).add(int(m.group(2)))
    return max(lists.items(), key=lambda item: len(item[1]), default=("", set()))


def refuse_missing_layers(state: Mapping[str, Any], config: Any, *, source: str, config_path: str) -> None:
    """A config saying more layers than the keys of ``state`` hold, refused from the keys alone: a model one layer
    longer than the checkpoint (cheap) must hold more layers than it, as the config's would (a model that shares
    one layer's weights across its depth, ALBERT's, holds no more and passes on)."""
    want = getattr(config, "num_hidden_layers", None)
    name, held = held_layers(state)
    if not isinstance(want, int) or want <= len(held) or not _grows(config, len(held)):
        return
    field = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    what = f"{len(held)} ('{name}.{min(held)}' to '{name}.{max(held)}')" if held else "none"
    raise MismatchError(
        f"{source}: holds {len(held)} layers, but {config_path} says {field} {want} (layers held: "
        f"{what}); nothing was written; pass --config-from the folder of the config it was trained "
        f"with"
    )


def _grows(config: Any, held: int) -> bool:
    """Whether the model of ``config`` with ``held + 1`` layers holds more layers than ``held`` (built on the meta
    device, the bare model of its ``model_type``); False where none is built (the full model's keys then say)."""
    import torch

    transformers = require_transformers()
    small = copy.deepcopy(config)
    small.num_hidden_layers = held + 1
    try:
        with torch.device("meta"), quiet_transformers():
            model = transformers.AutoModel.from_config(small, trust_remote_code=False)
    except _UNBUILT:
        return False
    return len(held_layers(model.state_dict())[1]) > held


def candidates(model_type: str) -> list[str]:
    """The model classes transformers' auto mappings list for ``model_type``, those this transformers has."""
    from transformers.models.auto import modeling_auto

    transformers = require_transformers()
    found: dict[str, None] = {}
    for name in sorted(n for n in dir(modeling_auto) if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES")):
        entry = getattr(modeling_auto, name).get(model_type)
        for cls in [entry] if isinstance(entry, str) else entry or ():
            if isinstance(c := getattr(transformers, cls, None), type) and issubclass(c, transformers.PreTrainedModel):
                found[cls] = None
    return sorted(found)


def chosen_model(
    state: Mapping[str, Any], config: Any, *, source: str, config_path: str, strip_prefixes: Iterable[str] = ()
) -> tuple[torch.nn.Module, list[str]]:
    """The meta model of the one class for ``config.model_type`` whose keys ``state`` fills: as they are (wrapper
    prefixes aside) first, else with one prefix added or taken off; refused naming the classes otherwise."""
    transformers = require_transformers()
    kind = str(getattr(config, "model_type", ""))
    names = candidates(kind)
    exact: list[Any] = []
    moved: list[Any] = []
    for name in names:
        try:
            model = meta_model(getattr(transformers, name), config)
        except _UNBUILT:  # a class the config does not suit (a field it lacks) is none the checkpoint fills
            continue
        report: KeyReport = fit(state, model, source=source, strip_prefixes=strip_prefixes)[1]
        if report.ok:
            (exact if report.renamed_prefix is None else moved).append(model)
    picked = exact or moved
    if len(picked) == 1:
        chosen = type(picked[0]).__name__
        return picked[0], [
            always(
                f"architecture {chosen}: {config_path} names none, and {chosen} is the one class of "
                f"model_type {kind!r} whose keys {source} fills (of {', '.join(names)})"
            )
        ]
    raise UsageError(_unchosen(picked, names, kind=kind, source=source, config_path=config_path))


def _unchosen(picked: list[Any], names: list[str], *, kind: str, source: str, config_path: str) -> str:
    head = f"{config_path}: names no 'architectures'"
    if not names:
        return f"{head}, and transformers has no model class for model_type {kind!r}; pass --architecture NAME"
    fill = [type(m).__name__ for m in picked]
    said = f"fill {' and '.join(fill)} alike" if fill else f"fill none of its classes for model_type {kind!r}"
    return (
        f"{head}, and the keys of {source} {said} ({', '.join(names)}); nothing was written; pass "
        f"--architecture NAME, one of {', '.join(fill or names)}"
    )


__all__ = ["candidates", "chosen_model", "export_for", "fitting_model", "held_layers", "refuse_missing_layers"]
