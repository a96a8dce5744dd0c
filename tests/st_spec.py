"""The safetensors format read as its specification says, where the installed safetensors release is older than
the dtype (complex64 came in 0.7, float8 *fnuz in 0.8; ckptfix's floor is 0.4): the truth for what a file holds
must not shrink with the library the tests happen to run beside."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import safetensors.torch
import torch

CODES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}  # fmt: skip
FORMAT_DTYPES = frozenset(str(d).removeprefix("torch.") for d in CODES.values())


def load_file(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors: by the safetensors library where it knows every dtype in the file, else by the spec
    (a little-endian u64 header length, a JSON header, then the bytes at each tensor's offsets)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    if all(CODES[h["dtype"]] in safetensors.torch._SIZE for h in header.values()):
        return safetensors.torch.load_file(path)
    data = raw[8 + n :]
    out = {}
    for key, h in header.items():
        start, end = h["data_offsets"]
        out[key] = torch.frombuffer(bytearray(data[start:end]) or bytearray(1), dtype=CODES[h["dtype"]])[
            : (end - start) // CODES[h["dtype"]].itemsize
        ].reshape(h["shape"])
    return out
