"""Streamed transformers shards and ``--dtype`` casts (ckptfix.stream.casting, the shard writer of
ckptfix.stream.folders): from DeepSpeed runs, DCP folders, transformers shards and one .safetensors file, byte for
byte what the torch path writes, each cast tensor read once, a block at a time.

The DeepSpeed runs are the fixtures DeepSpeed saved (fixtures/deepspeed/, with DeepSpeed's own consolidation
beside each as ``*.expected.pt``); the DCP folder is written by torch's ``dcp.save``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.deepspeed.run import describe_run
from ckptfix.formats.safetensors.file import stored_identity
from ckptfix.stream import casting
from ckptfix.transforms.checkpoint import Conversion
from tests.deepspeed_runs import RUNS
from tests.extras import needs
from tests.models import SmallNet

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
NAMES = [f"zero{stage}_{dtype}" for stage, dtype in RUNS]
CASES = [
    pytest.param({"shard_size": 300}, id="shards"),
    pytest.param({"shard_size": 100, "dtype": "bf16"}, id="shards-bf16"),
    pytest.param({"dtype": "fp16"}, id="fp16"),
]


def expected(name: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's consolidation, cast as ``cast_floating`` casts (tied names stay one tensor)."""
    state: dict[str, torch.Tensor] = torch.load(FIXTURES / f"{name}.expected.pt", weights_only=True)
    if dtype is None:
        return state
    target = getattr(torch, ckptfix.conversion.files.float_dtype(dtype) or "")
    cast: dict[Any, torch.Tensor] = {}
    for key, t in state.items():
        if t.is_floating_point():
            state[key] = cast.setdefault(stored_identity(t), t.to(target))
    return state


def both(src: Path, tmp_path: Path, name: str = "model.safetensors", **options: Any) -> tuple[Conversion, Path]:
    """Convert ``src`` on the streaming path and on the torch path into two folders; the files must be the same
    bytes under the same names. Returns the streamed result and its folder."""
    streamed, loaded = tmp_path / "stream", tmp_path / "torch"
    streamed.mkdir()
    loaded.mkdir()
    result = ckptfix.convert_file(src, streamed / name, **options)
    reference = ckptfix.convert_file(src, loaded / name, fast=False, **options)
    assert (result.method, reference.method) == ("stream", "torch")
    names = sorted(p.name for p in streamed.iterdir())
    assert names == sorted(p.name for p in loaded.iterdir())
    for file in names:
        assert (streamed / file).read_bytes() == (loaded / file).read_bytes(), file
    return result, streamed


