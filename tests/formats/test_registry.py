"""The format registry (ckptfix.formats.registry): which format a path is, asked of one ordered table."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.conversion.files import convert_file
from ckptfix.diffing import diff_files
from ckptfix.errors import CkptfixError, FormatError
from ckptfix.formats import registry
from ckptfix.formats.rankfile import rank_file_refusal
from ckptfix.formats.records import FolderRecords
from ckptfix.formats.registry import FORMATS, Format, ReadOptions, detect, detect_format
from ckptfix.formats.safety.allowlist import ShardedCheckpointError
from ckptfix.reading import open_checkpoint
from tests import sharded_writers
from tests.extras import needs
from tests.models import SmallNet, make_file

FIXTURES = Path(__file__).parents[2] / "fixtures"


def test_the_table_keeps_the_names_code_and_json_use() -> None:
    assert {f.name for f in FORMATS} == {"torch-zip", "torch-legacy", "safetensors", "folder"}
    kinds = [f.kind for f in FORMATS]
    assert len(kinds) == len(set(kinds))
    # DCP and DeepSpeed folders are asked before any other folder; safetensors before a JSON index
    assert kinds.index("dcp") < kinds.index("hf") and kinds.index("deepspeed") < kinds.index("hf")
    assert kinds.index("safetensors") < kinds.index("hf")


@pytest.mark.parametrize(
    ("path", "name", "kind"),
    [
        ("single.pt", "torch-zip", "torch-zip"),
        ("legacy_dp.pt", "torch-legacy", "torch-legacy"),
        ("ddp_wrapped.safetensors", "safetensors", "safetensors"),
        ("deepspeed/zero1_fp32", "folder", "deepspeed"),
    ],
)
def test_fixtures_are_claimed_by_their_format(path: str, name: str, kind: str) -> None:
    found = detect(FIXTURES / path)
    assert (found.name, found.kind) == (name, kind)
    assert detect_format(FIXTURES / path) == name


def test_folders_are_told_apart_by_what_they_hold(tmp_path: Path, single: Path) -> None:
    assert (detect(single).name, detect(single).kind) == ("folder", "dcp")
    state = SmallNet().state_dict()
    ckptfix.save(state, f"{tmp_path / 'shards'}/", shard_size=1024)
    assert detect(tmp_path / "shards").kind == "hf"
    index = next((tmp_path / "shards").glob("*.index.json"))
    assert (detect(index).name, detect(index).kind) == ("folder", "hf")
    loaded = ckptfix.load(index)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_file_is_probed_once_and_refusals_keep_their_words(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"x")
    shard = tmp_path / "__0_0.distcp"
    torch.save({"x": torch.zeros(1)}, shard)
    with pytest.raises(FormatError, match=r"is one data file of a torch\.distributed\.checkpoint folder"):
        detect(shard)
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(struct.pack("<Q", 1000) + b'{"x": 1}')
    with pytest.raises(FormatError, match="safetensors header runs past the end of the file"):
        detect(truncated)
    text = tmp_path / "notes.txt"
    text.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(FormatError, match=r"not a checkpoint ckptfix can read .* found bytes b'hello wo'"):
        detect(text)


def _toy_load(p: object, options: ReadOptions) -> dict[str, torch.Tensor]:
    """A new format's loader: JSON lists as tensors (a file after its 9-byte magic, a folder's toy.json)."""
    path = Path(str(p))
    data = json.loads((path / "toy.json").read_bytes() if path.is_dir() else path.read_bytes()[9:])
    return {k: torch.tensor(v) for k, v in data.items()}


@pytest.mark.parametrize("folder", [False, True])
def test_a_new_format_is_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: bool) -> None:
    """What adding a format takes: a claim, a loader and a row in FORMATS. detect, load, convert, inspect and diff
    then read it (by its loader, on the torch path); the formats before it are unchanged."""
    values = {"x": [1.0, 2.0]}
    if folder:  # a folder format comes before the catch-all folder (hf), as DCP and DeepSpeed do
        path = tmp_path / "run"
        path.mkdir()
        (path / "toy.json").write_text(json.dumps(values))
        toy = Format("folder", "toy", lambda probe: probe.folder and (Path(probe.path) / "toy.json").is_file(),
                     _toy_load)  # fmt: skip
        monkeypatch.setattr(registry, "FORMATS", (*FORMATS[:-1], toy, FORMATS[-1]))
    else:
        path = tmp_path / "weights.toy"
        path.write_bytes(b"TOYFMT01\n" + json.dumps(values).encode())
        toy = Format("toy", "toy", lambda probe: probe.head.startswith(b"TOYFMT01"), _toy_load)
        monkeypatch.setattr(registry, "FORMATS", (*FORMATS, toy))
    assert detect(path) is toy and detect_format(path) == toy.name
    assert torch.equal(ckptfix.load(path)["x"], torch.tensor([1.0, 2.0]))
    done = ckptfix.convert_file(path, tmp_path / "out.safetensors")
    assert done.method == "torch"
    assert torch.equal(ckptfix.load(tmp_path / "out.safetensors")["x"], torch.tensor([1.0, 2.0]))
    assert diff_files(path, tmp_path / "out.safetensors").equal
    assert detect(FIXTURES / "single.pt").kind == "torch-zip"


def test_a_new_output_format_is_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What writing a format takes: its row's ``output`` name and ``write`` slot; registry.write asks no other place,
    and a folder format's ``wrote`` is its "wrote" line."""
    written: list[tuple[Any, str, registry.WriteOptions]] = []
    toy = Format(
        "folder",
        "toy",
        lambda probe: False,
        _toy_load,
        output="toy",
        write=lambda obj, path, options: written.append((obj, str(path), options)),
        wrote="toy folder",
    )
    monkeypatch.setattr(registry, "FORMATS", (toy, *FORMATS))
    registry.write({"x": 1}, tmp_path / "out", fmt="toy", overwrite=True)
    assert written == [({"x": 1}, str(tmp_path / "out"), registry.WriteOptions(overwrite=True))]
    assert registry.describe_output(tmp_path / "out", fmt="toy", shard_size=None) == "toy folder"
    with pytest.raises(ValueError, match="not an output format"):
        registry.write({}, tmp_path / "out", fmt="nope")


