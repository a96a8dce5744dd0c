"""FSDP2 rank files (DTensor shards): recognised without building them, refused as a full model, reassembled."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import MergeError
from ckptfix.formats.fsdp import ranks as shards
from ckptfix.formats.fsdp.ranks import ShardedCheckpointError, load_ranks
from tests import sharded_writers
from tests.models import SmallNet

# Slow (each test marked): one real 2-process FSDP2 run (gloo) serves the module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


def _ranks(run: Path) -> list[str]:
    return [str(run / f"rank{r}.pt") for r in range(sharded_writers.WORLD)]


@pytest.mark.slow
def test_one_rank_file_is_said_to_be_shards_not_a_model(run: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match=r"holds DTensor shards .*formats\.fsdp\.ranks\.load_ranks"):
        ckptfix.load(run / "rank0.pt")


@pytest.mark.slow
def test_converting_one_rank_file_is_refused_in_one_line(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    cli = [sys.executable, "-c", "from ckptfix.cli import main; main()"]
    done = subprocess.run([*cli, "convert", str(run / "rank0.pt"), str(out)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "holds DTensor shards" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def test_a_rank_file_is_refused_whatever_its_keys_are_called(run: Path, tmp_path: Path) -> None:
    """GPT-2's keys (``transformer.h.0.…``) name no model entry: the file is still one rank's shards, not a file
    holding no model."""
    own = torch.load(run / "rank0.pt", weights_only=False)  # our own file, made by sharded_writers
    torch.save({f"transformer.h.{k}": v for k, v in own.items()}, tmp_path / "rank0.pt")
    for out in (tmp_path / "out.pt", tmp_path / "out.safetensors", tmp_path / "dcp"):
        done = CliRunner().invoke(
            cli, ["convert", str(tmp_path / "rank0.pt"), f"{out}/" if out.suffix == "" else str(out)]
        )
        assert done.exit_code == 2 and "holds DTensor shards" in done.output, done.output
        assert not out.exists()


@pytest.mark.slow
def test_every_ranks_file_reassembles_the_full_model(run: Path) -> None:
    trees = load_ranks(_ranks(run))
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    for rank, tree in enumerate(trees):
        assert list(tree) == list(full)
        own = torch.load(run / f"rank{rank}.pt", weights_only=False)  # our own file: the truth for plain tensors
        for key, value in full.items():
            expected = value if "running" not in key else own[key]  # BatchNorm statistics stay each rank's own
            assert torch.equal(tree[key], expected), (rank, key)


@pytest.mark.slow
def test_a_missing_rank_is_refused(run: Path) -> None:
    with pytest.raises(MergeError, match=r"1 files for a mesh of 2 ranks \[2\].*pass every rank's file exactly once"):
        load_ranks(_ranks(run)[:1])


@pytest.mark.slow
def test_one_rank_twice_is_refused(run: Path) -> None:
    with pytest.raises(MergeError, match="pass every rank's file exactly once"):
        load_ranks([_ranks(run)[0], _ranks(run)[0]])


@pytest.mark.slow
def test_rank_files_of_two_runs_are_refused(run: Path, tmp_path: Path) -> None:
    other = sharded_writers.write(tmp_path / "wide", "fsdp2-wide")
    with pytest.raises(MergeError, match=r"is float32 \[12, 3, 3, 3\] sharded .* the files are from different runs"):
        load_ranks([_ranks(run)[0], str(other / "rank1.pt")])
    shutil.rmtree(other)


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1"))


@pytest.mark.slow
def test_fsdp1_flat_parameters_are_never_written_as_a_model(fsdp1: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match=r"'_fsdp_wrapped_module._flat_param' is an FSDP1 flat parameter"):
        ckptfix.convert_file(fsdp1 / "flat0.pt", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_fsdp1_local_state_dicts_say_what_they_are(fsdp1: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match=r"holds ShardedTensor shards \(an FSDP1 LOCAL_STATE_DICT"):
        ckptfix.load(fsdp1 / "local0.pt")


@pytest.mark.slow
def test_validate_reports_rank_files_as_shards_with_exit_1(run: Path, fsdp1: Path) -> None:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    for path, what in ((run / "rank0.pt", "holds DTensor shards"), (fsdp1 / "flat0.pt", "is an FSDP1 flat parameter")):
        result = CliRunner().invoke(cli, ["validate", str(path), "--model", "tests.models:SmallNet"])
        assert result.exit_code == 1, result.output
        assert what in result.output and result.output.count("\n") == 1


# -- ckptfix merge: FSDP2 rank files reassembled, not averaged ---------------------------------------------------


def _cli(*args: object) -> Any:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["full.safetensors", "full.pt"])
def test_merge_reassembles_fsdp2_rank_files_into_the_full_state_dict(run: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    result = _cli("merge", *_ranks(run), "-o", out, "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    assert "reassembled 10 DTensor tensor(s) from every rank's shards (Shard(0) on mesh [2]): full tensors, not " \
           "averaged" in result.output  # fmt: skip
    full = torch.load(run / "full.pt", weights_only=True)["model"]  # get_model_state_dict(full_state_dict=True)
    merged = ckptfix.load(out)
    assert set(merged) == set(full)
    assert all(torch.equal(merged[k], v) and merged[k].dtype == v.dtype for k, v in full.items())


@pytest.mark.slow
def test_inspect_shows_a_rank_file_as_shards_of_full_tensors(run: Path) -> None:
    text = _cli("inspect", run / "rank1.pt")
    assert text.exit_code == 0, text.output
    assert text.output.splitlines()[1].startswith(
        "DTensor shards: one rank's part (mesh coordinate [1], Shard(0) on mesh [2]) of an FSDP2 or tensor-parallel run"
    )
    assert "ckptfix merge rank0.pt … rankN.pt -o full.safetensors" in text.output
    summary = json.loads(_cli("inspect", run / "rank1.pt", "--json").output)
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    assert summary["models"][""]["parameters"] == sum(v.numel() for k, v in full.items() if "running" not in k
                                                      and "num_batches" not in k)  # fmt: skip
    assert summary["models"][""]["sharding"]["head.weight"] == "Shard(0) on mesh [2]"
    assert summary["models"][""]["sharding"]["features.1.running_mean"] == "not sharded"
    assert summary["models"][""]["bytes"] == sum(v.numel() * v.element_size() for v in full.values())  # not a half


@pytest.mark.slow
def test_merge_streams_rank_files_a_tensor_at_a_time(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.formats.fsdp import ranks as shards

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("every rank file loaded whole")

    monkeypatch.setattr(shards, "load_ranks", whole)  # the in-memory path: not taken for plain rank files
    result = _cli("merge", *_ranks(run), "-o", tmp_path / "m.pt", "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(merged) == list(full) and all(torch.equal(merged[k], v) for k, v in full.items())


@pytest.mark.slow
def test_merge_reads_each_rank_file_s_pickle_once(run: Path, tmp_path: Path, pickle_reads: Counter[str]) -> None:
    reads = pickle_reads
    result = _cli("merge", *_ranks(run), "-o", tmp_path / "m.pt", "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    assert reads == {path: 1 for path in _ranks(run)}


@pytest.mark.slow
def test_merge_refuses_a_rank_file_with_a_corrupt_shard(run: Path, tmp_path: Path) -> None:
    from ckptfix.formats.torchzip.archive import read_archive

    bad = tmp_path / "rank1.pt"
    data = bytearray((run / "rank1.pt").read_bytes())
    with open(run / "rank1.pt", "rb") as f:
        record = next(r for r in read_archive(f.fileno(), "x").records if "/data/" in r.name and r.size >= 16)
    data[record.data_offset + 8] ^= 0xFF
    bad.write_bytes(bytes(data))
    result = _cli("merge", _ranks(run)[0], bad, "-o", tmp_path / "m.pt")
    assert result.exit_code == 2 and "CRC" in result.output and str(bad) in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "m.pt").exists()


@pytest.mark.slow
def test_merge_pools_the_ranks_batchnorm_statistics_beside_the_reassembled_weights(run: Path, tmp_path: Path) -> None:
    from ckptfix.merging.files import plan_merge

    result = _cli("merge", *_ranks(run), "-o", tmp_path / "m.safetensors", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["reassembled"]["features.0.weight"] == "Shard(0) on mesh [2]" and len(report["reassembled"]) == 10
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    merged = ckptfix.load(tmp_path / "m.safetensors")
    expected = plan_merge(load_ranks(_ranks(run))).obj  # each rank's own statistics, pooled
    for key, value in full.items():
        assert torch.equal(merged[key], expected[key]), key
        assert torch.equal(merged[key], value) == ("running" not in key), key  # rank 0's alone are not the pool


@pytest.mark.slow
def test_merge_refuses_rank_files_that_are_not_one_whole_run_in_one_line(run: Path, tmp_path: Path) -> None:
    other = sharded_writers.write(tmp_path / "cols", "fsdp2-cols")
    ckptfix.save(torch.load(run / "full.pt", weights_only=True)["model"], tmp_path / "plain.safetensors")
    rank0, rank1 = _ranks(run)
    cases = [
        ([rank0], "1 files for a mesh of 2 ranks [2], missing the rank at mesh coordinate(s) [[1]]"),
        ([rank0, rank0], "[[0]] given twice; pass every rank's file exactly once"),
        ([rank0, tmp_path / "plain.safetensors"], "holds DTensor shards (an FSDP2 rank file) but"),
        ([tmp_path / "plain.safetensors", rank1], "holds DTensor shards (an FSDP2 rank file) but"),
        ([rank0, other / "rank1.pt"], "sharded Shard(1) on mesh [2], but"),
    ]
    for inputs, message in cases:
        result = _cli("merge", *inputs, "-o", tmp_path / "m.pt")
        assert result.exit_code == 2, (inputs, result.output)
        error = result.output.splitlines()[-1]
        assert error.startswith("ckptfix: error: ") and message in error, (inputs, result.output)
        assert "Traceback" not in result.output and not (tmp_path / "m.pt").exists()
    shutil.rmtree(other)


@pytest.mark.slow
def test_merge_says_what_fsdp1_rank_files_are_and_what_to_do(fsdp1: Path, tmp_path: Path) -> None:
    cases = [
        ("flat", "'_fsdp_wrapped_module._flat_param' is an FSDP1 flat parameter", "full_state_dict=True"),
        ("local", "'_flat_param' is an FSDP1 LOCAL_STATE_DICT flat parameter (840 elements of many parameters joined)",
         "pass the model that was wrapped to split it (ckptfix merge --model MOD:FACTORY, with --kwargs JSON"),
    ]  # fmt: skip
    for stem, message, advice in cases:
        result = _cli("merge", fsdp1 / f"{stem}0.pt", fsdp1 / f"{stem}1.pt", "-o", tmp_path / "m.pt")
        assert result.exit_code == 2, result.output
        assert message in result.output and advice in result.output
        assert result.output.count("\n") == 1 and not (tmp_path / "m.pt").exists()


@pytest.mark.slow
def test_fsdp1_local_state_dicts_merge_with_the_model_into_the_full_state_dict(fsdp1: Path, tmp_path: Path) -> None:
    ranks = [fsdp1 / f"local{r}.pt" for r in range(sharded_writers.WORLD)]
    full = torch.load(fsdp1 / "full.pt", weights_only=True)  # rank 0's FULL_STATE_DICT in the same job
    out = tmp_path / "full.pt"
    model = ("--model", "tests.models:SmallNet", "--kwargs", '{"width": 8}')
    result = _cli("merge", *ranks, "-o", out, "--buffers", "rank0", *model)
    assert result.exit_code == 0, result.output
    merged = ckptfix.load(out)
    assert list(merged) == list(full) and all(torch.equal(merged[k], v) for k, v in full.items())
    # by default each rank's BatchNorm statistics are pooled, as for SHARDED_STATE_DICT files
    pooled = json.loads(_cli("merge", *ranks, "-o", tmp_path / "pooled.pt", "--json", *model).output)
    assert pooled["bn_modules"] == ["features.1", "features.4"]
    assert pooled["reassembled"]["features.0.weight"] == "ShardedTensor, 2 shard(s) over 2 rank(s), split from " \
                                                         "'_flat_param'"  # fmt: skip
    wide = _cli("merge", *ranks, "-o", tmp_path / "m.pt", *model[:-1], '{"width": 12}')
    have, need = (sum(p.numel() for p in SmallNet(width=w).features.parameters()) for w in (8, 12))  # the root unit
    assert wide.exit_code == 2 and wide.output == (
        f"ckptfix: error: {ranks[0]}: '_flat_param' holds {have} elements, but the 8 parameter(s) of the model's root "
        f"module need {need} ({need} with use_orig_params=True padding); pass the model that was wrapped, built with "
        f"the same arguments\n"
    )
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("out_name", ["full.pt", "full.safetensors"])
def test_fsdp1_sharded_state_dicts_merge_into_the_full_state_dict(fsdp1: Path, tmp_path: Path, out_name: str) -> None:
    ranks = [fsdp1 / f"sharded{r}.pt" for r in range(sharded_writers.WORLD)]
    before = [p.read_bytes() for p in ranks]
    full = torch.load(fsdp1 / "full.pt", weights_only=True)  # rank 0's FULL_STATE_DICT in the same job
    out = tmp_path / out_name
    result = _cli("merge", *ranks, "-o", out, "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    assert "reassembled 10 ShardedTensor tensor(s) from every rank's shards (ShardedTensor, 2 shard(s) over 2 " \
           "rank(s)): full tensors, not averaged" in result.output  # fmt: skip
    merged = ckptfix.load(out)
    assert list(merged) == list(full)  # exactly FULL_STATE_DICT's keys, in its order
    for key, value in full.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
    assert [p.read_bytes() for p in ranks] == before
    assert ckptfix.load_into(SmallNet(width=8), out).loads_as_is
    # by default each rank's BatchNorm statistics are pooled as for DDP: only they differ from rank 0's
    pooled = tmp_path / f"pooled{out.suffix}"
    report = json.loads(_cli("merge", *ranks, "-o", pooled, "--json").output)
    assert report["reassembled"]["head.weight"] == "ShardedTensor, 2 shard(s) over 2 rank(s)"
    assert report["bn_modules"] == ["features.1", "features.4"]
    differ = sorted(k for k, v in ckptfix.load(pooled).items() if not torch.equal(v, full[k]))
    assert differ == [f"features.{i}.running_{s}" for i in (1, 4) for s in ("mean", "var")]


@pytest.mark.slow
def test_fsdp1_rank_files_missing_twice_or_of_two_runs_are_refused(fsdp1: Path, run: Path, tmp_path: Path) -> None:
    ranks = [fsdp1 / f"sharded{r}.pt" for r in range(sharded_writers.WORLD)]
    other = sharded_writers.write_fsdp1(tmp_path / "wide", width=12)
    out = tmp_path / "m.pt"
    model = ("--model", "tests.models:SmallNet", "--kwargs", '{"width": 8}')  # LOCAL_STATE_DICT files split by it
    cases = [
        ((ranks[0],), "'features.0.weight': the shards of rank(s) [1] are missing (1 file(s) for a job of 2 ranks); "
                      "pass every rank's file exactly once"),
        ((ranks[1], ranks[1]), f"{ranks[1]}: rank 1 is given twice (also {ranks[1]}); pass every rank's file once"),
        ((ranks[0], other / "sharded1.pt"), f"{other / 'sharded1.pt'}: 'features.0.weight' is float32 [12, 3, 3, 3] "
                                            f"in 2 shard(s), but {ranks[0]} has float32 [8, 3, 3, 3]"),
        ((ranks[0], run / "rank1.pt"), f"{run / 'rank1.pt'}: holds DTensor shards (an FSDP2 rank file) but "
                                       f"{ranks[0]} holds ShardedTensor shards (an FSDP1 rank file)"),
        ((ranks[0], fsdp1 / "full.pt"), f"{ranks[0]}: holds ShardedTensor shards (an FSDP1 rank file) but "
                                        f"{fsdp1 / 'full.pt'} holds full tensors"),
        ((ranks[0], fsdp1 / "local1.pt"), f"{fsdp1 / 'local1.pt'}: '_flat_param' is an FSDP1 LOCAL_STATE_DICT"),
        ((ranks[0], fsdp1 / "local1.pt", *model), f"{fsdp1 / 'local1.pt'}: its sharded keys differ from {ranks[0]}'s "
                                                  f"('_flat_param'…); files of two runs?"),
        ((fsdp1 / "local1.pt", fsdp1 / "local1.pt", *model), f"{fsdp1 / 'local1.pt'}: rank 1 is given twice (also "
                                                             f"{fsdp1 / 'local1.pt'}); pass every rank's file once"),
        ((fsdp1 / "local0.pt", other / "local1.pt", *model), f"{other / 'local1.pt'}: '_flat_param' holds "),
        ((*ranks, "--average"), f"{ranks[0]}: holds ShardedTensor shards (an FSDP1 rank file); average full"),
    ]  # fmt: skip
    for args, message in cases:
        result = _cli("merge", *args, "-o", out)
        assert result.exit_code == 2, (args, result.output)
        error = result.output.splitlines()[-1]
        assert error.startswith(f"ckptfix: error: {message}"), (args, error)
        assert "Traceback" not in result.output and not out.exists()
    shutil.rmtree(other)
    trained = [fsdp1 / "train0.pt", fsdp1 / "train1.pt"]  # the model entry alone: the optimizer left out with the rest
    assert _cli("merge", *trained, "-o", out, "--model-only", "--buffers", "rank0").exit_code == 0
    full = torch.load(fsdp1 / "full.pt", weights_only=True)
    merged = ckptfix.load(out)
    assert list(merged) == list(full) and all(torch.equal(merged[k], v) for k, v in full.items())


@pytest.mark.slow
def test_a_two_dimensional_mesh_reassembles_exactly(tmp_path: Path) -> None:
    out = sharded_writers.write_2d(tmp_path / "mesh2d")  # 4 gloo processes on a (2, 2) mesh
    ranks = [out / f"rank{r}.pt" for r in range(4)]
    result = _cli("merge", *ranks, "-o", tmp_path / "m.safetensors", "--buffers", "rank0", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)["reassembled"]
    assert found["features.0.weight"] == "Replicate(), Shard(0) on mesh [2, 2]"  # HSDP
    assert found["extra.block"] == "Shard(0), Shard(1) on mesh [2, 2]"  # uneven: 7 rows, 5 columns over 2 × 2
    full = torch.load(out / "full.pt", weights_only=True)
    merged = ckptfix.load(tmp_path / "m.safetensors")
    assert set(merged) == set(full) and all(torch.equal(merged[k], v) for k, v in full.items())
    shown = json.loads(_cli("inspect", ranks[3], "--json").output)
    assert shown["dtensor"] == {"coordinate": [1, 1], "sharding": "Replicate(), Shard(0) on mesh [2, 2]"}
    assert shown["models"][""]["sharding"]["extra.block"] == "Shard(0), Shard(1) on mesh [2, 2]"
    missing = _cli("merge", *ranks[:3], "-o", tmp_path / "m.pt")
    assert missing.exit_code == 2 and "missing the rank at mesh coordinate(s) [[1, 1]]" in missing.output


@pytest.mark.slow
def test_inspect_says_fsdp1_flat_parameters_are_no_model(fsdp1: Path) -> None:
    result = _cli("inspect", fsdp1 / "flat0.pt")
    assert result.exit_code == 0, result.output
    nested = "_fsdp_wrapped_module.head._fsdp_wrapped_module._flat_param"  # the head is its own FSDP unit
    assert f"  FSDP1 flat parameters: _fsdp_wrapped_module._flat_param, {nested}: one rank's 1-D slice" in result.output
    summary = json.loads(_cli("inspect", fsdp1 / "flat0.pt", "--json").output)
    assert summary["models"][""]["fsdp1_flat_params"] == ["_fsdp_wrapped_module._flat_param", nested]


@pytest.mark.slow
def test_a_shard_of_the_wrong_size_is_refused(run: Path) -> None:
    import dataclasses

    from ckptfix.formats.fsdp.ranks import DTENSOR_GLOBALS, RankFilesError, assemble, check_pieces, describe_rank
    from ckptfix.formats.safety import allowlist

    pieces = []
    for path in _ranks(run):
        with open(path, "rb") as f:
            _, tree = describe_rank(
                f.fileno(), path, allowed=allowlist.allowed_names([], source=path) | DTENSOR_GLOBALS
            )
        pieces.append(tree["head.weight"].piece)
    check_pieces([{"head.weight": p} for p in pieces], _ranks(run))
    full = torch.load(run / "full.pt", weights_only=True)["model"]["head.weight"]  # [3, 8]: rows 0-1 and row 2
    parts = [dataclasses.replace(pieces[0], local=full[:2]), dataclasses.replace(pieces[1], local=full[2:])]
    assert torch.equal(assemble(parts, _ranks(run), key="head.weight"), full)
    short = [parts[0], dataclasses.replace(pieces[1], local=full[2:, :4])]  # half a row missing: the tiling has a gap
    with pytest.raises(RankFilesError, match=r"'head.weight' local shard is torch.float32 \[1, 4\] where rank \[1\]"):
        assemble(short, _ranks(run), key="head.weight")
    assert RankFilesError.exit_code == 2


# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


@pytest.mark.parametrize(
    ("dtype", "shape", "says"),
    [("Size", (2,), "dtype is Size"), ("FloatStorage", (2,), "dtype is FloatStorage"),
     ("", (2,), "dtype is not a dtype"), ("float32", (2**61, 2**61, 0), "past 64 bits")],
)  # fmt: skip
def test_dtensor_dtype_and_shape_proven(dtype: str, shape: tuple[int, ...], says: str) -> None:
    from ckptfix.errors import FormatError
    from ckptfix.formats.fsdp import ranks as shards

    with pytest.raises(FormatError, match=rf"^rank1\.pt: key 'w': its DTensor .*{says}"):
        shards._check_piece("w", dtype=dtype, shape=shape, mesh=(2,), coordinate=(0,), placements=(("replicate", 0),),
                            source="rank1.pt")  # fmt: skip


# Edited placements: refused in one line before a byte is placed, in time bounded by the file, never an uninitialized
# byte in an output.


def _edited(run: Path, out: Path, edit: Callable[[Any], None]) -> Path:
    """rank1.pt with ``edit`` applied to its first DTensor, saved by torch (the project's own file: unpickled)."""
    obj = torch.load(run / "rank1.pt", weights_only=False)
    edit(next(v for v in obj.values() if type(v).__name__ == "DTensor"))
    torch.save(obj, out)
    return out


def _coordinate(value: tuple[int, ...]) -> Callable[[Any], None]:
    return lambda t: object.__setattr__(t._spec.mesh, "_coordinate_on_dim", value)


def _placement(dim: int) -> Callable[[Any], None]:
    def edit(t: Any) -> None:
        from torch.distributed.tensor import Shard  # torch 2.4 has it as torch.distributed._tensor only

        object.__setattr__(t._spec, "placements", (Shard(dim),))

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_coordinate((-1,)), "mesh coordinate [-1] lies outside its mesh [2]"),
        (_coordinate((2,)), "mesh coordinate [2] lies outside its mesh [2]"),
        (_placement(5), "is Shard(5) of a 4-dimensional tensor"),
    ],
    ids=["negative-coordinate", "coordinate-past-the-mesh", "shard-dim-past-the-tensor"],
)
def test_an_edited_placement_is_refused_before_anything_is_placed(
    run: Path, tmp_path: Path, edit: Callable[[Any], None], message: str
) -> None:
    bad = _edited(run, tmp_path / "rank1.pt", edit)
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    for out in ("m.safetensors", "m.pt"):
        result = CliRunner().invoke(cli, ["merge", str(run / "rank0.pt"), str(bad), "-o", str(tmp_path / out)])
        assert result.exit_code == 2, result.output
        assert message in result.output and str(bad) in result.output and result.output.count("\n") == 1
        assert not (tmp_path / out).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["rank1.pt"]
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == digest


