"""Generators of hostile and mutated checkpoint files, written byte by byte.

Nothing here imports ckptfix: the files are made independently of the code they attack. Pickles are written
opcode by opcode (so they can hold what ``pickle.dumps`` never writes), zip archives with ``struct`` (so every
field of every header is under control), safetensors files from a header dict or raw bytes.

Layers, bottom up:

- ``P``: pickle opcodes as bytes, composed by concatenation (``P.call(P.glob("os", "system"), P.string("id"))``);
- ``Rec``/``build_zip``/``parse_zip``: torch-style archives (64-byte aligned, data descriptors), and a parser
  that finds every header field of an existing archive so that mutations can hit exactly one of them;
- checkpoint makers: ``tensor_pickle``, ``torch_zip_file``, ``legacy_file``, ``st_file``;
- ``payloads``: pickles that would write a marker file if anything executed them;
- ``zip_mutations``/``st_mutations``/``legacy_mutations``: deterministic corpora of damaged variants.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import pickletools
import struct
import subprocess
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# --- pickle opcodes --------------------------------------------------------------------------------------------


class P:
    """Pickle opcodes as bytes. Values compose by concatenation, in the order the unpickler pushes them."""

    @staticmethod
    def proto(n: int = 2) -> bytes:
        return b"\x80" + bytes([n])

    @staticmethod
    def stop() -> bytes:
        return b"."

    @staticmethod
    def glob(module: str, name: str) -> bytes:
        """GLOBAL: pushes ``module.name`` (protocols 0-3 form; STACK_GLOBAL is ``stack_glob``)."""
        return b"c" + module.encode("utf-8", "surrogatepass") + b"\n" + name.encode("utf-8", "surrogatepass") + b"\n"

    @staticmethod
    def stack_glob(module: str, name: str) -> bytes:
        return P.string(module) + P.string(name) + b"\x93"

    @staticmethod
    def string(text: str) -> bytes:
        raw = text.encode("utf-8", "surrogatepass")
        return b"X" + struct.pack("<I", len(raw)) + raw

    @staticmethod
    def binbytes(data: bytes) -> bytes:
        """BINBYTES (a protocol-3 opcode; the C unpickler accepts it whatever PROTO said)."""
        return b"B" + struct.pack("<I", len(data)) + data

    @staticmethod
    def integer(n: int) -> bytes:
        if 0 <= n < 256:
            return b"K" + bytes([n])
        if -(2**31) <= n < 2**31:
            return b"J" + struct.pack("<i", n)
        raw = pickle.encode_long(n)
        return b"\x8a" + bytes([len(raw)]) + raw

    @staticmethod
    def real(x: float) -> bytes:
        return b"G" + struct.pack(">d", x)

    @staticmethod
    def none() -> bytes:
        return b"N"

    @staticmethod
    def boolean(value: bool) -> bytes:
        return b"\x88" if value else b"\x89"

    @staticmethod
    def tup(*items: bytes) -> bytes:
        return b"(" + b"".join(items) + b"t" if items else b")"

    @staticmethod
    def lst(*items: bytes) -> bytes:
        return b"]" + (b"(" + b"".join(items) + b"e" if items else b"")

    @staticmethod
    def dct(pairs: Iterable[tuple[bytes, bytes]]) -> bytes:
        body = b"".join(k + v for k, v in pairs)
        return b"}" + (b"(" + body + b"u" if body else b"")

    @staticmethod
    def odict(pairs: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
        body = b"".join(k + v for k, v in pairs)
        return P.glob("collections", "OrderedDict") + b")R" + (b"(" + body + b"u" if body else b"")

    @staticmethod
    def call(func: bytes, *args: bytes) -> bytes:
        """``func(*args)``: REDUCE."""
        return func + P.tup(*args) + b"R"

    @staticmethod
    def build(state: bytes) -> bytes:
        """BUILD: ``setstate(top of stack, state)``."""
        return state + b"b"

    @staticmethod
    def put(n: int) -> bytes:
        return b"q" + bytes([n]) if n < 256 else b"r" + struct.pack("<I", n)

    @staticmethod
    def get(n: int) -> bytes:
        return b"h" + bytes([n]) if n < 256 else b"j" + struct.pack("<I", n)

    @staticmethod
    def persid(pid: bytes) -> bytes:
        return pid + b"Q"

    @staticmethod
    def storage(key: bytes, *, kind: str = "FloatStorage", numel: int, location: str = "cpu") -> bytes:
        """torch's persistent id ``('storage', torch.<kind>, key, location, numel)``; ``key`` is raw opcodes."""
        return P.persid(P.tup(P.string("storage"), P.glob("torch", kind), key, P.string(location), P.integer(numel)))

    @staticmethod
    def tensor(storage: bytes, *, offset: int = 0, shape: Sequence[int], stride: Sequence[int] | None = None) -> bytes:
        """``torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, False, OrderedDict())``."""
        if stride is None:
            stride = contiguous_stride(shape)
        return P.call(
            P.glob("torch._utils", "_rebuild_tensor_v2"),
            storage,
            P.integer(offset),
            P.tup(*(P.integer(s) for s in shape)),
            P.tup(*(P.integer(s) for s in stride)),
            P.boolean(False),
            P.odict(),
        )


def contiguous_stride(shape: Sequence[int]) -> list[int]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return stride[::-1]


