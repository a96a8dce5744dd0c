"""ckptfix.formats.pickles.unpickling: pickles read without running them; payloads refused, broken ones in one line."""

from __future__ import annotations

import io
import pickle
import time
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.conversion.files import convert_file
from ckptfix.errors import CkptfixError, FormatError, UnsafeCheckpointError
from ckptfix.formats.pickles import unpickling
from ckptfix.formats.safety import opscan
from tests import hostile
from tests.entry_points import (
    ALLOWED,
    GiB,
    _consistent,
    bounded_cli_problems,
    cli_op,
    fast_reader_problem,
    message_problem,
    reader_outcome,
    run_ops,
)
from tests.hostile import PAYLOADS, P, Payload, torch_zip
from tests.models import make_net
from tests.parity import check_parity

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


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


def test_case5_huge_bytearray_is_refused_before_allocating(tmp_path: Path) -> None:
    big = P.call(P.glob("builtins", "bytearray"), P.integer(4 * GiB))
    data = hostile.one_tensor_with("cfg", big)
    assert len(data) < 2048
    src = tmp_path / "bytearray.pt"
    src.write_bytes(data)
    ops: list[dict[str, Any]] = [
        cli_op("inspect", src),
        cli_op("convert", src, tmp_path / "o.pt", "--no-fast"),
        cli_op("convert", src, tmp_path / "o2.pt"),
        {"kind": "load", "path": str(src)},
    ]
    # 1.5 GiB of address space for data: enough for torch, not for the 4 GiB the file asks for.
    results = run_ops(tmp_path, ops, timeout=120, data_bytes=3 * GiB // 2)
    problems = bounded_cli_problems(results[:3], ops[:3], codes=[2], seconds=10, source=str(src))
    if results[3]["error"] != "FormatError" or "not enough memory" in results[3].get("message", ""):
        problems.append(f"load: {results[3]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_case5_huge_bytes8_claim_is_refused(tmp_path: Path, container: str) -> None:
    pkl = hostile.bytes8_pickle(5 * GiB)
    data = hostile.torch_zip_file(pkl) if container == "zip" else hostile.legacy_file(pkl)
    src = tmp_path / "bytes8.pt"
    src.write_bytes(data)
    ops: list[dict[str, Any]] = [
        {"kind": "load", "path": str(src)},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "a.pt"), "fast": True},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "b.pt"), "fast": False},
        cli_op("inspect", src),
    ]
    results = run_ops(tmp_path, ops, timeout=120, data_bytes=3 * GiB)
    problems = [f"{op['kind']}: {r}" for op, r in zip(ops[:3], results[:3], strict=True) if r["error"] != "FormatError"]
    problems += bounded_cli_problems(results[3:], ops[3:], codes=[2], seconds=10, source=str(src))
    assert not problems, "\n".join(problems)


def test_case5_surrogate_in_a_pickle_key(tmp_path: Path) -> None:
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    src = tmp_path / "surrogate.pt"
    src.write_bytes(hostile.torch_zip_file(hostile.tensor_pickle([("a\ud800b", w)]), {"0": hostile.floats(1.0, 2.0)}))
    problems = _consistent(tmp_path, src, key="a\ud800b")
    assert not problems, "\n".join(problems)


def test_case6_stack_global_set_is_answered_alike(tmp_path: Path) -> None:
    """STACK_GLOBAL (protocol 4), which torch's weights-only unpickler does not read: both paths agree."""
    tags = P.call(P.stack_glob("builtins", "set"), P.lst(P.string("x")))
    data = hostile.one_tensor_with("cfg", tags)
    (tmp_path / "parity").mkdir()
    assert not check_parity(tmp_path / "parity", data, ".pt")
    src = tmp_path / "cfg.pt"
    src.write_bytes(data)
    try:
        assert ckptfix.load(src)["cfg"] == {"x"}
    except CkptfixError as e:
        assert message_problem(str(e), str(src)) is None


@pytest.mark.parametrize("name", list(hostile.C_PATH_CASES))
def test_fast_reader_answers_as_the_reference(name: str) -> None:
    data = hostile.c_path_pickle(name)
    problem = fast_reader_problem(data)
    assert problem is None, problem


@pytest.mark.parametrize(
    "name",
    ["build-none-on-list", "build-none-on-dict", "build-memo-none-on-list", "build-slots-on-odict",
     "build-dunder-on-odict", "build-bad-then-good-metadata", "build-metadata-mended-in-list", "build-on-size",
     "build-on-tensor", "tensor-called", "refused-global-later", "deep-lists-100k"],
)  # fmt: skip
def test_fast_reader_refusals(name: str) -> None:
    """The cases the C unpickler alone would let through are refused, as torch's weights-only loader does."""
    assert reader_outcome(hostile.c_path_pickle(name))[0] in ("FormatError", "UnsafeCheckpointError")


def test_fast_reader_takes_torch_pickles_and_huge_memo_indices_cheaply() -> None:
    """torch's own pickles take the fast reader; a 4 GiB memo index in a tiny pickle does not (it would size the
    C unpickler's memo array), and the answer comes at once."""
    buffer = io.BytesIO()
    torch.save({"model": make_net().state_dict(), "epoch": 1}, buffer)
    with zipfile.ZipFile(buffer) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    assert opscan.provable(pkl)
    assert unpickling._fast_load(pkl, allowed=ALLOWED) is not None
    assert fast_reader_problem(pkl) is None
    huge = hostile.c_path_pickle("long-binput-4g")
    assert not opscan.provable(huge)
    start = time.monotonic()
    assert fast_reader_problem(huge) is None
    assert time.monotonic() - start < 1


def test_fast_reader_on_every_truncation_and_byte_of_a_torch_pickle() -> None:
    buffer = io.BytesIO()
    state = OrderedDict((f"module.l{i}.weight", torch.zeros(2)) for i in range(3))
    state._metadata = OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    torch.save(state, buffer)
    with zipfile.ZipFile(buffer) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    variants = [pkl[:cut] for cut in range(len(pkl))]
    variants += [pkl[:at] + bytes([op]) + pkl[at + 1 :] for at in range(2, len(pkl), 3) for op in b"bNqrhj.s)"]
    problems = [p for p in map(fast_reader_problem, variants) if p]
    assert not problems, problems[0]
