"""ckptfix: make PyTorch checkpoints portable between single-device, DataParallel, DDP and torch.compile.

Public names are imported lazily so that ``import ckptfix`` (and the CLI's start-up) does not import torch.
:data:`_EXPORTS` is the one list of public names (each with its module); ``__all__`` follows from it, and the
type checker's imports below repeat it because type checkers read imports, not dictionaries (tests/test_api.py
keeps the two equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "AverageError": "ckptfix.errors",
    "CkptfixError": "ckptfix.errors",
    "DistributedError": "ckptfix.errors",
    "FormatError": "ckptfix.errors",
    "LayoutError": "ckptfix.errors",
    "MergeError": "ckptfix.errors",
    "MismatchError": "ckptfix.errors",
    "OutputError": "ckptfix.errors",
    "UsageError": "ckptfix.errors",
    "UnsafeCheckpointError": "ckptfix.errors",
    "Layout": "ckptfix.transforms.layouts",
    "detect": "ckptfix.transforms.layouts",
    "Conversion": "ckptfix.transforms.checkpoint",
    "convert": "ckptfix.transforms.checkpoint",
    "convert_checkpoint": "ckptfix.transforms.checkpoint",
    "model_entries": "ckptfix.transforms.checkpoint",
    "load": "ckptfix.formats.registry",
    "save": "ckptfix.formats.registry",
    "ConvertOptions": "ckptfix.conversion.files",
    "convert_file": "ckptfix.conversion.files",
    "export_hf": "ckptfix.exporting.folder",
    "KeyReport": "ckptfix.loading.report",
    "check": "ckptfix.loading.model",
    "load_into": "ckptfix.loading.model",
    "DiffReport": "ckptfix.diffing",
    "diff": "ckptfix.diffing",
    "MergeResult": "ckptfix.merging.files",
    "merge": "ckptfix.merging.files",  # module not named merge: importing it would shadow the function
    "summarize": "ckptfix.summary",
    "Sanitized": "ckptfix.sanitizing",
    "sanitize": "ckptfix.sanitizing",  # module not named sanitize: importing it would shadow the function
    "load_for_ddp": "ckptfix.distributed",
    "save_for_ddp": "ckptfix.distributed",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from ckptfix.conversion.files import (
        ConvertOptions as ConvertOptions,
    )
    from ckptfix.conversion.files import (
        convert_file as convert_file,
    )
    from ckptfix.diffing import (
        DiffReport as DiffReport,
    )
    from ckptfix.diffing import (
        diff as diff,
    )
    from ckptfix.distributed import (
        load_for_ddp as load_for_ddp,
    )
    from ckptfix.distributed import (
        save_for_ddp as save_for_ddp,
    )
    from ckptfix.errors import (
        AverageError as AverageError,
    )
    from ckptfix.errors import (
        CkptfixError as CkptfixError,
    )
    from ckptfix.errors import (
        DistributedError as DistributedError,
    )
    from ckptfix.errors import (
        FormatError as FormatError,
    )
    from ckptfix.errors import (
        LayoutError as LayoutError,
    )
    from ckptfix.errors import (
        MergeError as MergeError,
    )
    from ckptfix.errors import (
        MismatchError as MismatchError,
    )
    from ckptfix.errors import (
        OutputError as OutputError,
    )
    from ckptfix.errors import (
        UnsafeCheckpointError as UnsafeCheckpointError,
    )
    from ckptfix.errors import (
        UsageError as UsageError,
    )
    from ckptfix.exporting.folder import (
        export_hf as export_hf,
    )
    from ckptfix.formats.registry import load as load
    from ckptfix.formats.registry import save as save
    from ckptfix.loading.model import (
        check as check,
    )
    from ckptfix.loading.model import (
        load_into as load_into,
    )
    from ckptfix.loading.report import (
        KeyReport as KeyReport,
    )
    from ckptfix.merging.files import (
        MergeResult as MergeResult,
    )
    from ckptfix.merging.files import (
        merge as merge,
    )
    from ckptfix.sanitizing import (
        Sanitized as Sanitized,
    )
    from ckptfix.sanitizing import (
        sanitize as sanitize,
    )
    from ckptfix.summary import (
        summarize as summarize,
    )
    from ckptfix.transforms.checkpoint import (
        Conversion as Conversion,
    )
    from ckptfix.transforms.checkpoint import (
        convert as convert,
    )
    from ckptfix.transforms.checkpoint import (
        convert_checkpoint as convert_checkpoint,
    )
    from ckptfix.transforms.checkpoint import (
        model_entries as model_entries,
    )
    from ckptfix.transforms.layouts import (
        Layout as Layout,
    )
    from ckptfix.transforms.layouts import (
        detect as detect,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
