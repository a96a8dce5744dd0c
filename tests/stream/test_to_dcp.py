"""Conversions into a DCP folder stream: torch's own writer, planned from meta tensors, reads one tensor at a time.

Each streamed folder is compared with the one the in-memory path writes (``fast=False``: the checkpoint loaded,
then ``dcp.save``): the same metadata and the same ``.distcp`` bytes; and read back by torch's ``dcp.load``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.formats.deepspeed.run import describe_run
from ckptfix.stream import to_dcp
from tests import sharded_writers
from tests.assertions import assert_equal
from tests.deepspeed_runs import RUNS
from tests.models import SmallNet

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
ZERO = [f"zero{stage}_{dtype}" for stage, dtype in RUNS]

_equal = functools.partial(assert_equal, ordered=False)  # DCP keeps no key order


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def both(src: Path, tmp_path: Path, **options: Any) -> tuple[Path, Any, Path]:
    """The streamed folder and its result, and the folder the in-memory path writes."""
    streamed, loaded = tmp_path / "streamed", tmp_path / "loaded"
    tmp_path.mkdir(exist_ok=True)
    result = ckptfix.convert_file(src, f"{streamed}/", **options)
    reference = ckptfix.convert_file(src, f"{loaded}/", fast=False, **options)
    assert reference.method == "torch"
    return streamed, result, loaded


def assert_same_folder(got: Path, want: Path) -> None:
    """The same plan in both (keys, dtypes, shapes, flags, which file) and each item the same value (``torch.equal``,
    dtype): without a cast, ckptfix lays the ``.distcp`` file out itself, not byte for byte as torch's writer does."""
    with open(got / ".metadata", "rb") as f, open(want / ".metadata", "rb") as g:
        a, b = pickle.load(f), pickle.load(g)  # written by torch or ckptfix here: our own files
    assert a.state_dict_metadata == b.state_dict_metadata and a.planner_data == b.planner_data
    assert a.storage_data.keys() == b.storage_data.keys()
    for index, info in b.storage_data.items():
        x, y = _item(got, a.storage_data[index]), _item(want, info)
        assert type(x) is type(y), index.fqn
        assert_equal(x, y, index.fqn)


def _item(folder: Path, info: Any) -> Any:
    with open(folder / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=True)


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(t) for k, t in state.items()}


# -- DeepSpeed runs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ZERO)
def test_a_zero_run_streams_into_the_folder_the_loaded_run_makes(name: str, tmp_path: Path) -> None:
    streamed, result, loaded = both(FIXTURES / "deepspeed" / name, tmp_path)
    assert result.method == "stream"
    assert result.notes[-1].startswith(f"DeepSpeed ZeRO-{name[4]} (2 ranks) -> dcp: ")
    assert_same_folder(streamed, loaded)
    want = torch.load(FIXTURES / "deepspeed" / f"{name}.expected.pt", weights_only=True)
    _equal(dict(ckptfix.load(streamed)), want)
    target = zeros_like(want)
    dcp.load(target, checkpoint_id=str(streamed))  # torch's own reader
    _equal(target, want)


def test_the_cli_streams_a_run_folder_and_says_so(tmp_path: Path) -> None:
    done = run("convert", FIXTURES / "deepspeed" / "zero3_bf16", f"{tmp_path / 'out'}/", "-v")
    assert done.exit_code == 0, done.output
    assert "path: stream; " in done.output and "DeepSpeed ZeRO-3 (2 ranks) -> dcp: 9 tensors" in done.output


def test_a_damaged_partition_is_refused_and_no_folder_is_left(tmp_path: Path) -> None:
    src = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed" / "zero3_bf16", src)
    piece = describe_run(str(src)).state["body.weight"].pieces[-1]
    with open(piece.path, "r+b") as f:  # flip the fp32 master bytes: the pickles stay intact
        f.seek(piece.offset)
        data = f.read(piece.nbytes)
        f.seek(piece.offset)
        f.write(bytes(b ^ 0xFF for b in data))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FormatError, match="CRC"):
        ckptfix.convert_file(src, f"{tmp_path / 'out'}/")
    assert sorted(os.listdir(tmp_path)) == before  # no folder, no temporary folder


