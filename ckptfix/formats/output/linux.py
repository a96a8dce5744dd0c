"""Linux calls the standard library lacks, taken from the C library on first use (ctypes is imported only then)."""

from __future__ import annotations

import functools
import sys
from typing import Any


@functools.cache
def libc(name: str) -> Any | None:
    """The C library's function ``name`` (errno kept for ``ctypes.get_errno``); None off Linux or where it lacks one."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)  # libc is loaded already: no library search
    except (OSError, AttributeError):
        return None
