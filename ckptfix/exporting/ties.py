"""The tied copies ``save_pretrained`` leaves out of a transformers folder, put back for a ``.pt`` a training job loads.

``save_pretrained`` writes a tied weight once (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) and
``from_pretrained`` ties it back; ``model.load_state_dict(..., strict=True)`` (DDP's included) finds it missing. A
``.pt`` holds every key the model's ``state_dict()`` has, tied ones as one storage, as ``torch.save`` writes them.
Which keys are tied is proven, never guessed: the model ``config.json`` describes is built on the meta device and
its state dict's names of one parameter are the tied ones.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import UsageError
from ckptfix.notes import Kind, Note, always
from ckptfix.transforms.checkpoint import is_state_dict

TIES_RESTORED = "tied copies restored"  # said whatever the verbosity: the output holds keys the input's files do not
TIES_NOT_RESTORED = "tied copies not restored"
_BY_HAND = "load the .pt with load_state_dict(strict=False), then call model.tie_weights()"
# what building a model from an unusual config may raise, besides ckptfix's own refusals (no architectures)
_CANNOT_BUILD = (UsageError, ValueError, TypeError, KeyError, AttributeError, RuntimeError, ImportError)


@dataclass(frozen=True)
class Ties:
    """The names of each tied tensor of a folder's model (the kept one first), or why they are unknown."""

    groups: tuple[tuple[str, ...], ...] = ()
    unknown: str | None = None  # the note saying why no tie could be proven

    def restore(self, tree: Any) -> tuple[Any, dict[str, str]]:
        """``tree`` (a state dict) with each tied name it lacks as the very tensor a present name holds (one storage
        once written), and what was put back: copy -> the key it is."""
        if not self.groups or not is_state_dict(tree):
            return tree, {}
        restored = {
            copy: kept
            for keys in self.groups
            if (kept := next((k for k in keys if k in tree), None))
            for copy in keys
            if copy not in tree
        }
        if not restored:
            return tree, {}
        out: OrderedDict[str, Any] = OrderedDict(tree)
        out.update((copy, tree[kept]) for copy, kept in restored.items())
        if (versions := getattr(tree, "_metadata", None)) is not None:
            out._metadata = versions  # type: ignore[attr-defined]
        return out, restored

    def notes(self, restored: dict[str, str]) -> list[Note]:
        """What to say of the restoration (or why there was none)."""
        if self.unknown is not None:
            return [always(self.unknown, kind=Kind.TIES)]
        if not restored:
            return []
        pairs = ", ".join(f"'{copy}' = '{kept}'" for copy, kept in restored.items())
        return [
            always(
                f"{TIES_RESTORED}: {pairs} (one storage, as torch.save writes a tied model; config.json ties them "
                f"and save_pretrained leaves the copy out)",
                kind=Kind.TIES,
            )
        ]


def saved_ties(source: str) -> Ties:
    """The tied names of the model whose ``config.json`` sits in transformers folder ``source`` (or beside its index
    or model file); none without a config, and a note saying why where transformers cannot build its model."""
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return Ties()
    try:
        import transformers  # noqa: F401
    except ImportError:
        return Ties(
            unknown=f"{TIES_NOT_RESTORED}: transformers, which reads which weights {config_path} ties "
            f"(save_pretrained leaves the copy out), is not installed; pip install 'ckptfix[hf]' and "
            f"convert again, or {_BY_HAND}"
        )
    from ckptfix.exporting.model import load_config, meta_model, model_class

    try:
        config = load_config(folder)
        model = meta_model(model_class(config, config_path=config_path), config)
    except _CANNOT_BUILD as e:
        said = str(e).strip().splitlines()[0].split("; ")[0] if str(e).strip() else type(e).__name__
        return Ties(
            unknown=f"{TIES_NOT_RESTORED}: the model of {config_path} cannot be built to prove which weights "
            f"it ties ({said}); {_BY_HAND}"
        )
    names: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    return Ties(tuple(tuple(keys) for keys in names.values() if len(keys) > 1))


__all__ = ["TIES_NOT_RESTORED", "TIES_RESTORED", "Ties", "saved_ties"]
