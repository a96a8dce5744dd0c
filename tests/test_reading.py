"""ckptfix.reading: a checkpoint opened for reading its tensors one at a time, for inspect, diff and merge."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import CkptfixError
from tests import hostile
from tests.entry_points import GiB, bounded_cli_problems, cli_op, cli_problem, invoke, run_ops

# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


def test_case5_expanded_tensor_is_not_materialized(tmp_path: Path) -> None:
    a, b = tmp_path / "rank0.pt", tmp_path / "rank1.pt"
    a.write_bytes(hostile.expanded(1.0))
    b.write_bytes(hostile.expanded(2.0))
    ops: list[dict[str, Any]] = [
        cli_op("diff", a, b),
        cli_op("diff", a, a),
        cli_op("merge", a, b, "-o", tmp_path / "merged.pt"),
        cli_op("inspect", a),
    ]
    results = run_ops(tmp_path, ops, timeout=180, data_bytes=3 * GiB)
    problems = bounded_cli_problems(results[:2], ops[:2], codes=[0, 1, 2], seconds=20, source=str(a))
    problems += bounded_cli_problems(results[2:], ops[2:], codes=[0, 1, 2], seconds=20, source=str(a))
    peak = max(r.get("max_rss_bytes", 0) for r in results)
    if peak > 2 * GiB:
        problems.append(f"peak memory {peak / GiB:.1f} GiB")
    assert not problems, "\n".join(problems)


def _exotic(kind: str) -> Any:
    if kind == "meta":
        return {"model": {"module.w": torch.empty(3, 4, device="meta"), "module.b": torch.ones(2)}}
    layout = torch.jagged if kind == "nested-jagged" else torch.strided
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)], layout=layout)
    return {"model": {"module.w": nested, "module.b": torch.ones(2)}}


@pytest.mark.parametrize("kind", ["meta", "nested", "nested-jagged"])
def test_case5_meta_and_nested_tensors_never_crash(tmp_path: Path, kind: str) -> None:
    src = tmp_path / f"{kind}.pt"
    torch.save(_exotic(kind), src)
    problems = []
    commands: list[list[str | os.PathLike[str]]] = [
        ["inspect", src],
        ["diff", src, src],
        ["convert", src, tmp_path / "o.pt"],
        ["convert", src, tmp_path / "o-nf.pt", "--no-fast"],
        ["convert", src, tmp_path / "o.safetensors"],
        ["convert", src, tmp_path / "o-nf.safetensors", "--no-fast"],
    ]
    for args in commands:
        result = invoke(*args)
        what = " ".join(os.fspath(a) for a in args[:1] + args[3:])
        if result.exit_code not in (0, 1, 2) or (result.exit_code == 1 and args[0] != "diff"):
            problems.append(f"{what}: exit {result.exit_code}: {result.stderr[:300]!r}")
        elif result.exit_code == 2:
            found = cli_problem(result, str(src))
            if found:
                problems.append(f"{what}: {found}")
        elif args[0] == "convert":
            out = Path(args[2])
            try:
                loaded = ckptfix.load(out)
                if list(loaded["model"]) != ["w", "b"] or not torch.equal(loaded["model"]["b"], torch.ones(2)):
                    problems.append(f"{what}: wrote {loaded}")
            except CkptfixError as e:
                problems.append(f"{what}: its output does not load: {e}")
    assert not problems, "\n".join(problems)
