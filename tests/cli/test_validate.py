"""``ckptfix validate`` through the real click group, on per-rank DDP files and the trainer's fixtures."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

import ckptfix
from ckptfix.cli import cli
from tests.dtype_files import _quantized_linear
from tests.models import Holder, Refusing, SmallNet, TiedLM, make_net

MODEL = "tests.models:SmallNet"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"  # the trainer's (python -m ckptfix.trainer.fixtures)
TRAINER = "ckptfix.trainer.model:build_model"
REPO = Path(__file__).resolve().parents[2]


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("which", [0, 1])
def test_validate_rank_files_prints_the_fix_and_the_fix_works(
    rank_files: list[Path], tmp_path: Path, which: int
) -> None:
    result = run("validate", rank_files[which], "--model", MODEL)
    assert result.exit_code == 1, result.output
    assert "layout only: the checkpoint is ddp, the model single" in result.stdout
    fix = result.stdout.splitlines()[-1].strip()
    out = tmp_path / "fixed.pt"
    assert fix == f"ckptfix convert {rank_files[which]} {rank_files[which].stem}.single.pt --to single"
    words = shlex.split(fix)
    assert run("convert", words[2], out, *words[4:]).exit_code == 0
    ok = run("validate", out, "--model", MODEL)
    assert ok.exit_code == 0 and ok.stdout.endswith("OK: loads with load_state_dict(strict=True)\n")
    assert run("validate", rank_files[which], "--model", MODEL, "--any-layout").exit_code == 0


def test_validate_renamed_model_pairs_and_rule(rank_files: list[Path], tmp_path: Path) -> None:
    result = run("validate", rank_files[0], "--model", "tests.models:RenamedNet")
    assert result.exit_code == 1
    assert "missing from the checkpoint (14):" in result.stdout
    assert "  features.0.weight -> backbone.0.weight" in result.stdout
    out = tmp_path / "fixed.pt"
    words = shlex.split(result.stdout.splitlines()[-1])
    assert words[:2] == ["ckptfix", "convert"] and "--rename" in words
    assert run("convert", words[2], out, *words[4:]).exit_code == 0
    assert run("validate", out, "--model", "tests.models:RenamedNet").exit_code == 0


def test_validate_wrong_shape_and_json(rank_files: list[Path]) -> None:
    result = run("validate", rank_files[0], "--model", "tests.models:small_net", "--kwargs", '{"classes": 5}')
    assert result.exit_code == 1
    assert "wrong shape, checkpoint [3, 4] vs model [5, 4] (1):\n  head.weight" in result.stdout
    assert "FAIL: would not load with strict=True: 2 wrong shape" in result.stdout
    result = run("validate", rank_files[0], "--model", "tests.models:wrong_head", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["exit_code"] == 1 and report["fix_command"] is None
    assert report["wrong_shape"]["head.bias"] == {"checkpoint": [3], "model": [5]}
    assert report["entry"] == "model" and report["layout_from"] == "ddp"


def test_validate_cannot_run_exits_2(rank_files: list[Path], tmp_path: Path) -> None:
    result = run("validate", rank_files[0], "--model", "tests.models:Nope")
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
            f"ckptfix convert {FIXTURES / name} {stem}.single.{ext} --to single --allow-global argparse.Namespace"
        )


@pytest.mark.parametrize("version", ["2", [2]])
def test_validate_refuses_a_batchnorm_version_that_load_state_dict_cannot_compare(tmp_path: Path, version: Any) -> None:
    state = SmallNet().state_dict()
    state._metadata["features.1"]["version"] = version  # type: ignore[attr-defined]
    path = tmp_path / "bad_version.pt"
    torch.save({"model": state}, path)
    with pytest.raises(TypeError):  # what a user's own load_state_dict would do
        SmallNet().load_state_dict(ckptfix.load(path)["model"])
    result = run("validate", path, "--model", MODEL)
    assert result.exit_code == 1 and "Traceback" not in result.output
    problem = (
        f"_metadata version {version!r} is a {type(version).__name__}, not a number, and BatchNorm2d compares it "
        "with 2: delete the version or set it to 2"
    )
    lines = result.stdout.splitlines()
    assert lines[-3:] == [
        "_metadata that load_state_dict refuses (1):",
        f"  module 'features.1': {problem}",
        f"FAIL: would not load with strict=True: 1 bad _metadata (e.g. module 'features.1': {problem})",
    ]
    report = json.loads(run("validate", path, "--model", MODEL, "--json").stdout)
    assert report["ok"] is False and report["bad_metadata"] == {"features.1": problem} and report["exit_code"] == 1


def test_validate_old_batchnorm_checkpoint_without_num_batches_tracked_loads(tmp_path: Path) -> None:
    state = SmallNet().state_dict()
    for key in ("features.1.num_batches_tracked", "features.4.num_batches_tracked"):
        del state[key]
    for path in ("features.1", "features.4"):
        state._metadata[path]["version"] = 1  # type: ignore[attr-defined]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    SmallNet().load_state_dict(ckptfix.load(old))  # torch fills num_batches_tracked in for version 1
    assert run("validate", old, "--model", MODEL).stdout.endswith("OK: loads with load_state_dict(strict=True)\n")
    state._metadata["features.4"]["version"] = 2  # type: ignore[attr-defined]
    torch.save(state, old)
    result = run("validate", old, "--model", MODEL)
    assert (
        result.exit_code == 1 and "missing from the checkpoint (1):\n  features.4.num_batches_tracked" in result.stdout
    )


def test_validate_reports_what_a_trial_load_raises(tmp_path: Path) -> None:
    path = tmp_path / "lin.pt"
    torch.save(Refusing().state_dict(), path)
    result = run("validate", path, "--model", "tests.models:Refusing")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stdout.splitlines()[-1] == (
        "FAIL: would not load with strict=True: load_state_dict raised RuntimeError: Error(s) in loading "
        "state_dict for Refusing: checkpoint too old: re-export it"
    )


def test_validate_prints_hostile_key_names_escaped(tmp_path: Path) -> None:
    state = SmallNet().state_dict()
    state["evil\nOK: loads with load_state_dict(strict=True)\x1b[2J"] = torch.zeros(1)
    path = tmp_path / "evil.pt"
    torch.save(state, path)
    result = run("validate", path, "--model", MODEL)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert "\x1b" not in result.output and "OK: loads with load_state_dict(strict=True)" not in lines
    assert lines[2:4] == [
        "unexpected in the checkpoint (1):",
        r"  evil\nOK: loads with load_state_dict(strict=True)\x1b[2J",
    ]
    assert lines[-1].startswith(r"FAIL: would not load with strict=True: 1 unexpected (e.g. 'evil\nOK: loads")


def test_validate_model_errors_name_the_flags(tmp_path: Path) -> None:
    result = run("validate", tmp_path / "x.pt", "--model", "torch.nn:Linear", "--kwargs", "{bad")
    assert result.exit_code == 2
    assert result.stderr == (
        "ckptfix: error: --kwargs: not valid JSON (Expecting property name enclosed in double quotes at column 2)\n"
    )
    result = run("validate", tmp_path / "x.pt", "--model", "torch.nn.Linear")
    assert result.stderr == (
        "ckptfix: error: --model 'torch.nn.Linear': expected package.module:factory, e.g. torch.nn:Linear\n"
    )


def test_validate_model_from_the_working_folder_does_not_shadow_installed_packages(tmp_path: Path) -> None:
    for name in ("torch", "numpy", "safetensors", "click"):
        (tmp_path / f"{name}.py").write_text(f"open({str(tmp_path / (name + '.ran'))!r}, 'w').close()\n")
    (tmp_path / "mymodels.py").write_text("import torch\n\n\ndef build():\n    return torch.nn.Linear(2, 3)\n")
    torch.save(nn.Linear(2, 3).state_dict(), tmp_path / "linear.pt")
    # As the console script runs: its own folder first on sys.path, not the working folder.
    code = "import sys; sys.path.pop(0); from ckptfix.cli import main; main()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", code, "validate", "linear.pt", "--model", "mymodels:build"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("OK: loads with load_state_dict(strict=True)\n")
    assert sorted(p.name for p in tmp_path.glob("*.ran")) == []


# --- parity with load_into: prefixes, entries, tied keys, every flag in the fix command ------------------------


class Opaque:
    """A user object that only the full unpickler rebuilds (--unsafe-pickle)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def compiled_holder() -> nn.Module:
    """``torch.compile`` of a module that keeps its network as ``self.net``: keys ``_orig_mod.net.…``."""
    return torch.compile(Holder())  # type: ignore[return-value]


