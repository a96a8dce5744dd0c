"""``ckptfix.cli.render``: what only a person at a terminal sees (verdicts in colour, the progress bar's time
remaining), and ``--json`` on every command (below)."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckptfix.cli import cli

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TRAINER = "ckptfix.trainer.model:build_model"
GREEN, RED, YELLOW = "\x1b[32m", "\x1b[31m", "\x1b[33m"

VERDICTS = {  # command line -> the colour of its verdict, the verdict's first word
    "validate-ok": (["validate", FIXTURES / "single.pt", "--model", TRAINER], GREEN, "OK"),
    "validate-layout": (["validate", FIXTURES / "ddp_rank0.pt", "--model", TRAINER], YELLOW, "layout only"),
    "validate-fail": (["validate", FIXTURES / "single.pt", "--model", "tests.models:wrong_head"], RED, "FAIL"),
    "diff-equal": (["diff", FIXTURES / "ddp_wrapped.pt", FIXTURES / "ddp_wrapped.pt"], GREEN, "equal"),
    "diff-different": (["diff", FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"], RED, "different"),
}


def run(args: list[str | Path], *, color: bool) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], color=color)


@pytest.mark.parametrize("case", VERDICTS)
def test_verdicts_are_coloured_on_a_terminal_only(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args, colour, label = VERDICTS[case]
    monkeypatch.delenv("NO_COLOR", raising=False)
    plain = run(args, color=False)  # stdout is not a terminal (a pipe, a file): no escape sequence at all
    assert "\x1b" not in plain.output
    verdicts = [line for line in plain.stdout.splitlines() if line.startswith(label)]
    assert len(verdicts) == 1
    coloured = run(args, color=True)  # as on a terminal
    assert coloured.exit_code == plain.exit_code
    assert f"{colour}\x1b[1m{label}\x1b[0m{verdicts[0][len(label) :]}" in coloured.stdout.splitlines()
    assert coloured.stdout.count("\x1b[0m") == 1  # the verdict's label alone
    monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org: even on a terminal
    assert run(args, color=True).output == plain.output


def test_json_is_never_coloured() -> None:
    result = CliRunner().invoke(cli, ["validate", str(FIXTURES / "single.pt"), "--model", TRAINER, "--json"],
                                color=True)  # fmt: skip
    assert result.exit_code == 0 and "\x1b" not in result.output


def test_the_progress_bar_shows_the_time_remaining(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ckptfix.stream import progress

    kinds = [type(c) for c in progress.columns()]
    assert {BarColumn, DownloadColumn, TransferSpeedColumn, TimeRemainingColumn} <= set(kinds)
    assert kinds[-1] is TimeRemainingColumn  # last, where a person looks for it
    shown: list[Progress] = []
    real = Progress

    def watched(*columns: object, **kwargs: object) -> Progress:
        bar = real(*columns, **kwargs)  # type: ignore[arg-type]
        shown.append(bar)
        return bar

    monkeypatch.setattr("rich.progress.Progress", watched)
    terminal = io.StringIO()
    terminal.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress.progress_bar(progress.THRESHOLD) as advance:
        assert advance is not None
        advance(progress.THRESHOLD // 2)
    (bar,) = shown
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)
    assert bar.console.stderr  # never on stdout, which holds what the command prints (--json)
    with progress.progress_bar(progress.THRESHOLD - 1) as advance:  # small: no bar
        assert advance is None


# ----------------------------------------------------------------------------------------------------------------------
# ``--json`` on every command that reports a result: one JSON object on stdout and nothing else, its keys exactly
# the ones docs/json.md lists, its values the facts the text output gives (on the committed fixtures).


ROOT = Path(__file__).resolve().parents[2]

# Every top-level key each command always prints (docs/json.md: "always"), and those it prints only sometimes.
ALWAYS = {
    "inspect": {"path", "format", "file_bytes", "kind", "models", "other_entries"},
    "convert": {"input", "output", "method", "dtype", "changes", "kept", "dropped", "notes"},
    "sanitize": {"input", "output", "converted", "dropped"},
    "diff": {"a", "b", "equal", "atol", "rtol", "layouts_differ", "entries", "other", "others_compared", "not_loaded",
             "exit_code"},
    "merge": {"inputs", "output", "written", "layout", "buffers", "atol", "parameters_match", "reassembled",
              "left_out", "notes", "entries", "bn_modules", "buffers_merged", "diverged", "warnings",
              "kept_from_first", "layouts_from", "averaged", "weights"},
    "validate": {"source", "entry", "ok", "loads_as_is", "layout_from", "layout_to", "missing", "unexpected",
                 "wrong_shape", "wrong_dtype", "bad_metadata", "load_error", "renamed", "rename_rules", "tied",
                 "renamed_prefix", "not_loaded", "keys", "model", "model_keys", "other_entries", "verdict",
                 "fix_command", "exit_code"},
}  # fmt: skip
SOMETIMES = {"inspect": {"devices", "folder", "dtensor", "loaded_with_torch", "crc_stored", "verified", "deepspeed",
                         "deepspeed_module_file"}}  # fmt: skip
MODEL_KEYS = {"layout", "tensors", "parameters", "tied", "bytes", "dtypes", "batchnorm_buffers", "batchnorm_modules",
              "shared_storage", "non_tensor_keys", "groups"}  # fmt: skip
GROUP_KEYS = {"keys", "count", "shape", "shapes", "dtype", "numel"}


def invoke(*args: str | Path, **kwargs: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], **kwargs)


def as_json(*args: str | Path, code: int = 0) -> dict[str, Any]:
    """The command's JSON, checked to be all of stdout, with the exit code it gives without --json."""
    result = invoke(*args, "--json")
    assert result.exit_code == code, result.output
    data = json.loads(result.stdout)  # raises if anything but one JSON document is on stdout
    assert isinstance(data, dict)
    return data


