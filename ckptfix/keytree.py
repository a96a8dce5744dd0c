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
    """``['0','1','2','5']`` -> ``{0..2,5}``; a single name stays bare."""
    if len(names) == 1:
        return names[0]
    parts: list[str] = []
    i = 0
    while i < len(names):
        j = i
        while (
            j + 1 < len(names)
            and _is_int(names[j])
            and _is_int(names[j + 1])
            and int(names[j + 1]) == int(names[j]) + 1
        ):
            j += 1
        parts.append(f"{names[i]}..{names[j]}" if j - i >= 2 else ",".join(names[i : j + 1]))
        i = j + 1
    return "{" + ",".join(parts) + "}"


def _is_int(text: str) -> bool:
    return re.fullmatch(r"\d+", text) is not None


def _render(prefix: str, node: _Node, out: list[str]) -> None:
    if node.leaf and prefix:
        out.append(prefix.rstrip("."))
    groups: dict[frozenset[str], list[str]] = {}
    for name, child in node.children.items():
        groups.setdefault(child.signature(), []).append(name)
    for names in groups.values():
        child = node.children[names[0]]
        label = prefix + brace(names)
        if not child.children:
            out.append(label)
        else:
            _render(label + ".", child, out)


def group_keys(keys: Iterable[str]) -> list[str]:
    """One line per group of keys, in first-seen order.

    >>> group_keys(["a.0.weight", "a.0.bias", "a.1.weight", "a.1.bias", "b"])
    ['a.{0,1}.{weight,bias}', 'b']
    """
    lines: list[str] = []
    _render("", _build(keys), lines)
    return lines


def expand(pattern: str) -> list[str]:
    """The keys a group line stands for (the inverse of :func:`group_keys`, for tests and tools)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    out: list[str] = []
    for part in match.group(1).split(","):
        lo, sep, hi = part.partition("..")
        options = [str(i) for i in range(int(lo), int(hi) + 1)] if sep else [part]
        for option in options:
            out.extend(expand(pattern[: match.start()] + option + pattern[match.end() :]))
    return out
