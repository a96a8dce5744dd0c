"""ckptfix: make PyTorch checkpoints portable between single-device, DataParallel, DDP and torch.compile.

Public names are imported lazily so that ``import ckptfix`` (and the CLI's start-up) does not import torch.
:data:`_EXPORTS` maps each public name to its module; ``__all__`` and the type checker's imports repeat the
names because tools read them statically (tests/test_api.py keeps the three equal).
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
    "Layout": "ckptfix.layouts",
    "detect": "ckptfix.layouts",
    "Conversion": "ckptfix.checkpoint",
    "convert": "ckptfix.checkpoint",
    "convert_checkpoint": "ckptfix.checkpoint",
    "model_entries": "ckptfix.checkpoint",
    "load": "ckptfix.formats",
    "save": "ckptfix.formats",
    "ConvertOptions": "ckptfix.conversion",
    "convert_file": "ckptfix.conversion",
    "KeyReport": "ckptfix.compare",
    "check": "ckptfix.compare",
    "load_into": "ckptfix.loading",
    "DiffReport": "ckptfix.diff",
    "diff": "ckptfix.diff",
    "MergeResult": "ckptfix.merging",
    "merge": "ckptfix.merging",  # module not named merge: importing it would shadow the function
    "summarize": "ckptfix.summary",
    "load_for_ddp": "ckptfix.distributed",
    "save_for_ddp": "ckptfix.distributed",
}

__all__ = [
    "CkptfixError",
    "Conversion",
    "ConvertOptions",
    "DiffReport",
    "DistributedError",
    "FormatError",
    "KeyReport",
    "Layout",
    "LayoutError",
    "MergeError",
    "MergeResult",
    "MismatchError",
    "OutputError",
    "UnsafeCheckpointError",
    "__version__",
    "check",
    "convert",
    "convert_checkpoint",
    "convert_file",
    "detect",
    "diff",
    "load",
    "load_for_ddp",
    "load_into",
    "merge",
    "model_entries",
    "save",
    "save_for_ddp",
    "summarize",
]

if TYPE_CHECKING:
    from ckptfix.checkpoint import Conversion, convert, convert_checkpoint, model_entries
    from ckptfix.compare import KeyReport, check
    from ckptfix.conversion import ConvertOptions, convert_file
    from ckptfix.diff import DiffReport, diff
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
    from ckptfix.formats import load, save
    from ckptfix.layouts import Layout, detect
    from ckptfix.loading import load_into
    from ckptfix.merging import MergeResult, merge
    from ckptfix.summary import summarize


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
