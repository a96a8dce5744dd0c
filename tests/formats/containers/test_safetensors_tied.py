"""A tensor under two names (tied weights) written into .safetensors is stored once, and ``convert`` says so, with what
gives both names back: ``ckptfix.load`` and ``safetensors.torch.load_model`` do, ``safetensors.torch.load_file``
gives one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, load_model

import ckptfix
from ckptfix.cli import cli


def _tied() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # an output layer tied to the input embedding, as language models tie them
    return model


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


NOTE = (
    "ckptfix: tied keys written once: '1.weight' = '0.weight' (one tensor, stored once with the alias in the "
    "metadata); ckptfix.load and safetensors.torch.load_model(model, path) give both back, "
    "safetensors.torch.load_file only the first"
)


@pytest.mark.parametrize("extra", [[], ["--no-fast"], ["--dtype", "float32"]], ids=["stream", "torch", "cast"])
def test_a_tied_key_written_once_is_said_with_what_loads_it(tmp_path: Path, extra: list[str]) -> None:
    model = _tied()
    torch.save(torch.nn.DataParallel(model).state_dict(), tmp_path / "ddp.pt")
    model.cpu()  # DataParallel moves the model to the first GPU where there is one
    out = tmp_path / "model.safetensors"
    result = run("convert", tmp_path / "ddp.pt", out, *extra)
    assert result.exit_code == 0, result.output
    assert NOTE in result.output.splitlines()
    assert sorted(load_file(out)) == ["0.weight"]  # what the note warns of
    assert sorted(ckptfix.load(out)) == ["0.weight", "1.weight"]
    other = _tied()
    torch.nn.init.zeros_(other[0].weight)
    load_model(other, out)  # strict: the shared tensor fills both names
    assert torch.equal(other[1].weight, model[1].weight)


def test_shards_say_it_too_and_untied_outputs_do_not(tmp_path: Path) -> None:
    torch.save(_tied().state_dict(), tmp_path / "tied.pt")
    result = run("convert", tmp_path / "tied.pt", f"{tmp_path / 'shards'}/", "--shard-size", "100B")
    assert result.exit_code == 0 and NOTE in result.output.splitlines()
    torch.save({k: v.clone() for k, v in _tied().state_dict().items()}, tmp_path / "untied.pt")
    result = run("convert", tmp_path / "untied.pt", tmp_path / "untied.safetensors")
    assert result.exit_code == 0 and "tied keys" not in result.output
