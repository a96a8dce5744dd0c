"""``ckptfix sanitize`` / ``ckptfix.sanitize``: a copy that plain ``torch.load(weights_only=True)`` opens."""

from __future__ import annotations

import _codecs
import argparse
import builtins
import datetime
import decimal
import pathlib
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.measured import digest, refused, run
from tests.models import make_net


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


class Plain:
    """A class of the training code: not data torch's weights-only loader builds."""

    def __init__(self) -> None:
        self.steps = 5


def _checkpoint(marker: Path) -> dict[str, Any]:
    return {
        "model": make_net().state_dict(),
        "args": argparse.Namespace(lr=0.1, root=pathlib.PosixPath("/data/run"), milestones=[3, 6]),
        "meta": {
            "seed": np.int64(7),
            "best": np.float32(0.25),
            "flag": np.bool_(True),
            "curve": np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3),
            "counts": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
            "mask": np.array([True, False]),
            "scalar": np.array(2.5),
            "when": datetime.datetime(2025, 1, 2, 3, 4, 5),
            "loss": decimal.Decimal("0.125"),
            "run": uuid.UUID(int=7),
            "names": np.array([["a", "bc"], ["déf", ""]]),
            "tags": np.asfortranarray(np.array([["x", "yz"], ["", "w"]])),
            "objects": np.array([1, "a"], dtype=object),
            "tracker": Plain(),
        },
        "hooks": [1, Payload(marker), 3],
    }


def test_the_copy_opens_weights_only_with_every_value_kept_as_data(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    src, dst = tmp_path / "in.pt", tmp_path / "clean.pt"
    torch.save(_checkpoint(marker), src)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(src, weights_only=True)
    result = ckptfix.sanitize(src, dst)
    out = torch.load(dst, weights_only=True)  # plain torch, no allowlist, no ckptfix
    for key, value in make_net().state_dict().items():
        assert torch.equal(out["model"][key], value), key
    assert out["args"] == {"lr": 0.1, "root": "/data/run", "milestones": [3, 6]}
    meta = out["meta"]
    assert (meta["seed"], meta["best"], meta["flag"]) == (7, 0.25, True)
    assert type(meta["seed"]) is int and type(meta["best"]) is float and type(meta["flag"]) is bool
    assert torch.equal(meta["curve"], torch.from_numpy(np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)))
    assert torch.equal(meta["counts"], torch.arange(6).reshape(2, 3))
    assert torch.equal(meta["mask"], torch.tensor([True, False]))
    assert torch.equal(meta["scalar"], torch.tensor(2.5, dtype=torch.float64))
    assert (meta["when"], meta["loss"], meta["run"]) == ("2025-01-02T03:04:05", "0.125", str(uuid.UUID(int=7)))
    assert meta["names"] == [["a", "bc"], ["déf", ""]] and meta["tags"] == [["x", "yz"], ["", "w"]]
    assert out["hooks"] == [1, None, 3] and "objects" not in meta and "tracker" not in meta
    assert [(d.where, d.what) for d in result.dropped] == [
        ("meta['objects']", "numpy.ndarray"),
        ("meta['tracker']", "tests.test_sanitizing.Plain"),
        ("hooks[1]", "builtins.exec"),
    ]
    assert "can run code; nothing was run" in result.dropped[2].why
    assert result.converted["argparse.Namespace -> dict"] == 1 and result.converted["numpy.ndarray -> tensor"] == 4
    assert result.converted["numpy.ndarray -> list"] == 2
    assert not marker.exists()


