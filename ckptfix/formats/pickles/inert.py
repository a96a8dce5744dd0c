"""What ckptfix reads torch's pickles into, without executing anything: the inert records.

Globals become immutable stand-ins (new ones for every file), calls become records of the call, persistent ids
become references to storages. Every rule about what a pickle may contain lives in the reader
(:mod:`.unpickling`), these records, or the allowlist: the globals it may name, the shape of a storage reference,
each tensor's view staying inside its storage, and limits on depth and on the size the tree takes once shared
references are followed (:func:`.inert_trees.measure`, which also walks the trees). :mod:`.pickling` writes a tree
back with the opcodes torch's pickler emits (protocol 2), so a tree round-trips and torch loads the result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NoReturn, cast

from ckptfix.errors import FormatError
from ckptfix.formats.copyable import Fallback, Reason, parameter_hooks_or_state, values_as_stored
from ckptfix.formats.dtypes import DTYPES, QUANTIZED, STORAGE_DTYPES, nbytes, storage_itemsize
from ckptfix.formats.raw import RawTensor
from ckptfix.formats.records import FileTable, Holder, RunReader, TensorRecord, torch_dtype
from ckptfix.formats.safety import allowlist

EXPANDED_LIMIT = 256 << 20  # bytes an expanded (stride-0) view may claim beyond its storage
_INT64 = (1 << 63) - 1
# The math bits torch.save records in a tensor's metadata (torch._utils.get_tensor_metadata), and the dtypes each
# applies to: torch asserts on a conjugate bit of a real tensor and cannot resolve a negative bit of the others.
_COMPLEX = frozenset({"complex64", "complex128"})
_NEGATABLE = (
    frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8"}) | _COMPLEX
)
_BIT_DTYPES = {"conj": _COMPLEX, "neg": _NEGATABLE}
_VIEW_FUNCS = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_qtensor",
}
_TENSOR_FUNCS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}
_PARAM_FUNCS = {"torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}


class Frozen(type):
    # Stand-ins are classes so that NEWOBJ accepts them; they can be neither renamed nor given state.
    def __call__(cls, *args: Any) -> Any:
        return cls.build(cls, args)  # type: ignore[attr-defined]

    def __setattr__(cls, name: str, value: Any) -> NoReturn:
        raise FormatError(f"its pickle tries to change the global {cls.__name__} (a BUILD on a class); refusing it")


class Global(metaclass=Frozen):
    """A pickle global, never imported: ``module.name`` and nothing else."""

    module: ClassVar[str]
    name: ClassVar[str]
    full: ClassVar[str]
    width: ClassVar[int | None]  # as a storage class: bytes per element it counts (None: not a storage class)
    build: ClassVar[Callable[[type[Global], tuple[Any, ...]], Inert]]  # the record of a call

    @staticmethod
    def __setstate__(state: Any) -> NoReturn:
        raise FormatError("its pickle gives state to a global (a BUILD on a class); refusing it")


def make_global(module: str, name: str) -> type[Global]:
    """A new immutable stand-in for ``module.name``."""

    def new(cls: type[Global], *args: Any) -> Inert:
        obj = Inert.make(cls, args)
        obj.newobj = True
        return obj

    full = f"{module}.{name}"
    build = tensor if full in _TENSOR_FUNCS else Inert.make
    namespace = {
        "module": module,
        "name": name,
        "full": full,
        "__new__": new,
        "width": storage_itemsize(name),
        "build": staticmethod(build),
    }
    return cast("type[Global]", Frozen(name, (Global,), namespace))


def nested_class(known: dict[str, type[Global]], allowed: frozenset[str]) -> type[Global]:
    """A stand-in for ``getattr`` that only names a nested class: ``getattr(<stand-in of a.B>, "C")`` is the
    stand-in of ``a.B.C`` when that name is allowed (protocol 2 pickles ``ShardedTensor.ProcessGroupState`` so).
    Nothing is looked up or called; any other use is refused."""

    def build(cls: type[Global], args: tuple[Any, ...]) -> Any:
        outer, attr = args if len(args) == 2 else (None, None)
        if not (isinstance(outer, type) and issubclass(outer, Global) and type(attr) is str):
            raise FormatError("its pickle calls getattr on something other than a class; refusing it")
        full = f"{outer.full}.{attr}"
        if full not in allowed:
            raise FormatError(f"its pickle looks up {full} with getattr, which is not a known class; refusing it")
        if full not in known:
            known[full] = make_global(outer.full, attr)
        return known[full]

    return cast(
        "type[Global]",
        Frozen(
            "getattr",
            (Global,),
            {
                "module": "builtins",
                "name": "getattr",
                "full": "builtins.getattr",
                "width": None,
                "build": staticmethod(build),
            },
        ),
    )


class StorageRef:
    """A persistent id: the storage ``key``, its class and element count, as the file states them.

    Read-only by convention (no pickle opcode reaches its attributes: BUILD finds __setstate__ and is refused).
    """

    __slots__ = ("key", "location", "nbytes", "numel", "pid", "storage_type")
    key: str
    location: str
    nbytes: int  # size of the storage in bytes (typed storages count elements, untyped ones bytes)
    numel: int
    pid: tuple[Any, ...]
    storage_type: type[Global]

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid
        self.storage_type, self.key, self.location, self.numel = pid[1:5]
        self.nbytes = self.numel * (self.storage_type.width or 1)

    def __setstate__(self, state: Any) -> NoReturn:
        raise FormatError("its pickle gives state to a storage reference; refusing it")


class Inert:
    """A call of an allowlisted global, kept as its recipe: ``func(*args)`` or ``func.__new__``, then state."""

    __slots__ = ("args", "func", "has_state", "newobj", "state")

    def __init__(self, func: type[Global], args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args
        self.newobj = False
        self.has_state = False
        self.state: Any = None

    @staticmethod
    def make(func: type[Global], args: tuple[Any, ...]) -> Inert:
        if func.full in _TENSOR_FUNCS:
            return InertTensor(func, args)
        if func.full in _PARAM_FUNCS:
            return InertParameter(func, args)
        if func.full in _VIEW_FUNCS:
            _check_view(func.full, args, dtype=_qtensor_dtype(args))
        if func.full == "builtins.bytearray" and args and isinstance(args[0], int) and args[0] > 1 << 20:
            raise FormatError(f"its pickle asks for bytearray({args[0]}), {args[0]} bytes from nothing; refusing it")
        return Inert(func, args)

    def __setstate__(self, state: Any) -> None:
        # as torch: state only for an object of an --allow-global class, once (the C unpickler calls this directly)
        if self.func.full in allowlist.TORCH_DEFAULT:
            raise FormatError(f"its pickle gives state to {self.func.full}, which torch's weights-only loader refuses")
        if self.has_state or isinstance(self, (InertTensor, InertParameter)):
            raise FormatError(f"its pickle gives state to {self.func.full} twice or to a tensor; refusing it")
        self.has_state = True
        self.state = state

    def __repr__(self) -> str:
        return f"<inert {self.func.full}{self.args!r}>"


def _qtensor_dtype(args: tuple[Any, ...]) -> str | None:
    ref = args[0] if args else None
    return STORAGE_DTYPES.get(ref.storage_type.name) if isinstance(ref, StorageRef) else None


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(type(v) is int for v in value):
        return tuple(value)
    if isinstance(value, Inert) and value.func.full == "torch.Size" and value.args:
        return _ints(value.args[0])
    return None


def _check_view(func: str, args: tuple[Any, ...], *, dtype: str | None) -> None:
    """The one storage-size rule for views: offset, shape and strides inside the storage's bytes."""
    where = func.rsplit(".", 1)[-1]
    if len(args) < 4 or not isinstance(args[0], StorageRef):
        raise FormatError(f"its pickle calls {where} without a storage; the file is corrupt")
    ref, offset, shape, stride = args[0], args[1], _ints(args[2]), _ints(args[3])
    if type(offset) is not int or shape is None or stride is None or len(shape) != len(stride):
        raise FormatError(f"tensor in storage '{ref.key}' has a malformed offset, shape or stride; the file is corrupt")
    if offset < 0 or any(d < 0 for d in shape) or any(s < 0 for s in stride):
        raise FormatError(
            f"tensor in storage '{ref.key}' has a negative offset, size or stride ({offset}, {list(shape)}, "
            f"{list(stride)}); the file is corrupt"
        )
    if dtype is None or dtype not in DTYPES:
        raise FormatError(f"tensor in storage '{ref.key}' has unknown dtype {dtype!r}; the file is corrupt")
    numel, overflow = 1, any(v > _INT64 for v in (offset, *shape, *stride))
    for d in shape:  # torch multiplies the sizes in order and fails on overflow, even when a later size is 0
        numel *= d
        overflow = overflow or numel > _INT64
    if overflow:
        raise FormatError(
            f"tensor in storage '{ref.key}' has sizes or strides past 64 bits ({list(shape)}, {list(stride)}); "
            f"torch cannot build it"
        )
    if numel == 0:
        return
    extent = offset + 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
    reach, size = nbytes(dtype, extent), nbytes(dtype, numel)  # quint4x2 packs two values a byte
    if reach > ref.nbytes:
        raise FormatError(
            f"tensor in storage '{ref.key}' reaches byte {reach} of a {ref.nbytes}-byte storage; "
            f"the file is corrupt or crafted to read other records"
        )
    if size > ref.nbytes + EXPANDED_LIMIT:
        raise FormatError(
            f"tensor in storage '{ref.key}' is an expanded view of {size} bytes over {ref.nbytes}; "
            f"materializing it would take that much memory (limit {EXPANDED_LIMIT} bytes beyond its storage)"
        )


