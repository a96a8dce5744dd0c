"""Zero-copy conversion: tensor bytes keep their offset modulo 4096, so XFS and btrfs can share the blocks.

Offsets are read the way torch and safetensors read them (torch's ``_checkpoint_offset`` from a meta-device load,
the safetensors header), and every output must still load through torch's own offset arithmetic.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import shutil
import struct
import subprocess
import time
import traceback
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.cli import cli
from ckptfix.conversion.files import convert_file
from ckptfix.errors import FormatError
from ckptfix.formats.registry import save
from ckptfix.formats.torchzip.archive import read_archive
from tests.assertions import assert_same

try:
    from torch.utils.serialization import config as torch_serialization
except ImportError:  # torch 2.6 and older
    torch_serialization = None

# The .pt tests check against torch's own record lookup (a storage's _checkpoint_offset after a meta-device load)
# and torch's own offset arithmetic (load.calculate_storage_offsets); releases without them have nothing to check.
TORCH_OFFSETS = pytest.mark.skipif(
    torch_serialization is None or not hasattr(torch.UntypedStorage, "_checkpoint_offset"),
    reason=f"torch {torch.__version__} has no _checkpoint_offset or torch.utils.serialization.config",
)

BLOCK = 4096
SHARE_MIN = 2 * BLOCK
FIXTURES = Path(__file__).parents[2] / "fixtures"
STREAMED = sorted(p.name for p in FIXTURES.glob("*.pt") if p.name not in ("legacy_dp.pt", "namespace_args.pt"))


def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}/{i}")


def _pt_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where torch finds each tensor's storage in the file, and its length (torch's own record lookup)."""
    meta = torch.load(path, weights_only=True, map_location="meta")
    return {k: (t.untyped_storage()._checkpoint_offset, t.untyped_storage().nbytes()) for k, t in _tensors(meta)}


def _st_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes start and how long they are, from the safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {f"/{k}": (8 + n + begin, end - begin) for k, v in header.items() for begin, end in [v["data_offsets"]]}


def _st_load(path: Path) -> dict[str, torch.Tensor]:
    """The tensors as safetensors' own reader gives them (in name order: its order for equal offsets varies)."""
    return dict(sorted(safetensors.torch.load_file(path).items()))


