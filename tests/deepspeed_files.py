"""The DeepSpeed runs of fixtures/deepspeed/ (``python -m tests.deepspeed_runs fixtures/deepspeed --fixtures``) as
the DeepSpeed tests use them: a run copied to edit, a rank file edited and saved back with DeepSpeed's globals
(safe to unpickle: the project's own files; DeepSpeed need not be installed), DeepSpeed's consolidation saved beside
each run, and the CLI's one-line refusal."""

from __future__ import annotations

import pickle
import shutil
import types
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

from ckptfix.cli import cli

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def refusal(command: str, src: Path, out: Path | None = None) -> str:
    """``ckptfix COMMAND SRC [OUT]`` refused: exit 2 and one line, which is returned; OUT not written."""
    result = run_cli(command, str(src), *([str(out)] if out else []))
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert out is None or not out.exists()
    return result.output.strip()


def expected(name: str) -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / f"{name}.expected.pt", weights_only=True)  # type: ignore[no-any-return]


def copy_run(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


class Stub:
    """Stands for a DeepSpeed class in the project's own fixtures (an enum, a loss scaler): the truth is read
    without DeepSpeed installed, as CI runs the fast tier."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class StubPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Writes a stub back under the DeepSpeed global it was read from (DeepSpeed need not be installed)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Stub):
            self.write(pickle.GLOBAL + f"{obj.ds_module}\n{obj.__name__}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


class EditUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            return type(name, (Stub,), {"ds_module": module, "__reduce__": _stub_reduce})
        return super().find_class(module, name)


def _stub_reduce(self: Any) -> tuple[Any, ...]:
    return (type(self), getattr(self, "args", ()), getattr(self, "state", None))


def edit_rank_file(path: Path, change: Any) -> None:
    """``change(tree)`` applied to one of the project's own fixture rank files, saved back by torch."""
    load = types.SimpleNamespace(Unpickler=EditUnpickler, load=pickle.load, __name__="pickle")
    tree = torch.load(path, weights_only=False, pickle_module=load)
    change(tree)
    torch.save(tree, path, pickle_module=types.SimpleNamespace(Pickler=StubPickler, __name__="pickle"))
