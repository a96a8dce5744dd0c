"""FSDP rank files are told apart by the registry (``registry.rank_kind``) from the one read of their pickle:
``inspect`` and ``merge`` both ask it, and neither reads a rank file's pickle twice."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckptfix.cli import cli
from ckptfix.formats.registry import rank_file_refusal
from ckptfix.formats.safety.allowlist import ShardedCheckpointError
from ckptfix.reading import open_checkpoint
from tests import sharded_writers

pytestmark = pytest.mark.slow  # real 2-process FSDP2 and FSDP1 runs (gloo)


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1"))


def test_the_registry_says_which_rank_file_each_is(fsdp2: Path, fsdp1: Path) -> None:
    for path, kind in [(fsdp2 / "rank0.pt", "dtensor"), (fsdp1 / "sharded0.pt", "sharded-tensor")]:
        with open_checkpoint(path, opaque=True, ranks=True) as opened:
            assert opened.rank_kind == kind
    with pytest.raises(ShardedCheckpointError) as refused:
        open_checkpoint(fsdp2 / "rank0.pt", opaque=True)  # read as a full checkpoint: the registry's refusal
    assert str(refused.value) == str(rank_file_refusal("dtensor", source=str(fsdp2 / "rank0.pt")))


def test_inspect_reads_a_rank_file_s_pickle_once(fsdp2: Path, pickle_reads: Counter[str]) -> None:
    path = str(fsdp2 / "rank1.pt")
    result = _cli("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["dtensor"]["coordinate"] == [1]
    assert pickle_reads[path] == 1


def test_inspect_of_an_fsdp1_rank_file_says_what_it_is(fsdp1: Path) -> None:
    path = fsdp1 / "sharded0.pt"
    result = _cli("inspect", path)
    assert result.exit_code != 0
    assert result.output.strip().endswith(str(rank_file_refusal("sharded-tensor", source=str(path))))
