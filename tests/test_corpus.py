"""Every file of the corpus (tests/corpus.py) through every operation: faithful, or refused in one accurate line.

For each case and operation the outcome is one of two: FAITHFUL (same keys and key order, container types and
``_metadata``, dtype, shape, stride, storage offset, storage bytes, sharing, device tags, Parameter type,
requires_grad and attributes, conj and neg bits, quantizer, sparse parts) or a refusal: exit 2 with one line
(CLI), a CkptfixError (library). Never exit 3, never a silent change.

The truth for a .pt file is what ``torch.load(weights_only=True)`` makes of it; for a .safetensors file what
``safetensors.torch.load_file`` makes of it, in the header's key order. A .safetensors output keeps values, not
layouts: its tensors are the input's as contiguous tensors (math bits resolved, Parameters stored as tensors),
and a tensor it cannot hold (a dtype safetensors has no code for, sparse, quantized) is refused by name.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests import st_spec
from tests.corpus import PT_CASES, ST_CASES, write_corpus
from tests.writers import torch_saves

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),
]

# dtypes a .safetensors file holds and safetensors.torch reads back
ST_READABLE = st_spec.FORMAT_DTYPES
# files torch.load(weights_only=True) refuses, and what ckptfix says of them (on every operation)
TORCH_REFUSES = {
    "protocol-4": "opcodes .* which torch's weights-only loader does not read",
    "protocol-5": "opcodes .* which torch's weights-only loader does not read",
}

# files a .safetensors output refuses for their other entries, and the line that says why
ST_REFUSED = {
    "full-checkpoint-tuple": r"entry 'args' \(tuple\) cannot go into \.safetensors metadata; write a \.pt file",
    "python-values": r"entry 'size' \(Size\) cannot go into \.safetensors metadata; write a \.pt file",
}

PT_OPS = ("load", "inspect", "inspect-json", "pt-fast", "pt-torch", "st-fast", "st-torch")
ST_OPS = ("load", "inspect", "inspect-json", "pt-fast", "pt-torch")
CASES = [(c, op) for c in PT_CASES for op in PT_OPS] + [(c, op) for c in ST_CASES for op in ST_OPS]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# -- what a loaded checkpoint is, down to its bits -----------------------------------------------------------------


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.untyped_storage()) if t.untyped_storage().nbytes() else b""


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    """Everything that makes a tensor what it is, bits included (torch.equal has no kernels for most dtypes and
    never calls a NaN equal)."""
    d: dict[str, Any] = {
        "type": type(t).__name__, "dtype": t.dtype, "shape": tuple(t.shape), "layout": t.layout,
        "device": t.device.type, "requires_grad": t.requires_grad, "conj": t.is_conj(), "neg": t.is_neg(),
        "attrs": {k: repr(v) for k, v in vars(t).items()},
    }  # fmt: skip
    if t.layout == torch.sparse_coo:
        d.update(coalesced=t.is_coalesced(), indices=_tensor(t._indices()), values=_tensor(t._values()))
    elif t.layout == torch.sparse_csr:
        d.update(crow=_tensor(t.crow_indices()), col=_tensor(t.col_indices()), values=_tensor(t.values()))
    else:
        d.update(stride=t.stride(), offset=t.storage_offset(), storage=_bytes(t))
    if t.is_quantized:
        d["qscheme"] = t.qscheme()
        if t.qscheme() == torch.per_tensor_affine:
            d.update(scale=t.q_scale(), zero_point=t.q_zero_point())
        else:
            d.update(scales=_tensor(t.q_per_channel_scales()), zero_points=_tensor(t.q_per_channel_zero_points()),
                     axis=t.q_per_channel_axis())  # fmt: skip
    return d


def describe(obj: Any) -> Any:
    """A loaded checkpoint as plain, comparable values: container types, key order and ``_metadata`` kept."""
    if isinstance(obj, torch.Tensor):
        return _tensor(obj)
    if isinstance(obj, Mapping):
        return (type(obj).__name__, repr(getattr(obj, "_metadata", None)), [(k, describe(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [describe(v) for v in obj])
    if isinstance(obj, float) and math.isnan(obj):
        return ("nan",)
    return (type(obj).__name__, obj)


def _tensors(obj: Any, where: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded checkpoint by its path."""
    if isinstance(obj, torch.Tensor):
        return {where: obj}
    found: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found.update(_tensors(v, f"{where}/{k}"))
    return found