def read_back(folder: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    index = folder / f"{name}.index.json"
    return ckptfix.load(index if index.exists() else folder / name)  # type: ignore[no-any-return]


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key


def stored_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of a state dict's tensors, a tensor under two names counted once (as the index counts them)."""
    unique = {stored_identity(t): t for t in state.values() if t.numel()}
    return sum(t.numel() * t.element_size() for t in unique.values())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("options", CASES)
def test_a_deepspeed_run_streams_what_the_torch_path_writes(name: str, options: dict[str, Any], tmp_path: Path) -> None:
    result, folder = both(FIXTURES / name, tmp_path, **options)
    want = expected(name, options.get("dtype"))
    assert_same(read_back(folder), want)
    records = {id(t): t for t in describe_run(str(FIXTURES / name)).state.values()}.values()  # tied: one record
    if "dtype" in options:  # each floating tensor not of the dtype cast (frozen ones are bf16 already), the rest copied
        target = ckptfix.conversion.files.float_dtype(options["dtype"])
        cast = sum(t.dtype.startswith(("float", "bfloat")) and t.dtype != target for t in records)
        ways = (
            f"{len(records) - cast} copied as byte ranges, 0 gathered in memory, {cast} cast to {target} a block at a "
        )
        ways += "time"
    else:  # a bf16 run's buffers are cast to float32 in memory, as zero_to_fp32 casts them
        gathered = sum(t.cast is not None for t in records)
        ways = f"{len(records) - gathered} copied as byte ranges, {gathered} gathered in memory"
    shards = sorted(p.name for p in folder.iterdir())
    where = "safetensors" if len(shards) == 1 else f"{len(shards) - 1} safetensors shards"
    assert result.notes[-1] == f"DeepSpeed ZeRO-{name[4]} (2 ranks) -> {where}: {len(records)} tensors, {ways}"
    if "shard_size" in options:
        assert_shard_set(folder, want, limit=options["shard_size"])


def assert_shard_set(folder: Path, want: dict[str, torch.Tensor], *, limit: int) -> None:
    """transformers' names and index: ``model-0000i-of-0000N.safetensors``, the weight map sorted by key, each
    key in the shard that holds it, the total counting a tied tensor once, each shard within the limit."""
    names = sorted(p.name for p in folder.iterdir())
    count = len(names) - 1
    assert count > 1
    shards = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert names == [*shards, "model.safetensors.index.json"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": stored_bytes(want)}
    assert list(index["weight_map"]) == sorted(want)
    for shard in shards:
        held = ckptfix.load(folder / shard)
        assert {k for k, v in index["weight_map"].items() if v == shard} == set(held)
        assert stored_bytes(held) <= limit or len({stored_identity(t) for t in held.values()}) == 1


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = SmallNet().state_dict()
    state["tied"] = state[next(iter(state))]  # saved once, under two names
    return state


@pytest.fixture(params=["shards", "dcp", "safetensors", "pt"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, Any], str]:
    """A folder of transformers shards, a DCP folder (torch's writer; its model entry picked), one .safetensors
    file or one torch.save file; the options that pick its model, and the kind the notes name."""
    from ckptfix.torchcompat import dcp_save_local

    kind = request.param
    inputs = tmp_path / "in"
    if kind == "dcp":
        dcp_save_local({"model": SmallNet().state_dict(), "step": 3}, checkpoint_id=str(inputs))
        return inputs, {"model_only": True, "entries": ["model"]}, kind
    inputs.mkdir()
    if kind == "pt":
        torch.save(_state(), inputs / "model.pt")
        return inputs / "model.pt", {}, kind
    ckptfix.save(_state(), inputs / "model.safetensors", shard_size=200 if kind == "shards" else None)
    return (inputs if kind == "shards" else inputs / "model.safetensors"), {}, kind


@pytest.mark.parametrize("options", CASES)
def test_other_inputs_stream_what_the_torch_path_writes(
    source: tuple[Path, dict[str, Any], str], options: dict[str, Any], tmp_path: Path
) -> None:
    src, picked, kind = source
    (tmp_path / "out").mkdir()
    result, folder = both(src, tmp_path / "out", **options, **picked)
    assert result.notes[-1].startswith(f"{kind} -> ")
    want = ckptfix.load(src)
    want = want.get("model", want)
    if "dtype" in options:
        conversion = Conversion(obj=want, changes=ckptfix.convert_checkpoint(want).changes)
        ckptfix.conversion.files.cast_floating(conversion, ckptfix.conversion.files.float_dtype(options["dtype"]) or "")
        want = conversion.obj
    assert_same(read_back(folder), want)


@pytest.mark.slow
def test_dcp_chunks_of_columns_are_gathered_then_cast(tmp_path: Path) -> None:
    from tests import sharded_writers

    out = sharded_writers.write(tmp_path / "cols", "fsdp2-cols")  # matrices sharded by columns: no byte ranges
    result, folder = both(out / "dcp", tmp_path, model_only=True, entries=["model"], shard_size=1000, dtype="bf16")
    assert result.notes[-1].startswith("dcp -> ") and " cast to bfloat16 " in result.notes[-1]
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1


def test_refusals_are_the_torch_paths(tmp_path: Path) -> None:
    """A checkpoint with other entries cannot be sharded; a dtype safetensors has no code for: the same one line
    on both paths, nothing written."""
    from ckptfix.torchcompat import dcp_save_local

    dcp_save_local({"model": SmallNet().state_dict(), "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    said = []
    for fast in (True, False):
        with pytest.raises(OutputError) as e:
            ckptfix.convert_file(tmp_path / "dcp", out, shard_size=300, fast=fast)
        said.append(str(e.value))
    assert (
        said[0]
        == said[1]
        == f"{out}: shards hold one state dict; this checkpoint has other entries: add " + ("model_only=True")
    )
    assert list(out.parent.iterdir()) == []
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "dcp"), str(out), "--shard-size", "300B"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "shards hold one state dict" in result.output and list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["RUN", "model.safetensors", "--shard-size", "300B"], "path: stream; "),
        (["RUN", "model.safetensors", "--dtype", "bf16"], "path: stream; "),
        (["RUN", "model.pt", "--dtype", "bf16"], "path: stream; "),
        (["RUN", "model.pt", "--shard-size", "300B"],
         "path: torch; fast path not taken: shards are written one by one from the loaded checkpoint"),
        (["PT", "model.safetensors", "--dtype", "bf16", "--model-only"], "path: stream; "),
        (["PT", "model.pt", "--dtype", "bf16"], "path: torch; fast path not taken: casting to bfloat16 needs torch"),
        (["PT", "model.pt", "--shard-size", "300B", "--model-only"],
         "path: torch; fast path not taken: shards are written one by one from the loaded checkpoint"),
        (["RUN", "model.safetensors", "--dtype", "bf16", "--no-fast"],
         "path: torch; fast path not taken: the torch path was asked for"),
    ],
)  # fmt: skip
def test_verbose_says_which_path_ran(args: list[str], said: str, tmp_path: Path) -> None:
    single = FIXTURES.parent / "single.pt"
    argv = [str(FIXTURES / "zero3_bf16") if a == "RUN" else str(single) if a == "PT" else a for a in args]
    argv[1] = str(tmp_path / argv[1])
    result = CliRunner().invoke(cli, ["convert", *argv, "-v"])
    assert result.exit_code == 0, result.output
    assert said in result.output


