"""ckptfix.formats.records: the one tensor record protocol and the one tree walker every reader and writer uses."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from ckptfix.formats.dcp.reader import Chunk, DcpTensor, Span, TensorEntry
from ckptfix.formats.hf.folder import FolderTensor
from ckptfix.formats.records import TensorRecord, identity, is_record, map_tree, spec, storage_of
from ckptfix.formats.safetensors.file import StTensor
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
