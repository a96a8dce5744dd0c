"""How deep a checkpoint's containers may nest, and the room to walk them.

Readers refuse nesting past :data:`MAX_DEPTH` (as deep as torch's own weights-only loader opens); consumers walk
trees recursively, a few frames a level, so every CLI command and every public library call runs inside
:func:`deep_enough`. Stdlib only: the decorator costs no import at start-up.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

MAX_DEPTH = 1000  # containers nested deeper than this are refused
FRAMES_PER_LEVEL = 12  # Python frames a recursive consumer spends on one level, at most

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def deep_enough() -> Iterator[None]:
    """Python's recursion limit raised (never lowered) so that a tree :data:`MAX_DEPTH` deep can be walked by
    recursive code: without it a 330-deep list that torch opens fails as an internal error. Python 3.11+ keeps
    Python frames off the C stack, so the raised limit does not risk it."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, MAX_DEPTH * FRAMES_PER_LEVEL + 2000))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def deep(func: F) -> F:
    """``func`` run inside :func:`deep_enough`: a library call walks what the readers accept, as the CLI does."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with deep_enough():
            return func(*args, **kwargs)

    return cast(F, wrapper)


__all__ = ["FRAMES_PER_LEVEL", "MAX_DEPTH", "deep", "deep_enough"]
