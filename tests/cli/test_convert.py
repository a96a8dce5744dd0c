"""``ckptfix convert`` through the real click group: what it changed, formats, prefixes and renames, usage errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests import st_spec
from tests.inputs import FOLDERS, _hf, _refused
from tests.models import PROBE, make_net


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_convert_reports_what_changed(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "plain.pt"
    result = run("convert", str(ddp_ckpt), str(out))
    assert result.exit_code == 0, result.output
    assert "'model': ddp -> single, 16 keys (16 renamed)" in result.output
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
    result = run("convert", str(src), str(out), "--rename", r"^model\.head\.=classifier.", "--keep-layout", "--force")
    assert result.exit_code == 0, result.output
    assert "classifier.weight" in ckptfix.load(out)["state_dict"]
    result = run("convert", str(src), str(out), "--strip-prefix", "net.", "--force")
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


@pytest.mark.parametrize(
    ("args", "path"),
    [
        ([], "path: stream; pt -> torch: "),
        (["--dtype", "float16"], "path: torch; fast path not taken: casting to float16 needs torch"),
        (["--no-fast"], "path: torch; fast path not taken: the torch path was asked for"),
        (["--unsafe-pickle"], "path: torch; fast path not taken: the unsafe option runs the file's pickle"),
    ],
)
def test_verbose_says_which_path_ran_and_why(tmp_path: Path, ddp_ckpt: Path, args: list[str], path: str) -> None:
    result = run("convert", str(ddp_ckpt), str(tmp_path / "out.pt"), "-v", *args)
    assert result.exit_code == 0, result.output
    assert path in result.output


def test_verbose_names_a_legacy_input(tmp_path: Path) -> None:
    src = tmp_path / "old.pt"
    torch.save({"module.w": torch.ones(2)}, src, _use_new_zipfile_serialization=False)
    result = run("convert", str(src), str(tmp_path / "out.pt"), "-v")
    assert result.exit_code == 0, result.output
    assert "path: torch; fast path not taken: the input is a legacy (pre-1.6, not zip) torch file" in result.output


@pytest.mark.parametrize("no_color", [None, "1"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch"])
def test_convert_prints_hostile_entry_names_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_color: str | None, fast: bool
) -> None:
    """Top-level entry names on the "kept unchanged:" and "dropped (--model-only):" lines (and the entry a layout
    change names) print escaped: a newline, CR, BEL or ESC can neither forge a line nor reach the terminal."""
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    names = ["a\nwrote forged.pt", "b\rwrote", "c\x07", "d\x1b[2J\x1b]0;pwned\x07"]
    src = tmp_path / "in.pt"
    torch.save({"model": {"module.w": torch.zeros(2)}, **{name: 1 for name in names}}, src)
    escaped = ", ".join(repr(name)[1:-1] for name in names)
    no_fast = [] if fast else ["--no-fast"]
    for flags, label in [([], "kept unchanged"), (["--model-only"], "dropped (--model-only)")]:
        out = tmp_path / f"out{len(flags)}.pt"
        result = CliRunner().invoke(cli, ["convert", str(src), str(out), *flags, *no_fast], color=True)
        assert result.exit_code == 0, result.output
        assert not any(c in result.output for c in "\r\x07\x1b"), result.output
        lines = result.stdout.splitlines()
        assert lines == ["'model': ddp -> single, 1 keys (1 renamed)", f"{label}: {escaped}", f"wrote {out}"]


@pytest.mark.parametrize("key", ["", "a\0b", "\ud800"], ids=["empty", "nul", "lone-surrogate"])
def test_keys_safetensors_cannot_hold_are_refused_before_writing(tmp_path: Path, key: str) -> None:
    """What ckptfix writes it reads back: a key .safetensors cannot store is refused on every path (fast, torch,
    sharded, merge), one line naming the output and the key, nothing written; a .pt output keeps it."""
    src = tmp_path / "in.pt"
    torch.save({"model": {key: torch.zeros(2), "w": torch.ones(2)}, "epoch": 1}, src)
    before = sorted(tmp_path.iterdir())
    where = {"fast": tmp_path / "o.safetensors", "torch": tmp_path / "o.safetensors", "shards": f"{tmp_path / 'hf'}/"}
    for how, out in where.items():
        flags = {"fast": [], "torch": ["--no-fast"], "shards": ["--shard-size", "1KB"]}[how]
        result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--model-only", *flags])
        assert result.exit_code == 2, (how, result.output)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptfix: error: "), (how, lines)
        assert f"key {key!r} " in lines[0] and lines[0].endswith("; rename it (--rename) or write a .pt file")
        assert sorted(tmp_path.iterdir()) == before, how
    merged = CliRunner().invoke(cli, ["merge", str(src), str(src), "-o", str(tmp_path / "m.safetensors")])
    assert merged.exit_code == 2 and "rename it (--rename) or write a .pt file" in merged.stderr, merged.output
    assert sorted(tmp_path.iterdir()) == before
    if key != "\ud800":  # .pt stores any key, and ckptfix reads it back
        for flags in ([], ["--no-fast"]):
            out = tmp_path / f"o{len(flags)}.pt"
            assert CliRunner().invoke(cli, ["convert", str(src), str(out), *flags]).exit_code == 0
            assert CliRunner().invoke(cli, ["inspect", str(out)]).exit_code == 0
            assert list(ckptfix.load(out)["model"]) == [key, "w"]


# Inputs are never outputs: an output that is, or sits inside, anything the command reads is refused with exit 2
# naming both, before anything is written (hard and symbolic links included).


@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_an_output_inside_an_input_folder_is_refused(tmp_path: Path, kind: str) -> None:
    folder = FOLDERS[kind](tmp_path / "in")
    victims = sorted(p for p in folder.iterdir() if p.is_file())
    for out in [*(str(p) for p in victims), str(folder / "new.pt"), str(folder / "new.safetensors")]:
        for extra in ([], ["--model-only"], ["--no-fast"]):
            message = _refused(["convert", str(folder), out, *extra], reads=folder, out=out)
            if out.endswith((".pt", ".bin", ".safetensors")):  # others (.metadata, .distcp): a bad extension first
                assert str(folder) in message and "inside the input folder" in message


def test_an_index_files_shards_are_inputs_too(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "in", "model.safetensors")
    (index,) = folder.glob("*.index.json")
    shard = next(p for p in sorted(folder.glob("*.safetensors")))
    message = _refused(["convert", str(index), str(shard)], reads=folder, out=str(shard))
    assert "which the input" in message and str(index) in message
    # beside the shards, a new file reads nothing it overwrites: allowed
    result = CliRunner().invoke(cli, ["convert", str(index), str(folder / "single.safetensors"), "--to", "single"])
    assert result.exit_code == 0, result.output


# Faithful to what torch and safetensors write: math bits, container types, key order of empty tensors.


@pytest.mark.parametrize("flag", [[], ["--no-fast"]], ids=["fast", "torch"])
def test_cli_convert_resolves_math_bits_and_inspect_reads_them(tmp_path: Path, flag: list[str]) -> None:
    state = {"w": torch.conj(torch.tensor([1 + 2j, 3 - 4j]))}
    torch.save(state, tmp_path / "c.pt")
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(tmp_path / "c.pt"), str(tmp_path / "c.safetensors"), *flag])
    assert result.exit_code == 0, result.output
    assert torch.equal(st_spec.load_file(tmp_path / "c.safetensors")["w"], torch.tensor([1 - 2j, 3 + 4j]))
    for path in ("c.pt", "c.safetensors"):
        shown = runner.invoke(cli, ["inspect", str(tmp_path / path)])
        assert shown.exit_code == 0, shown.output


@pytest.mark.parametrize("flag", [[], ["--no-fast"]], ids=["fast", "torch"])
def test_cli_convert_keeps_a_dict(tmp_path: Path, flag: list[str]) -> None:
    torch.save({"x": torch.randn(2, 2)}, tmp_path / "a.pt")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), *flag])
    assert result.exit_code == 0, result.output
    assert type(torch.load(tmp_path / "b.pt", weights_only=True)) is dict


# ----------------------------------------------------------------------------------------------------------------------
# ``ckptfix convert IN OUT/ --format hf|dcp|safetensors|pt``: a folder OUT's format chosen, and named in "wrote".


def _fits(state: Any) -> None:
    net = make_net(seed=3)
    net.load_state_dict(state, strict=True)
    assert torch.equal(net(PROBE), make_net()(PROBE))


def test_a_folder_without_format_is_a_dcp_folder_and_says_so(tmp_path: Path, ddp_ckpt: Path) -> None:
    result = run("convert", ddp_ckpt, f"{tmp_path / 'out'}/")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"wrote {tmp_path / 'out'}/ (DCP folder)"
    assert (tmp_path / "out" / ".metadata").is_file()
    _fits(ckptfix.load(tmp_path / "out")["model"])


def test_format_safetensors_writes_one_file_in_the_folder(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "st"
    result = run("convert", ddp_ckpt, f"{out}/", "--format", "safetensors", "--model-only")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == f"wrote {out}/ (safetensors file model.safetensors in the folder)"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    _fits(ckptfix.load(out / "model.safetensors"))


@pytest.mark.parametrize(("fmt", "ext"), [("safetensors", "safetensors"), ("pt", "pt")])
def test_format_with_shard_size_writes_shards_and_an_exact_index(
    tmp_path: Path, ddp_ckpt: Path, fmt: str, ext: str
) -> None:
    out = tmp_path / "shards"
    result = run("convert", ddp_ckpt, f"{out}/", "--format", fmt, "--shard-size", "1kB", "--model-only")
    assert result.exit_code == 0, result.output
    shards = sorted(p.name for p in out.iterdir() if not p.name.endswith(".index.json"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.{ext}"
    index = json.loads((out / f"model.{ext}.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert result.output.splitlines()[-1] == (
        f"wrote {out}/ ({len(shards)} {'torch' if fmt == 'pt' else fmt} shards and their index model.{ext}.index.json)"
    )
    _fits(ckptfix.load(out))


def test_shard_size_alone_still_writes_safetensors_shards_and_names_them(tmp_path: Path, ddp_ckpt: Path) -> None:
    out = tmp_path / "hf"
    result = run("convert", ddp_ckpt, f"{out}/", "--shard-size", "1kB", "--model-only")
    assert result.exit_code == 0, result.output
    assert "safetensors shards and their index model.safetensors.index.json)" in result.output.splitlines()[-1]


@pytest.mark.parametrize(
    ("out", "extra", "message"),
    [
        ("x.pt", ["--format", "dcp"], "x.pt: --format dcp writes a folder; end OUT with /"),
        ("x.pt", ["--format", "hf"], "x.pt: --format hf writes a folder; end OUT with /"),
        ("x.pt", ["--format", "safetensors"], "x.pt: its extension says torch, --format says safetensors"),
        ("d/", ["--format", "dcp", "--shard-size", "1kB"], "--shard-size writes transformers shards, --format dcp"),
    ],
)
def test_a_format_that_contradicts_out_is_a_usage_error(
    tmp_path: Path, ddp_ckpt: Path, out: str, extra: list[str], message: str
) -> None:
    result = run("convert", ddp_ckpt, f"{tmp_path}/{out}", *extra)
    assert result.exit_code == 2
    assert message in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp.pt"]


def test_library_call_takes_the_format(tmp_path: Path, ddp_ckpt: Path) -> None:
    result = ckptfix.convert_file(ddp_ckpt, f"{tmp_path / 'lib'}/", format="safetensors", model_only=True)
    assert result.wrote == "safetensors file model.safetensors in the folder"
    _fits(ckptfix.load(tmp_path / "lib" / "model.safetensors"))
