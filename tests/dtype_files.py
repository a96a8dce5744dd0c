"""Tensors of every dtype torch saves (made as bytes: torch cannot draw most of them), the ways a file is read or
converted (PATHS), and the check that each tensor comes back bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.writers import torch_saves

# dtypes torch.save writes as plain bytes (torch has no arithmetic for most of them)
BYTE_DTYPES = tuple(
    name
    for name in ("complex32", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")
    if torch_saves(name)  # those this torch has and saves
)

# the sub-byte quantized dtypes, packing 2 or 4 values a byte (qint8 and the others were carried already)
QUANTIZED = ("quint4x2", "quint2x4")


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (made as bytes: torch cannot draw most of these dtypes)."""
    width = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(n * width)
    return torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _quantized(name: str) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.arange(7.0), 0.5, 1, getattr(torch, name))


def make(name: str) -> dict[str, torch.Tensor]:
    if name.startswith("q"):
        return {"q": _quantized(name)}
    w = _random(getattr(torch, name), (4, 6))
    return {"w": w, "view": w[1:, 2:5], "t": w.t()}  # a view with an offset and strides, a transposed one


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes as they are stored (torch.equal has no kernels for most of these dtypes)."""
    if t.is_quantized:  # the storage: quint4x2 packs two values a byte
        return bytes(t.untyped_storage())
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_bits(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, t in want.items():
        g = got[key]
        assert (g.dtype, g.shape, g.stride(), g.storage_offset()) == (t.dtype, t.shape, t.stride(), t.storage_offset())
        assert raw(g) == raw(t), key
        if t.is_quantized:
            assert (g.q_scale(), g.q_zero_point()) == (t.q_scale(), t.q_zero_point())


def _load(src: Path, tmp: Path) -> dict[str, Any]:
    return ckptfix.load(src)  # type: ignore[no-any-return]


def _convert(fast: bool) -> Callable[[Path, Path], dict[str, Any]]:
    def run(src: Path, tmp: Path) -> dict[str, Any]:
        out = tmp / "out.pt"
        ckptfix.convert_file(src, out, to=None, fast=fast)
        return torch.load(out, weights_only=True)  # type: ignore[no-any-return]

    return run


def _cli_convert(src: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / "cli.pt"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--keep-layout"])
    assert result.exit_code == 0, result.output
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


PATHS = {"load": _load, "convert-fast": _convert(True), "convert-torch": _convert(False), "cli-convert": _cli_convert}


def _inspect(path: Path, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["inspect", str(path), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in args else result.output


def _quantized_linear() -> torch.nn.Module:
    m = torch.ao.nn.quantized.Linear(4, 3)
    g = torch.Generator().manual_seed(1)
    weight = torch.quantize_per_tensor(torch.randn(3, 4, generator=g), 0.05, 0, torch.qint8)
    m.set_weight_bias(weight, torch.randn(3, generator=g))
    return m


MATH_BITS = {
    "neg": (torch.arange(4.0), lambda x: torch._neg_view(x)),
    "conj": (torch.tensor([1 + 2j, 3 - 4j]), lambda z: z.conj()),
}
