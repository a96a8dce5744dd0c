"""torch.distributed.checkpoint folders: read inertly, reassembled exactly, refused when damaged or hostile."""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner, Result
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptfix
from ckptfix.cli import cli
from ckptfix.diffing import diff_files
from ckptfix.errors import FormatError, OutputError, UnsafeCheckpointError
from ckptfix.formats.dcp import reader as dcp_folders
from ckptfix.torchcompat import dcp_save_local
from tests import sharded_writers, st_spec
from tests.assertions import _assert_values, _bits_state, _values, assert_equal, assert_same
from tests.measured import OUTPUTS, refused
from tests.models import SmallNet
from tests.parity import PATHS
from tests.sharded_writers import _dcp_save, _dcp_truth

_equal = functools.partial(assert_equal, ordered=False)  # DCP keeps no key order


def _torch_truth(folder: Path, tmp: Path) -> Any:
    """What torch's own converter makes of the folder (it unpickles the metadata: only for files we wrote)."""
    dcp_to_torch_save(str(folder), str(tmp / "truth.pt"))
    return torch.load(tmp / "truth.pt", weights_only=False)


def test_a_single_process_dcp_folder_reads_as_what_torch_makes_of_it(single: Path, tmp_path: Path) -> None:
    got = ckptfix.load(single)
    _equal(got, _torch_truth(single, tmp_path))
    _equal(got["model"], SmallNet().state_dict())
    assert got["step"] == 3 and got["opt"]["lr"] == 0.1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_a_two_rank_dcp_folder_is_reassembled_exactly(tmp_path: Path, mode: str) -> None:
    out = sharded_writers.write(tmp_path / mode, mode)
    got = ckptfix.load(out / "dcp")
    _equal(got, _torch_truth(out / "dcp", tmp_path))
    full = torch.load(out / "full.pt", weights_only=True)
    params = {k for k in full["model"] if "running" not in k}  # BatchNorm statistics differ between ranks
    _equal({k: got["model"][k] for k in params}, {k: full["model"][k] for k in params})
    _equal(got["optim"], full["optim"])


# -- damaged and hostile folders ---------------------------------------------------------------------------------


