"""ckptfix.formats.safety.depth: nesting as deep as torch opens is walked by every command; deeper is refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import hostile
from tests.entry_points import bounded_cli_problems, cli_op, run_ops
from tests.measured import digest, refused, run

# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


def _save_deep(obj: Any, path: Path) -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 5000)  # pickling recurses per level; pytest's own frames are below
    try:
        torch.save(obj, path)
    except RecursionError:  # Python 3.12.0-3.12.1: a fixed C recursion limit stops the pickler itself
        pytest.skip(f"Python {sys.version.split()[0]} cannot pickle this deep (its C recursion limit)")
    finally:
        sys.setrecursionlimit(limit)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [250, 330, 999])
def test_deep_nesting_torch_opens_is_walked_by_every_command(tmp_path: Path, depth: int) -> None:
    src = tmp_path / "deep.pt"
    _save_deep({"model": {"w": torch.ones(2)}, "deep": _nested(depth)}, src)
    assert torch.load(src, weights_only=True)["model"]["w"].shape == (2,)
    before = digest(src)
    commands = [["inspect", src], ["inspect", "--json", src], ["sanitize", src, "s.pt"], ["convert", src, "c.pt"],
                ["convert", src, "d.pt", "--to", "ddp"], ["convert", src, "c.safetensors"], ["convert", src, "dcp/"],
                ["diff", src, src]]  # fmt: skip
    for command in commands:
        code, stderr, _, _ = run(*command, cwd=tmp_path)
        assert code == 0, f"{command[0]}: exit {code}: {stderr[-500:]}"
    assert digest(src) == before
    for name in ("s.pt", "c.pt", "d.pt"):
        torch.load(tmp_path / name, weights_only=True)


def test_nesting_past_the_documented_depth_is_refused_everywhere(tmp_path: Path) -> None:
    from ckptfix.formats.safety.depth import MAX_DEPTH

    src = tmp_path / "deep.pt"
    _save_deep({"model": {"w": torch.ones(2)}, "deep": _nested(MAX_DEPTH + 1)}, src)
    for command in (["inspect", src], ["sanitize", src, "s.pt"], ["convert", src, "c.pt"],
                    ["convert", src, "c.safetensors"], ["diff", src, src]):  # fmt: skip
        refused(*command, source=src, cwd=tmp_path, contains=f"more than {MAX_DEPTH} deep")


def test_the_library_walks_deep_nesting_as_the_cli_does(tmp_path: Path) -> None:
    import ckptfix

    # In this process, at Python's default recursion limit: each public call raises it for itself, and only then.
    src = tmp_path / "deep.pt"
    _save_deep({"model": {"w": torch.ones(2)}, "deep": _nested(330)}, src)
    limit = sys.getrecursionlimit()
    assert ckptfix.load(src)["model"]["w"].shape == (2,)
    for fast in (True, False):
        ckptfix.convert_file(src, tmp_path / f"c{fast}.pt", fast=fast)
    ckptfix.sanitize(src, tmp_path / "s.pt")
    assert ckptfix.summarize(src)["models"]
    assert ckptfix.diff(ckptfix.load(src), ckptfix.load(tmp_path / "cTrue.pt")).equal
    assert sys.getrecursionlimit() == limit


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


@pytest.mark.parametrize("shape", ["self-list", "self-dict", "deep-1e5"])
def test_case5_cycles_and_deep_nesting_are_refused_in_one_line(tmp_path: Path, shape: str) -> None:
    makers: dict[str, Callable[[], bytes]] = {
        "self-list": hostile.self_list_pickle,
        "self-dict": hostile.self_dict_pickle,
        "deep-1e5": lambda: hostile.deep_pickle(100_000),
    }
    pkl = makers[shape]()
    src = tmp_path / "x.pt"
    src.write_bytes(hostile.torch_zip_file(pkl, {"0": hostile.floats(1.0, 2.0)}))
    ops: list[dict[str, Any]] = [
        {"kind": "load", "path": str(src)},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "a.pt"), "fast": True},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "b.pt"), "fast": False},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "c.safetensors"), "fast": True},
        cli_op("convert", src, tmp_path / "d.pt"),
        cli_op("convert", src, tmp_path / "e.pt", "--no-fast"),
        cli_op("inspect", src),
    ]
    results = run_ops(tmp_path, ops, timeout=120)
    problems = [
        f"{op['kind']} {op.get('fast', '')}: {r['error']}: {r.get('message', '')[:200]}"
        for op, r in zip(ops[:4], results[:4], strict=True)
        if r["error"] != "FormatError"
    ]
    problems += bounded_cli_problems(results[4:], ops[4:], codes=[2], seconds=10, source=str(src))
    problems += [
        f"{n} was written" for n in ("a.pt", "b.pt", "c.safetensors", "d.pt", "e.pt") if (tmp_path / n).exists()
    ]
    assert not problems, "\n".join(problems)
