"""Key layouts: which wrapper put which prefix on a state dict's keys, and how to move between them.

Everything here works on key strings only, so it serves the torch path and the streaming path alike and
never imports torch. All layout knowledge lives in :data:`WRAPPERS`; detection and conversion read it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Literal, cast, get_args

from ckptfix.errors import LayoutError, UsageError


@dataclass(frozen=True)
class Wrapper:
    """A module wrapper that prefixes its child's keys."""

    name: str
    prefix: str
    added_by: str
    # Outer wrappers sit in front of every key (DDP, compile). Inner ones wrap submodules and appear at any
    # depth (FSDP1 per-layer wrapping, activation checkpointing); they are only ever removed, never added.
    inner: bool = False


WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper("ddp", "module.", "nn.DataParallel(m) / DistributedDataParallel(m)"),
    Wrapper("compiled", "_orig_mod.", "torch.compile(m)"),
    Wrapper("fsdp", "_fsdp_wrapped_module.", "FullyShardedDataParallel (FSDP1) submodule wrapping", inner=True),
    Wrapper("checkpoint", "_checkpoint_wrapped_module.", "activation checkpoint_wrapper(m)", inner=True),
)
_OUTER = {w.name: w for w in WRAPPERS if not w.inner}
_INNER = tuple(w for w in WRAPPERS if w.inner)

# Layout names as users type them, outermost wrapper first, mapped to the wrapper chain.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "single": (),
    "dp": ("ddp",),
    "ddp": ("ddp",),
    "compiled": ("compiled",),
    "ddp-compiled": ("ddp", "compiled"),  # DDP(torch.compile(m)): module._orig_mod.x
    "compiled-ddp": ("compiled", "ddp"),  # torch.compile(DDP(m)): _orig_mod.module.x
}
Layout = Literal["single", "dp", "ddp", "compiled", "ddp-compiled", "compiled-ddp"]
TARGETS: tuple[str, ...] = get_args(Layout)
assert set(TARGETS) == set(LAYOUTS), "Layout and LAYOUTS must name the same layouts"


def parse_layout(name: str | None) -> Layout | None:
    """A layout name as people write it, case-insensitive (``DDP`` → ``ddp``); :class:`UsageError` if unknown."""
    if name is None:
        return None
    key = str(name).strip().lower().replace("_", "-")
    if key not in TARGETS:
        raise UsageError(f"to={name!r}: unknown layout; choose one of {', '.join(TARGETS)}")
    return cast("Layout", key)


def layout_name(chain: Sequence[str]) -> str:
    """The user-facing name of a wrapper chain (``("ddp",)`` is reported as ``ddp``, alias ``dp``)."""
    for name, value in LAYOUTS.items():
        if tuple(chain) == value and name != "dp":
            return name
    return "+".join(chain)


def chain_prefix(chain: Sequence[str]) -> str:
    """The key prefix a wrapper chain produces: ``("ddp", "compiled")`` -> ``module._orig_mod.``."""
    return "".join(_OUTER[name].prefix for name in chain)


@dataclass(frozen=True)
class Detected:
    """What :func:`detect` found: the outer wrapper chain and the inner wrapper tokens present."""

    chain: tuple[str, ...]
    inner: tuple[str, ...]

    @property
    def name(self) -> str:
        base = layout_name(self.chain)
        return base if not self.inner else f"{base} (+{', '.join(self.inner)} inside)"


def detect(keys: Iterable[str], *, source: str = "state dict") -> Detected:
    """Find the wrapper chain that every key shares, outermost first.

    A prefix is peeled only when every key has it. A state dict holding both ``module.x`` and ``x`` is an
    error that names both keys, since loading it either way would silently drop one of them.
    """
    current = list(keys)
    chain: list[str] = []
    while current:
        _check_no_shadowing(current, source=source)
        wrapper = next((w for w in _OUTER.values() if _all_prefixed(current, w.prefix)), None)
        if wrapper is None:
            break
        chain.append(wrapper.name)
        current = [k[len(wrapper.prefix) :] for k in current]
    inner = tuple(w.name for w in _INNER if _any_inner(current, w))
    return Detected(tuple(chain), inner)


# str.startswith mapped in C: a state dict of a million keys is checked without a Python call per key, and
# any/all stop at the first key that decides


def refuse_partly_wrapped(keys: Iterable[str], found: Detected, *, source: str) -> None:
    """A state dict where some keys, not all, still carry a wrapper's prefix once ``found``'s chain is peeled
    (``module.fc.weight`` beside ``conv.weight``): converting it would leave those keys wrapped and say nothing."""
    peel = sum(len(_OUTER[name].prefix) for name in found.chain)
    inner = [k[peel:] for k in keys]
    for wrapper in _OUTER.values():
        some = [k for k in inner if k.startswith(wrapper.prefix)]
        if some and len(some) < len(inner):
            raise LayoutError(
                f"{source}: {len(some)} of {len(inner)} keys start with '{wrapper.prefix}' (e.g. '{some[0]}') and "
                f"the other {len(inner) - len(some)} do not: a partly wrapped state dict, which a layout change "
                f"would leave as it is. Strip it from those keys with renames='^{re.escape(wrapper.prefix)}=', "
                f"or keep every key as it is with to=None"
            )