def _rewrite_metadata(folder: Path, edit: Any) -> None:
    path = folder / ".metadata"
    meta = pickle.loads(path.read_bytes())  # our own file: safe to unpickle here
    edit(meta)
    path.write_bytes(pickle.dumps(meta, protocol=4))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_pickle_that_runs_code_is_refused_and_never_run(single: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _rewrite_metadata(single, lambda meta: setattr(meta, "planner_data", _Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"os.system|posix.system"):
        ckptfix.load(single)
    assert not marker.exists()


def _first_tensor(meta: Any) -> tuple[str, Any]:
    return next((k, v) for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks"))


def test_a_missing_data_file_is_named(single: Path) -> None:
    (single / "__0_0.distcp").unlink()
    with pytest.raises(FormatError, match=r"names shard '__0_0.distcp', which is missing"):
        ckptfix.load(single)


def test_a_truncated_data_file_is_refused(single: Path) -> None:
    data = single / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(FormatError, match="the file is truncated: copy the folder again"):
        ckptfix.load(single)


def test_a_data_path_outside_the_folder_is_refused(single: Path) -> None:
    def edit(meta: Any) -> None:
        for index, info in list(meta.storage_data.items()):
            meta.storage_data[index] = dataclasses.replace(info, relative_path="../__0_0.distcp")

    _rewrite_metadata(single, edit)
    with pytest.raises(FormatError, match="a path outside the folder"):
        ckptfix.load(single)


def test_a_tensor_missing_a_chunk_is_refused(single: Path) -> None:
    def edit(meta: Any) -> None:
        _, entry = _first_tensor(meta)
        entry.chunks[0] = dataclasses.replace(entry.chunks[0], sizes=torch.Size([1, *entry.chunks[0].sizes[1:]]))

    _rewrite_metadata(single, edit)
    with pytest.raises(FormatError, match=r"its chunks cover .* elements; the checkpoint is incomplete"):
        ckptfix.load(single)


def test_overlapping_chunks_are_refused(single: Path) -> None:
    def edit(meta: Any) -> None:
        _, entry = _first_tensor(meta)
        entry.chunks.append(entry.chunks[0])

    _rewrite_metadata(single, edit)
    with pytest.raises(FormatError, match="overlapping chunks"):
        ckptfix.load(single)


def test_a_chunk_outside_its_tensor_is_refused(single: Path) -> None:
    def edit(meta: Any) -> None:
        _, entry = _first_tensor(meta)
        entry.chunks[0] = dataclasses.replace(entry.chunks[0], offsets=torch.Size([1, *entry.chunks[0].offsets[1:]]))

    _rewrite_metadata(single, edit)
    with pytest.raises(FormatError, match="outside it"):
        ckptfix.load(single)


def test_one_data_file_alone_says_to_pass_the_folder(single: Path) -> None:
    with pytest.raises(
        FormatError, match=f"one data file of a torch.distributed.checkpoint folder.*pass the folder {single}"
    ):
        ckptfix.load(single / "__0_0.distcp")


# -- writing: one file → a DCP folder torch loads ------------------------------------------------------------------


def test_a_checkpoint_written_as_dcp_loads_in_torch_dcp(tmp_path: Path) -> None:
    torch.manual_seed(1)
    state = {"model": SmallNet().state_dict(), "epoch": 7}
    ckptfix.save(state, f"{tmp_path / 'out'}/")
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary folder left beside it
    target = {"model": SmallNet(seed=5).state_dict(), "epoch": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "out"))  # torch's reader, as a resuming FSDP job calls it
    _equal(target, state)
    _equal(ckptfix.load(tmp_path / "out"), state)


def test_dcp_output_needs_a_new_or_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="exists and is not empty; write to a new or empty folder, or pass overwrite"):
        ckptfix.save({"w": torch.zeros(2)}, tmp_path / "taken")
    assert os.listdir(tmp_path / "taken") == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    ckptfix.save({"w": torch.ones(2)}, tmp_path / "empty")
    _equal(ckptfix.load(tmp_path / "empty"), {"w": torch.ones(2)})


@pytest.mark.slow
def test_fsdp2_resumes_from_a_single_device_checkpoint_converted_to_dcp(tmp_path: Path) -> None:
    model = SmallNet(width=8)
    ckptfix.save({"model": model.state_dict(), "epoch": 2}, tmp_path / "single.pt")
    ckptfix.save(ckptfix.load(tmp_path / "single.pt"), f"{tmp_path / 'dcp'}/")
    resumed = sharded_writers.resume_fsdp2(tmp_path / "dcp", tmp_path / "resumed.pt")
    _equal(resumed, model.state_dict())


# -- streaming: a DCP folder to one .safetensors file ------------------------------------------------------------


def _stream(folder: Path, out: Path) -> Any:
    from ckptfix.conversion.files import ConvertOptions
    from ckptfix.stream.folders import convert_folder

    options = ConvertOptions(model_only=True, entries=("model",))
    return convert_folder(str(folder), str(out), transform=lambda tree: options.apply(tree, source=str(folder)))


def test_a_dcp_model_streams_into_safetensors_as_byte_ranges(single: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    result = _stream(single, tmp_path / "model.safetensors")
    assert result.notes[-1].endswith("16 copied as byte ranges, 0 gathered in memory")
    _equal(load_file(tmp_path / "model.safetensors"), SmallNet().state_dict())


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "gathered"), [("fsdp2", 0), ("ddp", 0), ("fsdp2-cols", 2)])
def test_two_rank_dcp_folders_stream_exactly(tmp_path: Path, mode: str, gathered: int) -> None:
    from safetensors.torch import load_file

    out = sharded_writers.write(tmp_path / mode, mode)
    result = _stream(out / "dcp", tmp_path / "model.safetensors")
    assert result.notes[-1].endswith(f"{gathered} gathered in memory")
    _equal(load_file(tmp_path / "model.safetensors"), _torch_truth(out / "dcp", tmp_path)["model"])


