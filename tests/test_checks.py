"""ckptfix.check / adapt_to_model: structured reports, likely renames, the fixing convert command."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.checks import adapt_to_model, build_model, likely_renames
from ckptfix.errors import CkptfixError, LayoutError, MismatchError
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
    for spec, kwargs, match in [
        ("torch.nn.Linear", None, "expected package.module:factory"),
        ("no_such_pkg_x:f", None, "cannot import 'no_such_pkg_x'"),
        ("torch.nn:Nope", None, "has no attribute 'Nope'"),
        ("torch.nn:Linear", "{bad", "--kwargs: not valid JSON"),
        ("torch.nn:Linear", "[1]", "expected a JSON object"),
        ("torch.nn:Linear", None, "building the model failed: TypeError"),
        ("tests.checks_models:inputs", '{"rank": 0}', "returned Tensor, not a torch.nn.Module"),
    ]:
        with pytest.raises(CkptfixError, match=match):
            build_model(spec, kwargs=kwargs)
