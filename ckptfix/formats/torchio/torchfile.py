"""Materialize torch checkpoint files (.pt/.pth/.bin) with torch, and save them: the torch path.

Every file is first read and checked by the same readers the streaming path uses (:mod:`torchzip` or
:mod:`legacy`). A zip's tensors are then built from that description (:mod:`materialize`); the legacy format,
and the few recipes the builder leaves to torch, reach ``torch.load``, weights-only, with the same allowlist.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from ckptfix.errors import FormatError, OutputError, UnsafeCheckpointError
from ckptfix.formats.legacy.reader import check_legacy
from ckptfix.formats.output.atomic import PathLike, atomic_output
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio import devices
from ckptfix.formats.torchio.materialize import NotBuilt, materialize
from ckptfix.formats.torchio.opaque import describe, entries, refusal
from ckptfix.torchcompat import safe_globals

_NOT_BUILT = object()


def file_identity(fd: int) -> tuple[int, ...]:
    """What changes when a file is replaced or written to: compared before and after a read."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def changed_while_reading(source: str) -> FormatError:
    return FormatError(f"{source}: the file changed while it was being read; run the command again once it is complete")


def load_torch(
    path: PathLike,
    *,
    fmt: str,
    source: str,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    mmap: bool = True,
    verify: bool = True,
    opaque: bool = False,
) -> Any:
    """Load a torch file weights-only onto the CPU; the unpickler never calls anything off the allowlist.

    ``opaque=True``: a zip's entries that need globals outside the allowlist come back unbuilt, as
    :class:`~ckptfix.formats.torchio.opaque.OpaqueEntry` records, instead of a refusal (and torch.load is never called).
    """
    if unsafe:
        # a warning filter must not hide this: printed, not warned
        print(f"ckptfix: {source}: unsafe pickle loading: this can run code from the file", file=sys.stderr)
        return _torch_load(path, source=source, weights_only=False, mmap=False)
    extra = list(allow_globals)
    allowed = allowlist.allowed_names(extra, source=source)
    objects = allowlist.resolve(extra, source=source)

    with open(path, "rb") as f:
        before = file_identity(f.fileno())
        obj = _NOT_BUILT
        if fmt == "torch-legacy":
            check_legacy(source, allowed=allowed)
        else:
            described = describe(f.fileno(), source, allowed=allowed, verify=verify, keep=opaque)
            try:
                obj = materialize(described, f.fileno(), mmap=mmap)
            except NotBuilt as e:
                if entries(described.tree):  # torch.load would refuse the whole file: say why, and what rescues
                    raise refusal(described.tree, source=source) from e
        if obj is _NOT_BUILT:  # the legacy format, and recipes only torch rebuilds (quantized, sparse, ...)
            with safe_globals(objects):
                obj = _torch_load(path, source=source, weights_only=True, mmap=mmap and fmt == "torch-zip")
        if file_identity(f.fileno()) != before:
            raise changed_while_reading(source)
    return obj


def _torch_load(path: PathLike, *, source: str, weights_only: bool, mmap: bool) -> Any:
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            name = os.fspath(path)
            if name.encode("utf-8", "surrogateescape").decode("utf-8", "replace") != name:
                # torch hands path names to C++ as UTF-8; a non-UTF-8 name is opened here (no mmap then)
                with open(name, "rb") as f:
                    return torch.load(f, map_location=devices.map_location(), weights_only=weights_only)
            return torch.load(name, map_location=devices.map_location(), weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as e:
        if weights_only:
            raise _weights_only_error(str(e), source=source) from e
        raise FormatError(f"{source}: corrupt pickle ({_first_line(e)}); re-download or re-save it") from e
    except MemoryError as e:
        raise FormatError(f"{source}: not enough memory to load it; free memory or use a smaller file") from e
    except Exception as e:  # torch reports corruption as RuntimeError, EOFError, KeyError, ...
        raise FormatError(
            f"{source}: corrupt or truncated torch file ({_first_line(e)}); re-download or re-save it"
        ) from e


def _weights_only_error(text: str, *, source: str) -> Exception:
    # torch wraps the unpickler's reason in a long preamble; the reason follows "WeightsUnpickler error:".
    reason = text.split("WeightsUnpickler error:", 1)[-1].strip().split("\n")[0].strip()
    name = re.search(r"<class '([\w.]+)'>|GLOBAL ([\w.]+)|function ([\w.]+)", reason)
    if name is None:
        return FormatError(f"{source}: corrupt pickle ({reason[:200]}); re-download or re-save it")
    needed = next(g for g in name.groups() if g)
    try:
        allowlist.refuse([needed], source=source)
    except (UnsafeCheckpointError, FormatError) as e:
        return e
    return FormatError(f"{source}: torch refused it ({reason[:200]}); re-download or re-save it")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0] or type(e).__name__
    return text if len(text) < 200 else text[:197] + "..."


def save_torch(obj: Any, out: PathLike) -> None:
    """``torch.save`` into a temp file beside OUT, then an atomic rename."""
    import torch

    try:
        with atomic_output(out) as f:
            torch.save(obj, f)
    except (TypeError, ValueError, AttributeError, RuntimeError, pickle.PicklingError) as e:
        # Objects a weights-only load accepted can still be ones torch.save rejects (odd tensor hooks, say).
        raise OutputError(f"{out}: torch cannot save this checkpoint ({_first_line(e)}); nothing was written") from e