class InertTensor(Inert, TensorRecord):
    """``_rebuild_tensor_v2/v3(storage, offset, size, stride, requires_grad, hooks[, dtype])``."""

    on_demand: ClassVar[bool] = True
    streamable: ClassVar[bool] = True

    __slots__ = ()

    def identity(self) -> Hashable:
        return ("pt", self.storage.key, self.offset, self.shape, self.stride, self.dtype)

    @property
    def requires_grad(self) -> bool:
        return bool(self.args[4])

    def _storage(self) -> Hashable:
        return ("pt", self.storage.key)

    def __init__(self, func: type[Global], args: tuple[Any, ...]) -> None:
        super().__init__(func, args)
        v3 = func.name.endswith("v3")
        if len(args) < (7 if v3 else 6) or not isinstance(args[0], StorageRef):
            raise FormatError(f"its pickle calls {func.name} with malformed arguments; the file is corrupt")
        if v3 and not (isinstance(args[6], type) and issubclass(args[6], Global) and args[6].name in DTYPES):
            raise FormatError(f"tensor in storage '{args[0].key}' has unknown dtype {args[6]!r}; the file is corrupt")
        if not v3 and args[0].storage_type.name not in STORAGE_DTYPES:
            raise FormatError(
                f"tensor in storage '{args[0].key}' is stored as {args[0].storage_type.full}, which needs a "
                f"dtype; the file is corrupt"
            )
        if self.dtype in QUANTIZED:
            raise FormatError(
                f"tensor in storage '{args[0].key}' has quantized dtype {self.dtype} without its quantizer; "
                f"the file is corrupt"
            )
        _check_view(func.full, args, dtype=self.dtype)
        for bit in self.math_bits or ():
            if self.dtype not in _BIT_DTYPES[bit]:
                raise FormatError(
                    f"tensor in storage '{args[0].key}' has its {bit} bit set but dtype {self.dtype}, which has no "
                    f"such view; the file is corrupt or crafted"
                )

    @property
    def storage(self) -> StorageRef:
        return self.args[0]  # type: ignore[no-any-return]

    @property
    def offset(self) -> int:
        return int(self.args[1])

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.args[2]
        return shape if type(shape) is tuple else (_ints(shape) or ())  # a tuple was checked to hold ints

    @property
    def stride(self) -> tuple[int, ...]:
        stride = self.args[3]
        return stride if type(stride) is tuple else (_ints(stride) or ())

    @property
    def dtype(self) -> str:
        if self.func.name.endswith("v3"):
            return self.args[6].name  # type: ignore[no-any-return]
        return STORAGE_DTYPES[self.storage.storage_type.name]

    @property
    def math_bits(self) -> dict[str, bool] | None:
        """The conjugate and negative bits (``torch.conj``, ``torch._neg_view``) that torch.save records after the
        hooks: ``{}`` for a plain tensor, ``None`` for one with backward hooks or any other extra state. The
        storage holds the values before the bits are applied; only a torch pickle can say so."""
        if self.args[5]:
            return None
        extra = self.args[7:] if self.func.name.endswith("v3") else self.args[6:]
        if not any(extra):
            return {}
        meta = extra[0]
        if (
            len(extra) == 1
            and type(meta) is dict
            and all(k in _BIT_DTYPES and type(v) is bool for k, v in meta.items())
        ):
            return {k: True for k, v in meta.items() if v}
        return None

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        return contiguous(self.shape, self.stride)

    def prepare_copy(self, files: FileTable, *, allowed: frozenset[str]) -> None:
        """Copied as its bytes only where they are its values, laid out in order (DCP's writer keeps a view)."""
        if not values_as_stored(self):
            raise Fallback(Reason.TENSOR_HOOKS_OR_BITS)
        if not self.is_contiguous():
            raise Fallback(Reason.STRIDED_VIEW_TO_DCP)

    def read(self, holder: Holder) -> Any:
        """Only the bytes the view reaches (a state dict of views into one flat buffer reads each view once)."""
        import torch

        dtype = torch_dtype(torch, self.dtype, source=holder.source)
        out = torch.empty((0,), dtype=dtype)
        if self.numel() == 0:
            return out.reshape(self.shape)
        width = DTYPES[self.dtype].itemsize
        extent = self.offset + 1 + sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True))
        data = holder.storage_bytes(self.storage.key, self.offset * width, (extent - self.offset) * width)
        out.set_(torch.frombuffer(data, dtype=torch.uint8).untyped_storage(), 0, self.shape, self.stride)
        return out

    def read_raw(self, holder: Holder) -> RawTensor | None:
        dtype = DTYPES.get(self.dtype)
        if not (values_as_stored(self) and self.is_contiguous() and dtype is not None and dtype.per_item == 1):
            return None
        if self.numel() == 0:
            return RawTensor(self.dtype, self.shape, bytearray(), holder.source)
        data = holder.storage_bytes(self.storage.key, self.offset * dtype.itemsize, self.numel() * dtype.itemsize)
        return RawTensor(self.dtype, self.shape, data, holder.source)

    def file_span(self, holder: Holder) -> tuple[int, int] | None:
        if not values_as_stored(self) or not self.is_contiguous() or self.dtype not in DTYPES:
            return None
        width = DTYPES[self.dtype].itemsize
        rec = holder.storage_record(self.storage.key)
        start, length = self.offset * width, self.numel() * width
        if start + length > rec.size:  # the reader refused such views already; never copy past a record
            raise FormatError(
                f"{holder.source}: a tensor reaches past its storage record {rec.name}; corrupt or crafted"
            )
        return rec.data_offset + start, length

    @property
    def zip_tensor(self) -> InertTensor:
        return self

    def read_runs(self, reader: RunReader, *, key: str) -> Any:
        """Its one run of the input's storage record (a strided view was refused when it was prepared)."""
        item = DTYPES[self.dtype].itemsize
        start = reader.storage_record(self.storage.key).data_offset + self.offset * item
        return reader.runs([(reader.fd(reader.source), start, self.numel() * item)], self.dtype, self.shape, key=key)


