"""ckptfix.formats.safety.allowlist: the globals a checkpoint may name, and what the module may import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.errors import UnsafeCheckpointError
from tests.measured import ROOT
from tests.models import make_net

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
