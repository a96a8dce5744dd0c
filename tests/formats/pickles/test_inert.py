"""ckptfix.formats.pickles.inert: globals as fresh stand-ins per file (a hostile BUILD changes nothing shared), shared
references walked once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import FormatError, UnsafeCheckpointError
from tests import hostile
from tests.entry_points import GiB, bounded_cli_problems, cli_op, run_ops

# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


def test_case2_build_laundering_and_process_poisoning(tmp_path: Path) -> None:
    """Hostile BUILDs on allowlisted globals, then, in the same process, ordinary files through the fast path."""
    files = {
        "launder": hostile.torch_zip_file(hostile.laundering_pickle(), {"0": hostile.floats(1.0, 2.0)}),
        "rename": hostile.torch_zip_file(hostile.storage_rename_pickle(), {"0": hostile.floats(1.0, 2.0)}),
    }
    for name, data in files.items():
        (tmp_path / f"{name}.pt").write_bytes(data)
    floats_path = tmp_path / "floats.pt"
    expected = torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.float32)
    torch.save({"model": {"module.w": expected}}, floats_path)
    set_path = tmp_path / "sets.pt"
    torch.save({"model": {"module.w": expected}, "cfg": {"tags": {"a", "b"}}}, set_path)

    ops: list[dict[str, Any]] = []
    for name in files:  # a hostile file, then two ordinary ones, in one process
        src, out = tmp_path / f"{name}.pt", tmp_path / f"{name}-out.pt"
        ops += [
            {"kind": "convert", "src": str(src), "dst": str(out), "fast": True},
            {"kind": "globals", "path": str(out)},
            {"kind": "convert", "src": str(floats_path), "dst": str(tmp_path / f"f-{name}.pt"), "fast": True},
            {"kind": "tensors", "path": str(tmp_path / f"f-{name}.pt")},
            {"kind": "convert", "src": str(set_path), "dst": str(tmp_path / f"s-{name}.pt"), "fast": True},
            {"kind": "globals", "path": str(tmp_path / f"s-{name}.pt")},
        ]
    results = run_ops(tmp_path, ops, timeout=120)
    from torch import _weights_only_unpickler as wo

    # a set is allowed by ckptfix on every torch, by torch only from 2.6 (its protocol-2 pickles say __builtin__.set)
    allowed = set(wo._get_allowed_globals()) | {"__builtin__.set", "builtins.set"}
    problems = []
    for i, name in enumerate(files):
        hostile_run, hostile_globals, f_run, f_tensors, s_run, s_globals = results[6 * i : 6 * i + 6]
        if hostile_run["error"] is None:
            bad = [g for g in hostile_globals.get("globals", []) if g not in allowed]
            problems.append(f"{name}: the fast path converted it; its output names {hostile_globals}")
            if bad:
                problems.append(f"{name}: ... including globals outside torch's allowlist: {bad}")
        elif hostile_run["error"] not in ("FormatError", "UnsafeCheckpointError"):
            problems.append(f"{name}: {hostile_run['error']}: {hostile_run['message']}")
        if f_run["error"] is not None or "tensors" not in f_tensors:
            problems.append(f"after {name}: a plain float32 file failed: {f_run} {f_tensors}")
        else:
            dtype, values = f_tensors["tensors"]["w"]
            if dtype != "torch.float32" or values != expected.tolist():
                problems.append(f"after {name}: PROCESS POISONED: float32 file came out as {dtype} {values}")
        if s_run["error"] is not None:
            problems.append(f"after {name}: a file with a set failed: {s_run}")
        elif any(g not in allowed for g in s_globals.get("globals", [])):
            problems.append(f"after {name}: PROCESS POISONED: a set came out as {s_globals['globals']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("which", ["launder", "rename"])
def test_case2_build_on_globals_is_refused_on_the_torch_path(tmp_path: Path, which: str) -> None:
    pkl = hostile.laundering_pickle() if which == "launder" else hostile.storage_rename_pickle()
    src = tmp_path / "x.pt"
    src.write_bytes(hostile.torch_zip_file(pkl, {"0": hostile.floats(1.0, 2.0)}))
    with pytest.raises((FormatError, UnsafeCheckpointError)):
        ckptfix.convert_file(src, tmp_path / "out.pt", fast=False)
    with pytest.raises((FormatError, UnsafeCheckpointError)):
        ckptfix.load(src)


def test_case5_shared_reference_dag_finishes_quickly(tmp_path: Path) -> None:
    data = hostile.torch_zip_file(hostile.dag_pickle(30), {"0": hostile.floats(1.0, 2.0)})
    assert len(data) < 4096
    src, copy = tmp_path / "dag.pt", tmp_path / "dag2.pt"
    src.write_bytes(data)
    copy.write_bytes(data)
    convert_ops = [
        cli_op("convert", src, tmp_path / "o1.safetensors"),
        cli_op("convert", src, tmp_path / "o2.safetensors", "--no-fast"),
        cli_op("convert", src, tmp_path / "o3.pt"),
        cli_op("convert", src, tmp_path / "o4.pt", "--no-fast"),
        cli_op("inspect", src),
    ]
    diff_ops = [cli_op("diff", src, copy)]
    results = run_ops(tmp_path, convert_ops + diff_ops, timeout=120, data_bytes=2 * GiB)
    problems = bounded_cli_problems(results[:5], convert_ops, codes=[0, 2], seconds=10, source=str(src))
    problems += bounded_cli_problems(results[5:], diff_ops, codes=[0, 1, 2], seconds=10, source=str(src))
    assert not problems, "\n".join(problems)