def sharing(obj: Any) -> list[list[str]]:
    """Paths whose (non-empty, strided) tensors share one storage, grouped: tied weights and views."""
    groups: dict[int, list[str]] = {}
    for where, t in _tensors(obj).items():
        if t.layout == torch.strided and t.untyped_storage().nbytes():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(where)
    return sorted(g for g in groups.values() if len(g) > 1)


def load_pt(path: Path) -> tuple[Any, list[str], dict[str, str]]:
    """What torch makes of a .pt file: the object, the device tag of each storage in file order, and the tag of
    each (non-empty, strided) tensor by its path."""
    seen: list[str] = []
    tags: dict[int, str] = {}

    def where(storage: Any, location: str) -> Any:
        seen.append(location)
        if storage.nbytes():
            tags[storage.data_ptr()] = location
        return storage

    obj = torch.load(path, weights_only=True, map_location=where)
    by_key = {
        k: tags[t.untyped_storage().data_ptr()]
        for k, t in _tensors(obj).items()
        if t.layout == torch.strided and t.untyped_storage().nbytes()
    }
    return obj, seen, by_key


def header_keys(path: Path) -> list[str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k, _ in json.loads(raw[8 : 8 + n], object_pairs_hook=list) if k != "__metadata__"]


def load_st(path: Path) -> dict[str, torch.Tensor]:
    """What safetensors makes of a file (its spec, for dtypes the installed release is too old for), in the
    order its header lists the tensors."""
    tensors = st_spec.load_file(path)
    return {k: tensors[k] for k in header_keys(path)}


def assert_faithful(got: Any, want: Any) -> None:
    assert describe(got) == describe(want)
    assert sharing(got) == sharing(want)


def _value(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's values and nothing of its layout: what a .safetensors file keeps."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    return (t.dtype, tuple(t.shape), flat.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def unkeepable(state: Mapping[str, Any]) -> list[str]:
    """Keys of the tensors a .safetensors file cannot hold."""
    return [
        k
        for k, t in state.items()
        if t.layout != torch.strided or t.is_quantized or str(t.dtype).removeprefix("torch.") not in ST_READABLE
    ]


# -- running the operations -----------------------------------------------------------------------------------------


def run_cli(*args: str | Path) -> Any:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code != 3, result.output  # an internal error is never an answer
    return result


def assert_refused(result: Any, *, names: list[str], out: Path | None = None) -> None:
    """Exit 2, one line, naming one of ``names`` (in quotes, as ckptfix names keys)."""
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1, result.output
    assert any(f"'{n}'" in result.output for n in names), (names, result.output)
    assert out is None or not out.exists()


def check_refused_by_torch(name: str, op: str, src: Path, tmp: Path) -> None:
    with pytest.raises(Exception, match="Weights only load failed"):
        load_pt(src)
    reason = TORCH_REFUSES[name]
    if op == "load":
        with pytest.raises(ckptfix.CkptfixError, match=reason):
            ckptfix.load(src)
        return
    out = tmp / ("out.safetensors" if op.startswith("st-") else "out.pt")
    args = ("inspect", src, *(["--json"] if op == "inspect-json" else []))
    if not op.startswith("inspect"):
        args = ("convert", src, out, *(["--no-fast"] if op.endswith("-torch") else []))
    result = run_cli(*args)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert re.search(f"{re.escape(src.name)}: .*{reason}", result.output), result.output
    assert not out.exists()


def check_pt_input(name: str, op: str, src: Path, tmp: Path) -> None:
    if name in TORCH_REFUSES:
        check_refused_by_torch(name, op, src, tmp)
        return
    want, tags, key_tags = load_pt(src)
    if op == "load":
        assert_faithful(ckptfix.load(src), want)
    elif op.startswith("inspect"):
        result = run_cli("inspect", src, *(["--json"] if op == "inspect-json" else []))
        assert result.exit_code == 0, result.output
        if op == "inspect-json":
            summary = json.loads(result.output)
            assert summary.get("devices", {"cpu": len(tags)}) == dict(Counter(tags))
    elif op.startswith("pt-"):
        out = tmp / "out.pt"
        result = run_cli("convert", src, out, *(["--no-fast"] if op == "pt-torch" else []))
        assert result.exit_code == 0, result.output
        got, got_tags, got_key_tags = load_pt(out)
        assert_faithful(got, want)
        assert (sorted(got_tags), got_key_tags) == (sorted(tags), key_tags)  # device tags, storage by storage
    else:
        check_safetensors_output(name, op, src, tmp, want)


def describe_values(obj: Any) -> Any:
    """describe() with each tensor reduced to its values: what a .safetensors output promises to keep."""
    if isinstance(obj, torch.Tensor):
        return _value(obj)
    if isinstance(obj, Mapping):
        return (type(obj).__name__, repr(getattr(obj, "_metadata", None)), [(k, describe_values(v)) for k, v in
                obj.items()])  # fmt: skip
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [describe_values(v) for v in obj])
    return describe(obj)