def _prefix(path: object) -> str:
    return str(json.loads((Path(str(path)) / "toy.json").read_bytes())["prefix"])


def _toy_folder_load(p: object, options: ReadOptions) -> dict[str, torch.Tensor]:
    """A folder format's loader: a DCP folder's tensors, renamed by the prefix its toy.json names."""
    from ckptfix.formats.dcp.load import load_dcp

    return {_prefix(p) + k: v for k, v in load_dcp(str(p), allow_globals=options.allow_globals).items()}


def _toy_records(path: str, allow_globals: tuple[str, ...]) -> FolderRecords:
    """The same folder as records, no tensor byte read: each tensor its DCP chunks, under its new name."""
    from ckptfix.formats.dcp.reader import DcpTensor, read_dcp

    d, prefix = read_dcp(path), _prefix(path)
    tree = {prefix + k: DcpTensor(prefix + k, entry) for k, entry in d.tensors.items()}
    files = [str(Path(path) / "toy.json"), str(Path(path) / ".metadata"), *sorted(d.files)]
    return FolderRecords(tree, "toy folder", files, summary={"prefix": prefix})


def _toy_describe(summary: dict[str, Any]) -> tuple[str, list[str]]:
    data = [f for f in summary["folder"]["files"] if f.endswith(".distcp")]
    return f"toy folder ({len(data)} data files)", [f"toy: names prefixed {summary['toy']['prefix']}"]


