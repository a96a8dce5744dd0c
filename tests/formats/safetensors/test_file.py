"""ckptfix.formats.safetensors: the header read and written by its rules (header.py), the files they make."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, load_model

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from tests import hostile
from tests.assertions import assert_same
from tests.dtype_files import BYTE_DTYPES, QUANTIZED, make
from tests.entry_points import Expect, _consistent, refused_everywhere
from tests.measured import OUTPUTS, refused
from tests.parity import PATHS

# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


def _safetensors_by_hand(path: Path, shape: list[int]) -> None:
    import json
    import struct

    raw = json.dumps({"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.mark.parametrize("size", [2**64, 2**63])
def test_empty_tensor_past_64_bits_from_safetensors(tmp_path: Path, size: int) -> None:
    src = tmp_path / "in.safetensors"
    _safetensors_by_hand(src, [0, size])
    for out, *options in OUTPUTS:
        refused("convert", src, out, *options, source=src, cwd=tmp_path, contains="past 64 bits")


def test_written_headers_are_ones_the_library_reads(tmp_path: Path) -> None:
    from ckptfix.errors import OutputError
    from ckptfix.formats.safetensors.header import LIBRARY_MAX_HEADER, encode_header

    with pytest.raises(OutputError, match=r"^x\.safetensors: key 'e' has shape \[0, 18446744073709551616\]"):
        encode_header({"e": None}, {}, [("e", "float32", (0, 2**64), 0)], {}, out="x.safetensors")
    many = [(f"k{i:07d}", "float32", (0,), 0) for i in range(LIBRARY_MAX_HEADER // 60)]
    with pytest.raises(OutputError, match=r"^x\.safetensors: its safetensors header would take \d+ bytes"):
        encode_header(dict.fromkeys(k for k, *_ in many), {}, many, {}, out="x.safetensors")
    safetensors = pytest.importorskip("safetensors.torch")
    fine = [("e", "float32", (0, 2**62), 0)]
    path = tmp_path / "ok.safetensors"
    path.write_bytes(encode_header({"e": None}, {}, fine, {}, out=str(path)))
    assert safetensors.load_file(path)["e"].shape == (0, 2**62)


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


def st_file(tmp_path: Path, header: Any, data: bytes = b"", *, raw: bytes | None = None) -> Path:
    body = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("case", "header", "data", "message"),
    [
        ("not_object", [1, 2], b"", "not a JSON object"),
        ("overlap", {"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps"),
        ("hole", {"a": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12, "gap"),
        ("trailing", {"a": F32}, b"\0" * 9, "after the last tensor"),
        ("past_end", {"a": {**F32, "data_offsets": [0, 16]}}, b"\0" * 8, "outside the data buffer"),
        ("size_mismatch", {"a": {**F32, "shape": [3]}}, b"\0" * 8, "needs 12 bytes"),
        ("overflow", {"a": {**F32, "shape": [2**62, 2**62]}}, b"\0" * 8, "past 64 bits"),
        ("too_large", {"a": {**F32, "shape": [2**60, 2]}}, b"\0" * 8, "needs"),
        ("bad_dtype", {"a": {**F32, "dtype": "F128"}}, b"\0" * 8, "unknown dtype"),
        ("bad_shape", {"a": {**F32, "shape": [-2]}}, b"\0" * 8, "shape"),
        ("bad_metadata", {"__metadata__": {"x": 1}, "a": F32}, b"\0" * 8, "metadata"),
        ("nul_name", {"a\x00b": F32}, b"\0" * 8, "NUL"),
    ],
)
def test_safetensors_header_rules(tmp_path: Path, case: str, header: Any, data: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        ckptfix.load(st_file(tmp_path, header, data))


def test_safetensors_header_encoding_and_size(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="UTF-8 JSON"):
        ckptfix.load(st_file(tmp_path, None, raw=b'{"a": "\xff\xfe"}'))
    with pytest.raises(FormatError, match="UTF-8 JSON"):
        ckptfix.load(st_file(tmp_path, None, raw=b"{not json"))
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 200 * 1024 * 1024) + b"{" + b" " * 100)
    with pytest.raises(FormatError):
        ckptfix.load(path)
    entry = b'{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    dup = b'{"a": ' + entry + b', "a": ' + entry + b"}"
    with pytest.raises(FormatError, match="key 'a' appears twice in the header"):
        ckptfix.load(st_file(tmp_path, None, b"\0" * 8, raw=dup))


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


def test_case5_deep_json_header_is_refused(tmp_path: Path) -> None:
    refused_everywhere(tmp_path, hostile.deep_json_header(), Expect(FormatError), suffix=".safetensors")


def test_case5_surrogate_in_a_safetensors_key(tmp_path: Path) -> None:
    raw = b'{"a\\ud800b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    src = tmp_path / "surrogate.safetensors"
    src.write_bytes(hostile.st_file(raw=raw, data=hostile.floats(1.0, 2.0)))
    problems = _consistent(tmp_path, src, key="a\ud800b")
    assert not problems, "\n".join(problems)


# Faithful to what torch and safetensors write: math bits, container types, key order of empty tensors.


def _header_keys(path: Path) -> list[str]:
    """The tensor names in the order the file's JSON header lists them."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k, _ in json.loads(raw[8 : 8 + n], object_pairs_hook=list) if k != "__metadata__"]


