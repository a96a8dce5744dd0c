"""Read and write .safetensors, carrying what a full checkpoint needs in the header's metadata.

ckptfix writes the format itself (header, then each tensor's bytes) so memory stays at one tensor at a time,
and records in ``__metadata__["ckptfix"]`` (JSON): the model entry's name, the other JSON-simple entries,
aliases of tied tensors (stored once) and the module versions of ``_metadata``. Reading restores all of it.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from ckptfix.checkpoint import is_state_dict, is_tensor, model_entries
from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.atomic import PathLike, atomic_output

META_KEY = "ckptfix"

# torch dtype name -> safetensors dtype code
DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}  # fmt: skip


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def sharing_groups(state: Mapping[str, Any]) -> list[list[str]]:
    """Groups of keys whose tensors share one storage (tied weights, views), in key order."""
    groups: dict[tuple[str, int], list[str]] = {}
    for key, t in state.items():
        if is_tensor(t) and t.numel() > 0:
            storage = t.untyped_storage()
            groups.setdefault((str(t.device), storage.data_ptr()), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def _is_simple(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_simple(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_simple(v) for k, v in value.items())
    return False


def split_checkpoint(obj: Any, *, out: str) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """Split a checkpoint into the one state dict a safetensors file can hold and its ckptfix metadata."""
    if is_state_dict(obj):
        return obj, {"entry": ""}
    entries = model_entries(obj)
    if len(entries) != 1:
        what = f"several model state dicts ({', '.join(entries)})" if entries else "no model state dict"
        raise OutputError(
            f"{out}: the checkpoint holds {what}; a .safetensors file holds one: write a .pt file, or pick "
            f"one with --entry NAME --model-only"
        )
    entry = entries[0]
    extras: dict[str, Any] = {}
    for key, value in obj.items():
        if key == entry:
            continue
        if not isinstance(key, str) or not _is_simple(value):
            raise OutputError(
                f"{out}: entry '{key}' ({type(value).__name__}) cannot go into .safetensors metadata; "
                f"write a .pt file to keep it, or pass --model-only to keep only '{entry}'"
            )
        extras[key] = value
    return obj[entry], {"entry": entry, "extras": extras, "order": [str(k) for k in obj]}


def save_safetensors(obj: Any, out: PathLike) -> None:
    """Write ``obj`` (a state dict, or a checkpoint with one model entry) atomically as .safetensors."""
    import torch

    out_s = str(out)
    state, meta = split_checkpoint(obj, out=out_s)
    tensors: OrderedDict[str, Any] = OrderedDict()
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise OutputError(f"{out_s}: key '{key}' holds a {type(t).__name__}, not a tensor; write a .pt file")
        if dtype_name(t.dtype) not in DTYPES:
            raise OutputError(
                f"{out_s}: key '{key}' has dtype {dtype_name(t.dtype)}, which safetensors cannot store; "
                f"write a .pt file"
            )
        if t.layout != torch.strided:
            raise OutputError(f"{out_s}: key '{key}' is a {t.layout} tensor; densify it or write a .pt file")
        # Tied weights are one tensor under two names: store it once and record the alias.
        ident = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            str(t.dtype),
        )
        if t.numel() > 0 and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = t.detach().to("cpu")
    stored = [(key, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for key, t in tensors.items()]
    with atomic_output(out) as f:
        f.write(encode_header(state, meta, stored, aliases))
        for t in tensors.values():
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def encode_header(
    state: Mapping[str, Any],
    meta: dict[str, Any],
    stored: Iterable[tuple[str, str, tuple[int, ...], int]],
    aliases: Mapping[str, str],
) -> bytes:
    """The length prefix and padded JSON header for ``stored`` (key, torch dtype name, shape, bytes), in order.

    Shared by the torch writer and the streaming path, so both write byte-identical headers.
    """
    meta["aliases"] = dict(aliases)
    if aliases:  # restoring aliases appends them; keep the original key order to put them back in place
        meta["keys"] = list(state.keys())
    versions = getattr(state, "_metadata", None)
    if versions is not None:
        meta["module_versions"] = {k: dict(v) for k, v in versions.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", META_KEY: json.dumps(meta)}}
    offset = 0
    for key, dtype, shape, nbytes in stored:
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def load_safetensors(path: PathLike, *, source: str) -> Any:
    """Read a .safetensors file memory-mapped (copy-on-write); a ckptfix-written one comes back as the checkpoint
    it was made from. The header is checked in full before any tensor is built."""
    import mmap

    import torch

    from ckptfix.formats.st_header import read_header

    header = read_header(path)
    codes = {code: getattr(torch, name) for name, code in DTYPES.items() if hasattr(torch, name)}
    tensors: OrderedDict[str, Any] = OrderedDict()
    with open(path, "rb") as f:
        if header.tensors:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, info in header.tensors.items():
        if info.dtype not in codes:
            raise FormatError(f"{source}: tensor '{name}' has dtype {info.dtype}, which this torch cannot represent")
        if info.end == info.begin:
            tensors[name] = torch.empty(info.shape, dtype=codes[info.dtype])
            continue
        raw = torch.frombuffer(
            mapped, dtype=torch.uint8, count=info.end - info.begin, offset=header.data_start + info.begin
        )
        tensors[name] = raw.view(codes[info.dtype]).reshape(info.shape)
    return restore(tensors, header.metadata, source=source)


def restore(tensors: Mapping[str, Any], metadata: Mapping[str, str], *, source: str) -> Any:
    """Rebuild the checkpoint that :func:`save_safetensors` split, from the tensors and header metadata."""
    state: OrderedDict[str, Any] = OrderedDict(tensors)
    raw = metadata.get(META_KEY)
    if raw is None:
        return state
    try:
        meta = json.loads(raw)
        aliases: dict[str, str] = meta.get("aliases", {})
        for alias, target in aliases.items():
            state[alias] = state[target]
        if "keys" in meta:
            state = OrderedDict((k, state[k]) for k in meta["keys"])
        versions = meta.get("module_versions")
        if versions is not None:
            state._metadata = OrderedDict(versions)  # type: ignore[attr-defined]
        entry = meta.get("entry", "")
        if not entry:
            return state
        extras = meta.get("extras", {})
        out = {k: (state if k == entry else extras[k]) for k in meta.get("order", [entry, *extras])}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(
            f"{source}: its '{META_KEY}' metadata is damaged ({e}); load it with plain safetensors"
        ) from e
    return out
