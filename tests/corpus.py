"""A corpus of small checkpoints, one file per case class, each written by torch (or safetensors) itself.

``write_corpus(folder)`` writes every case and returns ``{name: path}``. The cases cover what torch 2.13 can put in
a file: every dtype it saves, views, tied weights, channels_last, stride 0, big-endian bytes, sparse and quantized
tensors, conj and neg bits, Parameters, dict and OrderedDict containers, pickle protocols 2 to 5, the legacy
format, CUDA device tags (made without a GPU), CRC-less zips; and .safetensors files of every dtype safetensors
stores. test_corpus (tests/conversion/test_files.py) runs each one through each operation.
"""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tests.models import SmallNet
from tests.writers import CAN_SKIP_CRCS, save_without_crcs, saved_as, saved_on, torch_saves

# every dtype torch.save writes as a plain tensor (one this torch lacks or cannot save is left out)
DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex32", "complex64", "complex128", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)  # fmt: skip


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads included), made as bytes: torch draws few of these dtypes."""
    width = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(seed + n * width)
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:  # only 0 and 1 are booleans
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _dtype_state(name: str) -> dict[str, torch.Tensor]:
    w = random_bits(getattr(torch, name), (4, 6))
    return {"w": w, "view": w[1:, 2:5], "t": w.t()}  # a view with an offset and strides, a transposed one


def _views() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    flat = torch.linspace(-1, 1, 10)
    return {"base": base, "rows": base[1:3], "col": base[:, 2], "t": base.t(), "step": base[::2, ::3],
            "tail": flat[5:], "offset": flat[3:7]}  # fmt: skip


def _tied() -> dict[str, torch.Tensor]:
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    return {"enc.weight": w, "bias": torch.zeros(3), "dec.weight": w, "other": torch.ones(2)}


def _channels_last() -> dict[str, torch.Tensor]:
    w = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(2))
    return {"conv.weight": w.contiguous(memory_format=torch.channels_last), "plain": w}


def _stride0() -> dict[str, torch.Tensor]:
    return {"expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3), "scalar": torch.tensor(5).expand(2, 2)}


def _sparse() -> dict[str, torch.Tensor]:
    m = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, -3.0]])
    return {"dense": torch.ones(2), "coo": m.to_sparse(), "csr": m.to_sparse_csr()}


def _quantized() -> dict[str, torch.Tensor]:
    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    return {
        "dense": torch.ones(2),
        "per_tensor": torch.quantize_per_tensor(x, 0.05, 3, torch.qint8),
        "per_channel": torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.05]), torch.tensor([0, 1, -2]), 0,
                                                  torch.qint8),
    }  # fmt: skip


def _math_bits() -> dict[str, torch.Tensor]:
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j])
    return {
        "plain": z,
        "conj": torch.conj(z),  # shares plain's storage
        "neg": torch._neg_view(torch.tensor([1.0, -2.0, 3.5])),
        "both": torch._neg_view(torch.conj(torch.tensor([2 - 1j, -3j]))),
        "neg_int": torch._neg_view(torch.tensor([7, -8])),
    }


def _parameters() -> dict[str, torch.Tensor]:
    frozen = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)
    tagged = torch.nn.Parameter(torch.ones(2, 2))
    tagged.note = "kept"  # type: ignore[attr-defined]  # a Python attribute torch.save pickles with it
    return {"frozen": frozen, "trained": torch.nn.Parameter(torch.zeros(3)), "tagged": tagged}


def _small() -> dict[str, torch.Tensor]:
    w = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    return {"w": w, "b": torch.arange(3), "tied": w, "half": torch.tensor([0.5, float("nan")], dtype=torch.float16)}


def _full_checkpoint() -> dict[str, Any]:
    """What a training loop saves: a module's state dict among values .safetensors metadata can hold (JSON)."""
    return {"epoch": 3, "model": SmallNet().state_dict(), "loss": 0.25, "name": "run-1", "flags": [True, None],
            "config": {"lr": 0.1, "steps": [1, 2]}, "big": 2**70}  # fmt: skip


def _weights_only_reads(value: Any) -> bool:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _python_values() -> dict[str, Any]:
    """A state dict among the Python and torch values a weights-only pickle holds (this torch's: 2.4 and 2.5 refuse
    a complex and a set)."""
    values = {"model": dict(_small()), "epoch": 3, "none": None, "neg_zero": -0.0, "size": torch.Size([2, 3]),
            "dtype": torch.float16, "device": torch.device("cuda:1"), "complex": 1 - 2j, "bytes": b"a\x00",
            "set": {1, 2}, "nan": float("nan"), "qscheme": torch.per_channel_affine, "layout": torch.sparse_csr,
            "tensors": [torch.ones(2), (torch.zeros(1), 5)], "by_int": {1: "one"}}  # fmt: skip
    return {key: value for key, value in values.items() if key == "model" or _weights_only_reads(value)}


def _byteswapped(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, on its own storage) with each element's bytes reversed."""
    width = t.element_size()
    return t.view(torch.uint8).reshape(-1, width).flip(-1).contiguous().view(t.dtype).reshape(t.shape)


