"""Mutation fuzzing of the readers: the only acceptable outcomes are success or a CkptfixError.

Every input goes through ``ckptfix.load`` and both conversion paths (``fast=True``, ``fast=False``): success or
a CkptfixError with no output left, never another exception, never a payload (a marker file), never the bytes
of a record the input's tensors do not own. Besides byte mutations of real files, generators build the shapes
of issue 15: pickles with shared references (DAGs, cycles), record names differing in case, concatenated
archives, and storage references with odd keys, types, sizes, offsets, shapes and strides.

CI runs a few dozen examples per target (seconds). A longer campaign:

    CKPTFIX_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_fuzz.py -q
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptfix
from ckptfix.errors import CkptfixError
from tests import hostile
from tests.fuzzing import FUZZ
from tests.hostile import P
from tests.models import make_net

MARKER = Path(tempfile.gettempdir()) / "ckptfix-fuzz-PWNED"  # what the payloads in generated files would create


def _seeds() -> dict[str, bytes]:
    state = {"model": {f"module.{k}": v for k, v in make_net().state_dict().items()}, "epoch": 3}
    seeds = {}
    for name, kwargs in {"zip": {}, "legacy": {"_use_new_zipfile_serialization": False}}.items():
        buffer = io.BytesIO()
        torch.save(state, buffer, **kwargs)  # type: ignore[arg-type]
        seeds[name] = buffer.getvalue()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "x.safetensors"
        ckptfix.save(state, path)
        seeds["safetensors"] = path.read_bytes()
    return seeds


SEEDS = _seeds()


@st.composite
def mutated(draw: st.DrawFn, seed: str) -> bytes:
    data = bytearray(SEEDS[seed])
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "byte", "cut", "insert", "delete", "header"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:  # hit the first bytes, where headers and lengths live
            data[draw(st.integers(0, min(len(data), 128) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def _leaks(obj: Any, secret: bytes) -> bool:
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta" or obj.numel() * obj.element_size() > 1 << 24:
            return False
        try:
            raw = obj.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError):
            return False
        return secret[:16] in raw
    if isinstance(obj, dict):
        return any(_leaks(v, secret) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_leaks(v, secret) for v in obj)
    return False


def _check(data: bytes, suffix: str, *, secret: bytes | None = None) -> None:
    """Load and convert ``data`` on both paths: success or a CkptfixError, nothing else, nothing run or leaked."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"in{suffix}"
        path.write_bytes(data)
        with contextlib.suppress(CkptfixError):
            loaded = ckptfix.load(path)
            assert secret is None or not _leaks(loaded, secret)
        for fast in (True, False):
            out = Path(folder) / f"out-{fast}.pt"
            try:
                ckptfix.convert_file(path, out, fast=fast)
            except CkptfixError:
                assert not out.exists()
            else:
                assert secret is None or secret not in out.read_bytes()
        assert path.read_bytes() == data
        assert not MARKER.exists()


@pytest.mark.parametrize("seed", ["zip", "legacy"])
def test_fuzz_torch_readers(seed: str) -> None:
    @FUZZ
    @given(mutated(seed))
    def run(data: bytes) -> None:
        _check(data, ".pt")

    run()


def test_fuzz_safetensors_reader() -> None:
    @FUZZ
    @given(mutated("safetensors"))
    def run(data: bytes) -> None:
        _check(data, ".safetensors")

    run()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "I64", "BOOL", "U8", "X"]),
        "shape": st.lists(st.integers(-1, 5), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 64), min_size=0, max_size=3),
    }
)


@FUZZ
@given(
    st.dictionaries(st.text(max_size=6), _entry | _json, max_size=5),
    st.binary(max_size=64),
)
def test_fuzz_safetensors_headers(header: dict[str, object], data: bytes) -> None:
    body = json.dumps(header).encode()
    _check(struct.pack("<Q", len(body)) + body + data, ".safetensors")


# --- generators for the shapes of issue 15 ---------------------------------------------------------------------


@st.composite
def shared_references(draw: st.DrawFn) -> bytes:
    """A ``cfg`` list of memoized lists that hold earlier ones (a DAG), themselves, or, appended afterwards,
    later ones (cycles); the whole maybe nested a few thousand lists deep."""
    count = draw(st.integers(1, 40))
    body = b""
    for i in range(count):
        refs = draw(st.lists(st.integers(0, i - 1), max_size=3)) if i else []
        refs += [i] if draw(st.integers(0, 19)) == 0 else []  # now and then a list that holds itself
        body += P.lst() + P.put(i) + (b"(" + b"".join(P.get(r) for r in refs) + b"e" if refs else b"")
    for _ in range(draw(st.sampled_from([0] * 6 + [1, 2]))):  # back edges: an earlier list gets a later one
        j, k = sorted(draw(st.tuples(st.integers(0, count - 1), st.integers(0, count - 1))))
        body += P.get(j) + P.get(k) + b"a"
    depth = draw(st.sampled_from([0] * 6 + [1, 10, 500, 3000]))
    cfg = b"]" * depth + b"](" + body + b"e" + b"a" * depth
    return hostile.torch_zip_file(hostile.one_tensor_pickle_with("cfg", cfg), {"0": hostile.floats(1.0, 2.0)})


