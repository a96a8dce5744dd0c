"""Pure transforms over state dicts and full checkpoints: find the model entries, rename their keys.

Nothing here does I/O or imports torch at module level: the same functions run on real tensors and on the
inert tensor records of the streaming path (any :class:`~ckptfix.formats.records.TensorRecord`).
Inputs are never mutated; every transform returns new containers that share the tensor objects.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ckptfix.errors import LayoutError
from ckptfix.signature import strict_keywords
from ckptfix.transforms import layouts

# Where full checkpoints keep model state dicts, most common first (the first found is the "primary").
MODEL_ENTRY_NAMES: tuple[str, ...] = (
    "state_dict",
    "model",
    "model_state_dict",
    "module",
    "net",
    "network",
    "model_ema",
    "state_dict_ema",
    "ema",
    "ema_state_dict",
    "ema_model",
)
# Other entries that hold a state dict of a model, by name: EMA copies, GAN halves, distillation pairs.
_MODEL_ENTRY_PATTERN = re.compile(r"(model|net|state_dict|ema|encoder|decoder|generator|discriminator|teacher|student)")
# Entries that are never model weights even when they hold tensors.
_NOT_MODEL = re.compile(r"(optim|sched|scaler|rng|random|sampler|loss)", re.IGNORECASE)


def is_tensor(value: object) -> bool:
    """True for a torch.Tensor or a tensor record (:class:`~ckptfix.formats.records.TensorRecord`, known by the
    class flag it sets: this layer sits below formats/)."""
    if getattr(value, "__ckptfix_tensor__", False):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_state_dict(value: object) -> bool:
    """A mapping of string keys to tensors with at least one tensor and no nested mappings."""
    if not isinstance(value, Mapping) or not value:
        return False
    if not all(map(isinstance, value, repeat(str))):  # in C: a state dict may hold a million keys
        return False
    values = value.values()
    # each type is checked against Mapping once (an ABC check costs a Python call per value)
    return not any(issubclass(kind, Mapping) for kind in set(map(type, values))) and any(map(is_tensor, values))


def model_entries(obj: object) -> list[str]:
    """Names of the model state dicts inside a checkpoint; ``[""]`` when ``obj`` is itself a state dict."""
    if is_state_dict(obj):
        return [""]
    if not isinstance(obj, Mapping):
        return []
    found = [k for k, value in obj.items() if isinstance(k, str) and model_entry_name(k) and is_state_dict(value)]
    return sorted(found, key=lambda k: MODEL_ENTRY_NAMES.index(k) if k in MODEL_ENTRY_NAMES else len(found) + 99)


def model_entry_name(key: str) -> bool:
    """Whether an entry called ``key`` is taken for a model state dict when it holds one."""
    return not _NOT_MODEL.search(key) and (key in MODEL_ENTRY_NAMES or bool(_MODEL_ENTRY_PATTERN.search(key.lower())))


def get_entry(obj: Any, entry: str) -> Any:
    """The model state dict stored under ``entry`` (``""`` means ``obj`` itself)."""
    return obj if entry == "" else obj[entry]


def rename(state: Mapping[str, Any], key_map: layouts.KeyMap, *, source: str = "state dict") -> dict[str, Any]:
    """Apply ``key_map`` to every key; keys mapped to None keep their name (the container keeps its kind).

    Two keys that end with one name is an error naming both: a silent overwrite loses weights.
    ``_metadata`` (per-module versions, keyed by module path) is renamed along; entries the map does not
    cover are dropped, since they describe the wrapper that was removed.
    """
    out = same_kind(state, ())
    origin: dict[str, str] = {}
    for key, value in state.items():
        new = key_map(key)
        new = key if new is None else new
        if new in origin:
            raise LayoutError(
                f"{source}: '{origin[new]}' and '{key}' would both become '{new}'; "
                f"drop one of them or use different renames="
            )
        origin[new] = key
        out[new] = value
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = _rename_metadata(metadata, key_map)  # type: ignore[attr-defined]
    return out


def _rename_metadata(metadata: Mapping[str, Any], key_map: layouts.KeyMap) -> OrderedDict[str, Any]:
    # Module paths have no trailing dot ("" is the root); key maps speak in key prefixes ("module.").
    renamed: OrderedDict[str, Any] = OrderedDict()
    for path, value in metadata.items():
        new = key_map(f"{path}." if path else "")
        if new is None:
            continue
        renamed[new[:-1] if new.endswith(".") else new] = value
    if "" not in renamed:
        renamed[""] = {"version": 1}
        renamed.move_to_end("", last=False)
    return renamed


def apply_maps(
    state: Mapping[str, Any], maps: Sequence[layouts.KeyMap], *, source: str = "state dict"
) -> dict[str, Any]:
    """Apply key maps in order (a copy even when there are none), as :func:`rename` once per map would."""
    keys = list(state)
    for key_map in maps:
        if isinstance(key_map, layouts.StripPrefix):
            keys = key_map.rename_all(keys)
        else:
            keys = [key if (new := key_map(key)) is None else new for key in keys]
    out = same_kind(state, zip(keys, state.values(), strict=True))
    if len(out) != len(keys):
        # two keys met at some map (and stayed together after it): map by map, to name the two and their name
        # at the map that joined them
        staged = rename(state, _same, source=source)
        for key_map in maps:
            staged = rename(staged, key_map, source=source)
        raise AssertionError("colliding keys raise in rename")  # pragma: no cover
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        for key_map in (_same, *maps):  # a few entries per module: map by map, as rename does
            metadata = _rename_metadata(metadata, key_map)
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def same_kind(state: Mapping[str, Any], items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """A new container of ``state``'s kind holding ``items``: a ``dict`` stays a ``dict`` (what ``torch.save`` was
    given comes back), any other mapping becomes an ``OrderedDict``, as ``Module.state_dict()`` returns."""
    return dict(items) if type(state) is dict else OrderedDict(items)


def _same(key: str) -> str:
    return key


@dataclass
class EntryChange:
    """What :func:`convert_checkpoint` did to one model entry."""

    entry: str
    layout_from: str
    layout_to: str
    keys: int
    renamed: int


@dataclass
class Conversion:
    """The result of :func:`convert_checkpoint`: the new object and a record of what changed."""

    obj: Any
    changes: list[EntryChange] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    method: str = "memory"  # "stream" (no tensor loaded), "torch" (load and save) or "memory" (no file)
    notes: list[str] = field(default_factory=list)
    wrote: str = ""  # what a folder output holds (``DCP folder``, ``3 safetensors shards and their index``)

    def to_json(self, src: str, dst: str, *, dtype: str | None = None) -> dict[str, Any]:
        """``convert --json`` (docs/json.md): ``dtype`` is what floating-point tensors were cast to, or None."""
        return {
            "input": src,
            "output": dst,
            "method": self.method,  # "stream": bytes copied, no tensor loaded; "torch": loaded and saved
            "dtype": dtype,
            "changes": [dataclasses.asdict(change) for change in self.changes],
            "kept": list(self.kept),
            "dropped": list(self.dropped),
            "notes": list(self.notes),
        }


def replace_model_tensors(conversion: Conversion, replace: Callable[[str, Any], Any | None]) -> None:
    """Put ``replace(key, value)`` in place of each value of the converted model entries where it returns one
    (None keeps the value). It is called once per object: tied names (one tensor under two keys) stay one."""
    done: dict[int, tuple[Any, Any]] = {}  # the old value kept alive, so that its id is not reused meanwhile
    obj = conversion.obj
    for change in conversion.changes:
        state = obj if change.entry == "" or change.entry not in obj else obj[change.entry]
        for key, value in list(state.items()):
            if id(value) not in done:
                done[id(value)] = (value, replace(key, value))
            if (new := done[id(value)][1]) is not None:
                state[key] = new


def convert_checkpoint(
    obj: Any,
    *,
    to: str | None = "single",
    strip_prefixes: Iterable[str] = (),
    add_prefixes: Iterable[str] = (),
    renames: Iterable[str] = (),
    model_only: bool = False,
    entries: Iterable[str] | None = None,
    source: str = "checkpoint",
) -> Conversion:
    """Convert the model entries of a checkpoint; keep every other entry untouched.

    Custom maps run first (``--strip-prefix``, ``--rename``), then the layout change, then ``--add-prefix``.
    """
    names = list(entries) if entries is not None else model_entries(obj)
    if not names:
        raise LayoutError(
            f"{source}: found no model state dict (a mapping of names to tensors) at the top level or under "
            f"{', '.join(repr(n) for n in MODEL_ENTRY_NAMES[:6])}; name it with entries="
        )
    if entries is not None:
        _check_entries(obj, names, source=source)
    strips, adds = list(strip_prefixes), list(add_prefixes)
    custom = [layouts.strip_prefix(p) for p in strips] + [layouts.parse_rename(r) for r in renames]
    result = Conversion(obj=None)
    converted: dict[str, Any] = {}
    for name in names:
        where = f"{source}[{name!r}]" if name else source
        state = get_entry(obj, name)
        before = layouts.detect(state.keys(), source=where)
        if to is not None and not custom:
            layouts.refuse_partly_wrapped(state.keys(), before, source=where)
        _check_strips(state.keys(), strips, source=where)
        staged = apply_maps(state, custom, source=where) if custom else state  # the custom maps' collisions first
        _, maps = layouts.conversion_maps(staged.keys(), to=to, source=where, found=None if custom else before)
        maps += [layouts.add_prefix(p) for p in adds]
        new = apply_maps(staged, maps, source=where)
        if custom or adds or before.inner or not new:
            after = layouts.detect(new.keys(), source=where)
        else:  # the whole chain was peeled and the target's put on: what detect() would say, without a pass
            after = before if to is None else layouts.Detected(layouts.LAYOUTS[to], ())
        renamed = sum(map(operator.ne, state.keys(), new.keys()))
        converted[name] = new
        result.changes.append(EntryChange(name, before.name, after.name, len(new), renamed))
    if names == [""]:
        result.obj = converted[""]
        return result
    out = type(obj)() if isinstance(obj, OrderedDict) else {}
    if isinstance(obj, OrderedDict):
        vars(out).update(vars(obj))  # its attributes (_metadata) are part of what torch.load gives back
    for key, value in obj.items():
        if key in converted:
            out[key] = converted[key]
        elif model_only:
            result.dropped.append(str(key))
        else:
            out[key] = value
            result.kept.append(str(key))
    if model_only and len(names) == 1:
        out = converted[names[0]]
    result.obj = out
    return result


@strict_keywords
def convert(
    obj: Any,
    to: layouts.Layout | None = "single",
    *,
    strip_prefixes: Iterable[str] = (),
    add_prefixes: Iterable[str] = (),
    renames: Iterable[str] = (),
    model_only: bool = False,
    entries: Iterable[str] | None = None,
    source: str = "checkpoint",
) -> Any:
    """Convert a state dict or full checkpoint to layout ``to``; returns a new object.

    >>> sd = convert(ddp_model.state_dict(), to="single")
    >>> plain_model.load_state_dict(sd)
    """
    return convert_checkpoint(
        obj,
        to=to,
        strip_prefixes=strip_prefixes,
        add_prefixes=add_prefixes,
        renames=renames,
        model_only=model_only,
        entries=entries,
        source=source,
    ).obj


def strip_key_prefixes(
    state: Mapping[str, Any], prefixes: Iterable[str], *, source: str = "state dict"
) -> dict[str, Any]:
    """Remove each of ``prefixes`` in turn from every key, as ``convert(strip_prefixes=...)`` does (a copy).

    All-or-nothing: a key without the prefix is a :class:`LayoutError` naming it.
    """
    strips = list(prefixes)
    _check_strips(state.keys(), strips, source=source, renames=False)
    return apply_maps(state, [layouts.strip_prefix(p) for p in strips], source=source)


def _check_strips(keys: Iterable[str], prefixes: Sequence[str], *, source: str, renames: bool = True) -> None:
    # Strip-prefix is all-or-nothing like layout detection: a partial match means the prefix is wrong.
    keys = list(keys)
    for prefix in prefixes:
        stray = next((k for k in keys if not k.startswith(prefix)), None)
        if stray is not None:
            advice = f" (use renames='^{re.escape(prefix)}=' to strip it only where present)" if renames else ""
            raise LayoutError(
                f"{source}: strip_prefixes='{prefix}' does not match key '{stray}'; every key must start with "
                f"it{advice}"
            )
        keys = [k[len(prefix) :] for k in keys]


def _check_entries(obj: Any, names: Sequence[str], *, source: str) -> None:
    for name in names:
        if name == "" and is_state_dict(obj):
            continue
        if not isinstance(obj, Mapping) or name not in obj:
            available = ", ".join(repr(k) for k in obj) if isinstance(obj, Mapping) else "none"
            raise LayoutError(f"{source}: no entry '{name}' (entries: {available})")
        if not is_state_dict(obj[name]):
            raise LayoutError(f"{source}: entry '{name}' is not a state dict of tensors; pick another with entries=")
