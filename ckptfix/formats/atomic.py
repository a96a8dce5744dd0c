"""Crash-safe output: write to a temp file beside OUT, fsync, rename over OUT, fsync the folder.

A reader of OUT sees either the previous complete file or the new complete file, never a partial one. Stdlib only,
so the streaming path can use it without importing torch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from ckptfix.errors import OutputError

PathLike = str | os.PathLike[str]


def check_output(out: PathLike, *, inputs: tuple[PathLike, ...] = ()) -> None:
    """Refuse, before any work is done, an OUT that cannot be written or that is one of the inputs."""
    out_s = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out_s))
    if not os.path.isdir(folder):
        raise OutputError(f"{out_s}: folder '{folder}' does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{out_s}: folder '{folder}' is not writable; choose another output path")
    if os.path.isdir(out_s):
        raise OutputError(f"{out_s}: is a folder; give a file name such as {os.path.join(out_s, 'model.pt')}")
    for src in inputs:
        if _same_file(src, out_s):
            raise OutputError(f"{out_s}: is the input file; write to a new path (the input is never modified in place)")


def _same_file(a: PathLike, b: PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _umask() -> int:
    # os.umask can only be read by setting it; restore at once (single-threaded at this point in the CLI).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(out: PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``out`` only when the block completes without an exception.

    The temp file lives in OUT's folder so the final rename never crosses file systems. It gets the mode a
    plain ``open()`` would give (0666 & ~umask) rather than mkstemp's 0600.
    """
    out_s = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out_s))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out_s)}.", suffix=".ckptfix-tmp", dir=folder)
    except OSError as e:
        raise OutputError(f"{out_s}: cannot create a file in '{folder}' ({e.strerror}); check the folder") from e
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, out_s)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{out_s}: write failed ({e.strerror or e}); the output was not written") from e
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    # The rename is durable only once the folder entry is on disk.
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
