"""Checkpoints saved on a GPU: their device tags kept by every .pt conversion, and GPU models loaded for real.

Files with CUDA tags are made here without a GPU, the way torch.save tags a CUDA storage (``cuda:0`` as the
storage's location in the pickle); the tests marked ``cuda`` run where a GPU is (bench/gpu_check.sh).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.trainer.fixtures import CUDA_DIR, MANIFEST, reference_probe, sha256, storage_locations
from ckptfix.trainer.model import build_model, probe
from tests.dtype_files import _inspect, _quantized
from tests.models import make_net, wrap
from tests.writers import saved_as

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs these)")


def locations(path: Path) -> list[str]:
    """The location tag of every storage in a .pt file, in file order (read on the CPU)."""
    seen: list[str] = []
    torch.load(path, map_location=lambda storage, where: seen.append(where) or storage, weights_only=True)
    return seen


def _cuda_saved_checkpoint(path: Path) -> dict[str, Any]:
    state = wrap("dp", make_net()).cpu().state_dict()
    obj = {"model": state, "epoch": 3}
    with saved_as("cuda:0"):
        torch.save(obj, path)
    return obj


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-path"])
@pytest.mark.parametrize("dtype", [None, "float16"])
def test_a_cuda_saved_checkpoint_converts_with_its_device_tags(tmp_path: Path, fast: bool, dtype: str | None) -> None:
    src, out = tmp_path / "cuda.pt", tmp_path / "out.pt"
    obj = _cuda_saved_checkpoint(src)
    ckptfix.convert_file(src, out, to="single", fast=fast, dtype=dtype)
    assert locations(out) == ["cuda:0"] * len(locations(src))
    got = torch.load(out, map_location="cpu", weights_only=True)["model"]
    assert list(got) == [k.removeprefix("module.") for k in obj["model"]]
    for key, value in obj["model"].items():
        want = value.to(torch.float16) if dtype and value.is_floating_point() else value
        assert torch.equal(got[key.removeprefix("module.")], want), key


def test_the_cli_torch_path_keeps_device_tags_of_a_mixed_file(tmp_path: Path) -> None:
    src, out = tmp_path / "mixed.pt", tmp_path / "out.pt"
    state = make_net().state_dict()
    with saved_as("cuda:1", only=list(state.values())):
        torch.save({"model": state, "cpu_copy": {"w": torch.arange(3.0)}}, src)
    before = locations(src)
    assert sorted(set(before)) == ["cpu", "cuda:1"]
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--no-fast"])
    assert result.exit_code == 0, result.output
    assert locations(out) == before


def test_loading_a_cuda_saved_file_gives_cpu_tensors_here(tmp_path: Path) -> None:
    src = tmp_path / "cuda.pt"
    _cuda_saved_checkpoint(src)
    for mmap in (True, False):
        loaded = ckptfix.load(src, mmap=mmap)
        assert {t.device.type for t in loaded["model"].values()} == {"cpu"}
    net = make_net(seed=7)
    assert ckptfix.load_into(net, src).ok
    assert all(
        torch.equal(a, b) for a, b in zip(net.state_dict().values(), make_net().state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_says_where_the_storages_were_saved(tmp_path: Path, legacy: bool) -> None:
    src = tmp_path / "mixed.pt"
    state = make_net().state_dict()
    with saved_as("cuda:0", only=list(state.values())[:3]):
        torch.save({"model": state, "rng": torch.get_rng_state()}, src, _use_new_zipfile_serialization=not legacy)
    result = CliRunner().invoke(cli, ["inspect", str(src)])
    assert result.exit_code == 0, result.output
    assert f"saved on: cuda:0 ×3, cpu ×{len(state) - 3 + 1} (the device tags of its storages)" in result.output


# --- on a GPU ------------------------------------------------------------------------------------------------


@cuda
def test_load_into_a_cuda_model_from_cuda_and_cpu_saved_files(tmp_path: Path) -> None:
    reference = make_net()
    torch.save({"model": reference.state_dict()}, tmp_path / "cpu.pt")
    torch.save({"model": make_net().cuda().state_dict()}, tmp_path / "cuda.pt")
    ckptfix.save(make_net().state_dict(), tmp_path / "st.safetensors")
    for name in ("cpu.pt", "cuda.pt", "st.safetensors"):
        net = make_net(seed=9).cuda()
        assert ckptfix.load_into(net, tmp_path / name).ok
        assert {p.device.type for p in net.state_dict().values()} == {"cuda"}, name
        for key, value in reference.state_dict().items():
            assert torch.equal(net.state_dict()[key].cpu(), value), (name, key)


@cuda
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-path"])
def test_a_real_cuda_save_converts_back_to_cuda_tensors(tmp_path: Path, fast: bool) -> None:
    src, out = tmp_path / "dp.pt", tmp_path / "single.pt"
    model = torch.nn.DataParallel(make_net().cuda())
    torch.save({"model": model.state_dict()}, src)
    ckptfix.convert_file(src, out, to="single", fast=fast)
    got = torch.load(out, weights_only=True)["model"]  # no map_location: back where they were saved
    want = model.module.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].device == value.device and torch.equal(got[key], value), key


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("quantized", [False, True], ids=["described", "loaded-with-torch"])
def test_inspect_says_which_devices_the_storages_were_saved_on(tmp_path: Path, quantized: bool) -> None:
    from tests.writers import saved_as

    src = tmp_path / "mixed.pt"
    on_gpu = [torch.ones(3), torch.ones(4)]
    state = {"a": on_gpu[0], "b": on_gpu[1], "tied": on_gpu[0], "c": torch.zeros(2)}
    if quantized:  # a file ckptfix hands to torch.load: the tags still come from its description
        state["q"] = _quantized("qint8")
    with saved_as("cuda:0", only=on_gpu):
        torch.save(state, src)
    summary = _inspect(src, "--json")
    assert summary["devices"] == {"cuda:0": 2, "cpu": 1 + quantized}  # storages, not tensors: "tied" is "a"
    assert f"saved on: cuda:0 ×2, cpu ×{1 + quantized} (the device tags of its storages)" in _inspect(src)


# ----------------------------------------------------------------------------------------------------------------------
# The checkpoints torch.save wrote on a real GPU (fixtures/cuda, made by ``python -m ckptfix.trainer.fixtures
# --cuda``): their device tags kept, their values loaded onto the CPU here and onto the GPU where there is one.


CUDA_FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / CUDA_DIR
MANIFEST_DATA: dict[str, Any] = json.loads((CUDA_FIXTURES / MANIFEST).read_text())
FILES: dict[str, dict[str, Any]] = MANIFEST_DATA["files"]
PREFIX = {"single": "", "ddp": "module.", "compiled": "_orig_mod."}


def _truth(name: str) -> dict[str, torch.Tensor]:
    """The model state of a fixture as plain torch loads it onto the CPU, in the plain model's keys."""
    obj = torch.load(CUDA_FIXTURES / name, map_location="cpu", weights_only=True)
    record = FILES[name]
    state = obj[record["entry"]] if record["entry"] else obj
    return {k.removeprefix(PREFIX[record["layout"]]): v for k, v in state.items()}


