"""ckptfix.loading.factory: build_model from a ``package.module:factory`` spec and JSON keyword arguments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptfix.loading.factory import ModelSpecError, build_model, call_factory
from tests.models import SmallNet


def test_build_model_from_a_spec() -> None:
    model = build_model("torch.nn:Linear", kwargs='{"in_features": 2, "out_features": 3}')
    assert isinstance(model, nn.Linear) and model.weight.shape == (3, 2)
    assert isinstance(build_model("tests.models:small_net", kwargs={"classes": 5}), SmallNet)
    for spec, kwargs, argument, match in [
        ("torch.nn.Linear", None, "spec", r"build_model\(spec='torch.nn.Linear'\): expected package.module:factory"),
        ("no_such_pkg_x:f", None, "spec", "cannot import 'no_such_pkg_x'.*run from the folder that holds it or add"),
        ("torch.nn:Nope", None, "spec", "has no attribute 'Nope'"),
        ("torch.nn:Linear", "{bad", "kwargs", r"build_model\(kwargs='\{bad'\): not valid JSON"),
        ("torch.nn:Linear", "[1]", "kwargs", "expected a JSON object"),
        ("torch.nn:Linear", None, "spec", "calling 'Linear' failed: TypeError"),
        ("tests.models:inputs", '{"rank": 0}', "spec", "returned Tensor, not a torch.nn.Module"),
        ("builtins:exit", None, "spec", r"calling 'exit' failed: it exited \(SystemExit: None\) instead of"),
    ]:
        with pytest.raises(ModelSpecError, match=match) as caught:
            build_model(spec, kwargs=kwargs)
        assert caught.value.argument == argument and "--" not in str(caught.value)  # library terms, not flags


def test_build_model_searches_a_folder_last_and_only_while_building(tmp_path: Path) -> None:
    (tmp_path / "ckptfix_test_factory.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(2, 3)\n"
    )
    (tmp_path / "torch.py").write_text("raise RuntimeError('the installed torch must win')\n")
    path_before = list(sys.path)
    with pytest.raises(ModelSpecError, match=r"cannot import 'ckptfix_test_factory'.*to sys.path or PYTHONPATH$"):
        build_model("ckptfix_test_factory:build", search_path=None)
    assert isinstance(build_model("ckptfix_test_factory:build", search_path=tmp_path), nn.Linear)
    assert sys.path == path_before
    (tmp_path / "ckptfix_test_broken.py").write_text("raise ValueError('no')\n")
    with pytest.raises(ModelSpecError, match="importing 'ckptfix_test_broken' failed: ValueError: no"):
        build_model("ckptfix_test_broken:f", search_path=tmp_path)
    (tmp_path / "ckptfix_test_exits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ModelSpecError, match=r"importing 'ckptfix_test_exits' failed: it exited \(SystemExit: 0\)"):
        build_model("ckptfix_test_exits:f", search_path=tmp_path)


def test_build_model_on_the_meta_device_allocates_nothing() -> None:
    model = build_model("tests.models:SmallNet", device="meta")
    assert isinstance(model, SmallNet)
    assert all(t.is_meta for t in model.state_dict().values())
    assert set(model.state_dict()) == set(SmallNet().state_dict())
    assert not any(t.is_meta for t in build_model("tests.models:SmallNet").state_dict().values())


def test_the_current_folder_is_searched_by_default_for_any_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for every MOD:FACTORY (--model, and any other): the folder the process runs in is searched last."""
    (tmp_path / "ckptfix_test_here.py").write_text(
        "import torch\n\ndef adam(params, lr):\n    return torch.optim.Adam(params, lr=lr)\n"
    )
    monkeypatch.chdir(tmp_path)
    params = [nn.Parameter(torch.ones(2))]
    optimizer = call_factory("ckptfix_test_here:adam", params, kwargs='{"lr": 0.5}')
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == 0.5
    with pytest.raises(ModelSpecError, match=r"^call_factory\(spec='ckptfix_test_here:adam'\): calling 'adam' failed"):
        call_factory("ckptfix_test_here:adam", kwargs={"lr": 0.5})
    with pytest.raises(ModelSpecError, match=r"^build_model\(spec='ckptfix_test_here:adam'\): calling 'adam' failed"):
        build_model("ckptfix_test_here:adam")


@pytest.mark.parametrize("command", ["validate", "validate-json", "merge"])
def test_a_factory_that_exits_is_an_error_of_the_factory(rank_files: list[Path], tmp_path: Path, command: str) -> None:
    """``--model builtins:exit`` (or a factory calling ``sys.exit(0)``) exited 0 having said nothing."""
    from click.testing import CliRunner

    from ckptfix.cli import cli

    out = tmp_path / "merged.pt"
    args = {
        "validate": ["validate", str(rank_files[0]), "--model", "builtins:exit"],
        "validate-json": ["validate", str(rank_files[0]), "--model", "builtins:exit", "--json"],
        "merge": ["merge", *map(str, rank_files), "-o", str(out), "--model", "builtins:exit"],
    }[command]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "builtins:exit" in result.output and "exited (SystemExit: None)" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()
