"""Hostile and broken inputs: nothing runs, nothing crashes, nothing half-written, the input untouched."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import struct
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.conversion import convert_file
from ckptfix.errors import CkptfixError, FormatError, OutputError, UnsafeCheckpointError
from tests.models import make_net

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


@pytest.mark.parametrize("kind", list(PAYLOADS))
@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("legacy", [False, True])
def test_reduce_payloads_never_run(tmp_path: Path, kind: str, protocol: int, legacy: bool) -> None:
    marker = tmp_path / "PWNED"
    obj = {"model": {"w": torch.zeros(2)}, "nested": [{"x": Payload(kind, marker)}]}
    path = tmp_path / "evil.pt"
    torch.save(obj, path, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(UnsafeCheckpointError):
        ckptfix.load(path)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_hand_made_pickles_in_every_protocol_are_refused(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "PWNED"
    data = pickle.dumps({"x": Payload("os.system", marker)}, protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        ckptfix.load(torch_zip(tmp_path / "evil.pt", data))
    assert not marker.exists()


def test_inst_opcode_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    data = f"(S'touch {marker}'\nios\nsystem\n.".encode()  # MARK, arg, INST os.system
    with pytest.raises(UnsafeCheckpointError, match=r"os\.system"):
        ckptfix.load(torch_zip(tmp_path / "evil.pt", data))
    assert not marker.exists()


def test_archive_tricks_are_refused(tmp_path: Path) -> None:
    good = pickle.dumps({"a": 1}, protocol=2)
    evil = pickle.dumps(Payload("os.system", tmp_path / "PWNED"), protocol=2)
    cases = {
        "extra_pickle": {"archive/extra.pkl": evil},
        "outside": {"other/data.pkl": evil},
        "outside_plain": {"../escape": b"x"},
    }
    for name, extra in cases.items():
        with pytest.raises(FormatError, match=r"data\.pkl|outside"):
            ckptfix.load(torch_zip(tmp_path / f"{name}.pt", good, extra=extra))
    dup = tmp_path / "dup.pt"
    torch_zip(dup, good)
    with pytest.warns(UserWarning), zipfile.ZipFile(dup, "a") as zf:
        zf.writestr("archive/data.pkl", evil)
    with pytest.raises(FormatError):
        ckptfix.load(dup)
    assert not (tmp_path / "PWNED").exists()


def test_compressed_and_encrypted_records_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"a": 1}, protocol=2))
        zf.writestr("archive/data/0", b"\0" * 10_000_000)
    with pytest.raises(FormatError, match="compressed"):
        ckptfix.load(path)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(3)}, good)
    data = bytearray(good.read_bytes())
    data[6] |= 0x01  # general-purpose flag bit 0: encrypted
    (tmp_path / "enc.pt").write_bytes(bytes(data))
    with pytest.raises(FormatError):
        ckptfix.load(tmp_path / "enc.pt")


def test_other_archives_named_pt_are_refused(tmp_path: Path) -> None:
    tar_path = tmp_path / "model.pt"
    with tarfile.open(tar_path, "w") as tf:
        info = tarfile.TarInfo("data.pkl")
        payload = pickle.dumps({"a": 1})
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    (tmp_path / "seven.pt").write_bytes(b"7z\xbc\xaf\x27\x1c" + b"\0" * 100)
    for path in (tar_path, tmp_path / "seven.pt"):
        with pytest.raises(FormatError, match="not a checkpoint ckptfix can read"):
            ckptfix.load(path)


def test_broken_pickles_are_corrupt_not_crashes(tmp_path: Path) -> None:
    cases = {
        "memo": b"\x80\x02h\x05.",  # BINGET of a memo slot never written
        "truncated": pickle.dumps({"a": [1, 2, 3]}, protocol=2)[:-4],
        "garbage": b"\x80\x02\xff\xfe.",
    }
    for name, data in cases.items():
        with pytest.raises(FormatError, match="corrupt"):
            ckptfix.load(torch_zip(tmp_path / f"{name}.pt", data))


def with_storage_record(tmp_path: Path, tensor: torch.Tensor, edit: Any, name: str) -> Path:
    """A checkpoint of ``tensor`` whose first storage record's bytes went through ``edit``."""
    good = tmp_path / "good.pt"
    torch.save({"w": tensor}, good)
    src = zipfile.ZipFile(good)
    bad = tmp_path / name
    with zipfile.ZipFile(bad, "w") as zf:
        for info in src.infolist():
            data = src.read(info)
            zf.writestr(info.filename, edit(data) if info.filename.endswith("/data/0") else data)
    return bad


