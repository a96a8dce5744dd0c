"""FSDP1 sharded optimizer state (``FSDP.optim_state_dict`` under SHARDED_STATE_DICT) in ``ckptfix merge``: left out
with a note by default, consolidated with ``--optimizer`` into exactly what FULL_STATE_DICT gives, and loadable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.errors import UsageError
from ckptfix.formats.fsdp.ranks import RankFilesError
from ckptfix.merging.files import merge_files
from tests import sharded_writers
from tests.assertions import assert_equal
from tests.models import SmallNet

slow = pytest.mark.slow  # one real 2-process FSDP1 run (gloo) serves the tests of real files

NOTE_SGD = (
    "consolidated 'optim': FSDP1 sharded optimizer state, 10 ShardedTensor(s) reassembled, step and param_groups "
    "equal on every rank; keyed by parameter name, as FSDP.optim_state_dict gives it under FULL_STATE_DICT"
)
LEFT_OUT = (
    "left out 'optim': FSDP1 sharded optimizer state (10 ShardedTensor(s)); pass --optimizer to consolidate it (off "
    "by default: it can be several times the model)"
)


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1-optim"))


@pytest.fixture(scope="module")
def truth(fsdp1: Path) -> dict[str, Any]:
    """Rank 0's FULL_STATE_DICT optimizer state of each run (``sgd``, ``adamw``) and the AdamW run's model."""
    return torch.load(fsdp1 / "full_optim.pt", weights_only=True)  # type: ignore[no-any-return]


def _pair(fsdp1: Path, stem: str) -> list[Path]:
    return [fsdp1 / f"{stem}{r}.pt" for r in range(sharded_writers.WORLD)]


def _cli(*args: object) -> Any:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@slow
@pytest.mark.parametrize(("stem", "which", "buffers"), [("train", "sgd", "momentum_buffer"),
                                                        ("adamw", "adamw", "exp_avg_sq")])  # fmt: skip
def test_optimizer_consolidates_the_sharded_optimizer_state_exactly(
    fsdp1: Path, truth: dict[str, Any], tmp_path: Path, stem: str, which: str, buffers: str
) -> None:
    ranks = _pair(fsdp1, stem)
    before = [p.read_bytes() for p in ranks]
    out = tmp_path / "full.pt"
    result = _cli("merge", *ranks, "-o", out, "--buffers", "rank0", "--optimizer")
    assert result.exit_code == 0, result.output
    count = 10 if which == "sgd" else 20  # per parameter: momentum_buffer; exp_avg and exp_avg_sq
    assert f"reassembled {10 + count} ShardedTensor tensor(s) from every rank's shards" in result.output
    assert NOTE_SGD.replace("10 ShardedTensor", f"{count} ShardedTensor") in result.output.splitlines()
    assert f"taken from {ranks[0]}: epoch" in result.output
    merged = torch.load(out, weights_only=True)
    assert list(merged) == ["model", "optim", "epoch"] and merged["epoch"] == 1
    assert_equal(merged["optim"], truth[which])  # FSDP.optim_state_dict under FULL_STATE_DICT in the same job
    model = truth["adamw_model"] if which == "adamw" else torch.load(fsdp1 / "full.pt", weights_only=True)
    assert_equal(dict(merged["model"]), dict(model))
    assert all(buffers in s for s in merged["optim"]["state"].values())
    assert [p.read_bytes() for p in ranks] == before  # inputs untouched


@slow
def test_the_json_report_lists_the_optimizer_tensors_and_the_note(fsdp1: Path, tmp_path: Path) -> None:
    report = json.loads(_cli("merge", *_pair(fsdp1, "train"), "-o", tmp_path / "m.pt", "--optimizer", "--json").output)
    assert report["notes"] == [NOTE_SGD]
    assert report["kept_from_first"] == ["epoch"] and report["left_out"] == []
    optim = sorted(k for k in report["reassembled"] if k.startswith("optim."))
    assert optim == sorted(f"optim.state.{name}.momentum_buffer" for name, _ in SmallNet(width=8).named_parameters())


@slow
def test_without_optimizer_the_sharded_optimizer_state_is_left_out_with_a_note(fsdp1: Path, tmp_path: Path) -> None:
    ranks = _pair(fsdp1, "train")
    out = tmp_path / "m.pt"
    result = _cli("merge", *ranks, "-o", out, "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    assert LEFT_OUT in result.output.splitlines() and f"taken from {ranks[0]}: epoch" in result.output
    assert "reassembled 10 ShardedTensor tensor(s)" in result.output  # the model's, not the optimizer's
    merged = torch.load(out, weights_only=True)
    assert list(merged) == ["model", "epoch"] and merged["epoch"] == 1
    assert_equal(dict(merged["model"]), dict(torch.load(fsdp1 / "full.pt", weights_only=True)))
    report = json.loads(_cli("merge", *ranks, "-o", tmp_path / "j.pt", "--json").output)
    assert report["notes"] == [LEFT_OUT] and report["kept_from_first"] == ["epoch"] and report["left_out"] == []
    assert len(report["reassembled"]) == 10 and not any(k.startswith("optim.") for k in report["reassembled"])
    only = json.loads(_cli("merge", *ranks, "-o", tmp_path / "o.pt", "--model-only", "--json").output)
    assert only["left_out"] == ["optim", "epoch"] and only["notes"] == [] and len(only["reassembled"]) == 10


@slow
def test_the_optimizer_state_saved_alone_merges_with_optimizer_only(
    fsdp1: Path, truth: dict[str, Any], tmp_path: Path
) -> None:
    ranks = _pair(fsdp1, "adamw_optim")  # each rank's torch.save(FSDP.optim_state_dict(model, opt)), no model
    out = tmp_path / "optim.pt"
    result = _cli("merge", *ranks, "-o", out, "--optimizer")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "merged 2 rank file(s)",
        "reassembled 20 ShardedTensor tensor(s) from every rank's shards (ShardedTensor, 2 shard(s) over 2 "
        "rank(s)): full tensors, not averaged",
        "consolidated the optimizer state dict: FSDP1 sharded optimizer state, 20 ShardedTensor(s) reassembled, step "
        "and param_groups equal on every rank; keyed by parameter name, as FSDP.optim_state_dict gives it under "
        "FULL_STATE_DICT",
        f"wrote {out}",
    ]
    assert_equal(torch.load(out, weights_only=True), truth["adamw"])
    refused = _cli("merge", *ranks, "-o", tmp_path / "no.pt")
    assert refused.exit_code == 2 and not (tmp_path / "no.pt").exists()
    assert refused.output == (
        f"ckptfix: error: {ranks[0]}: holds FSDP1 sharded optimizer state alone (no model state dict); pass "
        f"--optimizer to consolidate it\n"
    )
    library = merge_files(ranks, tmp_path / "lib.pt", optimizer=True)  # the library: same result, same note
    assert library.notes == [result.output.splitlines()[2]] and library.entries == []
    assert_equal(torch.load(tmp_path / "lib.pt", weights_only=True), truth["adamw"])


@slow
def test_bad_uses_of_optimizer_are_refused_in_one_line(fsdp1: Path, tmp_path: Path) -> None:
    adamw = _pair(fsdp1, "adamw")
    out = tmp_path / "m.pt"
    changed = "the optimizer state beside the shards (step, param_groups) is the same on every rank of one job: " \
              "these are files of two runs or steps"  # fmt: skip
    cases = [
        ((*adamw, "--model-only"), "--optimizer and --model-only ask for opposite things (the optimizer state, the "
                                   "model alone); drop one"),
        ((*adamw, "-o", tmp_path / "m.safetensors"), f"--optimizer writes the optimizer state into one .pt file, but "
         f"{tmp_path / 'm.safetensors'} asks for a .safetensors file (tensors only); write a .pt, or drop --optimizer"),
        (_pair(fsdp1, "sharded"), f"{fsdp1 / 'sharded0.pt'}: holds no FSDP1 sharded optimizer state "
                                  f"(ShardedTensors outside the model state dict); --optimizer consolidates FSDP1 "
                                  f"SHARDED_STATE_DICT rank files' optimizer state: drop --optimizer (other entries "
                                  f"are kept as they are)"),
        ((fsdp1 / "full.pt",), f"{fsdp1 / 'full.pt'}: holds no FSDP1 sharded optimizer state"),
        ((adamw[0], fsdp1 / "adamw_lr1.pt"), f"{fsdp1 / 'adamw_lr1.pt'}: 'optim.param_groups.0.lr' is 0.02, but 0.01 "
                                             f"in {adamw[0]}; {changed}"),
        ((adamw[0], fsdp1 / "adamw_step21.pt"), f"{fsdp1 / 'adamw_step21.pt'}: 'optim.state.features.0.weight.step' "
                                                f"holds other values than in {adamw[0]}; {changed}"),
        ((adamw[0],), "'model.features.0.weight': the shards of rank(s) [1] are missing (1 file(s) for a job of 2 "
                      "ranks)"),
        ((adamw[0], adamw[0]), f"{adamw[0]}: rank 0 is given twice"),
        ((adamw[0], fsdp1 / "train1.pt"), f"{fsdp1 / 'train1.pt'}: its sharded keys differ from {adamw[0]}'s"),
    ]  # fmt: skip
    for args, message in cases:
        given = [str(a) for a in args]
        result = _cli("merge", *given, *([] if "-o" in given else ["-o", out]), "--optimizer")
        assert result.exit_code == 2, (args, result.output)
        error = result.output.splitlines()[-1]
        assert error.startswith(f"ckptfix: error: {message}"), (args, error)
        assert "Traceback" not in result.output and not out.exists() and not (tmp_path / "m.safetensors").exists()
    with pytest.raises(UsageError, match=r"optimizer=True and model_only=True ask for opposite things"):
        merge_files(adamw, out, optimizer=True, model_only=True)


@slow
def test_the_consolidated_optimizer_state_resumes_fsdp1_and_a_plain_model(
    fsdp1: Path, truth: dict[str, Any], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    out = tmp_path / "full.pt"
    assert _cli("merge", *_pair(fsdp1, "adamw"), "-o", out, "--buffers", "rank0", "--optimizer").exit_code == 0
    merged = torch.load(out, weights_only=True)
    # a fresh FSDP1 job: FSDP.optim_state_dict_to_load, then the state it holds is the merged one
    assert_equal(sharded_writers.resume_fsdp1(out, tmp_path / "resumed.pt"), merged["optim"])
    # FSDP1 keeps one `step` per flat parameter, shared by its parameters' entries: kept shared, as FSDP writes it
    assert _sharing(merged["optim"]) == _sharing(truth["adamw"]) == [8, 2]
    # a plain model and a plain AdamW, as docs/formats.md shows: each `step` its own tensor (a plain AdamW adds 1
    # to each in place), then torch maps the parameter names to its numbering
    model = SmallNet(width=8, seed=99)
    model.load_state_dict(merged["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    optim = merged["optim"]
    for state in optim["state"].values():
        state["step"] = state["step"].clone()
    set_optimizer_state_dict(model, opt, optim)
    loaded = opt.state_dict()
    names = [name for name, _ in model.named_parameters()]
    assert list(loaded["state"]) == list(range(len(names)))
    for index, name in enumerate(names):
        assert_equal(loaded["state"][index], truth["adamw"]["state"][name], name)
    group = {k: v for k, v in loaded["param_groups"][0].items() if k != "params"}
    assert group == {k: v for k, v in truth["adamw"]["param_groups"][0].items() if k != "params"}  # lr 0.01 again
    model(torch.randn(2, 3, 8, 8)).square().mean().backward()
    opt.step()  # it trains on, each parameter at its second step
    assert [float(opt.state_dict()["state"][i]["step"]) for i in range(len(names))] == [2.0] * len(names)


def _sharing(optim: dict[str, Any]) -> list[int]:
    """How many parameters' ``step`` share each storage, in order."""
    counts: dict[int, int] = {}
    for state in optim["state"].values():
        ptr = state["step"].untyped_storage().data_ptr()
        counts[ptr] = counts.get(ptr, 0) + 1
    return list(counts.values())


