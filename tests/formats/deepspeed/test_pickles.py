"""DeepSpeed rank files checked against what they say of themselves (issue 32): a file's rank comes from its name,
but the file records its partition (``param_slice_mappings``, ``group_paddings``, partition lengths) and its run
(``ds_config``: ZeRO stage and precision); a file renamed, swapped or copied in from another run is refused, by
name, before anything is written."""

from __future__ import annotations

import hashlib
import math
import pickle
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import FormatError
from tests.deepspeed_files import (
    FIXTURES,
    EditUnpickler,
    StubPickler,
    copy_run,
    edit_rank_file,
    expected,
    refusal,
    run_cli,
)
from tests.extras import DEEPSPEED, needs


def swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swapping")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def digests(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", [f"zero{s}_{d}" for s in (1, 2) for d in ("fp32", "bf16", "fp16")])
def test_swapped_optimizer_files_refused(name: str, tmp_path: Path) -> None:
    run = copy_run(name, tmp_path)
    tag = run / "global_step1"
    prefix = "bf16_" if "bf16" in name else ""
    rank0, rank1 = (tag / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    swap(rank0, rank1)
    before = digests(run)
    line = refusal("convert", run, tmp_path / "out.safetensors")
    assert line == (
        f"ckptfix: error: {rank0}: its param_slice_mappings are rank 1's partition, but its name says rank 0 "
        f"({rank1.name} holds rank 0's); the rank files were renamed or swapped: give each file its own rank's name"
    )
    assert digests(run) == before


def test_swapped_partitions_without_mappings_refused_by_their_lengths(tmp_path: Path) -> None:
    run = copy_run("zero2_fp32", tmp_path)  # an older DeepSpeed's files: no param_slice_mappings
    tag = run / "global_step1"
    rank0, rank1 = (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    for f in (rank0, rank1):
        edit_rank_file(f, lambda tree: tree["optimizer_state_dict"].pop("param_slice_mappings"))
    swap(rank0, rank1)
    assert refusal("inspect", run) == (
        f"ckptfix: error: {rank1}: group 0's partition holds 92 elements, more than the 90 of {rank0.name}; only the "
        f"last rank's partition is shorter: the rank files were renamed or swapped: give each file its own rank's name"
    )


@pytest.mark.parametrize(
    ("source", "file", "claim"),
    [
        ("zero2_bf16", "mp_rank_00_model_states.pt", "ds_config's precision 'bf16', but {optim} says 'fp32'"),
        ("zero2_fp16", "mp_rank_00_model_states.pt", "ds_config's precision 'fp16', but {optim} says 'fp32'"),
        ("zero1_fp32", "mp_rank_00_model_states.pt", "ds_config's ZeRO stage 1, but {optim} says 2"),
        (
            "zero3_bf16",
            "zero_pp_rank_1_mp_rank_00_model_states.pt",
            "ds_config's precision 'bf16', but {optim} says 'fp32'",
        ),
    ],
)
def test_module_file_of_another_run_refused(source: str, file: str, claim: str, tmp_path: Path) -> None:
    name = "zero3_fp32" if file.startswith("zero_pp") else "zero2_fp32"
    run = copy_run(name, tmp_path)
    tag = run / "global_step1"
    shutil.copy(FIXTURES / source / "global_step1" / file, tag / file)
    before = digests(run)
    line = refusal("convert", run, tmp_path / "out.safetensors")
    optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert line == (
        f"ckptfix: error: {tag / file}: {claim.format(optim=optim)}; the folder mixes two runs: keep one run's files"
    )
    assert digests(run) == before


def test_optimizer_file_claiming_another_stage_refused(tmp_path: Path) -> None:
    run = copy_run("zero2_fp32", tmp_path)  # ZeRO-1 and ZeRO-2 files are alike but for the stage they record
    tag = run / "global_step1"
    rank1 = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    edit_rank_file(rank1, lambda tree: tree["ds_config"]["zero_optimization"].__setitem__("stage", 1))
    assert refusal("inspect", run) == (
        f"ckptfix: error: {rank1}: ds_config's ZeRO stage 1, but zero_pp_rank_0_mp_rank_00_optim_states.pt says 2; "
        f"the folder mixes two runs: keep one run's files"
    )


# -- a run folder whose 'latest' cannot say which tag: what was found, and which folder to pass ----------------------


def test_two_tags_without_latest_name_the_tag_to_pass(tmp_path: Path) -> None:
    run = copy_run("zero2_fp32", tmp_path)
    (run / "latest").unlink()
    shutil.copytree(run / "global_step1", run / "global_step20")
    (run / "global_step1").rename(run / "global_step10")
    (run / "logs").mkdir()  # not a tag: no rank files in it
    assert refusal("convert", run, tmp_path / "out.safetensors") == (
        f"ckptfix: error: {run}: two DeepSpeed tags global_step10, global_step20 and no 'latest': pass the tag "
        f"folder, e.g. {run / 'global_step20'}"
    )
    (run / "global_step10").rename(run / "global_step9")  # tags in step order, not in the order of their names
    assert refusal("inspect", run).endswith(f"e.g. {run / 'global_step20'}")
    shutil.rmtree(run / "global_step9")
    assert refusal("inspect", run) == (
        f"ckptfix: error: {run}: a DeepSpeed tag global_step20 and no 'latest': pass the tag folder, e.g. "
        f"{run / 'global_step20'}"
    )


@pytest.mark.parametrize("kind", ["loop", "dangling", "folder"])
def test_latest_that_cannot_be_read_named_as_such(kind: str, tmp_path: Path) -> None:
    run = copy_run("zero2_fp32", tmp_path)
    latest = run / "latest"
    latest.unlink()
    if kind == "loop":
        latest.symlink_to("latest")
    elif kind == "dangling":
        latest.symlink_to("gone")
    else:
        latest.mkdir()
    why = {"loop": "a symlink loop", "dangling": "a link to gone, which is not there",
           "folder": "a folder, not a regular file"}[kind]  # fmt: skip
    assert refusal("convert", run, tmp_path / "out.safetensors") == (
        f"ckptfix: error: {latest}: DeepSpeed's 'latest' file cannot be read ({why}): pass the tag folder, e.g. "
        f"{run / 'global_step1'}"
    )


def test_empty_folder_says_what_every_folder_format_needs(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert refusal("convert", tmp_path / "empty", tmp_path / "out.safetensors") == (
        f"ckptfix: error: {tmp_path / 'empty'}: no checkpoint here (no *.index.json, model.safetensors, "
        f"pytorch_model.bin or model_N.safetensors; no DCP .metadata; no DeepSpeed 'latest' or tag folder of rank "
        f"files); pass a checkpoint file or a folder that holds one"
    )


# ----------------------------------------------------------------------------------------------------------------------
# ZeRO-3 rank files against what they say of their rank (issue 32). The two ranks' pickles of every run in
# fixtures/deepspeed/ (and of fresh runs with and without parameters whose size the world size does not divide)
# hold the same keys, shapes, partition lengths (ZeRO-3 pads each parameter to a multiple of the world size, so every
# rank's partition is as long), ``partition_count``, ``param_shapes`` order and ``ds_id`` on every rank. Two things
# say a file's rank: DeepSpeed fills ``shared_params`` (the tied names) on rank 0 alone, and torch.save names the
# archive's one folder after the file it was given (``zero_pp_rank_1_mp_rank_00_optim_states/data.pkl``). A swap is
# refused by either; where a file was saved through a file object (``archive/``) and names no tied parameters, its
# swap cannot be told, and converts to what DeepSpeed's own consolidation of the swapped folder gives (pinned here,
# so docs/formats.md stays true).


DTYPES = ["fp32", "bf16", "fp16"]
MODULE = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
RENAMED = "the rank files were renamed or swapped: give each file its own rank's name"


def optim_name(dtype: str, rank: int) -> str:
    return f"{'bf16_' if dtype == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_module_files_refused(dtype: str, tmp_path: Path) -> None:
    run = copy_run(f"zero3_{dtype}", tmp_path)
    tag = run / "global_step1"
    rank0, rank1 = (tag / MODULE.format(r) for r in (0, 1))
    swap(rank0, rank1)
    before = digests(run)
    line = (
        f"ckptfix: error: {rank1}: its shared_params name tied parameters, which DeepSpeed saves in rank 0's module "
        f"file alone, but its name says rank 1 ({rank0.name} names none); {RENAMED}"
    )
    assert refusal("convert", run, tmp_path / "out.safetensors") == line
    assert refusal("inspect", run) == line
    with pytest.raises(FormatError, match="its name says rank 1"):
        ckptfix.load(run)
    assert digests(run) == before
    swap(rank0, rank1)  # given their own names back, the files read as DeepSpeed consolidates them
    got = ckptfix.load(run)
    assert set(got) == set(expected(f"zero3_{dtype}"))
    assert all(torch.equal(got[k], t) for k, t in expected(f"zero3_{dtype}").items())


def test_rank0_module_file_copied_over_rank1_refused(tmp_path: Path) -> None:
    run = copy_run("zero3_bf16", tmp_path)
    tag = run / "global_step1"
    shutil.copy(tag / MODULE.format(0), tag / MODULE.format(1))
    assert refusal("convert", run, tmp_path / "out.safetensors") == (
        f"ckptfix: error: {tag / MODULE.format(1)}: its shared_params name tied parameters, which DeepSpeed saves in "
        f"rank 0's module file alone, but its name says rank 1 ({MODULE.format(0)} names them too); {RENAMED}"
    )


def test_renamed_without_bf16_prefix_reads_as_before(tmp_path: Path) -> None:
    """The archive's name is compared for what it says of the file (module or optimizer file, which rank), not
    letter for letter: a bf16 run's optimizer files without their ``bf16_`` prefix are still each rank's own."""
    run = copy_run("zero3_bf16", tmp_path)
    tag = run / "global_step1"
    for r in (0, 1):
        (tag / optim_name("bf16", r)).rename(tag / optim_name("fp32", r))
    got, want = ckptfix.load(run), expected("zero3_bf16")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], t) for k, t in want.items())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: the last rank's padding is ``torch.empty`` memory DeepSpeed never wrote (maybe a NaN)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_optimizer_files_refused_by_their_archive(dtype: str, tmp_path: Path) -> None:
    run = copy_run(f"zero3_{dtype}", tmp_path)
    tag = run / "global_step1"
    rank0, rank1 = (tag / optim_name(dtype, r) for r in (0, 1))
    swap(rank0, rank1)
    before = digests(run)
    line = (
        f"ckptfix: error: {rank0}: torch.save wrote it as {rank1.name} (its archive keeps the name), but it is named "
        f"{rank0.name} ({rank1.name} was saved as {rank0.name}); {RENAMED}"
    )
    assert refusal("convert", run, tmp_path / "out.safetensors") == line
    assert refusal("inspect", run) == line
    assert digests(run) == before


