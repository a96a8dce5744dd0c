"""``ckptfix inspect`` through the real click group: the summary as text and JSON, hostile key names escaped."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.formats.pickles import pickling
from ckptfix.formats.safetensors.header import encode_header
from ckptfix.formats.torchzip.archive import ZipWriter
from ckptfix.formats.torchzip.reader import HEAD, TAIL, stand_ins, tensor_record
from ckptfix.summary import describe, summarize_state
from ckptfix.transforms.checkpoint import get_entry, model_entries
from tests.dtype_files import BYTE_DTYPES, QUANTIZED, _inspect, make
from tests.extras import needs
from tests.models import make_net


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def test_inspect_text_and_json(ddp_ckpt: Path) -> None:
    result = run("inspect", str(ddp_ckpt))
    assert result.exit_code == 0, result.output
    assert "model entry 'model': layout ddp, 16 tensors" in result.output
    assert "BatchNorm statistics: 6 buffers in 2 modules" in result.output
    assert "module.features.{1,4}.{weight,bias,running_mean,running_var,num_batches_tracked}" in result.output
    assert "entry 'epoch': int 4" in result.output
    data = json.loads(run("inspect", str(ddp_ckpt), "--json").output)
    assert data["format"] == "torch-zip"
    model = data["models"]["model"]
    assert model["layout"] == "ddp"
    assert model["tensors"] == 16
    assert model["parameters"] == sum(p.numel() for p in make_net().parameters())
    assert data["other_entries"]["epoch"] == "int 4"


def test_inspect_prints_hostile_key_names_escaped(tmp_path: Path) -> None:
    state = {"conv.weight": torch.zeros(2), "x\x1b]0;pwned\x07.weight": torch.zeros(2)}
    state["y\nentry 'forged'"] = torch.ones(1)
    path = tmp_path / "evil.pt"
    torch.save({"model": state, "note\r\nentry 'forged'": 1}, path)
    result = run("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert not any(c in result.output for c in "\x1b\x07\r")
    lines = result.output.splitlines()
    assert not any(line.startswith("entry 'forged'") for line in lines)
    assert r"entry 'note\r\nentry 'forged'': int 1" in lines
    grouped = r"  {conv,x\x1b]0;pwned\x07}.weight  "
    assert lines[2] == f"{grouped}2 × float32 [2]"
    assert lines[3] == r"  y\nentry 'forged'".ljust(len(grouped)) + "float32 [1]"  # aligned as printed


# --- metadata only: no tensor byte read, torch not imported --------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GIB = 1 << 30


def _zero_crc(size: int) -> int:
    crc, chunk = 0, bytes(64 << 20)
    while size > 0:
        crc = zlib.crc32(chunk[: min(size, len(chunk))], crc)
        size -= len(chunk)
    return crc


def sparse_pt(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A torch zip of float32 zeros, laid out as torch.save does, whose data are holes (nothing on disk).

    Written by the records and zip writer of the fast path (the same bytes ``torch.save`` writes), so a file of
    any size costs only its headers; the test checks that torch itself reads it.
    """
    glob = stand_ins()
    state: OrderedDict[str, Any] = OrderedDict()
    sizes: list[int] = []
    for i, (key, shape) in enumerate(shapes.items()):
        sizes.append(math.prod(shape) * 4)
        state[key] = tensor_record("float32", shape, str(i), sizes[-1], glob=glob)
    pkl = pickling.dump({"model": state, "epoch": 1})
    crcs = {n: _zero_crc(n) for n in set(sizes)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writer = ZipWriter(fd)
        for name, data in (("data.pkl", pkl), *HEAD):
            writer.add(f"archive/{name}", data, zlib.crc32(data))
        for i, size in enumerate(sizes):
            writer.begin(f"archive/data/{i}", size)
            writer.end(crcs[size])
        for name, data in TAIL:
            writer.add(f"archive/{name}", data, zlib.crc32(data))
        writer.finish()
    finally:
        os.close(fd)


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A .safetensors file of float32 zeros: the one header writer, then holes up to the file's end."""
    stored = [(key, "float32", shape, math.prod(shape) * 4) for key, shape in shapes.items()]
    header = encode_header(dict.fromkeys(shapes), {"entry": ""}, stored, {}, out="x.safetensors")
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(n for *_, n in stored))


