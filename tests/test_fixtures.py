"""The real checkpoints in fixtures/: checksums, and every fixture through every layout and format."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.loading.model import model_state_of
from ckptfix.trainer.fixtures import MANIFEST, reference_probe, sha256
from ckptfix.trainer.model import build_model, probe
from ckptfix.transforms.layouts import LAYOUTS, chain_prefix, detect

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST_DATA: dict[str, Any] = json.loads((FIXTURES / MANIFEST).read_text())
FILES: dict[str, dict[str, Any]] = MANIFEST_DATA["files"]
TARGETS = [name for name in LAYOUTS if name != "dp"]  # dp is an alias of ddp's key layout


def _load(name: str) -> Any:
    return ckptfix.load(FIXTURES / name, allow_globals=FILES[name].get("allow_globals", ()))


@functools.cache
def _torch_probe(name: str) -> torch.Tensor:
    """The probe output of the fixture as plain torch loads it, on this machine: float kernels differ from one
    CPU to another in the last bits (two AVX-512 machines of different vendors do), so bit-for-bit equality is
    asserted against this, and the manifest's recorded output (another machine's) within float tolerance."""
    path, record = FIXTURES / name, FILES[name]
    if record["format"] == "safetensors":
        from safetensors.torch import load_file

        obj: Any = load_file(path)
    else:  # the project's own files: safe to unpickle in full here
        obj = torch.load(path, map_location="cpu", weights_only=False)
    state = obj[record["entry"]] if record["entry"] else obj
    got = torch.tensor(reference_probe(state, chain_prefix(LAYOUTS[record["layout"]])), dtype=torch.float32)
    recorded = torch.tensor(record["probe"], dtype=torch.float32)
    torch.testing.assert_close(got, recorded, rtol=0, atol=1e-5, msg=f"{name}: not the checkpoint the manifest says")
    return got.view(-1, 4)


def _assert_probe(model: torch.nn.Module, name: str) -> None:
    assert torch.equal(probe(model), _torch_probe(name)), f"{name}: output differs from the checkpoint's own"


def test_manifest_covers_every_file_and_checksums_match() -> None:
    on_disk = {p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != MANIFEST}  # cuda/: its own test
    assert on_disk == set(FILES)
    for name, record in FILES.items():
        assert sha256(FIXTURES / name) == record["sha256"], f"{name}: regenerate with {MANIFEST_DATA['command']}"
        assert (FIXTURES / name).stat().st_size == record["bytes"]
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*")) < 2 * 1024 * 1024


def test_fixtures_cover_the_required_cases() -> None:
    layouts = {record["layout"] for record in FILES.values()}
    assert {"single", "ddp", "compiled", "ddp-compiled", "compiled-ddp"} <= layouts
    modes = {record["made_by"]["mode"] for record in FILES.values()}
    assert modes == {"single", "dp", "ddp"}
    assert any(r["format"] == "safetensors" for r in FILES.values())
    assert (FIXTURES / "legacy_dp.pt").read_bytes()[:2] == b"\x80\x02"  # pickle, not a zip
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"argparse\.Namespace"):
        ckptfix.load(FIXTURES / "namespace_args.pt")
    full = _load("single.pt")
    assert {"model", "optimizer", "epoch", "rng", "config"} <= set(full)
    assert full["optimizer"]["state"], "optimizer state (momentum buffers) should be saved"


@pytest.mark.parametrize("name", sorted(FILES))
def test_fixture_layout_matches_manifest(name: str) -> None:
    assert detect(model_state_of(_load(name), source=name).keys()).name == FILES[name]["layout"]


def test_per_rank_files_differ_in_batchnorm_statistics_only() -> None:
    rank0, rank1 = (model_state_of(_load(f"ddp_rank{r}.pt"), source="fixture") for r in (0, 1))
    differ = {k for k in rank0 if not torch.equal(rank0[k], rank1[k])}
    assert differ
    assert all(k.endswith(("running_mean", "running_var")) for k in differ)
    assert FILES["ddp_rank0.pt"]["probe"] != FILES["ddp_rank1.pt"]["probe"]


@pytest.mark.parametrize("name", sorted(FILES))
def test_fixture_converts_to_every_layout_and_format(name: str, tmp_path: Path) -> None:
    obj = _load(name)
    for target in TARGETS:
        for ext in (".pt", ".safetensors"):
            # safetensors holds tensors only: the model entry goes alone.
            converted = ckptfix.convert(obj, to=target, model_only=ext == ".safetensors")
            out = tmp_path / f"{target}{ext}"
            ckptfix.save(converted, out)
            allow = FILES[name].get("allow_globals", ())
            back = ckptfix.load(out, allow_globals=allow)
            state = model_state_of(back, source=str(out))
            assert all(k.startswith(chain_prefix(LAYOUTS[target])) for k in state)
            assert detect(state.keys()).chain == LAYOUTS[target]
            model = build_model()
            # A path where the file needs no extra globals: the one-call way users load a checkpoint.
            report = ckptfix.load_into(model, back if allow and ext == ".pt" else out, strict=True)
            assert report.ok, f"{name} -> {target}{ext}: {report.summary()}"
            _assert_probe(model, name)


@pytest.mark.parametrize("name", ["single.pt", "dp_wrapped.pt", "ddp_compiled.pt", "namespace_args.pt"])
def test_fixture_loads_into_wrapped_models(name: str) -> None:
    obj = _load(name)
    for wrap in (torch.nn.DataParallel, torch.compile):
        model = build_model()
        ckptfix.load_into(wrap(model), model_state_of(obj, source=name), strict=True)
        _assert_probe(model.cpu(), name)  # DataParallel put it on cuda:0 on a GPU machine


def test_full_checkpoint_keeps_its_other_entries(tmp_path: Path) -> None:
    obj = _load("dp_wrapped.pt")
    ckptfix.save(ckptfix.convert(obj, to="single"), tmp_path / "single.pt")
    back = ckptfix.load(tmp_path / "single.pt")
    assert set(back) == set(obj)
    assert back["epoch"] == obj["epoch"] and back["config"] == obj["config"]
    for index, state in obj["optimizer"]["state"].items():
        assert torch.equal(back["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])