# -- the pure transforms, on hand-made trees ------------------------------------------------------------------------


def _record(key: str) -> Any:
    from ckptfix.formats.fsdp.ranks import ShardedTensorRecord

    return ShardedTensorRecord("float32", (4,), "ShardedTensor, 2 shard(s) over 2 rank(s)", key)


def test_consolidated_swaps_each_sharded_tensor_for_a_placeholder_and_leaves_the_input() -> None:
    from collections import OrderedDict

    from ckptfix.merging.sharded_optim import consolidated, outside_entries, without
    from ckptfix.writing import Placeholder

    model = OrderedDict(w=_record("model\0w"))
    optim = {"state": {"w": {"exp_avg": _record("optim\0state\0w\0exp_avg"), "step": 3}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]}  # fmt: skip
    tree = {"model": model, "optim": optim, "epoch": 1}
    keys = ["model\0w", "optim\0state\0w\0exp_avg"]
    assert outside_entries(tree, keys, ["model"]) == ["optim"]
    assert outside_entries(model, ["w"], [""]) == [] and outside_entries(optim, keys[1:], []) == [""]
    out, placeholders = consolidated(tree, ["optim"])
    assert list(placeholders) == [keys[1]] and isinstance(placeholders[keys[1]], Placeholder)
    assert out["optim"]["state"]["w"] == {"exp_avg": placeholders[keys[1]], "step": 3}
    assert out["optim"]["param_groups"] == optim["param_groups"] and out["model"] is model and out["epoch"] == 1
    assert tree["optim"]["state"]["w"]["exp_avg"].key == keys[1]  # the input is unchanged
    alone, found = consolidated(optim, [""])
    assert list(found) == [keys[1]] and alone["state"]["w"]["exp_avg"] is found[keys[1]]
    assert list(without(tree, ["optim"])) == ["model", "epoch"] and list(tree) == ["model", "optim", "epoch"]


