"""Write a copy of a torch checkpoint that plain ``torch.load(weights_only=True)`` opens, keeping what is data.

The pickle is read inertly (nothing imported or called), every global allowed to stay a record. The tree is then
rewritten with what torch's weights-only loader reads by default: an ``argparse.Namespace`` becomes a dict, a
``pathlib`` path a string, numpy arrays tensors (arrays of strings nested lists) and numpy scalars Python numbers
(rebuilt here from the bytes the pickle holds: numpy is neither imported nor called), ``Decimal``/``Fraction``/
``UUID``/``datetime`` values strings, a ``frozenset`` a set. Every other object, and anything that can run code,
is dropped and listed with the reason.
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import struct
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.output.atomic import PathLike, check_output
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import is_record
from ckptfix.formats.registry import detect_format, write
from ckptfix.formats.safety import allowlist
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.torchio.materialize import NotBuilt, materialize
from ckptfix.formats.torchio.torchfile import changed_while_reading, file_identity
from ckptfix.formats.torchzip.reader import read_torch_zip
from ckptfix.signature import strict_keywords

# numpy dtype strings (kind and size) -> torch dtype, with the struct format of one element
_NUMPY = {
    "f8": ("float64", "d"),
    "f4": ("float32", "f"),
    "f2": ("float16", "e"),
    "i8": ("int64", "q"),
    "i4": ("int32", "i"),
    "i2": ("int16", "h"),
    "i1": ("int8", "b"),
    "u8": ("uint64", "Q"),
    "u4": ("uint32", "I"),
    "u2": ("uint16", "H"),
    "u1": ("uint8", "B"),
    "b1": ("bool", "?"),
    "c8": ("complex64", "ff"),
    "c16": ("complex128", "dd"),
}
_RECONSTRUCT = {f"{m}.multiarray._reconstruct" for m in ("numpy.core", "numpy._core")}
_SCALAR = {f"{m}.multiarray.scalar" for m in ("numpy.core", "numpy._core")}
_PATHS = {f"pathlib.{c}" for c in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")}
_NOT_READ = "an object of a class torch's weights-only loader does not build"
# Lists and strings that arrays of strings may become, all together: a few per byte of the file. An array's shape
# is a count in its pickle, not bytes in it: (3_000_000, 0) would be three million empty lists from a 1 KB file.
_TEXT_NODES_BASE = 1 << 16
_TEXT_NODES_PER_BYTE = 16


@dataclass(frozen=True)
class Dropped:
    """One object left out of the copy: where it was, what it was, and why."""

    where: str
    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what} ({self.why})"


@dataclass
class Sanitized:
    """What :func:`sanitize` did: objects dropped, and values rewritten as plain data (``"argparse.Namespace ->
    dict": 3``)."""

    dropped: list[Dropped] = field(default_factory=list)
    converted: Counter[str] = field(default_factory=Counter)

    def to_json(self, src: str, dst: str) -> dict[str, Any]:
        """``sanitize --json`` (docs/json.md): what was rewritten (sorted) and what was dropped, where and why."""
        return {
            "input": src,
            "output": dst,
            "converted": dict(sorted(self.converted.items())),
            "dropped": [{"where": d.where, "what": d.what, "why": d.why} for d in self.dropped],
        }


@dataclass(frozen=True)
class _Array:
    """A numpy array read from its pickle: built as a tensor by :func:`_tensor`."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    fortran: bool


class _Drop(Exception):  # noqa: N818 - a signal: leave this object out, for this reason
    pass


class _TooBig(Exception):  # noqa: N818 - a signal: refuse the file, naming this key
    pass


@strict_keywords
@deep
def sanitize(src: PathLike, dst: PathLike, *, overwrite: bool = False) -> Sanitized:
    """Write ``dst``, a copy of torch checkpoint ``src`` that ``torch.load(weights_only=True)`` opens.

    Nothing of ``src`` is run. Returns what was dropped (and why) and what was rewritten; ``dst`` is written
    atomically, in the format its extension names; an existing ``dst`` is refused unless ``overwrite=True``.

    >>> result = ckptfix.sanitize("epoch_12.pth", "epoch_12.clean.pth")
    >>> [str(d) for d in result.dropped]   # ["message_hub['log_scalars']['train/loss']: mmengine... (...)"]
    """
    from ckptfix.formats.deepspeed.files import CONVERT_THE_RUN
    from ckptfix.formats.paths import output_format
    from ckptfix.formats.rankfile import refuse_rank_file

    source = os.fspath(src)
    fmt = detect_format(src)
    if fmt != "torch-zip":
        kind = "holds no pickle" if fmt == "safetensors" else "is not a torch zip file (torch.save since 1.6)"
        raise FormatError(f"{source}: {kind}; sanitize rewrites the pickle of a torch zip checkpoint")
    out_fmt = output_format(dst)
    check_output(dst, inputs=(src,), overwrite=overwrite)
    result = Sanitized()
    with open(source, "rb") as f:
        fd = f.fileno()
        before = file_identity(fd)
        z = read_torch_zip(fd, source, allowed=allowlist.TORCH_DEFAULT, verify=True, refused=[])
        # a lone ZeRO-3 module file loads with weights_only as it is: a copy would only pass its placeholders on
        refuse_rank_file(z.tree, source=source, model=False, instead=CONVERT_THE_RUN)
        budget = _TEXT_NODES_BASE + _TEXT_NODES_PER_BYTE * os.fstat(fd).st_size
        try:
            tree = _Cleaner(result, budget=budget).clean(z.tree, "")
        except _Drop as e:
            raise FormatError(f"{source}: the checkpoint itself is {e.args[0]} ({e.args[1]}); nothing to keep") from e
        except _TooBig as e:
            raise FormatError(f"{source}: {e}; nothing was written") from e
        try:
            obj = materialize(z, fd, mmap=False, tree=tree, leaf=_tensor)
        except NotBuilt as e:
            raise FormatError(f"{source}: holds {e}, which sanitize does not rebuild; nothing was written") from e
        except RecursionError as e:
            raise FormatError(f"{source}: nests containers deeper than sanitize follows; nothing was written") from e
        if file_identity(fd) != before:
            raise changed_while_reading(source)
    write(obj, dst, fmt=out_fmt)
    return result


def _tensor(obj: Any) -> Any:
    if not isinstance(obj, _Array):
        raise NotBuilt(f"a {type(obj).__name__}")
    import torch

    dtype = getattr(torch, obj.dtype)
    flat = torch.frombuffer(bytearray(obj.data), dtype=dtype) if obj.data else torch.empty(0, dtype=dtype)
    if not obj.fortran:
        return flat.reshape(obj.shape).clone()
    return flat.reshape(obj.shape[::-1]).permute(*reversed(range(len(obj.shape)))).contiguous()


class _Cleaner:
    """Rewrites an inert tree into what torch's weights-only loader reads; shared objects stay shared."""

    def __init__(self, result: Sanitized, *, budget: int) -> None:
        self.result = result
        self.budget = budget  # lists and strings arrays of strings may still become (_TEXT_NODES_PER_BYTE)
        self.done: dict[int, Any] = {}
        self.keep: list[Any] = []  # the inert objects, alive while their ids are keys
        self.set = inert.make_global("builtins", "set")
        self.rules: dict[str, Callable[[inert.Inert, str], Any]] = {
            "argparse.Namespace": self._namespace,
            "builtins.frozenset": self._frozenset,
            "decimal.Decimal": self._text,
            "fractions.Fraction": self._fraction,
            "uuid.UUID": self._uuid,
            "datetime.datetime": self._datetime,
            "datetime.date": self._datetime,
            "datetime.time": self._datetime,
            **{name: self._path for name in _PATHS},
            **{name: self._array for name in _RECONSTRUCT},
            **{name: self._scalar for name in _SCALAR},
            "numpy.dtype": _dtype_name,
        }

    def clean(self, obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, inert.StorageRef)):
            return obj
        if id(obj) in self.done:
            return self.done[id(obj)]
        if is_record(obj):  # a tensor or Parameter of the .pt
            return obj  # built as it is (materialize refuses one it cannot build)
        value = self._new(obj, where)
        self.done[id(obj)] = value
        self.keep.append(obj)
        return value

    def _new(self, obj: Any, where: str) -> Any:
        if isinstance(obj, dict):
            out: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for key, value in obj.items():
                here = _join(where, key)
                try:
                    new_key, new_value = self._item(key, here), self._item(value, here)
                except _Drop:
                    continue
                try:
                    out[new_key] = new_value
                except TypeError:  # a key rewritten as a dict or list (a Namespace, an array of strings)
                    what = key.func.full if isinstance(key, inert.Inert) else type(key).__name__
                    self.result.dropped.append(
                        Dropped(here, what, f"a dict key that becomes a {_kind(new_key)}, which cannot be a key")
                    )
            for name, value in getattr(obj, "__dict__", {}).items():  # _metadata of an OrderedDict
                setattr(out, name, self.clean(value, f"{where}.{name}"))
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._in_sequence(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, type) and issubclass(obj, inert.Global):
            if obj.full in allowlist.TORCH_DEFAULT:
                return obj
            raise _Drop(obj.full, "a reference to a class, not data")
        if isinstance(obj, inert.Inert):
            return self._record(obj, where)
        raise _Drop(type(obj).__name__, "not data")

    def _item(self, value: Any, where: str) -> Any:
        """A dict's key or value, cleaned; a dropped one is listed and leaves its whole item out."""
        try:
            return self.clean(value, where)
        except _Drop as e:
            self.result.dropped.append(Dropped(where, *e.args))
            raise

    def _in_sequence(self, value: Any, where: str) -> Any:
        try:
            return self.clean(value, where)
        except _Drop as e:
            what, why = e.args
            self.result.dropped.append(Dropped(where, what, f"{why}; None in its place keeps the positions"))
            return None

    def _record(self, rec: inert.Inert, where: str) -> Any:
        name = rec.func.full
        if allowlist.can_run_code(name):
            raise _Drop(name, "it can run code; nothing was run")
        if name in allowlist.TORCH_DEFAULT:
            if rec.has_state:
                raise _Drop(name, "an object with state torch's weights-only loader refuses")
            args = tuple(self._in_sequence(a, f"{where}<{i}>") for i, a in enumerate(rec.args))
            return _record(rec.func, args, newobj=rec.newobj)
        rule = self.rules.get(name)
        if rule is None:
            raise _Drop(name, _NOT_READ)
        value = rule(rec, where)
        self.result.converted[f"{_KINDS.get(name, name)} -> {_kind(value)}"] += 1
        return value

    def _namespace(self, rec: inert.Inert, where: str) -> Any:
        if rec.args or not (rec.has_state and isinstance(rec.state, dict)):
            raise _Drop(rec.func.full, "a Namespace pickled in an unusual way")
        return self._new(rec.state, where)

    def _frozenset(self, rec: inert.Inert, where: str) -> Any:
        items = rec.args[0] if len(rec.args) == 1 and isinstance(rec.args[0], list) else None
        if items is None or rec.has_state:
            raise _Drop(rec.func.full, "a frozenset pickled in an unusual way")
        return _record(self.set, (self._new(items, where),), newobj=False)

    @staticmethod
    def _text(rec: inert.Inert, where: str = "") -> str:
        if len(rec.args) != 1 or not isinstance(rec.args[0], str) or rec.has_state:
            raise _Drop(rec.func.full, "pickled in an unusual way")
        return rec.args[0]

    def _fraction(self, rec: inert.Inert, where: str) -> str:
        if len(rec.args) == 2 and all(type(a) is int for a in rec.args) and not rec.has_state:
            return f"{rec.args[0]}/{rec.args[1]}"
        return self._text(rec)

    @staticmethod
    def _uuid(rec: inert.Inert, where: str) -> str:
        state = rec.state if rec.has_state else None
        if (
            rec.args
            or not isinstance(state, dict)
            or type(state.get("int")) is not int
            or not 0 <= state["int"] < 2**128
        ):
            raise _Drop(rec.func.full, "a UUID pickled in an unusual way")
        return str(uuid.UUID(int=state["int"]))

    @staticmethod
    def _datetime(rec: inert.Inert, where: str) -> str:
        data = _bytes(rec.args[0]) if len(rec.args) == 1 and not rec.has_state else None
        kind = getattr(datetime, rec.func.name)
        try:
            if data is None:
                raise ValueError("not its compact form")
            return str(kind(data).isoformat())  # the stdlib's own decoder of its pickled bytes: it checks them
        except (TypeError, ValueError) as e:
            raise _Drop(rec.func.full, f"a {rec.func.name} pickled with a time zone or otherwise unusual") from e

    @staticmethod
    def _path(rec: inert.Inert, where: str) -> str:
        if not rec.args or not all(isinstance(a, str) for a in rec.args) or rec.has_state:
            raise _Drop(rec.func.full, "a path pickled in an unusual way")
        pure = pathlib.PureWindowsPath if "Windows" in rec.func.name else pathlib.PurePosixPath
        return str(pure(*rec.args))

    def _array(self, rec: inert.Inert, where: str) -> _Array | Any:
        state = rec.state if rec.has_state else None
        if (
            len(rec.args) != 3
            or getattr(rec.args[0], "full", None) != "numpy.ndarray"
            or not isinstance(state, tuple)
            or len(state) != 5
            or state[0] != 1
        ):
            raise _Drop("numpy.ndarray", "an array pickled in an unusual way (a subclass, or a new numpy format)")
        _, shape, dtype_rec, fortran, raw = state
        dtype = _numpy_dtype(dtype_rec)[0] if isinstance(dtype_rec, inert.Inert) else None
        data = _bytes(raw)
        if not (isinstance(shape, tuple) and all(type(d) is int and d >= 0 for d in shape)):
            raise _Drop("numpy.ndarray", "an array with a malformed shape")
        if not _fits_int64(shape):
            raise _TooBig(
                f"key '{where}': a numpy array of shape {list(shape)}, past 64 bits; the file is damaged "
                f"or crafted: drop that key"
            )
        if dtype is None and data is not None:
            nodes = _text_nodes(dtype_rec, shape, data, limit=self.budget)
            if nodes > self.budget:
                raise _TooBig(
                    f"key '{where}': a numpy array of strings of shape {list(shape)} would become over "
                    f"{self.budget} lists and strings, more than the file's bytes can hold; the file is damaged "
                    f"or crafted: drop that key"
                )
            if text := _text_array(dtype_rec, shape, data, bool(fortran)):
                self.budget -= nodes
                return text[0]
        if dtype is None or data is None:
            raise _Drop("numpy.ndarray", "an array of objects or records, which a tensor cannot hold")
        from ckptfix.formats.dtypes import DTYPES

        if len(data) != math.prod(shape) * DTYPES[dtype].itemsize:
            raise _Drop("numpy.ndarray", "an array whose bytes do not match its shape")
        return _Array(dtype, shape, data, bool(fortran))

    @staticmethod
    def _scalar(rec: inert.Inert, where: str) -> Any:
        if len(rec.args) != 2 or rec.has_state:
            raise _Drop("numpy scalar", "a scalar pickled in an unusual way")
        dtype, code = _numpy_dtype(rec.args[0])
        data = _bytes(rec.args[1])
        if dtype is None or data is None or len(data) != struct.calcsize("<" + code):
            raise _Drop("numpy scalar", "a scalar of a kind a Python number cannot hold")
        values = struct.unpack("<" + code, data)
        return complex(*values) if len(values) == 2 else values[0]


