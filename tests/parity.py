"""Both conversion paths on one input, and a deterministic corpus of inputs, intact or damaged.

For each file of the corpus (every fixture, a generated .pt and .safetensors, and mutations of each),
``convert_file(fast=True)`` (the streaming path) and ``convert_file(fast=False)`` (the torch path) are run to
``.pt`` and to ``.safetensors`` (:func:`check_parity`). Either both refuse with the same error class and leave no
output, or both succeed and their outputs, read back with ``ckptfix.load``, hold the same keys in the same order,
the same values bit for bit (``torch.equal`` and more: NaN payloads too) and the same tied tensors.

Two disagreements are known and kept in the corpus on purpose (they fail until the format layer is shared):
``known-local-flags-differ`` (a local header whose flags differ from its central directory entry) and
``known-header-order-differs`` (a safetensors header that lists tensors in another order than their data).
"""

from __future__ import annotations

import argparse
import functools
import io
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import CkptfixError
from tests import hostile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def generated_pt() -> bytes:
    """A small state dict saved by torch: a tied pair, a non-contiguous view, several dtypes."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    state["module.enc.weight"] = base
    state["module.enc.bias"] = torch.linspace(-1, 1, 6)
    state["module.dec.weight"] = base  # tied to enc.weight
    state["module.enc.weight_t"] = base.t()  # a non-contiguous view of the same storage
    state["module.steps"] = torch.tensor(7, dtype=torch.int64)
    state["module.half"] = torch.tensor([0.5, -2.0, float("nan")], dtype=torch.float16)
    state["module.mask"] = torch.tensor([True, False, True])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return hostile.canonical_zip(buffer.getvalue())  # serialization_id fixed: the same bytes on every run


def generated_st() -> bytes:
    """A small file written by the safetensors library itself (its own key and data order)."""
    from safetensors.torch import save

    tensors = {
        "module.b.weight": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "module.a.weight": torch.linspace(0, 1, 5, dtype=torch.float32),
        "module.c.index": torch.arange(3, dtype=torch.int64),
    }
    return bytes(save(tensors, metadata={"format": "pt"}))


@dataclass(frozen=True)
class Base:
    name: str
    suffix: str
    make: Callable[[], bytes]
    mutations: hostile.Mutations = field(default_factory=hostile.Mutations)


def _fixture(path: Path) -> Base:
    def read() -> bytes:
        return path.read_bytes()

    if path.suffix == ".safetensors":
        return Base(path.name, ".safetensors", read, hostile.st_mutations().subset(hostile.LIGHT_ST))
    if path.read_bytes()[:4] != b"PK\x03\x04":
        return Base(path.name, ".pt", read, hostile.legacy_mutations())
    # The full corpus on one real trainer checkpoint, the light one on every other fixture.
    full = path.name == "ddp_wrapped.pt"
    return Base(
        path.name, ".pt", read, hostile.zip_mutations() if full else hostile.zip_mutations().subset(hostile.LIGHT_ZIP)
    )


BASES = [
    Base("generated.pt", ".pt", generated_pt, hostile.zip_mutations()),
    Base("generated.safetensors", ".safetensors", generated_st, hostile.st_mutations()),
    *(_fixture(p) for p in sorted(FIXTURES.glob("*.pt")) + sorted(FIXTURES.glob("*.safetensors"))),
]
CASES = [(b, None) for b in BASES] + [(b, m) for b in BASES for m in b.mutations.items]


@functools.cache
def _base_bytes(name: str) -> bytes:
    return next(b for b in BASES if b.name == name).make()


def case_bytes(base: Base, mutation: str | None) -> bytes:
    data = _base_bytes(base.name)
    return data if mutation is None else base.mutations.items[mutation](data)


@dataclass
class Outcome:
    """What one conversion did: the CkptfixError class it raised, or the output read back."""

    error: str | None = None
    message: str = ""
    value: Any = None


def attempt(src: Path, out: Path, *, fast: bool, allow: tuple[str, ...], **options: Any) -> Outcome:
    try:
        ckptfix.convert_file(src, out, fast=fast, allow_globals=allow, **options)
    except CkptfixError as e:
        if out.exists():
            return Outcome("output-left-behind", f"{type(e).__name__}: {e}")
        return Outcome(type(e).__name__, str(e))
    except Exception as e:  # never acceptable: reported as a mismatch whatever the other path did
        return Outcome(f"crash:{type(e).__name__}", str(e))
    try:
        return Outcome(value=ckptfix.load(out, allow_globals=allow))
    except Exception as e:
        return Outcome(f"output-unreadable:{type(e).__name__}", str(e))
    finally:
        out.unlink(missing_ok=True)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.device.type == "meta" or a.numel() == 0:
        return True
    try:  # bit for bit, so NaNs and -0.0 compare too
        return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    except RuntimeError:
        return torch.equal(a, b)


def difference(a: Any, b: Any, where: str = "") -> str | None:
    """The first difference between two loaded checkpoints, or None: types, key order, values, tensors."""
    at = where or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{at}: {type(a).__name__} vs {type(b).__name__}"
        if not _same_tensor(a, b):
            return f"{at}: tensors differ ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})"
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a.keys()) != list(b.keys()):
            return f"{at}: keys {list(a.keys())} vs {list(b.keys())}"
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return f"{at}: _metadata differs"
        for key in a:
            found = difference(a[key], b[key], f"{where}/{key}")
            if found:
                return found
        return None
    if type(a) is not type(b):
        return f"{at}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{at}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, argparse.Namespace):
        return difference(vars(a), vars(b), f"{where}.")
    if a != b and not (isinstance(a, float) and a != a and b != b):
        return f"{at}: {a!r} vs {b!r}"
    return None


def sharing(obj: Any) -> set[frozenset[str]]:
    """Groups of paths whose (non-empty) tensors share one storage: tied weights and views."""
    groups: dict[int, set[str]] = {}

    def visit(value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() and value.device.type != "meta":
                groups.setdefault(value.untyped_storage().data_ptr(), set()).add(where)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, f"{where}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(v, f"{where}[{i}]")

    visit(obj, "")
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def describe(outcome: Outcome) -> str:
    return f"{outcome.error} ({outcome.message[:200]})" if outcome.error else "converted"


def compare(fast: Outcome, slow: Outcome) -> str | None:
    """Why two outcomes disagree, or None when they agree. A crash or an unreadable output never agrees."""
    both = f"fast path: {describe(fast)}; torch path: {describe(slow)}"
    if any(o.error and not o.error[0].isupper() for o in (fast, slow)):
        return both
    if fast.error or slow.error:
        return both if fast.error != slow.error else None
    found = difference(fast.value, slow.value)
    if found:
        return f"outputs differ at {found}"
    tied = [sorted(map(sorted, sharing(o.value))) for o in (fast, slow)]
    if tied[0] != tied[1]:
        return f"tied tensors differ: fast path {tied[0]} vs torch path {tied[1]}"
    return None


TARGETS: list[tuple[str, dict[str, Any]]] = [
    (".pt", {}),
    (".safetensors", {}),
    (".safetensors", {"model_only": True}),
]


def check_parity(tmp_path: Path, data: bytes, suffix: str, allow: tuple[str, ...] = ()) -> list[str]:
    """Every disagreement between the two paths on ``data``, for each target."""
    src = tmp_path / f"in{suffix}"
    src.write_bytes(data)
    problems = []
    for target, options in TARGETS:
        outcomes = [
            attempt(src, tmp_path / f"out-{path}{target}", fast=path == "fast", allow=allow, **options)
            for path in ("fast", "torch")
        ]
        found = compare(*outcomes)
        if found:
            problems.append(f"-> {target}{' ' + str(options) if options else ''}: {found}")
    assert src.read_bytes() == data, "the input was modified"
    return problems


PATHS = [pytest.param(True, id="fast"), pytest.param(False, id="torch")]
