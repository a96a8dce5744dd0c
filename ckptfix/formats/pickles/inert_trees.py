"""Walking and sizing the inert trees :mod:`.unpickling` builds: every object or record reachable, each once
(:func:`walk`, :func:`records`), and the size a tree takes once shared references are followed, refused past a
budget, a depth or a cycle (:func:`measure`). Building or writing a tree of a million containers runs with the
cyclic garbage collector paused (:func:`gc_paused`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.pickles.inert import Inert, InertParameter, InertTensor, StorageRef
from ckptfix.formats.records import TensorRecord
from ckptfix.formats.safety.depth import MAX_DEPTH


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building (or writing) a tree of a million containers, none of them
    garbage, would otherwise trigger collections that rescan it again and again.

    On the way out, what was made meanwhile joins the oldest generation unscanned (``gc.freeze`` then
    ``gc.unfreeze`` moves every tracked object there in constant time and resets the count of new ones): a
    plain ``gc.enable`` would have the next allocation scan the whole tree at once. Skipped when the program
    froze objects itself, which ``gc.unfreeze`` would release.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def children_of(item: Any) -> list[Any]:
    if isinstance(item, dict):
        kids = [*item.keys(), *item.values()]
        extra = getattr(item, "__dict__", None)  # _metadata of an OrderedDict
        return kids + list(extra.values()) if extra else kids
    if isinstance(item, (list, tuple)):
        return list(item)
    if isinstance(item, Inert) and not isinstance(item, TensorRecord):
        return [item.args, item.state] if item.has_state else [item.args]
    return []


def is_container(item: Any) -> bool:
    return isinstance(item, (dict, list, tuple)) or (isinstance(item, Inert) and not isinstance(item, TensorRecord))


def measure(tree: Any, *, budget: int, source: str) -> int:
    """The tree's size with shared references counted each time they are reached; refuse cycles, depth, blow-up.

    Consumers (transforms, diff, the writers) walk trees recursively, so a DAG of shared lists that is small in
    the file but huge when followed, a list that contains itself, or 10^5 levels of nesting would hang or crash
    them. Linear in the file: each object is sized once (memo) and tensors count as one.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    # a container being sized holds (number of children, the children that are containers)
    stack: list[tuple[Any, tuple[int, list[Any]] | None]] = [(tree, None)]
    while stack:
        item, kids = stack[-1]
        ident = id(item)
        if kids is None:
            if ident in sizes:
                stack.pop()
                continue
            children = children_of(item)
            if not children:
                sizes[ident] = 1
                stack.pop()
                continue
            if len(on_path) >= MAX_DEPTH:  # the containers being sized: this one's ancestors (not its siblings)
                raise FormatError(f"{source}: its pickle nests containers more than {MAX_DEPTH} deep; refusing it")
            on_path.add(ident)
            containers: list[Any] = []  # filled below, before any child is sized
            stack[-1] = (item, (len(children), containers))
            for kid in children:
                kind = type(kid)
                if kind in LEAVES or kind is InertTensor or kind is InertParameter:
                    continue  # counts 1 and holds nothing to follow: a state dict's keys and tensors, decided fast
                if id(kid) in on_path:
                    raise FormatError(f"{source}: its pickle has a container that contains itself; refusing it")
                if is_container(kid):
                    containers.append(kid)
                    if id(kid) not in sizes:  # a shared container is sized once
                        stack.append((kid, None))
            continue
        count, containers = kids
        total = 1 + count - len(containers) + sum(sizes.get(id(k), 1) for k in containers)
        if total > budget:
            raise FormatError(
                f"{source}: its pickle shares containers so often that following them visits more than {budget} "
                f"objects; refusing it"
            )
        sizes[ident] = total
        on_path.discard(ident)
        stack.pop()
    return sizes.get(id(tree), 1)


def walk(obj: Any) -> Iterator[Any]:
    """Every object reachable from ``obj``: containers and records once each, leaves (numbers, strings, storage
    references) once per place that holds them."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in LEAVES:
            yield item
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if kind is InertTensor or kind is InertParameter:
            # a Parameter's tensor; a tensor's storage (the rest of its record is numbers, checked when read)
            stack.append(item.args[0])
        else:
            stack.extend(children_of(item))


LEAVES = frozenset({str, int, float, bool, type(None), bytes, complex, StorageRef})


def records(obj: Any) -> Iterator[Inert]:
    """Every record reachable from ``obj`` (tensors, Parameters, other calls), once each: :func:`walk` without
    the leaves, which a state dict of a million string keys would yield for nothing."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in LEAVES or id(item) in seen:
            continue
        seen.add(id(item))
        if kind is InertTensor:
            yield item
        elif kind is InertParameter:
            yield item
            stack.append(item.args[0])
        elif isinstance(item, dict):
            if set(map(type, item)) - LEAVES:  # keys are strings, but need not be
                stack.extend(item)
            stack.extend(item.values())
            extra = getattr(item, "__dict__", None)  # _metadata of an OrderedDict
            if extra:
                stack.extend(extra.values())
        else:
            if isinstance(item, Inert):
                yield item
            stack.extend(children_of(item))