_KINDS = {
    **{n: "numpy.ndarray" for n in _RECONSTRUCT},
    **{n: "numpy scalar" for n in _SCALAR},
    **{n: "pathlib path" for n in _PATHS},
}


def _kind(value: Any) -> str:
    if isinstance(value, _Array):
        return "tensor"
    if isinstance(value, list):
        return "list"
    if isinstance(value, inert.Inert):
        return value.func.name
    return "number" if isinstance(value, (int, float, complex)) else type(value).__name__


def _fits_int64(shape: tuple[int, ...]) -> bool:
    """Whether torch can hold ``shape``: every size, and their product taken in order, within 64 bits."""
    numel = 1
    for d in shape:
        numel *= d
        if d > _INT64 or numel > _INT64:
            return False
    return True


_INT64 = (1 << 63) - 1


def _text_nodes(rec: Any, shape: tuple[int, ...], data: bytes, *, limit: int) -> int:
    """How many lists and strings :func:`_text_array` would build for ``shape`` (counting stops past ``limit``);
    0 for an array it does not build."""
    if not (isinstance(rec, inert.Inert) and rec.args and isinstance(rec.args[0], str)):
        return 0
    if rec.args[0][:1] != "U":
        return 0
    nodes, level = 1, 1  # the outer list (or the one string of a 0-d array)
    for size in shape[:-1]:
        level *= size
        nodes += level
        if nodes > limit:
            return nodes
    return nodes + level * (shape[-1] if shape else 0)


