"""What is in a checkpoint, as plain data: the model behind ``ckptfix inspect``.

Everything here comes from the file's checked description (the pickle read inertly, or the safetensors header):
no tensor byte is read and torch is not imported, so a 100 GB checkpoint is summarized as fast as a small one.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any

from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.fsdp.ranks import flat_param_keys, placement
from ckptfix.formats.opened import OpenedFolder
from ckptfix.formats.output.atomic import PathLike
from ckptfix.formats.pickles import inert
from ckptfix.formats.rankfile import rank_file_refusal
from ckptfix.formats.records import identity, is_record, spec, storage_of
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.torchio.opaque import OpaqueEntry
from ckptfix.keytree import groups as key_groups
from ckptfix.reading import open_checkpoint, stored_bytes
from ckptfix.transforms import layouts
from ckptfix.transforms.checkpoint import get_entry, is_tensor, model_entries

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
    tied = _tied(state, specs)
    params = sum(s.numel for k, s in specs.items() if k not in bn and k not in tied)
    # A DCP folder's tensors: how each is chunked across the data files; a DTensor rank file's: how each is
    # sharded (each record says, TensorRecord.spread). Keys are grouped per way, so each group line says it.
    spread = {k: s for k, v in state.items() if is_record(v) and (s := v.spread()) is not None}
    chunks = {k: way for k, (what, way) in spread.items() if what == "chunking"}
    shards = {k: spread[k][1] if k in spread else "not sharded" for k in state} if spread and not chunks else {}
    ways = chunks or shards
    # keys grouped per way and per layout (strided, sparse_coo, …), so that each group line says both
    parts: dict[tuple[str | None, str], list[str]] = {}
    for k, found in specs.items():
        parts.setdefault((ways.get(k), found.layout), []).append(k)
    order = {k: i for i, k in enumerate(specs)}
    # each line with the keys it stands for, never parsed back from the line: keys may hold braces or commas
    lines = sorted(
        ((line, keys, part) for part, names in parts.items() for line, keys in key_groups(names)),
        key=lambda item: order[item[1][0]],
    )
    groups = []
    for line, keys, (way, kind) in lines:
        shapes = list(dict.fromkeys(specs[k].shape for k in keys))  # distinct, in key order
        dtypes = {specs[k].dtype for k in keys}
        group = {
            "keys": line,
            "count": len(keys),
            "shape": list(shapes[0]) if len(shapes) == 1 else None,
            "shapes": [list(shape) for shape in shapes],
            "dtype": next(iter(dtypes)) if len(dtypes) == 1 else "mixed",
            "numel": sum(specs[k].numel for k in keys),
        }
        if kind != "strided":  # sparse: the shape is the dense tensor's
            group["layout"] = kind
        if ways:
            group["chunking" if chunks else "sharding"] = way
        groups.append(group)
    summary: dict[str, Any] = {
        "layout": layouts.detect(list(state.keys()), source=source).name,
        "tensors": len(specs),
        "parameters": params,
        "tied": tied,
        "bytes": sum(
            s.nbytes if s.layout == "strided" else stored_bytes(state[k]) for k, s in specs.items() if k not in tied
        ),
        "dtypes": dict(Counter(s.dtype for s in specs.values())),
        "batchnorm_buffers": len(bn),
        "batchnorm_modules": len({k.rsplit(".", 1)[0] for k in bn}),
        "shared_storage": _sharing(state),
        "non_tensor_keys": [k for k in state if k not in specs],
        "groups": groups,
    }
    if ways:
        summary["chunking" if chunks else "sharding"] = ways
    if flat := flat_param_keys(state):  # FSDP1: one rank's slices of many parameters, which no model loads
        summary["fsdp1_flat_params"] = flat
    return summary


def _tied(state: Mapping[str, Any], specs: Mapping[str, Any]) -> dict[str, str]:
    """Keys whose tensor is an earlier key's (tied weights: one tensor under two names) -> that key; counted once."""
    first: dict[Hashable, str] = {}
    tied: dict[str, str] = {}
    for key in specs:
        if storage_of(state[key]) is None:  # an empty or sparse tensor has no bytes to share
            continue
        if (kept := first.setdefault(identity(state[key]), key)) != key:
            tied[key] = kept
    return tied


