"""ckptfix.formats.dtypes: every dtype torch saves, carried bit for bit by load, inspect and convert on both paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dtype_files import BYTE_DTYPES, PATHS, QUANTIZED, assert_bits, make

# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", BYTE_DTYPES + QUANTIZED)
def test_every_dtype_torch_saves_is_carried_bit_for_bit(tmp_path: Path, name: str, path: str) -> None:
    src = tmp_path / f"{name}.pt"
    state = make(name)
    torch.save(state, src)
    assert_bits(torch.load(src, weights_only=True), state)  # what torch itself reads back
    assert_bits(PATHS[path](src, tmp_path), state)
