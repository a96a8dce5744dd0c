"""The torch APIs that differ between the releases ckptfix supports (torch 2.4 on), in one place.

Each function takes the newest API where the running torch has it and otherwise does the same thing with what the
older release offers. Nothing here imports torch until it is called.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def safe_globals(objects: Iterable[Callable[..., Any] | tuple[Callable[..., Any], str]]) -> Iterator[None]:
    """``torch.serialization.safe_globals(objects)``: the objects join the weights-only allowlist for the block.

    torch 2.5 has the context manager, 2.6 accepts ``(object, name)`` pairs in it; torch 2.4 has only
    ``add_safe_globals``, whose additions are taken back here on the way out. Before 2.6 a pair's object is
    allowed under its own ``module.__name__`` (how ``pickle`` names it, unless the pickle was written where the
    object had another name; such a file is still refused, as for a global not allowed at all), and the block
    also allows what torch 2.6 on allows by default and 2.4 or 2.5 does not (:func:`_newer_defaults`).
    """
    import torch

    ser = torch.serialization
    objects = list(objects)
    if version(torch) >= (2, 6):
        with ser.safe_globals(objects):
            yield
        return
    plain: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        o[0] if isinstance(o, tuple) else o for o in objects
    ]
    plain += [o for o in _newer_defaults(torch) if o not in plain]
    if hasattr(ser, "safe_globals"):  # torch 2.5
        with ser.safe_globals(plain):
            yield
        return
    before = list(ser.get_safe_globals())  # torch 2.4: one global list, restored as it was
    ser.add_safe_globals([o for o in plain if o not in before])
    try:
        yield
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(before)


def _newer_defaults(torch: Any) -> list[Callable[..., Any]]:
    """Globals of torch's default weights-only allowlist (torch 2.13's, which ckptfix's allowlist is) that torch
    2.4 or 2.5 leave out: sets, complex numbers, bytes (pickled as ``_codecs.encode``) and bytearrays, and the
    device-tensor rebuilds. The dtypes added since are not there to allow."""
    import codecs

    rebuilds = ("_rebuild_device_tensor_from_cpu_tensor", "_rebuild_device_tensor_from_numpy")
    return [
        set,
        complex,
        bytearray,
        codecs.encode,
        *(getattr(torch._utils, n) for n in rebuilds if hasattr(torch._utils, n)),
    ]


def version(torch: Any) -> tuple[int, int]:
    """torch's (major, minor): ``2.6.0+cu124`` and ``2.7.0.dev20250101`` give (2, 6) and (2, 7)."""
    major, minor = str(torch.__version__).split(".")[:2]
    return int(major), int(minor)


def dcp_save_local(state_dict: Any, **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.save(state_dict, no_dist=True, **kwargs)``: written by this process alone,
    with no collective, even inside a distributed job.

    Releases whose ``save`` has no ``no_dist`` (torch 2.6 and older) get the same from ``save_state_dict``, which has
    it; ``checkpoint_id`` then becomes the ``FileSystemWriter`` that ``save`` would have made from it.
    """
    import inspect

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict, save, save_state_dict

    if "no_dist" in inspect.signature(save).parameters:
        return save(state_dict, no_dist=True, **kwargs)
    checkpoint_id = kwargs.pop("checkpoint_id", None)
    if kwargs.get("storage_writer") is None:
        if checkpoint_id is None:
            raise ValueError("dcp_save_local needs checkpoint_id or storage_writer")
        kwargs["storage_writer"] = FileSystemWriter(checkpoint_id)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*save_state_dict.*deprecated", category=FutureWarning)
        return save_state_dict(_stateful_to_state_dict(state_dict), no_dist=True, **kwargs)


_NUMPY_WARNING = "Failed to initialize NumPy"


def without_numpy_warning() -> None:
    """Silence torch's import-time warning that numpy is missing, here and in child processes (torchrun workers).

    The CPU torch wheel does not bring numpy and ckptfix never needs it, so the warning is noise in every command's
    output (and no documented output shows it)."""
    warnings.filterwarnings("ignore", message=_NUMPY_WARNING)
    entry = f"ignore:{_NUMPY_WARNING}"
    current = os.environ.get("PYTHONWARNINGS", "")
    if entry not in current.split(","):
        os.environ["PYTHONWARNINGS"] = f"{current},{entry}" if current else entry
