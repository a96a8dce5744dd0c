"""Checkpoints saved on a GPU: their device tags kept by every .pt conversion, and GPU models loaded for real.

Files with CUDA tags are made here without a GPU, the way torch.save tags a CUDA storage (``cuda:0`` as the
storage's location in the pickle); the tests marked ``cuda`` run where a GPU is (bench/gpu_check.sh).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
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
