"""Read and write torch's ``data.pkl`` without executing anything.

Globals become inert stand-ins, calls become records of the call, persistent ids stay references to storage
records. Only globals on torch's weights-only allowlist are accepted; a global that can run code raises
:class:`UnsafeCheckpointError`, any other unknown one hands over to the torch path. The writer emits the
same opcodes torch's pickler does (protocol 2), so the tree round-trips and torch loads the result.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, cast

from ckptfix.errors import CkptfixError, FormatError
from ckptfix.formats.safety import ITEMSIZE, STORAGE_DTYPES
from ckptfix.stream.fallback import Fallback

_DTYPE_GLOBALS = {f"torch.{d}" for d in ITEMSIZE}
_TENSOR_FUNCS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3"}
_PARAM_FUNCS = {"torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}
# The part of torch's weights-only allowlist this reader understands; the rest goes through torch.
KNOWN_GLOBALS = frozenset(
    {"collections.OrderedDict", "collections.Counter", "_codecs.encode", "builtins.bytearray", "builtins.set",
     "builtins.complex", "torch.Size", "torch.device", "torch.storage.UntypedStorage",
     *(f"torch.{s}" for s in STORAGE_DTYPES), *_DTYPE_GLOBALS, *_TENSOR_FUNCS, *_PARAM_FUNCS}
)  # fmt: skip


class Global:
    """A pickle global, never imported: ``module.name`` and nothing else."""

    module: ClassVar[str]
    name: ClassVar[str]
    full: ClassVar[str]


class _GlobalMeta(type):
    # Globals are classes so that NEWOBJ accepts them; calling one (REDUCE) records the call.
    def __call__(cls, *args: Any) -> Any:
        return Inert.make(cast("type[Global]", cls), args)


_GLOBALS: dict[str, type[Global]] = {}


def make_global(module: str, name: str) -> type[Global]:
    """The one stand-in class for ``module.name``."""
    full = f"{module}.{name}"
    if full not in _GLOBALS:

        def new(cls: type[Global], *args: Any) -> Inert:
            obj = Inert.make(cls, args)
            obj.newobj = True
            return obj

        _GLOBALS[full] = cast(
            "type[Global]", _GlobalMeta(name, (Global,), {"module": module, "name": name, "full": full, "__new__": new})
        )
    return _GLOBALS[full]


class StorageRef:
    """A persistent id: the storage record ``data/<key>`` of the archive."""

    __slots__ = ("key", "location", "numel", "pid", "storage_type")

    def __init__(self, pid: tuple[Any, ...]) -> None:
        if len(pid) != 5 or pid[0] != "storage" or not isinstance(pid[2], str) or not isinstance(pid[4], int):
            raise Fallback(f"unsupported persistent id {pid!r}")
        self.pid = pid
        self.storage_type: type[Global] = pid[1]
        self.key: str = pid[2]
        self.location: str = pid[3]
        self.numel: int = pid[4]

    @property
    def nbytes(self) -> int:
        """Size of the storage in bytes (typed storages count elements, untyped ones bytes)."""
        dtype = STORAGE_DTYPES.get(self.storage_type.name)
        return self.numel * (ITEMSIZE[dtype] if dtype else 1)


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
        return Inert(func, args)

    def __setstate__(self, state: Any) -> None:
        self.has_state = True
        self.state = state

    def __repr__(self) -> str:
        return f"<inert {self.func.full}{self.args!r}>"


class InertTensor(Inert):
    """``_rebuild_tensor_v2/v3(storage, offset, size, stride, requires_grad, hooks[, dtype])``."""

    __ckptfix_tensor__ = True
    __slots__ = ()

    def __init__(self, func: type[Global], args: tuple[Any, ...]) -> None:
        super().__init__(func, args)
        v3 = func.name.endswith("v3")
        if len(args) < (7 if v3 else 6) or not isinstance(args[0], StorageRef) or args[5]:
            raise Fallback(f"tensor record {func.name} with unexpected arguments")
        if v3 and not (isinstance(args[6], type) and issubclass(args[6], Global) and args[6].full in _DTYPE_GLOBALS):
            raise Fallback(f"tensor with dtype {args[6]!r}")
        if len(args) > (7 if v3 else 6) and args[-1]:
            raise Fallback("tensor with extra metadata")
        if not v3 and args[0].storage_type.name not in STORAGE_DTYPES:
            raise Fallback(f"tensor stored as {args[0].storage_type.full}")

    @property
    def storage(self) -> StorageRef:
        return self.args[0]  # type: ignore[no-any-return]

    @property
    def offset(self) -> int:
        return int(self.args[1])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.args[2])

    @property
    def stride(self) -> tuple[int, ...]:
        return tuple(self.args[3])

    @property
    def dtype(self) -> str:
        if self.func.name.endswith("v3"):
            return self.args[6].name  # type: ignore[no-any-return]
        return STORAGE_DTYPES[self.storage.storage_type.name]

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
            raise Fallback("Parameter around something that is not a plain tensor")

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


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, *, on_unknown: Callable[[str], None]) -> None:
        super().__init__(io.BytesIO(data))
        self.on_unknown = on_unknown
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        # torch pickles with protocol 2, so Python 2 names (__builtin__.set) are mapped as torch maps them.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if full == "collections.OrderedDict":
            return OrderedDict
        if full not in KNOWN_GLOBALS:
            self.on_unknown(full)
            raise Fallback(f"global {full} is not handled by the fast path")
        return make_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple):
            raise Fallback(f"unsupported persistent id {pid!r}")
        ref = StorageRef(pid)
        # One object per storage key, so tensors that share a storage share the reference too.
        return self.storages.setdefault(ref.key, ref)


def load(data: bytes, *, source: str, on_unknown: Callable[[str], None]) -> tuple[Any, dict[str, StorageRef]]:
    """The inert tree of a ``data.pkl`` and its storages by key. ``on_unknown(name)`` may raise to refuse."""
    unpickler = _Unpickler(data, on_unknown=on_unknown)
    try:
        tree = unpickler.load()
    except (Fallback, CkptfixError):
        raise
    except Exception as e:  # a damaged pickle surfaces as any of a dozen exception types
        raise FormatError(
            f"{source}: record data.pkl is corrupt ({type(e).__name__}: {e}); re-download or re-save it"
        ) from e
    return tree, unpickler.storages


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
        if isinstance(item, dict):
            stack.extend(item.values())
            stack.extend(item.keys())
            stack.extend(vars(item).values() if hasattr(item, "__dict__") else ())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, Inert):
            stack.append(item.args)
            if item.has_state:
                stack.append(item.state)


# --- writer --------------------------------------------------------------------------------------------------


class _Pickler:
    """Protocol-2 opcodes for the inert tree, memoized by identity like the standard pickler."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # memoized objects must stay alive so their ids stay unique

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
            self._save_call(make_global("_codecs", "encode"), (obj.decode("latin1"), "latin1"))
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
            self._save_global(make_global("collections", "OrderedDict"))
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
            raise Fallback(f"cannot write a {type(obj).__name__} without torch")

    def _save_call(self, func: type[Global], args: tuple[Any, ...]) -> None:
        self.save(func)
        self.save(args)
        self.out += b"R"

    def _save_global(self, glob: type[Global]) -> None:
        if self._get(glob):
            return
        self.out += f"c{glob.module}\n{glob.name}\n".encode()
        self._memoize(glob)

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
    """The protocol-2 pickle of an inert tree, loadable by ``torch.load(weights_only=True)``."""
    return _Pickler().dump(tree)
