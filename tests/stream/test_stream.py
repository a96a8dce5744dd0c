"""The streaming fast path against the torch path (load, convert, save), which is the reference."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ckptfix
from ckptfix.conversion.files import convert_file
from ckptfix.errors import FormatError, UnsafeCheckpointError
from ckptfix.formats.torchzip.archive import read_archive
from ckptfix.stream import Fallback, fast_convert
from ckptfix.transforms.checkpoint import convert_checkpoint
from tests.assertions import assert_same
from tests.models import make_net


def _fast(src: Path, dst: Path, **options: Any) -> Any:
    return fast_convert(src, dst, transform=lambda tree: convert_checkpoint(tree, source=str(src), **options))


def _slow(src: Path, dst: Path, **options: Any) -> Any:
    return convert_file(src, dst, fast=False, **options)


def _check_torch_output(fast: Path, slow: Path) -> None:
    for mmap in (False, True):
        assert_same(
            torch.load(fast, weights_only=True, mmap=mmap), torch.load(slow, weights_only=True, mmap=mmap), str(mmap)
        )
    with open(fast, "rb") as f:
        archive = read_archive(f.fileno(), str(fast))
    assert all(r.data_offset % 64 == 0 for r in archive.records)
    with zipfile.ZipFile(fast) as zf:
        assert zf.testzip() is None


def _dp_checkpoint() -> dict[str, Any]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    return {"epoch": 3, "model": nn.DataParallel(net).state_dict(), "optimizer": opt.state_dict(), "args": {"lr": 0.1}}


CASES = {
    "dp-state-dict": lambda: nn.DataParallel(make_net()).state_dict(),
    "compiled-state-dict": lambda: torch.compile(make_net()).state_dict(),
    "plain-state-dict": lambda: make_net().state_dict(),
    "dp-checkpoint": _dp_checkpoint,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("to", ["single", "ddp"])
def test_pt_to_pt_matches_torch_path(tmp_path: Path, case: str, to: str) -> None:
    src = tmp_path / "in.pt"
    torch.save(CASES[case](), src)
    fast = _fast(src, tmp_path / "fast.pt", to=to)
    slow = _slow(src, tmp_path / "slow.pt", to=to)
    assert fast.changes == slow.changes
    _check_torch_output(tmp_path / "fast.pt", tmp_path / "slow.pt")


def test_model_only_drops_the_other_records(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save(_dp_checkpoint(), src)
    _fast(src, tmp_path / "fast.pt", to="single", model_only=True)
    _slow(src, tmp_path / "slow.pt", to="single", model_only=True)
    _check_torch_output(tmp_path / "fast.pt", tmp_path / "slow.pt")
    with zipfile.ZipFile(tmp_path / "fast.pt") as zf:
        stored = [n for n in zf.namelist() if "/data/" in n]
    assert len(stored) == len(torch.load(tmp_path / "slow.pt", weights_only=True))


def test_sharing_is_preserved(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    tied = nn.Parameter(torch.randn(3, 2))
    sd = OrderedDict(
        [
            ("module.a", tied),
            ("module.b", tied),
            ("module.view", base[1:3]),
            ("module.t", base.t()),
            ("module.base", base),
        ]
    )
    sd._metadata = OrderedDict([("", {"version": 1}), ("module", {"version": 1})])  # type: ignore[attr-defined]
    src = tmp_path / "in.pt"
    torch.save(sd, src)
    _fast(src, tmp_path / "fast.pt")
    _slow(src, tmp_path / "slow.pt")
    _check_torch_output(tmp_path / "fast.pt", tmp_path / "slow.pt")
    out = torch.load(tmp_path / "fast.pt", weights_only=True, mmap=True)
    assert out["a"] is out["b"] and isinstance(out["a"], nn.Parameter)
    ptr = out["base"].untyped_storage().data_ptr()
    assert out["view"].untyped_storage().data_ptr() == ptr == out["t"].untyped_storage().data_ptr()
    assert out._metadata == OrderedDict([("", {"version": 1})])


def test_corrupt_record_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(100)}, src)
    with zipfile.ZipFile(src) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("data/0"))
    with open(src, "r+b") as f:
        archive = read_archive(f.fileno(), str(src))
        rec = next(r for r in archive.records if r.name == info.filename)
        os.pwrite(f.fileno(), b"\x7f", rec.data_offset + 10)
    with pytest.raises(FormatError, match=r"data/0' fails its CRC check"):
        _fast(src, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_truncated_input_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(1000)}, src)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match=r"in\.pt"):
        _fast(src, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


def test_dangerous_global_is_refused_without_running(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    marker = tmp_path / "pwned"
    torch.save({"model": {"module.w": torch.ones(2)}, "evil": _Evil(marker)}, src)
    with pytest.raises(UnsafeCheckpointError, match=r"(os|posix)\.system"):
        _fast(src, tmp_path / "out.safetensors")  # a .safetensors output needs every value
    assert not (tmp_path / "out.safetensors").exists()
    result = _fast(src, tmp_path / "out.pt")  # a .pt copies the entry as its records, never run, and says so
    assert any("'evil'" in note and "which can run code" in note for note in result.notes), result.notes
    with pytest.raises(UnsafeCheckpointError, match=r"(os|posix)\.system"):
        ckptfix.load(tmp_path / "out.pt")  # the copy is refused as the input is
    assert not marker.exists(), "the pickle's payload ran"


def test_globals_need_the_same_allowance_on_both_paths(tmp_path: Path) -> None:
    import argparse

    src = tmp_path / "in.pt"
    torch.save({"model": {"module.w": torch.ones(2)}, "args": argparse.Namespace(lr=1)}, src)
    for fast in (True, False):  # values needed: a .safetensors output, or the torch path, which builds them
        with pytest.raises(UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'"):
            convert_file(src, tmp_path / "out.safetensors", fast=fast)
    with pytest.raises(UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'"):
        convert_file(src, tmp_path / "out.pt", fast=False)
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out.safetensors").exists()
    result = convert_file(src, tmp_path / "out.pt", allow_globals=["argparse.Namespace"])
    assert result.method == "stream"
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["args"] == argparse.Namespace(lr=1)
    assert list(out["model"]) == ["w"] and torch.equal(out["model"]["w"], torch.ones(2))


def _rezip(src: Path, dst: Path, *, order: list[str] | None = None, compress: bool = False) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        names = order or zin.namelist()
        for name in names:
            zout.writestr(name, zin.read(name), compress_type=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)


def test_fallbacks(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    _rezip(src, tmp_path / "deflated.pt", compress=True)
    with pytest.raises(FormatError, match="compressed"):
        _fast(tmp_path / "deflated.pt", tmp_path / "out.pt")
    names = zipfile.ZipFile(src).namelist()
    _rezip(src, tmp_path / "late.pt", order=names[1:] + names[:1])
    _fast(tmp_path / "late.pt", tmp_path / "out.pt")  # data.pkl need not come first
    assert torch.equal(torch.load(tmp_path / "out.pt")["w"], torch.ones(2))
    (tmp_path / "out.pt").unlink()
    torch.save({"module.w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(Fallback, match="legacy"):
        _fast(tmp_path / "legacy.pt", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_a_tensor_the_writer_cannot_reproduce_sends_the_conversion_the_torch_way(tmp_path: Path) -> None:
    # a tensor with a Python attribute is pickled through _rebuild_from_type_v2: only torch rebuilds it exactly
    weight = torch.ones(2, requires_grad=True)
    weight.note = "kept"  # type: ignore[attr-defined]
    torch.save({"module.w": weight, "module.b": torch.zeros(2)}, tmp_path / "in.pt")
    with pytest.raises(Fallback, match=r"_rebuild_from_type_v2\(\.\.\.\), which the torch path rebuilds"):
        _fast(tmp_path / "in.pt", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    result = convert_file(tmp_path / "in.pt", tmp_path / "out.pt", to="single")
    assert result.method == "torch"
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == ["w", "b"] and out["w"].note == "kept" and torch.equal(out["w"], weight.detach())


def test_convert_file_takes_the_fast_path(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save(nn.DataParallel(make_net()).state_dict(), src)
    result = convert_file(src, tmp_path / "out.pt", to="single")
    assert result.method == "stream"


# --- safetensors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_pt_to_safetensors_is_byte_identical_to_torch_path(tmp_path: Path, case: str) -> None:
    src = tmp_path / "in.pt"
    obj = CASES[case]()
    if case == "dp-checkpoint":
        obj.pop("optimizer")
    torch.save(obj, src)
    _fast(src, tmp_path / "fast.safetensors", to="single")
    _slow(src, tmp_path / "slow.safetensors", to="single")
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "slow.safetensors").read_bytes()


def test_pt_to_safetensors_falls_back_on_views(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.t": torch.ones(2, 3).t()}, src)
    with pytest.raises(Fallback, match="non-contiguous"):
        _fast(src, tmp_path / "out.safetensors")


def test_pt_to_safetensors_takes_empty_views(tmp_path: Path) -> None:
    # Empty tensors have no bytes to copy, whatever their strides or their offset into an empty storage.
    src = tmp_path / "in.pt"
    empty_past_end = torch.empty(2, 0)[1:]
    assert empty_past_end.storage_offset() == 1
    torch.save({"module.e": empty_past_end, "module.t": torch.empty(0, 3).t(), "module.w": torch.ones(2)}, src)
    _fast(src, tmp_path / "fast.safetensors")
    _slow(src, tmp_path / "slow.safetensors")
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "slow.safetensors").read_bytes()


@pytest.mark.parametrize("to", ["single", "ddp"])
def test_safetensors_round_trips_match_torch_path(tmp_path: Path, to: str) -> None:
    src = tmp_path / "in.safetensors"
    sd = nn.DataParallel(make_net()).state_dict()
    _slow_save_st(sd, src)
    _fast(src, tmp_path / "fast.safetensors", to=to)
    _slow(src, tmp_path / "slow.safetensors", to=to)
    # the same header and data; only the header's padding differs (the fast path keeps offsets modulo 4096)
    assert _st_parts(tmp_path / "fast.safetensors") == _st_parts(tmp_path / "slow.safetensors")
    _fast(src, tmp_path / "fast.pt", to=to)
    _slow(src, tmp_path / "slow.pt", to=to)
    _check_torch_output(tmp_path / "fast.pt", tmp_path / "slow.pt")


def test_safetensors_to_pt_keeps_strides_of_empty_tensors(tmp_path: Path) -> None:
    # torch's contiguous strides count a zero-size dim as 1: (1, 0) has stride (1, 1), not (0, 1).
    src = tmp_path / "in.safetensors"
    _slow_save_st({"module.a": torch.empty(1, 0), "module.b": torch.empty(2, 0, 3), "module.c": torch.ones(2)}, src)
    _fast(src, tmp_path / "fast.pt")
    _slow(src, tmp_path / "slow.pt")
    _check_torch_output(tmp_path / "fast.pt", tmp_path / "slow.pt")
    assert torch.load(tmp_path / "fast.pt", weights_only=True)["b"].stride() == (3, 3, 1)


def _st_parts(path: Path) -> tuple[Any, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _slow_save_st(obj: Any, path: Path) -> None:
    from ckptfix.formats.registry import save

    save(obj, path)


def test_fast_path_does_not_import_torch(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    code = (
        "import sys; from ckptfix.stream import fast_convert; "
        "from ckptfix.transforms.checkpoint import convert_checkpoint;"
        f"fast_convert({str(src)!r}, {str(tmp_path / 'out.pt')!r}, transform=lambda t: convert_checkpoint(t));"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == ["w"]


def test_safetensors_header_is_padded(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(3)}, src)
    _fast(src, tmp_path / "out.safetensors")
    raw = (tmp_path / "out.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0


# --- zip64 ----------------------------------------------------------------------------------------------------


def _zeros_crc(n: int) -> int:
    crc, zeros = 0, bytes(64 << 20)
    while n:
        crc = zlib.crc32(zeros[: min(n, len(zeros))], crc)
        n -= min(n, len(zeros))
    return crc


def _write_sparse_torch(path: Path, *, start: int, big: int = 0) -> torch.Tensor:
    """A torch zip whose records after data.pkl begin past byte ``start`` (a hole), optionally with a ``big``-byte
    uint8 tensor that is a hole except for its last 8 bytes; returns the small tensor it holds."""
    from ckptfix.formats.pickles import pickling
    from ckptfix.formats.torchzip.archive import ZipWriter
    from ckptfix.formats.torchzip.reader import stand_ins, tensor_record

    small = torch.arange(6, dtype=torch.float32)
    glob = stand_ins()
    tree: dict[str, Any] = {"module.small": tensor_record("float32", (6,), "0", 24, glob=glob)}
    if big:
        tree["module.big"] = tensor_record("uint8", (big,), "1", big, glob=glob)
    with open(path, "wb") as f:
        w = ZipWriter(f.fileno())
        pkl = pickling.dump(tree)
        w.add("archive/data.pkl", pkl, zlib.crc32(pkl))
        # records must tile the file: the hole is an unreferenced storage record of zeros, never read
        w.begin("archive/data/hole", start)
        w.end(_zeros_crc(start))
        w.add("archive/byteorder", b"little", zlib.crc32(b"little"))
        raw = small.numpy().tobytes()
        w.add("archive/data/0", raw, zlib.crc32(raw))
        if big:
            tail = bytes(range(1, 9))
            offset = w.begin("archive/data/1", big)
            os.pwrite(f.fileno(), tail, offset + big - 8)
            w.end(zlib.crc32(tail, _zeros_crc(big - 8)))
        w.add("archive/version", b"3\n", zlib.crc32(b"3\n"))
        w.finish()
    return small


@pytest.mark.slow
def test_zip64_offsets_read_and_written(tmp_path: Path) -> None:
    src = tmp_path / "far.pt"
    small = _write_sparse_torch(src, start=(1 << 32) + 100)
    with zipfile.ZipFile(src) as zf:
        assert zf.testzip() is None
    with open(src, "rb") as f:
        archive = read_archive(f.fileno(), str(src))
    assert min(r.header_offset for r in archive.records[2:]) > 1 << 32  # after data.pkl and the hole
    assert all(r.data_offset % 64 == 0 for r in archive.records)
    for mmap in (False, True):
        assert torch.equal(torch.load(src, weights_only=True, mmap=mmap)["module.small"], small)
    _fast(src, tmp_path / "near.pt")
    assert torch.equal(torch.load(tmp_path / "near.pt", weights_only=True, mmap=True)["small"], small)


@pytest.mark.slow
def test_checkpoint_over_4_gib(tmp_path: Path) -> None:
    big = (1 << 32) + 4096
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    if free < 3 * big:
        pytest.skip(f"needs {3 * big >> 30} GiB free in {tmp_path}, has {free >> 30} GiB")
    src = tmp_path / "big.pt"
    small = _write_sparse_torch(src, start=0, big=big)
    _fast(src, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    assert list(out) == ["small", "big"]
    assert torch.equal(out["small"], small)
    assert out["big"].shape == (big,)
    assert out["big"][-8:].tolist() == list(range(1, 9)) and int(out["big"][: 1 << 20].sum()) == 0
    with zipfile.ZipFile(tmp_path / "out.pt") as zf:
        assert zf.getinfo("archive/data/1").file_size == big


# ----------------------------------------------------------------------------------------------------------------------
# Property-based: random state dicts through the fast path and the torch path give the same checkpoint.


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.uint16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]  # fmt: skip


def _saves(dtype: torch.dtype) -> bool:
    """Whether this torch's torch.save writes the dtype (torch 2.5 and older have no storage type for uint16)."""
    try:
        torch.save(torch.zeros(1, dtype=dtype), io.BytesIO())
    except KeyError:
        return False
    return True