def resave(path: Path, *, through: str, deepspeed: bool = False) -> None:
    """A real rank file saved again as it was: through a file object (as DeepSpeed's fast checkpoint writer saves,
    torch then names the archive's folder ``archive``), or under a temporary name and renamed into place.
    ``deepspeed``: unpickled with DeepSpeed's own classes (installed), else with stand-ins saved back as them."""
    if deepspeed:
        tree = torch.load(path, weights_only=False)
        dump: Any = pickle
    else:
        tree = torch.load(path, weights_only=False, pickle_module=types.SimpleNamespace(
            Unpickler=EditUnpickler, load=pickle.load, __name__="pickle"))  # fmt: skip
        dump = types.SimpleNamespace(Pickler=StubPickler, __name__="pickle")
    if through == "file object":
        with open(path, "wb") as f:
            torch.save(tree, f, pickle_module=dump)
    else:
        tmp = path.with_name(path.name + ".tmp")
        torch.save(tree, tmp, pickle_module=dump)
        tmp.replace(path)


def test_saved_under_a_temporary_name_reads_as_before(tmp_path: Path) -> None:
    run = copy_run("zero3_bf16", tmp_path)
    for f in (run / "global_step1").iterdir():
        resave(f, through="temporary name")
    got, want = ckptfix.load(run), expected("zero3_bf16")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], t) for k, t in want.items())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: the last rank's padding is ``torch.empty`` memory DeepSpeed never wrote (maybe a NaN)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def swapped_through_file_objects(dtype: str, tmp_path: Path, *, deepspeed: bool = False) -> Path:
    """A real run whose files were saved through file objects (no name kept), its optimizer files then swapped."""
    run = copy_run(f"zero3_{dtype}", tmp_path)
    tag = run / "global_step1"
    for f in tag.iterdir():
        resave(f, through="file object", deepspeed=deepspeed)
    swap(tag / optim_name(dtype, 0), tag / optim_name(dtype, 1))
    return run


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_optimizer_files_saved_without_their_name_cannot_be_told(dtype: str, tmp_path: Path) -> None:
    """Nothing else in a ZeRO-3 optimizer file says its rank: the swapped run converts (exit 0), each trainable
    parameter joined from the ranks' slices in the order of the files' names, the last rank's padding inside it."""
    run = swapped_through_file_objects(dtype, tmp_path)
    out = tmp_path / "out.safetensors"
    result = run_cli("convert", str(run), str(out))
    assert result.exit_code == 0, result.output
    got, want = ckptfix.load(out), expected(f"zero3_{dtype}")
    assert set(got) == set(want)
    trainable = {"embed.weight", "body.weight", "body.bias", "norm.weight", "norm.bias", "head.weight"}
    for key, t in want.items():
        if key not in trainable:  # buffers and frozen parameters come from the module files, in their place
            assert torch.equal(got[key], t), key
            continue
        n = t.numel()
        s = math.ceil(n / 2)  # each rank's slice of the parameter; rank 1's ends in the padding when n is odd
        flat, true = got[key].flatten(), t.flatten()
        assert torch.equal(flat[: n - s], true[s:]), key  # rank 1's slice first
        assert torch.equal(flat[s:], true[: n - s]), key  # then rank 0's, cut to size
    assert not torch.equal(got["embed.weight"], want["embed.weight"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_optimizer_files_saved_without_their_name_read_as_deepspeed_reads_them(
    dtype: str, tmp_path: Path
) -> None:
    pytest.importorskip("deepspeed", reason=needs("deepspeed", DEEPSPEED))
    from tests.deepspeed_runs import reference

    run = swapped_through_file_objects(dtype, tmp_path, deepspeed=True)
    theirs, ours = reference(run), ckptfix.load(run)  # DeepSpeed's own consolidation of the swapped folder
    assert set(theirs) == set(ours)
    for key, t in theirs.items():
        assert isinstance(t, torch.Tensor)
        assert ours[key].dtype == t.dtype and torch.equal(_bits(ours[key]), _bits(t)), key


def test_swapped_module_files_saved_without_their_name_refused_by_their_tied_names(tmp_path: Path) -> None:
    run = copy_run("zero3_fp16", tmp_path)
    tag = run / "global_step1"
    rank0, rank1 = (tag / MODULE.format(r) for r in (0, 1))
    for f in (rank0, rank1):
        resave(f, through="file object")
    swap(rank0, rank1)
    assert refusal("convert", run, tmp_path / "out.safetensors") == (
        f"ckptfix: error: {rank1}: its shared_params name tied parameters, which DeepSpeed saves in rank 0's module "
        f"file alone, but its name says rank 1 ({rank0.name} names none); {RENAMED}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32"])
def test_fresh_run_without_tied_parameters_refused_by_their_archive(dtype: str, tmp_path: Path) -> None:
    """A model without tied or frozen parameters, of sizes 2 ranks do not divide: its module files name no tied
    parameters, so only their archive says their rank; a swap of either kind of file is refused by it."""
    pytest.importorskip("deepspeed", reason=needs("deepspeed", DEEPSPEED))
    from tests.deepspeed_runs import make_run, reference

    run = make_run(tmp_path / "run", stage=3, dtype=dtype, width=3, layers=2)
    tag = run / "global_step1"
    for name in (MODULE, optim_name(dtype, 9).replace("9", "{}")):
        rank0, rank1 = (tag / name.format(r) for r in (0, 1))
        swap(rank0, rank1)
        assert refusal("convert", run, tmp_path / "out.safetensors") == (
            f"ckptfix: error: {rank0}: torch.save wrote it as {rank1.name} (its archive keeps the name), but it is "
            f"named {rank0.name} ({rank1.name} was saved as {rank0.name}); {RENAMED}"
        )
        swap(rank0, rank1)
    want = reference(run)
    got = ckptfix.load(run)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], t) for k, t in want.items())