def _sharing(state: Mapping[str, Any]) -> list[list[str]]:
    """Groups of keys whose tensors share one storage (tied weights, views), in key order."""
    groups: dict[Any, list[str]] = {}
    for key, value in state.items():
        where = storage_of(value) if is_tensor(value) else None
        if where is not None:
            groups.setdefault(where, []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


@deep
def summarize(
    path: PathLike, *, allow_globals: tuple[str, ...] = (), unsafe: bool = False, verify: bool = False
) -> dict[str, Any]:
    """Everything ``ckptfix inspect`` shows, for one file or folder; ``verify`` also reads every record and checks
    its CRC.

    The summary has ``loaded_with_torch`` (the reason) when the file could not be described without loading it
    (a legacy torch file, ``unsafe=True``), ``verified`` when ``verify`` was asked for, and ``folder`` (its kind:
    ``shards``, ``accelerate`` or ``dcp``, its files and index) for a folder; a DCP folder's models have
    ``chunking``: key -> how the tensor is split across the data files. One rank's file of an FSDP2 or
    tensor-parallel run (DTensor shards) has ``dtensor`` (this rank's place on the mesh); its models show the full
    tensors' shapes, and ``sharding``: key -> ``Shard(0) on mesh [2]`` (or ``not sharded``: the rank's own).
    A DeepSpeed run folder has ``deepspeed``; one DeepSpeed module file on its own has ``deepspeed_module_file``
    (a ZeRO-3 one's ``placeholders``: the keys whose ``[0]`` tensors are no weights, and the ``folder`` to pass).
    """
    from ckptfix.formats.deepspeed.files import lone_module_summary

    source = os.fspath(path)
    with open_checkpoint(
        path, allow_globals=allow_globals, unsafe=unsafe, need_bytes=False, verify=verify, opaque=True, ranks=True
    ) as ckpt:
        if ckpt.rank_kind:  # one rank's file, told by the registry from this one read of its pickle
            return _rank_summary(ckpt, verify=verify)
        summary = _summary(ckpt.tree, source=source, fmt=ckpt.fmt)
    folder = ckpt if isinstance(ckpt, OpenedFolder) else None
    if folder is not None:
        summary["file_bytes"] = sum(map(os.path.getsize, folder.files))
    if folder is not None:
        root = os.path.dirname(folder.index or folder.files[0])  # shards may sit in subfolders of the index's
        summary["folder"] = {
            "kind": folder.kind,
            "files": [os.path.relpath(f, root) for f in folder.files],
            "index": os.path.basename(folder.index) if folder.index else None,
        }
    if folder is not None and folder.zero is not None:
        summary["deepspeed"] = deepspeed_summary(folder.zero)
    if folder is not None and folder.records is not None and folder.records.summary is not None:
        summary[folder.kind] = folder.records.summary  # what its registry row's records say of it
    if folder is None and (lone := lone_module_summary(ckpt.tree, source=source)) is not None:
        summary["deepspeed_module_file"] = lone  # its [0] tensors shown, and said to be placeholders
    if ckpt.note is not None:
        summary["loaded_with_torch"] = ckpt.note
    if not ckpt.crc_stored:  # saved with torch's compute_crc32=False: every record's CRC is 0
        summary["crc_stored"] = False
    if ckpt.locations:  # torch zips: the location tag of each storage, as torch.load(map_location=None) uses it
        summary["devices"] = ckpt.locations
    if verify:
        parts = folder.parts if folder else [ckpt]
        # a folder read through its one table (DCP, DeepSpeed, Megatron) has no parts: its data files are zips
        zips = all(p.fmt == "torch-zip" for p in parts)
        summary["verified"] = "crc" if zips and not unsafe and ckpt.crc_stored else "read"
    return summary


def _rank_summary(ckpt: Any, *, verify: bool) -> dict[str, Any]:
    """One rank's file of an FSDP2 or tensor-parallel run, its DTensors as records; an FSDP1 rank file is refused
    as a full checkpoint's reader refuses it."""
    from ckptfix.formats.fsdp.ranks import rank_records

    if ckpt.rank_kind != "dtensor":
        raise rank_file_refusal(ckpt.rank_kind, source=ckpt.source)
    tree = rank_records(ckpt.zip.tree, ckpt.source)
    summary = _summary(tree, source=ckpt.source, fmt="torch-zip")
    if (found := placement(_values(tree))) is not None:
        summary["dtensor"] = found
    if verify:
        summary["verified"] = "crc"
    return summary


def deepspeed_summary(run: Any) -> dict[str, Any]:
    """A ZeRO run: stage, ranks, dtypes, what each file holds (from the pickles: no tensor byte read)."""
    root = run.root
    unique = {id(t): t for t in run.state.values()}.values()
    return {
        "stage": run.stage,
        "world_size": run.world,
        "train_dtype": run.train_dtype,
        "master_dtype": run.master_dtype,
        "ds_version": run.ds_version,
        "tag": os.path.relpath(run.tag_dir, root),
        "parameters": sum(math.prod(t.shape) for t in unique if t.origin != "buffer"),
        "origins": dict(Counter(t.origin for t in unique)),
        "files": {os.path.relpath(f.path, root): f.holds for f in run.files},
        "notes": list(run.notes),
    }


def _summary(obj: Any, *, source: str, fmt: str) -> dict[str, Any]:
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
        "file_bytes": _size(source),
        "kind": "state dict" if entries == [""] else "checkpoint",
        "models": models,
        "other_entries": others,
    }


def _values(tree: Any) -> list[Any]:
    """The values of a checkpoint's model entries (or of the state dict itself)."""
    return [v for name in model_entries(tree) for v in get_entry(tree, name).values()]


def _size(source: str) -> int:
    if not os.path.isdir(source):
        return os.path.getsize(source)
    # a folder loaded with torch (a DCP folder whose values hold objects): every file in it
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(source) for n in names)
