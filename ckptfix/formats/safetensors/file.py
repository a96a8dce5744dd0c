"""The .safetensors format: a checkpoint split into the one state dict a file holds and its metadata, torch-backed
load and save, and the file's tensors as records (:class:`StTensor`) for the streaming path. The header's rules
(the strict reader, the one writer) are :mod:`ckptfix.formats.safetensors.header`'s.

ckptfix writes the format itself (header, then each tensor's bytes) so memory stays at one tensor at a time,
and records in ``__metadata__["ckptfix"]`` (JSON): the model entry's name, the other JSON-simple entries,
aliases of tied tensors (stored once) and the module versions of ``_metadata``. Reading restores all of it.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.formats.dtypes import DTYPES, FROM_SAFETENSORS, safetensors_code
from ckptfix.formats.output.atomic import PathLike, atomic_output
from ckptfix.formats.pickles.inert_trees import gc_paused
from ckptfix.formats.raw import RawTensor, resolved
from ckptfix.formats.records import Holder, TensorRecord, torch_dtype
from ckptfix.formats.safetensors.header import META_KEY, Header, all_storable, encode_header, read_header, unstorable
from ckptfix.formats.torchzip.archive import BLOCK
from ckptfix.transforms.checkpoint import is_state_dict, is_tensor, model_entries


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
    """Whether JSON gives ``value`` back as it is: exact types only (a tuple would come back a list, an
    OrderedDict a dict, an int or str subclass its base), finite floats, string keys."""
    if value is None or type(value) in (bool, int, str):
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(_is_simple(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _is_simple(v) for k, v in value.items())
    return False


# torch globals a weights-only pickle holds as values, by the type torch.load gives them
_TORCH_TYPES = {
    **{f"torch.{name}": "dtype" for name in DTYPES},
    **{
        f"torch.{q}": "qscheme"
        for q in (
            "per_tensor_affine",
            "per_channel_affine",
            "per_tensor_symmetric",
            "per_channel_symmetric",
            "per_channel_affine_float_qparams",
        )
    },
}


def _type_name(value: Any) -> str:
    """The type of ``value`` as torch.load builds it, also for the fast path's stand-ins (not "Inert")."""
    from ckptfix.formats.pickles import inert

    if isinstance(value, inert.InertParameter):
        return "Parameter"
    if isinstance(value, inert.InertTensor):
        return "Tensor"
    if isinstance(value, inert.Inert):
        return {"_codecs.encode": "bytes"}.get(value.func.full, value.func.name)
    if isinstance(value, type) and issubclass(value, inert.Global):
        return _TORCH_TYPES.get(value.full, value.full)
    if isinstance(value, OrderedDict):
        return "OrderedDict"
    return type(value).__name__