def _text_array(rec: Any, shape: tuple[int, ...], data: bytes, fortran: bool) -> tuple[Any] | None:
    """A numpy array of strings (``U``) as nested lists, in a 1-tuple; None for any other (bytes arrays too: torch's
    weights-only loader refuses an empty bytes object, which the pickler writes as a call of ``bytes``)."""
    descr = rec.args[0] if isinstance(rec, inert.Inert) and rec.args and isinstance(rec.args[0], str) else ""
    state = rec.state if isinstance(rec, inert.Inert) and rec.has_state else None
    order = state[1] if isinstance(state, tuple) and len(state) > 1 else None
    if descr[:1] != "U" or not descr[1:].isdigit() or order != "<":
        return None
    width = int(descr[1:]) * 4
    count = math.prod(shape)
    if width * count != len(data):
        return None
    try:
        items = [data[i * width : (i + 1) * width].decode("utf-32-le").rstrip("\0") for i in range(count)]
    except UnicodeDecodeError:
        return None
    if fortran:  # stored first index fastest: list them in C order
        strides = [math.prod(shape[:k]) for k in range(len(shape))]
        items = [items[sum(i * s for i, s in zip(index, strides, strict=True))] for index in _indices(shape)]
    return (_nest(items, shape),)


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [(*index, i) for index in out for i in range(size)]
    return out