def test_convert_streams_a_dcp_folder_and_writes_one(single: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    out = tmp_path / "model.safetensors"
    done = CliRunner().invoke(cli, ["convert", str(single), str(out), "--model-only", "--entry", "model", "-v"])
    assert done.exit_code == 0, done.output
    assert "path: stream; dcp -> safetensors: 16 tensors, 16 copied as byte ranges" in done.output
    _equal(dict(ckptfix.load(out)), SmallNet().state_dict())
    back = CliRunner().invoke(cli, ["convert", str(out), f"{tmp_path / 'again'}/"])
    assert back.exit_code == 0, back.output
    target = SmallNet(seed=3).state_dict()
    dcp.load(target, checkpoint_id=str(tmp_path / "again"))
    _equal(target, SmallNet().state_dict())


def test_a_corrupt_chunk_is_refused_and_no_output_is_left(single: Path, tmp_path: Path) -> None:
    from ckptfix.conversion.files import ConvertOptions
    from ckptfix.stream.folders import convert_folder

    sharded_writers.corrupt_chunk(single, "model.features.3.weight")
    out = tmp_path / "model.safetensors"
    options = ConvertOptions(model_only=True)
    with pytest.raises(FormatError, match="CRC"):
        convert_folder(str(single), str(out), transform=lambda tree: options.apply(tree, source="x"))
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["dcp"]


def test_a_damaged_chunk_pickle_late_in_the_folder_stops_the_copy_and_leaves_nothing(
    single: Path, tmp_path: Path
) -> None:
    # the last tensor's archive is parsed while the earlier tensors are already being copied on the copy thread
    import threading

    from ckptfix.conversion.files import ConvertOptions
    from ckptfix.stream.folders import convert_folder

    last = list(SmallNet().state_dict())[-1]
    sharded_writers.corrupt_chunk(single, f"model.{last}", record="data.pkl")
    out = tmp_path / "model.safetensors"
    options = ConvertOptions(model_only=True)
    with pytest.raises(FormatError, match=r"__0_0\.distcp.*data\.pkl"):
        convert_folder(str(single), str(out), transform=lambda tree: options.apply(tree, source="x"))
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["dcp"]
    assert not [t for t in threading.enumerate() if t.name == "ckptfix-copy"]


def test_an_error_on_the_copy_thread_reaches_the_caller_and_leaves_nothing(
    single: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.conversion.files import ConvertOptions
    from ckptfix.stream import folders

    def fail(*args: Any) -> str:
        raise FormatError("a data file ended early while copying; it was truncated while reading")

    monkeypatch.setattr(folders, "_write_tensor", fail)
    out = tmp_path / "model.safetensors"
    options = ConvertOptions(model_only=True)
    with pytest.raises(FormatError, match="ended early"):
        folders.convert_folder(str(single), str(out), transform=lambda tree: options.apply(tree, source="x"))
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["dcp"]


def _one_file_per_tensor(folder: Path, count: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemWriter

    state = {f"layer{i}.weight": torch.randn(3, 2, generator=torch.Generator().manual_seed(i)) for i in range(count)}
    dcp_save_local({"model": state}, storage_writer=FileSystemWriter(str(folder), single_file_per_rank=False))
    return state


def _limited(soft: int, hard: int | None, *argv: str) -> Any:
    import resource
    import subprocess
    import sys

    def limit() -> None:  # in the child only: the test process keeps its own limit
        keep = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, keep if hard is None else hard))

    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, preexec_fn=limit, timeout=300)