def test_manifest_covers_every_file_and_checksums_match() -> None:
    assert {p.name for p in CUDA_FIXTURES.iterdir() if p.name != MANIFEST} == set(FILES)
    for name, record in FILES.items():
        assert sha256(CUDA_FIXTURES / name) == record["sha256"], f"{name}: regenerate with {MANIFEST_DATA['command']}"
    assert MANIFEST_DATA["platform"]["gpu"], "made on a GPU"
    assert {r["layout"] for r in FILES.values()} == {"single", "ddp", "compiled"}
    assert (CUDA_FIXTURES / "cuda_legacy_dp.pt").read_bytes()[:2] == b"\x80\x02"  # pickle, not a zip
    assert sum(p.stat().st_size for p in CUDA_FIXTURES.iterdir()) < 512 * 1024


@pytest.mark.parametrize("name", sorted(FILES))
def test_device_tags_are_the_ones_torch_wrote_and_inspect_shows_them(name: str) -> None:
    tags = storage_locations(CUDA_FIXTURES / name)
    assert tags == FILES[name]["locations"]
    assert set(tags) <= {"cuda:0", "cpu"} and tags["cuda:0"] >= 20  # the model's 20 tensors at least
    result = CliRunner().invoke(cli, ["inspect", str(CUDA_FIXTURES / name)])
    assert result.exit_code == 0, result.output
    (line,) = re.findall(r"saved on: (.*) \(the device tags of its storages\)", result.output)
    assert dict((tag, int(n)) for tag, n in (part.split(" ×") for part in line.split(", "))) == tags


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-path"])
@pytest.mark.parametrize("name", sorted(FILES))
def test_converted_to_pt_keeps_device_tags_and_every_bit(name: str, fast: bool, tmp_path: Path) -> None:
    out = tmp_path / "single.pt"
    ckptfix.convert_file(CUDA_FIXTURES / name, out, to="single", fast=fast)
    assert storage_locations(out) == FILES[name]["locations"]
    obj = torch.load(out, map_location="cpu", weights_only=True)
    got, want = (obj["model"] if FILES[name]["entry"] else obj), _truth(name)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name", sorted(FILES))
def test_loads_into_the_plain_model_with_the_recorded_output(name: str, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(CUDA_FIXTURES / name), str(out), "--to", "single", "--model-only"])
    assert result.exit_code == 0, result.output
    check = CliRunner().invoke(cli, ["validate", str(out), "--model", "ckptfix.trainer.model:build_model"])
    assert check.exit_code == 0, check.output
    want = reference_probe(_truth(name), "")
    torch.testing.assert_close(torch.tensor(want), torch.tensor(FILES[name]["probe"]), rtol=0, atol=1e-5)
    for source in (out, CUDA_FIXTURES / name):  # the converted file, and the GPU-saved file itself
        model = build_model()
        report = ckptfix.load_into(model, source, strict=True)
        assert report.ok, report.summary()
        assert torch.equal(probe(model).flatten(), torch.tensor(want)), source


@pytest.mark.parametrize("name", sorted(FILES))
def test_load_gives_cpu_tensors_equal_to_torchs(name: str) -> None:
    loaded = ckptfix.load(CUDA_FIXTURES / name)
    state = loaded[FILES[name]["entry"]] if FILES[name]["entry"] else loaded
    assert {t.device.type for t in state.values()} == {"cpu"}
    want = _truth(name)
    assert [k.removeprefix(PREFIX[FILES[name]["layout"]]) for k in state] == list(want)
    assert all(torch.equal(t, want[k.removeprefix(PREFIX[FILES[name]["layout"]])]) for k, t in state.items())


@cuda
@pytest.mark.parametrize("name", sorted(FILES))
def test_load_into_a_cuda_model_from_a_gpu_saved_file(name: str) -> None:
    model = build_model().cuda()
    assert ckptfix.load_into(model, CUDA_FIXTURES / name, strict=True).ok
    want = _truth(name)
    got = model.state_dict()
    assert {t.device.type for t in got.values()} == {"cuda"}
    assert all(torch.equal(got[k].cpu(), want[k]) for k in want)
