"""Each output format's writer, as its row of the registry names it (``Format.write``): ``write(obj, path,
options)`` writes OUT, whose check came before. A file format writes one file, or with ``shard_size``
transformers shards of it beside OUT (:func:`file_writer`); a folder format writes its folder. The format modules
are imported only when one is written."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptfix.formats.output.atomic import PathLike


@dataclass(frozen=True)
class WriteOptions:
    """How a writer writes (``registry.write``): ``shard_size`` (bytes) splits a file format's state dict into
    transformers shards beside OUT, with OUT's index; ``overwrite`` lets a folder or a shard set replace the one
    already there."""

    shard_size: int | None = None
    overwrite: bool = False


def dcp_write(obj: Any, path: PathLike, options: WriteOptions) -> None:
    from ckptfix.formats.dcp.writer import save_dcp

    save_dcp(obj, os.fspath(path), overwrite=options.overwrite)  # a folder: never split into shards


def file_writer(save: Callable[[Any, PathLike], None]) -> Callable[[Any, PathLike, WriteOptions], None]:
    """A file format's writer: one file, or with ``shard_size`` transformers shards of it beside OUT."""

    def write_file(obj: Any, path: PathLike, options: WriteOptions) -> None:
        if options.shard_size is None:
            save(obj, path)
            return
        from ckptfix.formats.hf.folder import save_sharded

        save_sharded(obj, path, limit=options.shard_size, write=save, overwrite=options.overwrite)

    return write_file


def save_torch(obj: Any, path: PathLike) -> None:
    from ckptfix.formats.torchio import torchfile

    torchfile.save_torch(obj, path)


def save_safetensors(obj: Any, path: PathLike) -> None:
    from ckptfix.formats.safetensors import file

    file.save_safetensors(obj, path)


__all__ = ["WriteOptions", "dcp_write", "file_writer", "save_safetensors", "save_torch"]