def _all_prefixed(keys: Sequence[str], prefix: str) -> bool:
    return all(map(str.startswith, keys, repeat(prefix)))


def _any_prefixed(keys: Sequence[str], prefix: str) -> bool:
    return any(map(str.startswith, keys, repeat(prefix)))


def _check_no_shadowing(keys: Sequence[str], *, source: str) -> None:
    for wrapper in _OUTER.values():
        prefix = wrapper.prefix
        # when every key has the prefix, a key whose bare form is also present starts with it twice
        if _any_prefixed(keys, prefix) and (not _all_prefixed(keys, prefix) or _any_prefixed(keys, prefix * 2)):
            break
    else:
        return  # no key can shadow another: the usual case, decided without a Python loop over the keys
    present = set(keys)
    for key in keys:
        for wrapper in _OUTER.values():
            if key.startswith(wrapper.prefix) and key[len(wrapper.prefix) :] in present:
                bare = key[len(wrapper.prefix) :]
                raise LayoutError(
                    f"{source}: holds both '{key}' and '{bare}', a mix of wrapped and plain keys; "
                    f"remove one of them (e.g. with renames=) before converting"
                )


def _has_inner(key: str, wrapper: Wrapper) -> bool:
    return key.startswith(wrapper.prefix) or f".{wrapper.prefix}" in key


def _any_inner(keys: Sequence[str], wrapper: Wrapper) -> bool:
    # the token must at least occur somewhere: checked in C first, the exact rule only for keys that hold it
    if not any(map(str.__contains__, keys, repeat(wrapper.prefix))):
        return False
    return any(_has_inner(k, wrapper) for k in keys if wrapper.prefix in k)


KeyMap = Callable[[str], "str | None"]
"""Maps a key to its new name, or None when the key does not take part (see :func:`apply_key_map`)."""


@dataclass(frozen=True)
class StripPrefix:
    """A key map that removes ``prefix`` (None for keys without it)."""

    prefix: str

    def __call__(self, key: str) -> str | None:
        return key[len(self.prefix) :] if key.startswith(self.prefix) else None

    def rename_all(self, keys: list[str]) -> list[str]:
        """Every key renamed (kept where it lacks the prefix), without a call per key: a million keys pass here."""
        prefix, n = self.prefix, len(self.prefix)
        if _all_prefixed(keys, prefix):  # a layout change: the usual case
            return [key[n:] for key in keys]
        return [key[n:] if key.startswith(prefix) else key for key in keys]


def strip_prefix(prefix: str) -> KeyMap:
    """A key map that removes ``prefix`` (None for keys without it)."""
    return StripPrefix(prefix)


def add_prefix(prefix: str) -> KeyMap:
    """A key map that puts ``prefix`` in front of every key."""
    return lambda key: prefix + key


def regex_rename(pattern: str, repl: str) -> KeyMap:
    """A key map from ``REGEX=REPL`` (Python ``re.sub`` syntax); keys it does not match keep their name."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise LayoutError(f"renames='{pattern}={repl}': not a valid regular expression ({e})") from e
    return lambda key: compiled.sub(repl, key)


def remove_inner(key: str) -> str:
    """Drop FSDP1 and activation-checkpoint wrapper tokens wherever they sit in a key."""
    for wrapper in _INNER:
        key = key.replace(f".{wrapper.prefix}", ".")
        if key.startswith(wrapper.prefix):
            key = key[len(wrapper.prefix) :]
    return key


def parse_rename(spec: str) -> KeyMap:
    """Parse the CLI's ``REGEX=REPL`` form; the first ``=`` not escaped as ``\\=`` splits the two."""
    match = re.match(r"^((?:[^=\\]|\\.)*)=(.*)$", spec)
    if match is None:
        raise LayoutError(f"renames='{spec}': expected REGEX=REPL, e.g. renames='^model\\.='")
    return regex_rename(match.group(1).replace("\\=", "="), match.group(2))


def conversion_maps(
    keys: Iterable[str],
    *,
    to: str | None,
    source: str = "state dict",
    found: Detected | None = None,
) -> tuple[Detected, list[KeyMap]]:
    """Key maps that move ``keys`` from their detected layout to layout ``to`` (None keeps the layout).

    Returns the detected layout and the maps to apply in order. ``found``: ``detect(keys)``, when the caller
    already has it.
    """
    to = parse_layout(to)  # a UsageError (a ValueError) names the layouts; DDP is ddp
    if found is None:
        found = detect(keys, source=source)
    return found, ([] if to is None else maps_to(found, LAYOUTS[to]))


def maps_to(found: Detected, chain: Sequence[str]) -> list[KeyMap]:
    """Key maps from a detected layout to the wrapper ``chain`` (none when it is already there)."""
    if tuple(chain) == found.chain and not found.inner:
        return []
    maps: list[KeyMap] = []
    if found.chain:
        maps.append(strip_prefix(chain_prefix(found.chain)))
    if found.inner:
        maps.append(remove_inner)
    if chain:
        maps.append(add_prefix(chain_prefix(chain)))
    return maps
