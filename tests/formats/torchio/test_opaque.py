"""Entries that need globals outside the allowlist stay unbuilt: the weights next to them are rescued, nothing runs.

Each file here is written by torch.save. A payload is a ``builtins.exec`` call that would create a marker file;
every test ends with the marker absent.
"""

from __future__ import annotations

import argparse
import builtins
import pathlib
import pickle
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.formats.torchio import opaque
from tests.models import KEYS, SmallNet, make_net

EXEC = "builtins.exec"


class Payload:
    """Pickles as ``exec("open(marker, 'w').close()")``: running the file's pickle creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _same(state: Any, expected: dict[str, torch.Tensor]) -> None:
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


@pytest.fixture
def poisoned(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose 'payload' entry runs code when unpickled, beside plain weights; and its marker."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "ckpt.pt"
    torch.save({"model": make_net().state_dict(), "epoch": 3, "payload": [1, Payload(marker)]}, path)
    torch.load(path, weights_only=False)  # the premise: the full unpickler runs it
    assert marker.exists()
    marker.unlink()
    return path, marker


def test_load_refuses_naming_the_code_and_what_rescues_the_weights(poisoned: tuple[Path, Path]) -> None:
    path, marker = poisoned
    with pytest.raises(ckptfix.UnsafeCheckpointError) as refused:
        ckptfix.load(path)
    message = str(refused.value)
    assert f"its pickle calls {EXEC}, which can run code; nothing was executed" in message
    assert "The weights in 'model' need none of it ('payload' would stay unloaded)" in message
    assert "model_only=True" in message and "allow_globals" not in message and "unsafe" not in message
    assert not marker.exists()


def test_load_into_check_and_validate_use_the_weights_and_say_what_was_not_loaded(
    poisoned: tuple[Path, Path],
) -> None:
    path, marker = poisoned
    net = SmallNet(seed=7)
    report = ckptfix.load_into(net, path)
    assert report.loads_as_is and report.entry == "model"
    assert report.not_loaded == {"payload": f"{EXEC} ×1, not loaded; it calls {EXEC}, which can run code (nothing "
                                            f"was run)"}  # fmt: skip
    assert report.not_copyable == ["payload"]
    _same(net.state_dict(), make_net().state_dict())
    assert ckptfix.check(path, SmallNet()).not_loaded == report.not_loaded
    result = run("validate", path, "--model", "tests.models:SmallNet")
    assert result.exit_code == 0, result.output
    assert f"            entry 'payload': {EXEC} ×1, not loaded; it calls {EXEC}" in result.stdout
    assert not marker.exists()


def test_a_printed_fix_command_leaves_code_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where the fix writes
    marker = tmp_path / "PWNED"
    path = tmp_path / "ddp.pt"
    state = {f"module.{k}": v for k, v in make_net().state_dict().items()}
    torch.save({"model": state, "payload": Payload(marker)}, path)
    result = run("validate", path, "--model", "tests.models:SmallNet")
    assert result.exit_code == 1, result.output
    fix = result.stdout.splitlines()[-1].strip()
    assert fix.startswith("ckptfix convert") and fix.endswith("--model-only")
    assert run(*shlex.split(fix)[1:]).exit_code == 0
    assert run("validate", shlex.split(fix)[3], "--model", "tests.models:SmallNet").exit_code == 0
    assert not marker.exists()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_model_only_rescues_the_weights_on_both_paths(poisoned: tuple[Path, Path], ext: str, fast: bool) -> None:
    path, marker = poisoned
    out = path.parent / f"weights{ext}"
    result = run("convert", path, out, "--model-only", "-v", *([] if fast else ["--no-fast"]))
    assert result.exit_code == 0, result.output
    assert f"path: {'stream' if fast else 'torch'}" in result.stderr
    assert "dropped (--model-only): epoch, payload" in result.stdout
    _same(torch.load(out, weights_only=True) if ext == ".pt" else ckptfix.load(out), make_net().state_dict())
    assert not marker.exists()


def test_entry_rescues_the_weights_with_a_cast(poisoned: tuple[Path, Path]) -> None:
    path, marker = poisoned
    out = path.parent / "half.pt"
    result = ckptfix.convert_file(path, out, entries=["model"], model_only=True, dtype="float16")
    assert result.method == "torch"
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == KEYS and loaded["head.weight"].dtype == torch.float16
    assert not marker.exists()


@pytest.mark.parametrize("args", [[".pt", "--no-fast"], [".safetensors"], [".pt", "--dtype", "float16"]])
def test_a_conversion_that_must_build_every_entry_refuses_code(poisoned: tuple[Path, Path], args: list[str]) -> None:
    path, marker = poisoned
    out = path.parent / f"out{args[0]}"
    result = run("convert", path, out, *args[1:])
    assert result.exit_code == 2
    assert EXEC in result.stderr and "--allow-global" not in result.stderr and "--unsafe-pickle" not in result.stderr
    assert "--model-only" in result.stderr
    assert not out.exists() and not marker.exists()


def test_a_full_pt_conversion_copies_code_unexecuted_and_says_so(poisoned: tuple[Path, Path]) -> None:
    path, marker = poisoned
    out = path.parent / "single.pt"
    result = run("convert", path, out, "--to", "ddp")
    assert result.exit_code == 0, result.output
    assert "kept unchanged: epoch, payload" in result.stdout
    assert (f"kept as their pickle records, copied, never executed: 'payload' ({EXEC} ×1; it calls {EXEC}, which can "
            f"run code: load the output only as you would the input") in result.stderr  # fmt: skip
    assert not marker.exists()
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=re.escape(EXEC)):
        ckptfix.load(out)  # the output is refused exactly as the input is
    with pytest.raises(pickle.UnpicklingError):
        torch.load(out, weights_only=True)
    report = ckptfix.load_into(SmallNet(), out, strip_prefixes=["module."])
    assert report.not_copyable == ["payload"]
    inspected = run("inspect", out)
    assert f"entry 'payload': {EXEC} ×1, not loaded; it calls {EXEC}, which can run code" in inspected.stdout
    assert not marker.exists()


def test_a_full_pt_conversion_copies_other_unknown_entries_as_their_records(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    hparams = {"args": argparse.Namespace(lr=0.1, mean=torch.arange(3.0)), "root": pathlib.PosixPath("/data/run")}
    state = {f"module.{k}": v for k, v in make_net().state_dict().items()}
    torch.save({"model": state, "hparams": hparams, "epoch": 2}, path)
    out = tmp_path / "single.pt"
    result = run("convert", path, out, "-v")
    assert result.exit_code == 0, result.output
    assert "kept as their pickle records, copied, never executed: 'hparams' (argparse.Namespace ×1, " \
           "pathlib.PosixPath ×1)" in result.stderr  # fmt: skip
    loaded = torch.load(out, weights_only=False)  # the records are the same calls: torch rebuilds the same values
    assert loaded["hparams"]["root"] == hparams["root"] and loaded["hparams"]["args"].lr == 0.1
    assert torch.equal(loaded["hparams"]["args"].mean, torch.arange(3.0)) and loaded["epoch"] == 2
    _same(loaded["model"], make_net().state_dict())
    allow = ["argparse.Namespace", "pathlib.PosixPath"]
    assert ckptfix.load(out, allow_globals=allow)["hparams"]["root"] == hparams["root"]
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'"):
        ckptfix.load(out)  # as strict as the input: the records still need the same globals


def test_the_model_entry_itself_is_never_left_unbuilt(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {**make_net().state_dict(), "cfg": argparse.Namespace(a=1)}}, path)
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'") as refused:
        ckptfix.load_into(SmallNet(), path)
    assert "need none of it" not in str(refused.value)
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'"):
        ckptfix.convert_file(path, tmp_path / "out.pt", model_only=True)


def test_an_unbuilt_training_entry_does_not_let_the_ema_copy_be_picked(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    state = make_net().state_dict()
    torch.save({"state_dict": {**state, "cfg": argparse.Namespace(a=1)}, "state_dict_ema": state}, path)
    with pytest.raises(ckptfix.UnsafeCheckpointError, match="The weights in 'state_dict_ema' need none of it"):
        ckptfix.load_into(SmallNet(), path)
    assert ckptfix.load_into(SmallNet(), path, entry="state_dict_ema").not_loaded.keys() == {"state_dict"}


def test_code_outside_any_entry_rescues_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    weights = make_net().state_dict()
    for name, obj in (
        ("root", Payload(marker)),
        ("key", {"model": weights, Payload(marker): 1}),
        ("state dict", {**weights, "payload": Payload(marker)}),  # a bare state dict is all model
    ):
        path = tmp_path / f"{name}.pt"
        torch.save(obj, path)
        with pytest.raises(ckptfix.UnsafeCheckpointError, match=re.escape(EXEC)) as refused:
            ckptfix.load_into(SmallNet(), path)
        assert "need none of it" not in str(refused.value)
    assert not marker.exists()


def test_a_tensor_beside_the_entries_does_not_make_a_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": make_net().state_dict(), "best": torch.tensor(0.5), "args": argparse.Namespace()}, path)
    assert ckptfix.load_into(SmallNet(), path).not_loaded == {"args": "argparse.Namespace ×1, not loaded"}


def test_entries_are_found_without_building_anything(poisoned: tuple[Path, Path]) -> None:
    path, marker = poisoned
    with open(path, "rb") as f:
        described = opaque.describe(
            f.fileno(), str(path), allowed=frozenset(ckptfix.formats.safety.allowlist.TORCH_DEFAULT)
        )
    [entry] = opaque.entries(described.tree)
    assert (entry.name, entry.needs, entry.classes, entry.runs_code) == ("payload", (EXEC,), ((EXEC, 1),), (EXEC,))
    assert described.tree["epoch"] == 3 and not marker.exists()


def test_load_for_ddp_loads_the_weights_and_leaves_unbuilt_entries_out(
    poisoned: tuple[Path, Path], gloo_world: None
) -> None:
    path, marker = poisoned
    net = SmallNet(seed=4)
    extras = ckptfix.load_for_ddp(net, path)
    assert extras == {"epoch": 3}
    _same(net.state_dict(), make_net().state_dict())
    assert not marker.exists()
