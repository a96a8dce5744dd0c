"""Files as torch writes them in conditions this machine lacks: storages tagged with a GPU's location (as a save
on that device tags them, made without a GPU), and saves without CRCs (torch's ``compute_crc32 = False``)."""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

# torch.save's compute_crc32 option (torch.utils.serialization.config) is new in torch 2.7
CAN_SKIP_CRCS = importlib.util.find_spec("torch.utils.serialization") is not None
without_crcs = pytest.mark.skipif(not CAN_SKIP_CRCS, reason=f"torch {torch.__version__} always writes CRCs")


def torch_saves(name: str) -> bool:
    """Whether this torch has dtype ``name`` and torch.save writes it (torch 2.5 has uint16 but cannot save it)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        return False
    try:
        torch.save(torch.zeros(16, dtype=torch.uint8).view(dtype), io.BytesIO())
    except Exception:
        return False
    return True


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