def documented() -> dict[str, dict[str, str]]:
    """docs/json.md's tables: command -> key -> its "present" column."""
    text = (ROOT / "docs" / "json.md").read_text()
    tables: dict[str, dict[str, str]] = {}
    for command, body in re.findall(r"^## `ckptfix (\w+) --json`\n(.*?)(?=^## |\Z)", text, re.S | re.M):
        rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", body, re.M)
        tables[command] = {key: present.strip() for key, present in rows}
    return tables


def test_the_documented_keys_are_the_printed_ones() -> None:
    docs = documented()
    assert set(docs) == set(ALWAYS)
    for command, keys in docs.items():
        assert {k for k, present in keys.items() if present == "always"} == ALWAYS[command], command
        assert {k for k, present in keys.items() if present != "always"} == SOMETIMES.get(command, set()), command


def test_inspect_json_is_the_text(tmp_path: Path) -> None:
    path = FIXTURES / "ddp_wrapped.pt"
    data = as_json("inspect", path)
    assert set(data) == ALWAYS["inspect"] | {"devices"}
    assert (data["format"], data["kind"], data["file_bytes"]) == ("torch-zip", "checkpoint", path.stat().st_size)
    model = data["models"]["model"]
    assert set(model) == MODEL_KEYS
    assert (model["layout"], model["tensors"], model["parameters"]) == ("ddp", 20, 6076)
    assert model["dtypes"] == {"float32": 17, "int64": 3}
    assert (model["batchnorm_buffers"], model["batchnorm_modules"]) == (9, 3)
    for group in model["groups"]:
        assert set(group) == GROUP_KEYS
    convs, bns, head = model["groups"]
    assert convs["shapes"] == [[8, 1, 3, 3], [16, 8, 3, 3], [32, 16, 3, 3]] and convs["shape"] is None
    assert bns["shapes"] == [[8], [], [16], [32]] and bns["dtype"] == "mixed"
    assert head["shapes"] == [[4, 32], [4]]
    assert data["other_entries"]["epoch"] == "int 1"
    assert data["devices"] == {"cpu": 32}
    text = invoke("inspect", path).stdout
    assert "layout ddp, 20 tensors, 6,076 parameters" in text
    assert "BatchNorm statistics: 9 buffers in 3 modules" in text
    assert "3 × float32 [8, 1, 3, 3], [16, 8, 3, 3], [32, 16, 3, 3]" in text
    assert "15 × mixed [8], [], [16], [32]" in text
    assert "entry 'epoch': int 1" in text and "saved on: cpu ×32" in text


