"""Files as torch writes them in conditions this machine lacks: storages tagged with a GPU's location (as a save
on that device tags them, made without a GPU), and saves without CRCs (torch's ``compute_crc32 = False``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def saved_on(where: Callable[[Any], str | None]) -> Iterator[None]:
    """Inside it, torch.save tags each storage with ``where(storage)`` (None: torch's own tag, ``cpu``)."""
    entry = (-1000, where, lambda storage, location: None)
    torch.serialization._package_registry.append(entry)
    torch.serialization._package_registry.sort(key=lambda e: e[0])
    try:
        yield
    finally:
        torch.serialization._package_registry.remove(entry)


def saved_as(location: str, *, only: list[torch.Tensor] | None = None) -> Any:
    """:func:`saved_on` with one location for every storage, or for the storages of ``only``'s tensors."""
    chosen = None if only is None else {t.untyped_storage()._cdata for t in only}
    return saved_on(lambda storage: location if chosen is None or storage._cdata in chosen else None)


def save_without_crcs(obj: Any, path: Path) -> None:
    from torch.utils.serialization import config

    config.save.compute_crc32 = False  # torch then writes 0 as every record's CRC
    try:
        torch.save(obj, path)
    finally:
        config.save.compute_crc32 = True
