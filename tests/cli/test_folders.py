"""``inspect``, ``diff`` and ``merge`` on folders: transformers shards (or their index), accelerate ``save_state``
folders and DCP folders, read file by file as single files are; and diff/merge beside entries that were not loaded.

The FSDP2 rank files ``merge`` reassembles are in formats/fsdp/test_ranks.py; two-rank DCP folders in
formats/dcp/test_reader.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.merging.files import plan_merge
from ckptfix.torchcompat import dcp_save_local
from tests.extras import needs
from tests.models import SmallNet


def run(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    state = SmallNet(seed=seed).state_dict()
    torch.manual_seed(seed)
    for key in state:  # each "rank" its own BatchNorm statistics, as with DDP's buffer sync off
        if "running" in key:
            state[key] = state[key] + torch.rand_like(state[key])
    return state


def _hf(folder: Path, state: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True)
    ckptfix.save(state, folder / name, shard_size=200)
    return folder


def _accelerate(folder: Path) -> dict[str, torch.Tensor]:
    """An accelerate save_state folder (model, optimizer, scheduler, numpy RNG state); the model's state dict."""
    accelerate = pytest.importorskip("accelerate", reason=needs("accelerate"))
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    acc = accelerate.Accelerator(cpu=True)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    acc.save_state(str(folder))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- inspect ---------------------------------------------------------------------------------------------------


def test_inspect_a_sharded_folder_and_its_index_file(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "hf", _state())
    for path in (folder, folder / "model.safetensors.index.json"):
        text = run("inspect", path)
        assert text.exit_code == 0, text.output
        assert text.output.startswith(f"{path}: folder (4 shards and index model.safetensors.index.json) state dict")
        assert "state dict: layout single, 16 tensors, 291 parameters" in text.output
        summary = json.loads(run("inspect", path, "--json").output)
        assert summary["format"] == "folder" and summary["kind"] == "state dict"
        assert summary["folder"] == {
            "kind": "shards",
            "files": [*(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)), "model.safetensors.index.json"],
            "index": "model.safetensors.index.json",
        }
        assert summary["file_bytes"] == sum(p.stat().st_size for p in folder.iterdir())


def test_inspect_reads_no_tensor_byte_of_a_folder_but_verify_reads_them_all(tmp_path: Path) -> None:
    from ckptfix.formats.torchzip.archive import read_archive

    folder = _hf(tmp_path / "hf", _state(), "pytorch_model.bin")
    shard = folder / "pytorch_model-00001-of-00004.bin"
    with open(shard, "rb") as f:
        record = next(r for r in read_archive(f.fileno(), str(shard)).records if "/data/" in r.name)
    data = bytearray(shard.read_bytes())
    data[record.data_offset] ^= 0xFF  # one tensor byte: only a reader of tensor bytes can notice
    shard.write_bytes(bytes(data))
    text = run("inspect", folder)
    assert text.exit_code == 0, text.output
    assert "folder (4 shards and index pytorch_model.bin.index.json) state dict" in text.output
    verified = run("inspect", folder, "--verify")
    assert verified.exit_code == 2 and "CRC" in verified.output and str(shard) in verified.output
    assert verified.output.count("\n") == 1


def test_inspect_an_accelerate_folder_lists_its_training_state_as_other_entries(tmp_path: Path) -> None:
    _accelerate(tmp_path / "state")
    text = run("inspect", tmp_path / "state")
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'state'}: accelerate save_state folder (4 files) checkpoint")
    assert "model entry 'model': layout single, 16 tensors, 291 parameters" in text.output
    assert "entry 'optimizer': optimizer state: 1 param group(s), state for 10 param(s)" in lines
    assert (
        "entry 'scheduler': dict with 8 entries (step_size, gamma, base_lrs, last_epoch, _step_count, " in text.output
    )
    # numpy's RNG state needs classes outside the allowlist: described, not built
    assert any(line.startswith("entry 'random_states_0': numpy.ndarray") and "not loaded" in line for line in lines)
    summary = json.loads(run("inspect", tmp_path / "state", "--json").output)
    assert list(summary["models"]) == ["model"]
    assert sorted(summary["other_entries"]) == ["optimizer", "random_states_0", "scheduler"]
    assert summary["folder"]["kind"] == "accelerate"


