"""When a tensor's stored bytes are not its values: the rules every reader and writer that copies bytes asks, and
:class:`Fallback`, the one signal that a copy does not apply, with its :class:`Reason`.

The streaming writers copy records byte for byte, the readers hand records to torch as they are, and
:mod:`~ckptfix.formats.torchio.materialize` maps storages as they lie in the file. Each steps aside for torch (which
swaps, applies the bits, or copies the view) where one of these rules says the bytes are not the values, naming one
of the reasons of :class:`Reason`, each written once here (what ``convert -v`` and ``--json`` say). A torch zip's
tensor (a file's, a DCP chunk's) is asked both questions: its archive's byte order (:func:`foreign_byte_order`) and
its record's (:func:`values_as_stored`).

It imports nothing of ckptfix (a record and an archive are asked for the attributes named here), so the tensor
records themselves (:mod:`~ckptfix.formats.pickles.inert`) answer by these rules.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol


class Reason(enum.Enum):
    """Why a stream steps aside for torch, each in the words ``convert -v`` and ``--json`` say, written once here:
    a template whose ``{fields}`` the raise names (``Fallback(Reason.INPUT_FORMAT, fmt="torch-legacy")``)."""

    # the input as a whole
    INPUT_FORMAT = "input is a {fmt} file"
    BYTE_ORDER = "input is {order}"
    BYTE_ORDER_TO_SAFETENSORS = "input is {order}; safetensors is little-endian"
    READ_BY_LOADER = "a {kind} checkpoint is read by its loader"
    ACCELERATE_FOLDER = "an accelerate folder is read file by file"
    TORCH_SHARD = "shard {shard} is a torch file"
    BIG_ENDIAN_RANK_FILE = "a big-endian rank file, whose bytes torch swaps"
    FOREIGN_FILE = "a {order} file, whose bytes torch swaps"  # inspect/diff/merge/load: torch swaps them
    RAW_STORAGE = "a raw storage outside any tensor"
    TORCH_REBUILT_TENSOR = "{call}(...): a quantized, sparse or subclass tensor"
    NOT_AS_STORED = "{why}"  # not_as_stored's words (below): hooks or extra state, or which math bits
    # what the checkpoint holds beside tensors
    NOT_A_DICT = "the checkpoint is a {kind}, not a dict"
    OBJECTS = "the checkpoint holds objects other than tensors, which the torch path builds"
    CONTAINER_OF_TENSORS = "the checkpoint holds a {kind} of tensors or objects, which the torch path builds"
    REBUILT_CALL = "the checkpoint holds {call}(...), which the torch path rebuilds"
    DCP_VALUE_REBUILT = "value '{key}' holds tensors or objects, which the torch path rebuilds"
    VALUE_TYPE = "a {kind} value"
    NOT_A_TENSOR = "key '{key}' holds a {kind}, not a tensor"
    UNPICKLABLE = "{error}"  # what the pickle writer says of a value it does not write
    UNPICKLABLE_ENTRY = "'{name}': {error}"
    # a tensor whose stored bytes are not its values, or not a record the stream copies
    IN_MEMORY = "a tensor already in memory"
    NOT_PLAIN_TENSOR = "not a plain tensor"
    NOT_SAFETENSORS_TENSOR = "not a safetensors tensor"
    HOOKS_OR_METADATA = "a tensor carries backward hooks or extra metadata"
    PARAMETER_HOOKS = "a Parameter carries hooks or state, which the torch path rebuilds"
    TENSOR_HOOKS_OR_BITS = "a tensor carries hooks, extra state or a conj/neg bit, which the torch path rebuilds"
    MATH_BIT_VIEW = "a tensor is a {bits} view: its bytes are not its values"
    CHUNK_BYTE_ORDER = "chunk of '{key}' is {order}: its bytes are not its values"
    CHUNK_MATH_BIT_VIEW = "chunk of '{key}' is a {bits} view: its bytes are not its values"
    NON_CONTIGUOUS = "a tensor is a non-contiguous view"
    NON_CONTIGUOUS_TO_TORCH = "a tensor is a non-contiguous view, which the torch path makes contiguous"
    STRIDED_VIEW_TO_DCP = "a tensor is a strided view, which torch's DCP writer keeps as it is"
    DTYPE_NOT_IN_SAFETENSORS = "key '{key}' has dtype {dtype}, which the fast path does not write to safetensors"
    DCP_NAME_TWICE = "two entries flatten to the DCP name '{fqn}'"
    SHARED_STEP = "an optimizer's step tensor is shared between parameters (FSDP1); torch copies it apart"
    LAYERNORM_1P = "apply_layernorm_1p: the norm weights are computed (weight + 1), not copied"


class Fallback(Exception):  # noqa: N818 - a signal, not an error: the name is its contract with its callers
    """A stream does not apply to this input or output tree: ``reason`` says why, ``str(e)`` in words, for
    ``--verbose``.

    Raised before anything is written, by the stream readers and writers (:mod:`ckptfix.stream`) and by
    :func:`ckptfix.writing.streamed_writer` for a tree only ``ckptfix.save`` writes; the caller then takes the torch
    path (:func:`ckptfix.conversion.run.run`)."""

    def __init__(self, reason: Reason, /, **fields: object) -> None:
        super().__init__(reason.value.format(**fields))
        self.reason = reason


class _Archive(Protocol):
    @property
    def byteorder(self) -> str: ...  # a torch zip's byteorder record (``little`` when it has none)


class _Tensor(Protocol):
    @property
    def math_bits(self) -> dict[str, bool] | None: ...  # pickles.inert.InertTensor's


class _Parameter(Protocol):
    @property
    def func(self) -> Any: ...  # the rebuild function's global (``.name``)

    @property
    def args(self) -> tuple[Any, ...]: ...


def foreign_byte_order(z: _Archive) -> str | None:
    """``big-endian`` for a file (or DCP chunk) torch.save wrote on a big-endian machine (torch swaps its bytes as
    it loads); None for the little-endian files every copy and map reads as they are."""
    return None if z.byteorder == "little" else f"{z.byteorder}-endian"


def hooks_or_state(t: _Tensor) -> bool:
    """Whether ``t`` was saved with backward hooks or extra state (``__dict__``, a subclass's metadata), which only
    torch's unpickler rebuilds; a conj or neg bit is not this (see :func:`math_bit_view`)."""
    return t.math_bits is None


def parameter_hooks_or_state(p: _Parameter) -> bool:
    """Whether a Parameter record was saved with backward hooks or state (``_rebuild_parameter_with_state``),
    which only torch's unpickler rebuilds; its tensor is asked :func:`hooks_or_state` on its own."""
    return p.func.name != "_rebuild_parameter" or (len(p.args) > 2 and bool(p.args[2]))


def math_bit_view(t: _Tensor) -> str | None:
    """``conj``, ``neg`` or ``conj and neg`` for a view whose storage holds the values before those bits apply
    (``torch.conj``, ``torch._neg_view``: only a torch pickle records them); None otherwise."""
    return " and ".join(t.math_bits) if t.math_bits else None


def not_as_stored(t: _Tensor) -> str | None:
    """Why ``t``'s storage, read through its view, does not hold the values torch.load gives it, in the words a
    note or refusal uses (hooks or state; which math bits); None where it does (:func:`values_as_stored`)."""
    if hooks_or_state(t):
        return "a tensor with backward hooks or extra state"
    if bits := math_bit_view(t):
        return f"a {bits} view, whose stored bytes are not its values"
    return None


def torch_rebuilt(module: str) -> bool:
    """Whether a pickle's call to a global of ``module`` is one of torch's own tensor rebuilds that are not a plain
    tensor's or a Parameter's (quantized, sparse, subclass and device tensors: ``torch._utils``, ``torch._tensor``),
    which only torch builds."""
    return module.startswith(("torch._utils", "torch._tensor"))


def values_as_stored(t: _Tensor) -> bool:
    """Whether ``t``'s storage, read through its view, holds the values torch.load gives it (in the file's byte
    order): no hooks or extra state, no conj or neg bit. What reads or copies a record's bytes as its values asks
    this (and the archive's :func:`foreign_byte_order`); a .pt-to-.pt copy keeps the bits and asks only
    :func:`hooks_or_state`."""
    return t.math_bits == {}


__all__ = [
    "Fallback",
    "Reason",
    "foreign_byte_order",
    "hooks_or_state",
    "math_bit_view",
    "not_as_stored",
    "parameter_hooks_or_state",
    "torch_rebuilt",
    "values_as_stored",
]
