"""The one way ckptfix writes a size: SI decimal units (1 kB = 1,000 bytes, 1 GB = 10**9), as disks and
``ls -lh --si`` count them, with one decimal. Every command prints sizes through :func:`human_bytes`."""

from __future__ import annotations

_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def human_bytes(n: float) -> str:
    """``1610612736`` → ``1.6 GB``; ``512`` → ``512 B``."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


__all__ = ["human_bytes"]
