"""A transformers index (``model.safetensors.index.json``): a JSON object whose ``weight_map`` names, for each
key, the shard file beside it that holds it. Read here once, for the folder reader (:mod:`.hf`) and for the output
checks (:mod:`ckptfix.formats.output.atomic`: an index's shards are inputs too)."""

from __future__ import annotations

import os
import stat
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.strict_json import Said, json_object

INDEX_SUFFIX = ".index.json"
MAX_INDEX = 64 << 20  # a 1M-key weight map is ~60 MB of JSON; anything larger is not an index


def looks_like_json(path: str | os.PathLike[str]) -> bool:
    """A regular file whose first bytes open a JSON object (an index, told apart by content, never by name)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or device is never opened: it could block forever
            return False
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.lstrip().startswith(b"{")


def is_index(path: str) -> bool:
    """``path`` is an index: a JSON object with a ``weight_map`` dict."""
    try:
        return isinstance(read_index(path).get("weight_map"), dict)
    except FormatError:
        return False


_INDEX_SAID = Said(
    duplicate="{e} in the index; the index is damaged",
    invalid="not a JSON index ({e}); re-download it",
    not_object="not an index (a JSON object with a 'weight_map' was expected)",
)


def read_index(path: str) -> dict[str, Any]:
    """The index file ``path`` as one strict JSON object (at most :data:`MAX_INDEX` bytes)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise FormatError(f"{path}: not a regular file (a FIFO, socket or device?); an index is a JSON file")
        with open(path, "rb") as f:
            raw = f.read(MAX_INDEX + 1)
    except OSError as e:
        raise FormatError(f"{path}: cannot read it ({e.strerror})") from e
    if len(raw) > MAX_INDEX:
        raise FormatError(f"{path}: over {MAX_INDEX >> 20} MiB, too large for an index file; it is not one")
    return json_object(raw, source=path, said=_INDEX_SAID)


def shards(root: str, index: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """What ``index`` maps: key → shard path, and the shards in the order they were written; each shard a plain
    file inside ``root``."""
    parsed = read_index(index)
    weight_map = parsed.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index}: has no 'weight_map' of keys to shard files; it is not a checkpoint index")
    shards: dict[str, str] = {}
    paths: dict[str, str] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise FormatError(f"{index}: key '{key}' maps to {name!r}, not a file name; the index is damaged")
        if name not in shards:
            shards[name] = inside(root, name, source=index, key=key)
        paths[key] = shards[name]
    ordered = tuple(shards[name] for name in sorted(shards))  # numbered names: the order they were written in
    return paths, ordered


def inside(root: str, name: str, *, source: str, key: str = "") -> str:
    """The path of ``name`` inside ``root``, refused when it names anything outside it or is not a file."""
    what = f"key '{key}' names shard {name!r}" if key else repr(name)
    if "\0" in name or not _encodable(name):
        raise FormatError(f"{source}: {what}, a name no file can have (a NUL or an unpaired surrogate); refusing it")
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
        raise FormatError(f"{source}: {what}, a path outside the folder; refusing the index")
    path = os.path.join(root, name)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise FormatError(f"{source}: {what}, a link to outside the folder; refusing it")
    if not os.path.lexists(path) or not os.path.exists(path):
        raise FormatError(f"{source}: {what}, which is missing; download the whole folder again")
    if not os.path.isfile(path):
        raise FormatError(f"{source}: {what}, which is not a regular file (a FIFO, socket, device or folder)")
    return path


def _encodable(name: str) -> bool:
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True