def test_a_folder_of_more_data_files_than_the_soft_open_file_limit_converts_and_loads(tmp_path: Path) -> None:
    # DCP writes one file per tensor with single_file_per_rank=False (and one per rank: thousands on big jobs)
    state = _one_file_per_tensor(tmp_path / "dcp", 300)
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == 300
    for out in ("model.safetensors", "full.pt"):
        flags = ["--model-only", "--entry", "model"] if out.endswith(".safetensors") else []
        done = _limited(200, None, "-m", "ckptfix", "convert", str(tmp_path / "dcp"), str(tmp_path / out), *flags)
        assert done.returncode == 0, done.stderr
    loaded = ckptfix.load(tmp_path / "model.safetensors")
    _equal(loaded, state)
    _equal(ckptfix.load(tmp_path / "full.pt")["model"], state)
    script = "import sys, ckptfix, torch; sd = ckptfix.load(sys.argv[1])['model']; torch.save(sd, sys.argv[2])"
    done = _limited(200, None, "-c", script, str(tmp_path / "dcp"), str(tmp_path / "loaded.pt"))
    assert done.returncode == 0, done.stderr
    _equal(torch.load(tmp_path / "loaded.pt", weights_only=True), state)


def test_a_hard_open_file_limit_below_the_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    _one_file_per_tensor(tmp_path / "dcp", 300)
    out = tmp_path / "model.safetensors"
    done = _limited(200, 200, "-m", "ckptfix", "convert", str(tmp_path / "dcp"), str(out), "--model-only")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"ckptfix: error: {tmp_path / 'dcp'}: needs 300 files open at once, more than this process may open "
        f"(200); raise the limit (ulimit -n 556, as root or in limits.conf) and run again"
    ]
    assert not out.exists()


# -- inspect and diff ---------------------------------------------------------------------------------------------


def _cli(*args: object) -> Any:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow
def test_inspect_and_diff_a_two_rank_dcp_folder(tmp_path: Path) -> None:
    out = sharded_writers.write(tmp_path / "cols", "fsdp2-cols")  # matrices split by columns: block chunks
    shown = _cli("inspect", out / "dcp")
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0].startswith(f"{out / 'dcp'}: torch.distributed.checkpoint folder (2 data files) checkpoint")
    chunked = {
        line.split()[0]: line.rsplit("(", 1)[1].rstrip(")") for line in lines if line.startswith("  ") and "(" in line
    }
    assert chunked["head.weight"] == "2 block chunks in __0_0.distcp, __1_0.distcp"
    assert chunked["head.bias"] == "2 row chunks in __0_0.distcp, __1_0.distcp"
    assert "entry 'optim': optimizer state: 1 param group(s), state for 10 param(s)" in lines
    torch.save(_torch_truth(out / "dcp", tmp_path), tmp_path / "truth.pt")
    same = _cli("diff", out / "dcp", tmp_path / "truth.pt")
    assert same.exit_code == 0 and same.output.splitlines()[-1] == "equal", same.output
    full = torch.load(out / "full.pt", weights_only=True)  # rank 0's BatchNorm statistics; DCP kept rank 1's
    other = _cli("diff", out / "dcp", out / "full.pt", "--entry", "model")
    assert other.exit_code == 1, other.output
    assert {line.split()[0] for line in other.output.splitlines() if "max |Δ|" in line} == {
        k for k in full["model"] if k.endswith(("running_mean", "running_var"))
    }


def test_diff_refuses_a_corrupt_chunk_in_one_line(single: Path, tmp_path: Path) -> None:
    torch.save(ckptfix.load(single), tmp_path / "same.pt")
    sharded_writers.corrupt_chunk(single, "model.head.weight")
    assert _cli("inspect", single).exit_code == 0  # no tensor byte read
    result = _cli("diff", single, tmp_path / "same.pt")
    assert result.exit_code == 2 and "CRC" in result.output and "__0_0.distcp" in result.output, result.output
    assert result.output.count("\n") == 1


# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


def _dcp(tmp_path: Path, edit: Any) -> Path:
    """A real one-process DCP folder whose Metadata object ``edit`` changes, pickled back as torch does."""
    import pickle

    from ckptfix.torchcompat import dcp_save_local

    folder = tmp_path / "dcp"
    state = {"model": {"a": torch.ones(3), "b": torch.zeros(2, 2), "c": torch.arange(4.0)}, "step": 3}
    dcp_save_local(state, checkpoint_id=str(folder))
    meta = folder / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # our own file
    edit(metadata)
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    return folder