def _loads_through_torch_arithmetic(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch computes each storage's offset from the smallest padding when the archive says it may: it must agree."""
    plain = torch.load(path, weights_only=True)
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # torch then asserts computed == real offset
    with torch_serialization.patch({"load.calculate_storage_offsets": True}):
        assert_same(torch.load(path, weights_only=True, mmap=True), plain)
    torch.load(path, weights_only=True, map_location="meta")
    monkeypatch.delenv("TORCH_SERIALIZATION_DEBUG")


def _check_pt(out: Path, reference: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same content as the torch path's output, plain and memory-mapped; every record 64-byte aligned."""
    for mmap in (False, True):
        assert_same(torch.load(out, weights_only=True, mmap=mmap), torch.load(reference, weights_only=True))
    with open(out, "rb") as f:
        assert all(r.data_offset % 64 == 0 for r in read_archive(f.fileno(), str(out)).records)
    _loads_through_torch_arithmetic(out, monkeypatch)


def _congruent(src: dict[str, tuple[int, int]], out: dict[str, tuple[int, int]]) -> dict[str, bool]:
    # tied aliases are stored once; an empty tensor has no bytes to place
    return {k: (out[k][0] - src[k][0]) % BLOCK == 0 for k in out if k in src and out[k][1]}


# --- the fixtures: real checkpoints from real runs ------------------------------------------------------------


@TORCH_OFFSETS
@pytest.mark.parametrize("name", STREAMED)
def test_pt_to_pt_keeps_every_offset_of_a_fixture(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = FIXTURES / name, tmp_path / "out.pt"
    assert convert_file(src, out, to="single").method == "stream"
    convert_file(src, tmp_path / "torch.pt", to="single", fast=False)
    _check_pt(out, tmp_path / "torch.pt", monkeypatch)
    before, after = _pt_offsets(src), _pt_offsets(out)
    assert all(_congruent(before, after).values())
    with open(src, "rb") as f, open(out, "rb") as g:
        records = {r.name.split("/", 1)[1]: r.data_offset for r in read_archive(f.fileno(), str(src)).records}
        for rec in read_archive(g.fileno(), str(out)).records:  # every record, the small ones too
            assert (rec.data_offset - records[rec.name.split("/", 1)[1]]) % BLOCK == 0, rec.name
    assert out.stat().st_size <= src.stat().st_size + BLOCK  # at most one block of padding


def test_safetensors_fixture_keeps_offsets_to_safetensors(tmp_path: Path) -> None:
    src, out = FIXTURES / "ddp_wrapped.safetensors", tmp_path / "out.safetensors"
    assert convert_file(src, out, to=None).method == "stream"
    assert all(_congruent(_st_offsets(src), _st_offsets(out)).values())
    assert_same(_st_load(out), _st_load(src))


# --- random state dicts ---------------------------------------------------------------------------------------

NUMELS = st.sampled_from([0, 1, 3, 100, 1000, 1023, 2048, 2049, 5000, 20000])
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8, torch.float64])


@st.composite
def state_dicts(draw: st.DrawFn) -> OrderedDict[str, torch.Tensor]:
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for i in range(draw(st.integers(1, 8))):
        numel, dtype = draw(NUMELS), draw(DTYPES)
        if sd and draw(st.integers(0, 5)) == 0:
            sd[f"module.tied{i}"] = sd[draw(st.sampled_from(sorted(sd)))]
            continue
        g = torch.Generator().manual_seed(i)
        sd[f"module.layer{i}.weight"] = torch.randint(0, 100, (numel,), generator=g).to(dtype)
    return sd


@TORCH_OFFSETS
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=state_dicts(), writer=st.sampled_from(["ckptfix", "safetensors"]))
def test_random_state_dicts_keep_offsets(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, sd: Any, writer: str
) -> None:
    tmp = tmp_path_factory.mktemp("zc")
    pt, st_in = tmp / "in.pt", tmp / "in.safetensors"
    torch.save(sd, pt)
    if writer == "ckptfix":
        save(sd, st_in)
    else:  # safetensors' own writer: another header layout, tied tensors not allowed
        safetensors.torch.save_file({k: v.clone() for k, v in sd.items()}, st_in)
    # .pt -> .pt: every tensor stays where it was modulo 4096
    assert convert_file(pt, tmp / "pt.pt", to="single").method == "stream"
    convert_file(pt, tmp / "ref.pt", to="single", fast=False)
    _check_pt(tmp / "pt.pt", tmp / "ref.pt", monkeypatch)
    renamed = {f"/{k.removeprefix('/module.')}": v for k, v in _pt_offsets(pt).items()}
    assert all(_congruent(renamed, _pt_offsets(tmp / "pt.pt")).values())
    # .safetensors -> .safetensors: every tensor, whatever wrote the input
    assert convert_file(st_in, tmp / "st.safetensors", to=None).method == "stream"
    assert all(_congruent(_st_offsets(st_in), _st_offsets(tmp / "st.safetensors")).values())
    assert_same(_st_load(tmp / "st.safetensors"), _st_load(st_in))
    # .safetensors -> .pt: every long tensor whose source is 64-byte aligned (torch's records must stay so)
    assert convert_file(st_in, tmp / "st.pt", to=None).method == "stream"
    convert_file(st_in, tmp / "st_ref.pt", to=None, fast=False)
    _check_pt(tmp / "st.pt", tmp / "st_ref.pt", monkeypatch)
    source, placed = _st_offsets(st_in), _pt_offsets(tmp / "st.pt")
    for key, ok in _congruent(source, placed).items():
        offset, length = source[key]
        assert ok or length < SHARE_MIN or offset % 64, key


@TORCH_OFFSETS
def test_safetensors_to_pt_places_every_aligned_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # sizes that are multiples of 64 keep every tensor 64-byte aligned in a .safetensors written by ckptfix
    sd = {f"module.l{i}.weight": torch.randn(n) for i, n in enumerate([3008, 16, 5008, 64, 2048 * 9])}
    save(sd, tmp_path / "in.safetensors")
    assert convert_file(tmp_path / "in.safetensors", tmp_path / "out.pt", to=None).method == "stream"
    convert_file(tmp_path / "in.safetensors", tmp_path / "ref.pt", to=None, fast=False)
    _check_pt(tmp_path / "out.pt", tmp_path / "ref.pt", monkeypatch)
    source, placed = _st_offsets(tmp_path / "in.safetensors"), _pt_offsets(tmp_path / "out.pt")
    congruent = _congruent(source, placed)
    assert all(congruent[f"/module.l{i}.weight"] for i in (0, 2, 4))  # the ones of 8 KiB or more
    with open(tmp_path / "out.pt", "rb") as f:  # torch would compute the later storages' offsets: not from this file
        assert not any(r.name.endswith(".format_version") for r in read_archive(f.fileno(), "out.pt").records)


