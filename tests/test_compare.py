"""ckptfix.compare, .renames, .loading and .factory: reports, likely renames, the fixing command, model specs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import LayoutError, MismatchError
from ckptfix.factory import ModelSpecError, build_model
from ckptfix.loading import adapt_to_model
from ckptfix.renames import likely_renames
from tests.checks_models import RenamedCNN, SmallCNN, wrong_head

KEYS = {
    "features.0.weight",
    "features.0.bias",
    "features.1.weight",
    "features.1.bias",
    "features.1.running_mean",
    "features.1.running_var",
    "features.1.num_batches_tracked",
    "features.3.weight",
    "features.3.bias",
    "features.4.weight",
    "features.4.bias",
    "features.4.running_mean",
    "features.4.running_var",
    "features.4.num_batches_tracked",
    "head.weight",
    "head.bias",
}


def test_fitting_state_is_ok_and_strict_returns_the_report() -> None:
    report = ckptfix.check(SmallCNN().state_dict(), SmallCNN())
    assert report.ok and report.loads_as_is and report.strict() is report
    assert report.fix_command("x.pt") is None


@pytest.mark.parametrize("kind", ["dp", "compiled"])
def test_layout_only_difference_gives_the_convert_command(kind: str) -> None:
    net = SmallCNN()
    state = (nn.DataParallel(net) if kind == "dp" else torch.compile(net)).state_dict()
    adapted, report = adapt_to_model(state, SmallCNN(), source="run/ckpt.pt")
    assert set(adapted) == KEYS
    assert report.ok and not report.loads_as_is
    assert (report.layout_from, report.layout_to) == ("ddp" if kind == "dp" else "compiled", "single")
    assert report.fix_command("run/ckpt.pt") == "ckptfix convert run/ckpt.pt run/ckpt.single.pt --to single"


def test_renamed_module_is_paired_and_a_rename_rule_is_offered() -> None:
    state = nn.DataParallel(SmallCNN()).state_dict()
    _, report = adapt_to_model(state, RenamedCNN(), source="c.pt")
    assert not report.ok
    assert set(report.missing) == {k.replace("features.", "backbone.") for k in KEYS if k.startswith("features.")}
    assert sorted(report.renamed) == sorted((k, k.replace("features.", "backbone.")) for k in report.unexpected)
    assert report.rename_rules == [r"^module\.features\.=module.backbone."]
    assert report.fix_command("c.pt") == (
        "ckptfix convert c.pt c.fixed.pt --to single --rename '^module\\.features\\.=module.backbone.'"
    )
    with pytest.raises(MismatchError, match=r"c\.pt: does not fit the model: 14 missing"):
        report.strict()


@pytest.mark.parametrize("kind", ["single", "dp"])
def test_rename_rule_really_fixes_the_keys(kind: str) -> None:
    state = SmallCNN().state_dict() if kind == "single" else nn.DataParallel(SmallCNN()).state_dict()
    _, report = adapt_to_model(state, RenamedCNN())
    assert report.rename_rules
    fixed = ckptfix.convert(state, to="single", renames=report.rename_rules)
    assert ckptfix.check(fixed, RenamedCNN()).loads_as_is


def test_no_model_state_is_a_layout_error_not_a_mismatch() -> None:
    with pytest.raises(LayoutError, match="holds no model state dict"):
        ckptfix.load_into(SmallCNN(), {"epoch": 1})


def test_wrong_shape_is_reported_and_not_fixable() -> None:
    _, report = adapt_to_model(SmallCNN().state_dict(), wrong_head())
    assert report.wrong_shape == {"head.weight": ((3, 4), (5, 4)), "head.bias": ((3,), (5,))}
    assert not report.missing and not report.unexpected and report.fix_command("a.pt") is None
    assert report.to_dict()["wrong_shape"]["head.bias"] == {"checkpoint": [3], "model": [5]}


def test_wrong_dtype_is_reported() -> None:
    state = {k: v.half() if v.is_floating_point() else v for k, v in SmallCNN().state_dict().items()}
    report = ckptfix.check(state, SmallCNN())
    assert report.wrong_dtype["head.weight"] == ("float16", "float32")
    assert "num_batches_tracked" not in " ".join(report.wrong_dtype)


def test_likely_renames_refuses_ambiguous_pairs() -> None:
    shapes = {"a.w": (2,), "b.w": (2,), "x.w": (2,)}
    assert likely_renames(["x.w"], ["a.w", "b.w"], shapes) == []  # two equally good matches
    shapes = {"enc.0.w": (2,), "dec.0.w": (3,), "encoder.0.w": (2,), "decoder.0.w": (3,)}
    assert likely_renames(["encoder.0.w", "decoder.0.w"], ["enc.0.w", "dec.0.w"], shapes) == [
        ("enc.0.w", "encoder.0.w"),
        ("dec.0.w", "decoder.0.w"),
    ]


def test_build_model_from_a_spec() -> None:
    model = build_model("torch.nn:Linear", kwargs='{"in_features": 2, "out_features": 3}')
    assert isinstance(model, nn.Linear) and model.weight.shape == (3, 2)
    assert isinstance(build_model("tests.checks_models:small_cnn", kwargs={"classes": 5}), SmallCNN)
    for spec, kwargs, argument, match in [
        ("torch.nn.Linear", None, "spec", r"build_model\(spec='torch.nn.Linear'\): expected package.module:factory"),
        ("no_such_pkg_x:f", None, "spec", "cannot import 'no_such_pkg_x'.*to sys.path or PYTHONPATH$"),
        ("torch.nn:Nope", None, "spec", "has no attribute 'Nope'"),
        ("torch.nn:Linear", "{bad", "kwargs", r"build_model\(kwargs='\{bad'\): not valid JSON"),
        ("torch.nn:Linear", "[1]", "kwargs", "expected a JSON object"),
        ("torch.nn:Linear", None, "spec", "building the model failed: TypeError"),
        ("tests.checks_models:inputs", '{"rank": 0}', "spec", "returned Tensor, not a torch.nn.Module"),
    ]:
        with pytest.raises(ModelSpecError, match=match) as caught:
            build_model(spec, kwargs=kwargs)
        assert caught.value.argument == argument and "--" not in str(caught.value)  # library terms, not flags


def test_build_model_searches_a_folder_last_and_only_while_building(tmp_path: Path) -> None:
    (tmp_path / "ckptfix_test_factory.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(2, 3)\n"
    )
    (tmp_path / "torch.py").write_text("raise RuntimeError('the installed torch must win')\n")
    path_before = list(sys.path)
    with pytest.raises(ModelSpecError, match="cannot import 'ckptfix_test_factory'"):
        build_model("ckptfix_test_factory:build")
    assert isinstance(build_model("ckptfix_test_factory:build", search_path=tmp_path), nn.Linear)
    assert sys.path == path_before
    (tmp_path / "ckptfix_test_broken.py").write_text("raise ValueError('no')\n")
    with pytest.raises(ModelSpecError, match="importing 'ckptfix_test_broken' failed: ValueError: no"):
        build_model("ckptfix_test_broken:f", search_path=tmp_path)


def _with_version(state: Any, module: str, version: Any) -> Any:
    state._metadata[module]["version"] = version
    return state


@pytest.mark.parametrize("version", ["2", [2], (1, 2)])
def test_bad_batchnorm_version_is_a_mismatch_found_before_the_model_is_touched(version: Any) -> None:
    state = _with_version(SmallCNN().state_dict(), "features.1", version)
    state["features.0.bias"] = state["features.0.bias"] + 1  # loaded before features.1: a partial load would show
    model = SmallCNN()
    conv = model.features[0]
    assert isinstance(conv, nn.Conv2d) and conv.bias is not None
    before = conv.bias.detach().clone()
    with pytest.raises(TypeError):
        SmallCNN().load_state_dict(state)  # the premise: torch raises midway
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
    state = _with_version(SmallCNN().state_dict(), "features.1", version)
    SmallCNN().load_state_dict(state)
    assert ckptfix.check(state, SmallCNN()).bad_metadata == {}


def test_metadata_entries_that_are_not_dicts_are_reported() -> None:
    state = SmallCNN().state_dict()
    state._metadata["head"] = "v2"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        SmallCNN().load_state_dict(state)
    assert ckptfix.check(state, SmallCNN()).bad_metadata == {
        "head": "its _metadata entry is a str, not a dict: delete the entry"
    }


def test_metadata_that_is_not_a_dict_is_a_mismatch() -> None:
    state = SmallCNN().state_dict()
    state._metadata = [1, 2]  # type: ignore[attr-defined]
    with pytest.raises(MismatchError, match=r"^c\.pt: its _metadata is a list, not a dict of module entries"):
        adapt_to_model(state, SmallCNN(), source="c.pt")
    assert ckptfix.check(state, SmallCNN()).bad_metadata == {
        "": "_metadata is a list, not a dict of module entries: delete it"
    }


def test_num_batches_tracked_that_torch_fills_in_is_not_missing() -> None:
    state = SmallCNN().state_dict()
    del state["features.1.num_batches_tracked"]
    _with_version(state, "features.1", 1)
    SmallCNN().load_state_dict(state)
    assert ckptfix.check(state, SmallCNN()).loads_as_is
    plain = {k: v for k, v in SmallCNN().state_dict().items() if not k.endswith("num_batches_tracked")}
    assert ckptfix.check(plain, SmallCNN()).loads_as_is  # no _metadata at all: version None, filled in too
    _with_version(state, "features.1", 2)
    assert ckptfix.check(state, SmallCNN()).missing == ["features.1.num_batches_tracked"]
