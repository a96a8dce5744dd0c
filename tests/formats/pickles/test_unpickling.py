"""ckptfix.formats.pickles.unpickling: pickles read without running them; payloads refused, broken ones in one line."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.conversion import convert_file
from ckptfix.errors import FormatError, UnsafeCheckpointError
from tests.hostile import PAYLOADS, Payload, torch_zip

# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


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


def test_broken_pickles_are_corrupt_not_crashes(tmp_path: Path) -> None:
    cases = {
        "memo": b"\x80\x02h\x05.",  # BINGET of a memo slot never written
        "truncated": pickle.dumps({"a": [1, 2, 3]}, protocol=2)[:-4],
        "garbage": b"\x80\x02\xff\xfe.",
    }
    for name, data in cases.items():
        with pytest.raises(FormatError, match="corrupt"):
            ckptfix.load(torch_zip(tmp_path / f"{name}.pt", data))


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