def _nest(items: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return items[0]
    step = math.prod(shape[1:])
    return [_nest(items[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _dtype_name(rec: inert.Inert, where: str) -> str:
    """A numpy dtype held as a value: its torch name (``float64``), or numpy's own string (``U5``)."""
    return _numpy_dtype(rec)[0] or str(rec.args[0])


def _numpy_dtype(rec: Any) -> tuple[str | None, str]:
    """(torch dtype name, struct format) of a pickled ``numpy.dtype``, or (None, "") for one a tensor cannot hold."""
    if not (isinstance(rec, inert.Inert) and rec.func.full == "numpy.dtype" and rec.args) or not isinstance(
        rec.args[0], str
    ):
        raise _Drop("numpy.dtype", "a dtype pickled in an unusual way")
    state = rec.state if rec.has_state else None
    order = state[1] if isinstance(state, tuple) and len(state) > 4 else None
    plain = isinstance(state, tuple) and len(state) > 4 and state[3] is None and state[4] is None  # no fields
    found = _NUMPY.get(rec.args[0])
    if found is None or not plain or order not in ("<", "|") or (order == "|" and found[1] not in "?bB"):
        return None, ""
    return found


def _bytes(value: Any) -> bytes | None:
    """The bytes a protocol-2 pickle holds as ``_codecs.encode(text, 'latin1')``, or given as bytes."""
    if isinstance(value, bytes):
        return value
    if (
        isinstance(value, inert.Inert)
        and value.func.full == "_codecs.encode"
        and len(value.args) == 2
        and isinstance(value.args[0], str)
        and value.args[1] == "latin1"
    ):
        try:
            return value.args[0].encode("latin1")
        except UnicodeEncodeError:
            return None
    return None


def _record(func: type[inert.Global], args: tuple[Any, ...], *, newobj: bool) -> inert.Inert:
    rec = inert.Inert(func, args)
    rec.newobj = newobj
    return rec


def _join(where: str, key: Any) -> str:
    return str(key) if not where and isinstance(key, str) else f"{where}[{key!r}]"


__all__ = ["Dropped", "Sanitized", "sanitize"]
