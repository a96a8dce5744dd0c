"""A DCP folder written by torch's own writer, from this one process, staged beside OUT and put in place whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _first_failure(e: Any) -> BaseException:
    """The exception a ``CheckpointException`` of this one process wraps (itself when it wraps none)."""
    for failure in e.failures.values():
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            return failure[0]
    return e  # type: ignore[no-any-return]


def serial_writer(path: str) -> Any:
    """torch's ``FileSystemWriter`` for ``path`` that writes one tensor at a time, in plan order: one file, one
    thread, and no copy-ahead (``per_thread_copy_ahead=0``), which makes it take torch's serial loader even where
    a GPU is present (the copy-ahead loader would sort the tensors by size and hold several at once)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    return FileSystemWriter(path, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0)


def save_dcp(
    obj: Any, out: str, *, overwrite: bool = False, planner: Any = None, written: Callable[[], None] | None = None
) -> None:
    """Write ``obj`` (a state dict or a full checkpoint) as a DCP folder that ``torch.distributed.checkpoint.load``
    reads, e.g. to resume FSDP from a single-device or DDP checkpoint.

    torch's own writer does the writing (from this one process, no process group needed) into a temporary
    folder beside OUT, which becomes OUT only when complete. OUT must not exist or be empty; with ``overwrite``
    it may be a DCP checkpoint folder (nothing else), which is then replaced: the old folder is renamed aside,
    the new one renamed in, the old one removed, so a failure leaves the old checkpoint as it was.

    ``planner`` (a ``SavePlanner``; torch's default without one) is handed to ``dcp.save``; ``written()`` runs once
    the folder is written, before it is put in place (what it raises leaves nothing behind). The writer takes one
    tensor at a time, in plan order, on every machine (:func:`serial_writer`).
    """
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    from ckptfix.formats.output.atomic import staged_folder
    from ckptfix.torchcompat import dcp_save_local

    with staged_folder(out, overwrite=overwrite) as tmp:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")  # that is the intent here
            try:
                dcp_save_local(obj, storage_writer=serial_writer(tmp), planner=planner)  # this process alone
            except CheckpointException as e:  # DCP wraps whatever its writer raised (a read error, a signal)
                raise _first_failure(e) from e
        if written is not None:
            written()