def _big_shapes(total_gib: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(total_gib):
        shapes[f"module.blocks.{i}.weight"] = (GIB // 4 // 8192, 8192)  # 1 GiB each
        shapes[f"module.blocks.{i}.norm.weight"] = (8192,)
        shapes[f"module.blocks.{i}.norm.running_mean"] = (8192,)
    return shapes


def test_a_100_gib_checkpoint_is_inspected_from_its_description(tmp_path: Path) -> None:
    shapes = _big_shapes(100)
    pt, st = tmp_path / "big.pt", tmp_path / "big.safetensors"
    sparse_pt(pt, shapes)
    sparse_safetensors(st, shapes)
    assert pt.stat().st_size > 100 * GIB and pt.stat().st_blocks * 512 < 64 << 20  # holes, not data
    small = {"a.weight": (3, 5), "a.bias": (5,)}
    sparse_pt(tmp_path / "small.pt", small)  # the same writer, small enough for torch to read in full
    loaded = torch.load(tmp_path / "small.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in loaded["model"].items()} == small
    assert all(not v.any() for v in loaded["model"].values()) and loaded["epoch"] == 1
    for path in (pt, st):
        start = time.perf_counter()
        summary = ckptfix.summarize(path)
        elapsed = time.perf_counter() - start
        model = next(iter(summary["models"].values()))
        assert model["tensors"] == 300 and model["bytes"] == sum(math.prod(s) * 4 for s in shapes.values())
        assert model["layout"] == "ddp" and model["batchnorm_buffers"] == 100
        assert elapsed < 5, f"{path.name}: {elapsed:.1f} s, as if tensor bytes were read"  # reading holes: minutes


def test_inspect_never_imports_torch(tmp_path: Path) -> None:
    pt, st = tmp_path / "small.pt", tmp_path / "small.safetensors"
    torch.save({"model": make_net().state_dict(), "epoch": 2}, pt)
    ckptfix.save(make_net().state_dict(), st)
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch' in sys.modules, 'numpy' in sys.modules, file=sys.stderr))\n"
        "from ckptfix.cli import main\n"
        "sys.argv = ['ckptfix', 'inspect', *sys.argv[1:]]\n"
        "main()\n"
    )
    for path in (pt, st):
        for extra in ([], ["--json"], ["--verify"]):
            done = subprocess.run(
                [sys.executable, "-c", probe, str(path), *extra], capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, done.stderr
            assert done.stderr.strip() == "False False", (path.name, extra, done.stderr)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*") if p.suffix in (".pt", ".safetensors")))
def test_the_description_says_what_loading_says(name: str) -> None:
    path = FIXTURES / name
    allow = ("argparse.Namespace",) if name == "namespace_args.pt" else ()
    summary = ckptfix.summarize(path, allow_globals=allow)
    obj = ckptfix.load(path, allow_globals=allow)
    entries = model_entries(obj)
    assert summary["models"] == {e: summarize_state(get_entry(obj, e), source=str(path)) for e in entries}
    others = {str(k): describe(v) for k, v in obj.items() if k not in entries} if entries != [""] else {}
    assert summary["other_entries"] == others
    assert ("loaded_with_torch" in summary) == (name == "legacy_dp.pt")


def test_legacy_files_say_they_were_loaded_with_torch() -> None:
    result = run("inspect", str(FIXTURES / "legacy_dp.pt"))
    assert result.exit_code == 0
    assert result.output.splitlines()[1] == (
        "loaded with torch: a legacy (pre-1.6) torch file, whose storages only torch reads"
    )


def test_verify_reads_every_record(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.arange(1000.0)}, "epoch": 1}, path)
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<2f", 100.0, 101.0))
    data[at] ^= 0xFF  # one byte of the tensor: its record's CRC no longer matches
    path.write_bytes(bytes(data))
    plain = run("inspect", str(path))
    assert plain.exit_code == 0 and "verified" not in plain.output  # the description alone is intact
    checked = run("inspect", str(path), "--verify")
    assert checked.exit_code == 2
    assert "fails its CRC check" in checked.output and "record 'ckpt/data/0'" in checked.output
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.arange(10.0)}}, good)
    assert run("inspect", str(good), "--verify").output.endswith("verified: every record read, every CRC matches\n")
    st = tmp_path / "w.safetensors"
    ckptfix.save({"w": torch.ones(3)}, st)
    assert "verified: every byte read" in run("inspect", str(st), "--verify").output


