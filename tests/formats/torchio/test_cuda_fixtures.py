"""The checkpoints torch.save wrote on a real GPU (fixtures/cuda, made by ``python -m ckptfix.trainer.fixtures
--cuda``): their device tags kept, their values loaded onto the CPU here and onto the GPU where there is one."""

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

CUDA_FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / CUDA_DIR
MANIFEST_DATA: dict[str, Any] = json.loads((CUDA_FIXTURES / MANIFEST).read_text())
FILES: dict[str, dict[str, Any]] = MANIFEST_DATA["files"]
PREFIX = {"single": "", "ddp": "module.", "compiled": "_orig_mod."}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs these)")


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
