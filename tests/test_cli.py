from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.conftest import PROBE, make_net


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def ddp_ckpt(tmp_path: Path, wrapped_state: Callable[[str], Any]) -> Path:
    path = tmp_path / "ddp.pt"
    torch.save({"epoch": 4, "model": wrapped_state("ddp"), "optimizer": {"state": {}, "param_groups": []}}, path)
    return path


def test_convert_reports_what_changed(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "plain.pt"
    result = run("convert", str(ddp_ckpt), str(out))
    assert result.exit_code == 0, result.output
    assert "'model': ddp -> single, 9 keys (9 renamed)" in result.output
    assert "kept unchanged: epoch, optimizer" in result.output
    net = make_net(seed=3)
    net.load_state_dict(ckptfix.load(out)["model"], strict=True)
    assert torch.equal(net(PROBE), make_net()(PROBE))


def test_convert_to_safetensors_model_only(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = run("convert", str(ddp_ckpt), str(out), "--model-only", "--dtype", "float16")
    assert result.exit_code == 0, result.output
    assert "dropped (--model-only): epoch, optimizer" in result.output
    state = ckptfix.load(out)
    assert state["head.weight"].dtype == torch.float16
    assert state["features.1.num_batches_tracked"].dtype == torch.int64


def test_custom_prefixes_and_renames(tmp_path: Path) -> None:
    src = tmp_path / "lightning.ckpt.pt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in make_net().state_dict().items()}}, src)
    out = tmp_path / "out.pt"
    result = run("convert", str(src), str(out), "--strip-prefix", "model.", "--to", "ddp")
    assert result.exit_code == 0, result.output
    assert all(k.startswith("module.features") or k.startswith("module.head") for k in ckptfix.load(out)["state_dict"])
    result = run("convert", str(src), str(out), "--rename", r"^model\.head\.=classifier.", "--keep-layout")
    assert result.exit_code == 0, result.output
    assert "classifier.weight" in ckptfix.load(out)["state_dict"]
    result = run("convert", str(src), str(out), "--strip-prefix", "net.")
    assert result.exit_code == 2
    assert "--strip-prefix 'net.' does not match key 'model.features.0.weight'" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.pt", "out.pt"], "missing.pt: no such file; check the path"),
        (["IN", "IN"], "is the input file"),
        (["IN", "out.txt"], "unknown output extension"),
        (["IN", "no/such/dir/out.pt"], "does not exist; create it first"),
        (["IN", "out.pt", "--to", "fsdp"], "Invalid value for '--to'"),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path: Path, ddp_ckpt: Path, args: list[str], message: str) -> None:
    args = [str(ddp_ckpt) if a == "IN" else str(tmp_path / a) if a.endswith((".pt", ".txt")) else a for a in args]
    result = run("convert", *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out.pt").exists()


def test_unsafe_file_exit_2_and_allow_global(tmp_path: Path) -> None:
    import argparse

    src = tmp_path / "ns.pt"
    torch.save({"model": make_net().state_dict(), "args": argparse.Namespace(lr=0.5)}, src)
    result = run("inspect", str(src))
    assert result.exit_code == 2
    assert "--allow-global argparse.Namespace" in result.output
    result = run("convert", str(src), str(tmp_path / "o.pt"), "--allow-global", "argparse.Namespace")
    assert result.exit_code == 0, result.output


def test_inspect_text_and_json(ddp_ckpt: Path) -> None:
    result = run("inspect", str(ddp_ckpt))
    assert result.exit_code == 0, result.output
    assert "model entry 'model': layout ddp, 9 tensors" in result.output
    assert "BatchNorm statistics: 3 buffers in 1 modules" in result.output
    assert "module.features.1.{weight,bias,running_mean,running_var,num_batches_tracked}" in result.output
    assert "entry 'epoch': int 4" in result.output
    data = json.loads(run("inspect", str(ddp_ckpt), "--json").output)
    assert data["format"] == "torch-zip"
    model = data["models"]["model"]
    assert model["layout"] == "ddp"
    assert model["tensors"] == 9
    assert model["parameters"] == sum(p.numel() for p in make_net().parameters())
    assert data["other_entries"]["epoch"] == "int 4"


def test_debug_shows_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--debug", "inspect", str(tmp_path / "nope.pt")])
    assert result.exit_code != 0
    assert isinstance(result.exception, ckptfix.FormatError)


def test_python_m_and_help_do_not_import_torch() -> None:
    code = "import sys; from ckptfix.cli import cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    result = subprocess.run([sys.executable, "-m", "ckptfix", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "convert" in result.stdout and "inspect" in result.stdout


def test_inspect_prints_hostile_key_names_escaped(tmp_path: Path) -> None:
    state = {"conv.weight": torch.zeros(2), "x\x1b]0;pwned\x07.weight": torch.zeros(2)}
    state["y\nentry 'forged'"] = torch.ones(1)
    path = tmp_path / "evil.pt"
    torch.save({"model": state, "note\r\nentry 'forged'": 1}, path)
    result = run("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert not any(c in result.output for c in "\x1b\x07\r")
    lines = result.output.splitlines()
    assert not any(line.startswith("entry 'forged'") for line in lines)
    assert r"entry 'note\r\nentry 'forged'': int 1" in lines
    grouped = r"  {conv,x\x1b]0;pwned\x07}.weight  "
    assert lines[2] == f"{grouped}2 × float32 [2]"
    assert lines[3] == r"  y\nentry 'forged'".ljust(len(grouped)) + "float32 [1]"  # aligned as printed


def test_errors_stay_on_one_line_whatever_a_key_holds(tmp_path: Path) -> None:
    src = tmp_path / "evil.pt"
    torch.save({"w\n\x1b[31mckptfix: error: forged": torch.zeros(1)}, src)
    result = run("convert", str(src), str(tmp_path / "out.pt"), "--strip-prefix", "net.")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "\x1b" not in result.stderr
    assert r"'w\n\x1b[31mckptfix: error: forged'" in result.stderr


def _with_closed_stdout(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ckptfix with stdout a pipe whose reader has gone, as `ckptfix … | head -1` leaves it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "ckptfix", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            timeout=300,
        )
    finally:
        os.close(write_end)


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGPIPE semantics on Windows")
@pytest.mark.parametrize("as_json", [False, True], ids=["at-exit", "mid-write"])
def test_a_closed_stdout_pipe_ends_quietly(tmp_path: Path, as_json: bool) -> None:
    # Text output fits the buffer and fails only at the flush at exit; the JSON (3000 keys) fails mid-write.
    a = {f"layers.{i}.weight": torch.zeros(1) for i in range(3000)}
    torch.save(a, tmp_path / "a.pt")
    torch.save({k: v + 1 for k, v in a.items()}, tmp_path / "b.pt")
    result = _with_closed_stdout(["diff", "a.pt", "b.pt", *(["--json"] if as_json else [])], tmp_path)
    assert (result.returncode, result.stderr) == (141, "")


def test_unsafe_pickle_warning_is_printed_whatever_the_warning_filters(tmp_path: Path) -> None:
    import argparse

    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=1)}, tmp_path / "ns.pt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "ckptfix", "inspect", str(tmp_path / "ns.pt"), "--unsafe-pickle"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ns.pt: unsafe pickle loading: this can run code from the file") == 1