def split_checkpoint(obj: Any, *, out: str) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """Split a checkpoint into the one state dict a safetensors file can hold and its ckptfix metadata."""
    bare = is_state_dict(obj)
    state = obj if bare else None
    if state is None:
        entries = model_entries(obj)
        if len(entries) == 1:
            state = obj[entries[0]]
    if state and not all_storable(state):  # what the reader refuses (_entry): ckptfix reads back what it writes
        for key in state:
            if isinstance(key, str) and (problem := unstorable(key)):
                raise OutputError(
                    f"{out}: key {key!r} {problem}, which .safetensors cannot store; rename it (renames=) or write a "
                    f".pt file"
                )
    if bare:
        return obj, {"entry": ""}
    entries = model_entries(obj)
    if len(entries) != 1:
        what = f"several model state dicts ({', '.join(entries)})" if entries else "no model state dict"
        raise OutputError(
            f"{out}: the checkpoint holds {what}; a .safetensors file holds one: write a .pt file, or pick "
            f"one with entries='NAME' and model_only=True"
        )
    entry = entries[0]
    extras: dict[str, Any] = {}
    for key, value in obj.items():
        if key == entry:
            continue
        if not isinstance(key, str) or not _is_simple(value):
            raise OutputError(
                f"{out}: entry '{key}' ({_type_name(value)}) cannot go into .safetensors metadata; "
                f"write a .pt file to keep it, or model_only=True to keep only '{entry}'"
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
        if safetensors_code(dtype_name(t.dtype)) is None:
            raise OutputError(
                f"{out_s}: key '{key}': not supported yet: dtype {dtype_name(t.dtype)} in .safetensors (it has no "
                f"code for it); write a .pt file"
            )
        if t.layout != torch.strided:
            raise OutputError(f"{out_s}: key '{key}' is a {t.layout} tensor; densify it or write a .pt file")
        # Tied weights are one tensor under two names: store it once and record the alias.
        ident = stored_identity(t)
        if t.numel() > 0 and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = t.detach().to("cpu")
    stored = [(key, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for key, t in tensors.items()]
    with atomic_output(out) as f:
        f.write(encode_header(state, meta, stored, aliases, out=out_s))
        for t in tensors.values():
            if t.numel():
                f.write(tensor_bytes(t))


def stored_identity(t: Any) -> tuple[Any, ...]:
    """What makes two tensors one stored tensor: the same bytes, viewed the same way, with the same math bits
    (``t.conj()`` and ``torch._neg_view(t)`` share ``t``'s storage, offset and strides but not its values)."""
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        str(t.dtype),
        t.is_conj(),
        t.is_neg(),
    )


def tensor_bytes(t: Any) -> memoryview:
    """A CPU tensor's values as bytes in row-major order, without a copy when it is contiguous, and without numpy.

    A conjugate or negative view's storage holds the values before its bit is applied; only torch.save records
    the bit, so it is resolved here (a copy, for those tensors alone). Going through numpy would need numpy,
    which a plain ``pip install ckptfix`` does not bring. A :class:`~ckptfix.formats.raw.RawTensor` is its bytes.
    """
    if isinstance(t, RawTensor):
        return memoryview(t.data).cast("B")
    import ctypes

    flat: Any = resolved(t).contiguous()
    nbytes = flat.numel() * flat.element_size()
    raw = (ctypes.c_char * nbytes).from_address(flat.data_ptr())
    view = memoryview(raw).cast("B")
    # the view must keep the tensor alive: ctypes holds no reference to torch's memory
    raw._ckptfix_owner = flat
    return view


def losses_note(*, params: int, views: int, grads: int) -> str | None:
    """What a .safetensors copy cannot keep (values are exact), from counts of tensors: said under ``-v``."""
    lost = [
        f"{n} {what}"
        for n, what in (
            (params, "Parameters stored as tensors"),
            (views, "views stored as contiguous tensors"),
            (grads, "requires_grad flags"),
        )
        if n
    ]
    return f".safetensors keeps values only: {', '.join(lost)} not kept" if lost else None


TIED_ONCE = "tied keys written once"  # said whatever the verbosity: safetensors' own load_file gives one name


def tied_note(paths: Iterable[str]) -> str | None:
    """What .safetensors files ``paths`` (just written) store once under two names, and what gives both back."""
    aliases: dict[str, str] = {}
    for path in paths:
        raw = read_header(path).metadata.get(META_KEY)
        found = json.loads(raw).get("aliases", {}) if raw else {}
        aliases.update(found if isinstance(found, dict) else {})
    if not aliases:
        return None
    pairs = ", ".join(f"'{alias}' = '{key}'" for alias, key in list(aliases.items())[:3])
    more = f" and {len(aliases) - 3} more" if len(aliases) > 3 else ""
    return (
        f"{TIED_ONCE}: {pairs}{more} (one tensor, stored once with the alias in the metadata); ckptfix.load and "
        f"safetensors.torch.load_model(model, path) give both back, safetensors.torch.load_file only the first"
    )


def load_safetensors(path: PathLike, *, source: str) -> Any:
    """Read a .safetensors file memory-mapped (copy-on-write); a ckptfix-written one comes back as the checkpoint
    it was made from. The header is checked in full before any tensor is built."""
    import mmap

    import torch

    header = read_header(path)
    codes = {code: getattr(torch, name) for code, name in FROM_SAFETENSORS.items() if hasattr(torch, name)}
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


@dataclass(eq=False)
class StTensor(TensorRecord):
    """A tensor whose bytes are ``[start, end)`` of file ``path`` as they are: a safetensors tensor (a plain
    contiguous tensor of a ``.pt`` file, read as one by the streaming path)."""

    on_demand: ClassVar[bool] = True
    streamable: ClassVar[bool] = True

    streams_bytes: ClassVar[bool] = True

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    path: str = ""

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def identity(self) -> Hashable:
        return ("st", self.path, self.start, self.end, self.dtype, self.shape)

    def _storage(self) -> Hashable:
        return ("st", self.path, self.start)

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        return [(self.path, self.start, self.nbytes)] if self.nbytes else []

    def read(self, holder: Holder) -> Any:
        import torch

        dtype = torch_dtype(torch, self.dtype, source=holder.source)
        if self.end == self.start:
            return torch.empty(self.shape, dtype=dtype)
        data = holder.pread(self.start, self.end - self.start)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(self.shape)

    def read_raw(self, holder: Holder) -> RawTensor:
        return RawTensor(self.dtype, tuple(self.shape), holder.pread(self.start, self.end - self.start), holder.source)

    def file_span(self, holder: Holder) -> tuple[int, int]:
        return self.stored_span

    @property
    def stored_span(self) -> tuple[int, int]:
        return self.start, self.end - self.start


def tree_from_header(header: Header, *, source: str) -> Any:
    """The checkpoint :func:`load_safetensors` returns (aliases, key order, ``_metadata``, model entry and extras
    from the ``ckptfix`` metadata), with a :class:`StTensor` of file ``source`` for each tensor."""
    base = header.data_start
    tensors = {
        key: StTensor(FROM_SAFETENSORS[t.dtype], t.shape, base + t.begin, base + t.end, source)
        for key, t in header.tensors.items()  # data order, as the torch path reads them
    }
    return restore(tensors, header.metadata, source=source)


@dataclass
class StOutput:
    """A safetensors file to write: its header bytes, then each tensor's bytes from a source range."""

    header: bytes
    ranges: list[tuple[int, int]]  # (source offset, length) in data order

    @property
    def size(self) -> int:
        return len(self.header) + sum(n for _, n in self.ranges)


@gc_paused()  # a range and a header entry per tensor: nothing to collect, only to rescan
def plan_safetensors(obj: Any, *, out: str, locate: Any, keep_offsets: bool = False) -> StOutput:
    """Header and data ranges for ``obj`` (a state dict or a checkpoint with one model entry); :class:`Fallback` for
    what the caller's writer does not write (a value that is not a tensor, a dtype without a code).

    ``locate(value) -> (dtype, shape, source_offset, nbytes, identity)`` finds a tensor's bytes or raises.
    Mirrors ``save_safetensors``: tied tensors stored once and recorded as aliases. With
    ``keep_offsets`` the header is padded so that the most bytes keep their source offset modulo 4096 (all of
    them when the data keeps its order, as .safetensors to .safetensors does), for a copy that shares blocks.
    """
    state, meta = split_checkpoint(obj, out=out)
    ranges: list[tuple[int, int]] = []
    stored: list[tuple[str, str, tuple[int, ...], int]] = []
    aliases: dict[str, str] = {}
    seen: dict[Any, str] = {}
    for key, value in state.items():
        if not is_tensor(value):
            raise Fallback(Reason.NOT_A_TENSOR, key=key, kind=type(value).__name__)
        dtype, shape, src, nbytes, ident = locate(value)
        if safetensors_code(dtype) is None:
            raise Fallback(Reason.DTYPE_NOT_IN_SAFETENSORS, key=key, dtype=dtype)
        if nbytes > 0 and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        stored.append((key, dtype, tuple(shape), nbytes))
        ranges.append((src, nbytes))
    start = _best_data_start(ranges) if keep_offsets else None
    return StOutput(encode_header(state, meta, stored, aliases, out=out, congruent_to=start), ranges)


def _best_data_start(ranges: list[tuple[int, int]]) -> int | None:
    """The data buffer's start modulo 4096 that keeps the most bytes at their source offset modulo 4096."""
    gain: dict[int, int] = {}
    at = 0
    for src, nbytes in ranges:
        start = (src - at) % BLOCK
        if nbytes and start % 8 == 0:  # the buffer must stay 8-aligned
            gain[start] = gain.get(start, 0) + nbytes
        at += nbytes
    return max(sorted(gain), key=gain.__getitem__) if gain else None
