"""Where each tensor was saved (its location tag: ``cpu``, ``cuda:0``), kept from reading a file to writing one.

ckptfix reads every tensor onto the CPU (a checkpoint saved on a GPU opens on a machine without one), but a
``.pt`` it writes must say what the input said: ``torch.load`` of a CUDA-saved file puts its tensors back on
the GPU, and a conversion must not change that. Inside :func:`keeping_locations` the readers note each storage's
saved tag and ``torch.save`` writes it back, through a tagger in torch's own registry of locations
(``torch.serialization.register_package``). Storages made meanwhile (a dtype cast) can inherit their source's tag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The tags of the storages read in the active context, by their C storage pointer: the storages stay alive (the
# loaded checkpoint holds them) for as long as the context, so no pointer is reused while it is active.
_TAGS: ContextVar[dict[int, str] | None] = ContextVar("ckptfix_locations", default=None)
_REGISTERED = False


@contextmanager
def keeping_locations() -> Iterator[None]:
    """Storages read inside remember their saved location; ``torch.save`` inside writes it back."""
    _register()
    token = _TAGS.set({})
    try:
        yield
    finally:
        _TAGS.reset(token)


def note(storage: Any, location: str) -> None:
    """``storage`` (an UntypedStorage read onto the CPU) was saved at ``location``."""
    tags = _TAGS.get()
    if tags is not None and location != "cpu":
        tags[storage._cdata] = location


def inherit(new: torch.Tensor, old: torch.Tensor) -> None:
    """``new`` (made from ``old``, e.g. cast) is written with ``old``'s saved location."""
    tags = _TAGS.get()
    if tags is not None and (location := tags.get(old.untyped_storage()._cdata)) is not None:
        tags[new.untyped_storage()._cdata] = location


def map_location() -> str | Callable[[Any, str], Any]:
    """``torch.load``'s ``map_location``: the CPU, noting each storage's saved location in the active context."""
    if _TAGS.get() is None:
        return "cpu"

    def to_cpu(storage: Any, location: str) -> Any:
        note(storage, location)
        return storage  # torch hands each storage over on the CPU already

    return to_cpu


def _tagger(storage: Any) -> str | None:
    tags = _TAGS.get()
    cdata = getattr(storage, "_cdata", None)
    return None if tags is None or cdata is None else tags.get(cdata)


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        import torch

        # Ahead of torch's own taggers (cpu is 10, cuda 20); outside a context it answers None and theirs decide.
        torch.serialization.register_package(-100, _tagger, lambda storage, location: None)
        _REGISTERED = True


__all__ = ["inherit", "keeping_locations", "map_location", "note"]