def test_dcp_metadata_bounded_by_its_data_files(tmp_path: Path) -> None:
    def many(m: Any) -> None:
        m.planner_data = [{} for _ in range(8_000_000)]  # 16 MB of pickle, over 2 GB unpickled

    folder = _dcp(tmp_path, many)
    assert (folder / ".metadata").stat().st_size > 15 << 20
    for command in (["inspect", folder], ["convert", folder, tmp_path / "out.safetensors"]):
        refused(*command, source=folder, cwd=tmp_path, contains="bytes of metadata for", bounded=True)


def test_dcp_planner_entries_one_path_each(tmp_path: Path) -> None:
    def same(m: Any) -> None:
        m.planner_data["model.b"] = m.planner_data["model.a"]

    folder = _dcp(tmp_path, same)
    message = refused("convert", folder, tmp_path / "out.safetensors", source=folder, cwd=tmp_path)
    assert "'model.a'" in message and "'model.b'" in message and "one path per planner entry" in message


def test_dcp_planner_entry_under_another_value(tmp_path: Path) -> None:
    def under(m: Any) -> None:
        m.planner_data["model.a"] = ("step", "a")

    folder = _dcp(tmp_path, under)
    message = refused("convert", folder, tmp_path / "out.pt", source=folder, cwd=tmp_path)
    assert "'model.a'" in message and "'step'" in message


@pytest.mark.parametrize("name", ["__0_0.distcp\0x", "__0_0\ud800.distcp"])
def test_dcp_relative_path_no_file_can_have(tmp_path: Path, name: str) -> None:
    def rename(m: Any) -> None:
        for info in m.storage_data.values():
            info.relative_path = name

    folder = _dcp(tmp_path, rename)
    refused("inspect", folder, source=folder, cwd=tmp_path, contains="a name no file can have")


@pytest.mark.parametrize("glob", ["Size", "FloatStorage", "UntypedStorage"])
def test_dcp_dtype_not_a_dtype(tmp_path: Path, glob: str) -> None:
    def dtype(m: Any) -> None:
        m.state_dict_metadata["model.a"].properties.dtype = getattr(torch, glob)

    folder = _dcp(tmp_path, dtype)
    message = refused("convert", folder, tmp_path / "out.pt", source=folder, cwd=tmp_path, contains="dtype torch.")
    assert f"{glob}, which is not a torch dtype" in message


@pytest.mark.parametrize(("size", "says"), [(2**44, "needs 70368744177664 bytes"), (-6, "non-negative")])
def test_dcp_global_shape_bounded_by_its_bytes(tmp_path: Path, size: int, says: str) -> None:
    def shape(m: Any) -> None:
        entry = m.state_dict_metadata["model.a"]
        entry.size = entry.chunks[0].sizes = torch.Size([size])

    folder = _dcp(tmp_path, shape)
    for command in (["inspect", folder], ["convert", folder, tmp_path / "out.pt"], ["diff", folder, folder]):
        refused(*command, source=folder, cwd=tmp_path, contains=says, bounded=True)


def test_dcp_items_sharing_bytes(tmp_path: Path) -> None:
    def share(m: Any) -> None:
        infos = list(m.storage_data.values())
        infos[1].offset, infos[1].length = infos[0].offset, infos[0].length

    folder = _dcp(tmp_path, share)
    refused("convert", folder, tmp_path / "out.pt", source=folder, cwd=tmp_path, contains="stored in the same bytes")


@pytest.mark.parametrize("size", [2**64, 2**63])
def test_empty_tensor_past_64_bits_from_dcp(tmp_path: Path, size: int) -> None:
    def shape(m: Any) -> None:
        entry = m.state_dict_metadata["model.b"]
        entry.size = entry.chunks[0].sizes = torch.Size([0, size])

    folder = _dcp(tmp_path, shape)
    for out, *options in OUTPUTS:
        message = refused("convert", folder, out, *options, source=folder, cwd=tmp_path)
        assert "'model.b'" in message and "past 64 bits" in message


