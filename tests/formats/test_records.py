"""ckptfix.formats.records: the one tensor record protocol and the one tree walker every reader and writer uses."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.errors import FormatError
from ckptfix.formats.dcp.reader import Chunk, DcpTensor, Span, TensorEntry
from ckptfix.formats.hf.folder import FolderTensor
from ckptfix.formats.raw import RawTensor
from ckptfix.formats.records import TensorRecord, identity, is_record, map_tree, spec, storage_of
from ckptfix.formats.safetensors.file import StTensor
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchio.opaque import describe
from ckptfix.stream.casting import CastTensor
from ckptfix.transforms.checkpoint import is_tensor
from ckptfix.writing import Placeholder


def test_every_record_is_a_tensor_and_a_real_tensor_is_not_a_record() -> None:
    st = StTensor("float32", (2, 3), 100, 124, "a.safetensors")
    assert is_record(st) and is_tensor(st) and isinstance(st, TensorRecord)
    assert not is_record(torch.zeros(2)) and is_tensor(torch.zeros(2))
    assert not is_record({"a": 1}) and not is_tensor(None)
    assert (st.numel(), st.nbytes, spec(st).shape, spec(st).dtype) == (6, 24, (2, 3), "float32")


def test_identity_and_storage_say_which_names_are_one_tensor() -> None:
    a = StTensor("float32", (2,), 8, 16, "a.safetensors")
    twin = StTensor("float32", (2,), 8, 16, "a.safetensors")
    other_file = StTensor("float32", (2,), 8, 16, "b.safetensors")
    assert identity(a) == identity(twin) and storage_of(a) == storage_of(twin)
    assert identity(a) != identity(other_file) and storage_of(a) != storage_of(other_file)
    assert storage_of(StTensor("float32", (0,), 8, 8, "a.safetensors")) is None  # an empty tensor has no bytes
    # a folder's files never share a tensor, whatever their records say
    assert identity(FolderTensor(0, a)) != identity(FolderTensor(1, twin))
    assert storage_of(FolderTensor(0, a)) == (0, storage_of(a))
    # a tensor still to compute is a tensor of its own, with no bytes yet
    p, q = Placeholder("float16", (4,)), Placeholder("float16", (4,))
    assert identity(p) != identity(q) and storage_of(p) is None
    entry = TensorEntry("float32", (2,), (Chunk((0,), (2,), Span("x.distcp", 0, 10)),))
    assert identity(DcpTensor("w", entry)) == identity(DcpTensor("w", entry)) == ("dcp", "w")


def test_real_tensors_answer_as_before() -> None:
    t = torch.arange(6.0)
    view = t[2:]
    assert spec(t).dtype == "float32" and spec(t).layout == "strided"
    assert storage_of(t) == storage_of(view)  # one storage
    assert identity(t) != identity(view)  # two tensors of it
    assert identity(FolderTensor(0, t)) == (0, identity(t))
    sparse = torch.eye(3).to_sparse()
    assert spec(sparse).layout == "sparse_coo" and storage_of(sparse) is None
    assert spec(FolderTensor(0, sparse)).layout == "sparse_coo"  # a folder's record says what its tensor is


def test_map_tree_keeps_kinds_metadata_and_what_it_does_not_enter() -> None:
    point = namedtuple("point", "x y")
    rec = Placeholder("float32", (1,))
    meta = OrderedDict(a=rec)
    meta._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    tree = {"sd": meta, "list": [rec, (rec, 1)], "nt": point(rec, 2), "n": 3}
    out = map_tree(tree, lambda r: "T")
    assert type(out["sd"]) is OrderedDict and out["sd"] == {"a": "T"}
    assert out["sd"]._metadata == {"": {"version": 1}}
    assert out["list"] == ["T", ("T", 1)] and out["n"] == 3
    assert out["nt"] is tree["nt"]  # an object: kept as it is
    assert map_tree(tree, lambda r: "T", exact=False)["nt"] == ("T", 2)  # entered, as a plain tuple
    assert tree["list"][0] is rec  # the input is never changed


def test_map_tree_picks_by_class_or_predicate_and_keeps_sharing_when_asked() -> None:
    shared = [1, 2]
    tree = {"a": shared, "b": shared, "c": 5}
    assert map_tree(tree, lambda v: v * 10, leaf=int) == {"a": [10, 20], "b": [10, 20], "c": 50}
    assert map_tree(tree, str, leaf=lambda v: v == 5)["c"] == "5"
    copied = map_tree(tree, lambda v: v, leaf=int)
    assert copied["a"] is not copied["b"]
    kept = map_tree(tree, lambda v: v, leaf=int, shared=True)
    assert kept["a"] is kept["b"] and kept["a"] is not shared


def test_byte_ranges_are_the_runs_of_file_bytes_a_record_is() -> None:
    assert StTensor("int8", (3,), 10, 13, "a.safetensors").byte_ranges() == [("a.safetensors", 10, 3)]
    assert StTensor("int8", (0,), 10, 10, "a.safetensors").byte_ranges() == []
    assert Placeholder("int8", (3,)).byte_ranges() is None  # still to compute: no bytes anywhere yet


def test_a_writer_asks_the_record_what_it_is_never_its_class(tmp_path: Path) -> None:
    """What the streams, ckptfix.writing and sanitize ask of a record: each answer is its own class's."""
    st, todo = StTensor("float32", (2,), 8, 16, "a.safetensors"), Placeholder("float16", (4,))
    assert st.stored_span == (8, 8) and todo.stored_span is None  # a safetensors record says where it lies
    for r in (st, todo):
        assert r.zip_tensor is None and not r.is_parameter and not r.parameter_state and r.cast_from is None
    cast = CastTensor("w", st, "bfloat16")
    assert cast.cast_from is st and cast.stored_span is None and cast.zip_tensor is None
    raw = RawTensor("float32", (1,), bytearray(4))
    assert raw.same_bytes(RawTensor("float32", (1,), bytearray(4))) is True
    assert raw.same_bytes(RawTensor("float32", (1,), bytearray(b"\1\0\0\0"))) is False
    assert raw.same_bytes(torch.zeros(1)) is None and st.same_bytes(raw) is None  # torch tells
    path = tmp_path / "m.pt"
    torch.save({"p": torch.nn.Parameter(torch.ones(2)), "t": torch.ones(2)}, path)
    with open(path, "rb") as f:
        tree = describe(f.fileno(), str(path), allowed=allowlist.allowed_names((), source=str(path))).tree
    p, t = tree["p"], tree["t"]
    assert p.zip_tensor is p.data and p.is_parameter and not p.parameter_state and p.zip_tensor.storage.key
    assert t.zip_tensor is t and not t.is_parameter and t.stored_span is None  # its place: the archive's to say


