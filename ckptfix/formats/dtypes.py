"""The one dtype table: torch dtype names, their sizes, safetensors codes and legacy storage classes.

Stdlib only, so the readers, the streaming path and the torch path all look sizes up in the same place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class DType(NamedTuple):
    """One torch dtype as the file formats see it."""

    itemsize: int
    safetensors: str | None  # the safetensors code, None when safetensors cannot store it
    storage: str | None  # the legacy typed-storage class torch.save pickles for it, if any
    per_item: int = 1  # values packed in each item: shapes, offsets and strides count values, storages items


DTYPES: dict[str, DType] = {
    "float64": DType(8, "F64", "DoubleStorage"),
    "float32": DType(4, "F32", "FloatStorage"),
    "float16": DType(2, "F16", "HalfStorage"),
    "bfloat16": DType(2, "BF16", "BFloat16Storage"),
    "int64": DType(8, "I64", "LongStorage"),
    "int32": DType(4, "I32", "IntStorage"),
    "int16": DType(2, "I16", "ShortStorage"),
    "int8": DType(1, "I8", "CharStorage"),
    "uint8": DType(1, "U8", "ByteStorage"),
    "bool": DType(1, "BOOL", "BoolStorage"),
    "uint16": DType(2, "U16", None),
    "uint32": DType(4, "U32", None),
    "uint64": DType(8, "U64", None),
    "float8_e4m3fn": DType(1, "F8_E4M3", None),
    "float8_e5m2": DType(1, "F8_E5M2", None),
    "complex64": DType(8, "C64", "ComplexFloatStorage"),
    "complex128": DType(16, None, "ComplexDoubleStorage"),
    "float8_e4m3fnuz": DType(1, "F8_E4M3FNUZ", None),  # codes safetensors writes and reads (0.8 does)
    "float8_e5m2fnuz": DType(1, "F8_E5M2FNUZ", None),
    "float8_e8m0fnu": DType(1, None, None),
    # bytes torch saves and loads (torch.load rebuilds them as they are) without arithmetic on them: carried bit
    # for bit. safetensors has no code for any of them (its F4 is not read by safetensors.torch up to 0.8).
    "complex32": DType(4, None, None),
    "float4_e2m1fn_x2": DType(1, None, None),  # one item holds two values, but torch counts items
    "bits8": DType(1, None, None),
    "bits16": DType(2, None, None),
    "bits1x8": DType(1, None, None),
    "bits2x4": DType(1, None, None),
    "bits4x2": DType(1, None, None),
    # quantized dtypes: their storages are sized in these units, so the storage-size rule covers them too
    "qint8": DType(1, None, "QInt8Storage"),
    "quint8": DType(1, None, "QUInt8Storage"),
    "qint32": DType(4, None, "QInt32Storage"),
    "quint4x2": DType(1, None, "QUInt4x2Storage", per_item=2),  # sub-byte: torch counts their values, not bytes
    "quint2x4": DType(1, None, "QUInt2x4Storage", per_item=4),
}
QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
# legacy storage class -> dtype name
STORAGE_DTYPES: dict[str, str] = {d.storage: name for name, d in DTYPES.items() if d.storage}
# safetensors code -> dtype name
FROM_SAFETENSORS: dict[str, str] = {d.safetensors: name for name, d in DTYPES.items() if d.safetensors}


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name`` (a KeyError for a name not in the table)."""
    return DTYPES[name].itemsize


def nbytes(name: str, numel: int) -> int:
    """Bytes that ``numel`` values of dtype ``name`` take (sub-byte dtypes round up to whole bytes)."""
    dtype = DTYPES[name]
    return -(-numel // dtype.per_item) * dtype.itemsize


def storage_itemsize(storage_class: str) -> int | None:
    """Bytes per element counted by a storage class's element count (1 for UntypedStorage), None if unknown."""
    if storage_class == "UntypedStorage":
        return 1
    dtype = STORAGE_DTYPES.get(storage_class)
    return None if dtype is None else DTYPES[dtype].itemsize


def safetensors_code(name: str) -> str | None:
    """The safetensors code of dtype ``name``, None when safetensors cannot store it."""
    dtype = DTYPES.get(name)
    return None if dtype is None else dtype.safetensors


_INT64 = (1 << 63) - 1


def shape_problem(shape: Iterable[int]) -> str | None:
    """Why torch cannot hold ``shape`` (a size, or the product of the sizes taken in order, past 64 bits: torch's
    rule, stricter than the safetensors library's), or None: the shape rule of every .safetensors read or written
    and of DCP sizes."""
    numel = 1
    for d in shape:
        numel *= d
        if d > _INT64 or numel > _INT64:
            return "sizes past 64 bits, which torch cannot build"
    return None
