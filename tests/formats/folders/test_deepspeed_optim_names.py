"""A ZeRO run's consolidated optimizer state names its parameters: each group's ``param_names`` are the run's own
``param_shapes`` names in its flat order, and ``convert RUN folder/ --optimizer`` writes the state keyed by those
names (what ``set_optimizer_state_dict`` loads), each moment and step the one the ``.pt`` holds at its index.

In the fixture runs the frozen layer is in no group and ``head.weight`` (tied to ``embed.weight``) is named once.
Real runs whose groups interleave the model's parameters, resumed from both outputs: tests/test_resume_deepspeed.py
(slow, needs DeepSpeed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptfix
from tests.formats.folders.test_deepspeed import FIXTURES, NAMES, _unpickled, optimizer_truth, run_cli


def _param_shapes(name: str) -> list[list[str]]:
    module = sorted((FIXTURES / name / "global_step1").glob("*model_states.pt"))[0]
    return [list(group) for group in _unpickled(module)["param_shapes"]]


@pytest.mark.parametrize("name", NAMES)
def test_groups_carry_the_runs_parameter_names(name: str, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    assert run_cli("convert", str(FIXTURES / name), str(out), "--optimizer").exit_code == 0
    groups = torch.load(out, weights_only=True)["optimizer"]["param_groups"]
    assert [g["param_names"] for g in groups] == _param_shapes(name)
    assert [g["param_names"] for g in groups] == [["embed.weight", "body.weight"],
                                                  ["body.bias", "norm.weight", "norm.bias"]]  # fmt: skip
    assert [g["params"] for g in groups] == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_into_a_dcp_folder_is_keyed_by_name(name: str, tmp_path: Path) -> None:
    folder = f"{tmp_path / 'fsdp2_run'}/"
    result = run_cli("convert", str(FIXTURES / name), folder, "--optimizer", "-v")
    assert result.exit_code == 0, result.output
    assert "keyed by parameter name (set_optimizer_state_dict's form), names from its param_groups' param_names" \
        in result.output  # fmt: skip
    got = ckptfix.load(folder)["optimizer"]
    truth = optimizer_truth(name)  # index-keyed, from the raw rank files
    names = [n for group in _param_shapes(name) for n in group]
    assert sorted(got["state"]) == sorted(names)
    for index, param in enumerate(names):
        assert sorted(got["state"][param]) == sorted(truth["state"][index]), param
        for key, value in truth["state"][index].items():
            moved = got["state"][param][key]
            assert moved.dtype == value.dtype and torch.equal(moved, value), (param, key)
    for g, want in zip(got["param_groups"], truth["param_groups"], strict=True):
        assert g["params"] == g["param_names"] == [names[i] for i in want["params"]]
        assert {k: v for k, v in g.items() if k not in ("params", "param_names")} == {
            k: v for k, v in want.items() if k not in ("params", "param_names")
        }


def test_optimizer_into_safetensors_still_refused(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    result = run_cli("convert", str(FIXTURES / "zero1_fp32"), str(out), "--optimizer")
    assert result.exit_code == 2 and not out.exists()
    said = f"--optimizer writes {{model, optimizer}} into one .pt file or a DCP folder, but {out} asks for a " \
           f".safetensors file (tensors only); write a .pt or a folder/, or drop --optimizer"  # fmt: skip
    assert said in result.output


@pytest.mark.parametrize("extra", [("--no-fast",), ("--dtype", "bf16")])
def test_torch_writer_routes_write_the_same_optimizer(extra: tuple[str, ...], tmp_path: Path) -> None:
    """The torch path and the cast (torch's DCP writer) write the stream's optimizer state: a cast touches the
    model entry alone."""
    run = str(FIXTURES / "zero2_bf16")
    assert run_cli("convert", run, f"{tmp_path / 'stream'}/", "--optimizer").exit_code == 0
    result = run_cli("convert", run, f"{tmp_path / 'other'}/", "--optimizer", *extra)
    assert result.exit_code == 0, result.output
    want, got = ckptfix.load(tmp_path / "stream")["optimizer"], ckptfix.load(tmp_path / "other")["optimizer"]
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"])
    for param, moments in want["state"].items():
        for key, value in moments.items():
            moved = got["state"][param][key]
            assert moved.dtype == value.dtype == torch.float32 and torch.equal(moved, value), (param, key)
