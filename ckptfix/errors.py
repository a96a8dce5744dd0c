"""The one error hierarchy of ckptfix.

Every error a user can cause is a :class:`CkptfixError`. Messages are one line and name the file, the key,
what was expected and the fix. ``exit_code`` follows the CLI contract: 1 when a check found a problem,
2 when the input cannot be used or the command was misused.
"""

from __future__ import annotations

import re


class CkptfixError(Exception):
    """Base of every error ckptfix raises for bad input or bad usage."""

    exit_code = 2


class FormatError(CkptfixError):
    """A file is missing, truncated, corrupt, or in a format ckptfix does not read."""


class UnsafeCheckpointError(CkptfixError):
    """A checkpoint needs pickle globals outside the weights-only allowlist; nothing was executed."""

    def __init__(self, message: str, *, globals_needed: list[str] | None = None) -> None:
        super().__init__(message)
        self.globals_needed = list(globals_needed or [])


class LayoutError(CkptfixError):
    """Key layout is ambiguous, collides after conversion, or cannot be mapped to the requested one."""


class UsageError(CkptfixError, ValueError):
    """An argument ckptfix cannot take: an unknown layout or dtype name, a bad option value (also a ValueError)."""


class OutputError(CkptfixError):
    """The output cannot be written (same as input, folder missing or read-only, unsupported entries)."""


class MismatchError(CkptfixError):
    """A state dict does not fit a model or another state dict (missing, unexpected, shape, dtype)."""

    exit_code = 1


class MergeError(CkptfixError):
    """Per-rank checkpoints cannot be merged (parameters diverged, incompatible buffers)."""

    exit_code = 1


class AverageError(MergeError):
    """Checkpoints that cannot be averaged (different keys, shapes or dtypes) or weights that cannot be used.
    Bad input (exit 2), unlike ranks whose values disagree."""

    exit_code = 2


class DistributedError(CkptfixError):
    """A collective load or save failed on some rank; every rank raises it with the failing rank's message."""


# The library names its options as keywords (``renames='^a\\.='``); people at a shell read them as flags.
_FLAGS = {
    "strip_prefixes": "--strip-prefix",
    "add_prefixes": "--add-prefix",
    "renames": "--rename",
    "entries": "--entry",
    "entry": "--entry",
    "allow_globals": "--allow-global",
    "model_only": "--model-only",
    "unsafe": "--unsafe-pickle",
    "dtype": "--dtype",
    "to": "--to",
    "overwrite": "--force",
    "shard_size": "--shard-size",
    "optimizer": "--optimizer",
    "optimizer_factory": "--optimizer-factory",
    "model": "--model",
}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")=(True\b|None\b|'[^']*')?")


def as_flags(message: str) -> str:
    """A library message with its keyword options spelled as the CLI's flags.

    >>> as_flags("use renames='^model[.]=' or model_only=True")
    "use --rename '^model[.]=' or --model-only"
    """

    def flag(match: re.Match[str]) -> str:
        value = match.group(2)
        if match.group(1) == "to" and value == "None":  # the library keeps the layout with to=None
            return "--keep-layout"
        if match.group(1) == "allow_globals" and value:  # a dotted class name needs no quotes at a shell
            value = value[1:-1]
        return _FLAGS[match.group(1)] + (f" {value}" if value and value != "True" else "")

    return _KEYWORD.sub(flag, message)


__all__ = [
    "AverageError",
    "CkptfixError",
    "DistributedError",
    "FormatError",
    "LayoutError",
    "MergeError",
    "MismatchError",
    "OutputError",
    "UnsafeCheckpointError",
    "UsageError",
    "as_flags",
]