# Edited placements: refused in one line before a byte is placed, in time bounded by the file, never an uninitialized
# byte in an output.


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_a_tensor_in_65536_chunks_is_checked_in_time_bounded_by_the_file(order: str) -> None:
    boxes = [((i,), (1,)) for i in range(65536)]
    if order == "shuffled":
        random.Random(0).shuffle(boxes)
    started = time.perf_counter()
    dcp_folders._check_tiling("w", (65536,), boxes, source="x/.metadata")
    dcp_folders._check_tiling("w", (256, 256), [((i, j), (1, 1)) for i in range(256) for j in range(256)], source="x")
    dcp_folders._check_tiling("w", (4, 0), [((0, 0), (4, 0))] * 65536, source="x")  # one empty chunk, referenced often
    assert time.perf_counter() - started < 5  # pair by pair: minutes


@pytest.mark.parametrize(
    ("boxes", "message"),
    [
        ([((0,), (2,)), ((1,), (2,)), ((3,), (1,))], "overlapping chunks at [0] and [1]"),
        ([((0,), (2,)), ((0,), (2,)), ((2,), (2,))], "overlapping chunks at [0] and [0]"),
        ([((0,), (2,))], "cover 2 of 4 elements"),
        ([((i,), (1,)) for i in range(1000)] + [((0,), (1,))] * 600, "overlap or lie off a grid"),
    ],
    ids=["overlap", "twice", "gap", "many-overlapping"],
)
def test_chunks_that_do_not_tile_are_refused(boxes: list[Any], message: str) -> None:
    size = 1000 if len(boxes) > 100 else 4
    with pytest.raises(FormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dcp_folders._check_tiling("w", (size,), boxes, source="x/.metadata")


# Faithful to what torch and safetensors write: math bits, container types, key order of empty tensors.


@pytest.mark.parametrize("ext", ["pt", "safetensors"])
@pytest.mark.parametrize("fast", PATHS)
def test_math_bits_of_a_dcp_input_are_resolved(tmp_path: Path, fast: bool, ext: str) -> None:
    state = _bits_state()
    _dcp_save(state, tmp_path / "dcp")  # dcp.save pickles each tensor as torch.save does: bits and all
    out = tmp_path / f"out.{ext}"
    ckptfix.convert_file(tmp_path / "dcp", out, fast=fast)
    got = torch.load(out, weights_only=True) if ext == "pt" else st_spec.load_file(out)
    _assert_values(got, _values(state))
    _assert_values(ckptfix.load(tmp_path / "dcp"), _values(_dcp_truth(tmp_path / "dcp", tmp_path)))


@pytest.mark.parametrize("fast", PATHS)
def test_a_dcp_folder_to_pt_gives_what_dcp_itself_gives(tmp_path: Path, fast: bool) -> None:
    # DCP records no container type: its reader rebuilds plain dicts, and so does ckptfix
    _dcp_save({"model": SmallNet().state_dict(), "step": 3}, tmp_path / "dcp")
    ckptfix.convert_file(tmp_path / "dcp", tmp_path / "out.pt", fast=fast)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(got, _dcp_truth(tmp_path / "dcp", tmp_path))
    assert type(got) is dict and type(got["model"]) is dict


# ----------------------------------------------------------------------------------------------------------------------
# A DCP folder's chunks are torch.save archives: torch's DCP reader ``torch.load``s each one, so a chunk's byte-order
# record swaps its bytes and a conj or neg bit applies to its values. Every path of ckptfix gives those values:
# ``load`` (the torch path), ``diff`` and ``merge`` (a tensor read at a time), ``convert`` (the stream steps aside).


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _byteswapped(t: torch.Tensor) -> torch.Tensor:
    width = t.element_size()
    return t.view(torch.uint8).reshape(-1, width).flip(-1).contiguous().view(t.dtype).reshape(t.shape)


def _plain_values() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 6).reshape(2, 3), "i": torch.arange(-2, 3), "h": torch.ones(3).half()}


