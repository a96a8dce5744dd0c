"""Optimizer state between its two forms (ckptfix.optim_form): keyed by index (``optimizer.state_dict()``) and by
parameter name (``get_optimizer_state_dict``), through ``convert`` into and out of DCP folders.

Every optimizer here is a real one after real steps; the name-keyed form is compared with what torch's own
``get_optimizer_state_dict`` returns for the same model and optimizer.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner, Result
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import MismatchError
from ckptfix.optim_form import to_indices, to_names
from ckptfix.torchcompat import version
from ckptfix.trainer.model import build_model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# an optimizer built from named_parameters() (its groups record param_names): torch 2.6 on
NAMED = pytest.param(True, marks=pytest.mark.skipif(version(torch) < (2, 6), reason=(
    f"torch {torch.__version__}: optimizers take named_parameters() (param_names) from torch 2.6 on")))  # fmt: skip


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


class Tied(nn.Module):
    """An embedding tied to the output head, a LayerNorm and a BatchNorm (running statistics: buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.ln(self.emb(x))))


def tied() -> nn.Module:
    torch.manual_seed(0)
    return Tied()


def trained(optim: str, *, named: bool, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A :class:`Tied` model and its optimizer after ``steps``: two param groups (the embedding; the norms),
    built from ``named_parameters()`` (the groups record ``param_names``) or from parameters alone."""
    model = tied()
    params = list(model.named_parameters())
    groups: list[Any] = [params[:1], params[1:]]
    if not named:
        groups = [[p for _, p in g] for g in groups]
    if optim == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}], lr=1e-2
        )
    else:
        opt = torch.optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": 0.05}], lr=0.1, momentum=0.9)
    for step in range(steps):
        torch.manual_seed(step)
        opt.zero_grad()
        model(torch.randint(0, 10, (8,))).square().mean().backward()
        opt.step()
    return model, opt


def assert_bound(opt: torch.optim.Optimizer, model: nn.Module, want: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every parameter's state in ``opt`` is ``torch.equal`` to ``want[i]`` (i: its index in ``opt``)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.state) == len(want) == len(params)
    for i, p in enumerate(params):
        got = opt.state[p]
        assert sorted(got) == sorted(want[i]), i
        for key, value in want[i].items():
            assert torch.equal(got[key], value), (i, key)


# -- the pure transform --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("named", [NAMED, False])
def test_names_are_what_get_optimizer_state_dict_returns(optim: str, named: bool) -> None:
    model, opt = trained(optim, named=named)
    osd = opt.state_dict()
    from ckptfix.formats.records import identity
    from ckptfix.optim_form import entry_parameters

    params = entry_parameters(model.state_dict(), count=5, identity=identity, entry="model")
    assert not isinstance(params, str)
    names, note = to_names(osd, params, where="ckpt['optimizer']")
    want = get_optimizer_state_dict(model, opt)
    assert list(names["state"]) == list(want["state"]) == ["emb.weight", "ln.weight", "ln.bias", "bn.weight", "bn.bias"]
    assert [g["params"] for g in names["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for fqn, state in want["state"].items():
        assert sorted(names["state"][fqn]) == sorted(state)
        assert all(torch.equal(names["state"][fqn][k], v) for k, v in state.items())
    origin = "param_names" if named else "model entry 'model' (its running statistics left out)"
    assert origin in note
    back = to_indices(names, where="x")
    assert list(back["state"]) == list(osd["state"]) and back["param_groups"] == osd["param_groups"]


def test_a_shape_that_does_not_fit_is_refused_by_key() -> None:
    _, opt = trained("adamw", named=False)
    osd = opt.state_dict()
    from ckptfix.optim_form import Parameters

    swapped = Parameters(("emb.weight", "ln.weight", "ln.bias", "bn.weight", "bn.bias"),
                         ((4,), (4,), (4,), (4,), (10, 4)), "--model m:f")  # fmt: skip
    with pytest.raises(MismatchError, match=r"ckpt\.state\.0\.exp_avg: shape \[10, 4\], but parameter 'emb\.weight'"):
        to_names(osd, swapped, where="ckpt")
    short = Parameters(("emb.weight",), ((10, 4),), "--model m:f")
    with pytest.raises(MismatchError, match="ckpt: param_groups list 5 parameters but --model m:f has 1"):
        to_names(osd, short, where="ckpt")


# -- the README's round trip: .pt -> DCP -> .pt -----------------------------------------------------------------


def _resume(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """What the trainer does on resume: the model and SGD built, then both state dicts loaded."""
    full = torch.load(path, weights_only=True)
    model = build_model()
    model.load_state_dict(full["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(full["optimizer"])
    return model, opt


@pytest.mark.parametrize("form", [[], ["--optimizer-form", "indices"], ["--optimizer-form", "names"]])
def test_the_dcp_round_trip_keeps_momentum(tmp_path: Path, form: list[str]) -> None:
    src = FIXTURES / "ddp_wrapped.pt"
    assert run("convert", src, f"{tmp_path / 'run_dcp'}/", *form).exit_code == 0
    done = run("convert", f"{tmp_path / 'run_dcp'}/", tmp_path / "full.pt", "-v")
    assert done.exit_code == 0, done.output
    said = "keyed by index" if form != ["--optimizer-form", "indices"] else "put back as the ints"
    assert said in done.stderr
    model, opt = _resume(tmp_path / "full.pt")
    want = torch.load(src, weights_only=True)["optimizer"]["state"]
    assert_bound(opt, model, want)


def test_the_default_dcp_folder_holds_names(tmp_path: Path) -> None:
    done = run("convert", FIXTURES / "ddp_wrapped.pt", f"{tmp_path / 'run_dcp'}/", "-v")
    assert "keyed by parameter name (set_optimizer_state_dict's form)" in done.stderr
    keys = dcp.FileSystemReader(str(tmp_path / "run_dcp")).read_metadata().state_dict_metadata
    assert "optimizer.state.features.0.weight.momentum_buffer" in keys
    assert not any(k.startswith("optimizer.state.0.") for k in keys)


def test_ckptfix_load_of_an_index_keyed_dcp_folder_gives_int_keys(tmp_path: Path) -> None:
    run("convert", FIXTURES / "ddp_wrapped.pt", f"{tmp_path / 'run_dcp'}/", "--optimizer-form", "indices")
    loaded = ckptfix.load(tmp_path / "run_dcp")["optimizer"]
    assert list(loaded["state"]) == list(range(11)) == loaded["param_groups"][0]["params"]


def test_keys_that_cannot_be_proven_stay_strings_and_the_loss_is_said(tmp_path: Path) -> None:
    model, opt = trained("sgd", named=False)
    osd = opt.state_dict()
    osd["param_groups"][1]["params"] = osd["param_groups"][1]["params"][:-1]  # a parameter the groups no longer name
    dcp.save({"model": model.state_dict(), "optimizer": osd}, checkpoint_id=str(tmp_path / "d"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = ckptfix.load(tmp_path / "d")["optimizer"]
    assert list(loaded["state"]) == [0, 1, 2, 3, "4"]
    assert any("1 state key(s) (e.g. '4') are not parameters" in str(w.message) for w in caught)
    done = run("convert", tmp_path / "d", tmp_path / "out.pt")  # said whatever the verbosity
    assert done.exit_code == 0
    assert "optimizer.load_state_dict binds none of them, so a resume loses their moments and steps" in done.stderr
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)["optimizer"]["state"]) == [0, 1, 2, 3, "4"]


def test_names_into_a_pt_and_back(tmp_path: Path) -> None:
    model, opt = trained("adamw", named=False)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    assert run("convert", tmp_path / "a.pt", tmp_path / "names.pt", "--optimizer-form", "names").exit_code == 0
    names = torch.load(tmp_path / "names.pt", weights_only=True)["optimizer"]
    assert list(names["state"]) == list(get_optimizer_state_dict(model, opt)["state"])
    assert run("convert", tmp_path / "names.pt", tmp_path / "back.pt").exit_code == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)["optimizer"]
    fresh, fresh_opt = trained("adamw", named=False, steps=0)
    fresh.load_state_dict(torch.load(tmp_path / "back.pt", weights_only=True)["model"])
    fresh_opt.load_state_dict(back)
    assert_bound(fresh_opt, fresh, opt.state_dict()["state"])


def test_a_model_the_file_cannot_say_is_given_with_model(tmp_path: Path) -> None:
    model, opt = trained("sgd", named=False)
    state = model.state_dict()
    state["pos"] = torch.zeros(3)  # a float buffer only the model's code knows is not a parameter
    torch.save({"model": state, "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    refused = run("convert", tmp_path / "a.pt", f"{tmp_path / 'd'}/", "--optimizer-form", "names")
    assert refused.exit_code != 0 and "pass --model MOD:FACTORY" in refused.output
    assert not (tmp_path / "d").exists()
    default = run("convert", tmp_path / "a.pt", f"{tmp_path / 'd'}/", "-v")
    assert default.exit_code == 0 and "kept keyed by index" in default.stderr
    given = run("convert", tmp_path / "a.pt", f"{tmp_path / 'e'}/", "--optimizer-form", "names",
                "--model", "tests.test_optim_form:tied")  # fmt: skip
    assert given.exit_code == 0, given.output
    keys = dcp.FileSystemReader(str(tmp_path / "e")).read_metadata().state_dict_metadata
    assert "optimizer.state.emb.weight.momentum_buffer" in keys


def test_a_step_tensor_shared_between_parameters_is_copied_apart_in_a_pt(tmp_path: Path) -> None:
    # FSDP1 keeps one step per flat parameter, shared by its parameters' entries (tests/test_resume.py has the real
    # files); a plain AdamW adds 1 to each entry's step in place, so it would count a shared one several times
    model, opt = trained("adamw", named=False)
    osd = opt.state_dict()
    for i in range(1, 5):
        osd["state"][i]["step"] = osd["state"][0]["step"]
    torch.save({"model": model.state_dict(), "optimizer": osd}, tmp_path / "a.pt")
    done = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "-v")
    assert done.exit_code == 0
    assert "4 scalar state tensor(s) (step) shared between parameters copied apart" in done.stderr
    back = torch.load(tmp_path / "b.pt", weights_only=True)["optimizer"]["state"]
    assert len({s["step"].untyped_storage().data_ptr() for s in back.values()}) == 5
    assert all(torch.equal(back[i]["step"], osd["state"][0]["step"]) for i in range(5))


@pytest.mark.parametrize("wrapper", ["data_parallel", "compile"])
@pytest.mark.parametrize("named", [NAMED, False])
def test_a_wrapped_run_resumes_on_the_plain_model_by_name(wrapper: str, named: bool, tmp_path: Path) -> None:
    """A run trained under ``nn.DataParallel`` or ``torch.compile`` saves ``module.``/``_orig_mod.`` keys (and,
    built from ``named_parameters()``, such ``param_names``): its DCP folder holds the plain model's names, which
    ``set_state_dict`` binds on the unwrapped model (what an FSDP2 job does per rank)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = tied()
    wrapped = nn.DataParallel(model) if wrapper == "data_parallel" else torch.compile(model, backend="eager")
    params = list(wrapped.named_parameters())
    assert params[0][0] in ("module.emb.weight", "_orig_mod.emb.weight")
    opt = torch.optim.AdamW([{"params": params[:1] if named else [p for _, p in params[:1]], "weight_decay": 0.1},
                             {"params": params[1:] if named else [p for _, p in params[1:]]}], lr=1e-2)  # fmt: skip
    for step in range(3):
        torch.manual_seed(step)
        opt.zero_grad()
        wrapped(torch.randint(0, 10, (8,))).square().mean().backward()
        opt.step()
    model.cpu()  # DataParallel moves the model to the first GPU where there is one
    torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "run.pt")
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'dcp'}/", "-v")
    assert done.exit_code == 0, done.output
    assert "keyed by parameter name (set_optimizer_state_dict's form)" in done.stderr
    fresh, fresh_opt = trained("adamw", named=False, steps=0)
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    got, want = fresh.state_dict(), model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert_bound(
        fresh_opt, fresh, {i: {k: v.cpu() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    )