@st.composite
def name_variants(draw: st.DrawFn) -> bytes:
    """Record names changed in case, duplicated in another case, or moved: what a case-insensitive reader merges."""
    records = hostile.read_records(SEEDS["zip"])
    marker_pickle = hostile.marker_pickle(MARKER)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(records) - 1))
        name = records[i].name
        head, tail = ("", name) if draw(st.integers(0, 3)) == 0 else (name[:8], name[8:])  # the folder too, sometimes
        variant = head + "".join(c.upper() if draw(st.booleans()) else c for c in tail)
        action = draw(st.sampled_from(["rename", "add", "add-evil", "local-only"]))
        if action == "rename":
            records[i] = replace(records[i], name=variant)
        elif action == "add":
            records.insert(draw(st.integers(0, len(records))), replace(records[i], name=variant))
        elif action == "add-evil":
            records.insert(draw(st.integers(0, len(records))), hostile.Rec(variant, marker_pickle))
        else:
            records[i] = replace(records[i], local_name=variant)
    return hostile.build_zip(records)


@st.composite
def concatenations(draw: st.DrawFn) -> bytes:
    """Two archives back to back (maybe junk between), the second one's offsets for the file or for itself."""
    first = draw(st.sampled_from([SEEDS["zip"], hostile.small_checkpoint(1.0, 2.0)]))
    junk = draw(st.binary(max_size=16))
    second = hostile.read_records(draw(st.sampled_from([SEEDS["zip"], hostile.small_checkpoint(3.0, 4.0)])))
    start = len(first) + len(junk) if draw(st.booleans()) else 0
    data = first + junk + hostile.build_zip(second, start=start)
    return data if draw(st.booleans()) else data + first  # and sometimes a third copy of the first


_STORAGE_TYPES = [
    *("FloatStorage", "DoubleStorage", "HalfStorage", "LongStorage", "ByteStorage", "BoolStorage"),
    *("QInt8Storage", "QUInt8Storage", "QInt32Storage", "ComplexFloatStorage", "UntypedStorage"),
]
_KEYS = [P.string("0")] * 6 + [P.string("1")] * 3 + [P.integer(0), P.integer(-1), P.none()]
_KEYS += [P.string(k) for k in ("00", "../0", "0\x00", "data/0", "0 ", "DATA.PKL")]
_EXTREMES = [-1, -3, 2**31, 2**32, 2**62, 2**63, 2**64, -(2**63)]
_INTS = st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64] * 3 + _EXTREMES)  # mostly plausible, now and then extreme


@st.composite
def storage_references(draw: st.DrawFn) -> bytes:
    """Tensors whose persistent ids, offsets, shapes and strides are drawn, beside a secret record."""
    tensors = []
    for i in range(draw(st.integers(1, 3))):
        # mostly well-formed values, so that the checks behind the first one are reached too
        key = draw(st.sampled_from(_KEYS))
        kind = draw(st.sampled_from(_STORAGE_TYPES[:1] * 6 + _STORAGE_TYPES))
        module = "torch.storage" if kind == "UntypedStorage" else "torch"
        location = P.string(draw(st.sampled_from(["cpu"] * 8 + ["meta", "cuda:0"])))
        numel = draw(_INTS)
        pid = P.tup(P.string("storage"), P.glob(module, kind), key, location, P.integer(numel))
        ndim = draw(st.integers(0, 3))
        small = st.sampled_from([0, 1, 2, 3, 4] * 6 + _EXTREMES)
        shape = draw(st.lists(small, min_size=ndim, max_size=ndim))
        stride = draw(st.lists(small, min_size=ndim, max_size=ndim) | st.just(hostile.contiguous_stride(shape)))
        args = [P.persid(pid), P.integer(draw(small)), P.tup(*map(P.integer, shape)), P.tup(*map(P.integer, stride))]
        args += [P.boolean(False), P.odict()]
        rebuild = draw(st.sampled_from(["_rebuild_tensor_v2", "_rebuild_tensor"]))
        tensors.append(
            (f"w{i}", P.call(P.glob("torch._utils", rebuild), *(args if rebuild.endswith("v2") else args[:4])))
        )
    storages = {k: hostile.floats(*range(draw(st.integers(0, 4)))) for k in ("0", "1")}
    secret = hostile.Rec("archive/data/9", hostile.SECRET)
    return hostile.torch_zip_file(hostile.tensor_pickle(tensors), storages, extra=[secret])


