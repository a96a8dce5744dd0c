"""Read and write torch's pickles without executing anything: the one pickle reader of ckptfix.

Globals become immutable stand-ins (new ones for every file), calls become records of the call, persistent ids
become references to storages. Every rule about what a pickle may contain lives here or in the allowlist: the
globals it may name, the shape of a storage reference, each tensor's view staying inside its storage, and limits
on depth and on the size the tree takes once shared references are followed. The writer emits the opcodes
torch's pickler does (protocol 2), so a tree round-trips and torch loads the result.
"""

from __future__ import annotations

import _pickle
import functools
import gc
import io
import math
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, ClassVar, NoReturn, cast

from ckptfix.errors import CkptfixError, FormatError
from ckptfix.formats.dtypes import DTYPES, QUANTIZED, STORAGE_DTYPES, nbytes, storage_itemsize
from ckptfix.formats.safety import allowlist, opscan
from ckptfix.formats.safety.depth import MAX_DEPTH

EXPANDED_LIMIT = 256 << 20  # bytes an expanded (stride-0) view may claim beyond its storage
_INT64 = (1 << 63) - 1
# The math bits torch.save records in a tensor's metadata (torch._utils.get_tensor_metadata), and the dtypes each
# applies to: torch asserts on a conjugate bit of a real tensor and cannot resolve a negative bit of the others.
_COMPLEX = frozenset({"complex64", "complex128"})
_NEGATABLE = (
    frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8"}) | _COMPLEX
)
_BIT_DTYPES = {"conj": _COMPLEX, "neg": _NEGATABLE}
_BASE_NODES = 10_000_000  # plus 8 per pickle byte: the tree's size with shared references counted each time
_VIEW_FUNCS = {"torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
               "torch._utils._rebuild_qtensor"}  # fmt: skip
