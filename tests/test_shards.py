"""FSDP2 rank files (DTensor shards): recognised without building them, refused as a full model, reassembled."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.errors import MergeError
from ckptfix.formats.shards import ShardedCheckpointError, load_ranks
from tests import sharded_writers

pytestmark = pytest.mark.slow  # one real 2-process FSDP2 run (gloo) serves the module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


def _ranks(run: Path) -> list[str]:
    return [str(run / f"rank{r}.pt") for r in range(sharded_writers.WORLD)]


def test_one_rank_file_is_said_to_be_shards_not_a_model(run: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match=r"holds DTensor shards .*formats\.shards\.load_ranks"):
        ckptfix.load(run / "rank0.pt")


def test_converting_one_rank_file_is_refused_in_one_line(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    cli = [sys.executable, "-c", "from ckptfix.cli import main; main()"]
    done = subprocess.run([*cli, "convert", str(run / "rank0.pt"), str(out)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "holds DTensor shards" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def test_every_ranks_file_reassembles_the_full_model(run: Path) -> None:
    trees = load_ranks(_ranks(run))
    full = torch.load(run / "full.pt", weights_only=True)["model"]
    for rank, tree in enumerate(trees):
        assert list(tree) == list(full)
        own = torch.load(run / f"rank{rank}.pt", weights_only=False)  # our own file: the truth for plain tensors
        for key, value in full.items():
            expected = value if "running" not in key else own[key]  # BatchNorm statistics stay each rank's own
            assert torch.equal(tree[key], expected), (rank, key)


def test_a_missing_rank_is_refused(run: Path) -> None:
    with pytest.raises(MergeError, match=r"1 files for a mesh of 2 ranks \[2\].*pass every rank's file exactly once"):
        load_ranks(_ranks(run)[:1])


def test_one_rank_twice_is_refused(run: Path) -> None:
    with pytest.raises(MergeError, match="pass every rank's file exactly once"):
        load_ranks([_ranks(run)[0], _ranks(run)[0]])


def test_rank_files_of_two_runs_are_refused(run: Path, tmp_path: Path) -> None:
    other = sharded_writers.write(tmp_path / "wide", "fsdp2-wide")
    with pytest.raises(MergeError, match=r"is float32 \[12, 3, 3, 3\] sharded .* the files are from different runs"):
        load_ranks([_ranks(run)[0], str(other / "rank1.pt")])
    shutil.rmtree(other)


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1"))


def test_fsdp1_flat_parameters_are_never_written_as_a_model(fsdp1: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match=r"'_fsdp_wrapped_module._flat_param' is an FSDP1 flat parameter"):
        ckptfix.convert_file(fsdp1 / "flat0.pt", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_fsdp1_local_state_dicts_say_what_they_are(fsdp1: Path) -> None:
    with pytest.raises(ShardedCheckpointError, match=r"holds ShardedTensor shards \(an FSDP1 LOCAL_STATE_DICT"):
        ckptfix.load(fsdp1 / "local0.pt")


def test_validate_reports_rank_files_as_shards_with_exit_1(run: Path, fsdp1: Path) -> None:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    for path, what in ((run / "rank0.pt", "holds DTensor shards"), (fsdp1 / "flat0.pt", "is an FSDP1 flat parameter")):
        result = CliRunner().invoke(cli, ["validate", str(path), "--model", "tests.models:SmallNet"])
        assert result.exit_code == 1, result.output
        assert what in result.output and result.output.count("\n") == 1