def _piece(mesh: tuple[int, ...], coordinate: tuple[int, ...]) -> shards.Piece:
    return shards.Piece("float32", (4,), mesh, coordinate, (("shard", 0),), torch.zeros(2))


def test_a_mesh_of_a_trillion_ranks_is_refused_without_enumerating_it() -> None:
    started = time.perf_counter()
    ranks = [{"w": _piece((10**12,), (0,))}, {"w": _piece((10**12,), (1,))}]
    with pytest.raises(shards.RankFilesError, match=r"2 files for a mesh of 1000000000000 ranks"):
        shards.check_pieces(ranks, ["rank0.pt", "rank1.pt"])
    assert time.perf_counter() - started < 5  # 3x margin over a busy machine; enumerating it: forever


def test_pieces_that_do_not_cover_the_tensor_leave_no_uninitialized_byte() -> None:
    # Shard(0) over 2 ranks holds rows [0, 2) and [2, 4): two copies of the first half are refused, not assembled
    parts = [_piece((2,), (0,)), _piece((2,), (0,))]
    with pytest.raises(shards.RankFilesError, match=r"its chunks cover 2 of 4 elements"):
        shards.assemble(parts, ["rank0.pt", "rank1.pt"], key="w")
    bad = shards.Piece("float32", (4,), (2,), (-1,), (("shard", 0),), torch.zeros(2))
    with pytest.raises(shards.RankFilesError, match="does not place a piece"):
        shards.assemble([_piece((2,), (0,)), bad], ["rank0.pt", "rank1.pt"], key="w")


def test_a_dtensor_of_a_huge_global_shape_is_refused_before_memory_is_taken() -> None:
    parts = [shards.Piece("float32", (2**44,), (2,), (c,), (("shard", 0),), torch.zeros(2)) for c in (0, 1)]
    with pytest.raises(shards.RankFilesError):
        shards.assemble(parts, ["rank0.pt", "rank1.pt"], key="w")