@FUZZ
@given(shared_references())
def test_fuzz_shared_references(data: bytes) -> None:
    _check(data, ".pt")


@FUZZ
@given(name_variants())
def test_fuzz_name_case_variants(data: bytes) -> None:
    _check(data, ".pt")


@FUZZ
@given(concatenations())
def test_fuzz_concatenated_archives(data: bytes) -> None:
    _check(data, ".pt")


@FUZZ
@given(storage_references())
def test_fuzz_storage_references(data: bytes) -> None:
    _check(data, ".pt", secret=hostile.SECRET)


# --- the fast pickle reader against the reference reader ---------------------------------------------------------


def _seed_pickle() -> bytes:
    with zipfile.ZipFile(io.BytesIO(SEEDS["zip"])) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


SEED_PICKLE = _seed_pickle()
# Pieces that opscan must split right: opcodes with arguments of every width, BUILD after its allowed
# predecessors and after others, memo puts and gets, and a few opcodes torch does not read.
_PIECES = [
    b"}", b"]", b")", b"(", b"t", b"\x85", b"\x86", b"\x87", b"s", b"u", b"a", b"e", b"b", b"N", b"\x88", b"\x89",
    b"R", b"\x81", b"Q", b"\x8f", b"K\x05", b"M\x01\x02", b"J\xff\xff\xff\xff", b"G" + bytes(8), b"\x8a\x02\x01\x80",
    b"q\x01", b"h\x01", b"r\x02\x00\x00\x00", b"j\x02\x00\x00\x00", b"r\x00\x00\x00\x7f", b"X\x01\x00\x00\x00a",
    b"X\x00\x01\x00\x00", b"U\x02ab", b"ctorch\nSize\n", b"ccollections\nOrderedDict\n", b"cos\nsystem\n",
    b"\x80\x02", b"0", b"2", b"\x94", b"\x8c\x01a", b"\x82\x01", b"I1\n", b".",
]  # fmt: skip


@st.composite
def pickles(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return b"\x80\x02" + b"".join(draw(st.lists(st.sampled_from(_PIECES), max_size=40))) + b"."
    data = bytearray(SEED_PICKLE)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            data[at] = draw(st.sampled_from([*b"bNqrhj.su})(", draw(st.integers(0, 255))]))
        else:
            data[at:at] = draw(st.sampled_from(_PIECES))
    return bytes(data)


def _opcodes_proven(data: bytes) -> bool:
    """What opscan.provable must answer, by pickletools' argument sizes: the reference for its regular expression."""
    import pickletools

    from ckptfix.formats.pickles.unpickling import _OPCODES

    codes = {op.code.encode("latin1"): op for op in pickletools.opcodes}
    bound = 1 << ((len(data) >> 16).bit_length() + 16)  # the LONG_BINPUT bound opscan documents (well, its cause)
    pos, previous = 0, b""
    while pos < len(data):
        code, op = data[pos : pos + 1], codes.get(data[pos : pos + 1])
        if op is None or code not in _OPCODES:
            return False
        pos += 1
        n = op.arg.n if op.arg is not None else 0
        if n == pickletools.UP_TO_NEWLINE:
            for _ in range(2):
                end = data.find(b"\n", pos)
                if end < 0:
                    return False
                pos = end + 1
        elif n < 0:  # counted: 1 or 4 bytes of length first
            width = 1 if n == pickletools.TAKEN_FROM_ARGUMENT1 else 4
            if pos + width > len(data):
                return False
            pos += width + int.from_bytes(data[pos : pos + width], "little")
        else:
            if code == b"r" and int.from_bytes(data[pos : pos + 4], "little") >= bound:
                return False
            pos += n
        if pos > len(data):
            return False
        if code == b"b" and previous not in (b"}", b"s", b"u"):
            return False
        if code == b"e" and previous == b"(" and data[pos - 2 : pos] == b"(e":
            return False
        if code not in (b"q", b"r"):
            previous = code
        if code == b".":
            return True
    return False


@FUZZ
@given(pickles())
def test_fuzz_fast_pickle_reader(data: bytes) -> None:
    """opscan proves exactly what a plain opcode walk proves, and unpickling.load answers as the reference reader."""
    from ckptfix.formats.safety import opscan
    from tests.entry_points import fast_reader_problem

    assert opscan.provable(data) == _opcodes_proven(data)
    problem = fast_reader_problem(data)
    assert problem is None, problem
