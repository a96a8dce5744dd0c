"""ckptfix.formats.safety.allowlist: the globals a checkpoint may name, and what the module may import."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import UnsafeCheckpointError
from tests import hostile
from tests.entry_points import Expect, invoke, refused_everywhere
from tests.hostile import P
from tests.measured import ROOT
from tests.models import make_net
from tests.parity import check_parity

# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


def test_allowlist_does_not_import_the_shard_reader() -> None:
    tree = ast.parse((ROOT / "ckptfix" / "formats" / "safety" / "allowlist.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {n for n in names if n.startswith("ckptfix.formats.") and n != "ckptfix.formats.dtypes"}, names


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


def test_numpy_scalars_need_every_global_named(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "np.pt"
    torch.save({"model": make_net().state_dict(), "best_acc": np.float64(0.91)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"numpy\._core\.multiarray\.scalar.*numpy\.dtype") as info:
        ckptfix.load(path)
    needed = info.value.globals_needed
    loaded = ckptfix.load(path, allow_globals=needed)  # the first refusal named everything it takes
    assert loaded["best_acc"] == np.float64(0.91)
    with pytest.raises(UnsafeCheckpointError, match="no option allows it"):
        ckptfix.load(path, allow_globals=["builtins.__import__"])


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


@pytest.mark.parametrize("name", hostile.CODE_GLOBALS)
def test_case1_payloads_are_live(tmp_path: Path, name: str) -> None:
    """The generators are honest: the full unpickler really runs each payload (in a throwaway process)."""
    marker = tmp_path / "PWNED"
    pkl = tmp_path / "payload.pkl"
    pkl.write_bytes(P.proto(2) + hostile.payload_call(name, marker) + P.stop())
    code = "import pickle, sys\ntry:\n    pickle.loads(open(sys.argv[1], 'rb').read())\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", code, str(pkl)], cwd=tmp_path, timeout=60, check=True)
    deadline = time.monotonic() + 20  # fork_exec's child creates the file on its own time
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the {name} payload did not run even when unpickled for real"


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("name", hostile.CODE_GLOBALS)
def test_case1_code_globals_are_refused_without_advice(tmp_path: Path, name: str, container: str) -> None:
    marker = tmp_path / "PWNED"
    if container == "zip":
        data = hostile.torch_zip_file(hostile.payload_pickle(name, marker), {"0": hostile.floats(1.0, 2.0)})
    else:
        data = hostile.legacy_file(P.proto(2) + hostile.payload_call(name, marker) + P.stop())
    expect = Expect(
        UnsafeCheckpointError, contains=[name], forbid=["--allow-global", "allow_globals", "--unsafe-pickle", "unsafe="]
    )
    refused_everywhere(tmp_path, data, expect, marker=marker)


@pytest.mark.parametrize("name", hostile.CODE_GLOBALS)
def test_case1_code_globals_cannot_be_allowed(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "PWNED"
    data = hostile.torch_zip_file(hostile.payload_pickle(name, marker), {"0": hostile.floats(1.0, 2.0)})
    expect = Expect(UnsafeCheckpointError, allow=(name,), contains=["not a known-safe class", "can run code"])
    refused_everywhere(tmp_path, data, expect, marker=marker)


def test_case1_unknown_class_cannot_be_allowed(tmp_path: Path) -> None:
    config = P.call(P.glob("mypkg", "Config"), P.dct([(P.string("lr"), P.real(0.1))]))
    data = hostile.one_tensor_with("cfg", config)
    expect = Expect(UnsafeCheckpointError, allow=("mypkg.Config",), contains=["not a known-safe class"])
    refused_everywhere(tmp_path, data, expect)


def _known_safe_file(tmp_path: Path, value: Any) -> Path:
    path = tmp_path / "cfg.pt"
    torch.save({"model": {"module.w": torch.arange(3.0)}, "cfg": value}, path)
    return path


@pytest.mark.parametrize(
    "value", [Namespace(lr=0.1, arch="resnet"), pathlib.PosixPath("/runs/exp1")], ids=["Namespace", "PosixPath"]
)
def test_case1_known_safe_classes_still_load(tmp_path: Path, value: Any) -> None:
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    path = _known_safe_file(tmp_path, value)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(name)):
        ckptfix.load(path)
    refusal = invoke("convert", path, tmp_path / "refused.pt", "--no-fast")  # needs the value (inspect lists it)
    assert refusal.exit_code == 2, refusal.stderr
    assert re.search(rf"--allow-global '?{re.escape(name)}\b", refusal.stderr), refusal.stderr  # the fix, as a flag
    assert ckptfix.load(path, allow_globals=[name])["cfg"] == value
    for fast in (True, False):
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(path, out, fast=fast, allow_globals=[name])
        loaded = ckptfix.load(out, allow_globals=[name])
        assert loaded["cfg"] == value and list(loaded["model"]) == ["w"]
    for flags in ([], ["--no-fast"]):
        result = invoke("convert", path, tmp_path / "cli.pt", "--allow-global", name, *flags)
        assert result.exit_code == 0, result.stderr
        (tmp_path / "cli.pt").unlink()
    assert invoke("inspect", path, "--allow-global", name).exit_code == 0


def test_case6_sets_and_complex_numbers_in_a_config(tmp_path: Path) -> None:
    cfg = {"tags": {"a", "b"}, "frozen": 3, "z": complex(1.5, -2.0)}
    src = tmp_path / "cfg.pt"
    torch.save({"model": {"module.w": torch.arange(3.0)}, "cfg": cfg}, src)
    assert ckptfix.load(src)["cfg"] == cfg
    for fast in (True, False):
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(src, out, fast=fast)
        loaded = ckptfix.load(out)
        assert loaded["cfg"] == cfg and list(loaded["model"]) == ["w"]
    (tmp_path / "parity").mkdir()
    assert not check_parity(tmp_path / "parity", src.read_bytes(), ".pt")
    assert invoke("inspect", src).exit_code == 0
    result = invoke("convert", src, tmp_path / "cli.pt", "--allow-global", "__builtin__.set")
    assert result.exit_code == 0, result.stderr
    assert ckptfix.load(src, allow_globals=["__builtin__.set"])["cfg"] == cfg


def test_case6_python3_names_for_set_and_complex(tmp_path: Path) -> None:
    """``builtins.set``/``builtins.complex`` (torch.save writes ``__builtin__.set``): accepted on both paths."""
    tags = P.call(P.glob("builtins", "set"), P.lst(P.string("x")))
    z = P.call(P.glob("builtins", "complex"), P.real(0.0), P.real(1.0))
    src = tmp_path / "cfg.pt"
    src.write_bytes(hostile.one_tensor_with("cfg", P.dct([(P.string("tags"), tags), (P.string("z"), z)])))
    assert ckptfix.load(src)["cfg"] == {"tags": {"x"}, "z": 1j}
    (tmp_path / "parity").mkdir()
    assert not check_parity(tmp_path / "parity", src.read_bytes(), ".pt")