DTYPES = [dtype for dtype in DTYPES if _saves(dtype)]
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape).clone()


@st.composite
def state_dicts(draw: st.DrawFn) -> OrderedDict[str, Any]:
    n = draw(st.integers(1, 6))
    sd: OrderedDict[str, Any] = OrderedDict()
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        t = _tensor(dtype, draw(SHAPES), seed=i)
        kind = draw(st.sampled_from(["plain", "param", "view", "transposed", "tied"]))
        if kind == "param" and dtype.is_floating_point and dtype.itemsize > 1:
            t = nn.Parameter(t, requires_grad=draw(st.booleans()))
        elif kind == "view" and t.dim() and t.shape[0] > 1:
            t = t[1:]
        elif kind == "transposed" and t.dim() == 2:
            t = t.t()
        elif kind == "tied" and sd:
            t = sd[draw(st.sampled_from(sorted(sd)))]
        sd[f"module.layer{i}.weight"] = t
    sd._metadata = OrderedDict([("", {"version": 1}), ("module", {"version": 1})])  # type: ignore[attr-defined]
    return sd


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=state_dicts(), to=st.sampled_from(["single", "compiled"]), out=st.sampled_from([".pt", ".safetensors"]))
def test_random_state_dicts(tmp_path_factory: pytest.TempPathFactory, sd: Any, to: str, out: str) -> None:
    tmp = Path(tmp_path_factory.mktemp("prop"))
    torch.save(sd, tmp / "in.pt")
    try:
        _fast(tmp / "in.pt", tmp / f"fast{out}", to=to)
    except Fallback as e:
        # Only pt->safetensors may decline, and only for views it cannot copy as one range.
        assert out == ".safetensors" and "non-contiguous" in str(e)
        assert not (tmp / f"fast{out}").exists()
        return
    _slow(tmp / "in.pt", tmp / f"slow{out}", to=to)
    if out == ".pt":
        _check_torch_output(tmp / "fast.pt", tmp / "slow.pt")
    else:
        assert (tmp / "fast.safetensors").read_bytes() == (tmp / "slow.safetensors").read_bytes()
        _fast(tmp / "fast.safetensors", tmp / "back.pt", to="single")
        _slow(tmp / "slow.safetensors", tmp / "back_slow.pt", to="single")
        _check_torch_output(tmp / "back.pt", tmp / "back_slow.pt")