@pytest.mark.parametrize("formats", [("pt", "safetensors"), ("safetensors", "safetensors"), ("safetensors", "pt")])
@pytest.mark.parametrize("fast", PATHS)
def test_zero_size_tensors_keep_their_key_order(tmp_path: Path, fast: bool, formats: tuple[str, str]) -> None:
    # z20, z0 and z023 share one offset: their order is the JSON header's alone (sorted by name, it changed)
    state = {"w": torch.randn(3), "z20": torch.zeros(0), "z0": torch.zeros(0, 3), "z023": torch.zeros(2, 0),
             "b": torch.ones(2), "a": torch.zeros(0, dtype=torch.int64)}  # fmt: skip
    src, dst = tmp_path / f"in.{formats[0]}", tmp_path / f"out.{formats[1]}"
    ckptfix.save(state, src)
    ckptfix.convert_file(src, dst, fast=fast)
    assert_same(dict(ckptfix.load(dst)), state)  # key order included (.safetensors records no container type)
    if formats[1] == "pt":
        assert list(torch.load(dst, weights_only=True)) == list(state)
        return
    assert _header_keys(dst) == list(state)
    with safetensors.safe_open(dst, "pt") as f:  # the library lists names sorted, whatever the file says
        assert list(f.keys()) == sorted(state)
        for key, value in state.items():
            assert torch.equal(f.get_tensor(key), value), key


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-path"])
@pytest.mark.parametrize("name", (*BYTE_DTYPES, *QUANTIZED, "qint8"))
def test_a_dtype_safetensors_has_no_code_for_is_refused_in_one_line(tmp_path: Path, name: str, fast: bool) -> None:
    src, out = tmp_path / f"{name}.pt", tmp_path / "out.safetensors"
    torch.save({"w": make(name)[next(iter(make(name)))]}, src)
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), *([] if fast else ["--no-fast"])])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert f"not supported yet: dtype {name}" in result.output
    assert "corrupt" not in result.output
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------------
# A tensor under two names (tied weights) written into .safetensors is stored once, and ``convert`` says so, with what
# gives both names back: ``ckptfix.load`` and ``safetensors.torch.load_model`` do, ``safetensors.torch.load_file``
# gives one.


def _tied() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # an output layer tied to the input embedding, as language models tie them
    return model


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


NOTE = (
    "ckptfix: tied keys written once: '1.weight' = '0.weight' (one tensor, stored once with the alias in the "
    "metadata); ckptfix.load and safetensors.torch.load_model(model, path) give both back, "
    "safetensors.torch.load_file only the first"
)


@pytest.mark.parametrize("extra", [[], ["--no-fast"], ["--dtype", "float32"]], ids=["stream", "torch", "cast"])
def test_a_tied_key_written_once_is_said_with_what_loads_it(tmp_path: Path, extra: list[str]) -> None:
    model = _tied()
    torch.save(torch.nn.DataParallel(model).state_dict(), tmp_path / "ddp.pt")
    model.cpu()  # DataParallel moves the model to the first GPU where there is one
    out = tmp_path / "model.safetensors"
    result = run("convert", tmp_path / "ddp.pt", out, *extra)
    assert result.exit_code == 0, result.output
    assert NOTE in result.output.splitlines()
    assert sorted(load_file(out)) == ["0.weight"]  # what the note warns of
    assert sorted(ckptfix.load(out)) == ["0.weight", "1.weight"]
    other = _tied()
    torch.nn.init.zeros_(other[0].weight)
    load_model(other, out)  # strict: the shared tensor fills both names
    assert torch.equal(other[1].weight, model[1].weight)


def test_shards_say_it_too_and_untied_outputs_do_not(tmp_path: Path) -> None:
    torch.save(_tied().state_dict(), tmp_path / "tied.pt")
    result = run("convert", tmp_path / "tied.pt", f"{tmp_path / 'shards'}/", "--shard-size", "100B")
    assert result.exit_code == 0 and NOTE in result.output.splitlines()
    torch.save({k: v.clone() for k, v in _tied().state_dict().items()}, tmp_path / "untied.pt")
    result = run("convert", tmp_path / "untied.pt", tmp_path / "untied.safetensors")
    assert result.exit_code == 0 and "tied keys" not in result.output
