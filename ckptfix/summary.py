"""What is in a checkpoint, as plain data: the model behind ``ckptfix inspect``."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckptfix import layouts
from ckptfix.checkpoint import get_entry, is_tensor, model_entries
from ckptfix.formats.atomic import PathLike
from ckptfix.keytree import expand, group_keys

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    """A short, type-led description of a non-model entry."""
    if isinstance(value, Mapping) and "param_groups" in value and "state" in value:
        return f"optimizer state: {len(value['param_groups'])} param group(s), state for {len(value['state'])} param(s)"
    if is_tensor(value):
        return f"tensor {_dtype(value)} {list(value.shape)}"
    if isinstance(value, (bool, int, float)) or value is None:
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"str {value[:60]!r}" + ("…" if len(value) > 60 else "")
    if isinstance(value, Mapping):
        return (
            f"dict with {len(value)} entries ({', '.join(map(str, list(value)[:6]))}{', …' if len(value) > 6 else ''})"
        )
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def summarize_state(state: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """Counts, sizes, dtypes, layout, BatchNorm buffers, storage sharing and grouped keys of one state dict."""
    from ckptfix.formats.safetensors import sharing_groups

    tensors = {k: v for k, v in state.items() if is_tensor(v)}
    bn = [k for k in tensors if k.rsplit(".", 1)[-1] in BN_BUFFERS]
    params = sum(t.numel() for k, t in tensors.items() if k not in bn)
    groups = []
    for line in group_keys(tensors):
        keys = expand(line)
        shapes = {tuple(tensors[k].shape) for k in keys}
        dtypes = {_dtype(tensors[k]) for k in keys}
        groups.append(
            {
                "keys": line,
                "count": len(keys),
                "shape": list(next(iter(shapes))) if len(shapes) == 1 else None,
                "dtype": next(iter(dtypes)) if len(dtypes) == 1 else "mixed",
                "numel": sum(tensors[k].numel() for k in keys),
            }
        )
    return {
        "layout": layouts.detect(list(state.keys()), source=source).name,
        "tensors": len(tensors),
        "parameters": params,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "dtypes": dict(Counter(_dtype(t) for t in tensors.values())),
        "batchnorm_buffers": len(bn),
        "batchnorm_modules": len({k.rsplit(".", 1)[0] for k in bn}),
        "shared_storage": sharing_groups(tensors),
        "non_tensor_keys": [k for k in state if k not in tensors],
        "groups": groups,
    }


def summarize(path: PathLike, *, allow_globals: tuple[str, ...] = (), unsafe: bool = False) -> dict[str, Any]:
    """Everything ``ckptfix inspect`` shows, for one file."""
    from ckptfix.formats import detect_format, load

    source = os.fspath(path)
    fmt = detect_format(path)
    obj = load(path, allow_globals=allow_globals, unsafe=unsafe)
    entries = model_entries(obj)
    models = {name: summarize_state(get_entry(obj, name), source=source) for name in entries}
    others = (
        {}
        if entries == [""] or not isinstance(obj, Mapping)
        else {str(k): describe(v) for k, v in obj.items() if k not in entries}
    )
    return {
        "path": source,
        "format": fmt,
        "file_bytes": os.path.getsize(path),
        "kind": "state dict" if entries == [""] else "checkpoint",
        "models": models,
        "other_entries": others,
    }