def test_inspect_counts_the_shapes_past_a_few(tmp_path: Path) -> None:
    path = tmp_path / "many.pt"
    torch.save({f"layer.{i}.w": torch.zeros(i + 1) for i in range(6)} | {"one.w": torch.zeros(2, 2)}, path)
    (group, one) = as_json("inspect", path)["models"][""]["groups"]
    assert (group["keys"], group["count"], group["shape"]) == ("layer.{0..5}.w", 6, None)
    assert group["shapes"] == [[1], [2], [3], [4], [5], [6]]
    assert (one["shape"], one["shapes"]) == ([2, 2], [[2, 2]])
    text = invoke("inspect", path).stdout
    assert "6 × float32 [1], [2], [3], [4], … 2 more shapes" in text
    assert re.search(r"one\.w +float32 \[2, 2\]$", text, re.M)


def test_convert_json(tmp_path: Path) -> None:
    out = tmp_path / "half.safetensors"
    data = as_json("convert", FIXTURES / "ddp_wrapped.pt", out, "--model-only", "--dtype", "bf16")
    assert set(data) == ALWAYS["convert"]
    assert (data["method"], data["dtype"], data["output"]) == ("stream", "bfloat16", str(out))  # cast as it streams
    assert data["changes"] == [{"entry": "model", "layout_from": "ddp", "layout_to": "single", "keys": 20,
                                "renamed": 20}]  # fmt: skip
    assert data["kept"] == [] and "epoch" in data["dropped"]
    text = invoke("convert", FIXTURES / "ddp_wrapped.pt", tmp_path / "t.safetensors", "--model-only", "--dtype", "bf16")
    assert "'model': ddp -> single, 20 keys (20 renamed), cast to bfloat16" in text.stdout
    assert f"dropped (--model-only): {', '.join(data['dropped'])}" in text.stdout


def test_sanitize_json(tmp_path: Path) -> None:
    data = as_json("sanitize", FIXTURES / "namespace_args.pt", tmp_path / "clean.pt")
    assert set(data) == ALWAYS["sanitize"]
    assert data["converted"] == {"argparse.Namespace -> dict": 1} and data["dropped"] == []


def test_diff_json_is_the_text() -> None:
    a, b = FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"
    data = as_json("diff", a, b, code=1)
    assert set(data) == ALWAYS["diff"]
    assert (data["equal"], data["exit_code"], data["layouts_differ"]) == (False, 1, False)
    (entry,) = data["entries"]
    assert set(entry) == {"entry_a", "entry_b", "layout_a", "layout_b", "equal", "compared", "only_a", "only_b",
                          "shape", "dtype", "values"}  # fmt: skip
    assert entry["compared"] == 20 and all(set(v) == {"key", "max_abs", "max_rel"} for v in entry["values"])
    assert data["other"] == [{"path": "rank", "a": "0", "b": "1"}]
    text = invoke("diff", a, b).stdout
    assert f"values differ ({len(entry['values'])} of 20 tensors, atol 0, rtol 0):" in text
    for v in entry["values"]:
        assert f"  {v['key']}  max |Δ| {v['max_abs']:.3g}  max rel {v['max_rel']:.3g}" in text
    assert "  rank: 0 -> 1" in text and text.splitlines()[-1] == "different"
    same = as_json("diff", a, a)
    assert (same["equal"], same["exit_code"]) == (True, 0)


def test_merge_json_says_how_buffers_were_combined(tmp_path: Path) -> None:
    ranks = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    data = as_json("merge", *ranks, "-o", tmp_path / "m.pt", "--buffers", "mean", "--to", "ddp")
    assert set(data) == ALWAYS["merge"]
    assert (data["buffers"], data["layout"], data["parameters_match"], data["written"]) == ("mean", "ddp", True, True)
    assert data["inputs"] == [str(r) for r in ranks] and data["layouts_from"] == ["ddp", "ddp"]
    assert data["bn_modules"] == ["features.1", "features.4", "features.7"] and data["diverged"] == []
    text = invoke("merge", *ranks, "-o", tmp_path / "t.pt", "--buffers", "mean", "--to", "ddp").stdout
    assert "BatchNorm statistics (mean): 3 module(s): features.{1,4,7}" in text
    assert "parameters: equal on every rank" in text and f"wrote {tmp_path / 't.pt'} (layout ddp)" in text
    assert f"taken from {ranks[0]}: {', '.join(data['kept_from_first'])}" in text


