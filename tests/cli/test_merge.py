"""``ckptfix merge`` through the real click group, on per-rank DDP checkpoints (the conftest rank_files)."""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import AverageError
from ckptfix.formats.opened import Opened
from ckptfix.merging.files import merge_files
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


# ----------------------------------------------------------------------------------------------------------------------
# ``ckptfix merge --average`` / ``--weights``: the (weighted) mean of checkpoints of one model, streamed.
#
# Expected values are computed here with torch in the order the merge documents (float64, inputs in file order,
# divided by the weights' sum, cast back), so tensors compare with torch.equal.


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    state = {f"w_{str(d).removeprefix('torch.')}": torch.randn(4, 5, generator=gen).to(d) for d in DTYPES}
    state["bn.running_var"] = torch.rand(5, generator=gen) + 0.5
    state["bn.num_batches_tracked"] = torch.tensor(100 * step)
    state["mask"] = torch.rand(5, generator=gen) > 0.5
    return state


def _ckpt(step: int) -> dict[str, object]:
    return {"model": _state(step), "step": step, "note": f"step {step}"}


def _expected(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """The documented arithmetic: sum(w_i * x_i) in float64, in file order, / sum(w); others from the last."""
    out = {}
    for key, last in states[-1].items():
        if last.is_floating_point():
            acc = torch.zeros(last.shape, dtype=torch.float64)
            for state, w in zip(states, weights, strict=True):
                acc += state[key].to(torch.float64) * w
            out[key] = (acc / math.fsum(weights)).to(last.dtype)
        else:
            out[key] = last
    return out


def _files(tmp_path: Path, steps: Sequence[int]) -> list[Path]:
    files = []
    for step in steps:
        files.append(tmp_path / f"step{step}.pt")
        torch.save(_ckpt(step), files[-1])
    return files


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key  # dtype kept
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("out_name", ["avg.pt", "avg.safetensors"])
def test_average_is_the_mean_in_each_dtype_with_the_rest_from_the_last_file(tmp_path: Path, out_name: str) -> None:
    files = _files(tmp_path, [1, 2, 3])
    out = tmp_path / out_name
    before = [f.read_bytes() for f in files]
    result = run("merge", *files, "-o", out, "--average")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:2] == [
        "averaged 3 checkpoint(s) (weights 0.3333, 0.3333, 0.3333; layouts: single)",
        f"floating tensors averaged: 5; other tensors and entries from {files[-1]}",
    ]
    merged = ckptfix.load(out)
    want = _expected([_state(s) for s in (1, 2, 3)], [1.0, 1.0, 1.0])
    _assert_equal(dict(merged["model"]), want)
    assert torch.equal(merged["model"]["bn.num_batches_tracked"], torch.tensor(300))  # the last file's
    if out_name.endswith(".pt"):
        assert (merged["step"], merged["note"]) == (3, "step 3")
    assert [f.read_bytes() for f in files] == before  # inputs untouched
    # a plain mean of two is exactly (a + b) / 2, as timm's avg_checkpoints computes it (float64, then cast)
    two = ckptfix.merge([_ckpt(1), _ckpt(2)], average=True)["model"]
    a, b = _state(1)["w_float32"], _state(2)["w_float32"]
    assert torch.equal(two["w_float32"], ((a.double() + b.double()) / 2).float())


def test_weights_give_the_weighted_mean_in_the_cli_and_the_library(tmp_path: Path) -> None:
    files = _files(tmp_path, [4, 5])
    out = tmp_path / "soup.safetensors"
    result = run("merge", *files, "-o", out, "--weights", "0.3,0.7", "--model-only")
    assert result.exit_code == 0, result.output
    assert "(weights 0.3, 0.7; layouts: single)" in result.stdout
    want = _expected([_state(4), _state(5)], [0.3, 0.7])
    _assert_equal(dict(ckptfix.load(out)), want)
    report = merge_files(files, tmp_path / "soup.pt", weights=[0.3, 0.7])
    assert report.weights == [0.3, 0.7]
    assert sorted(report.averaged) == sorted(k for k, v in want.items() if v.is_floating_point())
    _assert_equal(dict(ckptfix.load(tmp_path / "soup.pt")["model"]), want)
    _assert_equal(dict(ckptfix.merge([_ckpt(4), _ckpt(5)], weights=[0.3, 0.7])["model"]), want)
    # weights are divided by their sum (a negative one is refused: see below)
    scaled = ckptfix.merge([_ckpt(4), _ckpt(5)], weights=[3, 7])["model"]
    torch.testing.assert_close(scaled["w_float64"], want["w_float64"], rtol=1e-15, atol=0)