@TORCH_OFFSETS
def test_model_only_keeps_torch_offset_arithmetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 64)).sum().backward()
    opt.step()
    model = torch.nn.DataParallel(net).cpu().state_dict()  # DataParallel moved it to cuda:0 on a GPU machine
    torch.save({"model": model, "optimizer": opt.state_dict()}, tmp_path / "in.pt")
    assert convert_file(tmp_path / "in.pt", tmp_path / "out.pt", model_only=True).method == "stream"
    convert_file(tmp_path / "in.pt", tmp_path / "ref.pt", model_only=True, fast=False)
    _check_pt(tmp_path / "out.pt", tmp_path / "ref.pt", monkeypatch)
    assert all(_congruent(_pt_offsets(tmp_path / "in.pt"), _pt_offsets(tmp_path / "out.pt")).values())


@TORCH_OFFSETS
@pytest.mark.parametrize(
    ("order", "options"),
    [
        (["model", "optimizer"], {"model_only": True}),  # the storages dropped are the last ones
        (["optimizer", "model"], {"model_only": True}),  # the first ones: the kept ones move
        (["model", "optimizer"], {"to": None}),  # nothing dropped: every record after the pickle in one range
    ],
    ids=["drop-last", "drop-first", "keep-all"],
)
def test_records_copied_as_one_range_keep_torch_offset_arithmetic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: list[str], options: dict[str, Any]
) -> None:
    # the records after the new pickle are copied with their headers as one range wherever all of them are kept
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(4, 16)).sum().backward()
    opt.step()
    parts = {"model": torch.nn.DataParallel(net).cpu().state_dict(), "optimizer": opt.state_dict()}
    torch.save({k: parts[k] for k in order}, tmp_path / "in.pt")
    assert convert_file(tmp_path / "in.pt", tmp_path / "out.pt", **options).method == "stream"
    convert_file(tmp_path / "in.pt", tmp_path / "ref.pt", fast=False, **options)
    _check_pt(tmp_path / "out.pt", tmp_path / "ref.pt", monkeypatch)
    assert all(_congruent(_pt_offsets(tmp_path / "in.pt"), _pt_offsets(tmp_path / "out.pt")).values())


# --- sharing on a real file system ----------------------------------------------------------------------------


def _mount(tmp_path: Path, mkfs: str, *args: str, size: int) -> Path | str:
    """A fresh file system in a sparse loop image, mounted: its folder, or why it could not be made."""
    if shutil.which(mkfs) is None:
        return f"{mkfs} is not installed"
    image, mnt = tmp_path / f"{mkfs}.img", tmp_path / f"{mkfs}.mnt"
    with open(image, "wb") as f:
        f.truncate(size)  # sparse: the host pays only for what is written
    mnt.mkdir()
    for argv in ([mkfs, *args, str(image)], ["mount", "-o", "loop", str(image), str(mnt)]):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{argv[0]} failed: {done.stderr.strip()[:100]}"
    return mnt


@contextlib.contextmanager
def _reflink_fs(tmp_path: Path) -> Iterator[Path]:
    """A small XFS (reflink=1) or btrfs loop image, mounted; skips with the reason when that cannot be done."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a loop image needs root")
    reasons = []
    for mkfs, args, size in (("mkfs.xfs", ["-q", "-m", "reflink=1"], 320 << 20), ("mkfs.btrfs", ["-q"], 128 << 20)):
        mnt = _mount(tmp_path, mkfs, *args, size=size)
        if isinstance(mnt, str):
            reasons.append(mnt)
            continue
        try:
            yield mnt
        except BaseException as e:
            # The failure's traceback holds the test's finished frames and, in them, tensors mapped from files on
            # the image: cleared, the unmount below finds no file in use and the failure is reported as itself.
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            _unmount(mnt)
        return
    pytest.skip("no XFS or btrfs loop mount: " + "; ".join(reasons))


def _unmount(mnt: Path) -> None:
    """Unmount (``-o loop`` detaches the loop device with it); a mount is never left behind, and a file the test
    still holds open is an error of the test, named."""
    gc.collect()
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
        return
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    subprocess.run(["umount", "--lazy", str(mnt)], check=True)  # detached now, released when the last file closes
    raise AssertionError(f"the test still held files on {mnt}: {[p for p in held if p.startswith(str(mnt))]}")


def _used(path: Path) -> int:
    s = os.statvfs(path)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def test_a_converted_checkpoint_shares_its_blocks(tmp_path: Path) -> None:
    with _reflink_fs(tmp_path) as fs:
        sd = {f"module.layer{i}.weight": torch.randn(4 << 20) for i in range(4)}  # 64 MiB of float32
        sd.update({f"module.layer{i}.bias": torch.randn(1000) for i in range(4)})
        torch.save(sd, fs / "in.pt")
        save(sd, fs / "in.safetensors")
        os.sync()
        cases = [("in.pt", "out.pt", True), ("in.pt", "no_verify.pt", False), ("in.safetensors", "o.safetensors", True)]
        for src, out, verify in cases:
            before = _used(fs)
            result = convert_file(fs / src, fs / out, to="single", verify=verify)
            assert _used(fs) - before < 1 << 20, out  # under 1 MB of new blocks for 64 MiB
            shared = re.search(r"([\d.]+) MB shared with the input", result.notes[-1])
            assert shared and float(shared[1]) >= 67.0, result.notes  # all but the first and last blocks
            # keys, order and bytes (the container: a dict from a .pt, an OrderedDict from .safetensors, as torch)
            assert_same(dict(ckptfix.load(fs / out)), {k.removeprefix("module."): v for k, v in sd.items()})
        before = _used(fs)  # the control: a copy the file system cannot share is measured as one
        result = convert_file(fs / "in.pt", fs / "copied.safetensors", to="single")
        assert _used(fs) - before > 60 << 20
        assert "shared" not in result.notes[-1]


# --- --no-verify ----------------------------------------------------------------------------------------------


def _corrupt_record(path: Path) -> None:
    """Change a stored tensor's bytes and keep its recorded CRC: what a bad disk or download does."""
    with open(path, "r+b") as f:
        rec = next(r for r in read_archive(f.fileno(), str(path)).records if r.name.endswith("data/0"))
        f.seek(rec.data_offset)
        first = f.read(4)
        f.seek(rec.data_offset)
        f.write(bytes(b ^ 0xFF for b in first))
        assert zlib.crc32(first) != zlib.crc32(bytes(b ^ 0xFF for b in first))


