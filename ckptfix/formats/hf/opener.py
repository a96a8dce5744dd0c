"""A transformers folder (shards with their index, or an accelerate ``save_state`` folder) opened file by file (its
registry row's ``open``): each file a checkpoint of its own, opened as it would be alone (a part), the folder's rules
(:mod:`~.hf.folder`) on top, and each tensor a :class:`~.hf.folder.FolderTensor` of its part. For a stream, flat
safetensors shards are opened as the byte ranges of their files instead (one table, no part each)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from ckptfix.errors import UnsafeCheckpointError
from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.formats.hf.folder import _MODEL_FILE, Folder, FolderTensor, describe, merge_shards, room_for_files
from ckptfix.formats.opened import Opened, OpenedFolder, OpenOptions
from ckptfix.formats.pickles import inert_trees
from ckptfix.formats.records import is_record, map_tree
from ckptfix.formats.safetensors.file import tree_from_header
from ckptfix.formats.safetensors.header import read_header
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import OpaqueEntry, wrap
from ckptfix.formats.torchio.torchfile import file_identity
from ckptfix.formats.torchzip.reader import read_torch_zip
from ckptfix.transforms.checkpoint import is_tensor


def open_hf(source: str, options: OpenOptions, *, detect_format: Callable[[str], str]) -> OpenedFolder:
    """The folder (or its index file) as an :class:`OpenedFolder`; for a stream, :func:`_stream_shards`.
    ``detect_format`` (the registry's) names each file's format."""
    if options.stream:
        return _stream_shards(source, detect_format=detect_format)
    folder = describe(source)
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=None,
        kind="shards" if folder.flat else "accelerate",
        label="shards" if folder.flat else "accelerate",
        files=folder.files + ([folder.index] if folder.index else []),
        index=folder.index,
    )
    try:
        if folder.flat:
            opened.tree = _shards(opened, folder, options)
        else:
            opened.tree = _accelerate(opened, folder, options, detect_format=detect_format)
        for i, part in enumerate(opened.parts):
            for obj in inert_trees.walk(part.tree):
                if is_record(obj):  # a tensor record of a part: read from that part
                    opened.owner.setdefault(id(obj), i)
    except BaseException:
        opened.close(check=False)
        raise
    tagged = [p.locations for p in opened.parts if p.locations is not None]
    opened.locations = dict(sum((Counter(t) for t in tagged), Counter())) if tagged else None
    opened.crc_stored = all(p.crc_stored for p in opened.parts)
    notes = [f"{os.path.basename(p.source)} is {p.note}" for p in opened.parts if p.note]
    opened.note = notes[0] if notes else None
    return opened


def _each(options: OpenOptions) -> dict[str, Any]:
    """How each file of the folder is opened: as it would be alone."""
    return {"allow_globals": options.allow_globals, "need_bytes": options.need_bytes, "verify": options.verify}


def _shards(opened: OpenedFolder, folder: Folder, options: OpenOptions) -> Any:
    assert options.open_file is not None  # reading.open_checkpoint passes itself

    def parts() -> Iterator[tuple[str, Any]]:
        for path in folder.files:
            opened.parts.append(options.open_file(path, **_each(options)))  # type: ignore[misc]
            yield path, opened.parts[-1].tree

    return merge_shards(folder, parts(), record=lambda path, value: _wrapped(value, len(opened.parts) - 1))


def _accelerate(
    opened: OpenedFolder, folder: Folder, options: OpenOptions, *, detect_format: Callable[[str], str]
) -> Any:
    """The model files as model entries, the training state (optimizer, scheduler, RNG) as other entries; with
    ``opaque``, a file needing globals outside the allowlist (numpy RNG state) is one unbuilt entry."""
    assert options.open_file is not None  # reading.open_checkpoint passes itself
    tree: OrderedDict[str, Any] = OrderedDict()
    for entry, (path,) in folder.entries.items():
        model = bool(_MODEL_FILE.match(os.path.basename(path)))
        try:
            part = options.open_file(path, **_each(options), opaque=options.opaque and not model)
        except UnsafeCheckpointError:
            if not options.opaque or model or detect_format(path) != "torch-zip":
                raise
            part = _opaque_file(path, entry, allow_globals=options.allow_globals)
        opened.parts.append(part)
        tree[entry] = _wrapped(part.tree, len(opened.parts) - 1)
    return tree


def _opaque_file(path: str, entry: str, *, allow_globals: tuple[str, ...]) -> Opened:
    """A whole file as one :class:`OpaqueEntry` named ``entry``: its records, nothing built."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = file_identity(fd)
        refused: list[str] = []
        z = read_torch_zip(fd, path, allowed=allowlist.allowed_names(allow_globals, source=path), refused=refused)
        tree = wrap({entry: z.tree}, refused, source=path)[entry]
    except BaseException:
        os.close(fd)
        raise
    return Opened(source=path, fmt="torch-zip", tree=tree, fd=fd, zip=z, before=before)


def _wrapped(obj: Any, part: int) -> Any:
    """``obj`` with each tensor (record) in it as a :class:`FolderTensor` of ``part``; containers copied."""

    def wrap(value: Any) -> Any:
        if isinstance(value, OpaqueEntry):
            return dataclasses.replace(value, records=_wrapped(value.records, part))
        return FolderTensor(part, value)

    return map_tree(obj, wrap, leaf=lambda v: is_tensor(v) or isinstance(v, OpaqueEntry))


def _stream_shards(source: str, *, detect_format: Callable[[str], str]) -> OpenedFolder:
    """Flat safetensors shards as the byte ranges of their files (a tensor under two names of a shard is one
    record of it, read from that shard); :class:`Fallback` for an accelerate folder or a torch shard, which the
    torch path reads file by file."""
    folder = describe(source)
    if not folder.flat:
        raise Fallback(Reason.ACCELERATE_FOLDER)
    room_for_files(len(folder.files), source=source)
    for path in folder.files:
        if detect_format(path) != "safetensors":
            raise Fallback(Reason.TORCH_SHARD, shard=os.path.basename(path))
    shards = ((path, tree_from_header(read_header(path), source=path)) for path in folder.files)
    tree = merge_shards(folder, shards)
    return OpenedFolder(source=source, fmt="folder", tree=tree, kind="shards", label="shards", files=folder.files)
