"""The test generators make what the real writers make: each hostile generator minus its attack is a file both
paths accept, torch itself reads the archives and legacy files written byte by byte, and the corpora
(tests/parity.py, tests/corpus.py) are deterministic and cover every case class."""

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
from tests.corpus import PT_CASES, ST_CASES, TORCH_REFUSES, _tensors, load_pt
from tests.entry_points import invoke
from tests.hostile import P
from tests.parity import CASES, _base_bytes, case_bytes, check_parity, generated_pt, generated_st
from tests.writers import torch_saves

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


# Both conversion paths give the same answer on every input, intact or damaged (tests/parity.py: the corpus, and what
# counts as the same answer).


def test_corpus_is_deterministic_and_covers_both_known_disagreements() -> None:
    assert generated_pt() == generated_pt()
    assert generated_st() == generated_st()
    ids = [f"{b.name}:{m or 'intact'}" for b, m in CASES]
    assert len(ids) == len(set(ids))
    assert "generated.pt:known-local-flags-differ" in ids
    assert "generated.safetensors:known-header-order-differs" in ids
    # every mutation really changes its base, so no case silently tests the intact file twice
    unchanged = [f"{b.name}:{m}" for b, m in CASES if m is not None and case_bytes(b, m) == _base_bytes(b.name)]
    assert not unchanged


# Every file of the corpus (tests/corpus.py) through every operation: faithful, or refused in one accurate line. For
# each case and operation the outcome is one of two: FAITHFUL (same keys and key order, container types and _metadata,
# dtype, shape, stride, storage offset, storage bytes, sharing, device tags, Parameter type, requires_grad and
# attributes, conj and neg bits, quantizer, sparse parts) or a refusal: exit 2 with one line (CLI), a CkptfixError
# (library). Never exit 3, never a silent change. The truth for a .pt file is what torch.load(weights_only=True) makes
# of it; for a .safetensors file what safetensors.torch.load_file makes of it, in the header's key order. A
# .safetensors output keeps values, not layouts: its tensors are the input's as contiguous tensors (math bits
# resolved, Parameters stored as tensors), and a tensor it cannot hold (a dtype safetensors has no code for, sparse,
# quantized) is refused by name.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_the_corpus_covers_every_case_class(corpus: dict[str, Path]) -> None:
    assert len(corpus) == len(PT_CASES) + len(ST_CASES)
    seen = {str(t.dtype).removeprefix("torch.") for name, p in corpus.items() if p.suffix == ".pt"
            and name not in TORCH_REFUSES for t in _tensors(load_pt(p)[0]).values()}  # fmt: skip
    assert {
        name for name in ("complex32", "float4_e2m1fn_x2", "bits1x8", "float8_e8m0fnu", "uint64") if torch_saves(name)
    } | {"qint8"} <= seen
    big = corpus["big-endian"]
    assert b"byteorder" in big.read_bytes() and b"big" in big.read_bytes()