class _Run(TensorRecord):
    """A record type no writer has heard of: float32 values, a run of one file's bytes."""

    def __init__(self, path: str, offset: int, shape: tuple[int, ...]) -> None:
        self.path, self.offset, self.dtype, self.shape = path, offset, "float32", shape

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        return [(self.path, self.offset, self.nbytes)]


class _Runs:
    """The least a record reads its bytes through (what a stream's reader gives)."""

    source = "test"

    def __init__(self) -> None:
        self.read: list[tuple[list[tuple[int, int, int]], str, tuple[int, ...], str | None]] = []

    def fd(self, path: str) -> int:
        return {"x.bin": 7}[path]

    def runs(
        self, runs: list[tuple[int, int, int]], dtype: str, shape: tuple[int, ...], *, key: str, cast: str | None = None
    ) -> Any:
        self.read.append((runs, dtype, shape, cast))
        return key


def test_a_record_reads_its_own_runs_and_a_record_without_bytes_says_so() -> None:
    reader = _Runs()
    assert _Run("x.bin", 16, (2, 3)).read_runs(reader, key="w") == "w"  # type: ignore[arg-type]
    assert reader.read == [([(7, 16, 24)], "float32", (2, 3), None)]
    with pytest.raises(FormatError, match="'b' has no bytes in the input"):
        Placeholder("float16", (4,)).read_runs(reader, key="b")  # type: ignore[arg-type]
