"""What goes into a folder transformers' ``from_pretrained`` loads: the keys, checked against the model, and the config.

The model is the one ``config.json`` describes (its ``architectures`` class), built on the meta device: its keys,
shapes and tied parameters, no weight allocated. A checkpoint's keys are moved to it as :func:`ckptfix.load_into`
moves them (the training wrappers' prefixes: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1's
``_fsdp_wrapped_module.``; a LightningModule's ``model.``), then must be exactly the model's, in the form the model
holds them or the form ``save_pretrained`` writes them (a mixture of experts' per-expert tensors, which transformers
fuses when it loads). A tied copy is left out when the config ties it, as ``save_pretrained`` leaves it out. Values
are never read (tensor records serve as tensors do), but for a tied copy stored apart: it and the tensor kept must
hold the same bits (:func:`check_tied_values` reads those two). ``config.json`` is read with no code of the model's
run, ever (``trust_remote_code=False``; a config only its own code reads is refused).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import MismatchError, UsageError
from ckptfix.formats.records import identity, spec
from ckptfix.loading.report import KeyReport
from ckptfix.notes import always

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


def model_class(config: Any, *, config_path: str, architecture: str | None = None) -> Any:
    """The transformers class ``architecture`` names, else ``config.architectures``' first, refused by name when
    there is none (:func:`ckptfix.exporting.classes.fitting_model` picks one from the checkpoint's keys instead)."""
    names = [architecture] if architecture else getattr(config, "architectures", None) or []
    if not names:
        raise UsageError(
            f"{config_path}: names no 'architectures', so the model class is unknown; pass "
            f"--architecture NAME (the class the weights belong to)"
        )
    return named_class(str(names[0]), where="--architecture" if architecture else config_path)


def named_class(name: str, *, where: str) -> Any:
    """transformers' model class ``name``; refused in one line when transformers has no such model class."""
    transformers = require_transformers()
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise UsageError(
            f"{where}: architecture {name!r} is not a model class of transformers "
            f"{transformers.__version__}; upgrade it, or name one it has"
        )
    return cls


def load_config(folder: str) -> Any:
    """The ``PretrainedConfig`` of ``folder``'s ``config.json``, read locally (nothing downloaded, no code run: a
    config only its own code reads is refused, naming the class it would need)."""
    transformers = require_transformers()
    path = os.path.join(folder, "config.json")
    _refuse_custom_code(path)
    try:  # trust_remote_code=False: transformers never asks on stdin, never imports a module of the folder
        with quiet_transformers():
            return transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:  # an unknown model_type, a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"{path}: transformers {transformers.__version__} cannot read it ({first}); "
            f"pass --config-from the folder of a config it reads"
        ) from e


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and warnings off while it reads a config or loads a model (a config's own
    oddities are its author's to see in transformers, not ckptfix's output: ckptfix's lines say the outcome), as
    they were after."""
    from transformers.utils import logging

    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _refuse_custom_code(path: str) -> None:
    """A config whose ``model_type`` transformers does not know, and whose ``auto_map`` names a module of its own:
    only running that module would read it, and ckptfix runs no code of a checkpoint's."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ckptfix.formats.hf.config import find_config

    config = find_config(path, config_from=os.path.dirname(path) or ".").config
    auto_map, kind = config.get("auto_map"), config.get("model_type")
    if not isinstance(auto_map, dict) or (isinstance(kind, str) and kind in CONFIG_MAPPING):
        return
    names = config.get("architectures")
    code = {str(v): None for v in auto_map.values() if isinstance(v, str)}  # AutoTokenizer's is a list: no model
    need = str(names[0]) if isinstance(names, list) and names else next(iter(code), "?")
    raise UsageError(
        f"{path}: model_type {kind!r} is not one transformers knows, and its auto_map names code of "
        f"its own ({', '.join(map(repr, code))}), which ckptfix never runs; export with a transformers "
        f"that has {need!r}, or pass --config-from the folder of a config transformers reads"
    )


def meta_model(cls: Any, config: Any) -> torch.nn.Module:
    """The model of class ``cls`` that ``config`` describes, on the meta device: keys, shapes and ties, no weight
    allocated."""
    import torch

    with torch.device("meta"), quiet_transformers():
        model: torch.nn.Module = cls._from_config(config)
    return model


@dataclass
class Exported:
    """The state dict to write (in the model's key order), which key form it is in, and what was left out."""

    state: OrderedDict[str, Any]
    form: str  # "model" (the keys the model holds) or "saved" (save_pretrained's, converted when loaded)
    report: KeyReport
    architecture: str = ""  # the model's class, which config.json names
    tied: dict[str, str] = field(default_factory=dict)  # left-out tied copy -> the key kept
    apart: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # such a copy stored apart -> (it, the kept one)
    notes: list[str] = field(default_factory=list)


def _keys_module(expected: Mapping[str, Any]) -> torch.nn.Module:
    """A module whose ``state_dict`` is ``expected``: a model's saved form, asked as
    :func:`~ckptfix.loading.model.adapt_to_model` asks a module for its keys and shapes."""
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


def fit(
    state: Mapping[str, Any], model: torch.nn.Module, *, source: str, strip_prefixes: Iterable[str] = ()
) -> tuple[Mapping[str, Any], KeyReport, str, list[str]]:
    """``state`` moved to ``model``'s keys (:func:`~ckptfix.loading.model.adapt_to_model`), its report, its form (the
    model's own keys, or ``save_pretrained``'s where only those fit) and the key order of that form."""
    from ckptfix.loading.model import adapt_to_model

    adapted, report = adapt_to_model(state, model, source=source, strip_prefixes=strip_prefixes)
    _floating_agrees(report)
    if not report.ok and (saved := saved_form(model)) is not None:
        other, other_report = adapt_to_model(state, _keys_module(saved), source=source, strip_prefixes=strip_prefixes)
        _floating_agrees(other_report)
        if other_report.ok:
            return other, other_report, "saved", list(saved)
    return adapted, report, "model", list(model.state_dict().keys())


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
    config say which is written. A tied copy stored apart must hold the kept tensor's values, bit for bit."""
    adapted, report, form, order = fit(state, model, source=source, strip_prefixes=strip_prefixes)
    if not report.ok:
        raise MismatchError(_refusal(report, model, config_path=config_path))
    exported = Exported(OrderedDict(), form, report, type(model).__name__)
    ties = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for copy, kept in ties.items():  # {target: source}: the target is the copy save_pretrained leaves out
        if copy in adapted and kept in adapted:
            exported.tied[copy] = kept
            apart = identity(adapted[copy]) != identity(adapted[kept])
            if apart:  # its values are compared by check_tied_values
                exported.apart[copy] = (adapted[copy], adapted[kept])
            exported.notes.append(
                always(
                    f"left out '{copy}': the config ties it to '{kept}', as save_pretrained leaves it out, and "
                    f"from_pretrained ties it back"
                    + (f" (stored apart in {source}, equal bit for bit)" if apart else "")
                )
            )
    for key in [*order, *(k for k in adapted if k not in set(order))]:
        if key in adapted and key not in exported.tied:
            exported.state[key] = adapted[key]
    _refuse_untied_sharing(exported.state, source=source, config_path=config_path)
    return exported


def check_tied_values(exported: Exported, *, read: Callable[[Any], bytes], source: str, config_path: str) -> None:
    """Each tied copy stored apart from the tensor it is tied to must hold its values, bit for bit: from_pretrained
    gives it the kept one's. ``read(t)`` is a tensor's bytes; only these tensors are read, one pair at a time."""
    for copy, (a, b) in exported.apart.items():
        if (spec(a).dtype, spec(a).shape) == (spec(b).dtype, spec(b).shape) and read(a) == read(b):
            continue
        kept = exported.tied[copy]
        raise MismatchError(
            f"{source}: holds '{copy}' apart from '{kept}', with other values, but {config_path} ties them "
            f"(from_pretrained would use '{kept}' for both); nothing was written; set \"tie_word_embeddings\": "
            f"false there (or the model's tie option), or pass --config-from the config it was trained with"
        )


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


def config_with_dtype(config: Mapping[str, Any], dtype: str | None, *, architecture: str = "") -> dict[str, Any]:
    """``config.json``'s content with its dtype (``dtype`` in transformers 5, ``torch_dtype`` before) set to the
    weights' (as it was when they mix dtypes), and ``architectures`` to the class exported for (named or chosen)."""
    out = dict(config)
    if architecture:
        out["architectures"] = [architecture]
    if dtype is None:
        return out
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    if "dtype" in out or "torch_dtype" not in out:
        out["dtype"] = dtype
    return out


__all__ = [
    "Exported",
    "check_tied_values",
    "config_with_dtype",
    "export_state",
    "fit",
    "load_config",
    "meta_model",
    "model_class",
    "named_class",
    "output_dtype",
    "quiet_transformers",
    "require_transformers",
    "saved_form",
]