def test_inspect_a_dcp_folder_says_how_each_tensor_is_chunked(tmp_path: Path) -> None:
    dcp_save_local({"model": SmallNet().state_dict(), "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    text = run("inspect", tmp_path / "dcp")
    assert text.exit_code == 0, text.output
    assert text.output.startswith(f"{tmp_path / 'dcp'}: torch.distributed.checkpoint folder (1 data file) checkpoint")
    assert "  head.{weight,bias}" in text.output and "(1 row chunk in __0_0.distcp)" in text.output
    assert "entry 'step': int 3" in text.output
    summary = json.loads(run("inspect", tmp_path / "dcp", "--json").output)
    assert summary["folder"]["files"] == [".metadata", "__0_0.distcp"]
    assert summary["models"]["model"]["chunking"]["features.0.weight"] == "1 row chunk in __0_0.distcp"
    assert {g["chunking"] for g in summary["models"]["model"]["groups"]} == {"1 row chunk in __0_0.distcp"}


def test_inspect_an_accelerate_folder_with_two_models(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate", reason=needs("accelerate"))
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(SmallNet(seed=1), SmallNet(seed=2, width=12))  # save_state writes every prepared model
    acc.save_state(str(tmp_path / "state"))
    summary = json.loads(run("inspect", tmp_path / "state", "--json").output)
    assert list(summary["models"]) == ["model", "model_1"]
    assert summary["models"]["model_1"]["parameters"] > summary["models"]["model"]["parameters"]
    result = run("diff", tmp_path / "state", tmp_path / "state", "--entry", "model_1")
    assert result.exit_code == 0 and "(entry 'model_1', layout single)" in result.output, result.output


def test_inspect_verify_checks_every_chunk_of_a_dcp_folder(tmp_path: Path) -> None:
    dcp_save_local({"model": _state()}, checkpoint_id=str(tmp_path / "dcp"))
    result = run("inspect", tmp_path / "dcp", "--verify")
    assert result.exit_code == 0 and "verified: every record read, every CRC matches" in result.output


def test_inspecting_folders_does_not_even_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    dcp_save_local({"model": _state()}, checkpoint_id=str(tmp_path / "dcp"))
    paths = [_hf(tmp_path / "hf", _state()), _hf(tmp_path / "bin", _state(), "pytorch_model.bin"), tmp_path / "dcp"]
    code = "import sys, ckptfix.summary as s\nfor p in sys.argv[1:]: s.summarize(p)\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "False\n", done.stderr


def test_a_hostile_folder_is_refused_in_one_line_by_every_command(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "hf", _state())
    index = folder / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    body["weight_map"]["head.bias"] = "../outside.safetensors"
    index.write_text(json.dumps(body))
    ckptfix.save(_state(), tmp_path / "one.safetensors")
    shutil.copytree(folder, tmp_path / "rank1")
    for args in (["inspect", folder], ["diff", folder, tmp_path / "one.safetensors"],
                 ["merge", folder, tmp_path / "rank1", "-o", tmp_path / "m.pt"]):  # fmt: skip
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "key 'head.bias' names shard '../outside.safetensors', a path outside the folder" in result.output
        assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert not (tmp_path / "m.pt").exists()


# -- diff ------------------------------------------------------------------------------------------------------


def test_diff_a_sharded_folder_against_the_file_it_was_consolidated_into(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "hf", _state())
    made = run("convert", folder, tmp_path / "one.safetensors")
    assert made.exit_code == 0, made.output
    for a, b in ((folder, tmp_path / "one.safetensors"), (tmp_path / "one.safetensors", folder),
                 (folder / "model.safetensors.index.json", folder)):  # fmt: skip
        same = run("diff", a, b)
        assert same.exit_code == 0 and same.output.splitlines()[-1] == "equal", same.output
    changed = _state()
    changed["features.3.weight"][0, 0, 0, 0] += 0.5
    ckptfix.save(changed, tmp_path / "changed.safetensors")
    other = run("diff", folder, tmp_path / "changed.safetensors", "--json")
    assert other.exit_code == 1, other.output
    (entry,) = json.loads(other.output)["entries"]
    assert [(v["key"], v["max_abs"]) for v in entry["values"]] == [("features.3.weight", pytest.approx(0.5))]
    assert entry["compared"] == 16 and not entry["only_a"] and not entry["only_b"]


def test_diff_two_folders_names_the_one_changed_tensor(tmp_path: Path) -> None:
    changed = _state()
    changed["head.bias"][1] = 7.0
    a, b = _hf(tmp_path / "a", _state()), _hf(tmp_path / "b", changed, "pytorch_model.bin")  # safetensors vs .bin
    result = run("diff", a, b)
    assert result.exit_code == 1, result.output
    assert "values differ (1 of 16 tensors, atol 0, rtol 0):" in result.output
    assert "  head.bias  max |Δ|" in result.output


def test_diff_an_accelerate_folders_model_against_its_weights(tmp_path: Path) -> None:
    expected = _accelerate(tmp_path / "state")
    ckptfix.save(expected, tmp_path / "w.safetensors")
    result = run("diff", tmp_path / "state", tmp_path / "w.safetensors", "--entry", "model")
    assert result.exit_code == 0, result.output
    assert "A: entry 'random_states_0': numpy.ndarray" in result.output  # named, never built
    whole = run("diff", tmp_path / "state", tmp_path / "state")
    assert whole.exit_code == 0 and whole.output.splitlines()[-1] == "equal", whole.output


def test_diff_a_dcp_folder_against_the_checkpoint_it_was_saved_from(tmp_path: Path) -> None:
    state = {"model": _state(), "epoch": 3}
    dcp_save_local(state, checkpoint_id=str(tmp_path / "dcp"))
    torch.save(state, tmp_path / "same.pt")
    assert run("diff", tmp_path / "dcp", tmp_path / "same.pt").exit_code == 0
    state["model"]["features.1.running_var"][2] = 5.0
    torch.save(state, tmp_path / "other.pt")
    result = run("diff", tmp_path / "dcp", tmp_path / "other.pt")
    assert result.exit_code == 1 and "  features.1.running_var  max |Δ|" in result.output, result.output


# -- merge -----------------------------------------------------------------------------------------------------


def test_merge_per_rank_sharded_folders(tmp_path: Path) -> None:
    ranks = [_state(seed=0), _state(seed=0)]
    ranks[1] = {k: (v + 1 if "running" in k else v) for k, v in ranks[1].items()}
    folders = [_hf(tmp_path / f"rank{r}", s) for r, s in enumerate(ranks)]
    result = run("merge", folders[0], folders[1] / "model.safetensors.index.json", "-o", tmp_path / "m.safetensors")
    assert result.exit_code == 0, result.output
    assert "BatchNorm statistics (pooled): 2 module(s): features.{1,4}" in result.output
    expected = plan_merge(ranks).obj
    merged = ckptfix.load(tmp_path / "m.safetensors")
    assert set(merged) == set(expected) and all(torch.equal(merged[k], v) for k, v in expected.items())


@pytest.mark.parametrize("kind", ["shards", "dcp"])
@pytest.mark.parametrize("out", ["m.pt", "m.safetensors"])
def test_folders_merge_tensor_by_tensor_without_loading_either(
    tmp_path: Path, kind: str, out: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.merging import files as merging

    def whole(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a folder was loaded whole")

    monkeypatch.setattr(merging, "_loaded", whole)  # the in-memory merge's reader: never reached
    ranks = [_state(seed=0), _state(seed=0)]
    ranks[1] = {k: (v + 1 if "running" in k else v) for k, v in ranks[1].items()}
    folders = []
    for r, state in enumerate(ranks):
        if kind == "shards":
            folders.append(_hf(tmp_path / f"rank{r}", state))
        else:
            dcp_save_local(state, checkpoint_id=str(tmp_path / f"rank{r}"))
            folders.append(tmp_path / f"rank{r}")
    result = run("merge", *folders, "-o", tmp_path / out)
    assert result.exit_code == 0, result.output
    expected = plan_merge(ranks).obj
    merged = ckptfix.load(tmp_path / out)
    assert set(merged) == set(expected) and all(torch.equal(merged[k], v) for k, v in expected.items())


def test_merge_accelerate_folders_keeps_or_leaves_out_their_training_state(tmp_path: Path) -> None:
    expected = _accelerate(tmp_path / "r0")
    shutil.copytree(tmp_path / "r0", tmp_path / "r1")
    # numpy's RNG state needs globals outside the allowlist: kept as its pickle records, never built, and said so
    done = run("merge", tmp_path / "r0", tmp_path / "r1", "-o", tmp_path / "m.pt")
    assert done.exit_code == 0, done.output
    assert "kept as their pickle records, copied, never executed: 'random_states_0' (numpy.ndarray ×1)" in done.output
    merged = torch.load(tmp_path / "m.pt", weights_only=False)  # the test's own files: safe to unpickle
    assert list(merged) == ["model", "optimizer", "random_states_0", "scheduler"]
    for name in ("optimizer", "random_states_0", "scheduler"):
        original = torch.load(tmp_path / "r0" / f"{name}.{'pkl' if 'random' in name else 'bin'}", weights_only=False)
        assert repr(merged[name]) == repr(original), name  # tensors, numpy arrays and numbers, exactly
    assert all(torch.equal(merged["model"][k], v) for k, v in expected.items())
    left = run("merge", tmp_path / "r0", tmp_path / "r1", "-o", tmp_path / "model.pt", "--model-only")
    assert left.exit_code == 0, left.output
    assert "left out (--model-only): optimizer, random_states_0, scheduler" in left.output
    model = ckptfix.load(tmp_path / "model.pt")
    assert set(model) == set(expected) and all(torch.equal(model[k], v) for k, v in expected.items())


# -- entries that were not loaded (mmengine's message_hub) ----------------------------------------------------


@pytest.fixture
def mmengine_ckpt(tmp_path: Path) -> Path:
    from tests.frameworks import mmengine_checkpoint

    return mmengine_checkpoint(tmp_path)


@pytest.mark.slow  # importing mmengine.optim takes seconds
def test_diff_beside_an_entry_that_needs_classes_outside_the_allowlist(mmengine_ckpt: Path, tmp_path: Path) -> None:
    trusted = torch.load(mmengine_ckpt, weights_only=False)  # our own file: the truth
    ckptfix.save(trusted["state_dict"], tmp_path / "w.safetensors")
    result = run("diff", "--entry", "state_dict", mmengine_ckpt, tmp_path / "w.safetensors")
    assert result.exit_code == 0, result.output
    assert "A: entry 'message_hub': mmengine.logging.history_buffer.HistoryBuffer ×2, not loaded" in result.output
    assert result.output.splitlines()[-1] == "equal"
    same = run("diff", mmengine_ckpt, mmengine_ckpt, "--json")
    report = json.loads(same.output)
    assert same.exit_code == 0 and report["equal"] and set(report["not_loaded"]["a"]) == {"message_hub"}
    changed = dict(trusted, meta={**trusted["meta"], "epoch": 2})
    torch.save(changed, tmp_path / "later.pth")
    later = run("diff", mmengine_ckpt, tmp_path / "later.pth")
    assert later.exit_code == 1 and "  meta.epoch: 1 -> 2" in later.output, later.output


@pytest.mark.slow  # importing mmengine.optim takes seconds
def test_merge_beside_an_entry_that_was_not_loaded(mmengine_ckpt: Path, tmp_path: Path) -> None:
    trusted = torch.load(mmengine_ckpt, weights_only=False)  # our own file: the truth
    pt = run("merge", mmengine_ckpt, mmengine_ckpt, "-o", tmp_path / "m.pt")
    assert pt.exit_code == 0, pt.output
    assert "kept as their pickle records, copied, never executed: 'message_hub'" in pt.output
    copy = torch.load(tmp_path / "m.pt", weights_only=False)  # our own file again
    assert copy["message_hub"]["log_scalars"].keys() == trusted["message_hub"]["log_scalars"].keys()
    assert all(torch.equal(copy["state_dict"][k], v) for k, v in trusted["state_dict"].items())
    st = run("merge", mmengine_ckpt, mmengine_ckpt, "-o", tmp_path / "m.safetensors")
    assert st.exit_code == 2 and "'message_hub' would stay unloaded" in st.output and "--model-only" in st.output
    assert not (tmp_path / "m.safetensors").exists()
    only = run("merge", mmengine_ckpt, mmengine_ckpt, "-o", tmp_path / "m.safetensors", "--model-only")
    assert only.exit_code == 0 and "left out (--model-only): meta, message_hub, optimizer" in only.output
    merged = ckptfix.load(tmp_path / "m.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in trusted["state_dict"].items())