def test_what_differs_beside_the_shards_is_named_by_its_key() -> None:
    from ckptfix.merging.sharded_optim import check_beside_shards

    def optim(lr: float, step: int, *, extra: bool = False) -> dict[str, Any]:
        state = {"exp_avg": _record("o\0state\0w\0exp_avg"), "step": torch.tensor(float(step))}
        group = {"lr": lr, "params": ["w"], **({"x": 1} if extra else {})}
        return {"o": {"state": {"w": state}, "param_groups": [group]}}

    def check(*trees: Any) -> None:
        check_beside_shards(trees, [lambda t: t] * len(trees), ["r0.pt", "r1.pt"], entries=["o"])

    check(optim(0.1, 1), optim(0.1, 1))
    cases = [
        (optim(0.2, 1), "r1.pt: 'o.param_groups.0.lr' is 0.2, but 0.1 in r0.pt; the optimizer state beside"),
        (optim(0.1, 2), "r1.pt: 'o.state.w.step' holds other values than in r0.pt;"),
        (optim(0.1, 1, extra=True), "r1.pt: 'o.param_groups.0.x' is here but not in r0.pt;"),
    ]
    for other, message in cases:
        with pytest.raises(RankFilesError) as found:
            check(optim(0.1, 1), other)
        assert str(found.value).startswith(message), str(found.value)
