"""Training goes on after a move: saved on one setup, converted by ``ckptfix convert``, resumed on another.

For each pair (one device, DDP, FSDP2; 1 rank and 2), the optimizer state the resumed run holds is ``torch.equal``
to what the first run held for every parameter, moment and step, and the next ``MORE`` steps give the first run's
losses: bit for bit where both runs have the same world size. Where they differ, each step's gradient is a mean
over the global batch summed in another order (8 rows in one process; 4 rows on each of 2 ranks, then averaged),
so float32 rounding differs by about one unit in the last place; ten AdamW steps carry that along, so the losses
are compared within rtol 1e-5 (a step changes the loss by about 1e-2), the tolerance written below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.resume_runs import DCP, MORE, OPTIMIZERS, SCALER, ckptfix, launch, rank_file, run_ranks
from tests.sharded_writers import FSDP2_ON_CPU, NO_FSDP2_REASON

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not FSDP2_ON_CPU, reason=NO_FSDP2_REASON)]

# Another world size sums each gradient in another order (see the module's docstring).
OTHER_WORLD = {"rtol": 1e-5, "atol": 1e-6}
WORLD = {"single": 1, "ddp": 2, "fsdp2": 2, "fsdp1": 2, "fsdp1local": 2, "ddp_dcp": 2}


def _saved(setup: str, folder: Path) -> dict[str, str]:
    # a DCP folder's name ends in / for convert; FSDP1's ranks add -rank<R>.pt to theirs
    suffix = {"fsdp2": "/", "ddp_dcp": "/", "fsdp1": "", "fsdp1local": ""}.get(setup, ".pt")
    return {kind: f"{folder / f'{setup}-{kind}'}{suffix}" for kind in OPTIMIZERS}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, str], dict[str, Any]]]:
    """Each setup's run: where it saved, and what it recorded (state held at the save, the next losses)."""
    folder = tmp_path_factory.mktemp("trained")
    runs = {}
    for setup in WORLD:
        paths = _saved(setup, folder)
        runs[setup] = paths, launch(setup, "train", world=WORLD[setup], paths=paths, out=folder / f"{setup}.pt")
    return runs


def assert_resumed(got: dict[str, Any], want: dict[str, Any], *, same_world: bool) -> None:
    for kind in OPTIMIZERS:
        held, was = got[kind]["held"], want[kind]["held"]
        assert sorted(held["state"]) == sorted(was["state"]) == ["mid.bias", "mid.weight", "norm.bias",
                                                                 "norm.weight", "out.bias", "proj.weight"]  # fmt: skip
        for name, moments in was["state"].items():
            assert sorted(held["state"][name]) == sorted(moments), (kind, name)
            for key, value in moments.items():
                assert torch.equal(held["state"][name][key], value), (kind, name, key)
        assert held["groups"] == was["groups"], kind
        assert held["scheduler"] == was["scheduler"], kind  # the LR schedule goes on where it was
        assert torch.equal(held["draws"], was["draws"]), kind  # and so does the random stream
        assert held["scaler"] == was["scaler"] == SCALER, kind  # and the GradScaler's scale and its growth count
        losses, expected = torch.tensor(got[kind]["losses"]), torch.tensor(want[kind]["losses"])
        assert len(losses) == MORE
        if same_world:
            assert torch.equal(losses, expected), kind
        else:
            torch.testing.assert_close(losses, expected, **OTHER_WORLD)


PAIRS = [("single", "fsdp2"), ("ddp", "fsdp2"), ("fsdp2", "single"), ("fsdp2", "ddp"), ("ddp", "single"),
         ("single", "ddp"), ("fsdp1", "fsdp2"), ("fsdp1", "single"), ("fsdp1", "ddp"), ("fsdp1local", "fsdp2"),
         ("fsdp1local", "ddp"), ("ddp_dcp", "single")]  # fmt: skip


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_resume_on_another_setup(a: str, b: str, trained: dict[str, Any], tmp_path: Path) -> None:
    saved, recorded = trained[a]
    moved = _saved(b, tmp_path)
    for kind in OPTIMIZERS:
        source = saved[kind]
        if a.startswith("fsdp1"):  # its rank files merged first, the sharded moments consolidated (keyed by name)
            source = str(tmp_path / f"merged-{kind}.pt")
            # LOCAL_STATE_DICT's flat parameter is split by the model that was wrapped
            model = ["--model", "tests.resume_runs:build", "--kwargs", '{"seed": 0}'] if a == "fsdp1local" else []
            merged = ckptfix("merge", rank_file(saved[kind], 0), rank_file(saved[kind], 1), "-o", source, "--optimizer",
                             *model)  # fmt: skip
            assert "consolidated 'optimizer': FSDP1 sharded optimizer state" in merged
        # SGD's two groups record no param_names: the run's own function names their parameters for FSDP2
        sgd = ["--model", "tests.resume_runs:build", "--optimizer-factory", "tests.resume_runs:sgd"]
        named = b == "fsdp2" and kind == "sgd" and a not in DCP and not a.startswith("fsdp1")
        said = ckptfix("convert", source, moved[kind], "-v", *(sgd if named else []))
        if b == "fsdp2" and a.startswith("fsdp1"):  # FSDP.optim_state_dict keys by name already
            assert "keyed by" not in said
        elif b == "fsdp2":
            assert "keyed by parameter name (set_optimizer_state_dict's form)" in said
            assert "names from its param_groups' param_names" in said if kind == "adamw" else "--optimizer-fact" in said
        elif a in ("fsdp2", "fsdp1", "fsdp1local", "ddp_dcp"):
            assert "keyed by index (optimizer.load_state_dict's form)" in said
    resumed = launch(b, "resume", world=WORLD[b], paths=moved, out=tmp_path / "resumed.pt")
    assert_resumed(resumed, recorded, same_world=WORLD[a] == WORLD[b])


def test_a_nanogpt_run_resumes_on_fsdp2_as_resume_md_says(tmp_path: Path) -> None:
    """nanoGPT's two AdamW groups (decayed: every parameter of two or more dimensions) interleave the model's order
    and record no param_names: ``convert`` keeps them by index and names the flag; with the run's own
    ``configure_optimizers`` the FSDP2 job on 2 ranks binds every moment to its parameter, each group's rate and
    decay the checkpoint's."""
    from tests import nanogpt

    model, opt = nanogpt.train(tmp_path / "run.pt")
    assert "stays keyed by index" in ckptfix("convert", tmp_path / "run.pt", f"{tmp_path / 'by_index'}/")
    said = ckptfix("convert", tmp_path / "run.pt", f"{tmp_path / 'gpt_dcp'}/", "--model", "tests.nanogpt:build",
                   "--optimizer-factory", "tests.nanogpt:configure_optimizers")  # fmt: skip
    assert "stays keyed by index" not in said
    out = tmp_path / "resumed.pt"
    args = (2, str(tmp_path / "store"), str(tmp_path / "gpt_dcp"), str(out))
    held = run_ranks(nanogpt.resume_fsdp2, args, in_process=False, world=2, out=out)
    want = {name: opt.state[p] for name, p in model.named_parameters()}
    assert sorted(held["state"]) == sorted(want)
    for name, moments in want.items():
        assert sorted(held["state"][name]) == sorted(moments), name
        for key, value in moments.items():
            assert torch.equal(held["state"][name][key], value), (name, key)
    assert [(g["lr"], g["weight_decay"]) for g in held["groups"]] == [(nanogpt.SAVED_LR, 0.1), (nanogpt.SAVED_LR, 0.0)]