def test_an_object_in_a_dict_leaves_its_item_out(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.pt", tmp_path / "clean.pt"
    torch.save({"state_dict": make_net().state_dict(), "meta": {"epoch": 1}, "extra": {"x": Plain(), "y": 2}}, src)
    result = ckptfix.sanitize(src, dst)
    assert [str(d) for d in result.dropped] == [
        "extra['x']: tests.test_sanitizing.Plain (an object of a class torch's weights-only loader does not build)"
    ]
    assert torch.load(dst, weights_only=True)["extra"] == {"y": 2}


def test_cli_lists_what_it_dropped_and_rewrote(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    src, dst = tmp_path / "in.pt", tmp_path / "clean.pt"
    torch.save(_checkpoint(marker), src)
    result = CliRunner().invoke(cli, ["sanitize", str(src), str(dst)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "rewrote 1 × argparse.Namespace -> dict" in lines and "rewrote 4 × numpy.ndarray -> tensor" in lines
    assert any(line.startswith("dropped hooks[1]: builtins.exec (it can run code") for line in lines)
    assert lines[-1] == f"wrote {dst} (3 objects dropped)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean.pt", "in.pt"] and not marker.exists()


def test_refusals(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": make_net().state_dict()}, src)
    ckptfix.save(torch.load(src), tmp_path / "w.safetensors")
    result = CliRunner().invoke(cli, ["sanitize", str(tmp_path / "w.safetensors"), str(tmp_path / "o.pt")])
    assert result.exit_code == 2 and "holds no pickle" in result.stderr
    result = CliRunner().invoke(cli, ["sanitize", str(src), str(src)])
    assert result.exit_code == 2 and "nothing was written" not in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "o.pt").exists()


# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


class _Encoded:
    """Pickles as ``_codecs.encode(text, 'latin1')``: the bytes of a protocol-2 pickle."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> Any:
        return (_codecs.encode, (self.text, "latin1"))


class _Array:
    """Pickles as numpy does an ndarray (``_reconstruct`` then its state), with any shape: numpy not needed."""

    def __init__(self, shape: tuple[int, ...], descr: str, data: str) -> None:
        self.shape, self.descr, self.data = shape, descr, data

    def __reduce__(self) -> Any:
        np = pytest.importorskip("numpy")
        reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
        return (reconstruct, (np.ndarray, (0,), _Encoded("b")),
                (1, self.shape, np.dtype(self.descr), False, _Encoded(self.data)))  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "descr"),
    [((3_000_000, 0), "<U3"), ((10**9, 0), "<U3"), ((10**9,), "<U0"), ((2**64, 0), "<f8"), ((0, 2**63), "<U2")],
)
def test_sanitize_array_shape_bounded_by_file(tmp_path: Path, shape: tuple[int, ...], descr: str) -> None:
    src = tmp_path / "arrays.pt"
    torch.save({"w": torch.ones(2), "a": _Array(shape, descr, "")}, src)
    assert src.stat().st_size < 4096
    refused("sanitize", src, tmp_path / "out.pt", source=src, cwd=tmp_path, contains="key 'a'", bounded=True)


def test_sanitize_small_empty_string_arrays_still_convert(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    src = tmp_path / "arrays.pt"
    torch.save({"a": _Array((3, 0), "<U3", ""), "b": np.array([["x", "yz"]])}, src)
    code, stderr, _, _ = run("sanitize", src, tmp_path / "out.pt", cwd=tmp_path)
    assert code == 0, stderr
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out == {"a": [[], [], []], "b": [["x", "yz"]]}


class _NamespaceKey:
    """Hashable here; pickles as an ``argparse.Namespace`` (which sanitize rewrites as a dict: no key)."""

    def __hash__(self) -> int:
        return 1

    def __reduce__(self) -> Any:
        import argparse

        return (argparse.Namespace, (), {"lr": 0.1})


def test_sanitize_namespace_as_a_dict_key_is_dropped_and_listed(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2), "cfg": {_NamespaceKey(): 3, "b": 4}}, src)
    before = digest(src)
    code, stderr, _, _ = run("sanitize", src, "out.pt", cwd=tmp_path)
    assert code == 0, stderr
    assert digest(src) == before
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["cfg"] == {"b": 4} and torch.equal(out["w"], torch.ones(2))
