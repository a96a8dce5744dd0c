"""FSDP1 LOCAL_STATE_DICT rank files (flat parameters) merged, given the model that was wrapped, into exactly the
FULL_STATE_DICT of the same job; a model that does not lay the flat parameters out is refused in one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

import ckptfix
from ckptfix.formats.folders.fsdp import RankFilesError
from ckptfix.merging import merge_files
from tests import sharded_writers
from tests.models import SmallNet, TiedNet

# Slow (each test marked): real FSDP1 runs on 2 or 3 gloo processes, one per case for the module

# width 5: parameters of 135 and 5 elements, so use_orig_params=True pads before most of them
RUNS: dict[str, dict[str, Any]] = {
    "orig-tied": {"orig": True, "tied": True, "width": 5},  # alignment and trailing padding; a shared weight
    "tied": {"tied": True, "width": 5},  # use_orig_params=False: no padding; the shared weight flattened once
    "orig-3-ranks": {"orig": True, "width": 5, "world": 3},
    "orig-bf16": {"orig": True, "width": 5, "mixed": True},  # MixedPrecision: 16 bytes of bfloat16 = 8 elements
}
Jobs = Callable[[str], tuple[Path, dict[str, Any]]]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """The folder of run ``name`` of :data:`RUNS` (written on first use, once for the module) and how it ran."""
    made: dict[str, Path] = {}

    def job(name: str) -> tuple[Path, dict[str, Any]]:
        if name not in made:
            made[name] = sharded_writers.write_fsdp1(tmp_path_factory.mktemp(name), **RUNS[name])
        return made[name], RUNS[name]

    return job


def _locals(folder: Path, how: dict[str, Any]) -> list[Path]:
    return [folder / f"local{r}.pt" for r in range(how.get("world", sharded_writers.WORLD))]


def _model_args(how: dict[str, Any], **kwargs: Any) -> list[str]:
    factory = "TiedNet" if how.get("tied") else "SmallNet"
    return ["--model", f"tests.models:{factory}", "--kwargs", json.dumps({"width": how["width"], **kwargs})]


def _cli(*args: Any) -> Result:
    from ckptfix.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_local_rank_files_merge_into_the_full_state_dict(jobs: Jobs, name: str, tmp_path: Path) -> None:
    folder, how = jobs(name)
    ranks = _locals(folder, how)
    before = [p.read_bytes() for p in ranks]
    full = torch.load(folder / "full.pt", weights_only=True)  # rank 0's FULL_STATE_DICT in the same job
    out = tmp_path / "full.pt"
    result = _cli("merge", *ranks, "-o", out, "--buffers", "rank0", *_model_args(how))
    assert result.exit_code == 0, result.output
    params = [k for k in full if "running" not in k and "num_batches" not in k]
    world = len(ranks)
    assert f"reassembled {len(params)} ShardedTensor tensor(s) from every rank's shards (ShardedTensor, {world} " \
           f"shard(s) over {world} rank(s), split from '_flat_param'; ShardedTensor, {world} shard(s) over {world} " \
           f"rank(s), split from 'head._flat_param'): full tensors, not averaged" in result.output  # fmt: skip
    merged = torch.load(out, weights_only=True)
    assert list(merged) == list(full)  # FULL_STATE_DICT's keys in its order (a shared weight after its module's own)
    for key, value in full.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
    assert [p.read_bytes() for p in ranks] == before
    model = TiedNet(width=how["width"]) if how.get("tied") else SmallNet(width=how["width"])
    st = tmp_path / "full.safetensors"  # the library, into the other format
    report = merge_files(ranks, st, model=model, buffers="rank0")
    assert sorted(report.reassembled) == sorted(params)
    assert report.reassembled["head.bias"].endswith("split from 'head._flat_param'")
    from_st = ckptfix.load(st)
    assert set(from_st) == set(full) and all(torch.equal(from_st[k], v) for k, v in full.items())
    assert ckptfix.load_into(model, out).loads_as_is


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_model_of_other_sizes_is_refused_with_the_numbers(jobs: Jobs, name: str, tmp_path: Path) -> None:
    folder, how = jobs(name)
    ranks = _locals(folder, how)
    out = tmp_path / "m.pt"
    wrong = TiedNet(width=6) if how.get("tied") else SmallNet(width=6)
    need = sum(p.numel() for name, p in wrong.named_parameters() if not name.startswith("head."))  # the root unit's
    result = _cli("merge", *ranks, "-o", out, *_model_args(how, width=6))
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output and not out.exists()
    assert result.output.startswith(f"ckptfix: error: {ranks[0]}: '_flat_param' holds "), result.output
    assert f" elements, but the {len(list(wrong.parameters())) - 2} parameter(s) of the model's root module need " \
           f"{need} (" in result.output  # fmt: skip
    assert "with use_orig_params=True padding); pass the model that was wrapped, built with the same arguments" \
           in result.output  # fmt: skip


class _SplitOtherwise(SmallNet):
    """SmallNet(width=5) whose first convolution is two flat tensors of 130 and 10 elements: with FSDP's alignment
    padding they fill the same 144 elements as the real 135 and 5, so only the parameters' parts on each rank (in
    a use_orig_params=True file) tell the split is wrong."""

    def __init__(self) -> None:
        super().__init__(width=5)
        conv = nn.Module()
        conv.weight = nn.Parameter(torch.zeros(130))
        conv.bias = nn.Parameter(torch.zeros(10))
        self.features[0] = conv


@pytest.mark.slow
def test_a_wrong_split_of_the_same_size_is_refused(jobs: Jobs, tmp_path: Path) -> None:
    ranks = _locals(*jobs("orig-3-ranks"))
    real = SmallNet(width=5).features[0].weight.numel()
    with pytest.raises(RankFilesError) as caught:
        merge_files(ranks, tmp_path / "m.pt", model=_SplitOtherwise())
    assert str(caught.value) == (
        f"{ranks[0]}: 'features.0.weight' holds {real} elements on rank 0, but the model's layout of '_flat_param' "
        f"puts 130 of its 130 there; pass the model that was wrapped"
    )
    assert not (tmp_path / "m.pt").exists()
    across = SmallNet(width=5)  # the head's weight also used outside its FSDP unit: not a split ckptfix can know
    across.extra = nn.Linear(5, 3)
    across.extra.weight = across.head.weight
    with pytest.raises(RankFilesError) as caught:
        merge_files(ranks, tmp_path / "m.pt", model=across)
    assert str(caught.value) == (
        f"{ranks[0]}: the model's parameter 'extra.weight' is also 'head.weight' of the nested FSDP unit 'head': a "
        f"parameter shared across units, which ckptfix does not split; save FULL_STATE_DICT or SHARDED_STATE_DICT "
        f"instead"
    )


@pytest.mark.slow
def test_a_missing_rank_or_another_model_is_refused(jobs: Jobs, tmp_path: Path) -> None:
    folder, how = jobs("orig-tied")
    ranks = _locals(folder, how)
    out = tmp_path / "m.pt"
    cases = [
        ((ranks[0], *_model_args(how)), "'_flat_param': the shards of rank(s) [1] are missing (1 file(s) for a job "
                                        "of 2 ranks); pass every rank's file exactly once"),
        ((*ranks, "--model", "tests.models:SmallNet", "--kwargs", '{"width": 5}'),
         f"{ranks[0]}: '_flat_param' holds "),  # TiedNet's files, SmallNet's parameters: fewer elements
        ((*ranks,), f"{ranks[0]}: 'head._flat_param' is an FSDP1 LOCAL_STATE_DICT flat parameter ("),  # its first
    ]  # fmt: skip
    for args, message in cases:
        result = _cli("merge", *args, "-o", out)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith(f"ckptfix: error: {message}"), (args, result.output)
        assert result.output.count("\n") == 1 and not out.exists()
