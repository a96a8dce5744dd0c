"""Key lists for people: ``layer1.{1,2}.{bn1,bn2}.{weight,bias}`` instead of forty lines.

Sibling modules whose subtrees hold the same relative keys are merged into one brace group, recursively, so a
ResNet-50 state dict (320 keys) reads in about thirty lines. Pure string work, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    leaf: bool = False

    def signature(self) -> frozenset[str]:
        """Relative keys under this node; siblings with equal signatures print as one group."""
        out = {""} if self.leaf else set()
        for name, child in self.children.items():
            out.update(f"{name}.{rest}" if rest else name for rest in child.signature())
        return frozenset(out)


def _build(keys: Iterable[str]) -> _Node:
    root = _Node()
    for key in keys:
        node = root
        for part in key.split("."):
            node = node.children.setdefault(part, _Node())
        node.leaf = True
    return root


def brace(names: list[str]) -> str:
    """``['0','1','2','5']`` -> ``{0..2,5}``; a single name stays bare. Zero-padded numbers keep their width:
    ``['00','01','02']`` -> ``{00..02}``."""
    if len(names) == 1:
        return names[0]
    parts: list[str] = []
    i = 0
    while i < len(names):
        j = i
        while j + 1 < len(names) and _follows(names[j], names[j + 1]):
            j += 1
        parts.append(f"{names[i]}..{names[j]}" if j - i >= 2 else ",".join(names[i : j + 1]))
        i = j + 1
    return "{" + ",".join(parts) + "}"


def _follows(a: str, b: str) -> bool:
    """Whether ``b`` is the number after ``a`` written the same way: both plain, or both padded to one width
    (so that ``{lo..hi}`` expands back to exactly these names)."""
    if not (_is_int(a) and _is_int(b)) or int(b) != int(a) + 1:
        return False
    return len(a) == len(b) if _padded(a) or _padded(b) else True


def _padded(text: str) -> bool:
    return len(text) > 1 and text.startswith("0")


def _is_int(text: str) -> bool:
    return re.fullmatch(r"[0-9]+", text) is not None


def _render(prefix: str, node: _Node, out: list[tuple[str, list[str]]], paths: list[str]) -> None:
    """Append (line, the keys it stands for) for ``node``, reached by the key prefixes ``paths``."""
    if node.leaf and prefix:
        out.append((prefix.removesuffix("."), [p.removesuffix(".") for p in paths]))
    groups: dict[frozenset[str], list[str]] = {}
    for name, child in node.children.items():
        groups.setdefault(child.signature(), []).append(name)
    for names in groups.values():
        child = node.children[names[0]]
        label = prefix + brace(names)
        below = [f"{p}{name}." for p in paths for name in names]
        if not child.children:
            out.append((label, [p.removesuffix(".") for p in below]))
        else:
            _render(label + ".", child, out, below)


def group_keys(keys: Iterable[str]) -> list[str]:
    """One line per group of keys, in first-seen order.

    >>> group_keys(["a.0.weight", "a.0.bias", "a.1.weight", "a.1.bias", "b"])
    ['a.{0,1}.{weight,bias}', 'b']
    """
    return [line for line, _ in groups(keys)]


def groups(keys: Iterable[str]) -> list[tuple[str, list[str]]]:
    """:func:`group_keys`, each line with the keys it stands for (whatever the keys hold: braces, commas, dots)."""
    lines: list[tuple[str, list[str]]] = []
    _render("", _build(keys), lines, [""])
    return lines


def expand(pattern: str) -> list[str]:
    """The keys a group line stands for (the inverse of :func:`group_keys`, for tests and tools)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    out: list[str] = []
    for part in match.group(1).split(","):
        lo, sep, hi = part.partition("..")
        width = len(lo) if _padded(lo) else 0
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)] if sep else [part]
        for option in options:
            out.extend(expand(pattern[: match.start()] + option + pattern[match.end() :]))
    return out
