"""Megatron-Core ``torch_dist`` folders (formats/folders/megatron.py): runs saved by megatron-core itself
(``tests/megatron_runs.py``; TP 1 or 2, PP 1 or 2, both on 4 ranks, VPP, EP 2 MoE; fp32 and bf16) converted without
megatron, each compared with Megatron's own load of it into a TP=1, PP=1 model; ``inspect``; hostile edits of a real
run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file

import ckptfix
from ckptfix.cli import cli
from tests.extras import MEGATRON_VENV, needs
from tests.megatron_runs import FIXTURES, fixture_runs, prefixed

ROOT = Path(__file__).resolve().parents[3]
MADE = fixture_runs()
RUNS = sorted(MADE)


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def expected(name: str, folder: Path = FIXTURES) -> dict[str, torch.Tensor]:
    """Megatron's own TP=1, PP=1 load of run ``name``, under the names the checkpoint gives them: the layer spec's
    own ``sharded_state_dict_keys_map`` (recorded by the generator from Megatron) applied to its state-dict names."""
    path = folder / f"{name}.expected.safetensors"
    with safe_open(str(path), "pt") as f:
        keys_map = json.loads(f.metadata()["sharded_state_dict_keys_map"])
    out = {}
    for key, value in load_file(str(path)).items():
        for local, saved in keys_map.items():
            key = key.replace(f".{local}", f".{saved}")
        out[key] = value
    return out


def assert_equal_state(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture
def copy_of(tmp_path: Path) -> Any:
    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst)
        return dst

    return make


def test_fixtures_cover_tp_pp_vpp_ep_and_both_dtypes() -> None:
    runs = MADE.values()
    assert {r["tp"] for r in runs} == {1, 2} and {r["pp"] for r in runs} == {1, 2} and {r["ep"] for r in runs} >= {2}
    assert any(r.get("vpp") == 2 for r in runs) and any(r.get("adam") for r in runs)
    assert {r["dtype"] for r in runs} == {"fp32", "bf16"}
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file()) < 1024 * 1024


@pytest.mark.parametrize("name", RUNS)
def test_load_equals_megatrons_own_tp1_pp1_load(name: str) -> None:
    assert_equal_state(ckptfix.load(FIXTURES / name), expected(name))


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.parametrize("out", ["model.safetensors", "model.pt", "shards/", "dcp/"])
def test_convert_streams_every_run_exactly(tmp_path: Path, name: str, out: str) -> None:
    src = FIXTURES / name
    before = digest(src)
    dst = tmp_path / out
    extra = ["--shard-size", "10kB"] if out == "shards/" else []
    result = run("convert", "-v", src, f"{dst}/" if out.endswith("/") else dst, *extra)
    assert result.exit_code == 0, result.output
    assert "path: stream" in result.output and "_extra_state entries left out" in result.output
    layout = MADE[name]
    vpp = f", VPP {layout['vpp']}" if "vpp" in layout else ""
    assert f"Megatron-Core torch_dist (TP {layout['tp']}, PP {layout['pp']}{vpp}, EP {layout['ep']})" in result.output
    if out == "shards/":
        assert len(list(dst.glob("model-*.safetensors"))) > 1
    assert_equal_state(ckptfix.load(dst), expected(name))
    assert digest(src) == before


def test_moe_experts_are_unstacked_by_layer_and_expert() -> None:
    state = ckptfix.load(FIXTURES / "moe_ep2_fp32")
    experts = sorted(k for k in state if ".local_experts." in k)
    assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight" in experts
    assert not any("experts.experts" in k for k in state)


def test_inspect_shows_layout_args_and_count_without_reading_tensor_bytes(copy_of: Any) -> None:
    folder = copy_of("tp2_fp32")
    for data in folder.glob("*.distcp"):  # zeroed: no byte of them may be needed to describe the folder
        data.write_bytes(bytes(data.stat().st_size))
    result = run("inspect", "--json", folder)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    mg = summary["megatron"]
    assert mg["layout"] == {"tensor": 2, "pipeline": 1, "expert": 1} and mg["ranks"] == 2
    assert mg["args"]["num_layers"] == 2 and mg["args"]["params_dtype"] == "float32"
    assert mg["tensors"] == len(expected("tp2_fp32")) == summary["models"][""]["tensors"]
    assert summary["folder"]["kind"] == "megatron"
    text = run("inspect", folder)
    assert text.exit_code == 0 and "tensor parallel 2, pipeline parallel 1, expert parallel 1" in text.output
    assert run("convert", folder, folder.parent / "out.safetensors").exit_code != 0  # the bytes are needed here


def test_no_megatron_transformer_engine_or_cuda_is_imported(tmp_path: Path) -> None:
    code = (
        "import sys, torch, ckptfix\n"
        "from ckptfix.summary import summarize\n"
        f"summarize({str(FIXTURES / 'moe_ep2_fp32')!r})\n"
        f"ckptfix.convert_file({str(FIXTURES / 'pp2_vpp2_bf16')!r}, {str(tmp_path / 'o.safetensors')!r})\n"
        f"ckptfix.load({str(FIXTURES / 'tp2_fp32')!r})\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine', 'apex')]\n"
        "assert not bad and not torch.cuda.is_initialized(), bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o.safetensors").exists()


def test_megatron_lm_save_folder_reads_the_iteration_its_tracker_names(tmp_path: Path) -> None:
    save = tmp_path / "checkpoints"
    shutil.copytree(FIXTURES / "moe_ep2_fp32", save / "iter_0000003")
    shutil.copytree(FIXTURES / "tp2_fp32", save / "iter_0000001")  # an older iteration, not read
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    result = run("convert", save, tmp_path / "model.safetensors")
    assert result.exit_code == 0, result.output
    assert_equal_state(ckptfix.load(tmp_path / "model.safetensors"), expected("moe_ep2_fp32"))
    inspected = run("inspect", save)
    assert inspected.exit_code == 0 and "(4 data files)" in inspected.output, inspected.output
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    refused(save, tmp_path, "iter_0000007", "not there")
    (save / "latest_checkpointed_iteration.txt").write_text("1")
    (save / "iter_0000001" / "metadata.json").unlink()  # as Megatron-LM's legacy per-rank format has none
    refused(save, tmp_path, "legacy", "torch_dist")


def test_optimizer_state_and_rng_objects_are_left_out_and_said(tmp_path: Path) -> None:
    result = run("convert", "-v", FIXTURES / "tp2_bf16", tmp_path / "o.safetensors")
    assert result.exit_code == 0, result.output
    assert "2 per-rank objects left out (rng_state)" in result.output
    assert "the optimizer's state (18 tensors) left out" in result.output  # exp_avg, exp_avg_sq of 9 parameters
    summary = json.loads(run("inspect", "--json", FIXTURES / "tp2_bf16").output)
    assert any("optimizer" in note for note in summary["megatron"]["notes"])
    assert not any(k.startswith("optimizer") for k in ckptfix.load(tmp_path / "o.safetensors"))


def test_inspect_and_its_verify_need_no_torch() -> None:
    code = (
        "import sys\n"
        "from ckptfix.summary import summarize\n"
        f"s = summarize({str(FIXTURES / 'tp2_bf16')!r}, verify=True)\n"
        "assert s['verified'] == 'crc' and s['megatron']['tensors'] == 15, s\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr


def test_optimizer_is_refused_with_the_reason(tmp_path: Path) -> None:
    result = run("convert", FIXTURES / "tp2_fp32", tmp_path / "o.pt", "--optimizer")
    assert result.exit_code != 0 and "not one" in result.output
    assert not (tmp_path / "o.pt").exists()


# -- hostile edits of a real run: one-line refusals, nothing written, the input untouched --------------------


def refused(folder: Path, tmp_path: Path, *words: str) -> None:
    before = digest(folder)
    for args in (("convert", folder, tmp_path / "o.safetensors"), ("convert", folder, tmp_path / "o.pt")):
        result = run(*args)
        assert result.exit_code != 0, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
        for word in words:
            assert word in result.output, result.output
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "o.pt").exists()
    assert digest(folder) == before


def rewrite_metadata(folder: Path, edit: Any) -> None:
    """Edit the plan with torch's own classes (this test's process trusts its own fixture) and write it back."""
    path = folder / ".metadata"
    meta = pickle.loads(path.read_bytes())
    edit(meta)
    path.write_bytes(pickle.dumps(meta))


def test_a_missing_rank_file_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("pp2_vpp2_bf16")
    (folder / "__1_0.distcp").unlink()
    refused(folder, tmp_path, "__1_0.distcp")


def test_a_missing_chunk_is_refused_by_the_dcp_coverage_rule(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    key = "decoder.layers.self_attention.linear_qkv.weight"
    rewrite_metadata(folder, lambda m: m.state_dict_metadata[key].chunks.pop())
    refused(folder, tmp_path, key, "cover")


def test_a_shape_past_its_chunks_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_bf16")
    key = "decoder.layers.mlp.linear_fc2.weight"

    def grow(meta: Any) -> None:
        meta.state_dict_metadata[key].size = torch.Size([5, *meta.state_dict_metadata[key].size[1:]])

    rewrite_metadata(folder, grow)
    refused(folder, tmp_path, key)


def test_more_layers_than_chunks_is_refused_before_any_is_listed(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("pp2_vpp2_bf16")
    key = "decoder.layers.mlp.linear_fc1.layer_norm_weight"

    def empty(meta: Any) -> None:  # a billion layers of nothing: the chunks still tile it (zero elements)
        entry = meta.state_dict_metadata[key]
        entry.size = torch.Size([10**9, 0])
        for c in entry.chunks:
            c.sizes = torch.Size([1, 0])

    rewrite_metadata(folder, empty)
    common = torch.load(folder / "common.pt", weights_only=False)
    del common["args"].num_layers  # no claim to check it against: the chunk count alone bounds it
    torch.save(common, folder / "common.pt")
    refused(folder, tmp_path, key, "1000000000 layers in 4 chunks")


def test_a_layer_count_other_than_the_args_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    common = torch.load(folder / "common.pt", weights_only=False)
    common["args"].num_layers = 3
    torch.save(common, folder / "common.pt")
    refused(folder, tmp_path, "num_layers=3", "mixes two checkpoints")


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


def test_common_pt_calling_code_is_refused_unrun(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    common = torch.load(folder / "common.pt", weights_only=False)
    common["args"].hook = _Evil()
    torch.save(common, folder / "common.pt")
    refused(folder, tmp_path, "can run code")


def test_a_metadata_pickle_calling_code_is_refused_unrun(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Touch(str(marker))))
    refused(folder, tmp_path, "can run code")
    assert not marker.exists()


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def test_a_metadata_json_with_a_key_twice_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend": "zarr"}')
    refused(folder, tmp_path, "metadata.json", "twice")


def test_another_sharded_backend_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    refused(folder, tmp_path, "zarr", "torch_dist")


def test_a_truncated_data_file_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("moe_ep2_fp32")
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    refused(folder, tmp_path)


def test_a_flipped_tensor_byte_is_refused(copy_of: Any, tmp_path: Path) -> None:
    folder = copy_of("tp2_fp32")
    data = folder / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    at = raw.index(b"data/0") + 200  # inside the first chunk's tensor bytes
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    refused(folder, tmp_path, "CRC")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason=needs("megatron-core", MEGATRON_VENV))
@pytest.mark.parametrize("name", ["tp2_bf16", "tp2_pp2_bf16"])  # 2 ranks; 4 (TP 2 x PP 2)
def test_a_fresh_megatron_run_converts_exactly(tmp_path: Path, name: str) -> None:
    from tests.megatron_runs import make_run

    folder = make_run(tmp_path, name)
    assert_equal_state(ckptfix.load(folder), expected(name, folder=tmp_path))


def test_layers_under_a_wrappers_prefix_are_unstacked_and_inspect_says_so(tmp_path: Path) -> None:
    folder = prefixed(FIXTURES / "moe_ep2_fp32", tmp_path / "run", "module.")
    result = run("convert", folder, tmp_path / "o.safetensors")
    assert result.exit_code == 0, result.output
    assert_equal_state(ckptfix.load(tmp_path / "o.safetensors"), expected("moe_ep2_fp32"))  # --to single's
    assert_equal_state(ckptfix.load(folder), {f"module.{k}": v for k, v in expected("moe_ep2_fp32").items()})
    text = run("inspect", folder)
    assert text.exit_code == 0 and "layers unstacked under 'module.'" in text.output, text.output
    plain = run("inspect", FIXTURES / "moe_ep2_fp32").output
    assert "layers unstacked" in plain and "under" not in plain


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason=needs("megatron-core", MEGATRON_VENV))
def test_a_fresh_run_saved_under_a_wrappers_prefix_is_unstacked(tmp_path: Path) -> None:
    from tests.megatron_runs import make_run

    folder = make_run(tmp_path, "module_tp2_fp32")
    want = expected("module_tp2_fp32", folder=tmp_path)
    assert_equal_state(ckptfix.load(folder), {f"module.{k}": v for k, v in want.items()})
    assert run("convert", folder, tmp_path / "o.safetensors").exit_code == 0
    assert_equal_state(ckptfix.load(tmp_path / "o.safetensors"), want)
    assert "layers unstacked under 'module.'" in run("inspect", folder).output


# ----------------------------------------------------------------------------------------------------------------------
# Every parallel layout of the Megatron-Core fixtures (``tests/megatron_runs.py``'s ``RUNS``), the plain one (TP 1,
# PP 1 on one rank) and tensor and pipeline parallelism together (TP 2 x PP 2 on four ranks) among them: ``inspect``
# says each run's layout, rank count, arguments and tensor count as the generator recorded them, without reading a
# tensor byte. (Each run's exact conversion: the tests above, parametrised over the same runs.)


def test_the_plain_layout_and_tp_by_pp_on_four_ranks_are_among_the_runs() -> None:
    runs = MADE.values()
    plain = [r for r in runs if (r["tp"], r["pp"], r["ep"], r.get("vpp")) == (1, 1, 1, None)]
    assert plain and all(r["world_size"] == 1 for r in plain)
    both = [r for r in runs if r["tp"] == 2 and r["pp"] == 2]
    assert both and all(r["world_size"] == 4 for r in both)
    # tied output, the Adam state, virtual stages and EP: each still covered
    assert any(r["tied"] for r in runs) and any(r.get("adam") for r in runs)
    assert any(r.get("vpp") for r in runs) and any(r["ep"] == 2 and r["moe"] for r in runs)
    for dtype in ("fp32", "bf16"):
        assert {(r["tp"], r["pp"]) for r in runs if r["dtype"] == dtype} >= {(2, 1)}
    assert {(r["tp"], r["pp"]) for r in runs} >= {(1, 1), (2, 1), (1, 2), (2, 2)}


@pytest.mark.parametrize("name", RUNS)
def test_inspect_says_each_runs_layout_without_reading_tensor_bytes(name: str, tmp_path: Path) -> None:
    made = MADE[name]
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    for data in folder.glob("*.distcp"):  # zeroed: no byte of them may be needed to describe the folder
        data.write_bytes(bytes(data.stat().st_size))
    result = run("inspect", "--json", folder)
    assert result.exit_code == 0, result.output
    mg = json.loads(result.output)["megatron"]
    layout = {"tensor": made["tp"], "pipeline": made["pp"], "expert": made["ep"]}
    if "vpp" in made:
        layout["virtual_pipeline"] = made["vpp"]
    assert mg["layout"] == layout and mg["ranks"] == made["world_size"]
    assert mg["args"]["num_layers"] == made["layers"]
    assert mg["args"]["params_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[made["dtype"]]
    with safe_open(str(FIXTURES / f"{name}.expected.safetensors"), "pt") as f:
        assert mg["tensors"] == len(list(f.keys()))
    text = run("inspect", folder)
    assert text.exit_code == 0, text.output
    said = f"tensor parallel {made['tp']}, pipeline parallel {made['pp']}"
    ranks = f"written by {made['world_size']} rank{'s' * (made['world_size'] != 1)}, iteration {made['steps']}"
    assert said in text.output and ranks in text.output, text.output