def test_storage_shorter_than_tensor_is_corrupt(tmp_path: Path) -> None:
    bad = with_storage_record(tmp_path, torch.arange(100.0), lambda data: data[:40], "short.pt")
    with pytest.raises(FormatError):
        ckptfix.load(bad)


def make_file(tmp_path: Path, fmt: str) -> Path:
    state = {"model": make_net().state_dict(), "epoch": 1}
    path = tmp_path / f"good-{fmt}{'.safetensors' if fmt == 'safetensors' else '.pt'}"
    if fmt == "safetensors":
        ckptfix.save(state, path)
    else:
        torch.save(state, path, _use_new_zipfile_serialization=fmt == "zip")
    return path


@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors"])
@pytest.mark.parametrize("percent", [0, 1, 10, 50, 90, 99])
def test_truncation_anywhere_is_one_line_and_no_output(tmp_path: Path, fmt: str, percent: int) -> None:
    good = make_file(tmp_path, fmt)
    data = good.read_bytes()
    bad = tmp_path / f"cut{good.suffix}"
    bad.write_bytes(data[: len(data) * percent // 100])
    out = tmp_path / "out.pt"
    with pytest.raises(FormatError) as info:
        convert_file(bad, out)
    assert "\n" not in str(info.value) and str(bad) in str(info.value)
    assert not out.exists()
    assert bad.read_bytes() == data[: len(data) * percent // 100]


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


def test_prefixes_inside_keys_are_left_alone() -> None:
    state = {"encoder.module.weight": torch.zeros(1), "decoder._orig_mod.bias": torch.zeros(1)}
    assert list(ckptfix.convert(state, to="single")) == list(state)
    assert list(ckptfix.convert(state, to="ddp")) == ["module." + k for k in state]


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_injected_io_errors_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, code: int
) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": {f"module.{k}": v for k, v in make_net().state_dict().items()}}, src)
    before = src.read_bytes()
    out = tmp_path / "out.pt"

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    if where == "write":
        import ckptfix.formats.torchio.torchfile as torchfile

        monkeypatch.setattr(torchfile, "save_torch", lambda obj, path: _save_failing(obj, path, fail))
    else:
        monkeypatch.setattr(os, where, fail)
    with pytest.raises(OutputError, match=os.strerror(code)):
        convert_file(src, out, fast=False)
    monkeypatch.undo()
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def _save_failing(obj: Any, path: Any, fail: Any) -> None:
    from ckptfix.formats.output.atomic import atomic_output

    with atomic_output(path) as f:
        f.write(b"partial")
        fail()


@pytest.mark.slow  # 50 forked writers of 16 MB files
def test_sigkill_during_writes_never_leaves_a_partial_file(tmp_path: Path) -> None:
    import random
    import signal
    import time

    out = tmp_path / "out.pt"
    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(16)}  # 16 MB per file
    rng = random.Random(0)
    complete = 0
    for trial in range(50):
        # fork, not a fresh interpreter: the writer must be in the middle of a write, not importing torch
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child only writes until it is killed
            try:
                while True:
                    ckptfix.save(state, out)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if out.exists():
            loaded = ckptfix.load(out)
            assert len(loaded) == 16 and torch.equal(loaded["w15"], state["w15"]), trial
            complete += 1
    assert complete > 0  # some writes finished; each of them is whole
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["out.pt"]


def test_missing_output_folder_fails_before_reading(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="does not exist"):
        convert_file(tmp_path / "also-missing.pt", tmp_path / "no" / "out.pt")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_output_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    src = make_file(tmp_path, "zip")
    with pytest.raises(OutputError, match="not writable"):
        convert_file(src, folder / "out.pt")


def test_any_error_is_a_ckptfix_error(tmp_path: Path) -> None:
    # The CLI contract: a user's bad file never surfaces as a raw Python exception.
    for data in (b"PK\x03\x04" + b"\0" * 40, b"\x80\x02" + b"\0" * 40, b"\x10" + b"\0" * 7 + b"{}"):
        path = tmp_path / "x.pt"
        path.write_bytes(data)
        with pytest.raises(CkptfixError):
            ckptfix.load(path)


def test_numpy_scalars_need_every_global_named(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "np.pt"
    torch.save({"model": make_net().state_dict(), "best_acc": np.float64(0.91)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"numpy\._core\.multiarray\.scalar.*numpy\.dtype") as info:
        ckptfix.load(path)
    needed = info.value.globals_needed
    loaded = ckptfix.load(path, allow_globals=needed)  # the first refusal named everything it takes
    assert loaded["best_acc"] == np.float64(0.91)
    with pytest.raises(UnsafeCheckpointError, match="no option allows it"):
        ckptfix.load(path, allow_globals=["builtins.__import__"])


def test_record_longer_than_its_storage_is_refused(tmp_path: Path) -> None:
    bad = with_storage_record(tmp_path, torch.arange(4.0), lambda data: data + b"\0" * 1_000_000, "padded.pt")
    with pytest.raises(FormatError, match=r"holds 1000016 bytes but its storage needs 16"):
        ckptfix.load(bad)
    with pytest.raises(FormatError):
        convert_file(bad, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_read_only_output_folder_is_refused_before_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root ignores permission bits, so the folder's answer to access(W_OK) is simulated.
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    with pytest.raises(OutputError, match="is not writable; choose another output path"):
        convert_file(tmp_path / "not-even-read.pt", folder / "out.pt")


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_injected_io_errors_on_the_streaming_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": {f"module.{k}": v for k, v in make_net().state_dict().items()}}, src)
    before = src.read_bytes()

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    probe = tmp_path / "probe.pt"
    assert convert_file(src, probe).method == "stream"  # the input really takes the streaming path
    probe.unlink()
    monkeypatch.setattr(os, where, fail)
    with pytest.raises(OutputError, match="No space left"):
        convert_file(src, tmp_path / "out.pt")
    monkeypatch.undo()
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


@pytest.mark.parametrize("fast", [True, False])
def test_malformed_module_versions_are_refused_on_both_paths(tmp_path: Path, fast: bool) -> None:
    from collections import OrderedDict

    state: Any = OrderedDict(w=torch.zeros(2))
    state._metadata = OrderedDict({"": [1, 2]})  # torch's load_state_dict expects {"": {"version": 1}}
    torch.save(state, tmp_path / "md.pt")
    for out in ("out.pt", "out.safetensors"):
        with pytest.raises(FormatError, match=r"md\.pt: a state dict's _metadata is not a mapping of module paths"):
            convert_file(tmp_path / "md.pt", tmp_path / out, fast=fast)
        assert not (tmp_path / out).exists()


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


def test_a_real_optimizer_with_thousands_of_parameters_loads(tmp_path: Path) -> None:
    # many sibling containers (one state dict per parameter) are wide, not deep
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2500)]
    opt = torch.optim.Adam(params)
    sum(p.sum() for p in params).backward()
    opt.step()
    torch.save({"model": {f"p{i}": p for i, p in enumerate(params)}, "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    loaded = ckptfix.load(tmp_path / "a.pt")
    assert len(loaded["optimizer"]["state"]) == 2500
    assert torch.equal(loaded["optimizer"]["state"][2499]["exp_avg"], opt.state_dict()["state"][2499]["exp_avg"])
    for fast in (True, False):
        convert_file(tmp_path / "a.pt", tmp_path / f"out-{fast}.pt", fast=fast)
        assert len(torch.load(tmp_path / f"out-{fast}.pt")["optimizer"]["state"]) == 2500


def test_an_input_rewritten_after_its_check_is_refused_on_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CRCs were checked before the rewrite: only the before/after comparison of the file can catch it
    import ckptfix.formats.torchio.torchfile as torchfile

    src = tmp_path / "in.pt"
    torch.save({"w": torch.ones(1000)}, src)
    time.sleep(0.05)  # file times tick at a few ms: the rewrite below must land on a later tick than the save
    real = torchfile.materialize

    def rewrite_then_build(described: Any, fd: int, *, mmap: bool = True) -> Any:
        with open(src, "r+b") as f:  # another process rewrites a record that has just passed its CRC check
            f.seek(described.archive.get("data/0").data_offset)
            f.write(b"\x00" * 16)
        return real(described, fd, mmap=mmap)

    monkeypatch.setattr(torchfile, "materialize", rewrite_then_build)
    with pytest.raises(FormatError, match=r"in\.pt: the file changed while it was being read"):
        ckptfix.load(src)
