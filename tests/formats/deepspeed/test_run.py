"""DeepSpeed ZeRO run folders: consolidated as DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` does.

The fast tier reads real runs saved by DeepSpeed (fixtures/deepspeed/: ZeRO-1/2/3 × fp32/bf16/fp16 on 2 gloo
ranks, a frozen layer, a tied weight, two parameter groups; made by ``python -m tests.deepspeed_runs
fixtures/deepspeed --fixtures``, recorded in its MANIFEST.json) and compares with DeepSpeed's consolidation saved
beside each (``*.expected.pt``), and with DeepSpeed itself where it is installed. The slow tier trains fresh runs
and compares with DeepSpeed live.
"""

from __future__ import annotations

import os
import pickle
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import FormatError
from ckptfix.formats.deepspeed.layout import layout_partitioned, layout_stage3
from ckptfix.formats.deepspeed.run import describe_run
from tests.deepspeed_files import FIXTURES, Stub, copy_run, edit_rank_file, expected, refusal, run_cli
from tests.deepspeed_runs import RUNS
from tests.extras import DEEPSPEED, needs

NAMES = [f"zero{stage}_{dtype}" for stage, dtype in RUNS]
TRAIN_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def half(name: str) -> bool:
    """A mixed-precision run (LayerNorm, no BatchNorm: tests/deepspeed_runs.py)."""
    return not name.endswith("_fp32")


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key


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
    pytest.importorskip("deepspeed", reason=needs("deepspeed", DEEPSPEED))
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
    for stage in (2, 3):  # an fp16 run's rank file, named as an fp32 run's and of the same sizes, in an fp32 run
        fp = copy_run(f"zero{stage}_fp32", tmp_path / str(stage))
        name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shutil.copy(FIXTURES / f"zero{stage}_fp16" / "global_step1" / name, fp / "global_step1" / name)
        result = run_cli("convert", str(fp), str(tmp_path / "out.safetensors"))
        assert result.exit_code == 2 and "dynamic_loss_scale True, but" in result.output, result.output
        assert "mixes two runs" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_latest_naming_a_missing_tag_refused(tmp_path: Path) -> None:
    run = copy_run("zero1_fp32", tmp_path)
    (run / "latest").write_text("global_step9")
    result = run_cli("inspect", str(run))
    assert result.exit_code == 2 and "global_step9" in result.output and "global_step1" in result.output