def test_a_folder_format_read_as_records_is_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder format whose tensors are records says so in its row alone (``records``, ``describe``): load,
    convert (streamed, no torch load), inspect (text and --json) and diff then read it; no other module is touched."""
    from click.testing import CliRunner

    from ckptfix.cli import cli
    from ckptfix.torchcompat import dcp_save_local

    state = SmallNet().state_dict()
    path = tmp_path / "run"
    dcp_save_local(state, checkpoint_id=str(path))  # the real writer's folder, and the toy's file beside it
    (path / "toy.json").write_text(json.dumps({"prefix": "toy."}))
    claims = lambda probe: probe.folder and (Path(probe.path) / "toy.json").is_file()  # noqa: E731
    toy = Format(
        "folder", "toy", claims, _toy_folder_load, records=_toy_records, describe=_toy_describe, beside=("dcp",)
    )  # a DCP folder and more, as Megatron's: DCP's claim is met by design
    monkeypatch.setattr(registry, "FORMATS", (toy, *FORMATS))
    assert detect(path) is toy
    expected = {f"toy.{k}": v for k, v in state.items()}
    loaded = ckptfix.load(path)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], v) for k, v in expected.items())

    done = ckptfix.convert_file(path, tmp_path / "out.safetensors")
    assert done.method == "stream"
    assert any(n.startswith(f"toy folder -> safetensors: {len(state)} tensors") for n in done.notes)
    out = ckptfix.load(tmp_path / "out.safetensors")
    assert out.keys() == expected.keys() and all(torch.equal(out[k], v) for k, v in expected.items())
    assert diff_files(path, tmp_path / "out.safetensors").equal

    text = CliRunner().invoke(cli, ["inspect", str(path)])
    assert text.exit_code == 0, text.output
    data = len(list(path.glob("*.distcp")))
    assert text.output.splitlines()[0].startswith(f"{path}: toy folder ({data} data files) state dict, ")
    assert text.output.splitlines()[1] == "toy: names prefixed toy."
    shown = CliRunner().invoke(cli, ["inspect", str(path), "--json", "--verify"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert summary["toy"] == {"prefix": "toy."} and summary["folder"]["kind"] == "toy"
    assert summary["verified"] == "crc" and summary["models"][""]["tensors"] == len(state)


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors"])
@pytest.mark.parametrize("percent", [0, 1, 10, 50, 90, 99])
def test_truncation_anywhere_is_one_line_and_no_output(tmp_path: Path, fmt: str, percent: int) -> None:
    good = make_file(tmp_path, fmt)
    data = good.read_bytes()
    bad = tmp_path / f"cut{good.suffix}"
    bad.write_bytes(data[: len(data) * percent // 100])
    out = tmp_path / "out.pt"
    with pytest.raises(FormatError) as info:
        convert_file(bad, out)
    assert "\n" not in str(info.value) and str(bad) in str(info.value)
    assert not out.exists()
    assert bad.read_bytes() == data[: len(data) * percent // 100]


def test_any_error_is_a_ckptfix_error(tmp_path: Path) -> None:
    # The CLI contract: a user's bad file never surfaces as a raw Python exception.
    for data in (b"PK\x03\x04" + b"\0" * 40, b"\x80\x02" + b"\0" * 40, b"\x10" + b"\0" * 7 + b"{}"):
        path = tmp_path / "x.pt"
        path.write_bytes(data)
        with pytest.raises(CkptfixError):
            ckptfix.load(path)


# Two checkpoints in one folder: every folder format is asked, and two claims are refused naming both.


def _dcp_and_transformers(folder: Path, how: str) -> dict[str, torch.Tensor]:
    """A real DCP folder (torch's writer, one process) with other weights written into it by ``how``: transformers'
    save_pretrained (sharded, so with its index) or safetensors' save_file as model.safetensors; the DCP state."""
    from safetensors.torch import save_file

    from ckptfix.torchcompat import dcp_save_local

    state = SmallNet().state_dict()
    dcp_save_local(state, checkpoint_id=str(folder))
    if how == "save_pretrained":
        transformers = pytest.importorskip("transformers", reason=needs("transformers"))
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
        transformers.GPT2LMHeadModel(config).save_pretrained(folder, max_shard_size="4KB")
    else:
        save_file({"other.weight": torch.ones(3, 3)}, folder / "model.safetensors")
    return state


@pytest.mark.parametrize("how", ["save_pretrained", "save_file"])
def test_a_dcp_folder_holding_transformers_weights_too_is_refused_naming_both(tmp_path: Path, how: str) -> None:
    from tests.measured import refused

    folder = tmp_path / "step-100"
    state = _dcp_and_transformers(folder, how)
    meant = folder / ("model.safetensors.index.json" if how == "save_pretrained" else "model.safetensors")
    with pytest.raises(FormatError, match="holds two checkpoints") as info:
        detect(folder)
    said = str(info.value)
    assert "(DCP) folder (.metadata)" in said and "and transformers weights (an index or model file)" in said
    assert f"pass {meant} for the transformers weights" in said
    message = refused("convert", folder, "out.pt", "--to", "ddp", source=folder, cwd=tmp_path,
                      contains="holds two checkpoints")  # fmt: skip
    assert "move them out of the folder to read a torch.distributed.checkpoint" in message
    weights = ckptfix.load(meant)  # the file named is read as the transformers weights
    assert "lm_head.weight" not in weights and set(weights).isdisjoint(state)
    for name in [meant.name, *(p.name for p in folder.glob("model*.safetensors"))]:
        (folder / name).unlink(missing_ok=True)
    loaded = ckptfix.load(folder)  # moved out: the DCP checkpoint reads as before
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_folders_that_hold_two_things_by_design_keep_their_format(tmp_path: Path) -> None:
    """HF Trainer saves the model beside a DeepSpeed run's tag folder; a Megatron torch_dist folder is a DCP one."""
    import shutil

    run = tmp_path / "checkpoint-1"
    shutil.copytree(FIXTURES / "deepspeed" / "zero1_fp32", run)
    ckptfix.save(SmallNet().state_dict(), run / "model.safetensors")
    assert detect(run).kind == "deepspeed"
    megatron = next(p.parent for p in sorted((FIXTURES / "megatron").rglob("metadata.json")))
    assert detect(megatron).kind == "megatron"


# ----------------------------------------------------------------------------------------------------------------------
# FSDP rank files are told apart by the registry (``registry.rank_kind``) from the one read of their pickle:
# ``inspect`` and ``merge`` both ask it, and neither reads a rank file's pickle twice.


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1"))


@pytest.mark.slow  # real 2-process FSDP2 and FSDP1 runs (gloo)
def test_the_registry_says_which_rank_file_each_is(fsdp2: Path, fsdp1: Path) -> None:
    for path, kind in [(fsdp2 / "rank0.pt", "dtensor"), (fsdp1 / "sharded0.pt", "sharded-tensor")]:
        with open_checkpoint(path, opaque=True, ranks=True) as opened:
            assert opened.rank_kind == kind
    with pytest.raises(ShardedCheckpointError) as refused:
        open_checkpoint(fsdp2 / "rank0.pt", opaque=True)  # read as a full checkpoint: the registry's refusal
    assert str(refused.value) == str(rank_file_refusal("dtensor", source=str(fsdp2 / "rank0.pt")))


@pytest.mark.slow  # real 2-process FSDP2 and FSDP1 runs (gloo)
def test_inspect_reads_a_rank_file_s_pickle_once(fsdp2: Path, pickle_reads: Counter[str]) -> None:
    path = str(fsdp2 / "rank1.pt")
    result = _cli("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["dtensor"]["coordinate"] == [1]
    assert pickle_reads[path] == 1


@pytest.mark.slow  # real 2-process FSDP2 and FSDP1 runs (gloo)
def test_inspect_of_an_fsdp1_rank_file_says_what_it_is(fsdp1: Path) -> None:
    path = fsdp1 / "sharded0.pt"
    result = _cli("inspect", path)
    assert result.exit_code != 0
    assert result.output.strip().endswith(str(rank_file_refusal("sharded-tensor", source=str(path))))
