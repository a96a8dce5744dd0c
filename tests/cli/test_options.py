"""The CLI takes names as people write them and says exactly what it does: dtype and layout spellings, remote
paths, output extensions, exit codes, one size convention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.units import human_bytes
from tests.models import make_net, wrap


@pytest.fixture
def ddp(tmp_path: Path) -> Path:
    path = tmp_path / "ddp.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, path)
    return path


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bf16", torch.bfloat16), ("BF16", torch.bfloat16), ("fp16", torch.float16), ("half", torch.float16),
     ("fp32", torch.float32), ("float", torch.float32), ("torch.float64", torch.float64), ("double", torch.float64)],
)  # fmt: skip
def test_dtype_names_as_people_write_them(ddp: Path, tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "out.pt"), "--dtype", name])
    assert result.exit_code == 0, result.output
    state = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    assert state["head.weight"].dtype == dtype and state["features.1.num_batches_tracked"].dtype == torch.int64


def test_a_bad_dtype_or_layout_names_the_flag_in_the_cli_and_the_keyword_in_the_library(
    ddp: Path, tmp_path: Path
) -> None:
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "o.pt"), "--dtype", "int8"])
    assert result.exit_code == 2 and "--dtype 'int8': not a floating-point dtype" in result.output, result.output
    assert "bf16" in result.output and not (tmp_path / "o.pt").exists()
    for options, word in (({"to": "module"}, "to='module': unknown layout"), ({"dtype": "fp8"}, "dtype='fp8'")):
        with pytest.raises(ckptfix.UsageError, match=word) as caught:
            ckptfix.convert_file(ddp, tmp_path / "o.pt", **options)
        assert isinstance(caught.value, ValueError)


def test_layout_names_are_case_insensitive(ddp: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "c.pt"), "--to", "Compiled"])
    assert result.exit_code == 0, result.output
    assert all(k.startswith("_orig_mod.") for k in torch.load(tmp_path / "c.pt", weights_only=True)["model"])
    ckptfix.convert_file(ddp, tmp_path / "s.pt", to="SINGLE")  # type: ignore[arg-type]
    assert "head.weight" in torch.load(tmp_path / "s.pt", weights_only=True)["model"]


@pytest.mark.parametrize("url", ["s3://bucket/ckpt.pt", "https://example.com/m.safetensors", "hf://org/model"])
def test_a_remote_path_is_said_to_be_one(tmp_path: Path, ddp: Path, url: str) -> None:
    for args in (["convert", url, str(tmp_path / "o.pt")], ["inspect", url], ["convert", str(ddp), url]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and "remote paths are not read yet; download the file first" in result.output


def test_the_extension_message_lists_every_extension_accepted(ddp: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "o.txt")])
    assert result.exit_code == 2 and ".pt, .pth, .bin, .ckpt, .tar (torch) or .safetensors" in result.output
    assert CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "o.ckpt")]).exit_code == 0


def test_help_lists_every_exit_code() -> None:
    text = CliRunner().invoke(cli, ["--help"]).output
    assert all(f"{code} " in text for code in ("0", "1", "2", "3", "141"))


def test_one_size_convention() -> None:
    assert [human_bytes(n) for n in (512, 1_000, 68_900, 1_610_612_736, 2 * 10**12)] == [
        "512 B", "1.0 kB", "68.9 kB", "1.6 GB", "2.0 TB"
    ]  # fmt: skip


def test_convert_and_sanitize_say_what_they_did_as_json(ddp: Path, tmp_path: Path) -> None:
    import json

    out = tmp_path / "m.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(out), "--model-only", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report) == {"input", "output", "method", "dtype", "changes", "kept", "dropped", "notes"}
    assert report["changes"] == [
        {"entry": "model", "layout_from": "ddp", "layout_to": "single", "keys": 16, "renamed": 16}
    ]
    assert report["method"] == "stream" and report["output"] == str(out) and out.exists()
    from argparse import Namespace

    src = tmp_path / "args.pt"
    torch.save({"model": make_net().state_dict(), "args": Namespace(lr=0.1)}, src)
    result = CliRunner().invoke(cli, ["sanitize", str(src), str(tmp_path / "clean.pt"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["converted"] == {"argparse.Namespace -> dict": 1}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--to", "single", "--keep-layout"], "--to single and --keep-layout ask for opposite things"),
        (["--no-fast", "--no-verify"], "--no-verify is the fast path's and --no-fast turns it off"),
    ],
)
def test_options_that_conflict_are_a_usage_error_naming_both(
    ddp: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "o.pt"), *flags])
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["merge", "{ddp}", "{ddp}", "-o", "{out}", "--kwargs", "{{}}"],
         "--kwargs are the --model factory's and no --model was given; add --model or drop --kwargs"),
        (["train", "--out", "{tmp}", "--nproc-per-node", "2"],
         "--nproc-per-node is for --mode ddp and this run is --mode single; drop --nproc-per-node or use --mode ddp"),
        (["train", "--mode", "dp", "--out", "{tmp}", "--rdzv-endpoint", "h:1"],
         "--rdzv-endpoint is for --mode ddp and this run is --mode dp; drop --rdzv-endpoint or use --mode ddp"),
    ],
    ids=["merge-kwargs", "train-nproc", "train-rdzv"],
)  # fmt: skip
def test_an_option_without_the_one_it_needs_is_a_usage_error_naming_both(
    ddp: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    args = [a.format(ddp=ddp, out=tmp_path / "o.pt", tmp=tmp_path / "run") for a in args]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and result.output == f"ckptfix: error: {message}\n", result.output
    assert os.listdir(tmp_path) == ["ddp.pt"]  # nothing run, nothing written


def test_a_bad_shard_size_names_the_flag_in_the_cli_and_the_keyword_in_the_library(ddp: Path, tmp_path: Path) -> None:
    from ckptfix.formats.hf.folder import parse_size

    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "o.safetensors"), "--shard-size", "lots"])
    assert result.exit_code == 2 and result.output.startswith("ckptfix: error: --shard-size 'lots': not a size")
    with pytest.raises(ckptfix.OutputError, match=r"^shard_size='lots': not a size"):
        parse_size("lots")


def test_a_partly_wrapped_state_dict_is_said_to_be_one(tmp_path: Path) -> None:
    state = make_net().state_dict()
    state = {(f"module.{k}" if k.startswith("head") else k): v for k, v in state.items()}
    src = tmp_path / "partial.pt"
    torch.save({"model": state}, src)
    result = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "o.pt")])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "2 of 16 keys start with 'module.' (e.g. 'module.head.weight') and the other 14 do not" in result.output
    assert "--rename '^module\\.='" in result.output and "--keep-layout" in result.output
    fixed = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "o.pt"), "--rename", "^module\\.="])
    assert fixed.exit_code == 0 and "(2 renamed)" in fixed.output, fixed.output
    kept = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "k.pt"), "--keep-layout"])
    assert kept.exit_code == 0, kept.output
    with pytest.raises(ckptfix.LayoutError, match=r"renames='\^module\\\.=', or keep every key as it is with to=None"):
        ckptfix.convert_file(src, tmp_path / "lib.pt")


def test_inspect_columns_hold_when_a_key_group_is_wide(tmp_path: Path) -> None:
    wide = "very.long.module.name." * 6 + "weight"
    torch.save({wide: torch.ones(2), "b": torch.ones(3)}, tmp_path / "wide.pt")
    lines = CliRunner().invoke(cli, ["inspect", str(tmp_path / "wide.pt")]).output.splitlines()
    at = lines.index(f"  {wide}")  # the wide group alone on its line, its details on the next
    details, other = lines[at + 1], next(line for line in lines if line.startswith("  b "))
    assert details.strip() == "float32 [2]" and other.split()[-2:] == ["float32", "[3]"]
    assert details.index("float32") == other.index("float32")


NANO = "import torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))\n"


@pytest.mark.parametrize("command", ["convert", "validate"])
def test_model_factory_in_the_current_folder_is_found_by_every_command(tmp_path: Path, command: str) -> None:
    """``convert --model nano:build`` run from the folder of nano.py could not import it; ``validate`` could."""
    import subprocess
    import sys

    (tmp_path / "nano.py").write_text(NANO)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "run.pt")
    args = {
        "convert": ["convert", "run.pt", "named.pt", "--optimizer-form", "names", "--model", "nano:build"],
        "validate": ["validate", "run.pt", "--model", "nano:build"],
    }[command]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # -P: as a console script runs, without the current folder on sys.path (python -m alone puts it there)
    done = subprocess.run([sys.executable, "-P", "-m", "ckptfix", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    if command == "convert":
        state = torch.load(tmp_path / "named.pt", weights_only=True)["optimizer"]["state"]
        assert sorted(state) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_a_model_factory_that_cannot_be_imported_names_the_flag(tmp_path: Path, ddp: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(ddp), str(tmp_path / "o.pt"), "--model", "no_such_mod_x:build"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.startswith("ckptfix: error: --model 'no_such_mod_x:build': cannot import 'no_such_mod_x' (")
    assert "run from the folder that holds it or add that folder to PYTHONPATH" in result.stderr
    assert not (tmp_path / "o.pt").exists()
