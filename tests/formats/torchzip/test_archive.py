"""ckptfix.formats.torchzip.archive: the zip container torch.save writes, and the archive tricks it refuses."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import CkptfixError, FormatError
from tests import hostile
from tests.dtype_files import PATHS, _inspect, _random, assert_bits
from tests.entry_points import Expect, bounded_cli_problems, cli_op, invoke, refused_everywhere, run_ops
from tests.hostile import P, Payload, torch_zip
from tests.writers import save_without_crcs, without_crcs

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


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


@pytest.mark.parametrize("evil_first", [False, True], ids=["pkl-first", "pkL-first"])
def test_case4_pickle_names_differing_in_case_are_refused(tmp_path: Path, evil_first: bool) -> None:
    marker = tmp_path / "PWNED"
    evil = P.proto(2) + P.call(P.glob("os", "system"), P.string(f"touch '{marker}'")) + P.stop()
    data = hostile.name_confusion(evil, evil_first=evil_first)
    refused_everywhere(tmp_path, data, Expect(FormatError), marker=marker)


def _outcomes(tmp_path: Path, src: Path) -> dict[str, Any]:
    """What each entry point makes of ``src``: an error class, or the model's values."""
    seen: dict[str, Any] = {}
    try:
        seen["load"] = ckptfix.load(src)["model"]["w"].tolist()
    except CkptfixError as e:
        seen["load"] = type(e).__name__
    for fast in (True, False):
        out = tmp_path / f"agree-{fast}.pt"
        try:
            ckptfix.convert_file(src, out, fast=fast)
            seen[f"convert(fast={fast})"] = ckptfix.load(out)["model"]["w"].tolist()
        except CkptfixError as e:
            seen[f"convert(fast={fast})"] = type(e).__name__
    result = invoke("inspect", src, "--json")
    if result.exit_code == 0:
        summary = json.loads(result.stdout)
        seen["inspect"] = "ok" if summary else "empty"
    else:
        seen["inspect"] = f"exit {result.exit_code}"
    return seen


@pytest.mark.parametrize("absolute", [False, True], ids=["offsets-relative", "offsets-absolute"])
def test_case4_concatenated_archives_read_the_same_everywhere(tmp_path: Path, absolute: bool) -> None:
    src = tmp_path / "two.pt"
    src.write_bytes(hostile.concatenated(absolute=absolute))
    seen = _outcomes(tmp_path, src)
    answers = {repr(v) for k, v in seen.items() if k != "inspect"}
    assert len(answers) == 1, f"entry points disagree on which archive this is: {seen}"
    assert (seen["inspect"] == "ok") == isinstance(seen["load"], list), f"inspect disagrees with load: {seen}"


@pytest.mark.parametrize("absolute", [False, True], ids=["offsets-relative", "offsets-absolute"])
def test_case4_concatenated_archives_are_refused(tmp_path: Path, absolute: bool) -> None:
    """The preferred answer to two archives in one file: refuse it rather than pick one."""
    refused_everywhere(tmp_path, hostile.concatenated(absolute=absolute), Expect(FormatError))


def test_case4_many_directory_entries_for_one_record(tmp_path: Path) -> None:
    src = tmp_path / "many.pt"
    src.write_bytes(hostile.many_entries())
    with pytest.raises(FormatError):
        ckptfix.load(src)
    outs = [tmp_path / n for n in ("fast.pt", "torch.pt", "fast.safetensors", "torch.safetensors")]
    ops: list[dict[str, Any]] = [
        cli_op("convert", src, outs[0]),
        cli_op("convert", src, outs[1], "--no-fast"),
        cli_op("convert", src, outs[2]),
        cli_op("convert", src, outs[3], "--no-fast"),
        cli_op("inspect", src),
    ]
    # 2,000 tensors of 1 MiB each would make a 2 GiB output: the child may write 64 MiB at most.
    results = run_ops(tmp_path, ops, timeout=180, file_bytes=64 << 20)
    problems = bounded_cli_problems(results, ops, codes=[2], seconds=30, source=str(src))
    problems += [f"{o.name} was written" for o in outs if o.exists()]
    assert not problems, "\n".join(problems)


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


def _zero_crcs(path: Path, names: Callable[[str], bool]) -> None:
    """Set the central-directory CRC of the records ``names`` picks to 0, as a damaged or altered file might."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        length = int.from_bytes(data[at + 28 : at + 30], "little")
        if names(data[at + 46 : at + 46 + length].decode()):
            data[at + 16 : at + 20] = bytes(4)
        at = data.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@without_crcs
@pytest.mark.parametrize("path", list(PATHS))
def test_a_file_saved_without_crcs_is_read_as_torch_reads_it(tmp_path: Path, path: str) -> None:
    src = tmp_path / "fast.pt"
    state = {"w": _random(torch.float32, (3, 5)), "b": _random(torch.bfloat16, (7,))}
    save_without_crcs(state, src)
    assert_bits(PATHS[path](src, tmp_path), state)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@without_crcs
def test_inspect_and_convert_say_no_crc_is_stored(tmp_path: Path) -> None:
    src = tmp_path / "fast.pt"
    save_without_crcs({"w": torch.ones(3)}, src)
    assert _inspect(src, "--json")["crc_stored"] is False
    assert "no CRC stored: bytes not verified" in _inspect(src)
    assert "verified: every record read (it stores no CRC to check)" in _inspect(src, "--verify")
    for fast in ([], ["--no-fast"]):
        result = CliRunner().invoke(cli, ["convert", "-v", str(src), str(tmp_path / "out.pt"), *fast, "--force"])
        assert result.exit_code == 0, result.output
        assert "no CRC stored: bytes not verified" in result.output
    assert "crc_stored" not in _inspect(tmp_path / "out.pt", "--json")  # torch.save wrote CRCs this time


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@without_crcs
@pytest.mark.parametrize(
    "zeroed", ["one storage", "every storage", "all but data.pkl"], ids=lambda z: z.replace(" ", "-")
)
def test_only_a_file_with_every_crc_zero_is_read_unchecked(tmp_path: Path, zeroed: str) -> None:
    state = {"w": torch.ones(3), "b": torch.ones(2)}
    save_without_crcs(state, tmp_path / "fast.pt")
    assert_bits(ckptfix.load(tmp_path / "fast.pt"), state)  # every CRC 0, as torch writes it: read unchecked
    src = tmp_path / "altered.pt"
    torch.save(state, src)
    picks = {
        "one storage": lambda name: name.endswith("/data/1"),
        "every storage": lambda name: "/data/" in name,
        "all but data.pkl": lambda name: not name.endswith("data.pkl"),
    }
    _zero_crcs(src, picks[zeroed])
    for args in (["convert", str(src), str(tmp_path / "out.pt")], ["inspect", "--verify", str(src)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        assert "fails its CRC check (stored 00000000" in result.output
    with pytest.raises(ckptfix.FormatError, match="fails its CRC check"):
        ckptfix.load(src)