def model_state(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The state dict a .safetensors file holds: ``obj`` itself, or its one entry that holds tensors."""
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    (state,) = (v for v in obj.values() if isinstance(v, Mapping) and _tensors(v))
    return state  # type: ignore[no-any-return]


def check_safetensors_output(name: str, op: str, src: Path, tmp: Path, want: Any) -> None:
    out = tmp / "out.safetensors"
    result = run_cli("convert", src, out, *(["--no-fast"] if op == "st-torch" else []))
    state = model_state(want)
    refused = unkeepable(state)
    if refused:
        assert_refused(result, names=refused, out=out)
        assert "not supported" in result.output or "sparse" in result.output or "quantized" in result.output
        return
    if name in ST_REFUSED:
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert re.search(ST_REFUSED[name], result.output), result.output
        assert not out.exists()
        return
    assert result.exit_code == 0, result.output
    got = ckptfix.load(out)  # tied tensors are stored once, under their first key: ckptfix puts them back
    if type(state) is dict:  # .safetensors keeps no container type: a dict state dict comes back an OrderedDict
        got_state = model_state(got)
        assert type(got_state) is OrderedDict and not hasattr(got_state, "_metadata")
        got = dict(got_state) if state is want else {k: dict(v) if v is got_state else v for k, v in got.items()}
    assert describe_values(got) == describe_values(want)
    stored = load_st(out)  # what the safetensors library itself reads
    assert {k: _value(t) for k, t in stored.items()} == {k: _value(state[k]) for k in stored}
    tied = {k.removeprefix("/") for group in sharing(state) for k in group[1:]}
    assert set(state) - set(stored) <= tied


def check_st_input(name: str, op: str, src: Path, tmp: Path) -> None:
    want = load_st(src)
    if op == "load":
        got = ckptfix.load(src)  # a .safetensors file records no container type: a dict or an OrderedDict
        assert type(got) in (dict, OrderedDict) and getattr(got, "_metadata", None) is None
        assert_faithful(dict(got), want)
    elif op.startswith("inspect"):
        result = run_cli("inspect", src, *(["--json"] if op == "inspect-json" else []))
        assert result.exit_code == 0, result.output
        if op == "inspect-json":
            assert json.loads(result.output)["models"][""]["dtypes"] == {name.removeprefix("st-"): len(want)}
    else:
        out = tmp / "out.pt"
        result = run_cli("convert", src, out, *(["--no-fast"] if op == "pt-torch" else []))
        assert result.exit_code == 0, result.output
        got, got_tags, _ = load_pt(out)
        assert type(got) in (dict, OrderedDict) and getattr(got, "_metadata", None) is None
        assert_faithful(dict(got), want)
        assert set(got_tags) == {"cpu"}


@pytest.mark.parametrize(("name", "op"), CASES, ids=[f"{c}:{op}" for c, op in CASES])
def test_corpus(corpus: dict[str, Path], tmp_path: Path, name: str, op: str) -> None:
    src = corpus[name]
    before = src.read_bytes()
    (check_pt_input if src.suffix == ".pt" else check_st_input)(name, op, src, tmp_path)
    assert src.read_bytes() == before, "the input was modified"


def test_the_corpus_covers_every_case_class(corpus: dict[str, Path]) -> None:
    assert len(corpus) == len(PT_CASES) + len(ST_CASES)
    seen = {str(t.dtype).removeprefix("torch.") for name, p in corpus.items() if p.suffix == ".pt"
            and name not in TORCH_REFUSES for t in _tensors(load_pt(p)[0]).values()}  # fmt: skip
    assert {
        name for name in ("complex32", "float4_e2m1fn_x2", "bits1x8", "float8_e8m0fnu", "uint64") if torch_saves(name)
    } | {"qint8"} <= seen
    big = corpus["big-endian"]
    assert b"byteorder" in big.read_bytes() and b"big" in big.read_bytes()
