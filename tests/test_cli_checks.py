"""``ckptfix merge``, ``validate`` and ``diff`` through the real click group, on real per-rank DDP files."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from tests.checks_models import ScaledHead, SmallCNN, ddp_rank_files

MODEL = "tests.checks_models:SmallCNN"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def rank_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return ddp_rank_files(tmp_path_factory.getbasetemp())


def test_merge_writes_the_merged_checkpoint(rank_files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged.pt"
    result = run("merge", *rank_files, "-o", out)
    assert result.exit_code == 0, result.output
    assert "BatchNorm statistics (pooled): 2 module(s): features.{1,4}" in result.stdout
    assert f"taken from {rank_files[0]}: epoch, optimizer, rank" in result.stdout
    merged = ckptfix.load(out)
    expected = ckptfix.merge([ckptfix.load(f) for f in rank_files])
    assert list(merged["model"]) == list(expected["model"])
    for key, value in expected["model"].items():
        assert torch.equal(merged["model"][key], value), key
    model = SmallCNN()
    assert ckptfix.load_into(model, out).loads_as_is
    model.eval()
    assert torch.equal(model.features[1].running_var, expected["model"]["features.1.running_var"])


def test_merge_to_safetensors_and_ddp_layout_with_json(rank_files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged.safetensors"
    result = run("merge", *rank_files, "-o", out, "--to", "ddp", "--buffers", "mean", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["written"] is True and report["bn_modules"] == ["features.1", "features.4"]
    assert report["layouts_from"] == ["ddp", "ddp"] and report["diverged"] == []
    assert all(k.startswith("module.") for k in ckptfix.load(out)["model"])


def test_merge_refuses_a_tampered_rank_and_writes_nothing(rank_files: list[Path], tmp_path: Path) -> None:
    ckpt = ckptfix.load(rank_files[1])
    ckpt["model"] = dict(ckpt["model"])
    ckpt["model"]["module.features.3.weight"] = ckpt["model"]["module.features.3.weight"] * 1.5
    tampered = tmp_path / "rank1_tampered.pt"
    ckptfix.save(ckpt, tampered)
    out = tmp_path / "merged.pt"
    result = run("merge", rank_files[0], tampered, "-o", out)
    assert result.exit_code == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [tampered]
    assert "1 key(s) differ across ranks (atol 0):" in result.stdout
    assert "  features.3.weight  max |Δ| " in result.stdout and f"on {tampered} (vs {rank_files[0]})" in result.stdout
    assert result.stderr.startswith(f"ckptfix: error: {out}: not written: 1 key(s) differ")
    assert run("merge", rank_files[0], tampered, "-o", out, "--atol", "10").exit_code == 0


def test_merge_warns_for_a_duplicated_rank_and_refuses_out_as_input(rank_files: list[Path], tmp_path: Path) -> None:
    result = run("merge", rank_files[0], rank_files[0], "-o", tmp_path / "m.pt")
    assert result.exit_code == 0
    assert "is given twice" in result.stderr and "is identical to" in result.stderr
    result = run("merge", rank_files[0], "-o", tmp_path / "lone.pt")
    assert result.exit_code == 0 and "only one input" in result.stderr
    result = run("merge", rank_files[0], rank_files[1], "-o", rank_files[1])
    assert result.exit_code == 2 and "is the input file" in result.stderr


def test_merge_with_model_averages_other_float_buffers(tmp_path: Path) -> None:
    files = []
    for rank in range(2):
        state = torch.nn.DataParallel(ScaledHead()).state_dict()
        state["module.module.scale"] = torch.full((2,), 1.0 + 2 * rank)
        files.append(tmp_path / f"rank{rank}.pt")
        ckptfix.save({"model": state}, files[-1])
    out = tmp_path / "merged.pt"
    refused = run("merge", *files, "-o", out)
    assert refused.exit_code == 1 and "  module.scale  max |Δ| 2" in refused.stdout and not out.exists()
    result = run("merge", *files, "-o", out, "--model", "tests.checks_models:ScaledHead")
    assert result.exit_code == 0, result.output
    assert "other buffers (pooled): module.scale" in result.stdout
    merged = ckptfix.load(out)["model"]
    assert torch.equal(merged["module.scale"], torch.full((2,), 2.0))
    assert ckptfix.check(merged, ScaledHead()).ok


@pytest.mark.parametrize("which", [0, 1])
def test_validate_rank_files_prints_the_fix_and_the_fix_works(
    rank_files: list[Path], tmp_path: Path, which: int
) -> None:
    result = run("validate", rank_files[which], "--model", MODEL)
    assert result.exit_code == 1, result.output
    assert "layout only: the checkpoint is ddp, the model single" in result.stdout
    fix = result.stdout.splitlines()[-1].strip()
    out = tmp_path / "fixed.pt"
    assert fix == f"ckptfix convert {rank_files[which]} {str(rank_files[which])[:-3]}.single.pt --to single"
    words = shlex.split(fix)
    assert run("convert", words[2], out, *words[4:]).exit_code == 0
    ok = run("validate", out, "--model", MODEL)
    assert ok.exit_code == 0 and ok.stdout.endswith("OK: loads with load_state_dict(strict=True)\n")
    assert run("validate", rank_files[which], "--model", MODEL, "--any-layout").exit_code == 0


def test_validate_renamed_model_pairs_and_rule(rank_files: list[Path], tmp_path: Path) -> None:
    result = run("validate", rank_files[0], "--model", "tests.checks_models:RenamedCNN")
    assert result.exit_code == 1
    assert "missing from the checkpoint (14):" in result.stdout
    assert "  features.0.weight -> backbone.0.weight" in result.stdout
    out = tmp_path / "fixed.pt"
    words = shlex.split(result.stdout.splitlines()[-1])
    assert words[:2] == ["ckptfix", "convert"] and "--rename" in words
    assert run("convert", words[2], out, *words[4:]).exit_code == 0
    assert run("validate", out, "--model", "tests.checks_models:RenamedCNN").exit_code == 0


def test_validate_wrong_shape_and_json(rank_files: list[Path]) -> None:
    result = run("validate", rank_files[0], "--model", "tests.checks_models:small_cnn", "--kwargs", '{"classes": 5}')
    assert result.exit_code == 1
    assert "wrong shape, checkpoint [3, 4] vs model [5, 4] (1):\n  head.weight" in result.stdout
    assert "FAIL: would not load with strict=True: 2 wrong shape" in result.stdout
    result = run("validate", rank_files[0], "--model", "tests.checks_models:wrong_head", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["exit_code"] == 1 and report["fix_command"] is None
    assert report["wrong_shape"]["head.bias"] == {"checkpoint": [3], "model": [5]}
    assert report["entry"] == "model" and report["layout_from"] == "ddp"


def test_validate_cannot_run_exits_2(rank_files: list[Path], tmp_path: Path) -> None:
    result = run("validate", rank_files[0], "--model", "tests.checks_models:Nope")
    assert result.exit_code == 2 and "has no attribute 'Nope'" in result.stderr
    result = run("validate", tmp_path / "missing.pt", "--model", MODEL)
    assert result.exit_code == 2 and "Traceback" not in result.output
    linear = tmp_path / "linear.pt"
    ckptfix.save(torch.nn.Linear(2, 3).state_dict(), linear)
    args = ["--model", "torch.nn:Linear", "--kwargs", '{"in_features": 2, "out_features": 3}']
    assert run("validate", linear, *args).exit_code == 0
    no_model = tmp_path / "epoch.pt"
    torch.save({"epoch": 1}, no_model)
    result = run("validate", no_model, "--model", MODEL)
    assert result.exit_code == 2 and "holds no model state dict" in result.stderr
    result = run("validate", rank_files[0], "--model", MODEL, "--entry", "optimizer")
    assert result.exit_code == 2 and "no model state dict under 'optimizer' (model entries: 'model')" in result.stderr


def test_diff_identical_layout_only_and_different(rank_files: list[Path], tmp_path: Path) -> None:
    assert run("diff", rank_files[0], rank_files[0]).exit_code == 0
    single = tmp_path / "rank0.safetensors"
    ckpt = ckptfix.load(rank_files[0])
    ckptfix.save(ckptfix.convert(ckpt["model"], to="single"), single)
    result = run("diff", rank_files[0], single)
    # the safetensors file holds the model only, so epoch/optimizer/rank exist only in A
    assert "layouts differ (ddp vs single): compared after converting both to single" in result.stdout
    assert "values differ" not in result.stdout and "other entries differ (3):" in result.stdout
    same = tmp_path / "rank0_single.pt"
    ckptfix.save({**ckpt, "model": ckptfix.convert(ckpt["model"], to="single")}, same)
    result = run("diff", rank_files[0], same)
    assert result.exit_code == 0 and result.stdout.endswith("equal\n")
    result = run("diff", rank_files[0], rank_files[1])
    assert result.exit_code == 1 and "values differ (4 of 16 tensors, atol 0, rtol 0):" in result.stdout
    assert "  rank: 0 -> 1" in result.stdout


def test_diff_json(rank_files: list[Path]) -> None:
    result = run("diff", rank_files[0], rank_files[1], "--json", "--atol", "1e-12")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["equal"] is False and report["exit_code"] == 1
    entry = report["entries"][0]
    assert sorted(v["key"] for v in entry["values"]) == [
        f"features.{i}.running_{s}" for i in (1, 4) for s in ("mean", "var")
    ]
    assert all(v["max_abs"] > 0 for v in entry["values"])
    assert report["other"] == [{"path": "rank", "a": "0", "b": "1"}]


# The trainer's real fixtures (python -m ckptfix.trainer.fixtures), when present.
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TRAINER = "ckptfix.trainer.model:build_model"


def _manifest() -> dict[str, dict[str, object]]:
    path = FIXTURES / "MANIFEST.json"
    return json.loads(path.read_text())["files"] if path.exists() else {}  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(_manifest()))
def test_validate_every_fixture_against_the_reference_model(name: str) -> None:
    layout = _manifest()[name]["layout"]
    result = run("validate", FIXTURES / name, "--model", TRAINER, "--allow-global", "argparse.Namespace", "--json")
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["layout_from"] == layout
    if layout == "single":
        assert result.exit_code == 0 and report["fix_command"] is None
    else:
        stem, ext = name.rsplit(".", 1)
        assert result.exit_code == 1
        # the fix command repeats the --allow-global the check itself needed
        assert report["fix_command"] == (
            f"ckptfix convert {FIXTURES / name} {FIXTURES / stem}.single.{ext} --to single "
            "--allow-global argparse.Namespace"
        )


@pytest.mark.skipif(not (FIXTURES / "ddp_rank1.pt").exists(), reason="trainer fixtures not generated")
def test_merge_the_trainer_per_rank_fixtures(tmp_path: Path) -> None:
    files = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    out = tmp_path / "merged.safetensors"
    assert run("merge", *files, "-o", out).exit_code == 0
    ranks = [{k.removeprefix("module."): v for k, v in ckptfix.load(f)["model"].items()} for f in files]
    merged = ckptfix.load(out)  # model only: safetensors keeps the simple entries as metadata
    merged = merged.get("model", merged)
    bn = sorted({k.rsplit(".", 1)[0] for k in ranks[0] if k.endswith("running_mean")})
    assert bn and not torch.equal(ranks[0][f"{bn[0]}.running_mean"], ranks[1][f"{bn[0]}.running_mean"])
    for key, value in ranks[0].items():
        module, _, leaf = key.rpartition(".")
        if module in bn and leaf in ("running_mean", "running_var"):
            m0, m1 = (r[f"{module}.running_mean"].double() for r in ranks)
            v0, v1 = (r[f"{module}.running_var"].double() for r in ranks)
            mean = (m0 + m1) / 2
            want = mean if leaf == "running_mean" else (v0 + v1) / 2 + ((m0 - mean) ** 2 + (m1 - mean) ** 2) / 2
            torch.testing.assert_close(merged[key], want.to(value.dtype), rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(merged[key], value), key
    result = run("validate", out, "--model", TRAINER)
    assert result.exit_code == 0, result.output