class Net(nn.Module):
    """The fixtures' model (tests/deepspeed_runs.py)."""

    def __init__(self, half: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 7)
        self.body = nn.Linear(7, 9)
        self.norm: nn.Module = nn.LayerNorm(9) if half else nn.BatchNorm1d(9)
        self.frozen = nn.Linear(9, 7)
        self.head = nn.Linear(7, 17, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_load_into_and_check() -> None:
    model = Net(half=False)
    report = ckptfix.load_into(model, FIXTURES / "zero2_fp32")
    assert not report.missing and not report.unexpected
    want = expected("zero2_fp32")
    assert torch.equal(model.body.weight.detach(), want["body.weight"])
    assert torch.equal(model.norm.running_mean, want["norm.running_mean"])  # type: ignore[arg-type]
    assert ckptfix.check(FIXTURES / "zero3_fp32", Net(half=False)).missing == []


def test_load_for_ddp(gloo_world: None) -> None:
    from ckptfix.distributed import load_for_ddp

    model = Net(half=False)
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
    pytest.importorskip("deepspeed", reason=needs("deepspeed", DEEPSPEED))
    from tests.deepspeed_runs import make_run, reference

    run = make_run(tmp_path / "run", stage=stage, dtype=dtype)
    out = tmp_path / "model.safetensors"
    assert run_cli("convert", str(run), str(out)).exit_code == 0
    want = reference(run)
    assert_same(ckptfix.load(out), want)
    assert_same(ckptfix.load(run), want)


# -- the optimizer state (convert --optimizer) --------------------------------------------------------------


class _WithoutDeepSpeed(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            return type(name, (Stub,), {})
        return super().find_class(module, name)


def _unpickled(path: Path) -> Any:
    """A fixture rank file in full (the project's own file: safe to unpickle), DeepSpeed's classes as stubs."""
    module = types.SimpleNamespace(Unpickler=_WithoutDeepSpeed, load=pickle.load, __name__="pickle")
    return torch.load(path, weights_only=False, pickle_module=module)


def optimizer_truth(name: str) -> dict[str, Any]:
    """The consolidated optimizer state computed here from the raw rank files, apart from ckptfix's layout code:
    each rank's flat moments joined (ZeRO-1/2) or sliced per parameter (ZeRO-3), padding cut, split by shapes."""
    import math

    tag = FIXTURES / name / "global_step1"
    optim = sorted(tag.glob("*optim_states.pt"), key=lambda p: int(p.name.split("rank_")[1].split("_")[0]))
    ranks = [_unpickled(p)["optimizer_state_dict"] for p in optim]
    module = next(tag.glob("*model_states.pt"))
    shapes = _unpickled(module)["param_shapes"]
    stage3 = "fp32_flat_groups" in ranks[0]
    base = [r["optimizer_state_dict" if stage3 else "base_optimizer_state"] for r in ranks]
    world = len(ranks)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    if stage3:
        flat = {k: [torch.cat([b["state"][g][k] for g in range(len(shapes))]) for b in base]
                for k in ("exp_avg", "exp_avg_sq")}  # fmt: skip
        offset = 0
    for pg in base[0]["param_groups"]:
        ids, names = [], []
        for g in pg["params"]:
            names += list(shapes[g])  # the run's names, in the flat order
            if not stage3:
                full = {k: torch.cat([b["state"][g][k] for b in base]) for k in ("exp_avg", "exp_avg_sq")}
                offset = 0
            for shape in shapes[g].values():
                numel = math.prod(shape)
                entry: dict[str, Any] = {"step": base[0]["state"][g]["step"]}
                for k in ("exp_avg", "exp_avg_sq"):
                    if stage3:
                        part = math.ceil(numel / world)
                        entry[k] = torch.cat([f[offset : offset + part] for f in flat[k]])[:numel].reshape(shape)
                    else:
                        entry[k] = full[k][offset : offset + numel].reshape(shape)
                offset += math.ceil(numel / world) if stage3 else numel
                state[index] = entry
                ids.append(index)
                index += 1
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": ids, "param_names": names})
    return {"state": state, "param_groups": groups}


def assert_same_optimizer(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == {"state", "param_groups"}
    assert got["param_groups"] == want["param_groups"]
    assert set(got["state"]) == set(want["state"])
    for i, s in want["state"].items():
        assert set(got["state"][i]) == set(s), i
        for k, t in s.items():
            assert got["state"][i][k].dtype == t.dtype and torch.equal(got["state"][i][k], t), (i, k)


# DeepSpeed's DynamicLossScaler after the fixtures' one fp16 step (initial_scale_power 4, see tests/deepspeed_runs.py)
FP16_SCALER = {"cur_scale": 16, "dynamic": True, "cur_iter": 1, "last_overflow_iter": -1, "scale_factor": 2.0,
               "scale_window": 1000, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 2,
               "consecutive_hysteresis": False, "raise_error_at_min_scale": True}  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_convert_optimizer_consolidates_the_moments(name: str, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    result = ckptfix.convert_file(FIXTURES / name, out, optimizer=True)
    assert result.method == "stream"
    back = torch.load(out, weights_only=True)
    # beside them the engine's counters (one step of 2 ranks x 2 samples), and an fp16 run's loss scaler
    progress = {"skipped_steps": 0, "global_steps": 1, "global_samples": 4}
    assert {k: v for k, v in back.items() if k not in ("model", "optimizer")} == progress | (
        {"loss_scaler": FP16_SCALER} if name.endswith("fp16") else {}
    )
    assert_same(back["model"], expected(name))
    assert_same_optimizer(back["optimizer"], optimizer_truth(name))
    steps = [s["step"] for s in back["optimizer"]["state"].values()]  # one tensor each: AdamW adds to it in place
    assert len({t.untyped_storage().data_ptr() for t in steps}) == len(steps)
    slow = tmp_path / "slow.pt"  # the torch path writes the same
    result = run_cli("convert", str(FIXTURES / name), str(slow), "--optimizer", "--no-fast")
    assert result.exit_code == 0, result.output
    again = torch.load(slow, weights_only=True)
    assert {k: v for k, v in again.items() if k not in ("model", "optimizer")} == {
        k: v for k, v in back.items() if k not in ("model", "optimizer")
    }
    assert_same(again["model"], back["model"])
    assert_same_optimizer(again["optimizer"], back["optimizer"])


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_loads_into_torch_adamw(name: str, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    assert run_cli("convert", str(FIXTURES / name), str(out), "--optimizer").exit_code == 0
    back = torch.load(out, weights_only=True)
    model = Net(half=half(name))  # the groups tests/deepspeed_runs.py trains with
    model.frozen.requires_grad_(False)
    decay = [model.embed.weight, model.body.weight]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and n not in ("embed.weight", "body.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=0.05)
    model.load_state_dict(back["model"], strict=False)
    opt.load_state_dict(back["optimizer"])
    assert opt.state_dict()["param_groups"] == back["optimizer"]["param_groups"]
    assert torch.equal(opt.state[model.body.weight]["exp_avg"], back["optimizer"]["state"][1]["exp_avg"])
    loss = sum((p.float() ** 2).sum() for p in model.parameters() if p.requires_grad)
    loss.backward()  # type: ignore[union-attr]
    opt.step()
    assert all(float(s["step"]) == 2.0 for s in opt.state.values())


def test_optimizer_usage_errors(tmp_path: Path) -> None:
    run = str(FIXTURES / "zero1_fp32")
    cases = [
        ([run, str(tmp_path / "out.safetensors"), "--optimizer"], (".safetensors", "--optimizer")),
        ([run, str(tmp_path / "out.pt"), "--optimizer", "--model-only"], ("--model-only", "--optimizer")),
        ([str(FIXTURES / "zero1_fp32.expected.pt"), str(tmp_path / "out.pt"), "--optimizer"],
         ("--optimizer", "DeepSpeed ZeRO run")),
    ]  # fmt: skip
    for args, words in cases:
        result = run_cli("convert", *args)
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1 and all(w in result.output for w in words), result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_moments_reproduce_the_saved_step(name: str) -> None:
    """A check apart from any layout: the fixtures trained one AdamW step from the seed-0 model, so the consolidated
    moments, applied to the initial weights, give the saved fp32 master weights, element for element."""
    from ckptfix.formats.deepspeed.run import load_training_state

    torch.manual_seed(0)  # as tests/deepspeed_runs.py builds the model
    model = Net(half=half(name))
    if half(name):  # DeepSpeed's fp32 master copy of the half-precision module
        model = model.to(TRAIN_DTYPE[name.split("_")[1]]).float()
    saved, opt = ckptfix.load(FIXTURES / name), load_training_state(str(FIXTURES / name))["optimizer"]
    params = dict(model.named_parameters())
    decay = ["embed.weight", "body.weight"]
    names = decay + [n for n in params if n not in decay and not n.startswith("frozen.")]
    assert len(names) == len(opt["state"])
    for i, key in enumerate(names):
        s = opt["state"][i]
        assert float(s["step"]) == 1.0
        update = (s["exp_avg"] / 0.1) / ((s["exp_avg_sq"] / 0.001).sqrt() + 1e-8)  # bias-corrected, step 1
        start = params[key].detach() * (1 - 0.05 * (0.01 if key in decay else 0.0))
        torch.testing.assert_close(start - 0.05 * update, saved[key], rtol=0, atol=1e-6, msg=key)


def test_damaged_moment_refused_only_with_optimizer(tmp_path: Path) -> None:
    run = copy_run("zero2_fp32", tmp_path)
    plan = describe_run(str(run), optimizer=True)
    assert plan.optimizer is not None
    piece = plan.optimizer["state"][1]["exp_avg_sq"].pieces[-1]
    with open(piece.path, "r+b") as f:  # damage a moment's bytes: the weights' records stay intact
        f.seek(piece.offset)
        flipped = bytes(b ^ 0xFF for b in f.read(piece.nbytes))
        f.seek(piece.offset)
        f.write(flipped)
    for fast in ([], ["--no-fast"]):
        bad = run_cli("convert", str(run), str(tmp_path / "full.pt"), "--optimizer", *fast)
        assert bad.exit_code == 2 and "CRC" in bad.output, bad.output
        assert not (tmp_path / "full.pt").exists()
    assert run_cli("convert", str(run), str(tmp_path / "model.pt")).exit_code == 0  # the moments are not read


# -- the fixtures themselves, and what the issue lists: fp16, frozen, tied, groups, buffers -------------------


def test_manifest_records_every_fixture_file() -> None:
    import json

    from ckptfix.trainer.fixtures import sha256
    from tests.deepspeed_runs import FP16_PATCH, MANIFEST

    manifest = json.loads((FIXTURES / MANIFEST).read_text())
    on_disk = {p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert set(manifest["files"]) == on_disk
    for name, record in manifest["files"].items():
        assert sha256(FIXTURES / name) == record["sha256"], f"{name}: regenerate with {manifest['command']}"
    assert list(manifest["runs"]) == NAMES
    for name, run in manifest["runs"].items():  # the patch is recorded on the runs it was applied to, only
        assert run["patched"] == ([FP16_PATCH] if name.endswith("_fp16") else []), name


@pytest.mark.parametrize("name", NAMES)
def test_inspect_says_stage_ranks_and_training_dtype(name: str) -> None:
    stage, dtype = name[len("zero")], name.split("_")[1]
    result = run_cli("inspect", str(FIXTURES / name))
    assert result.exit_code == 0, result.output
    train = str(TRAIN_DTYPE[dtype]).removeprefix("torch.")
    assert f"ZeRO-{stage} on 2 ranks" in result.output
    assert f"trained in {train}, master weights float32" in result.output


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("_fp16")])
def test_fp16_runs_are_deepspeeds_mixed_precision(name: str) -> None:
    """What makes the fp16 fixtures fp16 runs, read from DeepSpeed's own pickles: a float16 module, a dynamic loss
    scaler that applied its step (no overflow), and the fp32 master partitions the consolidation reads."""
    tag = FIXTURES / name / "global_step1"
    for path in sorted(tag.glob("*optim_states.pt")):
        assert not path.name.startswith("bf16_")  # fp16 and fp32 runs name their optimizer files alike
        saved = _unpickled(path)["optimizer_state_dict"]
        scaler = saved["loss_scaler"]
        assert type(scaler).__name__ == "DynamicLossScaler" and saved["dynamic_loss_scale"] is True
        assert scaler.state["dtype"] == torch.float16 and scaler.state["cur_iter"] == 1
        assert scaler.state["last_overflow_iter"] == -1 and saved["overflow"] is False
        flat = saved["fp32_flat_groups"] if name.startswith("zero3") else saved["single_partition_of_fp32_groups"]
        assert {t.dtype for t in flat} == {torch.float32}
    module = _unpickled(next(tag.glob("*model_states.pt")))["module"]
    assert {t.dtype for k, t in module.items() if k != "steps"} == {torch.float16}
    got = ckptfix.load(FIXTURES / name)
    assert got["body.weight"].dtype == torch.float32  # the master weights, not the fp16 module's
    if not name.startswith("zero3"):  # the fp16 module is the master weights rounded (ZeRO-3's are placeholders)
        assert torch.equal(module["body.weight"], got["body.weight"].to(torch.float16))


@pytest.mark.parametrize("name", NAMES)
def test_frozen_tied_groups_and_buffers(name: str, tmp_path: Path) -> None:
    """The issue's list, each from the run's own files: frozen parameters (ZeRO-1 leaves them out, as zero_to_fp32;
    ZeRO-2/3 in the training dtype), a tied weight (one tensor under both names), two parameter groups, buffers."""
    stage, train = int(name[len("zero")]), TRAIN_DTYPE[name.split("_")[1]]
    got, want = ckptfix.load(FIXTURES / name), expected(name)
    assert_same(got, want)
    frozen = {"frozen.weight", "frozen.bias"}
    assert frozen.isdisjoint(got) if stage == 1 else {got[k].dtype for k in frozen} == {train}
    assert got["head.weight"].untyped_storage().data_ptr() == got["embed.weight"].untyped_storage().data_ptr()
    groups = load_optimizer_groups(name)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and [len(g["params"]) for g in groups] == [2, 3]
    module = _unpickled(sorted((FIXTURES / name / "global_step1").glob("*model_states.pt"))[0])["module"]
    buffers = ["steps"] + ([] if half(name) else ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"])
    for key in buffers:  # from (rank 0's) module file, as DeepSpeed takes them; fp32 runs' BatchNorm trained a step
        assert torch.equal(got[key], module[key].float() if module[key].is_floating_point() else module[key]), key
    if not half(name):
        assert int(got["norm.num_batches_tracked"]) == 1 and bool(got["norm.running_mean"].ne(0).all())


def load_optimizer_groups(name: str) -> list[dict[str, Any]]:
    from ckptfix.formats.deepspeed.run import load_training_state

    return load_training_state(str(FIXTURES / name))["optimizer"]["param_groups"]  # type: ignore[no-any-return]


# -- one rank's ZeRO-3 module file, alone: its [0] placeholders are never weights -----------------------------

LONE = FIXTURES / "zero3_fp16" / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
LONE_1 = LONE.with_name("zero_pp_rank_1_mp_rank_00_model_states.pt")


def assert_refused(result: Any, *, folder: str = str(FIXTURES / "zero3_fp16")) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output and "[0] placeholders" in result.output and folder in result.output


def test_lone_zero3_module_file_refused_by_diff(tmp_path: Path) -> None:
    for a, b in ((LONE, FIXTURES / "zero3_fp16.expected.pt"), (FIXTURES / "zero3_fp16", LONE), (LONE, LONE_1)):
        assert_refused(run_cli("diff", str(a), str(b)))
    with pytest.raises(FormatError, match="placeholders"):
        ckptfix.diffing.diff_files(LONE, FIXTURES / "zero3_fp16")
    with pytest.raises(FormatError, match="placeholders"):
        ckptfix.diff(torch.load(LONE, weights_only=True), expected("zero3_fp16"))


def test_lone_zero3_module_files_refused_by_merge(tmp_path: Path) -> None:
    out = tmp_path / "merged.pt"
    for extra in ([], ["--average"], ["--model-only"]):
        result = run_cli("merge", str(LONE), str(LONE_1), "-o", str(out), *extra)
        assert_refused(result)
        assert f"ckptfix convert {FIXTURES / 'zero3_fp16'} model.safetensors" in result.output
    assert not out.exists()
    with pytest.raises(FormatError, match="placeholders"):
        ckptfix.merge([torch.load(p, weights_only=True) for p in (LONE, LONE_1)])


def test_lone_zero3_module_file_refused_by_validate_and_sanitize(tmp_path: Path) -> None:
    model = ["--model", "tests.formats.deepspeed.test_run:Net", "--kwargs", '{"half": true}']
    assert_refused(run_cli("validate", str(LONE), *model))
    folder = run_cli("validate", str(FIXTURES / "zero3_fp16"), *model)  # the folder: every key there, with weights
    assert folder.exit_code == 1 and "missing" not in folder.output, folder.output
    assert "float16 vs model float32 (2):\n  frozen.{weight,bias}\n" in folder.output  # frozen: no fp32 copy
    assert_refused(run_cli("sanitize", str(LONE), str(tmp_path / "clean.pt")))  # it loads weights-only as it is
    assert not (tmp_path / "clean.pt").exists()


def test_lone_zero3_module_file_refused_by_load_for_ddp(gloo_world: None) -> None:
    from ckptfix.distributed import load_for_ddp

    model = Net(half=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FormatError, match="placeholders"):
        load_for_ddp(model, LONE)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_inspect_says_what_placeholders_are() -> None:
    import json

    result = run_cli("inspect", str(LONE))
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("DeepSpeed: "))
    assert "8 parameter(s) shown as [0] are placeholders, not weights" in line
    assert line.endswith(f"inspect or convert the folder: {FIXTURES / 'zero3_fp16'}")
    info = json.loads(run_cli("inspect", str(LONE), "--json").output)["deepspeed_module_file"]
    module = _unpickled(LONE)["module"]
    assert set(info["placeholders"]) == {k for k, t in module.items() if t.numel() == 0}
    assert info["stage"] == 3 and info["folder"] == str(FIXTURES / "zero3_fp16")
    lone2 = json.loads(run_cli("inspect", str(FIXTURES / "zero2_fp16/global_step1/mp_rank_00_model_states.pt"),
                                "--json").output)["deepspeed_module_file"]  # fmt: skip
    assert lone2["stage"] == "1/2" and lone2["placeholders"] == [] and "training dtype" in lone2["note"]


def test_lone_module_file_names_the_folder_it_belongs_to(tmp_path: Path) -> None:
    run = copy_run("zero3_fp16", tmp_path)
    (run / "global_step1").rename(run / "global_step7")  # latest names global_step1, which is gone now: the tag folder
    lone = run / "global_step7" / LONE.name
    assert_refused(run_cli("convert", str(lone), str(tmp_path / "out.pt")), folder=str(run / "global_step7"))
    alone = tmp_path / "alone" / LONE.name  # taken out of its run: no folder to name, nothing guessed
    alone.parent.mkdir()
    shutil.copy(lone, alone)
    result = run_cli("diff", str(alone), str(FIXTURES / "zero3_fp16"))
    assert_refused(result, folder="<the run's global_stepN/ folder, with every rank's files>")
    assert not (tmp_path / "out.pt").exists()


def test_lone_optimizer_file_names_the_folder(tmp_path: Path) -> None:
    lone = FIXTURES / "zero2_fp16" / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    model = ["--model", "tests.formats.deepspeed.test_run:Net", "--kwargs", '{"half": true}']
    for args in (["convert", str(lone), str(tmp_path / "out.pt")], ["validate", str(lone), *model],
                 ["merge", str(lone), str(lone.with_name("zero_pp_rank_0_mp_rank_00_optim_states.pt")),
                  "-o", str(tmp_path / "out.pt")]):  # fmt: skip
        result = run_cli(*args)
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines()[-1] == (
            f"ckptfix: error: {lone}: one rank's optimizer file of a DeepSpeed ZeRO run: flat partitions of the fp32 "
            f"master weights and optimizer state, no state dict; pass the folder instead: {FIXTURES / 'zero2_fp16'}"
        )
    assert not (tmp_path / "out.pt").exists()
    # the library says the same, not "only unsafe=True opens it" (its pickle names DeepSpeed's classes)
    with pytest.raises(FormatError, match=r"one rank's optimizer file of a DeepSpeed ZeRO run: .* pass the folder"):
        ckptfix.load(lone)


# -- hostile rank files: the project's own fixtures edited (safe to unpickle), saved back with DeepSpeed's globals ----


def test_edited_rank_file_reads_as_before(tmp_path: Path) -> None:
    run = copy_run("zero3_fp16", tmp_path)
    for f in (run / "global_step1").iterdir():
        edit_rank_file(f, lambda tree: None)
    assert_same(ckptfix.load(run), expected("zero3_fp16"))


def test_partition_count_huge_refused_without_counting_to_it(tmp_path: Path) -> None:
    run = copy_run("zero3_bf16", tmp_path)
    rank0 = run / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    for count in (2**40, [2**40, 2]):
        edit_rank_file(rank0, lambda tree, c=count: tree["optimizer_state_dict"].__setitem__("partition_count", c))
        assert refusal("convert", run, tmp_path / "out.safetensors") == (
            f"ckptfix: error: {rank0.with_name('bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt')}: missing "
            f"({2**40 - 2} of {2**40} ranks' optimizer files missing); every rank's file is needed: copy the whole "
            f"tag folder"
        )


@pytest.mark.parametrize("edit", ["huge shape", "short partitions"])
def test_zero3_shapes_past_the_partitions_refused(edit: str, tmp_path: Path) -> None:
    run = copy_run("zero3_bf16", tmp_path)
    tag = run / "global_step1"
    if edit == "huge shape":  # 2**50 elements declared over partitions of 107
        edit_rank_file(
            tag / "zero_pp_rank_0_mp_rank_00_model_states.pt",
            lambda tree: tree["param_shapes"][0].__setitem__("embed.weight", torch.Size([2**25, 2**25])),
        )
    else:  # both ranks' first flat group cut to 50 elements of 92
        for rank in (0, 1):
            edit_rank_file(tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", lambda tree: tree[
                "optimizer_state_dict"]["fp32_flat_groups"].__setitem__(0, torch.zeros(50)))  # fmt: skip
    name, need = ("embed.weight", 2**49) if edit == "huge shape" else ("body.weight", 92)  # 60 + 32 of 65
    line = refusal("inspect", run)
    assert line == (
        f"ckptfix: error: {tag}: parameter '{name}' needs element {need} of each rank's partitions, which "
        f"hold {107 if edit == 'huge shape' else 65}; the rank files are from different runs"
    )


@pytest.mark.parametrize(("name", "sizes"), [("zero3_bf16", (30, 64)), ("zero2_bf16", (126,))])
def test_frozen_fragments_of_the_wrong_size_refused(name: str, sizes: tuple[int, ...], tmp_path: Path) -> None:
    run = copy_run(name, tmp_path)
    tag = run / "global_step1"
    files = ["mp_rank_00_model_states.pt"] if len(sizes) == 1 else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
                                                                     for r in range(2)]  # fmt: skip
    for file, size in zip(files, sizes, strict=True):  # ZeRO-3: 30 + 64 elements still cover the 63 of [7, 9]
        edit_rank_file(tag / file, lambda tree, n=size: tree["frozen_param_fragments"].__setitem__(
            "frozen.weight", torch.arange(n, dtype=torch.bfloat16)))  # fmt: skip
    assert refusal("convert", run, tmp_path / "out.safetensors") == (
        f"ckptfix: error: {tag / files[0]}: frozen parameter 'frozen.weight' of shape [7, 9] has {sizes[0]} elements "
        f"here, not {32 if len(sizes) == 2 else 63}; the rank files are from different runs"
    )


def test_two_module_files_of_one_rank_refused(tmp_path: Path) -> None:
    run = copy_run("zero3_fp32", tmp_path)
    tag = run / "global_step1"
    shutil.copy(FIXTURES / "zero3_bf16" / "global_step1" / "zero_pp_rank_1_mp_rank_00_model_states.pt",
                tag / "zero_pp_rank_01_mp_rank_00_model_states.pt")  # fmt: skip
    assert refusal("convert", run, tmp_path / "out.pt") == (
        f"ckptfix: error: {tag / 'zero_pp_rank_1_mp_rank_00_model_states.pt'}: rank 1 has two module files here "
        f"(zero_pp_rank_01_mp_rank_00_model_states.pt too); keep one run's files"
    )


@pytest.mark.parametrize(
    ("paddings", "message"),
    [
        ([[-20, 20], [0, 0, 0]], "param_alignment_paddings of group 0 are [-20, 20], not counts of elements"),
        ([[0.5, 0], [0, 0, 0]], "param_alignment_paddings of group 0 are [0.5, 0], not counts of elements"),
        ([[0, 0]], "param_alignment_paddings is not one list per parameter group (2)"),
        ([7, [0, 0, 0]], "param_alignment_paddings is not one list per parameter group (2)"),
    ],
)
def test_alignment_paddings_that_misplace_parameters_refused(paddings: Any, message: str, tmp_path: Path) -> None:
    run = copy_run("zero2_fp32", tmp_path)  # [-20, 20]: body.weight would overlap embed.weight, sizes still adding up
    tag = run / "global_step1"
    for rank in (0, 1):
        edit_rank_file(
            tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            lambda tree: tree["optimizer_state_dict"].__setitem__("param_alignment_paddings", paddings),
        )
    assert (
        refusal("convert", run, tmp_path / "out.safetensors")
        == f"ckptfix: error: {tag}: {message}; the rank files are damaged"
    )


@pytest.mark.parametrize("kind", ["fifo", "device", "link out"])
def test_rank_file_that_is_no_regular_file_inside_refused(kind: str, tmp_path: Path) -> None:
    if kind == "fifo" and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    run = copy_run("zero2_fp32", tmp_path)
    rank1 = run / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.unlink()
    if kind == "fifo":  # opening it would block for ever: no writer
        os.mkfifo(rank1)
    else:
        target = FIXTURES / "zero2_fp32" / "global_step1" / rank1.name
        rank1.symlink_to("/dev/zero" if kind == "device" else target)
    line = refusal("inspect", run)
    why = ("a link to outside the folder; refusing it: copy the file itself into the folder" if kind == "link out"
           else "not a regular file (a FIFO, socket, device or folder); copy the whole tag folder again")  # fmt: skip
    assert line == f"ckptfix: error: {rank1}: {why}"


@pytest.mark.parametrize("tag", ["../zero1_fp32", "/etc", "global_step1/../.."])
def test_latest_naming_a_path_out_of_the_run_refused_by_name(tag: str, tmp_path: Path) -> None:
    run = copy_run("zero1_fp32", tmp_path)
    (run / "latest").write_text(tag)
    assert refusal("convert", run, tmp_path / "out.safetensors") == (
        f"ckptfix: error: {run / 'latest'}: does not name a tag folder (found {tag.encode()!r}); pass the tag "
        f"folder itself"
    )


# ----------------------------------------------------------------------------------------------------------------------
# A ZeRO run's consolidated optimizer state names its parameters: each group's ``param_names`` are the run's own
# ``param_shapes`` names in its flat order, and ``convert RUN folder/ --optimizer`` writes the state keyed by those
# names (what ``set_optimizer_state_dict`` loads), each moment and step the one the ``.pt`` holds at its index.
#
# In the fixture runs the frozen layer is in no group and ``head.weight`` (tied to ``embed.weight``) is named once.
# Real runs whose groups interleave the model's parameters, resumed from both outputs: tests/test_resume_deepspeed.py
# (slow, needs DeepSpeed).


def _param_shapes(name: str) -> list[list[str]]:
    module = sorted((FIXTURES / name / "global_step1").glob("*model_states.pt"))[0]
    return [list(group) for group in _unpickled(module)["param_shapes"]]


@pytest.mark.parametrize("name", NAMES)
def test_groups_carry_the_runs_parameter_names(name: str, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    assert run_cli("convert", str(FIXTURES / name), str(out), "--optimizer").exit_code == 0
    groups = torch.load(out, weights_only=True)["optimizer"]["param_groups"]
    assert [g["param_names"] for g in groups] == _param_shapes(name)
    assert [g["param_names"] for g in groups] == [["embed.weight", "body.weight"],
                                                  ["body.bias", "norm.weight", "norm.bias"]]  # fmt: skip
    assert [g["params"] for g in groups] == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_into_a_dcp_folder_is_keyed_by_name(name: str, tmp_path: Path) -> None:
    folder = f"{tmp_path / 'fsdp2_run'}/"
    result = run_cli("convert", str(FIXTURES / name), folder, "--optimizer", "-v")
    assert result.exit_code == 0, result.output
    assert "keyed by parameter name (set_optimizer_state_dict's form), names from its param_groups' param_names" \
        in result.output  # fmt: skip
    got = ckptfix.load(folder)["optimizer"]
    truth = optimizer_truth(name)  # index-keyed, from the raw rank files
    names = [n for group in _param_shapes(name) for n in group]
    assert sorted(got["state"]) == sorted(names)
    for index, param in enumerate(names):
        assert sorted(got["state"][param]) == sorted(truth["state"][index]), param
        for key, value in truth["state"][index].items():
            moved = got["state"][param][key]
            assert moved.dtype == value.dtype and torch.equal(moved, value), (param, key)
    for g, want in zip(got["param_groups"], truth["param_groups"], strict=True):
        assert g["params"] == g["param_names"] == [names[i] for i in want["params"]]
        assert {k: v for k, v in g.items() if k not in ("params", "param_names")} == {
            k: v for k, v in want.items() if k not in ("params", "param_names")
        }


def test_optimizer_into_safetensors_still_refused(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    result = run_cli("convert", str(FIXTURES / "zero1_fp32"), str(out), "--optimizer")
    assert result.exit_code == 2 and not out.exists()
    said = f"--optimizer writes {{model, optimizer}} into one .pt file or a DCP folder, but {out} asks for a " \
           f".safetensors file (tensors only); write a .pt or a folder/, or drop --optimizer"  # fmt: skip
    assert said in result.output


@pytest.mark.parametrize("extra", [("--no-fast",), ("--dtype", "bf16")])
def test_torch_writer_routes_write_the_same_optimizer(extra: tuple[str, ...], tmp_path: Path) -> None:
    """The torch path and the cast (torch's DCP writer) write the stream's optimizer state: a cast touches the
    model entry alone."""
    run = str(FIXTURES / "zero2_bf16")
    assert run_cli("convert", run, f"{tmp_path / 'stream'}/", "--optimizer").exit_code == 0
    result = run_cli("convert", run, f"{tmp_path / 'other'}/", "--optimizer", *extra)
    assert result.exit_code == 0, result.output
    want, got = ckptfix.load(tmp_path / "stream")["optimizer"], ckptfix.load(tmp_path / "other")["optimizer"]
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"])
    for param, moments in want["state"].items():
        for key, value in moments.items():
            moved = got["state"][param][key]
            assert moved.dtype == value.dtype == torch.float32 and torch.equal(moved, value), (param, key)
