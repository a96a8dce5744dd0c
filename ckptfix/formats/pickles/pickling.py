"""Write inert trees back as torch's pickles: the opcodes torch's pickler emits (protocol 2), so a tree read by
:mod:`.unpickling` round-trips byte for byte and torch loads the result."""

from __future__ import annotations

import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ckptfix.formats.pickles.inert import (
    Frozen,
    Global,
    Inert,
    InertParameter,
    InertTensor,
    StorageRef,
    make_global,
)
from ckptfix.formats.pickles.inert_trees import gc_paused
from ckptfix.formats.pickles.unpickling import CheckedOrderedDict

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
        and (type(hooks) is OrderedDict or type(hooks) is CheckedOrderedDict)
        and not hooks
        and not vars(hooks)
        and len(pid) == 5
        and type(pid[0]) is str
        and type(pid[1]) is Frozen
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
            str: self._save_str,
            int: self._save_int,
            InertTensor: self._save_tensor,
            tuple: self._save_tuple,
            type(None): self._save_none,
            bool: self._save_bool,
            float: self._save_float,
            bytes: self._save_bytes,
            list: self._save_list,
            dict: self._save_dict,
            OrderedDict: self._save_odict,
            CheckedOrderedDict: self._save_odict,
            StorageRef: self._save_ref,
            Inert: self._save_inert,
            InertParameter: self._save_inert,
            Frozen: self._save_global,
        }

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
