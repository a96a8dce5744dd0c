"""Training goes on after a move from DeepSpeed ZeRO: a ZeRO-1/2/3 run (2 gloo ranks; torch's ``AdamW`` as the
client optimizer in fp32 or bf16, ``SGD`` with momentum in fp32) converted by ``ckptfix convert RUN …
--optimizer``, resumed on one device or DDP from the ``.pt`` (``optimizer.load_state_dict``, index-keyed) and on
FSDP2 from a DCP folder (``set_state_dict``, name-keyed, the names from the run's ``param_shapes``).

The ResumeNet groups interleave the model's parameters (weights decayed: ``proj.weight``, ``mid.weight``; the
rest not), so index 1 is ``mid.weight`` where ``named_parameters()`` order has ``norm.weight``: the names must come
from the run (without them, the DCP folder kept the index form, which ``set_state_dict`` does not load).

What the resumed run holds is ``torch.equal`` to what DeepSpeed held (``safe_get_full_optimizer_state`` per
parameter, the base optimizer's ``step``) for every parameter, moment and step, and the run's scheduler, random
state (in ``client_state``) and ``global_steps`` go on where DeepSpeed left them. The losses of the next ``MORE``
steps: DeepSpeed's engine steps torch's own ``AdamW`` (element-wise, so a flat fp32 partition steps as its
parameters would) on gradients averaged over 2 ranks, as DDP and FSDP2 average them, so on 2 ranks they are
``torch.equal``. On one device each gradient is a mean over the global batch summed in another order (8 rows in one
process; 4 rows on each of 2 ranks, then averaged), about one unit in the last place of float32; ten AdamW steps
carry that along, so those losses are compared within rtol 1e-5 (a step changes the loss by about 1e-2), as
``tests/test_resume.py`` compares its runs of another world size.

A bf16 run's moments and fp32 master weights are what a resume needs, and they move exactly (``torch.equal``); but
DeepSpeed runs its forward and backward in bf16 (weights cast from the masters, activations rounded), while the
resumed job runs in fp32 from the masters, so each loss differs by bf16 rounding: compared within rtol 4e-3, one
bf16 unit at 1.0 (2**-8; the losses are about 1; about 9.4e-4 measured, ZeRO-1/2/3 alike).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.extras import DEEPSPEED, needs
from tests.resume_deepspeed_runs import launch, train
from tests.resume_runs import MORE, STEPS, ckptfix
from tests.sharded_writers import FSDP2_ON_CPU, NO_FSDP2_REASON

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not FSDP2_ON_CPU, reason=NO_FSDP2_REASON),
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason=needs("deepspeed", DEEPSPEED),
    ),
]

OTHER_WORLD = {"rtol": 1e-5, "atol": 1e-6}  # one device against 2 ranks (see the module's docstring)
BF16_RUN = {"rtol": 4e-3, "atol": 0.0}  # a bf16 run's losses against an fp32 resume (see the module's docstring)
# each group's parameters in the order DeepSpeed flattens them (tests/resume_runs.py's groups)
GROUPS = {"adamw": [["proj.weight", "mid.weight"], ["norm.weight", "norm.bias", "mid.bias", "out.bias"]],
          "sgd": [["proj.weight", "norm.weight", "norm.bias"], ["mid.weight", "mid.bias", "out.bias"]]}  # fmt: skip
NAMES = ["mid.bias", "mid.weight", "norm.bias", "norm.weight", "out.bias", "proj.weight"]
STAGES = (1, 2, 3)
DTYPES = ("fp32", "bf16")
# AdamW in each precision; SGD with momentum (its momentum_buffer the one per-element state, no step) in fp32
RUNS = [(stage, dtype, "adamw") for stage in STAGES for dtype in DTYPES] + [(stage, "fp32", "sgd") for stage in STAGES]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], tuple[Path, dict[str, Any]]]:
    """Each stage's and dtype's run folder, and what its rank 0 recorded (DeepSpeed's state at the save, the next
    losses)."""
    folder = tmp_path_factory.mktemp("zero")
    runs = {}
    for stage, dtype, kind in RUNS:
        run = folder / f"zero{stage}_{dtype}_{kind}"
        runs[stage, dtype, kind] = run, train(run, stage=stage, dtype=dtype, kind=kind, record=Path(f"{run}.pt"))
    return runs


def assert_resumed(got: dict[str, Any], want: dict[str, Any], *, same_world: bool, dtype: str, kind: str) -> None:
    held, was = got["held"], want["held"]
    assert sorted(held["state"]) == sorted(was["state"]) == NAMES
    for name, moments in was["state"].items():
        keys = ["exp_avg", "exp_avg_sq", "step"] if kind == "adamw" else ["momentum_buffer"]
        assert sorted(held["state"][name]) == sorted(moments) == keys, name
        for key, value in moments.items():
            assert torch.equal(held["state"][name][key], value), (name, key)
        assert kind != "adamw" or float(moments["step"]) == STEPS, name
    assert held["groups"] == was["groups"]
    assert held["scheduler"] == was["scheduler"]  # the client's LR schedule goes on where the engine left it
    assert torch.equal(held["draws"], was["draws"])  # client_state's random stream, carried
    assert held["progress"] == was["progress"] == [STEPS, 1]  # the engine's global_steps, client_state's epoch
    losses, expected = torch.tensor(got["losses"]), torch.tensor(want["losses"])
    assert len(losses) == MORE
    if dtype == "bf16":
        torch.testing.assert_close(losses, expected, **BF16_RUN)
    elif same_world:
        assert torch.equal(losses, expected)
    else:
        torch.testing.assert_close(losses, expected, **OTHER_WORLD)


@pytest.mark.parametrize(("stage", "dtype", "kind"), RUNS)
@pytest.mark.parametrize("setup", ["single", "ddp", "fsdp2"])
def test_zero_run_resumes_elsewhere(stage: int, dtype: str, kind: str, setup: str, zero_runs: dict[Any, Any],
                                    tmp_path: Path) -> None:  # fmt: skip
    run, recorded = zero_runs[stage, dtype, kind]
    out = f"{tmp_path / 'fsdp2_run'}/" if setup == "fsdp2" else str(tmp_path / "plain.pt")
    said = ckptfix("convert", run, out, "--optimizer", "-v")
    if setup == "fsdp2":
        assert "keyed by parameter name (set_optimizer_state_dict's form), names from its param_groups' " \
               "param_names" in said  # fmt: skip
    else:
        assert "keyed by" not in said  # the index form, as consolidated
        groups = torch.load(out, weights_only=True)["optimizer"]["param_groups"]
        names = [g["param_names"] for g in groups]
        assert names == GROUPS[kind], names
    resumed = launch(setup, path=out, out=tmp_path / "resumed.pt", kind=kind)
    assert_resumed(resumed, recorded, same_world=setup != "single", dtype=dtype, kind=kind)
