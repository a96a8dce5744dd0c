"""Compare a state dict with a model: what ``load_state_dict(strict=True)`` would refuse, as data.

:func:`compare_keys` returns a :class:`KeyReport`: missing, unexpected, wrong-shape and wrong-dtype keys, tied keys
(absent, but the same tensor in the model as a key that is there), ``_metadata`` entries that make
``load_state_dict`` raise, likely renames and the ``ckptfix convert`` command that fixes a layout-only, prefix-only
or rename-only difference. It reads only keys, shapes and dtypes, so tensor records (no bytes) serve as well as
tensors. The public :func:`ckptfix.check` (in :mod:`ckptfix.loading.model`) adapts the layout first.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import MismatchError
from ckptfix.formats.pickles import inert
from ckptfix.transforms.checkpoint import is_tensor
from ckptfix.transforms.renames import format_rules, likely_renames, prefix_swaps

if TYPE_CHECKING:
    import torch


@dataclass
class KeyReport:
    """How a state dict fits a model; ``ok`` means ``load_state_dict(strict=True)`` would succeed.

    ``ok`` is judged after moving the state dict to the model's layout (what :func:`ckptfix.load_into` does);
    ``loads_as_is`` also requires the layouts to agree, as a plain ``model.load_state_dict`` would.
    """

    source: str
    layout_from: str = "single"
    layout_to: str = "single"
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    wrong_dtype: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Module path -> why its ``_metadata`` entry makes load_state_dict raise, and the fix.
    bad_metadata: dict[str, str] = field(default_factory=dict)
    # What a trial ``load_state_dict`` raised (see :func:`ckptfix.loading.model.trial_load`), as one line.
    load_error: str | None = None
    # (checkpoint key, model key) pairs that look like a rename: same shape, the only suffix match both ways.
    renamed: list[tuple[str, str]] = field(default_factory=list)
    # ``--rename`` rules that turn every renamed pair into its model key and break nothing else.
    rename_rules: list[str] = field(default_factory=list)
    # The same rules as (old prefix, new prefix) pairs in the model's layout.
    rename_swaps: list[tuple[str, str]] = field(default_factory=list)
    # Model keys the checkpoint lacks whose tensor is the same object in the model as a key it has (model key ->
    # checkpoint key): loading that key loads them, as transformers' tied embeddings are saved once.
    tied: dict[str, str] = field(default_factory=dict)
    # (old, new): the key prefix :func:`ckptfix.load_into` swapped, under the layout prefixes, to fit the model:
    # ``("model.", "")`` strips a LightningModule's attribute, ``("", "model.")`` adds one. None when none was.
    renamed_prefix: tuple[str, str] | None = None
    # The layout prefixes around the keys: the checkpoint's (after any strip_prefix) and the model's.
    source_prefix: str = ""
    target_prefix: str = ""
    target_layout: str = "single"
    entry: str = ""
    # Entries of the file that were not loaded because they need globals outside the allowlist (entry -> what
    # they hold); nothing in them was run. ``not_copyable``: those that can run code (a fix leaves them out).
    not_loaded: dict[str, str] = field(default_factory=dict)
    not_copyable: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        keys_fit = not (self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype)
        return keys_fit and not self.bad_metadata and self.load_error is None

    @property
    def layout_differs(self) -> bool:
        return self.layout_from != self.layout_to

    @property
    def loads_as_is(self) -> bool:
        """True when ``model.load_state_dict(state, strict=True)`` works without any key change.

        Tied keys are the exception: the checkpoint lacks them and ``load_state_dict`` loads them through the key
        they share (``strict=True`` would list them missing; :func:`ckptfix.load_into` passes them along).
        """
        return self.ok and not self.layout_differs and self.renamed_prefix is None

    @property
    def fixable_by_convert(self) -> bool:
        """True when ``ckptfix convert`` (a layout change, a prefix, ``--rename`` rules) makes the state fit."""
        if self.wrong_shape or self.wrong_dtype or self.bad_metadata or self.load_error is not None:
            return False
        if self.ok:
            return self.layout_differs or self.renamed_prefix is not None
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
        for path, problem in list(self.bad_metadata.items())[:1]:
            parts.append(f"{len(self.bad_metadata)} bad _metadata (e.g. {module_name(path)}: {problem})")
        if self.load_error is not None:
            parts.append(f"load_state_dict raised {self.load_error}")
        return "; ".join(parts) if parts else "ok"

    def raise_if_failed(self, *, strict: bool = True) -> None:
        """Raise :class:`MismatchError` with a one-line summary unless the state dict fits.

        With ``strict=False`` only what ``load_state_dict(strict=False)`` would raise on counts: bad ``_metadata``
        and a failed trial load (callers drop wrong-shape keys themselves).
        """
        if self.ok or (not strict and not self.bad_metadata and self.load_error is None):
            return
        raise MismatchError(
            f"{self.source}: does not fit the model: {self.summary()}; run 'ckptfix validate' for the full report"
        )

    def strict(self) -> KeyReport:
        """Raise :class:`MismatchError` unless the state dict fits; returns the report for chaining.

        >>> report = ckptfix.check(state, model).strict()
        """
        self.raise_if_failed()
        return self

    def fix_command(
        self,
        path: str,
        *,
        out: str | None = None,
        entry: str | None = None,
        strip_prefixes: Iterable[str] = (),
        allow_globals: Iterable[str] = (),
        unsafe: bool = False,
    ) -> str | None:
        """The ``ckptfix convert`` command that makes ``path`` fit the model, or None when none does.

        It writes ``out``, by default a new file in the current folder named after ``path`` (:func:`free_name`). It
        repeats every option the check itself needed (``entry``, ``strip_prefixes``, ``allow_globals``,
        ``unsafe``), so running it works.
        """
        if not self.fixable_by_convert:
            return None
        if out is None:
            out = free_name(path, "fixed" if self.rename_rules or self.renamed_prefix else self.target_layout)
        words = ["ckptfix", "convert", path, out]
        if entry:
            words += ["--entry", entry]
        for prefix in strip_prefixes:
            words += ["--strip-prefix", prefix]
        words += self._key_options()
        for rule in self.rename_rules:
            words += ["--rename", rule]
        for name in allow_globals:
            words += ["--allow-global", name]
        if unsafe:
            words.append("--unsafe-pickle")
        elif self.not_copyable:  # a full conversion would copy them, unexecuted: the fix keeps the weights only
            words.append("--model-only")
        return shlex.join(words)

    def _key_options(self) -> list[str]:
        # convert strips prefixes from the checkpoint's own keys, then changes the layout, then adds prefixes.
        if self.renamed_prefix is None or not self.ok:
            return ["--to", self.target_layout]
        old, new = self.renamed_prefix
        if old:
            return ["--strip-prefix", self.source_prefix + old, "--to", self.target_layout]
        return ["--to", "single", "--add-prefix", self.target_prefix + new]

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
            "bad_metadata": dict(self.bad_metadata),
            "load_error": self.load_error,
            "renamed": [list(pair) for pair in self.renamed],
            "rename_rules": list(self.rename_rules),
            "tied": dict(self.tied),
            "renamed_prefix": list(self.renamed_prefix) if self.renamed_prefix is not None else None,
            "not_loaded": dict(self.not_loaded),
        }

    def to_json(
        self,
        *,
        keys: int,
        model: str,
        model_keys: int,
        other_entries: list[str],
        fix_command: str | None,
        exit_code: int,
    ) -> dict[str, Any]:
        """``validate --json`` (docs/json.md): :meth:`to_dict`, the counts of keys on each side, the model's spec,
        the checkpoint's other model entries, the verdict line, the command that fixes the file and the exit code."""
        return {
            **self.to_dict(),
            "keys": keys,
            "model": model,
            "model_keys": model_keys,
            "other_entries": other_entries,
            "verdict": self.verdict(),
            "fix_command": fix_command,
            "exit_code": exit_code,
        }

    def verdict(self) -> str:
        """One line: whether the checkpoint loads with ``load_state_dict(strict=True)``, and if not, what is wrong."""
        if self.loads_as_is:
            if self.tied:
                return (
                    "OK: loads with load_state_dict(strict=True) once the tied keys are passed along (load_into does)"
                )
            return "OK: loads with load_state_dict(strict=True)"
        if self.ok and self.renamed_prefix is not None:
            old, new = self.renamed_prefix
            what = f"the checkpoint's keys carry '{old}'" if old else f"the model's keys carry '{new}'"
            does = "strips" if old else "adds"
            return f"prefix only: {what} in front; ckptfix.load_into {does} it, or rewrite the file with:"
        if self.ok:
            return (
                f"layout only: the checkpoint is {self.layout_from}, the model {self.layout_to}; "
                f"ckptfix.load_into adapts it, or rewrite the file with:"
            )
        if self.fixable_by_convert:
            return "renamed keys only: rewrite the file with:"
        return f"FAIL: would not load with strict=True: {self.summary()}"


