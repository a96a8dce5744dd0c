"""What may travel between ranks as pickled control data, and the check the source runs before sending any.

Control data (arguments, the manifest, the checkpoint's non-tensor entries, failures) crosses ranks as a
pickle that receivers open with a small allowlist. The source checks its payload against that same rule
before it announces success, so a payload every receiver would refuse fails on the source, in the status
phase, and every rank raises the same error. Advice never names a global that could run code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptfix.errors import DistributedError

if TYPE_CHECKING:
    import torch

    from ckptfix.distributed.buckets import Entry

# Plain containers, the placeholders for tensors, and torch's small inert value types.
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("builtins", "bytearray"),
    ("ckptfix.distributed.failures", "Failure"),
    ("ckptfix.distributed.buckets", "Entry"),
    ("ckptfix.distributed.buckets", "TensorRef"),
    ("torch", "Size"),
    ("torch", "device"),
    # A layout pickles as this lookup by name (torch.strided, torch.sparse_coo); it builds nothing.
    ("torch.serialization", "_get_layout"),
}

NOT_SENT = "which load_for_ddp cannot send to the other ranks"


class RefusedGlobalError(DistributedError):
    """A payload needs a pickle global outside the allowlist; ``name`` is ``module.attribute``."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"status payload needs global '{name}', which the receiving rank does not accept; "
            f"the source checks its payload first, so the ranks run different ckptfix versions"
        )
        self.name = name


class _Unpickler(pickle.Unpickler):
    # The payload comes from a weights-only load on the source, but receivers still refuse anything beyond
    # the allowlist (plus the user's own allow_globals), so this hop never widens what can run.
    def __init__(self, data: bytes, allowed: set[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in self.allowed or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise RefusedGlobalError(f"{module}.{name}")


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes, *, allowed: Iterable[str] = ()) -> Any:
    """Unpickle control data, accepting only the allowlist and ``allowed`` (``"module.attribute"`` names)."""
    extra: set[tuple[str, str]] = set()
    for name in allowed:
        module, _, attr = name.rpartition(".")
        extra.add((module, attr))
    return _Unpickler(data, _ALLOWED | extra).load()


def check_sendable(
    skeleton: Any, entries: Sequence[Entry], tensors: Sequence[torch.Tensor], *, source: str, allowed: list[str]
) -> None:
    """Raise a one-line :class:`DistributedError` naming the first entry that cannot reach the other ranks.

    ``skeleton``, ``entries`` and ``tensors`` are what :func:`ckptfix.distributed.buckets.strip_tensors`
    made of the checkpoint's extra entries; an entry's key is its path (``['optimizer']['state'][0]``).
    """
    for entry, tensor in zip(entries, tensors, strict=True):
        problem = _tensor_problem(tensor)
        if problem:
            raise DistributedError(_refusal(source, entry.key, *problem))
    try:
        loads(dumps(skeleton), allowed=allowed)
        return
    except Exception as e:  # any failure to round-trip; look for the entry, for a message that names it
        first = e
    for where, value in _leaves(skeleton):
        try:
            loads(dumps(value), allowed=allowed)
        except Exception as e:
            raise DistributedError(_refusal(source, where, *_object_problem(value, e))) from e
    raise DistributedError(
        f"{source}: a key or container among the checkpoint's other entries is not plain data, {NOT_SENT}; "
        f"use str or int keys and dict, list or tuple containers"
    ) from first


def _refusal(source: str, where: str, what: str, fix: str) -> str:
    return f"{source}: entry {where} is {what}, {NOT_SENT}; {fix}"


def _tensor_problem(tensor: torch.Tensor) -> tuple[str, str] | None:
    # Bytes on the wire must be the values: a meta tensor has none, the others are not one strided block.
    import torch

    if tensor.is_meta:
        return "a meta tensor (a shape without data)", "save real values or drop the entry"
    if tensor.is_quantized:
        return f"a quantized tensor ({tensor.dtype})", "save t.dequantize() or drop the entry"
    if tensor.is_nested:
        return "a nested tensor", "save its parts as separate tensors or drop the entry"
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor", "save t.to_dense() or drop the entry"
    return None


def _object_problem(value: Any, error: Exception) -> tuple[str, str]:
    import torch

    if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):
        # A storage pickles through a full (unsafe) torch.load of its bytes: never offer to allow that.
        return "a raw torch storage", "save the tensor it belongs to, or drop the entry"
    cls = type(value)
    own = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(error, RefusedGlobalError) and error.name == own:
        # The object's own class, as the loader's allow_globals names it: allowing it runs no other code.
        return f"a {own} object", f"pass allow_globals=['{own}'] on every rank"
    return f"a {own} object", "save it as tensors and plain Python values, or drop the entry"


def _leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    # The same walk and path spelling as buckets.strip_tensors.
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for index, value in enumerate(obj):
            yield from _leaves(value, f"{path}[{index}]")
    else:
        yield path or "<root>", obj
