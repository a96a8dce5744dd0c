"""The ckptfix command group: exit codes, one-line errors, --debug, shared read options, SIGPIPE, torch-free --help."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import _COMMANDS, cli
from tests.models import make_net


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def test_unsafe_file_exit_2_and_allow_global(tmp_path: Path) -> None:
    import argparse

    src = tmp_path / "ns.pt"
    torch.save({"model": make_net().state_dict(), "args": argparse.Namespace(lr=0.5)}, src)
    result = run("inspect", str(src))  # not needed there: listed, unbuilt
    assert result.exit_code == 0 and "entry 'args': argparse.Namespace ×1, not loaded" in result.output
    result = run("convert", str(src), str(tmp_path / "o.safetensors"))  # needed there
    assert result.exit_code == 2
    assert "--allow-global argparse.Namespace" in result.output
    result = run("convert", str(src), str(tmp_path / "o.pt"), "--allow-global", "argparse.Namespace")
    assert result.exit_code == 0, result.output


def test_debug_shows_traceback_and_keeps_the_exit_code(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--debug", "inspect", str(tmp_path / "nope.pt")])
    assert result.exit_code == 2  # as without --debug: scripts branch on it
    assert "Traceback (most recent call last)" in result.stderr and "FormatError" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("ckptfix: error: ")


def test_python_m_and_help_do_not_import_torch() -> None:
    code = "import sys; from ckptfix.cli import cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    result = subprocess.run([sys.executable, "-m", "ckptfix", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "convert" in result.stdout and "inspect" in result.stdout


# What start-up may not import: every command's module but the one run, and what only other commands use.
_NOT_FOR_CONVERT = {"torch", "ckptfix.merging.files", "ckptfix.diffing", "ckptfix.reading", "ckptfix.summary",
                    "ckptfix.writing", "ckptfix.formats.hf.folder", "ckptfix.trainer", "tempfile"}  # fmt: skip
_COMMAND_MODULES = {f"ckptfix.cli.{name}" for name in ("convert", "inspect", "diff", "merge", "validate", "sanitize",
                                                       "train")}  # fmt: skip
_HELPED = ("diff", "inspect", "merge", "sanitize", "validate")  # train's --help imports its trainer's options


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (["--help"], set()),
        (["convert", "--help"], {"ckptfix.cli.convert"}),
        *(([name, "--help"], {f"ckptfix.cli.{name}"}) for name in _HELPED),
        (["convert", "in.pt", "out.pt"], {"ckptfix.cli.convert"}),
        (["convert", "in.pt", "out.pt", "--no-verify"], {"ckptfix.cli.convert"}),
        (["convert", "in.pt", "out.safetensors"], {"ckptfix.cli.convert"}),
    ],
    ids=["help", "convert-help", *(f"{n}-help" for n in _HELPED), "pt-pt", "pt-pt-no-verify", "pt-st"],
)
def test_start_up_imports_only_what_the_command_runs(tmp_path: Path, args: list[str], allowed: set[str]) -> None:
    torch.save({"module.w": torch.ones(2)}, tmp_path / "in.pt")
    code = (
        "import sys\nfrom ckptfix.cli import main\ntry:\n    main()\nfinally:\n"
        "    open('modules.txt', 'w').write('\\n'.join(sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    modules = set((tmp_path / "modules.txt").read_text().split())
    assert "ckptfix.cli" in modules
    assert (modules - _click_imports()) & ((_COMMAND_MODULES - allowed) | _NOT_FOR_CONVERT) == set()


@functools.cache
def _click_imports() -> frozenset[str]:
    """What the interpreter and click import by themselves here (some releases of click import tempfile)."""
    code = "import sys, click; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return frozenset(out.split())


# Start-up of the commands that need no tensor arithmetic: no torch (its import is seconds and 200 MB). The files
# are named by the test below; the last line on stderr is what an exit hook saw.
_TORCH_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print(f'torch imported: {\"torch\" in sys.modules}', file=sys.stderr))\n"
    "from ckptfix.cli import main\n"
    "sys.argv[0] = 'ckptfix'\n"
    "main()\n"
)
_NO_TENSOR_ARITHMETIC = {
    **{f"{' '.join(args)}": (args, 0) for args in (["--help"], ["--version"], *([c, "--help"] for c in _COMMANDS))},
    "diff same file": (["diff", "a.pt", "a.pt"], 0),
    "diff equal, other layout": (["diff", "a.pt", "single.pt"], 0),
    "diff equal, safetensors": (["diff", "a.pt", "w.safetensors", "--entry", "model"], 0),
    "diff keys, shapes and entries differ": (["diff", "a.pt", "changed.pt"], 1),
    "diff --json keys differ": (["diff", "a.pt", "changed.pt", "--json"], 1),
    "merge identical ranks": (["merge", "a.pt", "single.pt", "-o", "out.pt"], 0),
    "merge identical ranks to safetensors": (["merge", "a.pt", "a.pt", "-o", "out.safetensors", "--model-only"], 0),
}
# Where values differ, |Δ| and the mean of BatchNorm statistics are computed with torch.
_TENSOR_ARITHMETIC = {
    "diff values differ": (["diff", "a.pt", "values.pt"], 1),
    "merge averages statistics": (["merge", "a.pt", "values.pt", "-o", "out.pt"], 0),
}


@pytest.fixture(scope="module")
def probe_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("startup")
    single = make_net().state_dict()
    ddp = {f"module.{k}": v for k, v in single.items()}
    optimizer = {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    torch.save({"model": ddp, "optimizer": optimizer, "epoch": 1}, folder / "a.pt")
    torch.save({"model": single, "optimizer": optimizer, "epoch": 1}, folder / "single.pt")
    ckptfix.save(single, folder / "w.safetensors")
    changed = {k: v for k, v in list(single.items())[1:]}  # one key fewer, one more, one shape changed
    changed["extra.weight"] = torch.zeros(2)
    changed["head.bias"] = torch.zeros(changed["head.bias"].numel() + 1)
    torch.save({"model": changed, "optimizer": {**optimizer, "param_groups": []}, "epoch": 2}, folder / "changed.pt")
    values = {k: v + 1 if k.endswith("running_mean") else v for k, v in single.items()}
    torch.save({"model": values, "optimizer": optimizer, "epoch": 1}, folder / "values.pt")
    return folder


@pytest.mark.parametrize("case", [*_NO_TENSOR_ARITHMETIC, *_TENSOR_ARITHMETIC])
def test_torch_is_imported_only_for_tensor_arithmetic(probe_files: Path, case: str, tmp_path: Path) -> None:
    args, code = {**_NO_TENSOR_ARITHMETIC, **_TENSOR_ARITHMETIC}[case]
    where = {a: tmp_path if a.startswith("out.") else probe_files for a in args if a.endswith((".pt", ".safetensors"))}
    args = [str(where[a] / a) if a in where else a for a in args]
    proc = subprocess.run([sys.executable, "-c", _TORCH_PROBE, *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == f"torch imported: {case in _TENSOR_ARITHMETIC}", proc.stderr


def test_merge_help_lists_the_buffer_strategies_of_the_merge() -> None:
    from ckptfix.cli import merge
    from ckptfix.merging import files as merging

    assert merge.BUFFER_STRATEGIES == merging.BUFFER_STRATEGIES


def test_a_misspelled_command_is_named_with_the_one_meant() -> None:
    import click

    result = run("convrt", "a.pt", "b.pt")
    assert result.exit_code == 2 and "No such command 'convrt'." in result.output
    if hasattr(click.exceptions, "NoSuchCommand"):  # click 8.4 and later suggest
        assert "Did you mean 'convert'?" in result.output


def test_help_lists_every_command_with_the_first_sentence_of_its_help() -> None:
    import importlib
    import pkgutil

    import click

    import ckptfix.cli as package

    eager = click.Group("ckptfix")
    for info in pkgutil.iter_modules(package.__path__):
        for command in getattr(importlib.import_module(f"ckptfix.cli.{info.name}"), "COMMANDS", []):
            eager.add_command(command)

    def listing(group: click.Group, width: int) -> str:
        with click.Context(group, terminal_width=width, max_content_width=width) as ctx:
            formatter = ctx.make_formatter()
            group.format_commands(ctx, formatter)
            return formatter.getvalue()

    assert len(eager.commands) == 7
    for width in (200, 80):  # whole sentences, then shortened as click shortens them
        assert listing(cli, width) == listing(eager, width)


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


def test_help_says_what_ckptfix_reads_and_writes() -> None:
    text = run("--help").output
    for name in ("DataParallel", "DDP", "torch.compile", "FSDP", "DCP", "DeepSpeed", "Megatron", "safetensors",
                 "from_pretrained", "Weights-only", "-q, --quiet", "completion"):  # fmt: skip
        assert name in text, name


def _commands(rank_files: list[Path], out: Path) -> dict[str, tuple[list[str], int]]:
    """One run of each command that prints for people (notes and warnings on stderr included), and its exit code."""
    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    model = ["--model", "tests.models:SmallNet"]
    return {
        "convert": (["convert", str(rank_files[0]), str(out / "c.safetensors"), "-v"], 0),
        "inspect": (["inspect", str(rank_files[0])], 0),
        "diff": (["diff", str(rank_files[0]), str(rank_files[1])], 1),
        "merge": (["merge", str(rank_files[0]), str(rank_files[0]), "-o", str(out / "m.pt")], 0),  # a warning
        "validate": (["validate", str(rank_files[0]), *model], 1),
        "sanitize": (["sanitize", str(fixtures / "namespace_args.pt"), str(out / "s.pt")], 0),
    }


@pytest.mark.parametrize("command", ["convert", "inspect", "diff", "merge", "validate", "sanitize"])
def test_quiet_prints_only_errors_and_json(rank_files: list[Path], tmp_path: Path, command: str) -> None:
    args, code = _commands(rank_files, tmp_path / "loud")[command]
    (tmp_path / "loud").mkdir()
    loud = run(*args)
    assert loud.exit_code == code and loud.stdout, loud.output
    assert loud.stderr or command not in ("convert", "merge")  # -v's path line, merge's warnings
    args, _ = _commands(rank_files, tmp_path)[command]
    quiet = run("-q", *args)
    assert (quiet.exit_code, quiet.output) == (code, ""), quiet.output
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        p.name for p in (tmp_path / "loud").iterdir()
    )
    if command != "sanitize":  # no --json there
        shutil.rmtree(tmp_path / "loud")
        (tmp_path / "loud").mkdir()
        as_json = run("-q", *_commands(rank_files, tmp_path / "loud")[command][0], "--json")
        assert as_json.exit_code == code and json.loads(as_json.stdout) and not as_json.stderr


def test_quiet_keeps_errors_and_their_exit_codes(tmp_path: Path) -> None:
    result = run("--quiet", "inspect", str(tmp_path / "missing.pt"))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"ckptfix: error: {tmp_path / 'missing.pt'}: no such file; check the path\n"
    result = run("-q", "convert", str(tmp_path / "missing.pt"), str(tmp_path / "o.pt"), "--to", "module")
    assert result.exit_code == 2 and "Invalid value for '--to'" in result.stderr


def test_quiet_silences_the_libraries_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    def warns(*args: Any, **kwargs: Any) -> dict[str, Any]:
        warnings.warn("a library warning", UserWarning, stacklevel=1)
        return {}

    monkeypatch.setattr("ckptfix.summary.summarize", warns)
    result = run("-q", "inspect", str(tmp_path / "x.pt"), "--json")
    assert result.exit_code == 0 and result.stdout == "{}\n" and result.stderr == "", result.output
    with pytest.warns(UserWarning, match="a library warning"):
        assert run("inspect", str(tmp_path / "x.pt"), "--json").exit_code == 0


def test_quiet_train_prints_nothing(tmp_path: Path) -> None:
    from tests.training import SMALL_ARGS

    result = run("-q", "train", "--out", str(tmp_path), "--epochs", "1", *SMALL_ARGS)
    assert (result.exit_code, result.output) == (0, ""), result.output
    assert ckptfix.load(tmp_path / "checkpoint.pt")["epoch"] == 1


def test_the_documented_shell_completion_commands_print_a_script_that_completes() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    shells = re.findall(r"_CKPTFIX_COMPLETE=(\w+)_source ckptfix\b", text)
    assert {"bash", "zsh", "fish"} <= set(shells), shells
    for shell, marker in (
        ("bash", "complete -o nosort -F _ckptfix_completion ckptfix"),
        ("zsh", "compdef _ckptfix_completion ckptfix"),
        ("fish", "complete --no-files --command ckptfix"),
    ):
        env = {**os.environ, "_CKPTFIX_COMPLETE": f"{shell}_source"}
        done = subprocess.run([sys.executable, "-m", "ckptfix"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and marker in done.stdout, done.stdout + done.stderr
    # what the bash script asks for when a person types `ckptfix con<TAB>` and `ckptfix convert a b --to <TAB>`
    for words, cword, want in (("ckptfix con", "1", "plain,convert"), ("ckptfix convert a b --to", "5", "plain,ddp")):
        env = {**os.environ, "_CKPTFIX_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
        done = subprocess.run([sys.executable, "-m", "ckptfix"], env=env, capture_output=True, text=True, timeout=120)
        assert want in done.stdout.splitlines(), done.stdout + done.stderr
