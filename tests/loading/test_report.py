"""ckptfix.loading.report: key reports (missing, unexpected, wrong shape and dtype, bad _metadata) and the fixing
command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import MismatchError
from ckptfix.formats.safetensors.file import StTensor
from ckptfix.loading.model import adapt_to_model
from ckptfix.loading.report import compare_keys
from tests.models import SmallNet, wrong_head


def test_fitting_state_is_ok_and_strict_returns_the_report() -> None:
    report = ckptfix.check(SmallNet().state_dict(), SmallNet())
    assert report.ok and report.loads_as_is and report.strict() is report
    assert report.fix_command("x.pt") is None


def test_wrong_shape_is_reported_and_not_fixable() -> None:
    _, report = adapt_to_model(SmallNet().state_dict(), wrong_head())
    assert report.wrong_shape == {"head.weight": ((3, 4), (5, 4)), "head.bias": ((3,), (5,))}
    assert not report.missing and not report.unexpected and report.fix_command("a.pt") is None
    assert report.to_dict()["wrong_shape"]["head.bias"] == {"checkpoint": [3], "model": [5]}


def test_wrong_dtype_is_reported() -> None:
    state = {k: v.half() if v.is_floating_point() else v for k, v in SmallNet().state_dict().items()}
    report = ckptfix.check(state, SmallNet())
    assert report.wrong_dtype["head.weight"] == ("float16", "float32")
    assert "num_batches_tracked" not in " ".join(report.wrong_dtype)


def _with_version(state: Any, module: str, version: Any) -> Any:
    state._metadata[module]["version"] = version
    return state


@pytest.mark.parametrize("version", ["2", [2], (1, 2)])
def test_bad_batchnorm_version_is_a_mismatch_found_before_the_model_is_touched(version: Any) -> None:
    state = _with_version(SmallNet().state_dict(), "features.1", version)
    state["features.0.bias"] = state["features.0.bias"] + 1  # loaded before features.1: a partial load would show
    model = SmallNet()
    conv = model.features[0]
    assert isinstance(conv, nn.Conv2d) and conv.bias is not None
    before = conv.bias.detach().clone()
    with pytest.raises(TypeError):
        SmallNet().load_state_dict(state)  # the premise: torch raises midway
    report = ckptfix.check(state, model)
    assert not report.ok and list(report.bad_metadata) == ["features.1"]
    assert report.bad_metadata["features.1"].startswith(f"_metadata version {version!r} is a {type(version).__name__}")
    assert report.fix_command("a.pt") is None and report.to_dict()["bad_metadata"] == report.bad_metadata
    for strict in (True, False):
        with pytest.raises(MismatchError, match=r"1 bad _metadata \(e\.g\. module 'features\.1': _metadata version"):
            ckptfix.load_into(model, state, strict=strict)
    assert torch.equal(conv.bias, before)


@pytest.mark.parametrize("version", [None, 0, 1, 2, 7, 1.5, True])
def test_versions_load_state_dict_accepts_are_accepted(version: Any) -> None:
    state = _with_version(SmallNet().state_dict(), "features.1", version)
    SmallNet().load_state_dict(state)
    assert ckptfix.check(state, SmallNet()).bad_metadata == {}


def test_metadata_entries_that_are_not_dicts_are_reported() -> None:
    state = SmallNet().state_dict()
    state._metadata["head"] = "v2"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        SmallNet().load_state_dict(state)
    assert ckptfix.check(state, SmallNet()).bad_metadata == {
        "head": "its _metadata entry is a str, not a dict: delete the entry"
    }


def test_num_batches_tracked_that_torch_fills_in_is_not_missing() -> None:
    state = SmallNet().state_dict()
    del state["features.1.num_batches_tracked"]
    _with_version(state, "features.1", 1)
    SmallNet().load_state_dict(state)
    assert ckptfix.check(state, SmallNet()).loads_as_is
    plain = {k: v for k, v in SmallNet().state_dict().items() if not k.endswith("num_batches_tracked")}
    assert ckptfix.check(plain, SmallNet()).loads_as_is  # no _metadata at all: version None, filled in too
    _with_version(state, "features.1", 2)
    assert ckptfix.check(state, SmallNet()).missing == ["features.1.num_batches_tracked"]


def test_compare_keys_reads_shapes_and_dtypes_of_records_too() -> None:
    records = {
        k: StTensor(str(v.dtype).removeprefix("torch."), tuple(v.shape), 0, 0)
        for k, v in SmallNet().state_dict().items()
    }
    assert compare_keys(records, SmallNet()).loads_as_is
    records["head.bias"] = StTensor("float16", (3,), 0, 0)
    records["head.weight"] = StTensor("float32", (5, 4), 0, 0)
    report = compare_keys(records, SmallNet())
    assert report.wrong_dtype == {"head.bias": ("float16", "float32")}
    assert report.wrong_shape == {"head.weight": ((5, 4), (3, 4))}


def test_fix_command_repeats_every_option_the_check_needed() -> None:
    _, report = adapt_to_model(nn.DataParallel(SmallNet()).state_dict(), SmallNet())
    assert report.fix_command(
        "run/x.pt", entry="state_dict_ema", strip_prefixes=["student."], allow_globals=["argparse.Namespace"],
        unsafe=True,
    ) == (
        "ckptfix convert run/x.pt x.single.pt --entry state_dict_ema --strip-prefix student. --to single "
        "--allow-global argparse.Namespace --unsafe-pickle"
    )  # fmt: skip
    assert report.to_dict()["renamed_prefix"] is None and report.to_dict()["tied"] == {}


def test_fix_command_for_a_prefix_strips_under_the_layout_prefix_or_adds_inside_the_models() -> None:
    state = {f"module.model.{k}": v for k, v in SmallNet().state_dict().items()}
    _, report = adapt_to_model(state, torch.compile(SmallNet()))  # type: ignore[arg-type]
    assert report.ok and report.renamed_prefix == ("model.", "")
    assert report.fix_command("a.pt") == "ckptfix convert a.pt a.fixed.pt --strip-prefix module.model. --to compiled"
    holder = nn.Module()
    holder.net = SmallNet()
    _, report = adapt_to_model(SmallNet().state_dict(), torch.compile(holder))  # type: ignore[arg-type]
    assert report.renamed_prefix == ("", "net.") and report.to_dict()["renamed_prefix"] == ["", "net."]
    assert report.fix_command("a.pt") == "ckptfix convert a.pt a.fixed.pt --to single --add-prefix _orig_mod.net."


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(("value", "kind"), [(3, "int"), (torch.float32, "torch.float32"), ((1, 2), "tuple")])
def test_a_value_that_is_not_a_tensor_where_the_model_has_one_is_a_wrong_dtype(
    tmp_path: Path, value: Any, kind: str
) -> None:
    src = tmp_path / "odd.pt"
    torch.save({"weight": value, "bias": torch.zeros(2)}, src)
    report = ckptfix.check(src, torch.nn.Linear(2, 2))
    assert report.wrong_dtype == {"weight": (f"{kind} (not a tensor)", "float32")}
    with pytest.raises(ckptfix.MismatchError, match=f"'weight': {kind} \\(not a tensor\\) vs model float32"):
        ckptfix.load_into(torch.nn.Linear(2, 2), src)
