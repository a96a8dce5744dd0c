"""The archive ``torch.save`` writes, for the writers that lay one out around bytes copied from elsewhere: the
records in its order (``data.pkl``, the head records, ``data/<key>`` per storage, the tail records and a
serialization id) and the inert tensors it pickles for tensors that are new to the archive."""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from ckptfix.formats.pickles import inert
from ckptfix.formats.torchzip.archive import ZipWriter
from ckptfix.formats.torchzip.reader import HEAD, TAIL, stand_ins, tensor_record

PREFIX = "archive/"


def write_head(writer: ZipWriter, pkl: bytes, *, format_version: bool = True) -> None:
    """``data.pkl`` and the records torch.save writes before the storages. Without ``format_version`` (a storage
    padded more than the smallest padding) torch reads every storage's offset from its header, as older torch
    versions wrote."""
    writer.add(PREFIX + "data.pkl", pkl, zlib.crc32(pkl))
    for name, data in HEAD:
        if format_version or name != ".format_version":
            writer.add(PREFIX + name, data, zlib.crc32(data))


def storage_name(key: str) -> str:
    return f"{PREFIX}data/{key}"


def write_tail(writer: ZipWriter) -> None:
    """The records torch.save writes after the storages (the caller then finishes the archive)."""
    for name, data in TAIL:
        writer.add(PREFIX + name, data, zlib.crc32(data))
    ident = b"%040d" % (int.from_bytes(os.urandom(17), "big") % 10**40)  # 40 digits, as torch.save (no secrets)
    writer.add(PREFIX + ".data/serialization_id", ident, zlib.crc32(ident))


class NewStorages:
    """The inert tensor torch.save pickles for each new tensor record (``dtype``, ``shape``) it is called with: one
    storage per record object (a tensor under two names, tied weights, is stored once, as torch.save stores it),
    keyed by the next of ``keys`` (``"0"``, ``"1"``, …); ``stored`` maps each key to its record, in order."""

    def __init__(self, *, keys: Iterable[str] | None = None, size: Callable[[Any], int] = lambda v: v.nbytes) -> None:
        self.glob = stand_ins()
        self.keys = iter(keys) if keys is not None else map(str, itertools.count())
        self.size = size
        self.made: dict[int, inert.InertTensor] = {}  # id of a record -> the inert tensor written for it
        self.stored: dict[str, Any] = {}

    def __call__(self, value: Any) -> inert.InertTensor:
        if id(value) not in self.made:
            key = next(self.keys)
            self.made[id(value)] = tensor_record(value.dtype, value.shape, key, self.size(value), glob=self.glob)
            self.stored[key] = value
        return self.made[id(value)]
