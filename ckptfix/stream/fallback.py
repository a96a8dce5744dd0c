"""The signal that the streaming path does not apply (it is not an error: the torch path takes over)."""

from __future__ import annotations


class Fallback(Exception):  # noqa: N818 - the name is the contract with ckptfix.conversion
    """The fast path does not apply to this input; ``str(e)`` says why, for ``--verbose``."""