def _plain() -> dict[str, torch.Tensor]:
    return make_net().state_dict()


def _ddp() -> dict[str, torch.Tensor]:
    return nn.DataParallel(make_net()).state_dict()


# name: (checkpoint, model, validate flags, the fix's output name, the options the fix must carry)
SCENARIOS: dict[str, tuple[Any, str, list[str], str, list[str]]] = {
    "layout": ({"model": _ddp()}, MODEL, [], "in.single.ckpt", ["--to", "single"]),
    "lightning-prefix": (
        {"state_dict": {f"model.{k}": v for k, v in _plain().items()}, "epoch": 1},
        MODEL, [], "in.fixed.ckpt", ["--strip-prefix", "model.", "--to", "single"],
    ),
    "prefix-under-ddp": (
        {"state_dict": {f"module.model.{k}": v for k, v in _plain().items()}},
        MODEL, [], "in.fixed.ckpt", ["--strip-prefix", "module.model.", "--to", "single"],
    ),
    "add-prefix": (
        {"model": _plain()}, "tests.models:Holder", [], "in.fixed.ckpt",
        ["--to", "single", "--add-prefix", "net."],
    ),
    "add-prefix-compiled": (
        {"model": _ddp()}, "tests.cli.test_validate:compiled_holder", [], "in.fixed.ckpt",
        ["--to", "single", "--add-prefix", "_orig_mod.net."],
    ),
    "ema-entry": (
        {"state_dict": _plain(), "state_dict_ema": _ddp()}, MODEL, ["--entry", "state_dict_ema"], "in.single.ckpt",
        ["--entry", "state_dict_ema", "--to", "single"],
    ),
    "allow-global": (
        {"state_dict": {f"model.{k}": v for k, v in _plain().items()}, "hparams": {"root": pathlib.PosixPath("/d")}},
        MODEL, ["--allow-global", "pathlib.PosixPath"], "in.fixed.ckpt",
        ["--strip-prefix", "model.", "--to", "single", "--allow-global", "pathlib.PosixPath"],
    ),
    "unsafe-pickle": (
        {"model": _ddp(), "extra": Opaque()}, MODEL, ["--unsafe-pickle"], "in.single.ckpt",
        ["--to", "single", "--unsafe-pickle"],
    ),
    "user-strip": (
        {"model": {f"student.{k}": v for k, v in _ddp().items()}}, MODEL, ["--strip-prefix", "student."],
        "in.single.ckpt", ["--strip-prefix", "student.", "--to", "single"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_printed_fix_command_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    checkpoint, model, flags, out, options = SCENARIOS[name]
    path = tmp_path / "run" / "in.ckpt"
    path.parent.mkdir()
    torch.save(checkpoint, path)
    monkeypatch.chdir(tmp_path)  # the fix writes here, not beside the input
    result = run("validate", path, "--model", model, *flags)
    assert result.exit_code == 1, result.output
    words = shlex.split(result.stdout.splitlines()[-1])
    assert words == ["ckptfix", "convert", str(path), out, *options]
    assert run("validate", path, "--model", model, *flags, "--any-layout").exit_code == 0  # load_into adapts it
    converted = run(*words[1:])
    assert converted.exit_code == 0, converted.output
    again = [f for f in flags if f not in ("--strip-prefix", "student.")]  # the fix applied the user's strip
    fixed = run("validate", words[3], "--model", model, *again)
    assert fixed.exit_code == 0, fixed.output
    assert fixed.stdout.splitlines()[-1] == "OK: loads with load_state_dict(strict=True)"


def test_validate_reports_tied_keys_as_loaded(tmp_path: Path) -> None:
    state = TiedLM().state_dict()
    del state["head.weight"]
    torch.save(state, tmp_path / "lm.pt")
    result = run("validate", tmp_path / "lm.pt", "--model", "tests.models:TiedLM")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-3:] == [
        "tied: left out, the same tensor in the model as a key that is there (1):",
        "  head.weight = emb.weight",
        "OK: loads with load_state_dict(strict=True) once the tied keys are passed along (load_into does)",
    ]
    report = json.loads(run("validate", tmp_path / "lm.pt", "--model", "tests.models:TiedLM", "--json").stdout)
    assert report["tied"] == {"head.weight": "emb.weight"} and report["missing"] == []


def test_validate_names_the_other_model_entries(tmp_path: Path) -> None:
    torch.save({"state_dict": _plain(), "state_dict_ema": _plain(), "epoch": 2}, tmp_path / "timm.pth.tar")
    result = run("validate", tmp_path / "timm.pth.tar", "--model", MODEL)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[:2] == [
        f"checkpoint: {tmp_path / 'timm.pth.tar'} (entry 'state_dict', layout single, 16 keys)",
        "            also holds model entries 'state_dict_ema' (check one with --entry NAME)",
    ]
    report = json.loads(run("validate", tmp_path / "timm.pth.tar", "--model", MODEL, "--json").stdout)
    assert report["entry"] == "state_dict" and report["other_entries"] == ["state_dict_ema"]


def test_validate_reads_no_tensor_byte(tmp_path: Path) -> None:
    path = tmp_path / "damaged.pt"
    torch.save({"model": _plain()}, path)
    data = bytearray(path.read_bytes())
    data[data.index(b"data/0") + 200] ^= 0xFF  # inside the first storage record's bytes
    path.write_bytes(bytes(data))
    refused = run("convert", path, tmp_path / "o.pt")  # reading the bytes finds the damage
    assert refused.exit_code == 2 and "CRC" in refused.stderr
    result = run("validate", path, "--model", MODEL)
    assert result.exit_code == 0 and result.stdout.endswith("OK: loads with load_state_dict(strict=True)\n")


def test_a_refusal_names_the_flag_and_the_unsafe_alternative(tmp_path: Path) -> None:
    # in the model entry, which is needed (elsewhere it would be left unbuilt: tests/formats/torchio/test_opaque.py)
    torch.save({"model": {**_plain(), "root": pathlib.PosixPath("/data")}}, tmp_path / "l.ckpt")
    result = run("validate", tmp_path / "l.ckpt", "--model", MODEL)
    assert result.exit_code == 2
    assert "add --allow-global pathlib.PosixPath (" in result.stderr
    assert "--unsafe-pickle opens it too but runs the file's pickle, which can run any code" in result.stderr


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_validate_a_quantized_modules_state_dict(tmp_path: Path) -> None:
    src = tmp_path / "qlinear.pt"
    torch.save(_quantized_linear().state_dict(), src)
    kwargs = ["--kwargs", '{"in_features": 4, "out_features": 3}']
    ok = CliRunner().invoke(cli, ["validate", str(src), "--model", "torch.ao.nn.quantized:Linear", *kwargs])
    assert ok.exit_code == 0, ok.output
    wrong = CliRunner().invoke(cli, ["validate", str(src), "--model", "torch.nn:Linear", *kwargs])
    assert wrong.exit_code == 1, wrong.output  # a plain Linear: missing and unexpected keys, not a crash


def test_the_fix_writes_a_new_file_in_the_current_folder(
    rank_files: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suggested ``convert`` wrote beside the input (into a shared ``fixtures/``) and could name a file that
    exists: it names a free one here, and running it works."""
    monkeypatch.chdir(tmp_path)
    taken = tmp_path / f"{rank_files[0].stem}.single.pt"
    taken.write_bytes(b"someone's")
    fix = json.loads(run("validate", rank_files[0], "--model", MODEL, "--json").stdout)["fix_command"]
    assert fix == f"ckptfix convert {rank_files[0]} {rank_files[0].stem}.single-2.pt --to single"
    assert run(*shlex.split(fix)[1:]).exit_code == 0
    assert run("validate", f"{rank_files[0].stem}.single-2.pt", "--model", MODEL).exit_code == 0
    assert taken.read_bytes() == b"someone's"
    folder = tmp_path / "run_dcp"
    assert run("convert", rank_files[0], f"{folder}/", "--to", "ddp").exit_code == 0
    fix = json.loads(run("validate", folder, "--model", MODEL, "--json").stdout)["fix_command"]
    assert fix == f"ckptfix convert {folder} run_dcp.single.pt --to single"
    assert run(*shlex.split(fix)[1:]).exit_code == 0