def _save(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "saving in a single process"
        dcp_save_local(state, checkpoint_id=str(folder))
    return folder


def _save_big_endian(folder: Path) -> Path:
    """The folder dcp.save writes on a big-endian machine: each chunk's ``byteorder`` record says ``big`` and its
    elements are byte-swapped (torch.load swaps them back here)."""
    real = sys.byteorder
    sys.byteorder = "big"  # type: ignore[misc]  # torch.save writes this into each chunk's byteorder record
    try:
        return _save(folder, {k: _byteswapped(v) for k, v in _plain_values().items()})
    finally:
        sys.byteorder = real  # type: ignore[misc]


def _torch_reads(folder: Path) -> dict[str, torch.Tensor]:
    """What torch's own DCP reader gives, into plain tensors of the saved shapes and dtypes."""
    out = {k: torch.empty_like(v) for k, v in _plain_values().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(folder))
    return out


def _assert_values_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    le, be = _save(tmp_path / "le", _plain_values()), _save_big_endian(tmp_path / "be")
    assert (be / "__0_0.distcp").read_bytes().count(b"big") >= 3  # a byteorder record per chunk
    _assert_values_equal(_torch_reads(be), _plain_values())  # torch swaps each chunk's bytes back
    return le, be


def test_load_gives_what_torch_reads_from_big_endian_chunks(folders: tuple[Path, Path]) -> None:
    _, be = folders
    _assert_values_equal(ckptfix.load(be), _plain_values())


def test_diff_finds_a_big_endian_folder_equal_to_the_little_endian_one(folders: tuple[Path, Path]) -> None:
    le, be = folders
    assert diff_files(le, be).equal
    assert run("diff", le, be).exit_code == 0


@pytest.mark.parametrize("out_name", ["out.safetensors", "out.pt"])
@pytest.mark.parametrize("fast", [True, False])
def test_convert_writes_the_values_not_the_swapped_bytes(
    folders: tuple[Path, Path], tmp_path: Path, out_name: str, fast: bool
) -> None:
    _, be = folders
    out = tmp_path / out_name
    ckptfix.convert_file(be, out, fast=fast)
    _assert_values_equal(ckptfix.load(out), _plain_values())


def test_convert_into_a_dcp_folder_writes_the_values(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, be = folders
    out = tmp_path / "out"
    ckptfix.convert_file(be, f"{out}/")
    _assert_values_equal(_torch_reads(out), _plain_values())


def test_convert_cli_says_why_the_stream_steps_aside(folders: tuple[Path, Path], tmp_path: Path) -> None:
    _, be = folders
    out = tmp_path / "cli.safetensors"
    result = run("convert", be, out, "-v")
    assert result.exit_code == 0, result.output
    assert "big-endian" in result.output
    _assert_values_equal(ckptfix.load(out), _plain_values())


def test_merge_reads_big_endian_chunks_as_their_values(folders: tuple[Path, Path], tmp_path: Path) -> None:
    le, be = folders
    out = tmp_path / "merged.pt"
    result = run("merge", le, be, "-o", out)
    assert result.exit_code == 0, result.output
    _assert_values_equal(ckptfix.load(out), _plain_values())


MATH_BITS = {"neg": torch._neg_view, "conj": torch.conj}


@pytest.mark.parametrize("bit", list(MATH_BITS))
def test_a_math_bit_chunk_reads_as_torch_reads_it(bit: str, tmp_path: Path) -> None:
    base = torch.tensor([1 + 2j, -3 + 0.5j, 4j])
    view = MATH_BITS[bit](base)
    folder = _save(tmp_path / "bits", {"w": view})
    plain = _save(tmp_path / "plain", {"w": view.resolve_conj().resolve_neg()})
    out = {"w": torch.empty_like(base)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(folder))
    assert torch.equal(out["w"], view) and not torch.equal(out["w"], base)
    assert torch.equal(ckptfix.load(folder)["w"].resolve_conj().resolve_neg(), out["w"])
    assert diff_files(plain, folder).equal
    converted = tmp_path / "out.safetensors"
    assert run("convert", folder, converted).exit_code == 0
    assert torch.equal(ckptfix.load(converted)["w"], out["w"])
