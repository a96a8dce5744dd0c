"""ckptfix: make PyTorch checkpoints portable between single-device, DataParallel, DDP and torch.compile.

Public names are imported lazily so that ``import ckptfix`` (and the CLI's start-up) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CkptfixError": "ckptfix.errors",
    "DistributedError": "ckptfix.errors",
    "FormatError": "ckptfix.errors",
    "LayoutError": "ckptfix.errors",
    "MergeError": "ckptfix.errors",
    "MismatchError": "ckptfix.errors",
    "OutputError": "ckptfix.errors",
    "UnsafeCheckpointError": "ckptfix.errors",
    "convert": "ckptfix.checkpoint",
    "convert_checkpoint": "ckptfix.checkpoint",
    "model_entries": "ckptfix.checkpoint",
    "detect": "ckptfix.layouts",
    "load": "ckptfix.formats",
    "convert_file": "ckptfix.conversion",
    "save": "ckptfix.formats",
    "check": "ckptfix.checks",
    "KeyReport": "ckptfix.checks",
    "load_into": "ckptfix.checks",
    "merge": "ckptfix.merging",  # module not named merge: importing it would shadow the function
    "load_for_ddp": "ckptfix.distributed",
    "save_for_ddp": "ckptfix.distributed",
}

__all__ = [
    "CkptfixError",
    "DistributedError",
    "FormatError",
    "KeyReport",
    "LayoutError",
    "MergeError",
    "MismatchError",
    "OutputError",
    "UnsafeCheckpointError",
    "__version__",
    "check",
    "convert",
    "convert_checkpoint",
    "convert_file",
    "detect",
    "load",
    "load_for_ddp",
    "load_into",
    "merge",
    "model_entries",
    "save",
    "save_for_ddp",
]

if TYPE_CHECKING:
    from ckptfix.checkpoint import convert, convert_checkpoint, model_entries
    from ckptfix.checks import KeyReport, check, load_into
    from ckptfix.distributed import load_for_ddp, save_for_ddp
    from ckptfix.errors import (
        CkptfixError,
        DistributedError,
        FormatError,
        LayoutError,
        MergeError,
        MismatchError,
        OutputError,
        UnsafeCheckpointError,
    )
    from ckptfix.conversion import convert_file
    from ckptfix.formats import load, save
    from ckptfix.layouts import detect
    from ckptfix.merging import merge


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
