"""ckptfix.transforms.renames: likely renames between missing and unexpected keys, and the --rename rule that fixes
them."""

from __future__ import annotations

import pytest
from torch import nn

import ckptfix
from ckptfix.errors import MismatchError
from ckptfix.loading.model import adapt_to_model
from ckptfix.transforms.renames import likely_renames, prefix_fits
from tests.models import KEYS, RenamedNet, SmallNet


def test_renamed_module_is_paired_and_a_rename_rule_is_offered() -> None:
    state = nn.DataParallel(SmallNet()).state_dict()
    _, report = adapt_to_model(state, RenamedNet(), source="c.pt")
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
    state = SmallNet().state_dict() if kind == "single" else nn.DataParallel(SmallNet()).state_dict()
    _, report = adapt_to_model(state, RenamedNet())
    assert report.rename_rules
    fixed = ckptfix.convert(state, to="single", renames=report.rename_rules)
    assert ckptfix.check(fixed, RenamedNet()).loads_as_is


def test_likely_renames_refuses_ambiguous_pairs() -> None:
    shapes = {"a.w": (2,), "b.w": (2,), "x.w": (2,)}
    assert likely_renames(["x.w"], ["a.w", "b.w"], shapes) == []  # two equally good matches
    shapes = {"enc.0.w": (2,), "dec.0.w": (3,), "encoder.0.w": (2,), "decoder.0.w": (3,)}
    assert likely_renames(["encoder.0.w", "decoder.0.w"], ["enc.0.w", "dec.0.w"], shapes) == [
        ("enc.0.w", "encoder.0.w"),
        ("dec.0.w", "decoder.0.w"),
    ]


def test_prefix_fits_finds_the_prefix_to_strip_or_to_add() -> None:
    inner = ["fc.weight", "fc.bias", "bn.running_mean"]
    lightning = [f"model.{k}" for k in inner]
    assert prefix_fits(lightning, inner) == [("model.", "")]
    assert prefix_fits(inner, lightning) == [("", "model.")]
    assert prefix_fits([f"a.b.{k}" for k in inner], inner) == [("a.b.", "")]
    assert prefix_fits(inner, inner) == []  # nothing to change


def test_prefix_fits_only_when_every_key_fits_exactly() -> None:
    inner = ["fc.weight", "fc.bias"]
    assert prefix_fits(["model.fc.weight", "model.fc.bias", "criterion.weight"], inner) == []  # an extra key
    assert prefix_fits(["model.fc.weight"], inner) == []  # a key short
    assert prefix_fits(["model.fc.weight"], inner, may_lack=["fc.bias"]) == [("model.", "")]  # unless it may be
    assert prefix_fits(["model.fc.weight", "net.fc.bias"], inner) == []  # two prefixes: not one rule


def test_prefix_fits_reports_every_candidate_so_none_is_guessed() -> None:
    # A model whose root weight is also its submodule 'a''s weight: 'm.' and 'm.a.' both fit.
    model = ["weight", "a.weight"]
    assert prefix_fits(["m.a.weight"], model, may_lack=model) == [("m.", ""), ("m.a.", "")]