_TENSOR_FUNCS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}
_PARAM_FUNCS = {"torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}


class _Frozen(type):
    # Stand-ins are classes so that NEWOBJ accepts them; they can be neither renamed nor given state.
    def __call__(cls, *args: Any) -> Any:
        return cls.build(cls, args)  # type: ignore[attr-defined]

    def __setattr__(cls, name: str, value: Any) -> NoReturn:
        raise FormatError(f"its pickle tries to change the global {cls.__name__} (a BUILD on a class); refusing it")


class Global(metaclass=_Frozen):
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
    namespace = {"module": module, "name": name, "full": full, "__new__": new, "width": storage_itemsize(name),
                 "build": staticmethod(build)}  # fmt: skip
    return cast("type[Global]", _Frozen(name, (Global,), namespace))


def _nested_class(known: dict[str, type[Global]], allowed: frozenset[str]) -> type[Global]:
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

    return cast("type[Global]", _Frozen("getattr", (Global,), {
        "module": "builtins", "name": "getattr", "full": "builtins.getattr", "width": None,
        "build": staticmethod(build)}))  # fmt: skip


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

    __ckptfix_tensor__: ClassVar[bool] = False
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


class InertTensor(Inert):
    """``_rebuild_tensor_v2/v3(storage, offset, size, stride, requires_grad, hooks[, dtype])``."""

    __ckptfix_tensor__ = True
    __slots__ = ()

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
    def plain(self) -> bool:
        """No backward hooks and no extra metadata: exactly what torch.save writes for a tensor."""
        if len(self.args) == 6:  # _rebuild_tensor_v2 without metadata (v3 has at least 7)
            return not self.args[5]
        extra = self.args[7:] if self.func.name.endswith("v3") else self.args[6:]
        return not self.args[5] and not any(extra)

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


class InertParameter(Inert):
    """``_rebuild_parameter(data, requires_grad, hooks[, state])``: a Parameter around an InertTensor."""

    __ckptfix_tensor__ = True
    __slots__ = ()

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


def tensor_of(value: Any) -> InertTensor:
    """The InertTensor behind a tensor or Parameter record."""
    return value.data if isinstance(value, InertParameter) else value


# The opcodes torch's weights-only unpickler reads (torch/_weights_only_unpickler.py); a file using any other is
# one torch refuses, so this reader refuses it too, before anything is built.
_OPCODES = frozenset(
    {pickle.APPEND, pickle.APPENDS, pickle.BINFLOAT, pickle.BINGET, pickle.BININT, pickle.BININT1, pickle.BININT2,
     pickle.BINPERSID, pickle.BINPUT, pickle.BINUNICODE, pickle.BUILD, pickle.EMPTY_DICT, pickle.EMPTY_LIST,
     pickle.EMPTY_SET, pickle.EMPTY_TUPLE, pickle.GLOBAL, pickle.LONG1, pickle.LONG_BINGET, pickle.LONG_BINPUT,
     pickle.MARK, pickle.NEWFALSE, pickle.NEWOBJ, pickle.NEWTRUE, pickle.NONE, pickle.PROTO, pickle.REDUCE,
     pickle.SETITEM, pickle.SETITEMS, pickle.SHORT_BINSTRING, pickle.STOP, pickle.TUPLE, pickle.TUPLE1,
     pickle.TUPLE2, pickle.TUPLE3}
)  # fmt: skip


def _check_metadata(metadata: Any) -> None:
    # a state dict's _metadata maps module paths to {"version": ...}; torch's load_state_dict relies on that shape
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(
        type(k) is str and isinstance(v, dict) and all(type(f) is str for f in v) for k, v in metadata.items()
    ):
        raise FormatError(
            "a state dict's _metadata is not a mapping of module paths to dicts; the file is corrupt or crafted"
        )


def _odict_state(state: Any) -> bool:
    """Whether a BUILD may give ``state`` to an OrderedDict: attributes by plain names (``_metadata`` checked)."""
    if isinstance(state, dict) and all(type(k) is str and not k.startswith("__") for k in state):
        _check_metadata(state.get("_metadata"))
        return True
    return False


def _foreign(code: int, func: Any) -> Any:
    def load(self: _Unpickler) -> None:
        # read on, so that the refusal can still name every global the file needs, then refuse
        self.foreign.setdefault(code, None)
        func(self)

    return load


class _Unpickler(pickle._Unpickler):  # the Python unpickler, whose opcode table can be wrapped
    dispatch: ClassVar[dict[int, Any]] = {
        code: func if bytes([code]) in _OPCODES else _foreign(code, func)
        for code, func in pickle._Unpickler.dispatch.items()
    }

    def __init__(self, stream: IO[bytes], *, allowed: frozenset[str], legacy: bool) -> None:
        super().__init__(stream)
        self.allowed = allowed
        self.legacy = legacy
        self.refused: list[str] = []
        self.foreign: dict[int, None] = {}  # opcodes torch's weights-only loader does not read
        self.globals: dict[str, type[Global]] = {}  # per file: nothing one file does reaches the next
        self.storages: dict[str, StorageRef] = {}
        self.stack: list[Any] = []  # pickle._Unpickler's own, declared for the type checker

    def load_build(self) -> None:
        # as torch: state only for an OrderedDict (its attributes) or an object of an --allow-global class
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is OrderedDict and _odict_state(state):
            inst.__dict__.update(state)
        elif type(inst) is Inert and inst.func.full not in allowlist.TORCH_DEFAULT:
            inst.__setstate__(state)
        else:
            what = inst.func.full if isinstance(inst, Inert) else type(inst).__name__
            raise FormatError(f"its pickle gives state to {what}, which torch's weights-only loader refuses")

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        full = allowlist.canonical(f"{module}.{name}")
        if full not in self.allowed or full in allowlist.UNSUPPORTED:
            self.refused.append(full)  # keep reading: the refusal lists every global the file needs
        elif full == "builtins.getattr":  # allowed only by the sharded-tensor reader: a nested class's name
            return _nested_class(self.globals, self.allowed)
        if full == "collections.OrderedDict":
            return OrderedDict
        if full not in self.globals:
            mod, _, attr = full.rpartition(".")
            self.globals[full] = make_global(mod, attr)
        return self.globals[full]

    def persistent_load(self, pid: Any) -> Any:
        ref = StorageRef(_checked_pid(pid, legacy=self.legacy))
        known = self.storages.setdefault(ref.key, ref)
        if known.storage_type.full != ref.storage_type.full or known.numel != ref.numel:
            raise FormatError(f"storage '{ref.key}' is declared twice with different types or sizes; refusing it")
        return known  # one object per key, so tensors that share a storage share the reference too


# Protocol 4 adds framing, short strings, memo shortcuts and STACK_GLOBAL (a GLOBAL whose names come from the
# stack, resolved by the same find_class): data-only opcodes that DCP's pickled metadata uses.
_PROTOCOL4 = frozenset({pickle.FRAME, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8, pickle.MEMOIZE,
                        pickle.STACK_GLOBAL, pickle.SHORT_BINBYTES, pickle.BINBYTES, pickle.BINBYTES8})  # fmt: skip


class _Protocol4Unpickler(_Unpickler):
    dispatch: ClassVar[dict[int, Any]] = {
        **_Unpickler.dispatch,
        **{code[0]: pickle._Unpickler.dispatch[code[0]] for code in _PROTOCOL4},
    }


# --- the fast reader ------------------------------------------------------------------------------------------
#
# The C unpickler runs the same hooks as the reader above (find_class, persistent_load, the stand-ins' calls and
# __setstate__), about 20 times faster, but it has no opcode table to restrict and its BUILD is its own. So it is
# only given a pickle that opscan.provable() has walked: opcodes torch reads, and every BUILD's state a container.
# BUILD then reaches an object's __setstate__ (stand-ins, records, storage references and the OrderedDict below
# apply the reference reader's rules) or fails for lack of a __dict__. Whatever it refuses, or anything else it
# cannot prove, is read again by the reference reader, which gives the answer and its message: the fast reader
# only ever accepts what the reference reader accepts, with the same tree.


class _NotProven(Exception):  # noqa: N818 - a signal: read it with the reference reader
    pass


class _CheckedOrderedDict(OrderedDict[Any, Any]):
    """An OrderedDict while the C unpickler runs: its BUILD takes the reference reader's rule."""

    def __setstate__(self, state: Any) -> None:
        if not _odict_state(state):
            raise _NotProven
        self.__dict__.update(state)


class _FastUnpickler(_pickle.Unpickler):
    def __init__(self, data: bytes, *, allowed: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed
        self.globals: dict[str, Any] = {}
        self.storages: dict[str, StorageRef] = {}
        self.legacy = False  # for persistent_load, shared with the reference reader

    def find_class(self, module: str, name: str) -> Any:
        full = allowlist.canonical(f"{module}.{name}")
        if full not in self.allowed or full in allowlist.UNSUPPORTED:
            raise _NotProven  # the reference reader lists every refused global
        if full not in self.globals:
            mod, _, attr = full.rpartition(".")
            self.globals[full] = _CheckedOrderedDict if full == "collections.OrderedDict" else make_global(mod, attr)
        return self.globals[full]

    def persistent_load(self, pid: Any) -> Any:
        # a shortcut for the first reference to a storage in torch.save's form; the rest (repeats, every
        # refusal) by the reference reader's rule
        if type(pid) is tuple and len(pid) == 5:
            tag, kind, key, location, numel = pid
            if (
                tag == "storage"
                and type(kind) is _Frozen
                and cast("type[Global]", kind).width
                and type(key) is str
                and type(location) is str
                and type(numel) is int
                and numel >= 0
                and key not in self.storages
            ):
                ref = self.storages[key] = StorageRef(pid)
                return ref
        return _Unpickler.persistent_load(self, pid)  # type: ignore[arg-type]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building (or writing) a tree of a million containers, none of them
    garbage, would otherwise trigger collections that rescan it again and again.

    On the way out, what was made meanwhile joins the oldest generation unscanned (``gc.freeze`` then
    ``gc.unfreeze`` moves every tracked object there in constant time and resets the count of new ones): a
    plain ``gc.enable`` would have the next allocation scan the whole tree at once. Skipped when the program
    froze objects itself, which ``gc.unfreeze`` would release.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _fast_load(data: bytes, *, allowed: frozenset[str]) -> tuple[Any, dict[str, StorageRef]] | None:
    """The tree and storages of ``data`` read by the C unpickler, or None when not proven to match the reference."""
    if not opscan.provable(data):
        return None
    unpickler = _FastUnpickler(data, allowed=allowed)
    try:
        with gc_paused():
            return unpickler.load(), unpickler.storages
    except Exception:  # any refusal: the reference reader says why
        return None


def _plain_odicts(tree: Any) -> Any:
    """``tree`` with every _CheckedOrderedDict replaced by an OrderedDict, sharing kept.

    Runs after measure(): the tree is acyclic and at most MAX_DEPTH deep. Dicts and lists are updated in place,
    tuples and OrderedDicts rebuilt, so every other object keeps its identity. A plain tensor record keeps its
    own empty hooks as they are (a million conversions for nothing) unless they are also held elsewhere.
    """
    done: dict[int, Any] = {id(_CheckedOrderedDict): OrderedDict}  # the class itself, where a pickle holds it
    keep: list[Any] = []  # the replaced objects stay alive, so their ids are not reused while they are keys
    seen: set[int] = set()
    simple: list[Inert] = []  # tensor records whose only container is their own empty hooks
    other: list[Inert] = []
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:
        obj, ready = stack.pop()
        if id(obj) in done:
            continue
        if not ready:
            stack.append((obj, True))
            for kid in _children(obj):
                if type(kid) is InertTensor or type(kid) is InertParameter:
                    if id(kid) not in seen:
                        seen.add(id(kid))
                        if _own_empty_hooks(kid):
                            simple.append(kid)
                        else:
                            other.append(kid)
                            stack.append((kid.args, False))
                elif type(kid) not in _LEAVES and id(kid) not in done and _is_container(kid):
                    stack.append((kid, False))
            continue
        done[id(obj)] = _rebuilt(obj, done)
        keep.append(obj)
    for record in simple:
        hooks = done.get(id(record.args[5]))
        if hooks is not None and hooks is not record.args[5]:  # held elsewhere too: one converted object, shared
            record.args = (*record.args[:5], hooks)
    for record in other:
        record.args = done.get(id(record.args), record.args)
    return done.get(id(tree), tree)


def _own_empty_hooks(record: Inert) -> bool:
    """A torch.save tensor record whose only container argument is an empty hooks dict."""
    args = record.args
    return type(record) is InertTensor and len(args) == 6 and type(args[5]) is _CheckedOrderedDict and not args[5] \
        and not vars(args[5])  # fmt: skip


def _rebuilt(obj: Any, done: dict[int, Any]) -> Any:
    def new(value: Any) -> Any:
        return done.get(id(value), value)

    if isinstance(obj, _CheckedOrderedDict):
        out: OrderedDict[Any, Any] = OrderedDict(obj)
        _renew(out, done)
        out.__dict__.update((k, new(v)) for k, v in vars(obj).items())
        return out
    if isinstance(obj, dict):
        _renew(obj, done)
        for key, value in vars(obj).items() if isinstance(obj, OrderedDict) else ():
            setattr(obj, key, new(value))
        return obj
    if isinstance(obj, list):
        obj[:] = [new(v) for v in obj]
        return obj
    if isinstance(obj, tuple):
        items = tuple(new(v) for v in obj)
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else items
    if isinstance(obj, Inert):
        obj.args = new(obj.args)
        obj.state = new(obj.state)
    return obj


def _renew(mapping: dict[Any, Any], done: dict[int, Any]) -> None:
    """Replace, in place and in order, the keys and values ``done`` maps to new objects."""
    replaced = done.keys()
    if not replaced.isdisjoint(map(id, mapping)):  # a key replaced (the OrderedDict class as a key)
        items = [(done.get(id(k), k), done.get(id(v), v)) for k, v in mapping.items()]
        mapping.clear()
        mapping.update(items)
        return
    if replaced.isdisjoint(map(id, mapping.values())):  # a state dict of tensors: decided in C
        return
    for key, value in mapping.items():
        renewed = done.get(id(value), value)
        if renewed is not value:
            mapping[key] = renewed


def _checked_pid(pid: Any, *, legacy: bool) -> tuple[Any, ...]:
    size = 6 if legacy else 5
    if not isinstance(pid, tuple) or len(pid) != size or pid[0] != "storage":
        raise FormatError(f"unsupported persistent id {_short(pid)}; the file was not written by torch.save")
    _, kind, key, location, numel = pid[:5]
    if not (isinstance(kind, type) and issubclass(kind, Global)) or storage_itemsize(kind.name) is None:
        raise FormatError(f"storage {_short(key)} has unknown type {_short(kind)}; the file is corrupt")
    if type(key) is not str or type(location) is not str or type(numel) is not int or numel < 0:
        raise FormatError(f"malformed storage reference {_short(pid)}; the file is corrupt")
    return pid


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load(
    data: bytes | IO[bytes],
    *,
    source: str,
    allowed: frozenset[str],
    count: int = 1,
    legacy: bool = False,
    protocol4: bool = False,
    as_data: frozenset[str] = frozenset(),
    refused: list[str] | None = None,
    plain: bool = True,
) -> tuple[list[Any], dict[str, StorageRef]]:
    """The inert trees of ``count`` consecutive pickles and their storages by key, every rule checked.

    Refuses (one error listing every offending global) a pickle that names a global outside ``allowed``.
    ``protocol4`` also reads protocol 4's data-only opcodes (torch.save never writes them; DCP metadata does).
    ``as_data`` names globals otherwise refused that this caller reads as records and never builds (the
    DTensor classes, for reassembling shards). ``refused``, when given, receives the names outside ``allowed``
    instead of a refusal: their records stay inert stand-ins, and the caller decides (formats/torchio/opaque.py).
    ``plain=False`` may leave OrderedDicts as the subclass the C unpickler built them as, for a caller that only
    writes the tree back (the fast path): replacing them is a pass over the tree, 0.7 s for a million tensors.
    """
    if isinstance(data, bytes) and count == 1 and not legacy and not protocol4 and not as_data:
        fast = _fast_load(data, allowed=allowed)
        if fast is not None:
            measure(fast[0], budget=_BASE_NODES + 8 * len(data), source=source)
            return [_plain_odicts(fast[0]) if plain else fast[0]], fast[1]
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    trees: list[Any] = []
    storages: dict[str, StorageRef] = {}
    names: list[str] = []
    foreign: dict[int, None] = {}
    for _ in range(count):
        unpickler = (_Protocol4Unpickler if protocol4 else _Unpickler)(stream, allowed=allowed, legacy=legacy)
        try:
            trees.append(unpickler.load())
        except CkptfixError as e:
            raise type(e)(f"{source}: {e}") from e
        except RecursionError as e:
            raise FormatError(f"{source}: its pickle nests deeper than Python can follow; refusing it") from e
        except Exception as e:  # a damaged pickle surfaces as any of a dozen exception types
            if any(allowlist.can_run_code(name) for name in unpickler.refused):
                allowlist.refuse(unpickler.refused, source=source)  # say it is dangerous, not merely damaged
            raise FormatError(
                f"{source}: its pickle is corrupt ({type(e).__name__}: {_first(e)}); re-download or re-save it"
            ) from e
        finally:
            names += unpickler.refused
            foreign.update(unpickler.foreign)
            storages.update(unpickler.storages)
    names = [name for name in names if name not in as_data]
    if refused is None or foreign:  # a pickle torch would not read at all: its globals are refused first
        allowlist.refuse(names, source=source)
    else:
        refused += names
    if foreign:
        raise FormatError(
            f"{source}: its pickle uses opcodes {', '.join(repr(bytes([c])) for c in foreign)}, which torch's "
            f"weights-only loader does not read (pickle protocol > 2?); re-save it with torch.save"
        )
    budget = _BASE_NODES + 8 * _length(data)
    for tree in trees:
        measure(tree, budget=budget, source=source)
    return trees, storages


def _length(data: bytes | IO[bytes]) -> int:
    return len(data) if isinstance(data, bytes) else data.tell()


def _first(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text if len(text) < 160 else text[:157] + "..."


def _children(item: Any) -> list[Any]:
    if isinstance(item, dict):
        kids = [*item.keys(), *item.values()]
        extra = getattr(item, "__dict__", None)  # _metadata of an OrderedDict
        return kids + list(extra.values()) if extra else kids
    if isinstance(item, (list, tuple)):
        return list(item)
    if isinstance(item, Inert) and not item.__ckptfix_tensor__:
        return [item.args, item.state] if item.has_state else [item.args]
    return []


def _is_container(item: Any) -> bool:
    return isinstance(item, (dict, list, tuple)) or (isinstance(item, Inert) and not item.__ckptfix_tensor__)


def measure(tree: Any, *, budget: int, source: str) -> int:
    """The tree's size with shared references counted each time they are reached; refuse cycles, depth, blow-up.

    Consumers (transforms, diff, the writers) walk trees recursively, so a DAG of shared lists that is small in
    the file but huge when followed, a list that contains itself, or 10^5 levels of nesting would hang or crash
    them. Linear in the file: each object is sized once (memo) and tensors count as one.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    # a container being sized holds (number of children, the children that are containers)
    stack: list[tuple[Any, tuple[int, list[Any]] | None]] = [(tree, None)]
    while stack:
        item, kids = stack[-1]
        ident = id(item)
        if kids is None:
            if ident in sizes:
                stack.pop()
                continue
            children = _children(item)
            if not children:
                sizes[ident] = 1
                stack.pop()
                continue
            if len(on_path) >= MAX_DEPTH:  # the containers being sized: this one's ancestors (not its siblings)
                raise FormatError(f"{source}: its pickle nests containers more than {MAX_DEPTH} deep; refusing it")
            on_path.add(ident)
            containers: list[Any] = []  # filled below, before any child is sized
            stack[-1] = (item, (len(children), containers))
            for kid in children:
                kind = type(kid)
                if kind in _LEAVES or kind is InertTensor or kind is InertParameter:
                    continue  # counts 1 and holds nothing to follow: a state dict's keys and tensors, decided fast
                if id(kid) in on_path:
                    raise FormatError(f"{source}: its pickle has a container that contains itself; refusing it")
                if _is_container(kid):
                    containers.append(kid)
                    if id(kid) not in sizes:  # a shared container is sized once
                        stack.append((kid, None))
            continue
        count, containers = kids
        total = 1 + count - len(containers) + sum(sizes.get(id(k), 1) for k in containers)
        if total > budget:
            raise FormatError(
                f"{source}: its pickle shares containers so often that following them visits more than {budget} "
                f"objects; refusing it"
            )
        sizes[ident] = total
        on_path.discard(ident)
        stack.pop()
    return sizes.get(id(tree), 1)


def walk(obj: Any) -> Iterator[Any]:
    """Every object reachable from ``obj``: containers and records once each, leaves (numbers, strings, storage
    references) once per place that holds them."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _LEAVES:
            yield item
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if kind is InertTensor or kind is InertParameter:
            # a Parameter's tensor; a tensor's storage (the rest of its record is numbers, checked when read)
            stack.append(item.args[0])
        else:
            stack.extend(_children(item))


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, complex, StorageRef})


def records(obj: Any) -> Iterator[Inert]:
    """Every record reachable from ``obj`` (tensors, Parameters, other calls), once each: :func:`walk` without
    the leaves, which a state dict of a million string keys would yield for nothing."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _LEAVES or id(item) in seen:
            continue
        seen.add(id(item))
        if kind is InertTensor:
            yield item
        elif kind is InertParameter:
            yield item
            stack.append(item.args[0])
        elif isinstance(item, dict):
            if set(map(type, item)) - _LEAVES:  # keys are strings, but need not be
                stack.extend(item)
            stack.extend(item.values())
            extra = getattr(item, "__dict__", None)  # _metadata of an OrderedDict
            if extra:
                stack.extend(extra.values())
        else:
            if isinstance(item, Inert):
                yield item
            stack.extend(_children(item))


# --- writer --------------------------------------------------------------------------------------------------


_PUT = [b"q" + bytes([i]) for i in range(256)]
_GET = [b"h" + bytes([i]) for i in range(256)]
_BYTE = [b"K" + bytes([i]) for i in range(256)]
_U32 = struct.Struct("<I").pack
_TUPLE_END = (b")", b"\x85", b"\x86", b"\x87")  # EMPTY_TUPLE, TUPLE1..3: no MARK needed


def _plain_record(args: tuple[Any, ...], newobj: bool) -> bool:
    """Whether a tensor record is exactly what torch.save pickles (then _save_tensor writes it directly)."""
    if len(args) != 6 or newobj:
        return False
    ref, offset, shape, stride, grad, hooks = args
    if type(ref) is not StorageRef:
        return False
    pid = ref.pid
    return (
        type(offset) is int
        and type(shape) is tuple
        and type(stride) is tuple
        and type(grad) is bool
        and (type(hooks) is OrderedDict or type(hooks) is _CheckedOrderedDict)
        and not hooks
        and not vars(hooks)
        and len(pid) == 5
        and type(pid[0]) is str
        and type(pid[1]) is _Frozen
        and type(pid[2]) is str
        and type(pid[3]) is str
        and type(pid[4]) is int
    )


def _int_bytes(obj: int) -> bytes:
    if 0 <= obj < 256:
        return _BYTE[obj]
    if 0 <= obj < 65536:
        return b"M" + struct.pack("<H", obj)
    if -(2**31) <= obj < 2**31:
        return b"J" + struct.pack("<i", obj)
    raw = pickle.encode_long(obj)
    return (b"\x8a" + bytes([len(raw)]) if len(raw) < 256 else b"\x8b" + struct.pack("<i", len(raw))) + raw


class _Pickler:
    """Protocol-2 opcodes for the inert tree, memoized by identity like the standard pickler.

    Objects whose identity matters (containers, records, storages) and strings (so that a string shared a million
    times is written once) are memoized; tuples of numbers and a plain tensor's empty hooks are not (sharing them
    or not makes no difference). The memo maps an object's id to the opcode that gets it back.
    """

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, bytes] = {}
        self.keep: list[Any] = []  # memoized objects must stay alive so their ids stay unique
        self.by_name: dict[str, type[Global]] = {}
        self.ints: dict[tuple[int, ...], bytes] = {}  # sizes and strides already encoded: shapes repeat
        self.storages: list[str] = []  # storage keys in the order a reader first meets them
        self._odict = make_global("collections", "OrderedDict")  # made once: a class per call costs 20 µs
        self._encode = make_global("_codecs", "encode")
        self._dispatch: dict[type, Callable[[Any], None]] = {
            str: self._save_str, int: self._save_int, InertTensor: self._save_tensor, tuple: self._save_tuple,
            type(None): self._save_none, bool: self._save_bool, float: self._save_float, bytes: self._save_bytes,
            list: self._save_list, dict: self._save_dict, OrderedDict: self._save_odict,
            _CheckedOrderedDict: self._save_odict, StorageRef: self._save_ref, Inert: self._save_inert,
            InertParameter: self._save_inert, _Frozen: self._save_global,
        }  # fmt: skip

    def dump(self, obj: Any) -> bytes:
        self.save(obj)
        self.out += b"."
        return bytes(self.out)

    def save(self, obj: Any) -> None:
        save = self._dispatch.get(type(obj))
        if save is None:
            raise TypeError(f"cannot write a {type(obj).__name__} without torch")
        save(obj)

    def _put(self, obj: Any) -> bytes:
        """Memoize ``obj``; returns the PUT opcode to write after it."""
        idx = len(self.memo)
        self.keep.append(obj)
        if idx < 256:
            self.memo[id(obj)] = _GET[idx]
            return _PUT[idx]
        self.memo[id(obj)] = b"j" + _U32(idx)
        return b"r" + _U32(idx)

    def _get(self, obj: Any) -> bool:
        got = self.memo.get(id(obj))
        if got is None:
            return False
        self.out += got
        return True

    def _save_none(self, obj: None) -> None:
        self.out += b"N"

    def _save_bool(self, obj: bool) -> None:
        self.out += b"\x88" if obj else b"\x89"

    def _save_int(self, obj: int) -> None:
        self.out += _int_bytes(obj)

    def _save_float(self, obj: float) -> None:
        self.out += b"G" + struct.pack(">d", obj)

    def _save_str(self, obj: str) -> None:
        got = self.memo.get(id(obj))
        if got is None:
            raw = obj.encode("utf-8", "surrogatepass")
            got = b"X" + _U32(len(raw)) + raw + self._put(obj)
        self.out += got

    def _save_bytes(self, obj: bytes) -> None:
        self.save(self._encode)
        self.save((obj.decode("latin1"), "latin1"))
        self.out += b"R"

    def _save_tuple(self, obj: tuple[Any, ...]) -> None:
        if self._get(obj):
            return
        if len(obj) > 3:
            self.out += b"("
        for item in obj:
            self.save(item)
        self.out += b"t" if len(obj) > 3 else _TUPLE_END[len(obj)]
        if obj:
            self.out += self._put(obj)

    def _ints(self, obj: tuple[Any, ...]) -> bytes:
        """A tuple of sizes or strides, not memoized (numbers only: sharing it or not makes no difference)."""
        got = self.ints.get(obj)  # a tensor record's sizes are ints by construction (the reader checks them)
        if got is None:
            if not all(type(v) is int for v in obj):
                raise TypeError("a tensor's sizes or strides are not integers")
            items = b"".join(map(_int_bytes, obj))
            got = (b"(" + items + b"t") if len(obj) > 3 else items + _TUPLE_END[len(obj)]
            self.ints[obj] = got
        return got

    def _save_list(self, obj: list[Any]) -> None:
        if self._get(obj):
            return
        self.out += b"]" + self._put(obj)
        self._batch(obj, b"a", b"e")

    def _save_dict(self, obj: dict[Any, Any]) -> None:
        if self._get(obj):
            return
        self.out += b"}" + self._put(obj)
        self._batch(list(obj.items()), b"s", b"u")

    def _save_odict(self, obj: OrderedDict[Any, Any]) -> None:
        if self._get(obj):
            return
        self._save_global(self._odict)
        self.out += b")R" + self._put(obj)
        self._batch(list(obj.items()), b"s", b"u")
        if vars(obj):
            self.save(dict(vars(obj)))
            self.out += b"b"

    def _save_global(self, glob: type[Global]) -> None:
        self.out += self._global(glob)

    def _global(self, glob: type[Global]) -> bytes:
        got = self.memo.get(id(glob))
        if got is not None:
            return got
        first = self.by_name.setdefault(glob.full, glob)  # stand-ins of one name, from several files, written once
        got = self.memo.get(id(first))
        if got is None:
            got = f"c{glob.module}\n{glob.name}\n".encode() + self._put(first)
        if first is not glob:
            self.keep.append(glob)
            self.memo[id(glob)] = self.memo[id(first)]
        return got

    def _save_ref(self, obj: StorageRef) -> None:
        if id(obj.pid) not in self.memo:
            self.storages.append(obj.key)
        self.save(obj.pid)
        self.out += b"Q"

    def _save_inert(self, obj: Inert) -> None:
        if self._get(obj):
            return
        self.save(obj.func)
        self.save(obj.args)
        self.out += (b"\x81" if obj.newobj else b"R") + self._put(obj)
        if obj.has_state:
            self.save(obj.state)
            self.out += b"b"

    def _save_tensor(self, obj: InertTensor) -> None:
        # torch.save's tensor record written piece by piece: it is most of what a big state dict holds
        memo = self.memo
        args = obj.args
        if id(obj) in memo or not _plain_record(args, obj.newobj):
            self._save_inert(obj)  # a tied weight (memo hit) or anything unusual
            return
        pid = args[0].pid
        ref = memo.get(id(pid))
        if ref is None:  # the first reference to this storage: its persistent id in full
            key = memo.get(id(pid[2]))
            if key is None:  # not memoized: a storage's name is in its one persistent id (the pid is memoized)
                raw = pid[2].encode("utf-8", "surrogatepass")
                key = b"X" + _U32(len(raw)) + raw
            tag = memo.get(id(pid[0])) or self._str_bytes(pid[0])
            loc = memo.get(id(pid[3])) or self._str_bytes(pid[3])
            ref = b"(" + tag + self._global(pid[1]) + key + loc + _int_bytes(pid[4]) + b"t" + self._put(pid)
            self.storages.append(pid[2])
        offset, shape, stride = args[1], args[2], args[3]
        ints = self.ints
        out = self.out
        out += memo.get(id(obj.func)) or self._global(obj.func)  # after the storage's: memo numbers follow
        out += b"("
        out += ref
        out += b"Q"
        out += _BYTE[offset] if 0 <= offset < 256 else _int_bytes(offset)
        out += ints.get(shape) or self._ints(shape)
        out += ints.get(stride) or self._ints(stride)
        out += b"\x88" if args[4] else b"\x89"
        out += memo.get(id(self._odict)) or self._global(self._odict)
        out += b")RtR"  # torch's empty hooks, written afresh; the args tuple; the call
        idx = len(memo)  # self._put(obj), inline
        self.keep.append(obj)
        if idx < 256:
            memo[id(obj)] = _GET[idx]
            out += _PUT[idx]
        else:
            memo[id(obj)] = b"j" + _U32(idx)
            out += b"r" + _U32(idx)

    def _str_bytes(self, obj: str) -> bytes:
        raw = obj.encode("utf-8", "surrogatepass")
        return b"X" + _U32(len(raw)) + raw + self._put(obj)

    def _batch(self, items: list[Any], single: bytes, many: bytes) -> None:
        save = self.save
        pairs = single == b"s"
        for start in range(0, len(items), 1000):
            chunk = items[start : start + 1000]
            if len(chunk) > 1:
                self.out += b"("
            if pairs:
                for key, value in chunk:
                    if type(key) is str:  # a state dict's key, written here rather than through save()
                        # and not memoized: a string's identity means nothing, and a memo of a million keys
                        # is a table too large for the caches that every later look-up then misses
                        raw = key.encode("utf-8", "surrogatepass")
                        self.out += b"X" + _U32(len(raw)) + raw
                    else:
                        save(key)
                    if type(value) is InertTensor:
                        self._save_tensor(value)
                    else:
                        save(value)
            else:
                for item in chunk:
                    save(item)
            self.out += many if len(chunk) > 1 else single


def dump(tree: Any) -> bytes:
    """The protocol-2 pickle of an inert tree, loadable by ``torch.load(weights_only=True)``.

    Raises TypeError for an object that is not part of an inert tree (the caller's transform put it there).
    """
    return dump_ordered(tree)[0]


def dump_ordered(tree: Any) -> tuple[bytes, list[str]]:
    """:func:`dump`, and the keys of the storages it refers to in the order torch's reader meets them."""
    pickler = _Pickler()
    try:
        with gc_paused():
            return pickler.dump(tree), pickler.storages
    finally:
        # its dispatch table of bound methods makes it a reference cycle: its memo and every object it keeps
        # would otherwise wait for the garbage collector (40 MB for 100k tensors)
        pickler.memo.clear()
        pickler.keep.clear()
        pickler._dispatch.clear()
