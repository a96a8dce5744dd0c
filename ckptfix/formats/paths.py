"""What a path names before anything is read: a remote address (refused, not called a missing file), and OUT's
format, from its extension or as a folder, with where a conversion writes it (:func:`resolve_output`). Which row of
the registry writes that format is :mod:`ckptfix.formats.registry`'s to say."""

from __future__ import annotations

import os
import re

from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.output.atomic import PathLike

TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".tar")
SAFETENSORS_EXTENSIONS = (".safetensors",)


def refuse_remote(path: str) -> None:
    """An ``s3://``, ``gs://``, ``hf://`` or ``https://`` address is said to be one, not called a missing file."""
    if _REMOTE.match(path):
        raise FormatError(
            f"{path}: remote paths are not read yet; download the file first (aws s3 cp, gsutil cp, "
            f"huggingface-cli download, curl -O) and pass the local copy"
        )


_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def output_format(path: PathLike) -> str:
    """``torch`` or ``safetensors`` from OUT's extension; ``dcp`` for a folder (ending in ``/`` or existing)."""
    refuse_remote(os.fspath(path))
    if os.fspath(path).endswith(os.sep) or os.path.isdir(path):
        return "dcp"
    name = os.fspath(path).lower()
    if name.endswith(SAFETENSORS_EXTENSIONS):
        return "safetensors"
    if name.endswith(TORCH_EXTENSIONS):
        return "torch"
    raise OutputError(
        f"{os.fspath(path)}: unknown output extension; use {', '.join(TORCH_EXTENSIONS)} (torch) or .safetensors, "
        f"or end it with / for a DCP folder"
    )


OUTPUT_FORMATS = ("hf", "dcp", "safetensors", "pt")  # what --format names
_FOLDER_FILES = {"safetensors": "model.safetensors", "pt": "model.pt"}  # a folder's one file, as transformers names it
ONE_SHARD = 1 << 62  # a shard size no checkpoint reaches: one file, written by the shard writer (folder made, swapped)


def resolve_output(
    path: PathLike, *, fmt: str | None = None, shard_size: int | None = None
) -> tuple[str, str, int | None]:
    """Where and in what format a conversion writes OUT: (the path its writer takes, ``torch``, ``safetensors``,
    ``dcp`` or ``hf``, the shard size). A folder OUT (ending in ``/`` or existing) gets ``fmt`` (``hf``, ``dcp``,
    ``safetensors``, ``pt``: ``model.safetensors`` or ``model.pt`` in it, written as one shard, by the shard
    writer that makes the folder; or their shards); without ``fmt`` a DCP folder, or transformers shards with
    ``shard_size``. A file OUT's extension must agree with ``fmt``."""
    from ckptfix.errors import UsageError

    out = os.fspath(path)
    if fmt is not None and fmt not in OUTPUT_FORMATS:
        raise UsageError(f"format={fmt!r}: unknown output format; choose one of {', '.join(OUTPUT_FORMATS)}")
    named_file = out.lower().endswith(SAFETENSORS_EXTENSIONS + TORCH_EXTENSIONS) and not os.path.isdir(out)
    found = "dcp" if fmt in ("hf", "dcp") and not named_file else output_format(path)
    if found != "dcp":  # a file
        if fmt in ("hf", "dcp"):
            raise UsageError(f"{out}: --format {fmt} writes a folder; end OUT with / (or name an existing folder)")
        if fmt is not None and {"pt": "torch"}.get(fmt, fmt) != found:
            raise UsageError(f"{out}: its extension says {found}, --format says {fmt}; change one")
        return out, found, shard_size
    if fmt == "dcp" and shard_size is not None:
        raise UsageError("--shard-size writes transformers shards, --format dcp a DCP folder; drop one")
    if fmt in (None, "dcp"):
        shards = os.path.join(out, "model.safetensors"), "safetensors", shard_size
        return shards if shard_size is not None else (out, "dcp", None)
    if fmt == "hf":
        return out, "hf", shard_size
    return os.path.join(out, _FOLDER_FILES[fmt]), {"pt": "torch"}.get(fmt, fmt), shard_size or ONE_SHARD


__all__ = [
    "ONE_SHARD",
    "OUTPUT_FORMATS",
    "SAFETENSORS_EXTENSIONS",
    "TORCH_EXTENSIONS",
    "output_format",
    "refuse_remote",
    "resolve_output",
]