def test_no_verify_keeps_a_corrupt_record_detectable(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.arange(5000.0), "module.b": torch.ones(3)}, src)
    _corrupt_record(src)
    run = CliRunner().invoke
    refused = run(cli, ["convert", str(src), str(tmp_path / "checked.pt")])
    assert refused.exit_code == 2 and "fails its CRC check" in refused.output
    assert not (tmp_path / "checked.pt").exists()
    out = tmp_path / "out.pt"
    result = run(cli, ["convert", str(src), str(out), "--no-verify", "-v"])
    assert result.exit_code == 0, result.output
    assert "CRCs not checked: the output keeps the input's CRCs" in result.output
    with pytest.raises(FormatError, match=r"out\.pt: record 'in/data/0' fails its CRC check"):
        ckptfix.load(out)
    # a .safetensors output has no CRCs to carry the evidence: the input is checked anyway
    to_st = run(cli, ["convert", str(src), str(tmp_path / "out.safetensors"), "--no-verify"])
    assert to_st.exit_code == 2 and "fails its CRC check" in to_st.output
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "evicted"])
def test_a_byte_changed_deep_in_a_large_record_is_refused_cached_or_not(tmp_path: Path, cached: bool) -> None:
    # 40 MiB: the CRC reader maps windows that are in the page cache and reads the others; both must see every byte
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    w = torch.arange(10 << 20, dtype=torch.float32)
    torch.save({"module.w": w}, src)
    good = convert_file(src, out)
    assert "CRCs checked" in good.notes[-1] and torch.equal(ckptfix.load(out)["w"], w)
    out.unlink()
    with open(src, "r+b") as f:
        rec = next(r for r in read_archive(f.fileno(), str(src)).records if r.name.endswith("data/0"))
        f.seek(rec.data_offset + rec.size - 2)  # in the last window
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
        if not cached:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    with pytest.raises(FormatError, match=r"in\.pt: record 'in/data/0' fails its CRC check"):
        convert_file(src, out)
    assert not out.exists()


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


@pytest.mark.parametrize("out", ["out.pt", "out.safetensors"])
def test_an_input_overwritten_during_the_copy_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str
) -> None:
    from ckptfix.stream.copy import Copier, Job

    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(1000)}, src)
    original = src.read_bytes()
    time.sleep(0.05)  # file times tick at a few ms: the rewrite below must land on a later tick than the save
    real_copy = Copier.copy

    def copy_after_a_rewrite(self: Copier, job: Job) -> None:
        with open(src, "r+b") as f:  # another process rewrites the record after its CRC was checked
            f.seek(job.src)
            f.write(b"\x00" * 16)
        real_copy(self, job)

    monkeypatch.setattr(Copier, "copy", copy_after_a_rewrite)
    # the CRC check catches it when it reads the rewritten bytes, the before/after comparison in any case
    with pytest.raises(
        FormatError, match=r"in\.pt: (the file changed while it was being read|record .* fails its CRC)"
    ):
        convert_file(src, tmp_path / out, to="single")
    assert not (tmp_path / out).exists()
    assert src.read_bytes() != original  # the rewrite happened: the refusal is what caught it
