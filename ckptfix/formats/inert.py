"""Read and write torch's pickles without executing anything: the one pickle reader of ckptfix.

Globals become immutable stand-ins (new ones for every file), calls become records of the call, persistent ids
become references to storages. Every rule about what a pickle may contain lives here or in the allowlist: the
globals it may name, the shape of a storage reference, each tensor's view staying inside its storage, and limits
on depth and on the size the tree takes once shared references are followed. The writer emits the opcodes
torch's pickler does (protocol 2), so a tree round-trips and torch loads the result.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Iterator
from typing import IO, Any, ClassVar, NoReturn, cast

from ckptfix.errors import CkptfixError, FormatError
from ckptfix.formats import allowlist
from ckptfix.formats.dtypes import DTYPES, QUANTIZED, STORAGE_DTYPES, storage_itemsize

MAX_DEPTH = 1000  # containers nested deeper than this are refused (consumers walk trees recursively)
EXPANDED_LIMIT = 256 << 20  # bytes an expanded (stride-0) view may claim beyond its storage
_INT64 = (1 << 63) - 1
_BASE_NODES = 10_000_000  # plus 8 per pickle byte: the tree's size with shared references counted each time
_VIEW_FUNCS = {"torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
               "torch._utils._rebuild_qtensor"}  # fmt: skip
_TENSOR_FUNCS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}
_PARAM_FUNCS = {"torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}


class _Frozen(type):
    # Stand-ins are classes so that NEWOBJ accepts them; they can be neither renamed nor given state.
    def __call__(cls, *args: Any) -> Any:
        return Inert.make(cast("type[Global]", cls), args)

    def __setattr__(cls, name: str, value: Any) -> NoReturn:
        raise FormatError(f"its pickle tries to change the global {cls.__name__} (a BUILD on a class); refusing it")


class Global(metaclass=_Frozen):
    """A pickle global, never imported: ``module.name`` and nothing else."""

    module: ClassVar[str]
    name: ClassVar[str]
    full: ClassVar[str]

    @staticmethod
    def __setstate__(state: Any) -> NoReturn:
        raise FormatError("its pickle gives state to a global (a BUILD on a class); refusing it")


def make_global(module: str, name: str) -> type[Global]:
    """A new immutable stand-in for ``module.name``."""

    def new(cls: type[Global], *args: Any) -> Inert:
        obj = Inert.make(cls, args)
        obj.newobj = True
        return obj

    namespace = {"module": module, "name": name, "full": f"{module}.{name}", "__new__": new}
    return cast("type[Global]", _Frozen(name, (Global,), namespace))


class StorageRef:
    """A persistent id: the storage ``key``, its class and element count, as the file states them."""

    __slots__ = ("key", "location", "numel", "pid", "storage_type")
    key: str
    location: str
    numel: int
    pid: tuple[Any, ...]
    storage_type: type[Global]

    def __init__(self, pid: tuple[Any, ...]) -> None:
        for name, value in (("pid", pid), ("storage_type", pid[1]), ("key", pid[2]), ("location", pid[3])):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "numel", pid[4])

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise FormatError("its pickle tries to change a storage reference; refusing it")

    def __setstate__(self, state: Any) -> NoReturn:
        raise FormatError("its pickle gives state to a storage reference; refusing it")

    @property
    def nbytes(self) -> int:
        """Size of the storage in bytes (typed storages count elements, untyped ones bytes)."""
        return self.numel * (storage_itemsize(self.storage_type.name) or 1)


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
    width = DTYPES[dtype].itemsize
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
    if extent * width > ref.nbytes:
        raise FormatError(
            f"tensor in storage '{ref.key}' reaches byte {extent * width} of a {ref.nbytes}-byte storage; "
            f"the file is corrupt or crafted to read other records"
        )
    if numel * width > ref.nbytes + EXPANDED_LIMIT:
        raise FormatError(
            f"tensor in storage '{ref.key}' is an expanded view of {numel * width} bytes over {ref.nbytes}; "
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

    @property
    def storage(self) -> StorageRef:
        return self.args[0]  # type: ignore[no-any-return]

    @property
    def offset(self) -> int:
        return int(self.args[1])

    @property
    def shape(self) -> tuple[int, ...]:
        return _ints(self.args[2]) or ()

    @property
    def stride(self) -> tuple[int, ...]:
        return _ints(self.args[3]) or ()

    @property
    def dtype(self) -> str:
        if self.func.name.endswith("v3"):
            return self.args[6].name  # type: ignore[no-any-return]
        return STORAGE_DTYPES[self.storage.storage_type.name]

    @property
    def plain(self) -> bool:
        """No backward hooks and no extra metadata: exactly what torch.save writes for a tensor."""
        extra = self.args[7:] if self.func.name.endswith("v3") else self.args[6:]
        return not self.args[5] and not any(extra)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        if self.numel() == 0:  # as torch says: an empty tensor is contiguous whatever its strides
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


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
        if (
            type(inst) is OrderedDict
            and isinstance(state, dict)
            and all(type(k) is str and not k.startswith("__") for k in state)
        ):
            _check_metadata(state.get("_metadata"))
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
) -> tuple[list[Any], dict[str, StorageRef]]:
    """The inert trees of ``count`` consecutive pickles and their storages by key, every rule checked.

    Refuses (one error listing every offending global) a pickle that names a global outside ``allowed``.
    ``protocol4`` also reads protocol 4's data-only opcodes (torch.save never writes them; DCP metadata does).
    ``as_data`` names globals otherwise refused that this caller reads as records and never builds (the
    DTensor classes, for reassembling shards).
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    trees: list[Any] = []
    storages: dict[str, StorageRef] = {}
    refused: list[str] = []
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
            refused += unpickler.refused
            foreign.update(unpickler.foreign)
            storages.update(unpickler.storages)
    allowlist.refuse([name for name in refused if name not in as_data], source=source)
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
    stack: list[tuple[Any, list[Any] | None]] = [(tree, None)]
    while stack:
        item, kids = stack[-1]
        ident = id(item)
        if kids is None:
            if ident in sizes:
                stack.pop()
                continue
            kids = _children(item)
            if not kids:
                sizes[ident] = 1
                stack.pop()
                continue
            if len(on_path) >= MAX_DEPTH:  # the containers being sized: this one's ancestors (not its siblings)
                raise FormatError(f"{source}: its pickle nests containers more than {MAX_DEPTH} deep; refusing it")
            on_path.add(ident)
            stack[-1] = (item, kids)
            for kid in kids:
                if id(kid) in on_path:
                    raise FormatError(f"{source}: its pickle has a container that contains itself; refusing it")
                if id(kid) not in sizes and _is_container(kid):  # leaves count 1 and are not remembered
                    stack.append((kid, None))
            continue
        total = 1 + sum(sizes.get(id(k), 1) for k in kids)
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
    """Every object reachable from ``obj`` (each once), containers and recipes included."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, InertParameter):
            stack.append(item.args[0])
        elif isinstance(item, InertTensor):
            stack.append(item.storage)  # the rest of a tensor record is numbers, checked when it was read
        else:
            stack.extend(_children(item))


# --- writer --------------------------------------------------------------------------------------------------


class _Pickler:
    """Protocol-2 opcodes for the inert tree, memoized by identity like the standard pickler."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # memoized objects must stay alive so their ids stay unique
        self.by_name: dict[str, type[Global]] = {}
        self._odict = make_global("collections", "OrderedDict")  # made once: a class per call costs 20 µs
        self._encode = make_global("_codecs", "encode")

    def dump(self, obj: Any) -> bytes:
        self.save(obj)
        self.out += b"."
        return bytes(self.out)

    def _memoize(self, obj: Any) -> None:
        idx = len(self.memo)
        self.memo[id(obj)] = idx
        self.keep.append(obj)
        self.out += b"q" + bytes([idx]) if idx < 256 else b"r" + struct.pack("<I", idx)

    def _get(self, obj: Any) -> bool:
        idx = self.memo.get(id(obj))
        if idx is None:
            return False
        self.out += b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)
        return True

    def save(self, obj: Any) -> None:
        out = self.out
        if obj is None:
            out += b"N"
        elif obj is True or obj is False:
            out += b"\x88" if obj else b"\x89"
        elif type(obj) is int:
            if 0 <= obj < 256:
                out += b"K" + bytes([obj])
            elif 0 <= obj < 65536:
                out += b"M" + struct.pack("<H", obj)
            elif -(2**31) <= obj < 2**31:
                out += b"J" + struct.pack("<i", obj)
            else:
                raw = pickle.encode_long(obj)
                out += (b"\x8a" + bytes([len(raw)]) if len(raw) < 256 else b"\x8b" + struct.pack("<i", len(raw))) + raw
        elif type(obj) is float:
            out += b"G" + struct.pack(">d", obj)
        elif type(obj) is str:
            if self._get(obj):
                return
            raw = obj.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(raw)) + raw
            self._memoize(obj)
        elif type(obj) is bytes:
            self._save_call(self._encode, (obj.decode("latin1"), "latin1"))
        elif self._get(obj):
            return
        elif type(obj) is tuple:
            self._save_tuple(obj)
        elif type(obj) is list:
            out += b"]"
            self._memoize(obj)
            self._batch(obj, b"a", b"e")
        elif type(obj) is dict:
            out += b"}"
            self._memoize(obj)
            self._batch(list(obj.items()), b"s", b"u")
        elif type(obj) is OrderedDict:
            self._save_global(self._odict)
            out += b")R"
            self._memoize(obj)
            self._batch(list(obj.items()), b"s", b"u")
            if vars(obj):
                self.save(dict(vars(obj)))
                out += b"b"
        elif isinstance(obj, type) and issubclass(obj, Global):
            self._save_global(obj)
        elif isinstance(obj, StorageRef):
            self.save(obj.pid)
            out += b"Q"
        elif isinstance(obj, Inert):
            self.save(obj.func)
            self.save(obj.args)
            out += b"\x81" if obj.newobj else b"R"
            self._memoize(obj)
            if obj.has_state:
                self.save(obj.state)
                out += b"b"
        else:
            raise TypeError(f"cannot write a {type(obj).__name__} without torch")

    def _save_call(self, func: type[Global], args: tuple[Any, ...]) -> None:
        self.save(func)
        self.save(args)
        self.out += b"R"

    def _save_global(self, glob: type[Global]) -> None:
        first = self.by_name.setdefault(glob.full, glob)  # stand-ins of one name, from several files, written once
        if self._get(first):
            return
        self.out += f"c{glob.module}\n{glob.name}\n".encode()
        self._memoize(first)

    def _save_tuple(self, obj: tuple[Any, ...]) -> None:
        if not obj:
            self.out += b")"
            return
        if len(obj) > 3:
            self.out += b"("
        for item in obj:
            self.save(item)
        self.out += b"t" if len(obj) > 3 else b"\x85\x86\x87"[len(obj) - 1 : len(obj)]
        self._memoize(obj)

    def _batch(self, items: list[Any], single: bytes, many: bytes) -> None:
        pairs = single == b"s"
        for start in range(0, len(items), 1000):
            chunk = items[start : start + 1000]
            if len(chunk) > 1:
                self.out += b"("
            for item in chunk:
                if pairs:
                    self.save(item[0])
                    self.save(item[1])
                else:
                    self.save(item)
            self.out += many if len(chunk) > 1 else single


def dump(tree: Any) -> bytes:
    """The protocol-2 pickle of an inert tree, loadable by ``torch.load(weights_only=True)``.

    Raises TypeError for an object that is not part of an inert tree (the caller's transform put it there).
    """
    return _Pickler().dump(tree)