def module_name(path: str) -> str:
    """A module path for messages: ``'features.1'``, or ``the root module`` for ``""``."""
    return f"module '{path}'" if path else "the root module"


def compare_keys(state: Mapping[str, Any], model: torch.nn.Module, *, source: str = "state dict") -> KeyReport:
    """Compare ``state`` (already in the model's layout) with ``model.state_dict()``: keys, shapes, dtypes.

    ``state`` may hold tensors or tensor records (anything with ``shape`` and ``dtype``); no value is read.

    >>> report = compare_keys(torch.load("ckpt.pt")["model"], model)
    >>> report.missing, report.unexpected, report.wrong_shape, report.tied, report.renamed
    """
    expected = model.state_dict(keep_vars=True)
    report = KeyReport(source=source)
    missing = [k for k in expected if k not in state]
    report.unexpected = [k for k in state if k not in expected]
    for key, want in expected.items():
        got = state.get(key)
        if got is None:
            continue
        if not (is_tensor(got) and is_tensor(want)):
            # a value that is not a tensor (a quantized Linear's packed params and their dtype, extra state):
            # load_state_dict hands it to the module as it is, so only a tensor where none belongs is wrong
            if is_tensor(got) != is_tensor(want):
                report.wrong_dtype[key] = (_kind(got), _kind(want))
        elif tuple(got.shape) != tuple(want.shape):
            report.wrong_shape[key] = (tuple(got.shape), tuple(want.shape))
        elif dtype_name(got) != dtype_name(want):
            report.wrong_dtype[key] = (dtype_name(got), dtype_name(want))
    report.bad_metadata = metadata_problems(state, model)
    report.tied = tied_in(missing, state, tied_keys(expected))
    missing = [k for k in missing if k not in report.tied]
    if missing and report.unexpected:
        shapes = {k: tuple(v.shape) for k, v in state.items() if is_tensor(v)}
        shapes.update({k: tuple(v.shape) for k, v in expected.items() if k not in state and is_tensor(v)})
        report.renamed = likely_renames(missing, report.unexpected, shapes)
        report.rename_swaps = prefix_swaps(
            report.renamed,
            missing=missing,
            unexpected=report.unexpected,
            state_keys=state.keys(),
            model_keys=[k for k in expected if k not in report.tied],
        )
        report.rename_rules = format_rules(report.rename_swaps)
    # A key load_state_dict fills in is not missing, unless it is a renamed key's new name: then the rename
    # brings it (and its module's _metadata entry) along.
    paired = {want for _, want in report.renamed}
    filled = filled_by_load(model, getattr(state, "_metadata", None))
    report.missing = [k for k in missing if k not in filled or k in paired]
    return report


