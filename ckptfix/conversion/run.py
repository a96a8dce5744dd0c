"""Carrying out a plan (:mod:`ckptfix.conversion.plan`): its stream, or the reason it cannot run and the torch path.

One function for every use case that streams (``convert_file``, ``export_hf``, ``merge_files``): the plan's stream
runs where the plan streams; where the plan says torch, or the stream raises
:class:`~ckptfix.formats.copyable.Fallback` (before anything is written), the torch path runs instead, and the reason
is kept. :func:`run_conversion` says it the way a :class:`~ckptfix.transforms.checkpoint.Conversion` does: its
``method`` and a route note.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ckptfix.conversion.plan import Plan
from ckptfix.formats.copyable import Fallback
from ckptfix.notes import Kind, Note
from ckptfix.transforms.checkpoint import Conversion

R = TypeVar("R")


@dataclass(frozen=True)
class Ran(Generic[R]):
    """What :func:`run` returns: the result, and why the torch path ran (None: the stream did)."""

    result: R
    why: str | None = None


def run(plan: Plan, *, stream: Callable[[], R], torch: Callable[[], R]) -> Ran[R]:
    """``stream()`` where ``plan`` streams, else (or where it raises :class:`Fallback`) ``torch()``; and why."""
    if not plan.streams:
        return Ran(torch(), plan.reason or "")  # a torch plan always says why
    try:
        return Ran(stream())
    except Fallback as e:  # raised before the stream wrote anything
        why = str(e)
    return Ran(torch(), why)


def run_conversion(plan: Plan, *, stream: Callable[[], Conversion], torch: Callable[[], Conversion]) -> Conversion:
    """:func:`run`, its result's ``method`` set (``stream`` or ``torch``) and, for torch, a note saying why."""
    ran = run(plan, stream=stream, torch=torch)
    done = ran.result
    if ran.why is None:
        done.method = "stream"
    else:
        done.method = "torch"
        done.notes.append(Note(f"fast path not taken: {ran.why}", kind=Kind.ROUTE))
    return done


__all__ = ["Ran", "run", "run_conversion"]
