"""A ZeRO run's state beyond the model and optimizer (``ckptfix.formats.deepspeed.state``): the client
scheduler, the engine's counters and ``client_state`` carried by ``convert --optimizer``, what cannot be built left
out and named. The runs are the fixtures' (DeepSpeed's own files), their module file saved again with a client
state as ``engine.save_checkpoint(dir, client_state=...)`` writes it: at the top level of the module file."""

from __future__ import annotations

import dataclasses
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckptfix.cli import cli

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "deepspeed"


@dataclasses.dataclass
class Sampler:
    """A user's object in client_state (ckptfix builds none)."""

    seed: int = 0


def with_client_state(tmp_path: Path, name: str, client: dict[str, Any]) -> Path:
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run)
    for module_file in (run / "global_step1").glob("*model_states.pt"):
        saved = torch.load(module_file, weights_only=False)  # the fixture, made by tests/deepspeed_runs.py
        saved.update(client)
        torch.save(saved, module_file)
    return run


def convert(*args: object) -> Any:
    return CliRunner().invoke(cli, ["convert", *map(str, args)])


@pytest.mark.parametrize("name", ["zero2_fp32", "zero3_bf16"])
@pytest.mark.parametrize("fast", [True, False])
def test_client_state_is_carried(name: str, fast: bool, tmp_path: Path) -> None:
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), step_size=2)
    client = {"lr_scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "epoch": 7,
              "history": OrderedDict(losses=[0.5, 0.25], best=torch.tensor([1.5, 2.5]))}  # fmt: skip
    run = with_client_state(tmp_path, name, client)
    out = tmp_path / "full.pt"
    done = convert(run, out, "--optimizer", *([] if fast else ["--no-fast"]))
    assert done.exit_code == 0, done.output
    back = torch.load(out, weights_only=True)
    assert set(back) == {"model", "optimizer", "skipped_steps", "global_steps", "global_samples", *client}
    assert back["lr_scheduler"] == client["lr_scheduler"] and back["epoch"] == 7
    assert torch.equal(back["rng"], client["rng"]) and back["rng"].dtype == torch.uint8
    assert type(back["history"]) is OrderedDict and back["history"]["losses"] == [0.5, 0.25]
    assert torch.equal(back["history"]["best"], client["history"]["best"])
    torch.set_rng_state(back["rng"])  # what a resumed run does with it


def test_dcp_output_carries_it_too(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    run = with_client_state(tmp_path, "zero1_fp16", {"rng": torch.get_rng_state(), "epoch": 7})
    done = convert(run, f"{tmp_path / 'dcp'}/", "--optimizer")
    assert done.exit_code == 0, done.output
    state = {"rng": torch.zeros_like(torch.get_rng_state()), "epoch": 0, "global_steps": 0,
             "loss_scaler": {"cur_scale": 0, "scale_window": 0}}  # fmt: skip
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    assert torch.equal(state["rng"], torch.get_rng_state()) and state["epoch"] == 7 and state["global_steps"] == 1
    assert state["loss_scaler"] == {"cur_scale": 16, "scale_window": 1000}  # the fp16 run's dynamic loss scale


def test_what_cannot_be_built_is_left_out_and_named(tmp_path: Path) -> None:
    run = with_client_state(tmp_path, "zero2_fp32", {"sampler": Sampler(), "epoch": 3})
    out = tmp_path / "full.pt"
    refused = convert(run, out, "--optimizer")  # a global outside the allowlist: refused, nothing run
    assert refused.exit_code != 0 and "Sampler" in refused.output and not out.exists()
    done = convert(run, out, "--optimizer", "-v", "--allow-global", f"{__name__}.Sampler")
    assert done.exit_code == 0, done.output
    assert f"client_state entry 'sampler' not carried: it holds a {__name__}.Sampler" in done.output
    back = torch.load(out, weights_only=True)
    assert "sampler" not in back and back["epoch"] == 3


@pytest.mark.parametrize("fast", [True, False])
def test_a_client_entry_named_as_a_parameter_stays_its_own(fast: bool, tmp_path: Path) -> None:
    """A client_state tensor under a parameter's name is the client's, not a second name of the parameter."""
    mine = torch.arange(63.0).reshape(9, 7)  # the parameter's shape and dtype too
    run = with_client_state(tmp_path, "zero2_fp32", {"body.weight": mine})
    out = tmp_path / "full.pt"
    done = convert(run, out, "--optimizer", *([] if fast else ["--no-fast"]))
    assert done.exit_code == 0, done.output
    back = torch.load(out, weights_only=True)
    assert torch.equal(back["body.weight"], mine)
    assert not torch.equal(back["model"]["body.weight"], mine)
    assert back["body.weight"].untyped_storage().data_ptr() != back["model"]["body.weight"].untyped_storage().data_ptr()