@functools.lru_cache(maxsize=4096)  # shapes repeat (a state dict has a few dozen); bounded for hostile files
def contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a view of ``shape`` and ``strides`` is contiguous (as torch's ``is_contiguous``)."""
    if len(shape) == 1:
        return shape[0] < 2 or strides[0] == 1
    if 0 in shape:  # as torch says: an empty tensor is contiguous whatever its strides
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def tensor(func: type[Global], args: tuple[Any, ...]) -> InertTensor:
    """``InertTensor(func, args)``, with a shortcut for the one shape torch.save writes (same checks, same result)."""
    if len(args) == 6 and func.name == "_rebuild_tensor_v2":
        ref, offset, shape, stride = args[0], args[1], args[2], args[3]
        if type(ref) is StorageRef and type(offset) is int and type(shape) is tuple and type(stride) is tuple:
            dtype = STORAGE_DTYPES.get(ref.storage_type.name)
            if (
                dtype is not None
                and dtype not in QUANTIZED
                and _fits(ref, offset, shape, stride, DTYPES[dtype].itemsize)
            ):
                tensor = _new_tensor(InertTensor)
                tensor.func, tensor.args, tensor.newobj, tensor.has_state, tensor.state = func, args, False, False, None
                return tensor
    return InertTensor(func, args)  # every rule, and the message of the one that fails


_new_tensor = object.__new__


def _fits(ref: StorageRef, offset: int, shape: tuple[Any, ...], stride: tuple[Any, ...], width: int) -> bool:
    """True when _check_view surely accepts this view (False: let it decide and say why)."""
    if len(shape) != len(stride) or not 0 <= offset <= _INT64:
        return False
    numel, extent = 1, offset + 1
    for d, s in zip(shape, stride):  # noqa: B905 - lengths checked above
        if type(d) is not int or type(s) is not int or not 0 <= d <= _INT64 or not 0 <= s <= _INT64:
            return False
        numel *= d  # in order, as torch: a product past 64 bits is refused even when a later size is 0
        if numel > _INT64:
            return False
        extent += (d - 1) * s
    return numel == 0 or (extent * width <= ref.nbytes and numel * width <= ref.nbytes + EXPANDED_LIMIT)


class InertParameter(Inert, TensorRecord):
    """``_rebuild_parameter(data, requires_grad, hooks[, state])``: a Parameter around an InertTensor."""

    on_demand: ClassVar[bool] = True
    streamable: ClassVar[bool] = True

    __slots__ = ()

    def identity(self) -> Hashable:
        return self.data.identity()

    @property
    def requires_grad(self) -> bool:
        return bool(self.args[1])

    def _storage(self) -> Hashable:
        return self.data._storage()

    def __init__(self, func: type[Global], args: tuple[Any, ...]) -> None:
        super().__init__(func, args)
        if not args or not isinstance(args[0], InertTensor):
            raise FormatError("its pickle builds a Parameter around something that is not a tensor; refusing it")

    @property
    def data(self) -> InertTensor:
        return self.args[0]  # type: ignore[no-any-return]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> str:
        return self.data.dtype

    def read(self, holder: Holder) -> Any:
        return self.data.read(holder)  # the tensor, as reading it has always given (not a Parameter)

    def read_raw(self, holder: Holder) -> RawTensor | None:
        return self.data.read_raw(holder)

    def file_span(self, holder: Holder) -> tuple[int, int] | None:
        return self.data.file_span(holder)

    @property
    def zip_tensor(self) -> InertTensor:
        return self.data

    @property
    def is_parameter(self) -> bool:
        return True

    @property
    def parameter_state(self) -> bool:
        return parameter_hooks_or_state(self)

    def read_runs(self, reader: RunReader, *, key: str) -> Any:
        return self.data.read_runs(reader, key=key)

    def prepare_copy(self, files: FileTable, *, allowed: frozenset[str]) -> None:
        if parameter_hooks_or_state(self):
            raise Fallback(Reason.PARAMETER_HOOKS)
        self.data.prepare_copy(files, allowed=allowed)


def tensor_of(value: Any) -> InertTensor:
    """The InertTensor behind a tensor or Parameter record."""
    return value.data if isinstance(value, InertParameter) else value
