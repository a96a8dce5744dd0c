"""What is in a checkpoint, as plain data: the model behind ``ckptfix inspect``.

Everything here comes from the file's checked description (the pickle read inertly, or the safetensors header):
no tensor byte is read and torch is not imported, so a 100 GB checkpoint is summarized as fast as a small one.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ckptfix import layouts
from ckptfix.checkpoint import get_entry, is_tensor, model_entries
from ckptfix.formats import inert
from ckptfix.formats.atomic import PathLike
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.opaque import OpaqueEntry
from ckptfix.keytree import expand, group_keys
from ckptfix.reading import open_checkpoint, spec, storage_of

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# What the real object of an inert call is, where its class name alone would mislead.
_INERT_TYPES = {"_codecs.encode": "builtins.bytes", "torch.Size": "torch.Size"}


def describe(value: Any) -> str:
    """A short, type-led description of a non-model entry (a loaded object or its inert description)."""
    if isinstance(value, OpaqueEntry):  # needs globals outside the allowlist: left unbuilt, nothing run
        return value.describe()
    if isinstance(value, Mapping) and "param_groups" in value and "state" in value:
        return f"optimizer state: {len(value['param_groups'])} param group(s), state for {len(value['state'])} param(s)"
    if is_tensor(value):
        found = spec(value)
        return f"tensor {found.dtype} {list(found.shape)}"
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
    if isinstance(value, inert.Inert):
        if value.func.full == "torch.Size" and value.args and isinstance(value.args[0], (list, tuple)):
            return f"Size of {len(value.args[0])}"  # as for the real torch.Size, a tuple
        return _INERT_TYPES.get(value.func.full, value.func.full)
    if isinstance(value, type) and issubclass(value, inert.Global):
        return "torch.dtype" if value.module == "torch" and value.name in DTYPES else "type"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def summarize_state(state: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """Counts, sizes, dtypes, layout, BatchNorm buffers, storage sharing and grouped keys of one state dict."""
    specs = {k: spec(v) for k, v in state.items() if is_tensor(v)}
    bn = [k for k in specs if k.rsplit(".", 1)[-1] in BN_BUFFERS]
    params = sum(s.numel for k, s in specs.items() if k not in bn)
    groups = []
    for line in group_keys(specs):
        keys = expand(line)
        shapes = {specs[k].shape for k in keys}
        dtypes = {specs[k].dtype for k in keys}
        groups.append(
            {
                "keys": line,
                "count": len(keys),
                "shape": list(next(iter(shapes))) if len(shapes) == 1 else None,
                "dtype": next(iter(dtypes)) if len(dtypes) == 1 else "mixed",
                "numel": sum(specs[k].numel for k in keys),
            }
        )
    return {
        "layout": layouts.detect(list(state.keys()), source=source).name,
        "tensors": len(specs),
        "parameters": params,
        "bytes": sum(s.nbytes for s in specs.values()),
        "dtypes": dict(Counter(s.dtype for s in specs.values())),
        "batchnorm_buffers": len(bn),
        "batchnorm_modules": len({k.rsplit(".", 1)[0] for k in bn}),
        "shared_storage": _sharing(state),
        "non_tensor_keys": [k for k in state if k not in specs],
        "groups": groups,
    }


def _sharing(state: Mapping[str, Any]) -> list[list[str]]:
    """Groups of keys whose tensors share one storage (tied weights, views), in key order."""
    groups: dict[Any, list[str]] = {}
    for key, value in state.items():
        where = storage_of(value) if is_tensor(value) else None
        if where is not None:
            groups.setdefault(where, []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def summarize(
    path: PathLike, *, allow_globals: tuple[str, ...] = (), unsafe: bool = False, verify: bool = False
) -> dict[str, Any]:
    """Everything ``ckptfix inspect`` shows, for one file; ``verify`` also reads every record and checks its CRC.

    The summary has ``loaded_with_torch`` (the reason) when the file could not be described without loading it
    (a legacy torch file, ``unsafe=True``), and ``verified`` when ``verify`` was asked for.
    """
    source = os.fspath(path)
    with open_checkpoint(
        path, allow_globals=allow_globals, unsafe=unsafe, need_bytes=False, verify=verify, opaque=True
    ) as ckpt:
        obj = ckpt.tree
        entries = model_entries(obj)
        models = {name: summarize_state(get_entry(obj, name), source=source) for name in entries}
        others = (
            {}
            if entries == [""] or not isinstance(obj, Mapping)
            else {str(k): describe(v) for k, v in obj.items() if k not in entries}
        )
    summary: dict[str, Any] = {
        "path": source,
        "format": ckpt.fmt,
        "file_bytes": os.path.getsize(path),
        "kind": "state dict" if entries == [""] else "checkpoint",
        "models": models,
        "other_entries": others,
    }
    if ckpt.note is not None:
        summary["loaded_with_torch"] = ckpt.note
    if verify:
        summary["verified"] = "crc" if ckpt.fmt == "torch-zip" and not unsafe else "read"
    return summary