def pickle_globals(data: bytes) -> list[str]:
    """Every global a pickle names (GLOBAL, INST, STACK_GLOBAL), found with pickletools, never executed."""
    names: list[str] = []
    strings: list[str] = []
    for op, arg, _pos in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            names.append(str(arg).replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(str(arg))
        elif op.name == "STACK_GLOBAL":
            names.append(".".join(strings[-2:]))
    return names


# --- zip archives ----------------------------------------------------------------------------------------------

ALIGN = 64
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
FLAGS = 0x0808  # what torch.save writes: data descriptor + UTF-8 names


@dataclass
class Rec:
    """One record to write. Every field a reader may trust can be made to lie."""

    name: str
    data: bytes
    local_name: str | None = None  # name in the local header (default: ``name``)
    flags: int = FLAGS
    local_flags: int | None = None  # flags in the local header (default: ``flags``)
    method: int = 0
    local_method: int | None = None
    crc: int | None = None  # CRC claimed everywhere (default: the data's)
    size: int | None = None  # size claimed in the central directory and descriptor (default: len(data))


@dataclass
class Cd:
    """One central-directory entry: its name and the record (by index) whose local header it points at."""

    name: str
    target: int
    rec: Rec | None = None  # fields to claim instead of the target's (default: the target's)


def build_zip(
    records: Sequence[Rec],
    *,
    directory: Sequence[Cd] | None = None,
    start: int = 0,
    comment: bytes = b"",
    align: bool = True,
) -> bytes:
    """A torch-style zip: aligned data, sizes in data descriptors, then the central directory.

    ``directory`` lists the central-directory entries (default: one per record, in order); ``start`` is the
    offset the archive will sit at in its file, so that a second archive appended to a first can carry
    offsets that are right for the whole file (``start=len(first)``) or only for itself (``start=0``).
    """
    out = bytearray()
    offsets: list[int] = []
    for rec in records:
        offsets.append(start + len(out))
        name = (rec.local_name if rec.local_name is not None else rec.name).encode("utf-8", "surrogatepass")
        flags = rec.local_flags if rec.local_flags is not None else rec.flags
        method = rec.local_method if rec.local_method is not None else rec.method
        pad = -(start + len(out) + _LOCAL.size + len(name) + 4) % ALIGN if align else 0
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad if align else b""
        out += _LOCAL.pack(0x04034B50, 20, flags, method, 0, 0x21, 0, 0, 0, len(name), len(extra)) + name + extra
        out += rec.data
        crc = rec.crc if rec.crc is not None else zlib.crc32(rec.data)
        size = rec.size if rec.size is not None else len(rec.data)
        if flags & 0x8:
            out += struct.pack("<IIII", 0x08074B50, crc, size, size)
    cd_offset = start + len(out)
    entries = directory if directory is not None else [Cd(r.name, i) for i, r in enumerate(records)]
    for entry in entries:
        rec = entry.rec or records[entry.target]
        name = entry.name.encode("utf-8", "surrogatepass")
        crc = rec.crc if rec.crc is not None else zlib.crc32(rec.data)
        size = rec.size if rec.size is not None else len(rec.data)
        out += (
            _CENTRAL.pack(
                0x02014B50, 20, 20, rec.flags, rec.method, 0, 0x21, crc, size, size, len(name), 0, 0, 0, 0, 0,
                offsets[entry.target],
            )
            + name
        )  # fmt: skip
    cd_size = start + len(out) - cd_offset
    out += _EOCD.pack(0x06054B50, 0, 0, len(entries), len(entries), cd_size, cd_offset, len(comment)) + comment
    return bytes(out)


@dataclass
class Entry:
    """One record of an existing archive as its headers describe it (offsets into the file)."""

    name: str
    cd_pos: int  # where its central-directory entry starts
    header_offset: int
    data_offset: int
    size: int
    crc: int
    flags: int


@dataclass
class Zip:
    """The parsed structure of an archive: records in central-directory order and the end record."""

    entries: list[Entry]
    eocd: int
    cd_offset: int
    cd_size: int

    def get(self, suffix: str) -> Entry:
        """The first record whose name ends with ``suffix``."""
        return next(e for e in self.entries if e.name.endswith(suffix))

    def storages(self) -> list[Entry]:
        return [e for e in self.entries if "/data/" in e.name and not e.name.rsplit("/", 1)[-1].startswith(".")]


def parse_zip(data: bytes) -> Zip:
    """Parse an intact archive (no zip64): every central-directory entry and where its data lies."""
    eocd = data.rfind(b"PK\x05\x06")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(data, eocd)
    entries, pos = [], cd_offset
    for _ in range(count):
        fields = _CENTRAL.unpack_from(data, pos)
        flags, crc, size, name_len, extra_len, comment_len, offset = (
            fields[3], fields[7], fields[9], fields[10], fields[11], fields[12], fields[16],
        )  # fmt: skip
        name = data[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len].decode("utf-8", "surrogateescape")
        local = _LOCAL.unpack_from(data, offset)
        data_offset = offset + _LOCAL.size + local[9] + local[10]
        entries.append(Entry(name, pos, offset, data_offset, size, crc, flags))
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return Zip(entries, eocd, cd_offset, cd_size)


def read_records(data: bytes) -> list[Rec]:
    """The records of an intact archive as ``Rec`` values, in file order (to rebuild it with changes)."""
    z = parse_zip(data)
    return [
        Rec(e.name, data[e.data_offset : e.data_offset + e.size])
        for e in sorted(z.entries, key=lambda e: e.data_offset)
    ]


def with_record(data: bytes, suffix: str, new: bytes) -> bytes:
    """The archive rebuilt with the record named ``...suffix`` holding ``new`` (CRCs right, layout torch's)."""
    return build_zip([replace(r, data=new) if r.name.endswith(suffix) else r for r in read_records(data)])


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


def flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    return patch(data, offset, bytes([data[offset] ^ mask]))


def fix_crcs(data: bytes) -> bytes:
    """Recompute every record's CRC in place (central directory and data descriptor), sizes untouched."""
    z = parse_zip(data)
    out = bytearray(data)
    for e in z.entries:
        crc = zlib.crc32(data[e.data_offset : e.data_offset + e.size])
        struct.pack_into("<I", out, e.cd_pos + 16, crc)
        if e.flags & 0x8 and out[e.data_offset + e.size : e.data_offset + e.size + 4] == b"PK\x07\x08":
            struct.pack_into("<I", out, e.data_offset + e.size + 4, crc)
    return bytes(out)


def canonical_zip(data: bytes) -> bytes:
    """A torch.save archive with its random ``serialization_id`` fixed, so generated files are deterministic."""
    return build_zip(
        [replace(r, data=b"0" * len(r.data)) if r.name.endswith("serialization_id") else r for r in read_records(data)]
    )


# --- checkpoint files ------------------------------------------------------------------------------------------


def tensor_pickle(entries: Iterable[tuple[str, bytes]], *, extra: Iterable[tuple[str, bytes]] = ()) -> bytes:
    """``{"model": OrderedDict(entries), **extra}`` as a protocol-2 pickle (values are raw opcodes)."""
    model = P.odict((P.string(k), v) for k, v in entries)
    return P.proto(2) + P.dct([(P.string("model"), model), *((P.string(k), v) for k, v in extra)]) + P.stop()


def torch_zip_file(
    data_pkl: bytes,
    storages: dict[str, bytes] | None = None,
    *,
    extra: Sequence[Rec] = (),
    prefix: str = "archive",
) -> bytes:
    """A torch archive around a hand-made ``data.pkl``: data.pkl first, then storages, as torch.save orders them."""
    records = [Rec(f"{prefix}/data.pkl", data_pkl), Rec(f"{prefix}/byteorder", b"little")]
    records += [Rec(f"{prefix}/data/{k}", v) for k, v in (storages or {}).items()]
    records += list(extra)
    records.append(Rec(f"{prefix}/version", b"3\n"))
    return build_zip(records)


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def legacy_file(obj_pickle: bytes, storages: dict[str, bytes] | None = None) -> bytes:
    """A legacy (pre-1.6) torch file: magic, protocol, system info, the object's pickle, keys, storage data.

    Each storage is written as torch did: an 8-byte element count (here: bytes, for a ByteStorage), the bytes.
    """
    info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    head = b"".join(pickle.dumps(x, protocol=2) for x in (LEGACY_MAGIC, 1001, info))
    keys = list(storages or {})
    body = b"".join(struct.pack("<q", len(v)) + v for v in (storages or {}).values())
    return head + obj_pickle + pickle.dumps(keys, protocol=2) + body


def st_file(header: dict[str, Any] | None = None, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """A safetensors file: 8-byte length, the JSON header (or ``raw`` bytes), then ``data``."""
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def parse_st(data: bytes) -> tuple[dict[str, Any], bytes]:
    """Header (key order kept) and data buffer of an intact safetensors file."""
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def st_rebuild(header: dict[str, Any], buffer: bytes) -> bytes:
    """A safetensors file with ``header`` (in its key order), padded as the writers pad."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + buffer


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


# --- payloads --------------------------------------------------------------------------------------------------


def fork_exec_args(argv: list[str]) -> list[Any]:
    """Arguments for ``_posixsubprocess.fork_exec`` that run ``argv`` in this Python version.

    Recorded from ``subprocess.Popen`` itself (the signature changes between Python versions), then made
    self-contained: the error pipe becomes stdin/stderr, which exist in any process that unpickles it.
    """
    import subprocess

    captured: list[tuple[Any, ...]] = []

    class CapturedError(Exception):
        pass

    def fake(*args: Any) -> int:
        captured.append(args)
        raise CapturedError

    saved = subprocess._fork_exec, subprocess._USE_POSIX_SPAWN  # type: ignore[attr-defined]
    subprocess._fork_exec, subprocess._USE_POSIX_SPAWN = fake, False  # type: ignore[attr-defined,misc]
    try:
        subprocess.Popen(argv, close_fds=False)
    except CapturedError:
        pass
    finally:
        subprocess._fork_exec, subprocess._USE_POSIX_SPAWN = saved  # type: ignore[attr-defined,misc]
    args = list(captured[0])
    args[3], args[12], args[13] = (2,), 0, 2  # fds_to_keep, errpipe_read, errpipe_write
    return args


def _value(obj: Any) -> bytes:
    """Opcodes for a plain value (str, bytes, int, bool, None, float, list, tuple, dict), all of them opcodes that
    torch's weights-only unpickler reads: a refusal must then come from the global, not from the opcodes."""
    if obj is None:
        return P.none()
    if isinstance(obj, bool):
        return P.boolean(obj)
    if isinstance(obj, int):
        return P.integer(obj)
    if isinstance(obj, float):
        return P.real(obj)
    if isinstance(obj, str):
        return P.string(obj)
    if isinstance(obj, bytes):  # as torch.save writes bytes: only opcodes torch's weights-only unpickler reads
        return P.call(P.glob("_codecs", "encode"), P.string(obj.decode("latin1")), P.string("latin1"))
    if isinstance(obj, list):
        return P.lst(*(_value(v) for v in obj))
    if isinstance(obj, tuple):
        return P.tup(*(_value(v) for v in obj))
    if isinstance(obj, dict):
        return P.dct((_value(k), _value(v)) for k, v in obj.items())
    raise TypeError(type(obj))


def marker_pickle(marker: Path) -> bytes:
    """A plain pickle (no torch needed) that creates ``marker`` through ``os.system``."""
    return P.proto(2) + P.call(P.glob("os", "system"), P.string(f"touch '{marker}'")) + P.stop()


def payload_call(name: str, marker: Path) -> bytes:
    """Opcodes of a call of global ``name`` that would create ``marker`` if it ran."""
    module, _, attr = name.rpartition(".")
    target = str(marker)
    args: tuple[Any, ...]
    if name == "torch.fx.graph_module._exec_with_source":
        args = (f"open({target!r}, 'w').close()", {})
    elif name == "torch.storage._load_from_bytes":
        args = (marker_pickle(marker),)  # torch.load(weights_only=False) of a pickle that runs os.system
    elif name == "zipfile.ZipFile":
        args = (target, "w")  # creating the archive creates the file
    elif name == "torch.save":
        args = (0, target)
    elif name == "_posixsubprocess.fork_exec":
        args = tuple(fork_exec_args(["/bin/sh", "-c", f"touch '{target}'"]))
    else:
        raise ValueError(name)
    return P.call(P.glob(module, attr), *(_value(a) for a in args))


CODE_GLOBALS = (
    "torch.fx.graph_module._exec_with_source",
    "torch.storage._load_from_bytes",
    "zipfile.ZipFile",
    "torch.save",
    "_posixsubprocess.fork_exec",
)


def payload_pickle(name: str, marker: Path) -> bytes:
    """``{"model": {"w": <tensor data/0>}, "cfg": <payload>}``: a real checkpoint with a live payload in it."""
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    return tensor_pickle([("w", w)], extra=[("cfg", payload_call(name, marker))])


# --- mutation corpora ------------------------------------------------------------------------------------------

Mutation = Callable[[bytes], bytes]


@dataclass
class Mutations:
    """Named mutations, each applied to a base file."""

    items: dict[str, Mutation] = field(default_factory=dict)

    def add(self, name: str, fn: Mutation) -> None:
        self.items[name] = fn

    def subset(self, names: Iterable[str]) -> Mutations:
        return Mutations({n: self.items[n] for n in names})


def _truncate(d: bytes, *, frac: float) -> bytes:
    return d[: max(1, int(len(d) * frac))]


def _flip_at(d: bytes, *, frac: float) -> bytes:
    return flip(d, int(len(d) * frac), 0x04)


def truncations(m: Mutations, points: Iterable[float] = (0.0005, 0.1, 0.5, 0.9)) -> None:
    for frac in points:
        m.add(f"trunc{frac:g}", functools.partial(_truncate, frac=frac))
    m.add("trunc-1", lambda d: d[:-1])


def _pkl(d: bytes) -> Entry:
    return parse_zip(d).get("/data.pkl")


def _storage(d: bytes) -> Entry:
    """The largest storage record (ties: the first)."""
    return max(parse_zip(d).storages(), key=lambda e: e.size)


Locate = Callable[[bytes], Entry]


def _cd_field(entry: Locate, at: int, fmt: str, value: Callable[[Entry], tuple[int, ...]]) -> Mutation:
    """Overwrite the central-directory field at byte ``at`` of the entry ``entry(d)`` with ``value(entry)``."""

    def apply(d: bytes) -> bytes:
        e = entry(d)
        return patch(d, e.cd_pos + at, struct.pack(fmt, *value(e)))

    return apply


def _local_field(entry: Locate, at: int, value: Callable[[bytes, Entry], int]) -> Mutation:
    """Overwrite the 16-bit local-header field at byte ``at`` of the entry ``entry(d)``."""

    def apply(d: bytes) -> bytes:
        e = entry(d)
        return patch(d, e.header_offset + at, struct.pack("<H", value(d, e)))

    return apply


def _eocd_field(at: int, fmt: str, value: Callable[[Zip], tuple[int, ...]]) -> Mutation:
    def apply(d: bytes) -> bytes:
        z = parse_zip(d)
        return patch(d, z.eocd + at, struct.pack(fmt, *value(z)))

    return apply


def _in_record(entry: Locate, frac: float, mask: int, *, crc: bool) -> Mutation:
    """Flip bits at ``frac`` of the record's data; with ``crc`` the CRCs are fixed, so the damage gets past them."""

    def apply(d: bytes) -> bytes:
        e = entry(d)
        out = flip(d, e.data_offset + min(e.size - 1, int(e.size * frac)), mask)
        return fix_crcs(out) if crc else out

    return apply


def _numel_arg(pkl: bytes) -> int:
    """Offset in ``pkl`` of the first storage's numel argument (the int opcode after the location string)."""
    ops = [(op, arg, pos) for op, arg, pos in pickletools.genops(pkl) if "PUT" not in op.name]
    for i, (op, arg, _pos) in enumerate(ops):
        if arg == "cpu" and op.name.endswith("UNICODE") and ops[i + 1][0].name in ("BININT1", "BININT2", "BININT"):
            return int(ops[i + 1][2] or 0) + 1
    raise ValueError("no storage numel found")


def _lie_numel(d: bytes) -> bytes:
    e = _pkl(d)
    return fix_crcs(flip(d, e.data_offset + _numel_arg(d[e.data_offset : e.data_offset + e.size]), 0x01))


def _cd_dup(entry: Locate) -> Mutation:
    """One more central-directory entry: a copy of ``entry(d)``'s (count and directory size fixed)."""

    def apply(d: bytes) -> bytes:
        z = parse_zip(d)
        e = entry(d)
        dup = d[e.cd_pos : e.cd_pos + _CENTRAL.size + len(e.name.encode())]
        cd_end = z.cd_offset + z.cd_size
        count = len(z.entries) + 1
        out = d[:cd_end] + dup + d[cd_end:]
        return patch(out, z.eocd + len(dup) + 8, struct.pack("<HHI", count, count, z.cd_size + len(dup)))

    return apply


def _cd_reversed(d: bytes) -> bytes:
    z = parse_zip(d)
    ends = [e.cd_pos for e in z.entries[1:]] + [z.cd_offset + z.cd_size]
    chunks = [d[e.cd_pos : end] for e, end in zip(z.entries, ends, strict=True)]
    return d[: z.cd_offset] + b"".join(reversed(chunks)) + d[z.cd_offset + z.cd_size :]


def _pickle_last(d: bytes) -> bytes:
    records = read_records(d)
    pickles = [r for r in records if r.name.endswith("/data.pkl")]
    return build_zip([r for r in records if r not in pickles] + pickles)


def _name_letter(e: Entry) -> int:
    """Offset, inside a header's name, of the ``d`` of ``data.pkl``."""
    return e.name.rindex("/") + 1


def local_flags_differ(d: bytes) -> bytes:
    """Known disagreement (1): the local header of data.pkl claims other flags than its central entry."""
    return _local_field(_pkl, 6, lambda _d, e: e.flags | 0x0002)(d)


def zip_mutations() -> Mutations:
    """Deterministic damage to a torch zip, each aimed at one structure."""
    m = Mutations()
    truncations(m)
    m.add("trunc-eocd", lambda d: d[: parse_zip(d).eocd + 10])
    m.add("local-sig", lambda d: flip(d, _pkl(d).header_offset + 1))
    m.add("known-local-flags-differ", local_flags_differ)
    m.add("local-method-differs", _local_field(_pkl, 8, lambda _d, _e: 8))
    m.add("local-name-differs", lambda d: flip(d, _pkl(d).header_offset + 30 + _name_letter(_pkl(d)), 0x20))
    m.add(
        "local-extra-len+4",
        _local_field(_pkl, 28, lambda d, e: struct.unpack_from("<H", d, e.header_offset + 28)[0] + 4),
    )
    m.add("cd-name-pkl", lambda d: flip(d, _pkl(d).cd_pos + 46 + _name_letter(_pkl(d)), 0x20))
    m.add("cd-name-storage", lambda d: flip(d, _storage(d).cd_pos + 46 + len(_storage(d).name) - 1, 0x02))
    m.add("cd-sizes-pkl+1", _cd_field(_pkl, 20, "<II", lambda e: (e.size + 1, e.size + 1)))
    m.add("cd-sizes-storage-1", _cd_field(_storage, 20, "<II", lambda e: (e.size - 1, e.size - 1)))
    m.add("cd-sizes-storage+4", _cd_field(_storage, 20, "<II", lambda e: (e.size + 4, e.size + 4)))
    m.add("cd-usize-storage+4", _cd_field(_storage, 24, "<I", lambda e: (e.size + 4,)))
    m.add("cd-offset-storage+1", _cd_field(_storage, 42, "<I", lambda e: (e.header_offset + 1,)))
    m.add("cd-offset-storage-to-pkl", lambda d: _cd_field(_storage, 42, "<I", lambda e: (_pkl(d).header_offset,))(d))
    m.add("cd-crc-storage", lambda d: flip(d, _storage(d).cd_pos + 16))
    m.add("cd-method-storage", _cd_field(_storage, 10, "<H", lambda e: (8,)))
    m.add("eocd-count-1", _eocd_field(8, "<HH", lambda z: (len(z.entries) - 1, len(z.entries) - 1)))
    m.add("eocd-cd-offset+1", _eocd_field(16, "<I", lambda z: (z.cd_offset + 1,)))
    m.add("cd-dup-pkl", _cd_dup(_pkl))
    m.add("cd-dup-storage", _cd_dup(_storage))
    m.add("cd-reordered", _cd_reversed)
    m.add("records-reordered", _pickle_last)
    m.add("pkl-flip-raw", _in_record(_pkl, 0.5, 0x04, crc=False))
    for frac in (0.05, 0.3, 0.5, 0.7, 0.95):
        m.add(f"pkl-flip{frac:g}-crc-fixed", _in_record(_pkl, frac, 0x04, crc=True))
    m.add("pkl-numel-lie", _lie_numel)
    m.add("storage-flip-raw", _in_record(_storage, 0.0, 0x10, crc=False))
    m.add("storage-flip-crc-fixed", _in_record(_storage, 0.5, 0x10, crc=True))
    m.add("storage-record-dropped", lambda d: build_zip([r for r in read_records(d) if r.name != _storage(d).name]))
    m.add("trailing-garbage", lambda d: d + b"\0garbage")
    m.add("comment", lambda d: _eocd_field(20, "<H", lambda z: (7,))(d) + b"comment")
    return m


LIGHT_ZIP = ("trunc0.5", "trunc-1", "known-local-flags-differ", "cd-sizes-storage-1", "pkl-flip0.5-crc-fixed")


def st_header_order_differs(d: bytes) -> bytes:
    """Known disagreement (2): the JSON header lists tensors in the reverse of their data order."""
    header, buffer = parse_st(d)
    meta = {k: v for k, v in header.items() if k == "__metadata__"}
    tensors = [(k, v) for k, v in header.items() if k != "__metadata__"]
    return st_rebuild({**meta, **dict(reversed(tensors))}, buffer)


def _st_edit(edit: Callable[[dict[str, Any]], None]) -> Mutation:
    def apply(d: bytes) -> bytes:
        header, buffer = parse_st(d)
        edit(header)
        return st_rebuild(header, buffer)

    return apply


def _first(header: dict[str, Any]) -> dict[str, Any]:
    """The header entry of the first tensor in data order."""
    tensors = [v for k, v in header.items() if k != "__metadata__"]
    return min(tensors, key=lambda v: tuple(v["data_offsets"]))


def _ckptfix_meta(edit: Callable[[dict[str, Any]], None]) -> Mutation:
    def apply(header: dict[str, Any]) -> None:
        meta = header.setdefault("__metadata__", {})
        inner = json.loads(meta.get("ckptfix", "{}"))
        edit(inner)
        meta["ckptfix"] = json.dumps(inner)

    return _st_edit(apply)


def _grow_end(header: dict[str, Any]) -> None:
    _first(header)["data_offsets"][1] += 4


def st_mutations() -> Mutations:
    m = Mutations()
    truncations(m)
    m.add("len+1", lambda d: patch(d, 0, struct.pack("<Q", struct.unpack_from("<Q", d)[0] + 1)))
    m.add("len-1", lambda d: patch(d, 0, struct.pack("<Q", struct.unpack_from("<Q", d)[0] - 1)))
    m.add("len-huge", lambda d: patch(d, 0, struct.pack("<Q", 2**63)))
    m.add("known-header-order-differs", st_header_order_differs)
    m.add("dtype-f16", _st_edit(lambda h: _first(h).update(dtype="F16")))
    m.add("dtype-i32", _st_edit(lambda h: _first(h).update(dtype="I32")))  # same width: bytes reinterpreted
    m.add("shape-lie", _st_edit(lambda h: _first(h).update(shape=[*_first(h)["shape"], 2])))
    m.add("offset-lie", _st_edit(_grow_end))
    m.add("json-flip", lambda d: flip(d, 8 + struct.unpack_from("<Q", d)[0] // 2, 0x02))
    m.add("json-quote", lambda d: patch(d, 9, b"'"))
    m.add("data-flip", lambda d: flip(d, len(d) - 3, 0x10))
    m.add("trailing", lambda d: d + b"\0" * 8)
    m.add("meta-dropped", _st_edit(lambda h: h.pop("__metadata__", None)))
    m.add("meta-alias-missing", _ckptfix_meta(lambda meta: meta.update(aliases={"ghost": "nowhere"})))
    m.add("meta-keys-short", _ckptfix_meta(lambda meta: meta.update(keys=["only"])))
    m.add("meta-entry-odd", _ckptfix_meta(lambda meta: meta.update(entry="model", order=["x"])))
    m.add("meta-not-json", _st_edit(lambda h: h.setdefault("__metadata__", {}).update(ckptfix="{not json")))
    return m


LIGHT_ST = ("trunc0.5", "known-header-order-differs", "dtype-i32", "json-flip")


def legacy_mutations() -> Mutations:
    m = Mutations()
    truncations(m, (0.1, 0.5, 0.9))
    for frac in (0.02, 0.2, 0.4):
        m.add(f"flip{frac:g}", functools.partial(_flip_at, frac=frac))
    return m


# --- shapes of hostile pickles ---------------------------------------------------------------------------------


def dag_pickle(depth: int, *, tensor: bool = True) -> bytes:
    """A checkpoint whose ``cfg`` lists the ``depth + 1`` levels of a DAG, each level a list holding the one below
    twice (by memo reference). A few bytes per level in the file, ``2**depth`` paths for a walk that does not
    notice shared references. Only opcodes torch's weights-only unpickler reads.
    """
    levels = P.lst(P.integer(1)) + P.put(0)
    for level in range(1, depth + 1):
        levels += P.lst(P.get(level - 1), P.get(level - 1)) + P.put(level)
    entries = [("w", P.tensor(P.storage(P.string("0"), numel=2), shape=[2]))] if tensor else []
    return tensor_pickle(entries, extra=[("cfg", b"](" + levels + b"e")])


def self_list_pickle() -> bytes:
    """``cfg`` is a list that contains itself."""
    cfg = b"]" + P.put(0) + P.get(0) + b"a"
    return tensor_pickle([("w", P.tensor(P.storage(P.string("0"), numel=2), shape=[2]))], extra=[("cfg", cfg)])


def self_dict_pickle() -> bytes:
    """The model state dict holds itself under one of its keys."""
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    model = P.odict() + P.put(0) + b"(" + P.string("w") + w + P.string("me") + P.get(0) + b"u"
    return P.proto(2) + P.dct([(P.string("model"), model)]) + P.stop()


def deep_pickle(depth: int) -> bytes:
    """``cfg`` is ``depth`` nested lists: ``[[[...]]]``."""
    cfg = b"]" * depth + b"a" * (depth - 1)
    return tensor_pickle([("w", P.tensor(P.storage(P.string("0"), numel=2), shape=[2]))], extra=[("cfg", cfg)])


def bytes8_pickle(length: int) -> bytes:
    """A BINBYTES8 opcode claiming ``length`` bytes, followed by a handful."""
    return P.proto(4) + b"\x8e" + struct.pack("<Q", length) + b"tiny" + P.stop()


# --- the hostile files of issue 15 -----------------------------------------------------------------------------

SECRET = b"SECRET-RECORD-MUST-NEVER-LEAK!!!" * 8  # 256 bytes, placed right after the storage a hostile file abuses


def with_secret(data_pkl: bytes, storage: bytes = b"") -> bytes:
    """An archive whose ``data/0`` (``storage``, default two floats) is followed at once by a secret record."""
    return torch_zip_file(data_pkl, {"0": storage or floats(1.0, 2.0)}, extra=[Rec("archive/data/9", SECRET)])


def storage_bypasses() -> dict[str, bytes]:
    """Case 3: files whose tensors claim more bytes than their storage record holds, by a detour each."""

    def one(*tensors: bytes) -> bytes:
        return with_secret(tensor_pickle([(f"w{i}", t) for i, t in enumerate(tensors)]))

    s0 = P.string("0")
    return {
        "int-key": one(P.tensor(P.storage(P.integer(0), numel=64), shape=[64])),
        "quantized": one(P.tensor(P.storage(s0, kind="QInt8Storage", numel=256), shape=[256])),
        "key-twice": one(
            P.tensor(P.storage(s0, kind="DoubleStorage", numel=32), shape=[32]),
            P.tensor(P.storage(s0, kind="FloatStorage", numel=2), shape=[2]),
        ),
        "key-twice-reversed": one(
            P.tensor(P.storage(s0, kind="FloatStorage", numel=2), shape=[2]),
            P.tensor(P.storage(s0, kind="DoubleStorage", numel=32), shape=[32]),
        ),
        "negative-offset": one(P.tensor(P.storage(s0, numel=2), offset=-1, shape=[2])),
        "view-past-end": one(P.tensor(P.storage(s0, numel=2), shape=[64])),
        "view-past-end-by-offset": one(P.tensor(P.storage(s0, numel=2), offset=1, shape=[2])),
        "negative-stride": one(P.tensor(P.storage(s0, numel=2), offset=1, shape=[2], stride=[-1])),
        "overflowing-size": one(P.tensor(P.storage(s0, numel=2), shape=[2**32, 2**32], stride=[2**32, 1])),
        "overflowing-stride": one(P.tensor(P.storage(s0, numel=2), shape=[2, 2], stride=[2**62, 1])),
        "negative-dim": one(P.tensor(P.storage(s0, numel=2), shape=[-1], stride=[1])),
        # no element at all, yet torch refuses them: it multiplies the sizes before it meets the 0
        "zero-elements-numel-overflow": one(P.tensor(P.storage(s0, numel=2), shape=[2**62, 4, 0], stride=[4, 1, 1])),
        "zero-elements-size-past-int64": one(P.tensor(P.storage(s0, numel=2), shape=[2**63, 0], stride=[1, 1])),
    }


def laundering_pickle() -> bytes:
    """Case 2: only allowlisted globals, but BUILD gives the ``builtins.set`` global itself the slots of os.system."""
    state = P.tup(P.none(), P.dct([(P.string("name"), P.string("system")), (P.string("module"), P.string("os"))]))
    cfg = P.glob("builtins", "set") + P.build(state)
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    return P.proto(2) + P.dct([(P.string("cfg"), cfg), (P.string("model"), P.odict([(P.string("w"), w)]))]) + P.stop()


def storage_rename_pickle() -> bytes:
    """Case 2: BUILD renames the ``torch.FloatStorage`` global to ``IntStorage`` before a float tensor uses it."""
    cfg = P.glob("torch", "FloatStorage") + P.build(
        P.tup(P.none(), P.dct([(P.string("name"), P.string("IntStorage"))]))
    )
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    return P.proto(2) + P.dct([(P.string("cfg"), cfg), (P.string("model"), P.odict([(P.string("w"), w)]))]) + P.stop()


def name_confusion(evil: bytes, *, evil_first: bool) -> bytes:
    """Case 4: ``archive/data.pkl`` (a plain checkpoint) beside ``archive/data.pkL`` (``evil``)."""
    good = tensor_pickle([("w", P.tensor(P.storage(P.string("0"), numel=2), shape=[2]))])
    pickles = [Rec("archive/data.pkl", good), Rec("archive/data.pkL", evil)]
    records = (pickles[::-1] if evil_first else pickles) + [
        Rec("archive/byteorder", b"little"),
        Rec("archive/data/0", floats(1.0, 2.0)),
        Rec("archive/version", b"3\n"),
    ]
    return build_zip(records)


def small_checkpoint(*values: float) -> bytes:
    """A torch archive of ``{"model": {"w": tensor(values)}}``."""
    w = P.tensor(P.storage(P.string("0"), numel=len(values)), shape=[len(values)])
    return torch_zip_file(tensor_pickle([("w", w)]), {"0": floats(*values)})


def concatenated(*, absolute: bool) -> bytes:
    """Case 4: two valid archives back to back; the second one's offsets right for the file or only for itself."""
    first = small_checkpoint(1.0, 2.0)
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    records = [
        Rec("archive/data.pkl", tensor_pickle([("w", w)])),
        Rec("archive/byteorder", b"little"),
        Rec("archive/data/0", floats(3.0, 4.0)),
        Rec("archive/version", b"3\n"),
    ]
    return first + build_zip(records, start=len(first) if absolute else 0)


def many_entries(count: int = 2000, size: int = 1 << 20) -> bytes:
    """Case 4: ``count`` central-directory entries (data/0 .. data/N) all pointing at one record of ``size`` bytes."""
    numel = size // 4
    tensors = [(f"w{i}", P.tensor(P.storage(P.string(str(i)), numel=numel), shape=[numel])) for i in range(count)]
    records = [
        Rec("archive/data.pkl", tensor_pickle(tensors)),
        Rec("archive/byteorder", b"little"),
        Rec("archive/data/0", b"\x00" * size),
        Rec("archive/version", b"3\n"),
    ]
    directory = [Cd(r.name, i) for i, r in enumerate(records)]
    directory += [Cd(f"archive/data/{i}", 2) for i in range(1, count)]
    return build_zip(records, directory=directory)


def one_tensor_with(name: str, value: bytes) -> bytes:
    """A torch archive of ``{"model": {"w": tensor([1., 2.])}, name: value}`` (``value`` raw opcodes)."""
    return torch_zip_file(one_tensor_pickle_with(name, value), {"0": floats(1.0, 2.0)})


def expanded(value: float, numel: int = 2**31) -> bytes:
    """Case 5: a stride-0 tensor of ``numel`` float32 elements (8 GiB for 2**31) backed by one 4-byte element."""
    w = P.tensor(P.storage(P.string("0"), numel=1), shape=[numel], stride=[0])
    b = P.tensor(P.storage(P.string("1"), numel=2), shape=[2])
    return torch_zip_file(tensor_pickle([("weight", w), ("bias", b)]), {"0": floats(value), "1": floats(1.0, 2.0)})


def deep_json_header(depth: int = 100_000) -> bytes:
    """Case 5: a safetensors header whose metadata nests ``depth`` JSON arrays."""
    nested = b"[" * depth + b"]" * depth
    raw = b'{"__metadata__": {"x": ' + nested + b'}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    return st_file(raw=raw, data=floats(1.0, 2.0))


# Opcodes ``pickle`` reads but torch's weights-only unpickler does not (or only some of), each as a ``cfg`` value.
EXOTIC_OPCODES: dict[str, bytes] = {
    "POP": P.integer(1) + b"0" + P.integer(2),
    "DUP": b"](" + P.integer(1) + b"2" + b"e",
    "STACK_GLOBAL-set": P.call(P.stack_glob("builtins", "set"), P.lst(P.string("x"))),
    "MEMOIZE": P.lst(P.integer(1)) + b"\x94",
    "SHORT_BINUNICODE": b"\x8c\x03abc",
    "BINBYTES": P.binbytes(b"abc"),
    "SHORT_BINBYTES": b"C\x03abc",
    "EMPTY_SET-ADDITEMS": b"\x8f(" + P.integer(1) + b"\x90",
    "FROZENSET": b"(" + P.integer(1) + b"\x91",
    "STRING": b"S'abc'\n",
    "INT": b"I42\n",
    "LONG": b"L42\n",
    "LONG4": b"\x8b\x01\x00\x00\x00\x05",
    "BINFLOAT-nan": b"G\x7f\xf8\x00\x00\x00\x00\x00\x01",
    "NEXT_BUFFER": b"\x97",
    "EXT1": b"\x82\x01",
}


# Pickles aimed at the fast reader (the C unpickler after opscan's proof): each must get exactly the answer of the
# reference reader. BUILD is where the C unpickler differs most: it skips a None state, splits a (state, slots)
# tuple and writes any __dict__; the memo array is sized by the largest LONG_BINPUT index.
def _odict_metadata(meta: bytes) -> bytes:
    return P.build(P.dct([(P.string("_metadata"), meta)]))


_W = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
_GOOD_META = P.odict([(P.string(""), P.dct([(P.string("version"), P.integer(1))]))])
C_PATH_CASES: dict[str, bytes] = {
    "build-none-on-list": P.lst() + P.build(P.none()),
    "build-none-on-dict": P.dct([]) + P.build(P.none()),
    "build-memo-none-on-list": P.none() + P.put(200) + P.lst() + P.build(P.get(200)),
    "build-empty-dict-on-list": P.lst() + P.build(P.dct([])),
    "build-empty-dict-on-int": P.integer(3) + P.build(P.dct([])),
    "build-slots-on-odict": P.odict() + P.build(P.tup(P.dct([]), P.dct([(P.string("keys"), P.integer(1))]))),
    "build-dunder-on-odict": P.odict() + P.build(P.dct([(P.string("__class__"), P.integer(1))])),
    "build-int-key-on-odict": P.odict() + P.build(P.dct([(P.integer(1), P.integer(1))])),
    "build-bad-then-good-metadata": P.odict() + _odict_metadata(P.integer(5)) + _odict_metadata(_GOOD_META),
    "build-metadata-mended-later": P.odict()
    + P.build(P.dct([(P.string("_metadata"), P.dct([(P.string("a"), P.integer(5))]) + P.put(201))]))
    + P.get(201)
    + P.string("a")
    + P.dct([])
    + b"s0",  # POP: torch does not read it, neither path accepts
    "build-metadata-mended-in-list": P.lst(
        P.odict() + P.build(P.dct([(P.string("_metadata"), P.dct([(P.string("a"), P.integer(5))]) + P.put(202))])),
        P.get(202) + P.string("a") + P.dct([]) + b"s",
    ),
    "build-good-metadata": P.odict([(P.string("w"), _W)]) + _odict_metadata(_GOOD_META),
    "build-on-odict-class": P.glob("collections", "OrderedDict") + P.build(P.dct([])),
    "build-on-tensor": _W + P.build(P.dct([])),
    "build-on-storage": P.storage(P.string("0"), numel=2) + P.build(P.dct([])),
    "build-on-size": P.call(P.glob("torch", "Size"), P.tup(P.integer(2))) + P.build(P.dct([])),
    "build-twice-on-size": P.call(P.glob("torch", "Size"), P.tup()) + P.build(P.dct([])) + P.build(P.dct([])),
    "long-binput-4g": P.integer(1) + b"r\xf0\xff\xff\xff",
    "long-binput-16m": P.integer(1) + b"r\x00\x00\x00\x01",
    "long-binget-missing": b"j\xf0\xff\xff\x00",
    "deep-lists-100k": b"]" * 100_000 + b"a" * 99_999,
    "deep-tuples-5k": b"(" * 5000 + P.integer(1) + b"t" * 5000,
    "hooks-filled-after-reduce": P.lst(
        P.call(
            P.glob("torch._utils", "_rebuild_tensor_v2"),
            P.storage(P.string("0"), numel=2),
            P.integer(0),
            P.tup(P.integer(2)),
            P.tup(P.integer(1)),
            P.boolean(False),
            P.odict() + P.put(203),
        ),
        P.get(203) + P.string("hook") + P.integer(1) + b"s",
    ),
    "shape-list-grown-after-reduce": P.lst(
        P.call(
            P.glob("torch._utils", "_rebuild_tensor_v2"),
            P.storage(P.string("0"), numel=2),
            P.integer(0),
            P.lst(P.integer(2)) + P.put(204),
            P.lst(P.integer(1)),
            P.boolean(False),
            P.odict(),
        ),
        P.get(204) + P.integer(9) + b"a",
    ),
    "storage-declared-twice-other-location": P.lst(
        P.tensor(P.storage(P.string("0"), numel=2), shape=[2]),
        P.tensor(P.storage(P.string("0"), numel=2, location="cuda:0"), shape=[2]),
    ),
    "storage-declared-twice-other-size": P.lst(
        P.tensor(P.storage(P.string("0"), numel=2), shape=[2]),
        P.tensor(P.storage(P.string("0"), numel=3), shape=[2]),
    ),
    "tensor-called": P.call(_W),
    "tensor-view-past-storage": P.tensor(P.storage(P.string("0"), numel=2), offset=1, shape=[2]),
    "tensor-sizes-overflow-then-zero": P.tensor(P.storage(P.string("0"), numel=2), shape=[2**40, 2**40, 0]),
    "newobj-tensor": P.glob("torch._utils", "_rebuild_tensor_v2")
    + P.tup(
        P.storage(P.string("0"), numel=2),
        P.integer(0),
        P.tup(P.integer(2)),
        P.tup(P.integer(1)),
        P.boolean(False),
        P.odict(),
    )
    + b"\x81",
    "long-key-and-long-int": P.dct([(P.string("k" * 5000), P.integer(2**200)), (P.string("é" * 90), P.real(-0.0))]),
    "short-binstring": P.lst(b"U\x03abc", b"U\x03\xff\xfe\x00"),
    "refused-global-later": P.lst(_W, P.call(P.glob("os", "system"), P.tup(P.string("true")))),
    "empty-appends-on-dict": P.dct([]) + b"(e",
    "empty-appends-on-list": P.lst() + b"(e",
    "empty-setitems-on-list": P.lst() + b"(u",
    "empty-set-and-none": P.tup(b"\x8f", P.none(), P.boolean(True), P.integer(-5), P.integer(70000)),
}


def c_path_pickle(name: str) -> bytes:
    """The protocol-2 pickle of ``{"cfg": <case>}``."""
    return P.proto(2) + P.dct([(P.string("cfg"), C_PATH_CASES[name])]) + P.stop()


def exotic_opcode_file(name: str) -> bytes:
    """A torch archive whose ``cfg`` entry is written with opcode ``name`` (``FRAME``: a protocol-4 frame)."""
    if name == "FRAME":
        body = one_tensor_pickle_with("cfg", P.integer(7))[2:]
        return torch_zip_file(P.proto(4) + b"\x95" + struct.pack("<Q", len(body)) + body, {"0": floats(1.0, 2.0)})
    return torch_zip_file(one_tensor_pickle_with("cfg", EXOTIC_OPCODES[name]), {"0": floats(1.0, 2.0)})


def one_tensor_pickle_with(name: str, value: bytes) -> bytes:
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    return tensor_pickle([("w", w)], extra=[(name, value)])


# --- a child process to run commands under limits --------------------------------------------------------------
#
# Inputs that may hang, recurse without end, allocate gigabytes, write gigabytes or poison the process are run in
# a fresh interpreter: ``python -m tests.hostile OPS.json`` runs each op and prints one JSON line per op as soon as
# it is done, so a parent that has to kill a hung child still knows which op hung.


def _op_result(op: dict[str, Any]) -> dict[str, Any]:
    import ckptfix
    from ckptfix.errors import CkptfixError

    kind = op["kind"]
    if kind == "cli":
        from click.testing import CliRunner

        from ckptfix.cli import cli

        result = CliRunner().invoke(cli, op["args"])
        return {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
    try:
        if kind == "load":
            ckptfix.load(op["path"], allow_globals=op.get("allow", ()))
        elif kind == "convert":
            ckptfix.convert_file(op["src"], op["dst"], fast=op["fast"], allow_globals=op.get("allow", ()))
        elif kind == "tensors":  # a written .pt file, read by torch itself: dtype and values of each tensor
            import torch

            loaded = torch.load(op["path"], weights_only=True)
            model = loaded.get("model", loaded)
            return {"tensors": {k: [str(v.dtype), v.tolist()] for k, v in model.items()}}
        elif kind == "globals":  # every global the data.pkl of a written .pt names
            import zipfile

            with zipfile.ZipFile(op["path"]) as zf:
                name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
                return {"globals": pickle_globals(zf.read(name))}
        else:
            raise ValueError(kind)
    except CkptfixError as e:
        return {"error": type(e).__name__, "message": str(e)}
    except BaseException as e:  # anything else is a bug the parent reports
        return {"error": f"crash:{type(e).__name__}", "message": str(e)[:500]}
    return {"error": None}


def run_ops_main(ops_file: str) -> None:
    import resource
    import sys
    import time

    spec = json.loads(Path(ops_file).read_text())
    for which, limit in (("RLIMIT_DATA", spec.get("data_bytes")), ("RLIMIT_FSIZE", spec.get("file_bytes"))):
        if limit:
            resource.setrlimit(getattr(resource, which), (limit, limit))
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the file-size limit, write() fails with EFBIG instead
    import torch  # noqa: F401  (imports before the clock starts: ops are timed, not interpreter start-up)

    import ckptfix.cli  # noqa: F401

    for op in spec["ops"]:
        start = time.monotonic()
        result = _op_result(op)
        result["seconds"] = time.monotonic() - start
        result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(result), flush=True)
    sys.stdout.flush()


PAYLOADS = {
    "os.system": lambda marker: (os.system, (f"touch {marker}",)),
    "eval": lambda marker: (eval, (f"open({str(marker)!r}, 'w')",)),
    "subprocess": lambda marker: (subprocess.call, (["touch", str(marker)],)),
    "importlib": lambda marker: (__import__("importlib").import_module, ("this",)),
}


class Payload:
    def __init__(self, kind: str, marker: Path) -> None:
        self.kind, self.marker = kind, marker

    def __reduce__(self) -> Any:
        return PAYLOADS[self.kind](self.marker)


def torch_zip(path: Path, data_pkl: bytes, *, extra: dict[str, bytes] | None = None) -> Path:
    """A torch-style archive around a hand-made data.pkl (for opcodes torch.save never writes)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/version", b"3\n")
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return path


if __name__ == "__main__":
    import sys

    run_ops_main(sys.argv[1])
