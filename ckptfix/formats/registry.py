"""Safe readers and atomic writers for .pt/.pth/.bin and .safetensors: one module per format.

- :mod:`ziparchive`: the zip container and its rules; :mod:`torchzip`: torch's zip checkpoint;
  :mod:`legacy`: the pre-1.6 torch format; :mod:`safetensors`: header reader, writer, load and save.
- :mod:`inert`: the one pickle reader (nothing executed); :mod:`allowlist`: which globals a pickle may name;
  :mod:`dtypes`: the one dtype table; :mod:`atomic`: crash-safe output.

The input format is decided by content (magic bytes), the output format by OUT's extension.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from collections.abc import Iterable
from typing import Any

from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.output.atomic import PathLike, check_output
from ckptfix.formats.safety.depth import deep

TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".tar")
SAFETENSORS_EXTENSIONS = (".safetensors",)


def detect_format(path: PathLike) -> str:
    """``torch-zip``, ``torch-legacy``, ``safetensors`` or ``folder``, from the first bytes of the file.

    ``folder`` is a folder of shards or training state, or a shard index file (JSON) in one.
    """
    source = os.fspath(path)
    refuse_remote(source)
    if os.path.isdir(source):
        return "folder"
    try:
        mode = os.stat(source).st_mode
        if not stat.S_ISREG(mode):  # never opened: reading a FIFO waits for a writer, a device never ends
            raise FormatError(f"{source}: not a regular file (a FIFO, socket or device); pass a checkpoint file")
        with open(path, "rb") as f:
            head = f.read(32)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError as e:
        raise FormatError(f"{source}: no such file; check the path") from e
    except IsADirectoryError as e:
        raise FormatError(f"{source}: is a folder, not a checkpoint file") from e
    except OSError as e:
        raise FormatError(f"{source}: cannot read it ({e.strerror})") from e
    if not head:
        raise FormatError(f"{source}: file is empty; re-download or re-save it")
    if head.startswith(b"PK\x03\x04"):
        _not_a_dcp_shard(source)
        return "torch-zip"
    if head[:1] == b"\x80":
        from ckptfix.formats.containers.legacy import MAGIC  # here: the legacy reader is for the rare old file only

        if MAGIC in head:
            return "torch-legacy"
    json_text = head.lstrip().startswith(b"{")
    if len(head) >= 9 and head[8:9] in (b"{", b"[", b" "):
        # safetensors: an 8-byte little-endian header length, then the JSON header. Text never passes for one:
        # eight bytes of text read as a length are over 2**61.
        (header_len,) = struct.unpack("<Q", head[:8])
        if header_len + 8 <= size:
            return "safetensors"
        if not json_text:
            raise FormatError(f"{source}: safetensors header runs past the end of the file; it is truncated")
    if json_text:
        return "folder"  # a shard index (JSON): folder.describe checks that it is one
    raise FormatError(
        f"{source}: not a checkpoint ckptfix can read (expected a torch zip, legacy torch or safetensors file, "
        f"found bytes {head[:8]!r})"
    )


def _not_a_dcp_shard(source: str) -> None:
    folder = os.path.dirname(os.path.abspath(source))
    if source.endswith(".distcp") and os.path.isfile(os.path.join(folder, ".metadata")):
        raise FormatError(
            f"{source}: is one data file of a torch.distributed.checkpoint folder, not a checkpoint on its own; "
            f"pass the folder {folder}"
        )


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


@deep
def load(
    path: PathLike,
    *,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    mmap: bool = True,
    verify: bool = True,
    model_only: bool = False,
) -> Any:
    """Load a checkpoint safely: weights-only, onto the CPU, memory-mapped where the format allows.

    ``allow_globals`` names extra classes the pickle may build (``argparse.Namespace``); never ``os.system``
    and the like. ``unsafe=True`` runs the full unpickler: only for files you fully trust. ``path`` may be a
    folder (transformers shards with their index, an accelerate ``save_state`` folder) or its index file;
    ``model_only=True`` leaves a folder's optimizer, scheduler and RNG files unread.

    >>> ckpt = ckptfix.load("run/last.pt")
    """
    return read(
        path,
        fmt=detect_format(path),
        unsafe=unsafe,
        allow_globals=allow_globals,
        mmap=mmap,
        verify=verify,
        model_only=model_only,
    )


def read(
    path: PathLike,
    *,
    fmt: str,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    mmap: bool = True,
    verify: bool = True,
    model_only: bool = False,
    opaque: bool = False,
) -> Any:
    """:func:`load` for a file whose format was already detected; ``opaque``: see :func:`.torchfile.load_torch`."""
    source = os.fspath(path)
    if fmt == "folder":
        from ckptfix.formats.folders.dcp import is_dcp, load_dcp
        from ckptfix.formats.folders.hf import load_folder

        if is_dcp(source):
            return load_dcp(source, allow_globals=allow_globals, mmap=mmap, verify=verify)
        from ckptfix.formats.folders.deepspeed import is_deepspeed, load_run

        if is_deepspeed(source):  # the consolidated fp32 master weights, each partition's bytes read once
            return load_run(source, allow_globals=allow_globals, verify=verify)

        def shard(file: str) -> Any:
            return read(file, fmt=detect_format(file), unsafe=unsafe, allow_globals=allow_globals, mmap=mmap,
                        verify=verify)  # fmt: skip

        return load_folder(path, read=shard, model_only=model_only)
    if fmt == "safetensors":
        from ckptfix.formats.containers.safetensors import load_safetensors

        return load_safetensors(path, source=source)
    from ckptfix.formats.torchio.torchfile import load_torch

    return load_torch(path, fmt=fmt, source=source, unsafe=unsafe, allow_globals=allow_globals, mmap=mmap,
                      verify=verify, opaque=opaque)  # fmt: skip


@deep
def save(obj: Any, path: PathLike, *, shard_size: int | None = None, overwrite: bool = False) -> None:
    """Write ``obj`` atomically in the format OUT's extension names (temp file, fsync, rename).

    With ``shard_size`` (bytes) a state dict is written as transformers shards of at most that size beside
    OUT (``model-00001-of-00003.safetensors`` …) with OUT's index (``model.safetensors.index.json``); OUT may
    be a folder (``model.safetensors`` in it). A folder OUT without ``shard_size`` (ending in ``/``, or an
    existing empty folder) gets a torch.distributed.checkpoint (DCP) folder.

    A file OUT is replaced if it exists, as ``torch.save`` replaces it. An existing DCP folder (not empty) or
    shard set of OUT's name is refused unless ``overwrite=True``, which replaces it only when it holds nothing
    but a checkpoint's files, and only once the new one is complete.

    >>> ckptfix.save({"model": model.state_dict(), "epoch": 3}, "run/last.pt")
    """
    if shard_size is not None and output_format(path) == "dcp":
        path = os.path.join(path, "model.safetensors")  # a folder of shards, named as transformers names them
    fmt = output_format(path)
    if fmt != "dcp" and shard_size is None:  # the DCP and shard writers check their folders themselves
        check_output(path)
    write(obj, path, fmt=fmt, shard_size=shard_size, overwrite=overwrite)


def write(obj: Any, path: PathLike, *, fmt: str, shard_size: int | None = None, overwrite: bool = False) -> None:
    """:func:`save` to an output already checked, in format ``fmt``; ``overwrite`` lets a DCP folder or a shard
    set replace the one already there (a file output is replaced whatever it says: its check came before)."""
    if fmt == "dcp":
        from ckptfix.formats.folders.dcp import save_dcp

        save_dcp(obj, os.fspath(path), overwrite=overwrite)
    elif shard_size is not None:
        from ckptfix.formats.folders.hf import save_sharded

        save_sharded(
            obj, path, limit=shard_size, write=lambda sub, file: write(sub, file, fmt=fmt), overwrite=overwrite
        )
    elif fmt == "safetensors":
        from ckptfix.formats.containers.safetensors import save_safetensors

        save_safetensors(obj, path)
    else:
        from ckptfix.formats.torchio.torchfile import save_torch

        save_torch(obj, path)


__all__ = ["detect_format", "load", "output_format", "read", "save", "write"]