def test_a_lone_zero3_rank_file_is_still_refused(tmp_path: Path) -> None:
    lone = FIXTURES / "deepspeed" / "zero3_bf16" / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    fast, slow = run("convert", lone, f"{tmp_path / 'a'}/"), run("convert", lone, f"{tmp_path / 'b'}/", "--no-fast")
    assert fast.exit_code == slow.exit_code == 2
    assert fast.stderr.replace(str(tmp_path / "a"), "") == slow.stderr.replace(str(tmp_path / "b"), "")
    assert "zero3_bf16" in fast.stderr and os.listdir(tmp_path) == []


# -- other inputs ----------------------------------------------------------------------------------------------


def test_a_pt_checkpoint_streams_with_its_notes(tmp_path: Path) -> None:
    streamed, result, loaded = both(FIXTURES / "single.pt", tmp_path)
    assert result.method == "stream" and any(n.startswith("pt -> dcp: ") for n in result.notes)
    assert any("keyed by parameter name" in n for n in result.notes)  # set_optimizer_state_dict's form
    assert_same_folder(streamed, loaded)
    want = torch.load(FIXTURES / "single.pt", weights_only=True)["model"]
    target = {"model": zeros_like(want)}
    dcp.load(target, checkpoint_id=str(streamed))
    _equal(target["model"], want)


def test_parameters_keep_requires_grad_in_the_metadata(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {"w": torch.nn.Parameter(torch.randn(4, 3)), "frozen": torch.nn.Parameter(torch.randn(2), False),
             "tail": torch.arange(12)[4:], "steps": [torch.ones(2), 7], "name": "run"}  # fmt: skip
    torch.save(state, tmp_path / "p.pt")
    streamed, result, loaded = both(tmp_path / "p.pt", tmp_path)
    assert result.method == "stream"
    assert_same_folder(streamed, loaded)
    back = ckptfix.load(streamed)
    assert torch.equal(back["tail"], torch.arange(4, 12)) and back["name"] == "run" and back["steps"][1] == 7


@pytest.mark.parametrize("layout", ["safetensors", "shards", "dcp"])
def test_safetensors_shards_and_dcp_folders_stream(layout: str, tmp_path: Path) -> None:
    src = tmp_path / "in"
    if layout == "safetensors":
        src = FIXTURES / "ddp_wrapped.safetensors"
    elif layout == "shards":
        src.mkdir()
        ckptfix.convert_file(FIXTURES / "single.pt", src / "model.safetensors", model_only=True, shard_size=4000)
        assert len(list(src.glob("*.safetensors"))) > 1
    else:
        ckptfix.convert_file(FIXTURES / "single.pt", f"{src}/", fast=False)
    streamed, result, loaded = both(src, tmp_path / "out", to="single" if layout != "dcp" else None)
    assert result.method == "stream", result.notes
    assert_same_folder(streamed, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "fsdp2-cols"])
def test_two_rank_dcp_folders_stream_into_one_rank_folders(tmp_path: Path, mode: str) -> None:
    out = sharded_writers.write(tmp_path / mode, mode)
    streamed, result, loaded = both(out / "dcp", tmp_path / "out", to=None)
    assert result.method == "stream"
    assert_same_folder(streamed, loaded)


def test_what_the_stream_does_not_take_goes_the_torch_way(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(3, 4).t(), "b": torch.zeros(2)}, tmp_path / "view.pt")  # a strided view
    pair = {"model": {"w": torch.ones(2)}, "pair": (torch.ones(2), 3)}  # DCP pickles a tuple whole, tensor and all
    torch.save(pair, tmp_path / "tuple.pt")
    for name, why in [("view", "strided view"), ("tuple", "a tuple of tensors or objects")]:
        streamed, result, loaded = both(tmp_path / f"{name}.pt", tmp_path / name)
        assert result.method == "torch" and any(why in n for n in result.notes), result.notes
        assert_same_folder(streamed, loaded)


