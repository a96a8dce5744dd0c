"""Keyword-only options that fail loudly: a misspelled option names the valid ones."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def strict_keywords(func: F) -> F:
    """Turn Python's "unexpected keyword argument" into a TypeError that lists the valid options."""
    params = inspect.signature(func).parameters
    options = [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            import difflib  # only a misspelled option needs it, not every start-up

            close = difflib.get_close_matches(unknown[0], options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{func.__name__}() got an unexpected option {unknown[0]!r}{hint}; valid options: {', '.join(options)}"
            )
        return func(*args, **kwargs)

    return cast(F, wrapper)