def test_force_swaps_a_shard_set_and_a_failure_leaves_the_old_one(tmp_path: Path) -> None:
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    (out.parent / "config.json").write_text("{}")
    ckptfix.convert_file(FIXTURES / "zero3_fp32", out, shard_size=100)
    old = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    with pytest.raises(OutputError, match="already exists; write the shards to a new or empty folder"):
        ckptfix.convert_file(FIXTURES / "zero3_fp32", out, shard_size=300)
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "zero3_fp32", run)
    piece = describe_run(str(run)).state["body.weight"].pieces[-1]
    with open(piece.path, "r+b") as f:  # a partition's bytes damaged: its CRC no longer matches
        f.seek(piece.offset)
        f.write(bytes(b ^ 0xFF for b in f.read(4)))
    for options in ({"shard_size": 300}, {"shard_size": 300, "dtype": "bf16"}):
        with pytest.raises(FormatError, match="CRC"):
            ckptfix.convert_file(run, out, overwrite=True, **options)
        assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == old  # nothing half written, no temp folder
    ckptfix.convert_file(FIXTURES / "zero3_fp32", out, shard_size=300, overwrite=True)
    names = sorted(p.name for p in out.parent.iterdir())
    assert len(names) < len(old) and "config.json" in names  # the old set's extra shards gone, config.json kept
    assert_same(read_back(out.parent), expected("zero3_fp32"))


def test_each_cast_tensor_is_read_once_a_block_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = 64
    monkeypatch.setattr(casting, "_BLOCK", block)
    reads: list[tuple[int, int, int]] = []
    read = casting._read

    def counted(fd: int, offset: int, view: memoryview, **kw: Any) -> None:
        reads.append((fd, offset, len(view)))
        read(fd, offset, view, **kw)

    monkeypatch.setattr(casting, "_read", counted)
    result = ckptfix.convert_file(FIXTURES / "zero3_fp32", tmp_path / "m.safetensors", dtype="bf16", shard_size=200)
    assert result.method == "stream"
    assert max(n for *_, n in reads) <= block  # what is held: one block, whatever the tensor
    records = {id(t): t for t in describe_run(str(FIXTURES / "zero3_fp32")).state.values()}.values()
    cast = [t for t in records if t.dtype == "float32"]
    assert sum(n for *_, n in reads) == sum(p.nbytes for t in cast for p in t.pieces)  # each byte read once
    assert len(set(reads)) == len(reads)
    assert_same(read_back(tmp_path, "m.safetensors"), expected("zero3_fp32", "bf16"))


