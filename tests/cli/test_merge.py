"""``ckptfix merge`` through the real click group, on per-rank DDP checkpoints (the conftest rank_files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from tests.assertions import assert_same
from tests.inputs import _hf, _refused
from tests.models import ScaledHead, SmallNet

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"  # the trainer's (python -m ckptfix.trainer.fixtures)
TRAINER = "ckptfix.trainer.model:build_model"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_merge_writes_the_merged_checkpoint(rank_files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged.pt"
    result = run("merge", *rank_files, "-o", out)
    assert result.exit_code == 0, result.output
    assert "BatchNorm statistics (pooled): 2 module(s): features.{1,4}" in result.stdout
    assert f"taken from {rank_files[0]}: epoch, optimizer, rank" in result.stdout
    merged = ckptfix.load(out)
    expected = ckptfix.merge([ckptfix.load(f) for f in rank_files])
    assert list(merged["model"]) == list(expected["model"])
    for key, value in expected["model"].items():
        assert torch.equal(merged["model"][key], value), key
    model = SmallNet()
    assert ckptfix.load_into(model, out).loads_as_is
    model.eval()
    assert torch.equal(model.features[1].running_var, expected["model"]["features.1.running_var"])


def test_merge_to_safetensors_and_ddp_layout_with_json(rank_files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged.safetensors"
    result = run("merge", *rank_files, "-o", out, "--to", "ddp", "--buffers", "mean", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["written"] is True and report["bn_modules"] == ["features.1", "features.4"]
    assert report["layouts_from"] == ["ddp", "ddp"] and report["diverged"] == []
    assert all(k.startswith("module.") for k in ckptfix.load(out)["model"])


def test_merge_refuses_a_tampered_rank_and_writes_nothing(rank_files: list[Path], tmp_path: Path) -> None:
    ckpt = ckptfix.load(rank_files[1])
    ckpt["model"] = dict(ckpt["model"])
    ckpt["model"]["module.features.3.weight"] = ckpt["model"]["module.features.3.weight"] * 1.5
    tampered = tmp_path / "rank1_tampered.pt"
    ckptfix.save(ckpt, tampered)
    out = tmp_path / "merged.pt"
    result = run("merge", rank_files[0], tampered, "-o", out)
    assert result.exit_code == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [tampered]
    assert "1 key(s) differ across ranks (atol 0):" in result.stdout
    assert "  features.3.weight  max |Δ| " in result.stdout and f"on {tampered} (vs {rank_files[0]})" in result.stdout
    assert result.stderr.startswith(f"ckptfix: error: {out}: not written: 1 key(s) differ")
    assert run("merge", rank_files[0], tampered, "-o", out, "--atol", "10").exit_code == 0


def test_a_corrupt_record_copied_at_the_end_fails_the_merge_and_writes_nothing(tmp_path: Path) -> None:
    # the optimizer's tensors are not merged: the first rank's records are copied as the last step of the write
    import zipfile

    state = {"model": {"w": torch.ones(64)}, "optimizer": {"state": {0: {"exp_avg": torch.full((1000,), 3.0)}}}}
    ranks = [tmp_path / "rank0.pt", tmp_path / "rank1.pt"]
    for path in ranks:
        torch.save(state, path)
    name = next(i for i in zipfile.ZipFile(ranks[0]).infolist() if i.file_size == 4000)  # the optimizer tensor
    data = bytearray(ranks[0].read_bytes())
    at = name.header_offset
    data[at + 30 + int.from_bytes(data[at + 26 : at + 28], "little") + int.from_bytes(data[at + 28 : at + 30], "little")
         + 100] ^= 0xFF  # fmt: skip
    ranks[0].write_bytes(bytes(data))
    out = tmp_path / "merged.pt"
    result = run("merge", *ranks, "-o", out)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"ckptfix: error: {ranks[0]}: record '{name.filename}' fails its CRC check (stored {name.CRC:08x}, actual "
        f"{result.output.split('actual ')[1][:8]}); the file is corrupt: re-download or re-save it"
    ]
    assert sorted(tmp_path.iterdir()) == ranks


def test_merge_warns_for_a_duplicated_rank_and_refuses_out_as_input(rank_files: list[Path], tmp_path: Path) -> None:
    result = run("merge", rank_files[0], rank_files[0], "-o", tmp_path / "m.pt")
    assert result.exit_code == 0
    assert "is given twice" in result.stderr and "is identical to" in result.stderr
    result = run("merge", rank_files[0], "-o", tmp_path / "lone.pt")
    assert result.exit_code == 0 and "only one input" in result.stderr
    result = run("merge", rank_files[0], rank_files[1], "-o", rank_files[1])
    assert result.exit_code == 2 and "is the input file" in result.stderr


def test_merge_with_model_averages_other_float_buffers(tmp_path: Path) -> None:
    files = []
    for rank in range(2):
        state = torch.nn.DataParallel(ScaledHead()).state_dict()
        state["module.module.scale"] = torch.full((2,), 1.0 + 2 * rank)
        files.append(tmp_path / f"rank{rank}.pt")
        ckptfix.save({"model": state}, files[-1])
    out = tmp_path / "merged.pt"
    refused = run("merge", *files, "-o", out)
    assert refused.exit_code == 1 and "  module.scale  max |Δ| 2" in refused.stdout and not out.exists()
    result = run("merge", *files, "-o", out, "--model", "tests.models:ScaledHead")
    assert result.exit_code == 0, result.output
    assert "other buffers (pooled): module.scale" in result.stdout
    merged = ckptfix.load(out)["model"]
    assert torch.equal(merged["module.scale"], torch.full((2,), 2.0))
    assert ckptfix.check(merged, ScaledHead()).ok


@pytest.mark.skipif(not (FIXTURES / "ddp_rank1.pt").exists(), reason="trainer fixtures not generated")
def test_merge_the_trainer_per_rank_fixtures(tmp_path: Path) -> None:
    files = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    out = tmp_path / "merged.safetensors"
    assert run("merge", *files, "-o", out).exit_code == 0
    ranks = [{k.removeprefix("module."): v for k, v in ckptfix.load(f)["model"].items()} for f in files]
    merged = ckptfix.load(out)  # model only: safetensors keeps the simple entries as metadata
    merged = merged.get("model", merged)
    bn = sorted({k.rsplit(".", 1)[0] for k in ranks[0] if k.endswith("running_mean")})
    assert bn and not torch.equal(ranks[0][f"{bn[0]}.running_mean"], ranks[1][f"{bn[0]}.running_mean"])
    for key, value in ranks[0].items():
        module, _, leaf = key.rpartition(".")
        if module in bn and leaf in ("running_mean", "running_var"):
            m0, m1 = (r[f"{module}.running_mean"].double() for r in ranks)
            v0, v1 = (r[f"{module}.running_var"].double() for r in ranks)
            mean = (m0 + m1) / 2
            want = mean if leaf == "running_mean" else (v0 + v1) / 2 + ((m0 - mean) ** 2 + (m1 - mean) ** 2) / 2
            torch.testing.assert_close(merged[key], want.to(value.dtype), rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(merged[key], value), key
    result = run("validate", out, "--model", TRAINER)
    assert result.exit_code == 0, result.output


def test_merge_prints_hostile_key_names_escaped_and_errors_stay_one_line(tmp_path: Path) -> None:
    key = "evil\x1b[2J\nparameters: equal on every rank"
    files = [tmp_path / "rank0.pt", tmp_path / "rank1.pt"]
    for rank, path in enumerate(files):
        torch.save({"w": torch.zeros(2), key: torch.full((2,), float(rank))}, path)
    out = tmp_path / "merged.pt"
    result = run("merge", *files, "-o", out)
    assert result.exit_code == 1 and not out.exists()
    assert "\x1b" not in result.output
    assert result.stdout.splitlines() == [
        "1 key(s) differ across ranks (atol 0):",
        rf"  evil\x1b[2J\nparameters: equal on every rank  max |Δ| 1  on {files[1]} (vs {files[0]})",
    ]
    assert result.stderr == (
        rf"ckptfix: error: {out}: not written: 1 key(s) differ across ranks (e.g. 'evil\x1b[2J\nparameters: equal "
        "on every rank'); use files of the same step, or --atol if the drift is expected\n"
    )


def _rank_ckpt(rank: int, *, legacy: bool = False, path: Path) -> Path:
    """A per-rank checkpoint with what real ones hold besides plain tensors: tied weights, a view, optimizer state."""
    net = SmallNet()
    state = net.state_dict()
    state["features.1.running_mean"] = state["features.1.running_mean"] + rank  # ranks' own statistics
    state["features.1.running_var"] = state["features.1.running_var"] * (1 + rank)
    state["head.tied"] = state["head.weight"]  # one tensor under two names
    state["head.weight_t"] = state["head.weight"].t()  # a non-contiguous view of the same storage
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    ckpt = {"model": torch.nn.DataParallel(net).state_dict() | {}, "optimizer": optimizer.state_dict(), "rank": 0}
    ckpt["model"] = type(state)((f"module.{k}", v) for k, v in state.items())
    ckpt["model"]._metadata = state._metadata  # type: ignore[attr-defined]
    torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy)
    return path


@pytest.mark.parametrize("out_name", ["merged.pt", "merged.safetensors"])
@pytest.mark.parametrize("kinds", [("pt", "pt"), ("legacy", "pt"), ("pt", "legacy"), ("st", "pt")])
def test_the_streamed_merge_writes_what_merging_in_memory_writes(
    tmp_path: Path, kinds: tuple[str, str], out_name: str
) -> None:
    files = []
    for rank, kind in enumerate(kinds):
        path = _rank_ckpt(rank, legacy=kind == "legacy", path=tmp_path / f"rank{rank}.pt")
        if kind == "st":
            model = ckptfix.load(path)["model"]
            path = tmp_path / f"rank{rank}.safetensors"
            ckptfix.save(model, path)
        files.append(path)
    out = tmp_path / out_name
    result = run("merge", *files, "-o", out)
    if out_name.endswith(".safetensors") and kinds[0] != "st":
        assert result.exit_code == 2 and "entry 'optimizer'" in result.stderr  # as ckptfix.save refuses it
        assert not out.exists() and not list(tmp_path.glob(".*ckptfix-tmp"))
        return
    assert result.exit_code == 0, result.output
    reference = tmp_path / f"reference{out.suffix}"
    ckptfix.save(ckptfix.merge([ckptfix.load(f) for f in files]), reference)
    assert_same(ckptfix.load(out), ckptfix.load(reference))
    if out.suffix == ".pt":
        assert_same(torch.load(out, weights_only=True, mmap=True), torch.load(reference, weights_only=True))


def test_ddp_files_that_record_their_rank_are_taken_as_those_ranks(tmp_path: Path) -> None:
    """The trainer's per-rank files hold ``rank`` and ``world_size``: given rank 1's first, ``--buffers rank0``
    still keeps rank 0's statistics and the other entries are rank 0's; files that record no rank keep the order
    given (the first is rank 0)."""
    files = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    result = run("merge", *files, "-o", tmp_path / "in_order.pt", "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    assert "not in the order given" not in result.output
    result = run("merge", *files[::-1], "-o", tmp_path / "reversed.pt", "--buffers", "rank0")
    assert result.exit_code == 0, result.output
    assert f"took the rank files as the ranks they record (rank 0: {files[0]}), not in the order given" in result.stdout
    assert f"taken from {files[0]}: epoch, step, world_size, mode, rank" in result.stdout
    in_order, reversed_ = ckptfix.load(tmp_path / "in_order.pt"), ckptfix.load(tmp_path / "reversed.pt")
    assert reversed_["rank"] == 0 and list(reversed_) == list(in_order)
    assert_same(reversed_["model"], in_order["model"])
    rank0 = ckptfix.load(files[0])["model"]
    assert torch.equal(reversed_["model"]["features.1.running_var"], rank0["module.features.1.running_var"])
    unranked = []
    for path in files[::-1]:  # the same files without the entries that say their rank
        obj = ckptfix.load(path)
        del obj["rank"]
        unranked.append(tmp_path / path.name)
        ckptfix.save(obj, unranked[-1])
    result = run("merge", *unranked, "-o", tmp_path / "listed.pt", "--buffers", "rank0", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["notes"] == []
    listed = ckptfix.load(tmp_path / "listed.pt")["model"]
    rank1 = ckptfix.load(files[1])["model"]
    assert torch.equal(listed["features.1.running_var"], rank1["module.features.1.running_var"])  # the first given


# Inputs are never outputs: an output that is, or sits inside, anything the command reads is refused with exit 2
# naming both, before anything is written (hard and symbolic links included).


def test_merge_into_a_shard_of_an_input_folder_is_refused(tmp_path: Path) -> None:
    a, b = _hf(tmp_path / "a", "model.safetensors"), _hf(tmp_path / "b", "model.safetensors")
    shard = str(sorted(b.glob("*.safetensors"))[0])
    message = _refused(["merge", str(a), str(b), "-o", shard], reads=b, out=shard)
    assert str(b) in message
