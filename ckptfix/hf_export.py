"""What goes into a folder transformers' ``from_pretrained`` loads: the keys, checked against the model, and the config.

The model is the one ``config.json`` describes (its ``architectures`` class), built on the meta device: its keys,
shapes and tied parameters, no weight allocated. A checkpoint's keys are moved to it as :func:`ckptfix.load_into`
moves them (the training wrappers' prefixes: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1's
``_fsdp_wrapped_module.``; a LightningModule's ``model.``), then must be exactly the model's, in the form the model
holds them or the form ``save_pretrained`` writes them (a mixture of experts' per-expert tensors, which transformers
fuses when it loads). A tied copy is left out when the config ties it, as ``save_pretrained`` leaves it out. Values
are never read: tensor records serve as tensors do.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.compare import KeyReport
from ckptfix.errors import MismatchError, UsageError
from ckptfix.formats.records import identity, spec

if TYPE_CHECKING:
    from types import ModuleType

    import torch

FLOATING = ("float16", "bfloat16", "float32", "float64")
NO_TRANSFORMERS = (
    "transformers is not installed, and --format hf builds the model its config describes with it: "
    "pip install 'ckptfix[hf]' (or pip install transformers)"
)


def require_transformers() -> ModuleType:
    """transformers, or a one-line :class:`UsageError` saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise UsageError(NO_TRANSFORMERS) from e


def model_class(config: Any, *, config_path: str) -> Any:
    """The transformers class of ``config.architectures`` (its first entry), refused by name when there is none."""
    transformers = require_transformers()
    names = getattr(config, "architectures", None) or []
    if not names:
        raise UsageError(f"{config_path}: names no 'architectures', so the model class is unknown; add "
                         f'"architectures": ["LlamaForCausalLM"] (the class the weights belong to)')  # fmt: skip
    cls = getattr(transformers, str(names[0]), None)
    if cls is None:
        raise UsageError(f"{config_path}: architecture '{names[0]}' is not a class of transformers "
                         f"{transformers.__version__}; upgrade it, or name one it has")  # fmt: skip
    return cls


def load_config(folder: str) -> Any:
    """The ``PretrainedConfig`` of ``folder``'s ``config.json``, read locally (nothing downloaded)."""
    transformers = require_transformers()
    try:
        return transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # an unknown model_type, a config of remote code, a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{folder}/config.json: transformers {transformers.__version__} cannot read it ({first}); "
                         f"pass --config-from the folder of a config it reads") from e  # fmt: skip


def meta_model(config: Any, *, config_path: str) -> torch.nn.Module:
    """The model ``config`` describes, on the meta device: keys, shapes and ties, no weight allocated."""
    import torch

    cls = model_class(config, config_path=config_path)
    with torch.device("meta"):
        model: torch.nn.Module = cls._from_config(config)
    return model


@dataclass
class Exported:
    """The state dict to write (in the model's key order), which key form it is in, and what was left out."""

    state: OrderedDict[str, Any]
    form: str  # "model" (the keys the model holds) or "saved" (save_pretrained's, converted when loaded)
    report: KeyReport
    tied: dict[str, str] = field(default_factory=dict)  # left-out tied copy -> the key kept
    notes: list[str] = field(default_factory=list)


def _keys_module(expected: Mapping[str, Any]) -> torch.nn.Module:
    """A module whose ``state_dict`` is ``expected``: a model's saved form, asked as
    :func:`~ckptfix.loading.adapt_to_model` asks a module for its keys and shapes."""
    import torch

    class Keys(torch.nn.Module):
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            return OrderedDict(expected)

    return Keys()


