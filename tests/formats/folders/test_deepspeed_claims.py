"""DeepSpeed rank files checked against what they say of themselves (issue 32): a file's rank comes from its name,
but the file records its partition (``param_slice_mappings``, ``group_paddings``, partition lengths) and its run
(``ds_config``: ZeRO stage and precision); a file renamed, swapped or copied in from another run is refused, by
name, before anything is written."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.formats.folders.test_deepspeed import FIXTURES, copy_run, edit_rank_file, refusal


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
