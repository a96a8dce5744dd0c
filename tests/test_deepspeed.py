"""DeepSpeed ZeRO run folders: consolidated as DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` does.

The fast tier reads real runs saved by DeepSpeed (fixtures/deepspeed/: ZeRO-1/2/3 × fp32/bf16 on 2 gloo ranks, a
frozen layer, a tied weight, two parameter groups; made by ``python -m tests.deepspeed_runs fixtures/deepspeed
--fixtures``) and compares with DeepSpeed's consolidation saved beside each (``*.expected.pt``), and with DeepSpeed
itself where it is installed. The slow tier trains fresh runs and compares with DeepSpeed live.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.formats.deepspeed import describe_run, layout_partitioned, layout_stage3
from tests.deepspeed_runs import RUNS

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"
NAMES = [f"zero{stage}_{dtype}" for stage, dtype in RUNS]


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def expected(name: str) -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / f"{name}.expected.pt", weights_only=True)  # type: ignore[no-any-return]


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key


def copy_run(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_load_equals_deepspeeds_consolidation(name: str) -> None:
    assert_same(ckptfix.load(FIXTURES / name), expected(name))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ext", ["safetensors", "pt"])
def test_convert_streams_deepspeeds_consolidation(name: str, ext: str, tmp_path: Path) -> None:
    out = tmp_path / f"model.{ext}"
    result = ckptfix.convert_file(FIXTURES / name, out)
    assert result.method == "stream"
    assert any("copied as byte ranges" in n for n in result.notes)
    assert_same(ckptfix.load(out), expected(name))
    if ext == "pt":  # tied names stay one tensor, as zero_to_fp32 returns them
        back = torch.load(out, weights_only=True)
        assert back["head.weight"].untyped_storage().data_ptr() == back["embed.weight"].untyped_storage().data_ptr()


def test_tag_folder_reads_as_the_run(tmp_path: Path) -> None:
    assert_same(ckptfix.load(FIXTURES / "zero3_bf16" / "global_step1"), expected("zero3_bf16"))


def test_matches_deepspeed_itself() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is an optional test dependency (pip install ckptfix[deepspeed])")
    from tests.deepspeed_runs import reference

    for name in NAMES:
        assert_same(ckptfix.load(FIXTURES / name), reference(FIXTURES / name))


def test_other_layouts_and_dtype_cast(tmp_path: Path) -> None:
    want = expected("zero2_bf16")
    assert run_cli("convert", str(FIXTURES / "zero2_bf16"), str(tmp_path / "dcp") + "/").exit_code == 0
    assert_same(ckptfix.load(tmp_path / "dcp"), want)
    result = run_cli("convert", str(FIXTURES / "zero2_bf16"), str(tmp_path / "half.safetensors"), "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    half = ckptfix.load(tmp_path / "half.safetensors")
    assert torch.equal(half["body.weight"], want["body.weight"].to(torch.bfloat16))
    assert half["steps"].dtype == torch.int64


def test_inspect_reads_no_tensor_bytes(tmp_path: Path) -> None:
    run = copy_run("zero3_bf16", tmp_path)
    plan = describe_run(str(run))
    piece = plan.state["body.weight"].pieces[-1]
    with open(piece.path, "r+b") as f:  # damage the fp32 partition's bytes: the pickles stay intact
        f.seek(piece.offset)
        flipped = bytes(b ^ 0xFF for b in f.read(piece.nbytes))
        f.seek(piece.offset)
        f.write(flipped)
    result = run_cli("inspect", str(run))
    assert result.exit_code == 0, result.output
    assert "ZeRO-3 on 2 ranks" in result.output and "trained in bfloat16" in result.output
    assert "rank 1's float32 master partition" in result.output
    info = run_cli("inspect", str(run), "--json")
    assert '"stage": 3' in info.output and '"world_size": 2' in info.output
    bad = run_cli("convert", str(run), str(tmp_path / "out.safetensors"))
    assert bad.exit_code == 2 and "CRC" in bad.output
    assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(FormatError, match="CRC"):
        ckptfix.load(run)


def test_lone_zero3_module_file_refused(tmp_path: Path) -> None:
    lone = FIXTURES / "zero3_fp32" / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    for args in (["--model-only"], ["--model-only", "--no-fast"], []):
        result = run_cli("convert", str(lone), str(tmp_path / "out.pt"), *args)
        assert result.exit_code == 2, result.output
        assert "placeholders" in result.output and str(FIXTURES / "zero3_fp32") in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(FormatError, match="placeholders"):
        ckptfix.load_into(nn.Linear(1, 1), lone)


def test_lone_zero2_module_file_says_training_dtype(tmp_path: Path) -> None:
    lone = FIXTURES / "zero2_bf16" / "global_step1" / "mp_rank_00_model_states.pt"
    result = run_cli("convert", str(lone), str(tmp_path / "out.pt"), "--model-only", "-v")
    assert result.exit_code == 0, result.output
    assert "training dtype" in result.output and "global_step1" in result.output
    assert ckptfix.load(tmp_path / "out.pt")["body.weight"].dtype == torch.bfloat16


def test_missing_rank_file_refused(tmp_path: Path) -> None:
    run = copy_run("zero3_fp32", tmp_path)
    (run / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = run_cli("convert", str(run), str(tmp_path / "out.safetensors"))
    assert result.exit_code == 2
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in result.output
    run2 = copy_run("zero3_bf16", tmp_path)
    (run2 / "global_step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    result = run_cli("inspect", str(run2))
    assert result.exit_code == 2 and "zero_pp_rank_1_mp_rank_00_model_states.pt: missing" in result.output


def test_mixed_runs_refused(tmp_path: Path) -> None:
    run = copy_run("zero3_fp32", tmp_path)
    other = FIXTURES / "zero2_fp32" / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(other, run / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    result = run_cli("convert", str(run), str(tmp_path / "out.safetensors"))
    assert result.exit_code == 2 and "mixes two runs" in result.output, result.output
    bf = copy_run("zero2_fp32", tmp_path)  # a bf16 run's optimizer file beside an fp32 one's, same rank
    shutil.copy(FIXTURES / "zero2_bf16" / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                bf / "global_step1")  # fmt: skip
    result = run_cli("inspect", str(bf))
    assert result.exit_code == 2 and "two optimizer files" in result.output


def test_latest_naming_a_missing_tag_refused(tmp_path: Path) -> None:
    run = copy_run("zero1_fp32", tmp_path)
    (run / "latest").write_text("global_step9")
    result = run_cli("inspect", str(run))
    assert result.exit_code == 2 and "global_step9" in result.output and "global_step1" in result.output


class Net(nn.Module):
    """The fixtures' model (tests/deepspeed_runs.py)."""

    def __init__(self, bf16: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 7)
        self.body = nn.Linear(7, 9)
        self.norm: nn.Module = nn.LayerNorm(9) if bf16 else nn.BatchNorm1d(9)
        self.frozen = nn.Linear(9, 7)
        self.head = nn.Linear(7, 17, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_load_into_and_check() -> None:
    model = Net(bf16=False)
    report = ckptfix.load_into(model, FIXTURES / "zero2_fp32")
    assert not report.missing and not report.unexpected
    want = expected("zero2_fp32")
    assert torch.equal(model.body.weight.detach(), want["body.weight"])
    assert torch.equal(model.norm.running_mean, want["norm.running_mean"])  # type: ignore[arg-type]
    assert ckptfix.check(FIXTURES / "zero3_fp32", Net(bf16=False)).missing == []


def test_load_for_ddp(gloo_world: None) -> None:
    from ckptfix.distributed import load_for_ddp

    model = Net(bf16=False)
    load_for_ddp(model, FIXTURES / "zero3_fp32")
    assert torch.equal(model.frozen.weight.detach(), expected("zero3_fp32")["frozen.weight"])


def test_diff_folder_and_its_consolidation(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", str(FIXTURES / "zero1_bf16"), str(out)).exit_code == 0
    result = run_cli("diff", str(FIXTURES / "zero1_bf16"), str(out))
    assert result.exit_code == 0 and "equal" in result.output, result.output


def test_layout_partitioned_unequal_partitions() -> None:
    # rank 0 holds 4 elements, rank 1 holds 3 (its padding cut): a [5] and a [2] parameter
    layout = layout_partitioned([[("a", (5,)), ("b", (2,))]], [[4], [3]], source="x")
    assert layout == {"a": [(0, 0, 0, 4), (1, 0, 0, 1)], "b": [(1, 0, 1, 2)]}
    with pytest.raises(FormatError, match="different runs"):
        layout_partitioned([[("a", (9,))]], [[4], [3]], source="x")


def test_layout_stage3_crosses_groups() -> None:
    # world 2: 'a' (3 elements) takes 2 per rank (the last padded), 'b' (4) takes 2; rank groups of 3 and 1
    layout = layout_stage3([("a", (3,)), ("b", (2, 2))], [[3, 1], [3, 1]], source="x")
    assert layout["a"] == [(0, 0, 0, 2), (1, 0, 0, 1)]
    assert layout["b"] == [(0, 0, 2, 1), (0, 1, 0, 1), (1, 0, 2, 1), (1, 1, 0, 1)]
    with pytest.raises(FormatError, match="different runs"):
        layout_stage3([("a", (3,))], [[3, 1], [3, 1]], source="x")


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "dtype"), RUNS)
def test_fresh_run_matches_deepspeed(stage: int, dtype: str, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is an optional test dependency (pip install ckptfix[deepspeed])")
    from tests.deepspeed_runs import make_run, reference

    run = make_run(tmp_path / "run", stage=stage, dtype=dtype)
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", str(run), str(out)).exit_code == 0
    want = reference(run)
    assert_same(ckptfix.load(out), want)
    assert_same(ckptfix.load(run), want)
