"""Read torch's pickles into inert trees (:mod:`.inert`'s records): the opcode engine, nothing executed.

Two readers give one answer: the reference reader (Python's unpickler with its opcode table restricted to what
torch's weights-only loader reads, BUILD checked, globals turned into stand-ins) and, for a pickle that
:func:`~ckptfix.formats.safety.opscan.provable` has walked, the C unpickler with the same hooks, about 20 times
faster. :func:`load` is the entry point; every rule about what a pickle may contain is checked there or in the
records it builds.
"""

from __future__ import annotations

import _pickle
import io
import pickle
from collections import OrderedDict
from typing import IO, Any, ClassVar, cast

from ckptfix.errors import CkptfixError, FormatError
from ckptfix.formats.dtypes import storage_itemsize
from ckptfix.formats.pickles.inert import (
    Frozen,
    Global,
    Inert,
    InertParameter,
    InertTensor,
    StorageRef,
    make_global,
    nested_class,
)
from ckptfix.formats.pickles.inert_trees import LEAVES, children_of, gc_paused, is_container, measure
from ckptfix.formats.safety import allowlist, opscan

_BASE_NODES = 10_000_000  # plus 8 per pickle byte: the tree's size with shared references counted each time
# The opcodes torch's weights-only unpickler reads (torch/_weights_only_unpickler.py); a file using any other is
# one torch refuses, so this reader refuses it too, before anything is built.
_OPCODES = frozenset(
    {
        pickle.APPEND,
        pickle.APPENDS,
        pickle.BINFLOAT,
        pickle.BINGET,
        pickle.BININT,
        pickle.BININT1,
        pickle.BININT2,
        pickle.BINPERSID,
        pickle.BINPUT,
        pickle.BINUNICODE,
        pickle.BUILD,
        pickle.EMPTY_DICT,
        pickle.EMPTY_LIST,
        pickle.EMPTY_SET,
        pickle.EMPTY_TUPLE,
        pickle.GLOBAL,
        pickle.LONG1,
        pickle.LONG_BINGET,
        pickle.LONG_BINPUT,
        pickle.MARK,
        pickle.NEWFALSE,
        pickle.NEWOBJ,
        pickle.NEWTRUE,
        pickle.NONE,
        pickle.PROTO,
        pickle.REDUCE,
        pickle.SETITEM,
        pickle.SETITEMS,
        pickle.SHORT_BINSTRING,
        pickle.STOP,
        pickle.TUPLE,
        pickle.TUPLE1,
        pickle.TUPLE2,
        pickle.TUPLE3,
    }
)


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

    def __init__(
        self, stream: IO[bytes], *, allowed: frozenset[str], legacy: bool, records: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(stream)
        self.allowed = allowed | records
        self.records = records  # read as records, yet listed in refused: the caller decides (see load)
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
        refused = full not in self.allowed or full in allowlist.UNSUPPORTED
        if refused or full in self.records:
            self.refused.append(full)  # keep reading: the refusal lists every global the file needs
        if full == "builtins.getattr" and not refused:  # allowed only by the sharded-tensor reader: a nested class
            return nested_class(self.globals, self.allowed)
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
_PROTOCOL4 = frozenset(
    {
        pickle.FRAME,
        pickle.SHORT_BINUNICODE,
        pickle.BINUNICODE8,
        pickle.MEMOIZE,
        pickle.STACK_GLOBAL,
        pickle.SHORT_BINBYTES,
        pickle.BINBYTES,
        pickle.BINBYTES8,
    }
)


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


class CheckedOrderedDict(OrderedDict[Any, Any]):
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
            self.globals[full] = CheckedOrderedDict if full == "collections.OrderedDict" else make_global(mod, attr)
        return self.globals[full]

    def persistent_load(self, pid: Any) -> Any:
        # a shortcut for the first reference to a storage in torch.save's form; the rest (repeats, every
        # refusal) by the reference reader's rule
        if type(pid) is tuple and len(pid) == 5:
            tag, kind, key, location, numel = pid
            if (
                tag == "storage"
                and type(kind) is Frozen
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
    """``tree`` with every CheckedOrderedDict replaced by an OrderedDict, sharing kept.

    Runs after measure(): the tree is acyclic and at most MAX_DEPTH deep. Dicts and lists are updated in place,
    tuples and OrderedDicts rebuilt, so every other object keeps its identity. A plain tensor record keeps its
    own empty hooks as they are (a million conversions for nothing) unless they are also held elsewhere.
    """
    done: dict[int, Any] = {id(CheckedOrderedDict): OrderedDict}  # the class itself, where a pickle holds it
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
            for kid in children_of(obj):
                if type(kid) is InertTensor or type(kid) is InertParameter:
                    if id(kid) not in seen:
                        seen.add(id(kid))
                        if _own_empty_hooks(kid):
                            simple.append(kid)
                        else:
                            other.append(kid)
                            stack.append((kid.args, False))
                elif type(kid) not in LEAVES and id(kid) not in done and is_container(kid):
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
    return (
        type(record) is InertTensor
        and len(args) == 6
        and type(args[5]) is CheckedOrderedDict
        and not args[5]
        and not vars(args[5])
    )


def _rebuilt(obj: Any, done: dict[int, Any]) -> Any:
    def new(value: Any) -> Any:
        return done.get(id(value), value)

    if isinstance(obj, CheckedOrderedDict):
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
    records: frozenset[str] = frozenset(),
) -> tuple[list[Any], dict[str, StorageRef]]:
    """The inert trees of ``count`` consecutive pickles and their storages by key, every rule checked.

    Refuses (one error listing every offending global) a pickle that names a global outside ``allowed``.
    ``protocol4`` also reads protocol 4's data-only opcodes (torch.save never writes them; DCP metadata does).
    ``as_data`` names globals otherwise refused that this caller reads as records and never builds (the
    DTensor classes, for reassembling shards). ``refused``, when given, receives the names outside ``allowed``
    instead of a refusal: their records stay inert stand-ins, and the caller decides (formats/torchio/opaque.py).
    ``plain=False`` may leave OrderedDicts as the subclass the C unpickler built them as, for a caller that only
    writes the tree back (the fast path): replacing them is a pass over the tree, 0.7 s for a million tensors.
    ``records`` (with ``refused``) names globals outside ``allowed`` that the reference reader reads as records
    (the sharded-tensor classes, for a merge telling rank files apart): still listed in ``refused``, so the
    caller sees what the file needs, and the tree is what an ``as_data`` read of them gives.
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
        unpickler = (_Protocol4Unpickler if protocol4 else _Unpickler)(
            stream, allowed=allowed, legacy=legacy, records=records - allowed
        )
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
