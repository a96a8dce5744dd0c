"""DeepSpeed ZeRO run folders: consolidated as DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` does.

The fast tier reads real runs saved by DeepSpeed (fixtures/deepspeed/: ZeRO-1/2/3 × fp32/bf16 on 2 gloo ranks, a
frozen layer, a tied weight, two parameter groups; made by ``python -m tests.deepspeed_runs fixtures/deepspeed
--fixtures``) and compares with DeepSpeed's consolidation saved beside each (``*.expected.pt``), and with DeepSpeed
itself where it is installed. The slow tier trains fresh runs and compares with DeepSpeed live.
"""

from __future__ import annotations

import pickle
import shutil
import types
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


# -- the optimizer state (convert --optimizer) --------------------------------------------------------------


class _Stub:
    """Stands for a DeepSpeed class in the project's own fixtures (an enum, a loss scaler): the truth is read
    without DeepSpeed installed, as CI runs the fast tier."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _WithoutDeepSpeed(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            return type(name, (_Stub,), {})
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
        ids = []
        for g in pg["params"]:
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
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def assert_same_optimizer(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == {"state", "param_groups"}
    assert got["param_groups"] == want["param_groups"]
    assert set(got["state"]) == set(want["state"])
    for i, s in want["state"].items():
        assert set(got["state"][i]) == set(s), i
        for k, t in s.items():
            assert got["state"][i][k].dtype == t.dtype and torch.equal(got["state"][i][k], t), (i, k)


@pytest.mark.parametrize("name", NAMES)
def test_convert_optimizer_consolidates_the_moments(name: str, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    result = ckptfix.convert_file(FIXTURES / name, out, optimizer=True)
    assert result.method == "stream"
    back = torch.load(out, weights_only=True)
    assert set(back) == {"model", "optimizer"}
    assert_same(back["model"], expected(name))
    assert_same_optimizer(back["optimizer"], optimizer_truth(name))
    steps = [s["step"] for s in back["optimizer"]["state"].values()]  # one tensor each: AdamW adds to it in place
    assert len({t.untyped_storage().data_ptr() for t in steps}) == len(steps)
    slow = tmp_path / "slow.pt"  # the torch path writes the same
    result = run_cli("convert", str(FIXTURES / name), str(slow), "--optimizer", "--no-fast")
    assert result.exit_code == 0, result.output
    again = torch.load(slow, weights_only=True)
    assert_same(again["model"], back["model"])
    assert_same_optimizer(again["optimizer"], back["optimizer"])


@pytest.mark.parametrize("name", ["zero2_fp32", "zero3_bf16"])
def test_optimizer_loads_into_torch_adamw(name: str, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    assert run_cli("convert", str(FIXTURES / name), str(out), "--optimizer").exit_code == 0
    back = torch.load(out, weights_only=True)
    model = Net(bf16="bf16" in name)  # the groups tests/deepspeed_runs.py trains with
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
    from ckptfix.formats.deepspeed import load_optimizer

    torch.manual_seed(0)  # as tests/deepspeed_runs.py builds the model
    model = Net(bf16="bf16" in name)
    if "bf16" in name:  # DeepSpeed's fp32 master copy of the bf16 module
        model = model.to(torch.bfloat16).float()
    saved, opt = ckptfix.load(FIXTURES / name), load_optimizer(str(FIXTURES / name))
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