# -- bounded memory ----------------------------------------------------------------------------------------------


def test_one_tensor_is_held_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tensor read is freed when the next is asked for: the writer has written it by then (the serial loader)."""
    read = to_dcp._Reader.read
    held: list[torch.Tensor] = []
    inside: list[str] = []

    def reading(self: Any, record: Any, *, key: str) -> Any:
        if inside:  # a cast's source, read by the call for the cast tensor
            return read(self, record, key=key)
        assert all(t.untyped_storage().nbytes() == 0 for t in held), "two tensors held at once"
        inside.append(key)
        held.append(read(self, record, key=key))
        inside.pop()
        return held[-1]

    monkeypatch.setattr(to_dcp._Reader, "read", reading)
    streamed, result, loaded = both(FIXTURES / "deepspeed" / "zero2_fp32", tmp_path, dtype="bf16")  # torch's writer
    assert len(held) == 12 and "12 tensors, each read when torch's DCP writer asked for it" in result.notes[-1]
    assert_same_folder(streamed, loaded)


def test_the_writer_takes_one_tensor_at_a_time_even_where_a_gpu_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch picks its copy-ahead loader (several tensors resolved, sorted by size) where CUDA is available unless
    there is no copy-ahead: the folder is the same, in plan order, either way."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    streamed, result, loaded = both(FIXTURES / "deepspeed" / "zero3_fp32", tmp_path)
    monkeypatch.undo()
    assert result.method == "stream"
    assert_same_folder(streamed, loaded)
    _equal(dict(ckptfix.load(streamed)), torch.load(FIXTURES / "deepspeed" / "zero3_fp32.expected.pt"))


# -- outputs: refusals and --force as before --------------------------------------------------------------------


def test_an_existing_folder_is_refused_and_replaced_with_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_dir = FIXTURES / "deepspeed" / "zero1_fp32"
    assert run("convert", FIXTURES / "single.pt", f"{out}/").exit_code == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    taken = run("convert", run_dir, f"{out}/")
    assert taken.exit_code == 2 and "exists and is not empty" in taken.stderr and "--force" in taken.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    done = run("convert", run_dir, f"{out}/", "--force")
    assert done.exit_code == 0, done.output
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary or old folder beside it
    _equal(dict(ckptfix.load(out)), torch.load(FIXTURES / "deepspeed" / "zero1_fp32.expected.pt"))


def test_an_input_truncated_while_written_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "in.safetensors"
    shutil.copy(FIXTURES / "ddp_wrapped.safetensors", src)
    read = to_dcp._Reader.read
    calls: list[Any] = []
    keys: list[str] = []

    def truncating(self: Any, record: Any, *, key: str) -> Any:
        if not hasattr(record, "source"):  # a cast's source, or a tensor not cast
            return read(self, record, key=key)
        calls.append(record)
        keys.append(key)
        if len(calls) == 3:  # another process cuts the file short while the folder is written
            os.truncate(src, record.source.start + 1)
        return read(self, record, key=key)

    monkeypatch.setattr(to_dcp._Reader, "read", truncating)
    done = run("convert", src, f"{tmp_path / 'out'}/", "--dtype", "bf16")  # torch's writer: a cast
    assert done.exit_code == 2, done.output
    key = next(k for k, r in zip(keys, calls, strict=True) if r is calls[2])
    assert (
        done.stderr.strip()
        == f"ckptfix: error: {src}: ends inside tensor '{key}'; it was truncated while reading: copy it again"
    )
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


def _peak_rss(code: str) -> int:
    """Peak RSS in bytes of a fresh Python running ``code`` with this checkout importable: its VmHWM, which starts
    at exec (wait4's maxrss would count the forked test process)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    tail = "; print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
    done = subprocess.run([sys.executable, "-c", code + tail], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) << 10


@pytest.mark.slow
def test_peak_memory_is_a_tensor_or_two_above_importing_torch_never_the_model(tmp_path: Path) -> None:
    """12 tensors of 8 MiB: the streamed conversion stays within 40 MiB of what importing torch's DCP takes (a
    tensor, torch.save's copy of it, and slack); the in-memory one holds the 96 MiB model."""
    from safetensors.torch import save_file

    save_file({f"layer{i}.weight": torch.full((1024, 2048), float(i)) for i in range(12)}, tmp_path / "m.safetensors")
    floor = _peak_rss("import torch, torch.distributed.checkpoint, ckptfix.conversion.files")
    convert = "import ckptfix; ckptfix.convert_file({!r}, {!r}, fast={})"
    streamed = _peak_rss(convert.format(str(tmp_path / "m.safetensors"), f"{tmp_path / 's'}/", True))
    loaded = _peak_rss(convert.format(str(tmp_path / "m.safetensors"), f"{tmp_path / 'l'}/", False))
    assert streamed - floor < 40 << 20 and loaded - floor > 80 << 20, (floor >> 20, streamed >> 20, loaded >> 20)
    assert_same_folder(tmp_path / "s", tmp_path / "l")


@pytest.mark.parametrize(
    "src",
    ["deepspeed/zero2_fp32", "deepspeed/zero3_fp16", "deepspeed/zero1_bf16", "single.pt", "ddp_wrapped.safetensors"],
)
def test_a_cast_into_a_dcp_folder_streams_the_folder_the_torch_path_writes(src: str, tmp_path: Path) -> None:
    streamed, result, loaded = both(FIXTURES / src, tmp_path, dtype="bf16")
    assert result.method == "stream", result.notes
    assert any(note.endswith(" cast to bfloat16 as read") for note in result.notes), result.notes
    assert_same_folder(streamed, loaded)
    if src.startswith("deepspeed/"):  # DeepSpeed's own consolidation, then the cast
        want = torch.load(FIXTURES / f"{src}.expected.pt", weights_only=True)
        _equal(dict(ckptfix.load(streamed)), {k: t.to(torch.bfloat16) if t.is_floating_point() else t
                                                   for k, t in want.items()})  # fmt: skip


def test_a_dtype_this_torch_lacks_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a file from a newer torch: the meta tensor of the plan cannot be made, which says so (not an exit 3)
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip(f"torch {torch.__version__} cannot save float8_e8m0fnu")
    torch.save({"scale": torch.ones(4, dtype=torch.float8_e8m0fnu)}, tmp_path / "m.pt")
    monkeypatch.delattr(torch, "float8_e8m0fnu")
    result = run("convert", tmp_path / "m.pt", f"{tmp_path / 'out'}/", "--dtype", "bf16")  # torch's writer: a cast
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"ckptfix: error: {tmp_path / 'm.pt'}: a tensor has dtype float8_e8m0fnu, which this torch cannot "
        f"represent; upgrade torch"
    )
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


# Faithful to what torch and safetensors write: math bits, container types, key order of empty tensors.


def test_a_dcp_output_says_which_keys_become_strings(tmp_path: Path) -> None:
    # DCP stores every key as a string: an optimizer's int-keyed state comes back keyed '0', '1', ...
    net = SmallNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "full.pt")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "full.pt"), str(tmp_path / "dcp") + "/",
                                      "--optimizer-form", "indices"])  # fmt: skip
    assert result.exit_code == 0, result.output
    count = len(opt.state_dict()["state"])  # its keys; param_groups' lists of ints stay ints
    assert (
        f"ckptfix: DCP keeps keys as strings: {count} non-string key(s) become strings (e.g. 'optimizer.state.0')"
        in result.stderr
    )
    # read back, they are the ints param_groups name again
    assert set(ckptfix.load(tmp_path / "dcp")["optimizer"]["state"]) == set(opt.state_dict()["state"])
    plain = CliRunner().invoke(cli, ["convert", str(tmp_path / "full.pt"), str(tmp_path / "m") + "/", "--model-only"])
    assert plain.exit_code == 0 and "DCP keeps keys as strings" not in plain.stderr
