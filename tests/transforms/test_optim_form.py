"""Optimizer state between its two forms (ckptfix.transforms.optim_form): keyed by index (``optimizer.state_dict()``)
and by
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
from ckptfix.errors import UsageError
from ckptfix.torchcompat import version
from ckptfix.trainer.model import build_model
from ckptfix.transforms.optim_form import to_indices, to_names

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HERE = "tests.transforms.test_optim_form"  # this module, whose functions --model and --optimizer-factory name
# the run's own model and optimizer functions, which name the parameters of an optimizer of two unnamed groups
ADAMW = ["--model", f"{HERE}:tied", "--optimizer-factory", f"{HERE}:adamw"]
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


def adamw(model: nn.Module, *, named: bool = False) -> torch.optim.Optimizer:
    """Two param groups (the embedding; the norms), built from ``named_parameters()`` (the groups record
    ``param_names``) or from parameters alone: what ``--optimizer-factory tests.transforms.test_optim_form:adamw``
    builds."""
    groups = _groups(model, named=named)
    return torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}],
                             lr=1e-2)  # fmt: skip


def sgd(model: nn.Module, *, named: bool = False) -> torch.optim.Optimizer:
    groups = _groups(model, named=named)
    return torch.optim.SGD([{"params": groups[0]}, {"params": groups[1], "lr": 0.05}], lr=0.1, momentum=0.9)


def _groups(model: nn.Module, *, named: bool) -> list[Any]:
    params = list(model.named_parameters())
    groups: list[Any] = [params[:1], params[1:]]
    return groups if named else [[p for _, p in g] for g in groups]


def trained(optim: str, *, named: bool, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A :class:`Tied` model and its optimizer (:func:`adamw`, :func:`sgd`) after ``steps``."""
    model = tied()
    opt = {"adamw": adamw, "sgd": sgd}[optim](model, named=named)
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
    from ckptfix.conversion.files import optimizer_parameters

    params = optimizer_parameters(f"{HERE}:tied", f"{HERE}:{optim}")
    names, note = to_names(osd, params, where="ckpt['optimizer']")
    want = get_optimizer_state_dict(model, opt)
    assert list(names["state"]) == list(want["state"]) == ["emb.weight", "ln.weight", "ln.bias", "bn.weight", "bn.bias"]
    assert [g["params"] for g in names["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for fqn, state in want["state"].items():
        assert sorted(names["state"][fqn]) == sorted(state)
        assert all(torch.equal(names["state"][fqn][k], v) for k, v in state.items())
    origin = "param_names" if named else f"--optimizer-factory tests.transforms.test_optim_form:{optim}"
    assert origin in note
    back = to_indices(names, where="x")
    assert list(back["state"]) == list(osd["state"]) and back["param_groups"] == osd["param_groups"]


def test_an_optimizer_that_does_not_fit_is_refused_naming_the_group() -> None:
    _, opt = trained("adamw", named=False)
    osd = opt.state_dict()
    from ckptfix.transforms.optim_form import Parameters

    names = ("emb.weight", "ln.weight", "ln.bias", "bn.weight", "bn.bias")
    shapes = ((10, 4), (4,), (4,), (4,), (4,))
    swapped = Parameters(names, ((4,), *shapes[1:4], (10, 4)), "--optimizer-factory m:f", groups=(1, 4))
    with pytest.raises(UsageError, match=r"ckpt\.state\.0\.exp_avg: shape \[10, 4\], but parameter 'emb\.weight' "
                       r"\(--optimizer-factory m:f, param group 0\) has \[4\]"):  # fmt: skip
        to_names(osd, swapped, where="ckpt")
    other = Parameters(names, shapes, "--optimizer-factory m:f", groups=(2, 3))
    with pytest.raises(UsageError, match="ckpt: param group 0 holds 1 parameters, but group 0 of --optimizer-f"):
        to_names(osd, other, where="ckpt")
    with pytest.raises(UsageError, match=r"ckpt: 2 param group\(s\), but --optimizer-factory m:f builds 1"):
        to_names(osd, Parameters(names, shapes, "--optimizer-factory m:f", groups=(5,)), where="ckpt")
    with pytest.raises(UsageError, match="ckpt: its 2 param groups record no param_names"):
        to_names(osd, Parameters(names, shapes, "model entry 'model'"), where="ckpt")  # the model's order: unproven


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
    done = run("convert", tmp_path / "a.pt", tmp_path / "names.pt", "--optimizer-form", "names", *ADAMW)
    assert done.exit_code == 0, done.output
    names = torch.load(tmp_path / "names.pt", weights_only=True)["optimizer"]
    assert list(names["state"]) == list(get_optimizer_state_dict(model, opt)["state"])
    assert run("convert", tmp_path / "names.pt", tmp_path / "back.pt").exit_code == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)["optimizer"]
    fresh, fresh_opt = trained("adamw", named=False, steps=0)
    fresh.load_state_dict(torch.load(tmp_path / "back.pt", weights_only=True)["model"])
    fresh_opt.load_state_dict(back)
    assert_bound(fresh_opt, fresh, opt.state_dict()["state"])


def test_a_model_the_file_cannot_say_is_given_with_model(tmp_path: Path) -> None:
    model = tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # one group: index i is the model's i-th
    model(torch.randint(0, 10, (8,))).square().mean().backward()
    opt.step()
    state = model.state_dict()
    state["pos"] = torch.zeros(3)  # a float buffer only the model's code knows is not a parameter
    torch.save({"model": state, "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    refused = run("convert", tmp_path / "a.pt", f"{tmp_path / 'd'}/", "--optimizer-form", "names")
    assert refused.exit_code == 2 and "pass --model MOD:FACTORY" in refused.output
    assert not (tmp_path / "d").exists()
    default = run("convert", tmp_path / "a.pt", f"{tmp_path / 'd'}/")
    assert default.exit_code == 0 and "stays keyed by index" in default.stderr
    given = run("convert", tmp_path / "a.pt", f"{tmp_path / 'e'}/", "--optimizer-form", "names",
                "--model", "tests.transforms.test_optim_form:tied")  # fmt: skip
    assert given.exit_code == 0, given.output
    assert "names from --model tests.transforms.test_optim_form:tied, in the model's parameter order" in given.stderr
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
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'dcp'}/", "-v", *([] if named else ADAMW))
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


# -- optimizers whose groups record no param_names: names only where proven -------------------------------------

GPT = ["--model", "tests.nanogpt:build", "--optimizer-factory", "tests.nanogpt:configure_optimizers"]


class Twin(nn.Module):
    """Two layers of one shape: an optimizer's groups that swap them fit the model's shapes either way."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())  # type: ignore[no-any-return]


def twin() -> Twin:
    torch.manual_seed(0)
    return Twin()


def twin_sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Groups not in the model's order: ``b`` first (its own rate), then ``a``."""
    assert isinstance(model, Twin)
    return torch.optim.SGD([{"params": [model.b.weight], "lr": 0.1}, {"params": [model.a.weight], "lr": 0.01}],
                           momentum=0.9)  # fmt: skip


def _twin_run(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = twin()
    opt = twin_sgd(model)
    for step in range(2):
        torch.manual_seed(step)
        opt.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    for group in opt.param_groups:  # a schedule's rates, which the resumed run must take from the checkpoint
        group["lr"] /= 2
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return model, opt


def _resumed_by_name(folder: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """What an FSDP2 job does per rank (here in one process): ``dcp.load`` into ``get_state_dict``'s, then
    ``set_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def assert_same_by_name(
    got: tuple[nn.Module, torch.optim.Optimizer], want: tuple[nn.Module, torch.optim.Optimizer]
) -> None:
    """Each parameter's state in ``got`` is ``torch.equal`` to the state of the parameter of the same name in
    ``want``, and each group's hyperparameters are ``want``'s."""
    (model, opt), (model0, opt0) = got, want
    was = {name: opt0.state[p] for name, p in model0.named_parameters()}
    for name, p in model.named_parameters():
        assert sorted(opt.state[p]) == sorted(was[name]), name
        assert all(torch.equal(opt.state[p][k], v) for k, v in was[name].items()), name
    hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]
    assert hyper == [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt0.param_groups]


def _untouched(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("run_of", ["nanogpt", "twin"])
def test_groups_that_record_no_names_stay_by_index_and_the_flag_is_said(run_of: str, tmp_path: Path) -> None:
    """nanoGPT's two groups (shapes that differ) and two groups of equal shapes not in the model's order: the model's
    order proves nothing, so the default output says the optimizer stays keyed by index and which flag names it."""
    from tests import nanogpt

    nanogpt.train(tmp_path / "run.pt") if run_of == "nanogpt" else _twin_run(tmp_path / "run.pt")
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'out'}/")
    assert done.exit_code == 0, done.output
    said = [line for line in done.stderr.splitlines() if "stays keyed by index" in line]
    assert len(said) == 1 and "--optimizer-factory MOD:FN" in said[0] and "--model MOD:FACTORY" in said[0]
    assert said[0].startswith(f"ckptfix: {tmp_path / 'run.pt'}['optimizer']: stays keyed by index")
    assert "its 2 param groups record no param_names" in said[0]
    keys = dcp.FileSystemReader(str(tmp_path / "out")).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer.state.0.") for k in keys)  # as optimizer.state_dict() keyed it
    assert not any(k.startswith(("optimizer.state.a.", "optimizer.state.wte.")) for k in keys)


NAMES = ["--optimizer-form", "names"]


@pytest.mark.parametrize(
    "flags", [NAMES, [*NAMES, "--model", "tests.nanogpt:build"], ["--model", "tests.nanogpt:build"]]
)
def test_names_asked_for_groups_that_record_none_is_a_usage_error(flags: list[str], tmp_path: Path) -> None:
    """``--optimizer-form names``, or ``--model`` given to name them (the model's order proves nothing here)."""
    from tests import nanogpt

    nanogpt.train(tmp_path / "run.pt")
    before = _untouched(tmp_path / "run.pt")
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'out'}/", *flags)
    assert done.exit_code == 2, done.output
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"ckptfix: error: {tmp_path / 'run.pt'}['optimizer']: its 2 param groups")
    assert "pass --optimizer-factory MOD:FN" in done.stderr
    assert not (tmp_path / "out").exists() and _untouched(tmp_path / "run.pt") == before


@pytest.mark.parametrize("run_of", ["nanogpt", "twin"])
def test_the_runs_optimizer_function_names_each_group_exactly(run_of: str, tmp_path: Path) -> None:
    from tests import nanogpt

    if run_of == "nanogpt":
        source, flags = nanogpt.train(tmp_path / "run.pt"), GPT
        fresh = nanogpt.build(seed=9)
        fresh_opt = nanogpt.configure_optimizers(fresh)
    else:
        source = _twin_run(tmp_path / "run.pt")
        flags = ["--model", f"{HERE}:twin", "--optimizer-factory", f"{HERE}:twin_sgd"]
        fresh = twin()
        fresh_opt = twin_sgd(fresh)
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'out'}/", *flags)
    assert done.exit_code == 0, done.output
    assert "stays keyed by index" not in done.stderr
    _resumed_by_name(tmp_path / "out", fresh, fresh_opt)
    assert_same_by_name((fresh, fresh_opt), source)
    if run_of == "nanogpt":  # the rate the run's schedule had reached, each group's decay: the checkpoint's
        assert [(g["lr"], g["weight_decay"]) for g in fresh_opt.param_groups] == [(3e-4, 0.1), (3e-4, 0.0)]


@pytest.mark.parametrize(
    ("factory", "said"),
    [
        (f"{HERE}:adamw", "param group 0 holds 10 parameters, but group 0 of --optimizer-factory "
                          f"{HERE}:adamw holds 1"),
        (f"{HERE}:one_group", f"2 param group(s), but --optimizer-factory {HERE}:one_group"
                              " builds 1"),
        (f"{HERE}:stranger", "param group 0 holds a tensor that is not a parameter of the model"),
        (f"{HERE}:nowhere", f"module '{HERE}' has no attribute 'nowhere'"),
    ],
)  # fmt: skip
def test_an_optimizer_function_that_does_not_fit_is_refused(factory: str, said: str, tmp_path: Path) -> None:
    from tests import nanogpt

    nanogpt.train(tmp_path / "run.pt")
    flags = ["--model", "tests.nanogpt:build", "--optimizer-factory", factory]
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'out'}/", *flags)
    assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1, done.output
    assert said in done.stderr and not (tmp_path / "out").exists()


def one_group(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters())


def stranger(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(nn.Linear(2, 2).parameters())


def test_an_optimizer_function_needs_the_model(tmp_path: Path) -> None:
    from tests import nanogpt

    nanogpt.train(tmp_path / "run.pt")
    done = run("convert", tmp_path / "run.pt", f"{tmp_path / 'out'}/", *GPT[2:])
    assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1, done.output
    assert "--optimizer-factory 'tests.nanogpt:configure_optimizers' builds the optimizer for a model: pass " \
           "--model 'MOD:FACTORY' too" in done.stderr  # fmt: skip


def test_one_group_is_named_in_the_models_order_and_says_so(tmp_path: Path) -> None:
    done = run("convert", FIXTURES / "ddp_wrapped.pt", f"{tmp_path / 'out'}/")
    assert done.exit_code == 0, done.output
    assert ("['optimizer']: keyed by parameter name (set_optimizer_state_dict's form), names from model entry "
            "'model' (its running statistics left out), in the model's parameter order (its one param group holds "
            "every parameter)") in done.stderr  # fmt: skip
