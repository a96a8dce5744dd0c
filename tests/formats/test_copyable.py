"""ckptfix.formats.copyable: when a tensor's stored bytes are not its values, and the words that say why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptfix.formats.copyable import not_as_stored, values_as_stored
from ckptfix.formats.pickles import inert
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchzip.reader import read_torch_zip
from ckptfix.reading import open_checkpoint

_VIEWS = {
    "conj": (lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(), "a conj view, whose stored bytes are not its values"),
    "neg": (lambda: torch._neg_view(torch.arange(4.0)), "a neg view, whose stored bytes are not its values"),
    "plain": (lambda: torch.arange(4.0), None),
}


def _record(path: Path) -> inert.InertTensor:
    """The inert record of the file's tensor ``t``, as the readers describe it (nothing built)."""
    with open(path, "rb") as f:
        z = read_torch_zip(f.fileno(), str(path), allowed=allowlist.allowed_names((), source=str(path)))
    record = z.tree["t"]
    assert isinstance(record, inert.InertTensor)
    return record


@pytest.mark.parametrize("kind", sorted(_VIEWS))
def test_a_math_bit_view_is_named_as_one(tmp_path: Path, kind: str) -> None:
    make, why = _VIEWS[kind]
    path = tmp_path / f"{kind}.pt"
    torch.save({"t": make()}, path)
    record = _record(path)
    assert not_as_stored(record) == why
    assert values_as_stored(record) == (why is None)
    expected = torch.load(path, weights_only=True)["t"]
    with open_checkpoint(path) as opened:
        assert opened.note == why  # why torch loaded the file (a plain tensor: described, no note)
        value = opened.tensor(opened.tree["t"])
    # what torch.load gives, bit and all
    assert value.is_conj() == expected.is_conj() and value.is_neg() == expected.is_neg()
    assert torch.equal(value.resolve_conj().resolve_neg(), expected.resolve_conj().resolve_neg())
