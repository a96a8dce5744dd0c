"""Guess renamed modules: pair missing and unexpected keys, the ``--rename`` rules that fix them, and the one prefix
that makes a checkpoint's keys fit a model's exactly.

Pure string work, no torch: a pair needs the same shape and the longest dotted suffix match both ways; rules are
prefix swaps, offered only when applying them makes the key sets equal.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence


def _suffix_len(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def likely_renames(
    missing: Sequence[str], unexpected: Sequence[str], shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, str]]:
    """Pair unexpected checkpoint keys with missing model keys of the same shape and longest dotted suffix.

    A pair counts only when each side is the other's single best match, so a guess is never ambiguous.
    Returns ``(checkpoint key, model key)`` pairs in model order.

    >>> likely_renames(["head.w"], ["fc.w"], {"head.w": (2,), "fc.w": (2,)})
    [('fc.w', 'head.w')]
    """

    def best(key: str, pool: Sequence[str]) -> str | None:
        parts = key.split(".")
        scored = [(_suffix_len(parts, o.split(".")), o) for o in pool if shapes.get(o) == shapes.get(key)]
        scored = [(n, o) for n, o in scored if n > 0]
        if not scored:
            return None
        top = max(n for n, _ in scored)
        winners = [o for n, o in scored if n == top]
        return winners[0] if len(winners) == 1 else None

    pairs = []
    for want in missing:
        got = best(want, unexpected)
        if got is not None and best(got, missing) == want:
            pairs.append((got, want))
    return pairs


def format_rules(swaps: Sequence[tuple[str, str]], prefix: str = "") -> list[str]:
    """``REGEX=REPL`` rules (``ckptfix convert --rename``) for prefix swaps under a wrapper ``prefix`` that stays."""
    return [f"^{re.escape(prefix + old)}={prefix}{new}" for old, new in swaps]


def prefix_swaps(
    renamed: Sequence[tuple[str, str]],
    *,
    missing: Sequence[str],
    unexpected: Sequence[str],
    state_keys: Iterable[str],
    model_keys: Iterable[str],
) -> list[tuple[str, str]]:
    """Prefix swaps (old, new) for the ``renamed`` pairs, when applying them makes the key sets equal.

    Empty when some missing or unexpected key is unpaired, or one prefix would go to two places.
    """
    if not renamed or len(renamed) != len(missing) or len(renamed) != len(unexpected):
        return []
    swaps: dict[str, str] = {}
    for got, want in renamed:
        n = _suffix_len(got.split("."), want.split("."))
        old = ".".join(got.split(".")[:-n]) + "." if n < len(got.split(".")) else ""
        new = ".".join(want.split(".")[:-n]) + "." if n < len(want.split(".")) else ""
        if swaps.setdefault(old, new) != new:
            return []  # one prefix going to two places: a table of pairs, not a rule
    # Longest prefix first, so '^a\.b\.' is tried before '^a\.' and the rules compose like the pairs.
    ordered = sorted(swaps.items(), key=lambda kv: -len(kv[0]))

    def apply(key: str) -> str:
        for old, new in ordered:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    if sorted(apply(k) for k in state_keys) != sorted(model_keys):
        return []
    return ordered


def prefix_fits(
    state_keys: Iterable[str], model_keys: Iterable[str], *, may_lack: Collection[str] = ()
) -> list[tuple[str, str]]:
    """Every prefix change that makes the checkpoint's keys the model's exactly: ``(old, "")`` strips ``old`` from
    every key, ``("", new)`` puts ``new`` in front of every key.

    A wrapper's attribute is the usual cause: a LightningModule saves its network as ``model.…``, a wrapper as
    ``net.…`` or ``backbone.…``. ``may_lack`` names model keys the checkpoint may leave out (tied keys, keys
    ``load_state_dict`` fills in). Returns every fitting change, so a caller applies one only when it is alone:
    two would be a guess. Linear in the keys: a fitting prefix must turn the first key into a model key.

    >>> prefix_fits(["model.fc.w", "model.fc.b"], ["fc.w", "fc.b"])
    [('model.', '')]
    """
    state, model = list(state_keys), list(model_keys)
    if not state or not model or sorted(state) == sorted(model):
        return []
    wanted, required = set(model), set(model) - set(may_lack)
    fits: list[tuple[str, str]] = []
    for prefix in _prefixes(state[0], model):
        renamed = {k[len(prefix) :] for k in state if k.startswith(prefix)}
        if len(renamed) == len(state) and renamed <= wanted and required <= renamed:
            fits.append((prefix, ""))
    first = next((k for k in model if k in required), None)
    for prefix in _prefixes(first, state) if first is not None else []:
        renamed = {prefix + k for k in state}
        if renamed <= wanted and required <= renamed:
            fits.append(("", prefix))
    return fits


def _prefixes(key: str, candidates: Iterable[str]) -> list[str]:
    """The dotted prefixes ``p`` with ``key == p + c`` for some candidate ``c``."""
    return sorted({key[: len(key) - len(c)] for c in candidates if len(c) < len(key) and key.endswith("." + c)})
