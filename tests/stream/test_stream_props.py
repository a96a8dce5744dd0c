"""Property-based: random state dicts through the fast path and the torch path give the same checkpoint."""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ckptfix.stream import Fallback
from tests.stream.test_stream import _check_torch_output, _fast, _slow

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.uint16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]  # fmt: skip


def _saves(dtype: torch.dtype) -> bool:
    """Whether this torch's torch.save writes the dtype (torch 2.5 and older have no storage type for uint16)."""
    try:
        torch.save(torch.zeros(1, dtype=dtype), io.BytesIO())
    except KeyError:
        return False
    return True


DTYPES = [dtype for dtype in DTYPES if _saves(dtype)]
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape).clone()


@st.composite
def state_dicts(draw: st.DrawFn) -> OrderedDict[str, Any]:
    n = draw(st.integers(1, 6))
    sd: OrderedDict[str, Any] = OrderedDict()
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        t = _tensor(dtype, draw(SHAPES), seed=i)
        kind = draw(st.sampled_from(["plain", "param", "view", "transposed", "tied"]))
        if kind == "param" and dtype.is_floating_point and dtype.itemsize > 1:
            t = nn.Parameter(t, requires_grad=draw(st.booleans()))
        elif kind == "view" and t.dim() and t.shape[0] > 1:
            t = t[1:]
        elif kind == "transposed" and t.dim() == 2:
            t = t.t()
        elif kind == "tied" and sd:
            t = sd[draw(st.sampled_from(sorted(sd)))]
        sd[f"module.layer{i}.weight"] = t
    sd._metadata = OrderedDict([("", {"version": 1}), ("module", {"version": 1})])  # type: ignore[attr-defined]
    return sd


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=state_dicts(), to=st.sampled_from(["single", "compiled"]), out=st.sampled_from([".pt", ".safetensors"]))
def test_random_state_dicts(tmp_path_factory: pytest.TempPathFactory, sd: Any, to: str, out: str) -> None:
    tmp = Path(tmp_path_factory.mktemp("prop"))
    torch.save(sd, tmp / "in.pt")
    try:
        _fast(tmp / "in.pt", tmp / f"fast{out}", to=to)
    except Fallback as e:
        # Only pt->safetensors may decline, and only for views it cannot copy as one range.
        assert out == ".safetensors" and "non-contiguous" in str(e)
        assert not (tmp / f"fast{out}").exists()
        return
    _slow(tmp / "in.pt", tmp / f"slow{out}", to=to)
    if out == ".pt":
        _check_torch_output(tmp / "fast.pt", tmp / "slow.pt")
    else:
        assert (tmp / "fast.safetensors").read_bytes() == (tmp / "slow.safetensors").read_bytes()
        _fast(tmp / "fast.safetensors", tmp / "back.pt", to="single")
        _slow(tmp / "slow.safetensors", tmp / "back_slow.pt", to="single")
        _check_torch_output(tmp / "back.pt", tmp / "back_slow.pt")
