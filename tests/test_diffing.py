"""ckptfix.diffing: layout-normalised comparison of two checkpoints."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.diffing import diff, diff_files, same_bytes, tensor_diff
from tests.assertions import _bits_state, _values
from tests.dtype_files import MATH_BITS
from tests.models import SmallNet
from tests.sharded_writers import _dcp_save
from tests.writers import torch_saves


def _ckpt(state: dict[str, torch.Tensor], epoch: int = 3) -> dict[str, object]:
    return {"model": state, "epoch": epoch, "args": {"lr": 0.1}}


def test_identical_and_layout_only_different_are_equal() -> None:
    state = SmallNet().state_dict()
    assert diff(_ckpt(state), _ckpt(dict(state))).equal
    # On a GPU machine DataParallel's tensors are on cuda:0: compared with CPU ones all the same.
    report = diff(_ckpt(state), _ckpt(nn.DataParallel(SmallNet()).state_dict()))
    assert report.equal and report.layouts_differ
    assert (report.entries[0].layout_a, report.entries[0].layout_b) == ("single", "ddp")
    assert report.entries[0].compared == 16


def test_value_shape_dtype_and_key_differences() -> None:
    a = SmallNet().state_dict()
    b = dict(a)
    b["head.weight"] = a["head.weight"] + 0.25
    b["head.bias"] = a["head.bias"].half()
    b["features.0.weight"] = torch.zeros(2, 2)
    del b["features.0.bias"]
    b["extra.weight"] = torch.ones(1)
    report = diff(_ckpt(a), _ckpt(b, epoch=4), names=("a.pt", "b.pt"))
    entry = report.entries[0]
    assert not report.equal
    assert entry.only_a == ["features.0.bias"] and entry.only_b == ["extra.weight"]
    assert entry.shape == {"features.0.weight": ([4, 3, 3, 3], [2, 2])}
    assert entry.dtype == {"head.bias": ("float32", "float16")}
    by_key = {v.key: v for v in entry.values}
    assert set(by_key) == {"head.weight", "head.bias"}  # the fp16 cast also changed the values a little
    assert by_key["head.weight"].max_abs == 0.25
    assert [(o.path, o.a, o.b) for o in report.other] == [("epoch", "3", "4")]
    parsed = json.loads(json.dumps(report.to_dict()))
    assert parsed["entries"][0]["shape"]["features.0.weight"] == {"a": [4, 3, 3, 3], "b": [2, 2]}


def test_tolerances() -> None:
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([1.0, 2.001])}
    assert not diff(a, b).equal
    assert diff(a, b, atol=0.01).equal
    assert diff(a, b, rtol=1e-3).equal
    assert not diff(a, b, rtol=1e-4).equal
    found = tensor_diff(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), atol=0, rtol=0)
    assert found == (1.0, 1.0)
    found = tensor_diff(torch.tensor([1.0]), torch.tensor([0.0]), atol=0, rtol=0)
    assert found is not None and math.isinf(found[1])
    nan = torch.tensor([float("nan"), 1.0])
    assert tensor_diff(nan, nan.clone(), atol=0, rtol=0) is None
    assert tensor_diff(nan, torch.tensor([1.0, 1.0]), atol=10, rtol=0) is not None
    inf = torch.tensor([float("inf"), 1.0])  # equal infinities are equal, even beside a real difference
    assert tensor_diff(inf, torch.tensor([float("inf"), 1.5]), atol=0, rtol=0) == (0.5, pytest.approx(1 / 3))
    assert tensor_diff(inf, torch.tensor([float("inf"), 1.5]), atol=0.5, rtol=0) is None
    found = tensor_diff(inf, torch.tensor([-float("inf"), 1.0]), atol=10, rtol=0)
    assert found is not None and math.isinf(found[0])
    report = diff({"w": torch.tensor([1.0])}, {"w": torch.tensor([0.0])})
    assert json.loads(json.dumps(report.to_dict()))["entries"][0]["values"][0]["max_rel"] == "inf"


def test_non_model_entries_compared_as_data() -> None:
    state = {"w": torch.ones(2)}
    a = {"model": state, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}}, "tags": ["x"]}
    b = {"model": state, "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}}, "note": "hi"}
    report = diff(a, b)
    assert [(o.path, o.b) for o in report.other] == [
        ("optimizer.state.0.step", "values differ (max |Δ| 1)"),
        ("tags", "(absent)"),
        ("note", "'hi'"),
    ]


def test_bare_state_against_full_checkpoint_pairs_the_lone_entry() -> None:
    state = SmallNet().state_dict()
    report = diff(state, {"state_dict": state, "epoch": 1})
    assert report.entries[0].equal
    assert [(o.path, o.a) for o in report.other] == [("epoch", "(absent)")]


def test_the_difference_is_computed_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptfix.diffing._CHUNK", 7)  # many chunks, one partial
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 11, generator=gen)
    y = x.clone()
    y[3, 4] += 0.5
    y[4, 10] = 0.0
    delta = (x.double() - y.double()).abs()
    rel = torch.where(delta == 0, torch.zeros_like(delta), delta / y.double().abs())
    assert tensor_diff(x, y, atol=0, rtol=0) == (delta.max().item(), rel.max().item())
    assert tensor_diff(x, y, atol=0.6, rtol=0) is None
    nan = torch.zeros(30)
    nan[20] = float("nan")
    assert tensor_diff(torch.zeros(30), nan, atol=100, rtol=0) == (math.inf, math.inf)


def test_equal_bytes_are_equal_values_and_equal_values_need_not_be_equal_bytes() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bytes(nan, nan.clone()) and tensor_diff(nan, nan.clone(), atol=0, rtol=0) is None
    zeros, negative = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert not same_bytes(zeros, negative) and tensor_diff(zeros, negative, atol=0, rtol=0) is None
    assert not same_bytes(torch.ones(2), torch.ones(2).half())
    assert tensor_diff(torch.ones(2), torch.ones(2).half(), atol=0, rtol=0) is None
    view = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    assert same_bytes(view, view.contiguous())


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PAIRS = [
    ("ddp_rank0.pt", "ddp_rank1.pt"),
    ("ddp_wrapped.pt", "ddp_wrapped.safetensors"),
    ("dp_plain.pt", "ddp_plain.pt"),
    ("legacy_dp.pt", "dp_wrapped.pt"),
    ("namespace_args.pt", "single.pt"),
]


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_files_read_one_tensor_at_a_time_compare_as_loaded_objects(a: str, b: str) -> None:
    allow = ("argparse.Namespace",)
    pa, pb = FIXTURES / a, FIXTURES / b
    streamed = diff_files(pa, pb, allow_globals=allow)
    loaded = diff(
        ckptfix.load(pa, allow_globals=allow), ckptfix.load(pb, allow_globals=allow), names=(str(pa), str(pb))
    )
    assert streamed.to_dict() == loaded.to_dict()


def test_other_entries_of_inert_descriptions_compare_by_value(tmp_path: Path) -> None:
    a, b, c = (tmp_path / f"{n}.pt" for n in "abc")
    state = SmallNet().state_dict()
    torch.save({"model": state, "args": argparse.Namespace(lr=0.1), "shape": torch.Size([2, 3])}, a)
    torch.save({"model": state, "args": argparse.Namespace(lr=0.1), "shape": torch.Size([2, 3])}, b)
    torch.save({"model": state, "args": argparse.Namespace(lr=0.2), "shape": torch.Size([2, 4])}, c)
    allow = ("argparse.Namespace",)
    assert diff_files(a, b, allow_globals=allow).equal
    report = diff_files(a, c, allow_globals=allow)
    assert [(o.path, o.a, o.b) for o in report.other] == [
        ("args", "Namespace(lr=0.1)", "Namespace(lr=0.2)"),
        ("shape.1", "3", "4"),
    ]


def test_bytes_of_tensors_off_the_cpu_are_compared_as_bits() -> None:
    from ckptfix.diffing import _bits

    # the comparison used for GPU tensors (and a GPU tensor against a CPU one); NaN payloads count as equal bits
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.equal(_bits(nan), _bits(nan.clone())) and not torch.equal(nan, nan)
    assert _bits(torch.tensor(1.0)).shape == (4,) and _bits(torch.ones(2, 3).t()).shape == (24,)


# Faithful to what torch and safetensors write: math bits, container types, key order of empty tensors.


def test_diff_reads_the_math_bits_of_a_dcp_folder(tmp_path: Path) -> None:
    state = _bits_state()
    _dcp_save(state, tmp_path / "dcp")
    torch.save(_values(state), tmp_path / "values.pt")
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "dcp"), str(tmp_path / "values.pt")])
    assert result.exit_code == 0 and result.output.rstrip().endswith("equal"), result.output


# diff and merge compare what torch.load gives, never a cheaper stand-in: a neg or conj view's bytes are not its
# values; a byte-order record torch finds (its lookup ignores case) swaps every storage; integers are compared as
# integers, never after a cast to float64.


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


@pytest.mark.parametrize("bit", list(MATH_BITS))
def test_a_math_bit_view_is_compared_by_its_values(bit: str, tmp_path: Path) -> None:
    base, view = MATH_BITS[bit]
    plain = _save(tmp_path / "plain.pt", {"w": base})
    bits = _save(tmp_path / "bits.pt", {"w": view(base)})
    assert not torch.equal(torch.load(plain)["w"], torch.load(bits)["w"])
    report = diff_files(plain, bits)
    assert not report.equal
    assert report.entries[0].values[0].max_abs == pytest.approx(
        float((torch.load(plain)["w"] - torch.load(bits)["w"]).abs().max())
    )
    assert run("diff", plain, bits).exit_code == 1
    # the same values through the bit: equal
    same = _save(tmp_path / "same.pt", {"w": view(view(base).resolve_neg().resolve_conj())})
    assert torch.equal(torch.load(same)["w"], base)
    assert diff_files(plain, same).equal


def _int_dtypes() -> list[torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
    return [getattr(torch, n) for n in names if torch_saves(n)]  # torch 2.4 and 2.5 cannot save uint16-uint64


def _extremes(dtype: torch.dtype) -> tuple[int, int]:
    if dtype is torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


@pytest.mark.parametrize("a, b", [(2**53, 2**53 + 1), (2**60, 2**60 + 1), (-(2**63), 2**63 - 1)])
def test_int64_values_are_compared_as_integers(a: int, b: int, tmp_path: Path) -> None:
    x = _save(tmp_path / "x.pt", {"w": torch.tensor([a, 0])})
    y = _save(tmp_path / "y.pt", {"w": torch.tensor([b, 0])})
    report = diff_files(x, y)
    assert not report.equal
    assert report.entries[0].values[0].max_abs == float(abs(a - b))
    assert run("diff", x, y).exit_code == 1
    out = tmp_path / "merged.pt"
    result = run("merge", x, y, "-o", out, "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["parameters_match"] is False


@pytest.mark.parametrize("dtype", _int_dtypes(), ids=str)
def test_every_integer_dtype_is_compared_exactly(dtype: torch.dtype, tmp_path: Path) -> None:
    low, high = _extremes(dtype)
    for a, b in [(high, high - 1), (low, high), (low, low + 1)]:
        x = _save(tmp_path / "x.pt", {"w": torch.tensor([a, low, high], dtype=dtype)})
        y = _save(tmp_path / "y.pt", {"w": torch.tensor([b, low, high], dtype=dtype)})
        report = diff_files(x, y)
        assert not report.equal, (dtype, a, b)
        assert report.entries[0].values[0].max_abs == float(abs(a - b)), (dtype, a, b)
        assert diff_files(x, x).equal
        # within a tolerance: integers too
        assert diff_files(x, y, atol=float(abs(a - b))).equal