def test_average_reads_folders_safetensors_and_other_layouts(tmp_path: Path) -> None:
    states = [_state(s) for s in (6, 7, 8)]
    folder = tmp_path / "hf"
    ckptfix.save(states[0], folder / "model.safetensors", shard_size=200)  # a sharded transformers folder
    assert len(list(folder.glob("*.safetensors"))) > 1
    ckptfix.save(states[1], tmp_path / "b.safetensors")
    torch.save({"state_dict": {f"module.{k}": v for k, v in states[2].items()}}, tmp_path / "c.pt")  # DDP layout
    out = tmp_path / "avg.pt"
    result = run("merge", folder, tmp_path / "b.safetensors", tmp_path / "c.pt", "-o", out, "--average")
    assert result.exit_code == 0, result.output
    _assert_equal(dict(ckptfix.load(out)["state_dict"]), _expected(states, [1.0, 1.0, 1.0]))


def test_average_reads_one_tensor_of_one_file_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        files.append(tmp_path / f"s{step}.pt")
        torch.save({f"layer{i}.weight": torch.randn(64, 64, generator=gen) for i in range(8)}, files[-1])
    alive: set[int] = set()
    peak, reads = [0], [0]
    read = Opened.raw  # a tensor's bytes (torch only where it must read it)

    def counted(self: Opened, value: object) -> object:
        tensor = read(self, value)
        reads[0] += 1
        alive.add(reads[0])
        weakref.finalize(tensor, alive.discard, reads[0])
        peak[0] = max(peak[0], len(alive))
        return tensor

    monkeypatch.setattr(Opened, "raw", counted)
    merge_files(files, tmp_path / "avg.safetensors", average=True)
    assert reads[0] == 3 * 8  # each tensor of each file read once
    assert peak[0] == 1  # never two read tensors alive at once: memory holds one tensor and the float64 sum


def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path: Path) -> None:
    files = _files(tmp_path, [1, 2])
    out = tmp_path / "avg.pt"
    other = _ckpt(3)
    other["model"]["extra.bias"] = torch.zeros(5)  # type: ignore[index]
    torch.save(other, tmp_path / "more_keys.pt")
    wide = _ckpt(3)
    wide["model"]["w_float32"] = torch.zeros(4, 6)  # type: ignore[index]
    torch.save(wide, tmp_path / "wide.pt")
    before = sorted(tmp_path.iterdir())
    cases = [
        ((files[0], tmp_path / "more_keys.pt", "--average"),
         f"{files[0]}['model']: keys differ from {tmp_path / 'more_keys.pt'}['model'] (1 only there, 0 only here; "
         f"'extra.bias' only in {tmp_path / 'more_keys.pt'}['model']); checkpoints of one model hold the same keys"),
        ((files[0], tmp_path / "wide.pt", "--average"),
         f"{files[0]}['model']: 'w_float32' is [4, 5] torch.float32 but [4, 6] torch.float32 in "
         f"{tmp_path / 'wide.pt'}['model']; checkpoints of one model hold the same shapes and dtypes"),
        ((*files, "--weights", "1"), "weights: 1 weight(s) for 2 input(s); give one weight per input, in order"),
        ((*files, "--weights", "1,nan"), "weights: nan is not a finite number; give one finite weight per input"),
        ((*files, "--weights", "1,-1"), "weights: -1 is negative; give weights of zero or more, at least one of them "),
        ((*files, "--average", "--buffers", "mean"), "buffers applies to merging ranks, not to averaging"),
    ]  # fmt: skip
    for args, message in cases:
        result = run("merge", *args, "-o", out)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ckptfix: error: {message}"), lines
        assert "Traceback" not in result.output
    result = run("merge", *files, "-o", out, "--weights", "a,b")
    assert result.exit_code == 2 and "'a,b' is not a list of numbers" in result.output
    assert sorted(tmp_path.iterdir()) == before  # nothing written, no temp file left
    with pytest.raises(AverageError, match="1 weight"):
        ckptfix.merge([_ckpt(1), _ckpt(2)], weights=[1.0])


def test_fp8_tensors_are_refused_rather_than_averaged_without_their_scales(tmp_path: Path) -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    states = [{"w": torch.ones(4).to(torch.float8_e4m3fn), "w_scale": torch.tensor(float(s))} for s in (1, 2)]
    with pytest.raises(AverageError, match=r"'w' is torch.float8_e4m3fn, whose values need their scales"):
        ckptfix.merge(states, average=True)


