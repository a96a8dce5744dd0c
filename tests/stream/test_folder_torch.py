"""Folders (DCP, safetensors shards) streamed into one .pt file: what torch makes of the folder, byte for byte."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from tests import sharded_writers
from tests.assertions import assert_same
from tests.models import SmallNet


def _truth(folder: Path, tmp: Path) -> Any:
    """What torch's own converter makes of the folder (it unpickles the metadata: only for files we wrote)."""
    dcp_to_torch_save(str(folder), str(tmp / "truth.pt"))
    return torch.load(tmp / "truth.pt", weights_only=False)


def _convert(*args: str | Path) -> str:
    done = CliRunner().invoke(cli, ["convert", *map(str, args), "-v"])
    assert done.exit_code == 0, done.output
    return done.output


def _plain(obj: Any) -> Any:
    """``obj`` with every mapping a dict: a converted state dict is an OrderedDict, as torch's own are."""
    return {k: _plain(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


def _loaded(path: Path) -> list[Any]:
    """The file as plain torch.load reads it, with and without mmap, and as ckptfix.load does."""
    loads = [torch.load(path, weights_only=True), torch.load(path, weights_only=True, mmap=True), ckptfix.load(path)]
    return [_plain(obj) for obj in loads]


def test_a_dcp_folder_streams_into_the_pt_file_torch_makes_of_it(single: Path, tmp_path: Path) -> None:
    said = _convert(single, tmp_path / "full.pt")
    assert "path: stream; dcp -> torch: 16 storages, 16 copied as byte ranges, 0 gathered in memory" in said
    truth = _truth(single, tmp_path)
    for got in _loaded(tmp_path / "full.pt"):
        assert_same(got, _plain(truth))


def test_the_model_of_a_dcp_folder_streams_with_a_new_layout(single: Path, tmp_path: Path) -> None:
    _convert(single, tmp_path / "ddp.pt", "--model-only", "--entry", "model", "--to", "ddp")
    expected = {f"module.{k}": v for k, v in SmallNet().state_dict().items()}  # a dict, as _plain makes
    for got in _loaded(tmp_path / "ddp.pt"):
        assert_same(got, expected)


def test_safetensors_shards_stream_into_one_pt_file(tmp_path: Path) -> None:
    state = SmallNet().state_dict()
    (tmp_path / "shards").mkdir()
    ckptfix.save(state, tmp_path / "shards" / "model.safetensors", shard_size=200)
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 2
    said = _convert(tmp_path / "shards", tmp_path / "model.pt")
    assert "path: stream; shards -> torch: 16 storages, 16 copied as byte ranges" in said
    for got in _loaded(tmp_path / "model.pt"):
        assert_same(got, _plain(state))


def test_a_corrupt_chunk_is_refused_and_no_output_is_left(single: Path, tmp_path: Path) -> None:
    sharded_writers.corrupt_chunk(single, "model.features.3.weight")
    with pytest.raises(FormatError, match="CRC"):
        ckptfix.convert_file(single, tmp_path / "full.pt")
    assert sorted(os.listdir(tmp_path)) == ["dcp"]


@pytest.mark.parametrize("record", ["data.pkl", "data/0"])
def test_a_damaged_last_chunk_stops_the_copy_already_running_and_leaves_nothing(
    single: Path, tmp_path: Path, record: str
) -> None:
    # the earlier tensors are being copied on a thread while the last one's archive is parsed (data.pkl), or its
    # CRC is checked after the copy (data/0)
    import threading

    last = list(SmallNet().state_dict())[-1]
    sharded_writers.corrupt_chunk(single, f"model.{last}", record=record)
    with pytest.raises(FormatError, match=rf"__0_0\.distcp.*{record}.*CRC"):
        ckptfix.convert_file(single, tmp_path / "full.pt")
    assert sorted(os.listdir(tmp_path)) == ["dcp"]
    assert not [t for t in threading.enumerate() if t.name in ("ckptfix-copy", "ckptfix-verify", "ckptfix-crc")]


@pytest.mark.slow
# fsdp2-cols: two weight matrices sharded by columns, and their optimizer moments (exp_avg, exp_avg_sq)
@pytest.mark.parametrize(("mode", "gathered"), [("fsdp2", 0), ("ddp", 0), ("fsdp2-cols", 6)])
def test_two_rank_dcp_folders_stream_into_a_pt_file_exactly(tmp_path: Path, mode: str, gathered: int) -> None:
    out = sharded_writers.write(tmp_path / mode, mode)
    # the optimizer kept keyed by name, as torch's own converter keeps it (the default re-keys it by index)
    said = _convert(out / "dcp", tmp_path / "full.pt", "--optimizer-form", "names")
    assert f"{gathered} gathered in memory" in said
    truth = _truth(out / "dcp", tmp_path)
    for got in _loaded(tmp_path / "full.pt"):
        assert_same(got, _plain(truth))