def _save_big_endian(path: Path) -> None:
    """A file as torch.save writes it on a big-endian machine: a ``byteorder`` record of ``big``, and each
    storage's elements byte-swapped (torch.load swaps them back here)."""
    values = {"f32": torch.linspace(-1, 1, 6).reshape(2, 3), "i64": torch.arange(-2, 3), "f16": torch.ones(3).half(),
              "u8": torch.arange(4, dtype=torch.uint8)}  # fmt: skip
    swapped = {k: _byteswapped(v) for k, v in values.items()}
    real = sys.byteorder
    sys.byteorder = "big"  # type: ignore[misc]  # torch.save writes this into the byteorder record
    try:
        torch.save(swapped, path)
    finally:
        sys.byteorder = real  # type: ignore[misc]


def _save_mixed_devices(path: Path) -> None:
    state = _small()
    other = torch.arange(3.0)
    tags = {state["w"].untyped_storage()._cdata: "cuda:1", other.untyped_storage()._cdata: "cuda:0"}
    with saved_on(lambda storage: tags.get(storage._cdata)):
        torch.save({**state, "other": other}, path)


def _save_cuda(path: Path) -> None:
    with saved_as("cuda:0"):
        torch.save(_small(), path)


def _saver(make: Callable[[], Any], **options: Any) -> Callable[[Path], None]:
    return lambda path: torch.save(make(), path, **options)


# .pt cases: name -> writer
PT_CASES: dict[str, Callable[[Path], None]] = {
    **{f"dtype-{name}": _saver(lambda name=name: _dtype_state(name)) for name in DTYPES if torch_saves(name)},
    "views": _saver(_views),
    "tied": _saver(_tied),
    "channels-last": _saver(_channels_last),
    "stride0": _saver(_stride0),
    "big-endian": _save_big_endian,
    "sparse": _saver(_sparse),
    "quantized": _saver(_quantized),
    "math-bits": _saver(_math_bits),
    "parameters": _saver(_parameters),
    "plain-dict": _saver(lambda: dict(_small())),
    "module-state-dict": _saver(lambda: SmallNet().state_dict()),  # an OrderedDict with _metadata
    "full-checkpoint": _saver(_full_checkpoint),
    "full-checkpoint-tuple": _saver(lambda: {**_full_checkpoint(), "args": ("a", 2)}),  # JSON has no tuple
    "full-checkpoint-dict": _saver(lambda: {"step": 1, "state_dict": dict(_small()), "none": None, "neg": -0.0}),
    "python-values": _saver(_python_values),
    "protocol-2": _saver(_small, pickle_protocol=2),
    "protocol-3": _saver(_small, pickle_protocol=3),
    "protocol-4": _saver(_small, pickle_protocol=4),  # torch.load(weights_only=True) refuses these two
    "protocol-5": _saver(_small, pickle_protocol=5),
    "legacy": _saver(_small, _use_new_zipfile_serialization=False),
    "legacy-views": _saver(_views, _use_new_zipfile_serialization=False),
    "cuda-tags": _save_cuda,
    "mixed-tags": _save_mixed_devices,
    **({"no-crc32": lambda path: save_without_crcs(_small(), path)} if CAN_SKIP_CRCS else {}),
}

# dtypes safetensors.torch writes and reads (those the installed release knows: float8 *fnuz since 0.8, complex64
# since 0.7; the floor, 0.4, writes neither)
ST_DTYPES_ALL = ("float64", "float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
             "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "complex64")  # fmt: skip


def _st_writable(name: str) -> bool:
    from safetensors.torch import _SIZE

    return getattr(torch, name) in _SIZE


ST_DTYPES = tuple(name for name in ST_DTYPES_ALL if _st_writable(name))


def _save_st(name: str) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        from safetensors.torch import save_file

        dtype = getattr(torch, name)
        save_file({"w": random_bits(dtype, (3, 4)), "b": random_bits(dtype, (5,), seed=1)}, path)

    return write


ST_CASES: dict[str, Callable[[Path], None]] = {f"st-{name}": _save_st(name) for name in ST_DTYPES}


def write_corpus(folder: Path) -> dict[str, Path]:
    """Write every case into ``folder``: ``{name: path}``, .pt cases first, then .safetensors ones."""
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf, TypedStorage, sparse CSR beta: torch's own notes
        for name, write in PT_CASES.items():
            paths[name] = folder / f"{name}.pt"
            write(paths[name])
        for name, write in ST_CASES.items():
            paths[name] = folder / f"{name}.safetensors"
            write(paths[name])
    return paths


# files torch.load(weights_only=True) refuses, and what ckptfix says of them (on every operation)
TORCH_REFUSES = {
    "protocol-4": "opcodes .* which torch's weights-only loader does not read",
    "protocol-5": "opcodes .* which torch's weights-only loader does not read",
}


def _tensors(obj: Any, where: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded checkpoint by its path."""
    if isinstance(obj, torch.Tensor):
        return {where: obj}
    found: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found.update(_tensors(v, f"{where}/{k}"))
    return found


def load_pt(path: Path) -> tuple[Any, list[str], dict[str, str]]:
    """What torch makes of a .pt file: the object, the device tag of each storage in file order, and the tag of
    each (non-empty, strided) tensor by its path."""
    seen: list[str] = []
    tags: dict[int, str] = {}

    def where(storage: Any, location: str) -> Any:
        seen.append(location)
        if storage.nbytes():
            tags[storage.data_ptr()] = location
        return storage

    obj = torch.load(path, weights_only=True, map_location=where)
    by_key = {
        k: tags[t.untyped_storage().data_ptr()]
        for k, t in _tensors(obj).items()
        if t.layout == torch.strided and t.untyped_storage().nbytes()
    }
    return obj, seen, by_key
