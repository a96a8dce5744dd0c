"""ckptfix.merge on per-rank checkpoints of a 2-rank DDP run with buffer sync off (a real gloo run checks them)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import MergeError
from ckptfix.loading.model import load_into
from ckptfix.merging.files import plan_merge
from tests import models
from tests.dtype_files import MATH_BITS
from tests.models import SmallNet

BN = ["features.1.", "features.4."]


@pytest.fixture
def ranks(rank_files: list[Path]) -> list[Any]:
    return [ckptfix.load(f) for f in rank_files]


def _bare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in state.items()}


def test_fixture_really_has_per_rank_statistics(ranks: list[Any]) -> None:
    a, b = _bare(ranks[0]["model"]), _bare(ranks[1]["model"])
    for prefix in BN:
        assert not torch.equal(a[prefix + "running_mean"], b[prefix + "running_mean"])
    assert torch.equal(a["head.weight"], b["head.weight"])


@pytest.mark.slow
def test_rank_files_are_bitwise_what_a_real_gloo_ddp_run_saves(ranks: list[Any], tmp_path: Path) -> None:
    real = [ckptfix.load(f) for f in models.ddp_rank_files(tmp_path)]
    for ours, theirs in zip(ranks, real, strict=True):
        assert list(ours) == list(theirs) and list(ours["model"]) == list(theirs["model"])
        for key, value in theirs["model"].items():
            assert torch.equal(ours["model"][key], value), key
        assert ours["model"]._metadata == theirs["model"]._metadata
        assert {k: v for k, v in ours.items() if k != "model"} == {k: v for k, v in theirs.items() if k != "model"}


@pytest.mark.parametrize("strategy", ["pooled", "mean", "rank0"])
def test_merged_statistics_follow_the_formulas(ranks: list[Any], strategy: str) -> None:
    merged = ckptfix.merge(ranks, buffers=strategy)
    states = [_bare(r["model"]) for r in ranks]
    out = merged["model"]
    for prefix in BN:
        m = torch.stack([s[prefix + "running_mean"].double() for s in states])
        v = torch.stack([s[prefix + "running_var"].double() for s in states])
        mean = (m[0] + m[1]) / 2
        if strategy == "pooled":
            var = (v[0] + v[1]) / 2 + ((m[0] - mean) ** 2 + (m[1] - mean) ** 2) / 2
        elif strategy == "mean":
            var = (v[0] + v[1]) / 2
        else:
            mean, var = m[0], v[0]
        assert out[prefix + "running_mean"].dtype == torch.float32
        torch.testing.assert_close(out[prefix + "running_mean"], mean.float(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out[prefix + "running_var"], var.float(), rtol=1e-6, atol=1e-7)
        assert torch.equal(out[prefix + "num_batches_tracked"], states[0][prefix + "num_batches_tracked"])
    if strategy == "pooled":  # the spread of the shard means is real here, so pooled differs from mean
        assert not torch.allclose(out["features.1.running_var"], ((v[0] + v[1]) / 2).float())


def test_parameters_are_bit_identical_to_rank0_and_the_result_loads(ranks: list[Any]) -> None:
    merged = ckptfix.merge(ranks)
    rank0 = _bare(ranks[0]["model"])
    assert set(merged["model"]) == set(rank0)
    for key in ["features.0.weight", "features.1.weight", "head.bias"]:
        assert torch.equal(merged["model"][key], rank0[key])
    assert merged["epoch"] == ranks[0]["epoch"] and merged["rank"] == 0  # non-model entries from rank 0
    model = SmallNet()
    report = load_into(model, merged)
    assert report.ok and report.layout_from == "single"
    assert torch.equal(model.features[4].running_mean, merged["model"]["features.4.running_mean"])


def test_mixed_layouts_and_formats(ranks: list[Any], tmp_path: Path) -> None:
    st = tmp_path / "rank1.safetensors"
    ckptfix.save(ckptfix.convert(ranks[1]["model"], to="compiled"), st)
    merged = ckptfix.merge([ranks[0], ckptfix.load(st)], to="ddp")
    reference = ckptfix.merge(ranks, to="ddp")
    assert list(merged["model"]) == list(reference["model"])
    assert all(k.startswith("module.") for k in merged["model"])
    for key, value in reference["model"].items():
        assert torch.equal(merged["model"][key], value), key


def test_tampered_rank_is_refused_with_a_per_key_report(ranks: list[Any]) -> None:
    tampered = dict(ranks[1])
    tampered["model"] = dict(ranks[1]["model"])
    tampered["model"]["module.head.weight"] = ranks[1]["model"]["module.head.weight"] + 0.5
    result = plan_merge([ranks[0], tampered], names=["r0.pt", "r1.pt"])
    assert result.obj is None
    assert [(d.key, d.ranks) for d in result.diverged] == [("head.weight", ["r1.pt"])]
    assert result.diverged[0].max_abs == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(MergeError, match=r"'head\.weight'.*max \|Δ\| 0\.5 on rank1"):
        ckptfix.merge([ranks[0], tampered])
    assert (
        ckptfix.merge([ranks[0], tampered], atol=0.6)["model"]["head.weight"] is ranks[0]["model"]["module.head.weight"]
    )


def test_num_batches_tracked_differs_keeps_the_maximum_with_a_warning(ranks: list[Any]) -> None:
    other = {**ranks[1]["model"], "module.features.1.num_batches_tracked": torch.tensor(7)}
    with pytest.warns(UserWarning, match=r"num_batches_tracked differs .* 'features\.1\.num_batches_tracked'"):
        merged = ckptfix.merge([ranks[0]["model"], other])
    assert merged["features.1.num_batches_tracked"].item() == 7
    assert merged["features.1.num_batches_tracked"].dtype == torch.int64


def test_duplicate_rank_and_lone_input_warn(ranks: list[Any]) -> None:
    result = plan_merge([ranks[0], ranks[1], ranks[0]], names=["a", "b", "c"])
    assert result.warnings == [
        "c is identical to a (the same file twice, or buffers were synced); it adds nothing to the merge"
    ]
    lone = plan_merge([ranks[0]])
    assert lone.warnings[0].startswith("only one input (rank0): nothing to merge")
    assert torch.equal(lone.obj["model"]["features.1.running_var"], ranks[0]["model"]["module.features.1.running_var"])
    assert lone.kept_from_first == ["epoch", "optimizer", "rank"]


def test_other_buffers_follow_the_strategy_only_when_named() -> None:
    a = {"w": torch.ones(2), "ema": torch.tensor([1.0, 3.0]), "steps": torch.tensor([1])}
    b = {"w": torch.ones(2), "ema": torch.tensor([3.0, 5.0]), "steps": torch.tensor([2])}
    with pytest.raises(MergeError, match="'ema'"):
        ckptfix.merge([a, b])
    merged = ckptfix.merge([a, b], buffer_keys=["ema"], atol=1)  # steps differ by 1: within atol
    assert torch.equal(merged["ema"], torch.tensor([2.0, 4.0]))
    assert ckptfix.merge([a, b], buffer_keys=["ema"], buffers="rank0", atol=1)["ema"] is a["ema"]
    result = plan_merge([a, b], buffer_keys=["ema", "steps"])
    assert [d.key for d in result.diverged] == ["steps"]  # integer buffers are never averaged


def test_nonfinite_values_compare_by_position() -> None:
    a = {"w": torch.tensor([float("inf"), float("nan"), 1.0])}
    b = {"w": torch.tensor([float("inf"), float("nan"), 1.25])}
    assert ckptfix.merge([a, b], atol=0.5)["w"] is a["w"]
    assert [(d.key, d.max_abs) for d in plan_merge([a, b]).diverged] == [("w", 0.25)]
    c = {"w": torch.tensor([1.0, float("nan"), 1.0])}
    assert [(d.key, d.max_abs) for d in plan_merge([a, c], atol=10).diverged] == [("w", float("inf"))]


def test_inputs_that_cannot_be_merged() -> None:
    a = {"w": torch.ones(2)}
    with pytest.raises(MergeError, match=r"rank1: keys differ from rank0"):
        ckptfix.merge([a, {"v": torch.ones(2)}])
    with pytest.raises(MergeError, match=r"rank1: 'w' is \[3\]"):
        ckptfix.merge([a, {"w": torch.ones(3)}])
    with pytest.raises(ckptfix.UsageError, match="buffers='median': unknown buffer strategy; choose one of pooled"):
        ckptfix.merge([a, a], buffers="median")


def test_merge_reads_each_ddp_file_s_pickle_once(tmp_path: Path, pickle_reads: Counter[str]) -> None:
    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    ranks = [str(fixtures / "ddp_rank0.pt"), str(fixtures / "ddp_rank1.pt")]
    ckptfix.merging.files.merge_files(ranks, tmp_path / "m.pt")
    assert pickle_reads == {path: 1 for path in ranks}


# diff and merge compare what torch.load gives, never a cheaper stand-in: a neg or conj view's bytes are not its
# values; a byte-order record torch finds (its lookup ignores case) swaps every storage; integers are compared as
# integers, never after a cast to float64.


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


@pytest.mark.parametrize("bit", list(MATH_BITS))
def test_merge_does_not_call_a_math_bit_view_equal(bit: str, tmp_path: Path) -> None:
    base, view = MATH_BITS[bit]
    plain = _save(tmp_path / "plain.pt", {"w": base})
    bits = _save(tmp_path / "bits.pt", {"w": view(base)})
    out = tmp_path / "merged.pt"
    result = run("merge", plain, bits, "-o", out, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["parameters_match"] is False and not out.exists()
    assert [d["key"] for d in report["diverged"]] == ["w"]
