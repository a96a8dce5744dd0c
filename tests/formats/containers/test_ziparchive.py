"""ckptfix.formats.containers.ziparchive: the zip container torch.save writes, and the archive tricks it refuses."""

from __future__ import annotations

import io
import pickle
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.errors import FormatError
from tests.hostile import Payload, torch_zip

# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


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
