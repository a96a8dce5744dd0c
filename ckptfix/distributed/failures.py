"""Failures as every rank raises them: built once, on the rank that saw them, and carried to the others.

A failure travels as class name and message (and, for an unsafe checkpoint, the globals it needs) so that
every rank rebuilds the same :class:`~ckptfix.errors.CkptfixError`. A failure that no single rank owns (a
hang, a lost connection, ranks that disagree) names the ranks involved and never the rank that noticed, so
its text is the same whichever rank records it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptfix import errors
from ckptfix.errors import CkptfixError, DistributedError, UnsafeCheckpointError


@dataclass(frozen=True)
class Failure:
    """A failure in a form that crosses process boundaries.

    ``rank`` is the failing rank (``None`` for a failure no rank owns); ``absent`` the ranks known not to be
    there to hear of it (``None``: not known, during a transfer), so the others know whom to wait for.
    """

    rank: int | None
    kind: str
    message: str
    globals_needed: tuple[str, ...] = ()
    absent: tuple[int, ...] | None = ()

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> Failure:
        """Describe ``exc``; errors from outside ckptfix travel as :class:`DistributedError`."""
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, CkptfixError):
            # The nearest class that every rank can rebuild by name.
            kind = next(k.__name__ for k in type(exc).__mro__ if getattr(errors, k.__name__, None) is k)
        else:
            kind, message = "DistributedError", f"{type(exc).__name__}: {message}"
        needed = tuple(getattr(exc, "globals_needed", ()) or ())
        return cls(rank, kind, message, needed)

    @classmethod
    def common(cls, message: str, *, absent: tuple[int, ...] | None) -> Failure:
        """A hang, a lost connection or a disagreement: raised as :class:`DistributedError` with ``message``."""
        return cls(None, "DistributedError", message, absent=absent)

    def error(self) -> CkptfixError:
        """The error every rank raises: the failing rank's class and message, prefixed with that rank."""
        kind = getattr(errors, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, CkptfixError)):
            kind = DistributedError
        message = self.message if self.rank is None else f"rank {self.rank}: {self.message}"
        if kind is UnsafeCheckpointError:
            return UnsafeCheckpointError(message, globals_needed=list(self.globals_needed))
        return kind(message)


def who(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def disagreement(arguments: list[dict[str, Any]], ranks: list[int]) -> Failure | None:
    """The failure of a call whose ranks passed different ``arguments`` (one dict per rank), or ``None``."""
    names = list(dict.fromkeys(name for args in arguments for name in args))
    parts, differ = [], []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, args in zip(ranks, arguments, strict=True):
            by_value.setdefault(repr(args.get(name)), []).append(rank)
        if len(by_value) > 1:
            differ.append(name)
            parts.append(", ".join(f"{name}={value} on ranks {on}" for value, on in by_value.items()))
    if not differ:
        return None
    if "protocol" in differ:
        fix = "install the same ckptfix version on every rank"
    elif "call" in differ:
        fix = "make the same ckptfix calls on every rank, in the same order"
    else:
        fix = f"pass the same {', '.join(differ)} on every rank"
    calls = {args.get("call") for args in arguments}
    head = f"{calls.pop()} was called" if len(calls) == 1 else "ckptfix collectives were called"
    message = f"{head} with different arguments on different ranks: {'; '.join(parts)}; {fix}"
    return Failure.common(message, absent=())
