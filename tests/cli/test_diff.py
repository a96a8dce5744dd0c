"""``ckptfix diff`` through the real click group, on per-rank DDP checkpoints (the conftest rank_files)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from tests.models import SmallNet


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


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


def test_diff_prints_hostile_key_names_escaped(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(2), "evil\n\x1b[2Jequal": torch.zeros(2)}, a)
    torch.save({"model": {"w": torch.zeros(2)}, "note\r\nequal": 1}, b)
    result = run("diff", a, b)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert "\x1b" not in result.stdout and "\r" not in result.stdout and "equal" not in lines
    assert lines[2:4] == ["only in A (1):", r"  evil\n\x1b[2Jequal"]
    assert lines[-3:] == ["other entries differ (1):", r"  note\r\nequal: (absent) -> 1", "different"]


def _lightning_like(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint laid out as Lightning's Trainer.save_checkpoint writes it, and the weights extracted from it.

    The LightningModule keeps the network as ``self.model``, so its ``state_dict`` keys start with ``model.``.
    """
    net = SmallNet()
    state = OrderedDict((f"model.{k}", v) for k, v in net.state_dict().items())
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 4,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": state,
            "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
            "callbacks": {},
            "optimizer_states": [torch.optim.SGD(net.parameters(), lr=0.1).state_dict()],
            "lr_schedulers": [],
        },
        ckpt,
    )
    weights = tmp_path / "weights.safetensors"
    ckptfix.save(net.state_dict(), weights)
    return ckpt, weights


def test_diff_entry_and_strip_prefix_compare_a_lightning_ckpt_with_its_weights(tmp_path: Path) -> None:
    ckpt, weights = _lightning_like(tmp_path)
    plain = run("diff", ckpt, weights)
    assert plain.exit_code == 1 and "only in A (16):" in plain.stdout  # every key differs by model.
    result = run("diff", ckpt, weights, "--entry", "state_dict", "--strip-prefix", "model.")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"A: {ckpt} (entry 'state_dict', layout single)",
        f"B: {weights} (layout single)",
        "other entries not compared (--entry state_dict)",
        "equal",
    ]
    # the prefix applies only where every key has it: the same command the other way round is equal too
    assert run("diff", weights, ckpt, "--entry", "state_dict", "--strip-prefix", "model.").exit_code == 0
    report = json.loads(run("diff", ckpt, weights, "--strip-prefix", "model.", "--json").stdout)
    assert report["entries"][0]["equal"] and report["others_compared"]
    assert {o["path"] for o in report["other"]} >= {"epoch", "global_step", "optimizer_states"}


def test_diff_entry_picks_an_ema_copy(tmp_path: Path) -> None:
    net, ema = SmallNet(seed=0), SmallNet(seed=1)
    ckpt = tmp_path / "timm.pth.tar"
    torch.save({"epoch": 3, "state_dict": net.state_dict(), "state_dict_ema": ema.state_dict()}, ckpt)
    weights = tmp_path / "ema.pt"
    torch.save(ema.state_dict(), weights)
    assert run("diff", ckpt, weights).exit_code == 1  # the default entry is state_dict, not the EMA
    assert run("diff", ckpt, weights, "--entry", "state_dict_ema").exit_code == 0


def test_diff_entry_and_prefix_that_fit_no_side_are_one_line_errors(tmp_path: Path) -> None:
    ckpt, weights = _lightning_like(tmp_path)
    result = run("diff", ckpt, weights, "--entry", "ema")
    assert result.exit_code == 2 and "neither file has a model entry 'ema'" in result.stderr
    assert result.stderr.count("\n") == 1
    result = run("diff", ckpt, weights, "--strip-prefix", "net.")
    assert result.exit_code == 2
    assert f"--strip-prefix 'net.' matches neither {ckpt} nor {weights}" in result.stderr


def test_diff_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({f"a{i}.weight": torch.zeros(1) for i in range(3000)}, a)
    torch.save({f"b{i}.weight": torch.zeros(1) for i in range(3000)}, b)
    command = [sys.executable, "-m", "ckptfix", "diff", str(a), str(b), "--json"]
    # the reader is gone before anything is written: every write fails with EPIPE
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, text=True, check=False)
    os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
    # and as a shell runs it: `ckptfix diff A B | head -1`
    shell = subprocess.run(
        ["bash", "-c", f'{shlex.join(command)} | head -1; echo "exit=${{PIPESTATUS[0]}}"'],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shell.stderr == ""
    first, status = shell.stdout.splitlines()
    assert first == "{" and status in ("exit=141", "exit=1")  # 1: all of it fit in the pipe before head left