def dtype_name(value: Any) -> str:
    """``float32`` for a tensor (``torch.float32``) and for a tensor record (``"float32"``) alike."""
    return str(value.dtype).removeprefix("torch.")


def _kind(value: Any) -> str:
    """A tensor's dtype, or the type of a value that is not a tensor (``tuple (not a tensor)``)."""
    if is_tensor(value):
        return dtype_name(value)
    inert_global = isinstance(value, type) and issubclass(value, inert.Global)  # torch.qint8 as the file names it
    return f"{value.full if inert_global else type(value).__name__} (not a tensor)"


def tied_keys(expected: Mapping[str, Any]) -> dict[str, list[str]]:
    """Keys of a model's ``state_dict(keep_vars=True)`` whose tensor is the same object as another key's.

    Maps each such key to every key of its group, in state-dict order: ``{"lm_head.weight": ["transformer.wte.weight",
    "lm_head.weight"], …}`` for a GPT-2 whose output layer is its input embedding.
    """
    groups: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(key)
    return {key: group for group in groups.values() if len(group) > 1 for key in group}


def tied_in(missing: Iterable[str], state: Mapping[str, Any], ties: Mapping[str, list[str]]) -> dict[str, str]:
    """The ``missing`` keys that share their tensor with a key ``state`` has: missing key -> that key."""
    found = {}
    for key in missing:
        present = next((k for k in ties.get(key, ()) if k in state), None)
        if present is not None:
            found[key] = present
    return found


