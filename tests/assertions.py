"""The deep comparisons of loaded checkpoints the tests share: every storage detail, or the values alone."""

from __future__ import annotations

from typing import Any

import torch


def _raw(t: torch.Tensor) -> torch.Tensor:
    # an empty tensor has no bytes (and torch 2.4 has no torch.equal for float8, even empty)
    return t.detach().contiguous().flatten().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Same structure and key order, same types (Parameter or not), tensors equal byte for byte with the same
    device, dtype, shape, strides, storage offset and requires_grad, and the same ``_metadata``."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.device, a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.device, b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad
        ), where  # fmt: skip
        # bytes, not values: random bit patterns hold NaNs, which torch.equal never calls equal
        assert torch.equal(_raw(a), _raw(b)), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_equal(got: Any, want: Any, where: str = "", *, ordered: bool = True) -> None:
    """The same values where storage details do not matter: the same nested dicts (keys in the same order, or
    the same key sets with ``ordered=False``) and list lengths, tensors of one dtype and torch.equal, == on the rest."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict), (where, type(got))
        assert (list(got) == list(want)) if ordered else (set(got) == set(want)), (where, list(got), list(want))
        for key in want:
            assert_equal(got[key], want[key], f"{where}.{key}", ordered=ordered)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert_equal(x, y, f"{where}[{i}]", ordered=ordered)
    else:
        assert got == want, (where, got, want)


def _bits_state() -> dict[str, torch.Tensor]:
    """Conjugate and negative views, one sharing the storage of a plain tensor (they are not tied weights)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j])
    return {
        "plain": z,
        "conj": torch.conj(z),
        "neg": torch._neg_view(torch.tensor([1.0, -2.0, 3.5])),
        "both": torch._neg_view(torch.conj(torch.tensor([2 - 1j, -3j]))),
        "neg_int": torch._neg_view(torch.tensor([7, -8])),
    }


def _values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().resolve_neg() for k, v in state.items()}


def _assert_values(got: Any, want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), (key, got[key], value)