def saved_form(model: torch.nn.Module) -> Mapping[str, Any] | None:
    """The keys (meta tensors) ``save_pretrained`` writes for ``model`` where they are not its own (transformers
    converts some when loading: fused experts); None where they are the same."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions saves the model's own keys
        return None
    own = model.state_dict()
    saved: Mapping[str, Any] = revert_weight_conversion(model, dict(own))  # type: ignore[arg-type]
    return None if saved.keys() == own.keys() else saved


def export_state(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    *,
    source: str,
    config_path: str,
    strip_prefixes: Iterable[str] = (),
) -> Exported:
    """``state``'s keys as ``from_pretrained`` takes them for ``model``: wrapper prefixes gone, checked exactly
    (missing, unexpected and wrong-shape keys refused by name, with the fix), tied copies left out as
    ``save_pretrained`` leaves them out. A dtype other than the model's is no mismatch: ``--dtype`` and the
    config say which is written."""
    from ckptfix.loading import adapt_to_model

    adapted, report = adapt_to_model(state, model, source=source, strip_prefixes=strip_prefixes)
    _floating_agrees(report)
    form, order = "model", list(model.state_dict().keys())
    if not report.ok and (saved := saved_form(model)) is not None:
        other, other_report = adapt_to_model(state, _keys_module(saved), source=source, strip_prefixes=strip_prefixes)
        _floating_agrees(other_report)
        if other_report.ok:
            adapted, report, form, order = other, other_report, "saved", list(saved)
    if not report.ok:
        raise MismatchError(_refusal(report, model, config_path=config_path))
    exported = Exported(OrderedDict(), form, report)
    ties = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for copy, kept in ties.items():  # {target: source}: the target is the copy save_pretrained leaves out
        if copy in adapted and kept in adapted:
            exported.tied[copy] = kept
            apart = identity(adapted[copy]) != identity(adapted[kept])
            exported.notes.append(
                f"left out '{copy}': the config ties it to '{kept}', as save_pretrained leaves it out, and "
                f"from_pretrained ties it back"
                + (f" (stored apart in {source}: from_pretrained uses '{kept}' for both)" if apart else "")
            )
    for key in [*order, *(k for k in adapted if k not in set(order))]:
        if key in adapted and key not in exported.tied:
            exported.state[key] = adapted[key]
    _refuse_untied_sharing(exported.state, source=source, config_path=config_path)
    return exported


def _refuse_untied_sharing(state: Mapping[str, Any], *, source: str, config_path: str) -> None:
    """Two keys the config keeps apart that are one tensor in the checkpoint: a safetensors file would store it once,
    and from_pretrained would find the second key missing. The model was trained tied; its config should say so."""
    seen: dict[Any, str] = {}
    for key, value in state.items():
        if spec(value).numel == 0:  # empty tensors share no bytes, whatever their pointers say
            continue
        if (first := seen.setdefault(identity(value), key)) != key:
            raise MismatchError(
                f"{source}: '{key}' and '{first}' are one tensor (tied in training), but {config_path} does not "
                f'tie them; set "tie_word_embeddings": true there (or the model\'s tie option), or pass '
                f"--config-from the config it was trained with"
            )


def _floating_agrees(report: KeyReport) -> None:
    """A floating-point tensor stored in another floating-point dtype than the meta model's fits: the weights are
    written in their dtype (or ``--dtype``), and the config says which."""
    report.wrong_dtype = {k: v for k, v in report.wrong_dtype.items() if not (v[0] in FLOATING and v[1] in FLOATING)}


def _refusal(report: KeyReport, model: torch.nn.Module, *, config_path: str) -> str:
    fix = (
        f"rename them with --rename {' --rename '.join(report.rename_rules)}"
        if report.rename_rules
        else "pass --config-from the folder of the config it was trained with, or fix its keys with --strip-prefix "
        "or --rename"
    )
    return (
        f"{report.source}: does not fit {type(model).__name__} as {config_path} describes it: {report.summary()}; "
        f"nothing was written; {fix}"
    )


def output_dtype(state: Mapping[str, Any], cast: str | None) -> str | None:
    """The one floating-point dtype of the weights written (``cast`` when given); None when they mix several."""
    if cast is not None:
        return cast
    found = {spec(v).dtype for v in state.values() if spec(v).dtype in FLOATING}
    return found.pop() if len(found) == 1 else None


def config_with_dtype(config: Mapping[str, Any], dtype: str | None) -> dict[str, Any]:
    """``config.json``'s content with its dtype (``dtype`` in transformers 5, ``torch_dtype`` before) set to the
    weights'; as it was when they mix dtypes."""
    out = dict(config)
    if dtype is None:
        return out
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    if "dtype" in out or "torch_dtype" not in out:
        out["dtype"] = dtype
    return out


__all__ = [
    "Exported",
    "config_with_dtype",
    "export_state",
    "load_config",
    "meta_model",
    "model_class",
    "output_dtype",
    "require_transformers",
    "saved_form",
]