def test_merge_json_of_ranks_that_disagree(tmp_path: Path) -> None:
    other = torch.load(FIXTURES / "ddp_rank1.pt", weights_only=True)
    other["model"]["module.classifier.bias"] = other["model"]["module.classifier.bias"] + 1
    torch.save(other, tmp_path / "drifted.pt")
    result = invoke("merge", FIXTURES / "ddp_rank0.pt", tmp_path / "drifted.pt", "-o", tmp_path / "m.pt", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)  # the report alone on stdout; the refusal one line on stderr
    assert (data["parameters_match"], data["written"]) == (False, False)
    assert [d["key"] for d in data["diverged"]] == ["classifier.bias"]
    assert result.stderr.startswith("ckptfix: error: ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "m.pt").exists()


def test_a_tolerance_that_is_not_a_finite_number_is_refused_so_json_stays_strict(tmp_path: Path) -> None:
    # JSON has no NaN or Infinity: a tolerance that is not finite (or is negative) is refused at the option, exit 2
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} is not JSON")}
    ranks = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    commands = {"diff": ("diff", FIXTURES / "single.pt", FIXTURES / "single.pt"),
                "merge": ("merge", *ranks, "-o", tmp_path / "m.pt")}  # fmt: skip
    cases = [("diff", "--atol", "inf"), ("diff", "--atol", "nan"), ("diff", "--rtol", "1e400"),
             ("diff", "--rtol", "-1e-6"), ("merge", "--atol", "inf"), ("merge", "--atol", "nan"),
             ("merge", "--atol", "-0.5")]  # fmt: skip
    for command, option, value in cases:
        result = invoke(*commands[command], option, value, "--json")
        assert result.exit_code == 2, (command, option, value, result.output)
        assert result.stdout == ""
        assert result.stderr == (
            f"ckptfix: error: {option} {value}: a tolerance is a finite number, zero or more; give one such as "
            f"{option} 1e-6\n"
        )
    assert not (tmp_path / "m.pt").exists()
    result = invoke(*commands["diff"], "--atol", "1e-6", "--rtol", "0", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout, **strict)["atol"] == 1e-6
    result = invoke(*commands["merge"], "--atol", "0.5", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout, **strict)["atol"] == 0.5


def test_validate_json_is_the_text() -> None:
    path = FIXTURES / "ddp_rank0.pt"
    data = as_json("validate", path, "--model", TRAINER, code=1)
    assert set(data) == ALWAYS["validate"]
    assert (data["ok"], data["loads_as_is"], data["layout_from"], data["layout_to"]) == (True, False, "ddp", "single")
    assert (data["keys"], data["model_keys"], data["model"], data["exit_code"]) == (20, 20, TRAINER, 1)
    lines = invoke("validate", path, "--model", TRAINER).stdout.splitlines()
    assert lines[0] == f"checkpoint: {path} (entry 'model', layout ddp, 20 keys)"
    assert lines[1] == f"model:      {TRAINER} (layout single, 20 keys)"
    assert lines[2:] == [data["verdict"], f"  {data['fix_command']}"]
    ok = as_json("validate", FIXTURES / "single.pt", "--model", TRAINER)
    assert (ok["loads_as_is"], ok["exit_code"], ok["fix_command"]) == (True, 0, None)
    assert ok["verdict"].startswith("OK: ")


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "missing.pt"],
        ["convert", "missing.pt", "out.pt"],
        ["sanitize", "missing.pt", "out.pt"],
        ["diff", "missing.pt", "missing.pt"],
        ["merge", "missing.pt", "-o", "out.pt"],
        ["validate", "missing.pt", "--model", TRAINER],
    ],
    ids=lambda args: args[0],
)
def test_an_error_under_json_is_one_line_on_stderr_and_nothing_on_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, "--json")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("ckptfix: error: missing.pt") and result.stderr.count("\n") == 1