def test_a_tied_weight_cast_stays_one_tensor(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "tied.pt")
    for src, fast in ((tmp_path / "tied.pt", False), (FIXTURES / "zero3_fp32", True)):
        out = tmp_path / f"{src.stem}-{fast}.pt"
        assert ckptfix.convert_file(src, out, dtype="bf16", fast=fast).method == ("stream" if fast else "torch")
        back = torch.load(out, weights_only=True)
        first, second = ("tied", next(iter(state))) if not fast else ("head.weight", "embed.weight")
        assert back[first].dtype == torch.bfloat16
        assert back[first].untyped_storage().data_ptr() == back[second].untyped_storage().data_ptr()


def test_transformers_loads_the_streamed_shards(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    from ckptfix.torchcompat import dcp_save_local

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    dcp_save_local(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"))  # as a training job saves it
    out = tmp_path / "hf"
    out.mkdir()
    model.config.save_pretrained(out)
    result = ckptfix.convert_file(tmp_path / "dcp", out / "model.safetensors", shard_size=20_000, dtype="bf16")
    assert result.method == "stream" and len(list(out.glob("model-*-of-*.safetensors"))) > 2
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.bfloat16).eval()
    want = model.to(torch.bfloat16).state_dict()
    assert all(torch.equal(loaded.state_dict()[k], t) for k, t in want.items())


@pytest.mark.parametrize("options", CASES)
def test_a_corrupt_dcp_chunk_is_refused_and_nothing_is_written(
    single: Path, options: dict[str, Any], tmp_path: Path
) -> None:
    from tests import sharded_writers

    sharded_writers.corrupt_chunk(single, "model.features.3.weight")  # read by a later shard than the first
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with pytest.raises(FormatError, match="CRC"):
        ckptfix.convert_file(single, out, model_only=True, entries=["model"], **options)
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("dtype", [None, "bf16", "fp32"])
def test_a_pt_of_parameters_says_what_safetensors_drops_as_the_torch_path_says_it(
    dtype: str | None, tmp_path: Path
) -> None:
    """A cast Parameter is a plain tensor on the torch path (its requires_grad kept); one of the dtype stays one."""
    torch.manual_seed(0)
    params = dict(SmallNet().named_parameters())
    params["view"] = params[next(iter(params))].detach()[1:]  # a slice of a larger storage
    torch.save(params, tmp_path / "params.pt")
    options = {"shard_size": 300} if dtype is None else {"dtype": dtype}
    (tmp_path / "out").mkdir()
    result, _ = both(tmp_path / "params.pt", tmp_path / "out", **options)
    reference = ckptfix.convert_file(tmp_path / "params.pt", tmp_path / "ref.safetensors", fast=False, **options)
    lost = [n for n in reference.notes if n.startswith(".safetensors keeps values only")]
    assert len(lost) == 1 and [n for n in result.notes if n.startswith(".safetensors keeps")] == lost


def test_a_pt_the_stream_does_not_copy_goes_the_torch_way(tmp_path: Path) -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 6)
    torch.save({"t": weight.t(), "w": weight}, tmp_path / "view.pt")  # a transposed view: not a byte range
    done = ckptfix.convert_file(tmp_path / "view.pt", tmp_path / "out.safetensors", dtype="bf16")
    assert done.method == "torch"
    assert "fast path not taken: a tensor is a non-contiguous view, which the torch path makes contiguous" in done.notes
    back = ckptfix.load(tmp_path / "out.safetensors")
    assert torch.equal(back["t"], weight.t().to(torch.bfloat16)) and torch.equal(back["w"], weight.to(torch.bfloat16))


@pytest.mark.parametrize("options", CASES)
def test_a_corrupt_pt_record_is_refused_and_nothing_is_written(options: dict[str, Any], tmp_path: Path) -> None:
    from ckptfix.formats.torchzip.archive import read_archive

    torch.save(_state(), tmp_path / "model.pt")
    with open(tmp_path / "model.pt", "r+b") as f:
        record = [r for r in read_archive(f.fileno(), "x").records if "/data/" in r.name][-1]
        f.seek(record.data_offset + record.size // 2)
        byte = f.read(1)
        f.seek(record.data_offset + record.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with pytest.raises(FormatError, match="CRC"):
        ckptfix.convert_file(tmp_path / "model.pt", out, **options)
    assert list(out.parent.iterdir()) == []