@pytest.mark.skipif(not (FIXTURES / "ddp_rank1.pt").exists(), reason="trainer fixtures not generated")
def test_average_of_the_trainer_checkpoints_loads_into_the_model(tmp_path: Path) -> None:
    from ckptfix.trainer.model import build_model

    files = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    out = tmp_path / "avg.pt"
    result = run("merge", *files, "-o", out, "--average")
    assert result.exit_code == 0, result.output
    ckpts = [torch.load(f, weights_only=True) for f in files]
    states = [{k.removeprefix("module."): v for k, v in c["model"].items()} for c in ckpts]
    want = _expected(states, [1.0, 1.0])
    merged = ckptfix.load(out)
    _assert_equal(dict(merged["model"]), want)
    assert merged["rank"] == ckpts[1]["rank"] == 1  # the other entries: the last file's
    bn = next(k for k in want if k.endswith("running_mean"))
    assert not torch.equal(states[0][bn], states[1][bn])  # the ranks' statistics differ: this is a real mean
    model, reference = build_model(), build_model()
    assert ckptfix.load_into(model, out).loads_as_is
    reference.load_state_dict(want)
    probe = torch.randn(3, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    model.eval(), reference.eval()
    with torch.no_grad():
        assert torch.equal(model(probe), reference(probe))
        assert not torch.equal(model(probe), _loaded(states[0])(probe))  # not simply rank 0's model


def _loaded(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from ckptfix.trainer.model import build_model

    model = build_model()
    model.load_state_dict(state)
    return model.eval()


def test_weights_are_normalised_before_they_multiply(tmp_path: Path) -> None:
    """Weights at the ends of float64 (subnormal, near the maximum) give the mean, not 0.0, inf or an error."""
    files = [tmp_path / "a.pt", tmp_path / "b.pt"]
    torch.save({"w": torch.tensor([1e-5], dtype=torch.float64)}, files[0])
    torch.save({"w": torch.tensor([3e-5], dtype=torch.float64)}, files[1])
    plain = tmp_path / "plain.pt"
    assert run("merge", *files, "-o", plain, "--average").exit_code == 0
    want = ckptfix.load(plain)["w"]
    torch.testing.assert_close(want, torch.tensor([2e-5], dtype=torch.float64), rtol=1e-15, atol=0)
    for weights, expected in [
        ("5e-324,5e-324", want),
        ("1e308,1e308", want),
        ("1e308,1", torch.tensor([1e-5], dtype=torch.float64)),
    ]:
        out = tmp_path / f"w{weights}.pt"
        result = run("merge", *files, "-o", out, "--weights", weights)
        assert result.exit_code == 0, (weights, result.output)
        got = ckptfix.load(out)["w"]
        assert torch.isfinite(got).all(), weights
        torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-15, atol=0)
        if expected is want:
            assert torch.equal(got, want), weights  # equal weights, however small or large: the plain mean
    assert merge_files(files, tmp_path / "r.pt", weights=[5e-324, 5e-324]).weights == [0.5, 0.5]
    merged = ckptfix.merge([{"w": torch.tensor([1e-5])}, {"w": torch.tensor([3e-5])}], weights=[1e308, 1e308])
    assert torch.equal(merged["w"], ((torch.tensor([1e-5]).double() + torch.tensor([3e-5]).double()) / 2).float())


def test_weights_that_cannot_be_normalised_are_refused_naming_the_option(tmp_path: Path) -> None:
    files = _files(tmp_path, [1, 2])
    out = tmp_path / "avg.pt"
    before = sorted(tmp_path.iterdir())
    some = "give weights of zero or more, at least one of them above zero (each is divided by their sum)"
    cases = [
        ("1,inf", "weights: inf is not a finite number; give one finite weight per input"),
        ("-inf,1", "weights: -inf is not a finite number; give one finite weight per input"),
        ("1,-1", f"weights: -1 is negative; {some}"),
        ("-0.5,1.5", f"weights: -0.5 is negative; {some}"),
        ("0,0", f"weights: all are zero; {some}"),
    ]
    for weights, message in cases:
        result = run("merge", *files, "-o", out, "--weights", weights)
        assert result.exit_code == 2, (weights, result.output)
        assert result.stderr.splitlines() == [f"ckptfix: error: {message}"], weights
    assert sorted(tmp_path.iterdir()) == before
    with pytest.raises(AverageError, match="weights: all are zero"):
        ckptfix.merge([_ckpt(1), _ckpt(2)], weights=[0.0, -0.0])
