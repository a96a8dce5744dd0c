"""Mutation fuzzing of the readers: the only acceptable outcomes are success or a CkptfixError.

CI runs a few dozen examples per target (seconds). A longer campaign:

    CKPTFIX_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_fuzz.py -q
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.errors import CkptfixError
from ckptfix.formats import convert_file
from tests.conftest import make_net

EXAMPLES = int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="CKPTFIX_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=list(HealthCheck),
    database=None,
)


def _seeds() -> dict[str, bytes]:
    state = {"model": {f"module.{k}": v for k, v in make_net().state_dict().items()}, "epoch": 3}
    seeds = {}
    for name, kwargs in {"zip": {}, "legacy": {"_use_new_zipfile_serialization": False}}.items():
        buffer = io.BytesIO()
        torch.save(state, buffer, **kwargs)  # type: ignore[arg-type]
        seeds[name] = buffer.getvalue()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "x.safetensors"
        ckptfix.save(state, path)
        seeds["safetensors"] = path.read_bytes()
    return seeds


SEEDS = _seeds()


@st.composite
def mutated(draw: st.DrawFn, seed: str) -> bytes:
    data = bytearray(SEEDS[seed])
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "byte", "cut", "insert", "delete", "header"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:  # hit the first bytes, where headers and lengths live
            data[draw(st.integers(0, min(len(data), 128) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def _check(data: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"in{suffix}"
        path.write_bytes(data)
        with contextlib.suppress(CkptfixError):
            ckptfix.load(path)
        out = Path(folder) / "out.pt"
        try:
            convert_file(path, out)
        except CkptfixError:
            assert not out.exists()
        assert path.read_bytes() == data


@pytest.mark.parametrize("seed", ["zip", "legacy"])
def test_fuzz_torch_readers(seed: str) -> None:
    @FUZZ
    @given(mutated(seed))
    def run(data: bytes) -> None:
        _check(data, ".pt")

    run()


def test_fuzz_safetensors_reader() -> None:
    @FUZZ
    @given(mutated("safetensors"))
    def run(data: bytes) -> None:
        _check(data, ".safetensors")

    run()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "I64", "BOOL", "U8", "X"]),
        "shape": st.lists(st.integers(-1, 5), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 64), min_size=0, max_size=3),
    }
)


@FUZZ
@given(
    st.dictionaries(st.text(max_size=6), _entry | _json, max_size=5),
    st.binary(max_size=64),
)
def test_fuzz_safetensors_headers(header: dict[str, object], data: bytes) -> None:
    body = json.dumps(header).encode()
    _check(struct.pack("<Q", len(body)) + body + data, ".safetensors")
