"""The reference trainer: options, resume equivalence, DDP sharding and averaging, per-rank BatchNorm drift."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import CkptfixError
from ckptfix.trainer.config import TrainConfig, parse_args
from ckptfix.trainer.loop import ddp_buffer_kwargs, rank_checkpoint_name, setup, train
from tests.training import FIXTURES, REPO, SMALL, SMALL_ARGS, ckptfix_process


def _model(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = ckptfix.load(path)["model"]
    return state


def _assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone … -m ckptfix.trainer ARGS`` (what torchrun runs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "ckptfix.trainer", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


# --- options -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--local_rank", "--local-rank"])
def test_old_launcher_local_rank_flag_is_accepted(flag: str) -> None:
    config = parse_args(["--out", "x", flag, "1"])
    assert config.local_rank == 1
    assert parse_args(["--out", "x", f"{flag}=3"]).local_rank == 3


def test_mode_defaults_to_ddp_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parse_args(["--out", "x"]).mode == "single"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_args(["--out", "x"]).mode == "ddp"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--mode", "single", "--sync-bn"], "only works under DDP"),
        (["--mode", "dp", "--save-per-rank"], "DDP options"),
        (["--mode", "ddp", "--sync-bn", "--norm", "none"], "no BatchNorm"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_option_combinations_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(CkptfixError, match=match):
        parse_args(["--out", "x", *argv], raising=True)


def test_ddp_buffer_switch_uses_this_torchs_name() -> None:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    kwargs = ddp_buffer_kwargs(False)
    assert kwargs in ({"forward_sync_buffers": False}, {"broadcast_buffers": False})
    assert next(iter(kwargs)) in inspect.signature(DistributedDataParallel.__init__).parameters


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU runs")
def test_sync_bn_on_cpu_stops_with_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(CkptfixError, match="SyncBatchNorm only on GPU"):
        setup(TrainConfig(out=str(tmp_path), mode="ddp", sync_bn=True))
    result = CliRunner().invoke(cli, ["train", "--mode", "ddp", "--out", str(tmp_path), "--sync-bn"])
    assert result.exit_code == 2
    assert "SyncBatchNorm only on GPU" in result.output
    assert "Traceback" not in result.output


def test_ddp_mode_without_a_launcher_says_how_to_start_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(CkptfixError, match=r"torchrun --nproc-per-node N -m ckptfix\.trainer"):
        setup(TrainConfig(out=str(tmp_path), mode="ddp"))


# --- single process and DataParallel ---------------------------------------------------------------------


def test_single_run_saves_a_full_checkpoint_and_learns(tmp_path: Path) -> None:
    result = train(TrainConfig(out=str(tmp_path), epochs=2, samples=1024, val_samples=256))
    ckpt = ckptfix.load(result.checkpoint)
    assert {"model", "optimizer", "epoch", "step", "rng", "config"} <= set(ckpt)
    assert ckpt["epoch"] == 2 and ckpt["step"] == 2 * 1024 // 32
    assert ckptfix.detect(ckpt["model"].keys()).name == "single"
    assert result.val_accuracy > 0.5  # four classes: chance is 0.25


def test_resume_continues_bitwise_in_single_mode(tmp_path: Path) -> None:
    options: dict[str, Any] = {**SMALL, "warmup_epochs": 0.5, "deterministic": True}  # bitwise on a GPU too
    straight = train(TrainConfig(out=str(tmp_path / "a"), epochs=2, **options))
    first = train(TrainConfig(out=str(tmp_path / "b"), epochs=1, **options))
    resumed = train(TrainConfig(out=str(tmp_path / "c"), epochs=2, resume=str(first.checkpoint), **options))
    _assert_equal_states(_model(straight.checkpoint), _model(resumed.checkpoint))
    a, c = ckptfix.load(straight.checkpoint), ckptfix.load(resumed.checkpoint)
    assert a["step"] == c["step"]
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], c["optimizer"]["state"][index]["momentum_buffer"])


def test_dp_run_saves_plain_or_wrapped_keys(tmp_path: Path) -> None:
    options: dict[str, Any] = {**SMALL, "mode": "dp", "epochs": 1, "deterministic": True}  # bitwise on a GPU too
    plain = train(TrainConfig(out=str(tmp_path / "plain"), **options))
    wrapped = train(TrainConfig(out=str(tmp_path / "wrapped"), save_layout="wrapped", **options))
    a, b = _model(plain.checkpoint), _model(wrapped.checkpoint)
    assert ckptfix.detect(a.keys()).name == "single"
    assert ckptfix.detect(b.keys()).name == "ddp"
    assert set(b) == {f"module.{k}" for k in a}
    _assert_equal_states(a, ckptfix.convert(b, to="single"))


@pytest.mark.parametrize("source", ["dp_wrapped.pt", "ddp_wrapped.safetensors", "legacy_dp.pt"])
def test_resume_accepts_any_layout_and_format(source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(TrainConfig(out=str(tmp_path), epochs=2, resume=str(FIXTURES / source), **SMALL))
    ckpt = ckptfix.load(result.checkpoint)
    assert ckptfix.detect(ckpt["model"].keys()).name == "single"
    assert (ckpt["epoch"], ckpt["step"]) == (2, 2 * 256 // 32)
    # A full checkpoint resumes after its epoch; weights-only safetensors starts a fresh schedule.
    start = 0 if source.endswith(".safetensors") else 1
    assert f"at epoch {start}, step {start * 256 // 32}" in capsys.readouterr().out


def test_single_process_resume_returns_what_load_for_ddp_returns(tmp_path: Path) -> None:
    from ckptfix.trainer.loop import Env, _resume
    from ckptfix.trainer.model import build_model

    trained = build_model()
    state = {f"module.{k}": v for k, v in trained.state_dict().items()}
    ema = {k: v.clone() for k, v in trained.state_dict().items()}
    ckptfix.save({"model": state, "ema": ema, "epoch": 3}, tmp_path / "full.pt")
    model = build_model()
    extras = _resume(TrainConfig(out=str(tmp_path), resume=str(tmp_path / "full.pt")), model, Env())
    # Everything but the loaded model entry, an EMA copy included (test_distributed checks the DDP side).
    assert set(extras) == {"ema", "epoch"} and extras["epoch"] == 3
    _assert_equal_states(model.state_dict(), trained.state_dict())
    ckptfix.save(ema, tmp_path / "bare.pt")
    assert _resume(TrainConfig(out=str(tmp_path), resume=str(tmp_path / "bare.pt")), build_model(), Env()) == {}


def test_resume_needing_a_global_says_which(tmp_path: Path) -> None:
    config = TrainConfig(out=str(tmp_path), epochs=2, resume=str(FIXTURES / "namespace_args.pt"), **SMALL)
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'"):
        train(config)
    config.allow_globals = ["argparse.Namespace"]
    assert ckptfix.load(train(config).checkpoint)["epoch"] == 2


# --- DDP: two gloo processes on the CPU --------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_equals_single_process_on_the_same_global_batch(tmp_path: Path) -> None:
    """Without BatchNorm, 2 ranks x batch 16 must match 1 process x batch 32: sharding and averaging are right."""
    common = ["--norm", "none", "--epochs", "1", "--samples", "128", "--val-samples", "32", "--warmup-epochs", "1"]
    run = _torchrun("--mode", "ddp", "--batch-size", "16", "--out", str(tmp_path / "ddp"), *common)
    assert "batch size 16 per process, global batch 32" in run.stdout
    assert run.stdout.count("[ckptfix.trainer] epoch 1/1") == 1  # only rank 0 logs
    single = parse_args(["--mode", "single", "--batch-size", "32", "--out", str(tmp_path / "single"), *common])
    train(single)
    ddp, one = _model(tmp_path / "ddp" / "checkpoint.pt"), _model(tmp_path / "single" / "checkpoint.pt")
    assert list(ddp) == list(one)
    assert any(not torch.equal(ddp[k], build_fresh()[k]) for k in ddp)  # it trained
    for key in ddp:
        torch.testing.assert_close(ddp[key], one[key], rtol=1e-5, atol=1e-6)


def build_fresh() -> dict[str, torch.Tensor]:
    from ckptfix.trainer.model import build_model

    torch.manual_seed(0)
    return build_model(norm="none").state_dict()


@pytest.mark.slow
def test_ddp_per_rank_files_differ_in_batchnorm_statistics_only(tmp_path: Path) -> None:
    out = tmp_path / "drift"
    args = ["--mode", "ddp", "--nproc-per-node", "2", "--epochs", "1", "--out", str(out), *SMALL_ARGS]
    result = ckptfix_process("train", *args, "--no-buffer-sync", "--save-per-rank", "--save-layout", "wrapped")
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (_model(out / rank_checkpoint_name(r)) for r in (0, 1))
    assert ckptfix.detect(rank0.keys()).name == "ddp"
    differ = {k for k in rank0 if not torch.equal(rank0[k], rank1[k])}
    assert differ == {k for k in rank0 if k.endswith(("running_mean", "running_var"))}
    _assert_equal_states(_model(out / "checkpoint.pt"), rank0)


@pytest.mark.slow
def test_ddp_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    common = [*SMALL_ARGS, "--mode", "ddp", "--no-buffer-sync", "--save-per-rank"]
    _torchrun(*common, "--epochs", "2", "--out", str(tmp_path / "a"))
    _torchrun(*common, "--epochs", "1", "--out", str(tmp_path / "b"))
    resumed = _torchrun(
        *common, "--epochs", "2", "--out", str(tmp_path / "c"), "--resume", str(tmp_path / "b" / "checkpoint.pt")
    )
    assert "resumed from" in resumed.stdout
    a, c = _model(tmp_path / "a" / "checkpoint.pt"), _model(tmp_path / "c" / "checkpoint.pt")
    assert list(a) == list(c)
    for key in a:
        torch.testing.assert_close(a[key], c[key], rtol=1e-5, atol=1e-6)


# --- the launcher ------------------------------------------------------------------------------------------


def test_launcher_flags_single_node_and_multi_node() -> None:
    from ckptfix.trainer.launch import launcher_args

    assert launcher_args("2") == ["--nproc-per-node", "2", "--nnodes", "1", "--standalone"]
    multi = launcher_args("8", nnodes="2", rdzv_endpoint="host:29400", rdzv_id="job")
    assert multi[:4] == ["--nproc-per-node", "8", "--nnodes", "2"]
    assert multi[4:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400", "--rdzv-id", "job"]
    with pytest.raises(CkptfixError, match="--rdzv-endpoint"):
        launcher_args("2", nnodes="2")


def test_the_reported_worker_is_the_one_that_failed_not_one_the_launcher_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torchrun SIGTERMs the other workers once one exits with an error; rank 0's -15 is a consequence.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import ckptfix.trainer.launch as launch

    def run(_: object) -> None:
        failures = {
            0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none")),
            1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(tmp_path / "none")),
        }
        raise ChildFailedError("ckptfix.trainer", failures)

    monkeypatch.setattr("torch.distributed.run.run", run)
    with pytest.raises(CkptfixError, match="first rank 1 with exit code 1;") as caught:
        launch.launch_trainer(["--epochs", "1"], launch.launcher_args("2"))
    assert caught.value.exit_code == 1
