"""Faithful to every file torch and safetensors can write: dtypes, CRC-less saves, odd keys, layouts, devices.

Every input is made by torch itself. A dtype torch can save is either carried bit for bit (``ckptfix.load``,
``inspect``, ``convert`` to .pt on both paths) or refused with exit 2 and one line saying it is not supported
yet; never called corrupt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
]

# dtypes torch.save writes as plain bytes (torch has no arithmetic for most of them)
BYTE_DTYPES = ("complex32", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")
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


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", BYTE_DTYPES + QUANTIZED)
def test_every_dtype_torch_saves_is_carried_bit_for_bit(tmp_path: Path, name: str, path: str) -> None:
    src = tmp_path / f"{name}.pt"
    state = make(name)
    torch.save(state, src)
    assert_bits(torch.load(src, weights_only=True), state)  # what torch itself reads back
    assert_bits(PATHS[path](src, tmp_path), state)


@pytest.mark.parametrize("name", BYTE_DTYPES + QUANTIZED)
def test_inspect_shows_every_dtype_torch_saves_with_its_byte_size(tmp_path: Path, name: str) -> None:
    src = tmp_path / f"{name}.pt"
    state = make(name)
    torch.save(state, src)
    result = CliRunner().invoke(cli, ["inspect", str(src), "--json"])
    assert result.exit_code == 0, result.output
    model = json.loads(result.output)["models"][""]
    assert model["dtypes"] == {name: len(state)}
    per_byte = {"quint4x2": 2, "quint2x4": 4}.get(name, 1)  # 7 values of quint4x2 take 4 bytes
    assert model["bytes"] == sum(-(-t.numel() // per_byte) * t.element_size() for t in state.values())


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-path"])
@pytest.mark.parametrize("name", (*BYTE_DTYPES, *QUANTIZED, "qint8"))
def test_a_dtype_safetensors_has_no_code_for_is_refused_in_one_line(tmp_path: Path, name: str, fast: bool) -> None:
    src, out = tmp_path / f"{name}.pt", tmp_path / "out.safetensors"
    torch.save({"w": make(name)[next(iter(make(name)))]}, src)
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), *([] if fast else ["--no-fast"])])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert f"not supported yet: dtype {name}" in result.output
    assert "corrupt" not in result.output
    assert not out.exists()