def metadata_problems(state: Mapping[str, Any], model: torch.nn.Module) -> dict[str, str]:
    """The ``_metadata`` entries of ``state`` that make ``model.load_state_dict`` raise, by module path, with the fix.

    The same rules as torch: every module of the model reads its entry as a dict, and the normalization layers
    (BatchNorm, InstanceNorm) compare its ``version`` with 2, so a version such as ``'2'`` raises a TypeError.
    """
    from torch.nn.modules.batchnorm import _NormBase

    metadata = getattr(state, "_metadata", None)
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        return {"": f"_metadata is a {type(metadata).__name__}, not a dict of module entries: delete it"}
    problems: dict[str, str] = {}
    # load_state_dict walks every path to a module, shared modules included.
    for path, module in model.named_modules(remove_duplicate=False):
        if path not in metadata:
            continue
        entry = metadata[path]
        if not isinstance(entry, Mapping):
            problems[path] = f"its _metadata entry is a {type(entry).__name__}, not a dict: delete the entry"
        elif isinstance(module, _NormBase) and not _compares_with_int(entry.get("version")):
            version = entry.get("version")
            cls = type(module).__name__
            problems[path] = (
                f"_metadata version {_short_repr(version)} is a {type(version).__name__}, not a number, and {cls} "
                f"compares it with 2: delete the version or set it to {getattr(type(module), '_version', 2)}"
            )
    return problems


def filled_by_load(model: torch.nn.Module, metadata: Any) -> set[str]:
    """Keys ``load_state_dict`` puts in itself: BatchNorm's ``num_batches_tracked``, for a version below 2.

    A checkpoint from before that buffer existed (version 1, or no ``_metadata`` at all) loads with strict=True.
    """
    from torch.nn.modules.batchnorm import _NormBase

    filled = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if not (isinstance(module, _NormBase) and module.track_running_stats):
            continue
        entry = metadata.get(path, {}) if isinstance(metadata, Mapping) else {}
        version = entry.get("version") if isinstance(entry, Mapping) else None
        if version is None or (_compares_with_int(version) and bool(version < 2)):
            filled.add(f"{path}.num_batches_tracked" if path else "num_batches_tracked")
    return filled


def _compares_with_int(version: Any) -> bool:
    """Whether ``version is None or version < 2`` works, as in BatchNorm's ``_load_from_state_dict``."""
    if version is None:
        return True
    try:
        bool(version < 2)
    except Exception:  # whatever the comparison raises, load_state_dict raises it too
        return False
    return True


def _short_repr(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def free_name(path: str, tag: str) -> str:
    """A file name for a converted ``path`` in the current folder, not beside ``path`` (its folder may be shared,
    read-only or a run that must stay as it was): ``path``'s name with ``.tag`` before its extension, numbered
    (``ddp_run.single-2.pt``) past the names already taken there.

    >>> free_name("fixtures/ddp_wrapped.pt", "single")
    'ddp_wrapped.single.pt'
    """
    from ckptfix.formats.paths import SAFETENSORS_EXTENSIONS, TORCH_EXTENSIONS

    name = os.path.basename(os.path.normpath(path))
    stem, ext = (name, "") if os.path.isdir(path) else os.path.splitext(name)
    if ext.lower() not in (*TORCH_EXTENSIONS, *SAFETENSORS_EXTENSIONS):  # a folder, an index.json: a .pt file
        ext = ".pt"
    out, n = f"{stem}.{tag}{ext}", 1
    while os.path.lexists(out):
        n += 1
        out = f"{stem}.{tag}-{n}{ext}"
    return out
