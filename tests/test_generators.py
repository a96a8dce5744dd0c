"""The test generators make what the real writers make: each hostile generator minus its attack is a file both
paths accept, and torch itself reads the archives and legacy files written byte by byte."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from tests import hostile
from tests.entry_points import invoke
from tests.hostile import P
from tests.test_parity import check_parity

# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


TWO = torch.tensor([1.0, 2.0])
CONTROLS: dict[str, tuple[Callable[[], bytes], str, torch.Tensor]] = {  # minus the attack: file, key, value
    "small": (lambda: hostile.small_checkpoint(1.0, 2.0), "w", TWO),
    "secret-beside-a-good-storage": (
        lambda: hostile.with_secret(
            hostile.tensor_pickle([("w", P.tensor(P.storage(P.string("0"), numel=2), shape=[2]))])
        ),
        "w",
        TWO,
    ),
    "config-entry": (lambda: hostile.one_tensor_with("cfg", P.dct([(P.string("lr"), P.real(0.1))])), "w", TWO),
    "shallow-dag": (lambda: hostile.torch_zip_file(hostile.dag_pickle(3), {"0": hostile.floats(1.0, 2.0)}), "w", TWO),
    "one-directory-entry": (lambda: hostile.many_entries(count=1, size=64), "w0", torch.zeros(16)),
    "not-expanded": (lambda: hostile.expanded(3.0, numel=4), "weight", torch.full((4,), 3.0)),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_controls_without_the_attack_are_accepted(tmp_path: Path, name: str) -> None:
    """Each generator minus its attack makes a file both paths accept: the refusals above are for the attack."""
    make, key, value = CONTROLS[name]
    data = make()
    assert not check_parity(tmp_path, data, ".pt")
    src = tmp_path / "control.pt"
    src.write_bytes(data)
    assert torch.equal(ckptfix.load(src)["model"][key], value)
    for fast in (True, False):
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(src, out, fast=fast)
        assert torch.equal(ckptfix.load(out)["model"][key], value)
        assert hostile.SECRET not in out.read_bytes()
    assert invoke("inspect", src).exit_code == 0


def test_generators_make_what_torch_reads() -> None:
    """The byte-level writers are right: torch itself reads an archive and a legacy file made by them."""
    loaded = torch.load(io.BytesIO(hostile.small_checkpoint(1.0, 2.0)), weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.tensor([1.0, 2.0]))
    with zipfile.ZipFile(io.BytesIO(hostile.small_checkpoint(1.0))) as zf:
        assert zf.testzip() is None
    legacy = hostile.legacy_file(pickle_of({"a": 1}))
    assert torch.load(io.BytesIO(legacy), weights_only=True) == {"a": 1}


def pickle_of(obj: Any) -> bytes:
    import pickle

    return pickle.dumps(obj, protocol=2)