def test_inspect_says_it_read_no_tensor_bytes_unless_asked(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    plain = CliRunner().invoke(cli, ["inspect", str(tmp_path / "w.pt")])
    assert plain.output.rstrip().endswith(
        "tensor bytes not read: --verify, `ckptfix validate` or `ckptfix convert` check them"
    )
    checked = CliRunner().invoke(cli, ["inspect", str(tmp_path / "w.pt"), "--verify"])
    assert "tensor bytes not read" not in checked.output
    assert checked.output.rstrip().endswith("verified: every record read, every CRC matches")


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("name", BYTE_DTYPES + QUANTIZED)
def test_inspect_shows_every_dtype_torch_saves_with_its_byte_size(tmp_path: Path, name: str) -> None:
    src = tmp_path / f"{name}.pt"
    state = make(name)
    torch.save(state, src)
    result = CliRunner().invoke(cli, ["inspect", str(src), "--json"])
    assert result.exit_code == 0, result.output
    model = json.loads(result.output)["models"][""]
    assert model["dtypes"] == {name: len(state)}
    per_byte = {"quint4x2": 2, "quint2x4": 4}.get(name, 1)  # 7 values of quint4x2 take 4 bytes
    assert model["bytes"] == sum(-(-t.numel() // per_byte) * t.element_size() for t in state.values())


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_inspect_groups_zero_padded_keys_keeping_their_width(tmp_path: Path, fmt: str) -> None:
    from safetensors.torch import save_file

    state = {f"layer.{i:05d}.w": torch.ones(2) for i in range(12)}
    src = tmp_path / f"zp.{fmt}"
    torch.save(state, src) if fmt == "pt" else save_file(state, src)
    (group,) = _inspect(src, "--json")["models"][""]["groups"]
    assert (group["keys"], group["count"], group["shape"]) == ("layer.{00000..00011}.w", 12, [2])
    assert "layer.{00000..00011}.w  12 × float32 [2]" in _inspect(src)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_inspect_shows_keys_of_any_shape_one_group_each(tmp_path: Path) -> None:
    names = ["a{b}.c", "a,b", "x..y", "x.", ".z", "", "l.{0..2}", "m.08", "m.09", "m.10"]
    src = tmp_path / "odd.pt"
    torch.save({name: torch.ones(i + 1) for i, name in enumerate(names)}, src)
    groups = _inspect(src, "--json")["models"][""]["groups"]
    assert [g["keys"] for g in groups] == [*names[:-3], "m.{08..10}"]
    assert [g["shape"] for g in groups[:-1]] == [[i + 1] for i in range(len(names) - 3)]


SPARSE = {
    "coo": lambda t: t.to_sparse(),
    "csr": lambda t: t.to_sparse_csr(),
    "csc": lambda t: t.to_sparse_csc(),
    "bsr": lambda t: t.to_sparse_bsr((2, 2)),
    "bsc": lambda t: t.to_sparse_bsc((2, 2)),
}


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", list(SPARSE))
def test_inspect_shows_a_sparse_tensor_with_its_layout(tmp_path: Path, layout: str) -> None:
    sparse = SPARSE[layout](torch.eye(4, dtype=torch.float16))
    src = tmp_path / f"{layout}.pt"
    torch.save({"s": sparse, "w": torch.ones(3)}, src)
    model = _inspect(src, "--json")["models"][""]
    s, w = model["groups"]
    assert (s["keys"], s["dtype"], s["shape"], s["layout"]) == ("s", "float16", [4, 4], f"sparse_{layout}")
    assert "layout" not in w
    parts = {"coo": ("_indices", "_values"), "csr": ("crow_indices", "col_indices", "values"),
             "csc": ("ccol_indices", "row_indices", "values")}  # fmt: skip
    parts.update(bsr=parts["csr"], bsc=parts["csc"])
    stored = sum(getattr(sparse, p)().nbytes for p in parts[layout])
    assert model["bytes"] == stored + 12  # what the file holds, not the dense size
    assert f"s  float16 [4, 4] sparse_{layout}" in _inspect(src)


def test_a_tied_head_is_counted_once_and_said_to_share_its_storage(tmp_path: Path) -> None:
    """GPT-2's lm_head.weight is transformer.wte.weight: torch.save stores it once, and its parameters are counted
    once, as model.parameters() counts them; the HF folder (save_pretrained leaves the copy out) counts the same."""
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    model.save_pretrained(tmp_path / "hf")
    expected = sum(p.numel() for p in model.parameters())
    text = run("inspect", str(tmp_path / "gpt2.pt"))
    assert text.exit_code == 0, text.output
    assert f"{expected:,} parameters (lm_head.weight shares transformer.wte.weight's storage), " in text.output
    summary = json.loads(run("inspect", str(tmp_path / "gpt2.pt"), "--json").output)["models"][""]
    assert summary["parameters"] == expected and summary["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert summary["bytes"] == expected * 4
    folder = json.loads(run("inspect", str(tmp_path / "hf"), "--json").output)["models"][""]
    assert (folder["parameters"], folder["tied"]) == (expected, {})
