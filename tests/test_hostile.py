"""Issue 15: hostile files, each made byte by byte (tests/hostile.py), against every entry point.

For every file: both conversion paths (``convert_file(fast=True/False)``, ``ckptfix convert [--no-fast]``),
``ckptfix.load`` and ``ckptfix inspect`` refuse it with the right error class (exit code 2), one line naming
the file, no output left, the input unchanged, and no payload run (a marker file the payload would create).
(A payload in an entry beside the model is listed by ``inspect`` as not loaded instead: formats/torchio/opaque.py.)
Test names carry the case number of the issue (``case1`` .. ``case6``). Inputs that could hang, recurse
without end, allocate or write gigabytes, or poison the process run in a child process under limits.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from argparse import Namespace
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import CkptfixError, FormatError, UnsafeCheckpointError
from ckptfix.formats.pickles import inert, unpickling
from ckptfix.formats.safety import allowlist, opscan
from tests import hostile
from tests.hostile import P
from tests.models import make_net
from tests.test_parity import check_parity

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
# The console script beside this interpreter when it is installed (a venv), else the module: a checkout on PYTHONPATH.
_SCRIPT = Path(sys.executable).parent / "ckptfix"
CKPTFIX = [os.fsencode(_SCRIPT)] if _SCRIPT.exists() else [os.fsencode(sys.executable), b"-m", b"ckptfix"]


# --- checking one hostile file everywhere ----------------------------------------------------------------------


def invoke(*args: str | os.PathLike[str]) -> Any:
    return CliRunner().invoke(cli, [os.fspath(a) for a in args])


def message_problem(message: str, source: str) -> str | None:
    """Why an error message breaks the contract (one line, names the file), or None."""
    if "\n" in message.strip():
        return f"message is not one line: {message[:300]!r}"
    if source not in message:
        return f"message does not name {source}: {message[:300]!r}"
    return None


def cli_problem(result: Any, source: str, *, code: int = 2) -> str | None:
    if result.exit_code != code:
        return f"exit code {result.exit_code} (expected {code}): {(result.stderr or result.stdout)[:300]!r}"
    text = result.stderr.strip()
    if "Traceback" in result.output or "Traceback" in text:
        return "a traceback was printed"
    if not text.startswith("ckptfix: error:"):
        return f"stderr is not a ckptfix error: {text[:300]!r}"
    return message_problem(text, source)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def leaked(obj: Any, secret: bytes) -> bool:
    """True if any tensor of a loaded checkpoint holds the first bytes of ``secret``."""
    for t in tensors_in(obj):
        if t.device.type == "meta" or t.numel() * t.element_size() > 1 << 24:
            continue
        try:
            raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError):
            continue
        if secret[:16] in raw:
            return True
    return False


@dataclass
class Expect:
    """What every entry point must answer for one hostile file."""

    error: type[CkptfixError]
    allow: tuple[str, ...] = ()
    contains: Sequence[str] = ()  # each message contains one of these (if any given)
    forbid: Sequence[str] = ()  # no message contains any of these


def refusals(
    tmp_path: Path,
    data: bytes,
    expect: Expect,
    *,
    suffix: str = ".pt",
    marker: Path | None = None,
    secret: bytes | None = None,
    inspect: bool = True,
) -> list[str]:
    """Every way the entry points fail to refuse ``data`` as ``expect`` says; empty when all is well."""
    src = tmp_path / f"hostile{suffix}"
    src.write_bytes(data)
    source = str(src)
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    problems: list[str] = []

    def check_error(where: str, e: BaseException) -> None:
        if not isinstance(e, expect.error):
            problems.append(f"{where}: {type(e).__name__} (expected {expect.error.__name__}): {str(e)[:300]!r}")
            return
        check_text(where, str(e))
        found = message_problem(str(e), source)
        if found:
            problems.append(f"{where}: {found}")

    def check_text(where: str, text: str) -> None:
        if expect.contains and not any(c in text for c in expect.contains):
            problems.append(f"{where}: message lacks any of {list(expect.contains)}: {text[:300]!r}")
        for word in expect.forbid:
            if word in text:
                problems.append(f"{where}: message contains {word!r}: {text[:300]!r}")

    def copied_unexecuted(where: str, out: Path) -> bool:
        """A full .pt copy of code in an entry beside the model, as its records, never run: it is accepted when the
        copy is refused exactly as its input is (nothing laundered); the copy is then removed."""
        if expect.error is not UnsafeCheckpointError or out.suffix != ".pt" or not out.exists():
            return False
        try:
            ckptfix.load(out, allow_globals=expect.allow)
        except UnsafeCheckpointError as e:
            check_text(f"{where} (loading its copy)", str(e))
            out.unlink()
            return True
        return False

    def accepted(where: str, value: Any, out: Path | None = None) -> None:
        what = f"{where}: accepted (expected {expect.error.__name__})"
        if secret is not None and (leaked(value, secret) or (out is not None and secret in out.read_bytes())):
            what += ", AND THE SECRET RECORD LEAKED INTO IT"
        problems.append(what)

    try:
        accepted("ckptfix.load", ckptfix.load(src, allow_globals=expect.allow))
    except Exception as e:
        check_error("ckptfix.load", e)
    for target in (".pt", ".safetensors"):
        for fast in (True, False):
            where = f"convert_file(fast={fast}) -> {target}"
            out = out_dir / f"lib-{fast}{target}"
            try:
                ckptfix.convert_file(src, out, fast=fast, allow_globals=expect.allow)
            except Exception as e:
                check_error(where, e)
            else:
                if fast and copied_unexecuted(where, out):
                    continue
                try:
                    value = ckptfix.load(out, allow_globals=expect.allow)
                except Exception:
                    value = None
                accepted(where, value, out)
    flags = [a for name in expect.allow for a in ("--allow-global", name)]
    commands = [
        ["convert", source, str(out_dir / "cli.pt"), *flags],
        ["convert", source, str(out_dir / "cli-nf.pt"), "--no-fast", *flags],
    ]
    if inspect:
        commands.append(["inspect", source, *flags])
    for args in commands:
        result = invoke(*args)
        if args[0] == "inspect" and result.exit_code == 0:  # an entry beside the model: listed unbuilt, not refused
            if not any(
                f"{c} ×" in line and "not loaded" in line
                for c in expect.contains
                for line in result.stdout.splitlines()
            ):
                problems.append(f"ckptfix inspect: accepted without listing any of {list(expect.contains)} unbuilt")
            continue
        copied = "copied, never executed" in result.stderr and "--no-fast" not in args
        if (
            args[0] == "convert"
            and result.exit_code == 0
            and copied
            and copied_unexecuted("ckptfix convert", Path(args[2]))
        ):
            check_text("ckptfix convert", result.stderr)  # it names the code it copied
            continue
        found = cli_problem(result, source)
        if found:
            problems.append(f"ckptfix {' '.join(args[:1] + args[3:4])}: {found}")
        else:
            check_text(f"ckptfix {args[0]}", result.stderr)
    left = sorted(p.name for p in out_dir.iterdir())
    if left:
        problems.append(f"files left in the output folder: {left}")
    if src.read_bytes() != data:
        problems.append("the input file was modified")
    if marker is not None and marker.exists():
        problems.append(f"THE PAYLOAD RAN: {marker} exists")
    return problems


def refused(tmp_path: Path, data: bytes, expect: Expect, **kwargs: Any) -> None:
    problems = refusals(tmp_path, data, expect, **kwargs)
    assert not problems, "\n".join(problems)


# --- running inputs that may hang or blow up, in a child under limits ------------------------------------------


def run_ops(
    tmp_path: Path,
    ops: list[dict[str, Any]],
    *,
    timeout: float,
    data_bytes: int = 3 * GiB,
    file_bytes: int = 256 << 20,
) -> list[dict[str, Any]]:
    """Run ``ops`` (see ``tests/hostile.py``) in a fresh interpreter; one result per op, ``timeout`` for a hung one."""
    spec = tmp_path / "ops.json"
    spec.write_text(json.dumps({"ops": ops, "data_bytes": data_bytes, "file_bytes": file_bytes}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.hostile", str(spec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for op in ops[len(results) :]:
        gone = "timeout" if proc.returncode in (-9, None) else f"child died (rc {proc.returncode}): {err[-300:]!r}"
        results.append({"error": gone, "exit_code": None, "stderr": gone, "seconds": timeout, "op": op})
    return results


def cli_op(*args: str | os.PathLike[str]) -> dict[str, Any]:
    return {"kind": "cli", "args": [os.fspath(a) for a in args]}


def bounded_cli_problems(
    results: list[dict[str, Any]],
    ops: list[dict[str, Any]],
    *,
    codes: Sequence[int],
    seconds: float,
    source: str,
) -> list[str]:
    """Each CLI op finished within ``seconds``, with an allowed exit code, never 3, a one-line error if 2."""
    problems = []
    for op, result in zip(ops, results, strict=True):
        what = f"ckptfix {' '.join(op['args'][:1] + op['args'][3:])}"
        if result.get("exit_code") is None:
            problems.append(f"{what}: {result['error']}")
            continue
        if result["seconds"] > seconds:
            problems.append(f"{what}: took {result['seconds']:.1f} s (limit {seconds} s)")
        if result["exit_code"] not in codes:
            problems.append(f"{what}: exit code {result['exit_code']}: {result['stderr'][:300]!r}")
        elif result["exit_code"] == 2:
            stderr = result["stderr"].strip()
            if "\n" in stderr or not stderr.startswith("ckptfix: error:") or source not in stderr:
                problems.append(f"{what}: not a one-line error naming the file: {stderr[:300]!r}")
            if "not enough memory" in stderr:
                problems.append(f"{what}: it tried to allocate what the file claims: {stderr[:200]!r}")
    return problems


# --- case 1: globals that can run code -------------------------------------------------------------------------


@pytest.mark.parametrize("name", hostile.CODE_GLOBALS)
def test_case1_payloads_are_live(tmp_path: Path, name: str) -> None:
    """The generators are honest: the full unpickler really runs each payload (in a throwaway process)."""
    marker = tmp_path / "PWNED"
    pkl = tmp_path / "payload.pkl"
    pkl.write_bytes(P.proto(2) + hostile.payload_call(name, marker) + P.stop())
    code = "import pickle, sys\ntry:\n    pickle.loads(open(sys.argv[1], 'rb').read())\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", code, str(pkl)], cwd=tmp_path, timeout=60, check=True)
    deadline = time.monotonic() + 20  # fork_exec's child creates the file on its own time
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the {name} payload did not run even when unpickled for real"


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("name", hostile.CODE_GLOBALS)
def test_case1_code_globals_are_refused_without_advice(tmp_path: Path, name: str, container: str) -> None:
    marker = tmp_path / "PWNED"
    if container == "zip":
        data = hostile.torch_zip_file(hostile.payload_pickle(name, marker), {"0": hostile.floats(1.0, 2.0)})
    else:
        data = hostile.legacy_file(P.proto(2) + hostile.payload_call(name, marker) + P.stop())
    expect = Expect(
        UnsafeCheckpointError, contains=[name], forbid=["--allow-global", "allow_globals", "--unsafe-pickle", "unsafe="]
    )
    refused(tmp_path, data, expect, marker=marker)


@pytest.mark.parametrize("name", hostile.CODE_GLOBALS)
def test_case1_code_globals_cannot_be_allowed(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "PWNED"
    data = hostile.torch_zip_file(hostile.payload_pickle(name, marker), {"0": hostile.floats(1.0, 2.0)})
    expect = Expect(UnsafeCheckpointError, allow=(name,), contains=["not a known-safe class", "can run code"])
    refused(tmp_path, data, expect, marker=marker)


def test_case1_unknown_class_cannot_be_allowed(tmp_path: Path) -> None:
    config = P.call(P.glob("mypkg", "Config"), P.dct([(P.string("lr"), P.real(0.1))]))
    data = hostile.one_tensor_with("cfg", config)
    expect = Expect(UnsafeCheckpointError, allow=("mypkg.Config",), contains=["not a known-safe class"])
    refused(tmp_path, data, expect)


def _known_safe_file(tmp_path: Path, value: Any) -> Path:
    path = tmp_path / "cfg.pt"
    torch.save({"model": {"module.w": torch.arange(3.0)}, "cfg": value}, path)
    return path


@pytest.mark.parametrize(
    "value", [Namespace(lr=0.1, arch="resnet"), pathlib.PosixPath("/runs/exp1")], ids=["Namespace", "PosixPath"]
)
def test_case1_known_safe_classes_still_load(tmp_path: Path, value: Any) -> None:
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    path = _known_safe_file(tmp_path, value)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(name)):
        ckptfix.load(path)
    refusal = invoke("convert", path, tmp_path / "refused.pt", "--no-fast")  # needs the value (inspect lists it)
    assert refusal.exit_code == 2, refusal.stderr
    assert re.search(rf"--allow-global '?{re.escape(name)}\b", refusal.stderr), refusal.stderr  # the fix, as a flag
    assert ckptfix.load(path, allow_globals=[name])["cfg"] == value
    for fast in (True, False):
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(path, out, fast=fast, allow_globals=[name])
        loaded = ckptfix.load(out, allow_globals=[name])
        assert loaded["cfg"] == value and list(loaded["model"]) == ["w"]
    for flags in ([], ["--no-fast"]):
        result = invoke("convert", path, tmp_path / "cli.pt", "--allow-global", name, *flags)
        assert result.exit_code == 0, result.stderr
        (tmp_path / "cli.pt").unlink()
    assert invoke("inspect", path, "--allow-global", name).exit_code == 0


# --- case 2: BUILD laundering and process poisoning ------------------------------------------------------------


def test_case2_build_laundering_and_process_poisoning(tmp_path: Path) -> None:
    """Hostile BUILDs on allowlisted globals, then, in the same process, ordinary files through the fast path."""
    files = {
        "launder": hostile.torch_zip_file(hostile.laundering_pickle(), {"0": hostile.floats(1.0, 2.0)}),
        "rename": hostile.torch_zip_file(hostile.storage_rename_pickle(), {"0": hostile.floats(1.0, 2.0)}),
    }
    for name, data in files.items():
        (tmp_path / f"{name}.pt").write_bytes(data)
    floats_path = tmp_path / "floats.pt"
    expected = torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.float32)
    torch.save({"model": {"module.w": expected}}, floats_path)
    set_path = tmp_path / "sets.pt"
    torch.save({"model": {"module.w": expected}, "cfg": {"tags": {"a", "b"}}}, set_path)

    ops: list[dict[str, Any]] = []
    for name in files:  # a hostile file, then two ordinary ones, in one process
        src, out = tmp_path / f"{name}.pt", tmp_path / f"{name}-out.pt"
        ops += [
            {"kind": "convert", "src": str(src), "dst": str(out), "fast": True},
            {"kind": "globals", "path": str(out)},
            {"kind": "convert", "src": str(floats_path), "dst": str(tmp_path / f"f-{name}.pt"), "fast": True},
            {"kind": "tensors", "path": str(tmp_path / f"f-{name}.pt")},
            {"kind": "convert", "src": str(set_path), "dst": str(tmp_path / f"s-{name}.pt"), "fast": True},
            {"kind": "globals", "path": str(tmp_path / f"s-{name}.pt")},
        ]
    results = run_ops(tmp_path, ops, timeout=120)
    from torch import _weights_only_unpickler as wo

    # a set is allowed by ckptfix on every torch, by torch only from 2.6 (its protocol-2 pickles say __builtin__.set)
    allowed = set(wo._get_allowed_globals()) | {"__builtin__.set", "builtins.set"}
    problems = []
    for i, name in enumerate(files):
        hostile_run, hostile_globals, f_run, f_tensors, s_run, s_globals = results[6 * i : 6 * i + 6]
        if hostile_run["error"] is None:
            bad = [g for g in hostile_globals.get("globals", []) if g not in allowed]
            problems.append(f"{name}: the fast path converted it; its output names {hostile_globals}")
            if bad:
                problems.append(f"{name}: ... including globals outside torch's allowlist: {bad}")
        elif hostile_run["error"] not in ("FormatError", "UnsafeCheckpointError"):
            problems.append(f"{name}: {hostile_run['error']}: {hostile_run['message']}")
        if f_run["error"] is not None or "tensors" not in f_tensors:
            problems.append(f"after {name}: a plain float32 file failed: {f_run} {f_tensors}")
        else:
            dtype, values = f_tensors["tensors"]["w"]
            if dtype != "torch.float32" or values != expected.tolist():
                problems.append(f"after {name}: PROCESS POISONED: float32 file came out as {dtype} {values}")
        if s_run["error"] is not None:
            problems.append(f"after {name}: a file with a set failed: {s_run}")
        elif any(g not in allowed for g in s_globals.get("globals", [])):
            problems.append(f"after {name}: PROCESS POISONED: a set came out as {s_globals['globals']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("which", ["launder", "rename"])
def test_case2_build_on_globals_is_refused_on_the_torch_path(tmp_path: Path, which: str) -> None:
    pkl = hostile.laundering_pickle() if which == "launder" else hostile.storage_rename_pickle()
    src = tmp_path / "x.pt"
    src.write_bytes(hostile.torch_zip_file(pkl, {"0": hostile.floats(1.0, 2.0)}))
    with pytest.raises((FormatError, UnsafeCheckpointError)):
        ckptfix.convert_file(src, tmp_path / "out.pt", fast=False)
    with pytest.raises((FormatError, UnsafeCheckpointError)):
        ckptfix.load(src)


# --- case 3: storage-size bypasses -----------------------------------------------------------------------------

BYPASSES = hostile.storage_bypasses()


@pytest.mark.parametrize("name", list(BYPASSES))
def test_case3_storage_bypasses_are_refused(tmp_path: Path, name: str) -> None:
    refused(tmp_path, BYPASSES[name], Expect(FormatError), secret=hostile.SECRET)


# --- case 4: name confusion ------------------------------------------------------------------------------------


@pytest.mark.parametrize("evil_first", [False, True], ids=["pkl-first", "pkL-first"])
def test_case4_pickle_names_differing_in_case_are_refused(tmp_path: Path, evil_first: bool) -> None:
    marker = tmp_path / "PWNED"
    evil = P.proto(2) + P.call(P.glob("os", "system"), P.string(f"touch '{marker}'")) + P.stop()
    data = hostile.name_confusion(evil, evil_first=evil_first)
    refused(tmp_path, data, Expect(FormatError), marker=marker)


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
    refused(tmp_path, hostile.concatenated(absolute=absolute), Expect(FormatError))


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


# --- case 5: resource limits -----------------------------------------------------------------------------------


def test_case5_shared_reference_dag_finishes_quickly(tmp_path: Path) -> None:
    data = hostile.torch_zip_file(hostile.dag_pickle(30), {"0": hostile.floats(1.0, 2.0)})
    assert len(data) < 4096
    src, copy = tmp_path / "dag.pt", tmp_path / "dag2.pt"
    src.write_bytes(data)
    copy.write_bytes(data)
    convert_ops = [
        cli_op("convert", src, tmp_path / "o1.safetensors"),
        cli_op("convert", src, tmp_path / "o2.safetensors", "--no-fast"),
        cli_op("convert", src, tmp_path / "o3.pt"),
        cli_op("convert", src, tmp_path / "o4.pt", "--no-fast"),
        cli_op("inspect", src),
    ]
    diff_ops = [cli_op("diff", src, copy)]
    results = run_ops(tmp_path, convert_ops + diff_ops, timeout=120, data_bytes=2 * GiB)
    problems = bounded_cli_problems(results[:5], convert_ops, codes=[0, 2], seconds=10, source=str(src))
    problems += bounded_cli_problems(results[5:], diff_ops, codes=[0, 1, 2], seconds=10, source=str(src))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("shape", ["self-list", "self-dict", "deep-1e5"])
def test_case5_cycles_and_deep_nesting_are_refused_in_one_line(tmp_path: Path, shape: str) -> None:
    makers: dict[str, Callable[[], bytes]] = {
        "self-list": hostile.self_list_pickle,
        "self-dict": hostile.self_dict_pickle,
        "deep-1e5": lambda: hostile.deep_pickle(100_000),
    }
    pkl = makers[shape]()
    src = tmp_path / "x.pt"
    src.write_bytes(hostile.torch_zip_file(pkl, {"0": hostile.floats(1.0, 2.0)}))
    ops: list[dict[str, Any]] = [
        {"kind": "load", "path": str(src)},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "a.pt"), "fast": True},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "b.pt"), "fast": False},
        {"kind": "convert", "src": str(src), "dst": str(tmp_path / "c.safetensors"), "fast": True},
        cli_op("convert", src, tmp_path / "d.pt"),
        cli_op("convert", src, tmp_path / "e.pt", "--no-fast"),
        cli_op("inspect", src),
    ]
    results = run_ops(tmp_path, ops, timeout=120)
    problems = [
        f"{op['kind']} {op.get('fast', '')}: {r['error']}: {r.get('message', '')[:200]}"
        for op, r in zip(ops[:4], results[:4], strict=True)
        if r["error"] != "FormatError"
    ]
    problems += bounded_cli_problems(results[4:], ops[4:], codes=[2], seconds=10, source=str(src))
    problems += [
        f"{n} was written" for n in ("a.pt", "b.pt", "c.safetensors", "d.pt", "e.pt") if (tmp_path / n).exists()
    ]
    assert not problems, "\n".join(problems)


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


def test_case5_expanded_tensor_is_not_materialized(tmp_path: Path) -> None:
    a, b = tmp_path / "rank0.pt", tmp_path / "rank1.pt"
    a.write_bytes(hostile.expanded(1.0))
    b.write_bytes(hostile.expanded(2.0))
    ops: list[dict[str, Any]] = [
        cli_op("diff", a, b),
        cli_op("diff", a, a),
        cli_op("merge", a, b, "-o", tmp_path / "merged.pt"),
        cli_op("inspect", a),
    ]
    results = run_ops(tmp_path, ops, timeout=180, data_bytes=3 * GiB)
    problems = bounded_cli_problems(results[:2], ops[:2], codes=[0, 1, 2], seconds=20, source=str(a))
    problems += bounded_cli_problems(results[2:], ops[2:], codes=[0, 1, 2], seconds=20, source=str(a))
    peak = max(r.get("max_rss_bytes", 0) for r in results)
    if peak > 2 * GiB:
        problems.append(f"peak memory {peak / GiB:.1f} GiB")
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


def _exotic(kind: str) -> Any:
    if kind == "meta":
        return {"model": {"module.w": torch.empty(3, 4, device="meta"), "module.b": torch.ones(2)}}
    layout = torch.jagged if kind == "nested-jagged" else torch.strided
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)], layout=layout)
    return {"model": {"module.w": nested, "module.b": torch.ones(2)}}


@pytest.mark.parametrize("kind", ["meta", "nested", "nested-jagged"])
def test_case5_meta_and_nested_tensors_never_crash(tmp_path: Path, kind: str) -> None:
    src = tmp_path / f"{kind}.pt"
    torch.save(_exotic(kind), src)
    problems = []
    commands: list[list[str | os.PathLike[str]]] = [
        ["inspect", src],
        ["diff", src, src],
        ["convert", src, tmp_path / "o.pt"],
        ["convert", src, tmp_path / "o-nf.pt", "--no-fast"],
        ["convert", src, tmp_path / "o.safetensors"],
        ["convert", src, tmp_path / "o-nf.safetensors", "--no-fast"],
    ]
    for args in commands:
        result = invoke(*args)
        what = " ".join(os.fspath(a) for a in args[:1] + args[3:])
        if result.exit_code not in (0, 1, 2) or (result.exit_code == 1 and args[0] != "diff"):
            problems.append(f"{what}: exit {result.exit_code}: {result.stderr[:300]!r}")
        elif result.exit_code == 2:
            found = cli_problem(result, str(src))
            if found:
                problems.append(f"{what}: {found}")
        elif args[0] == "convert":
            out = Path(args[2])
            try:
                loaded = ckptfix.load(out)
                if list(loaded["model"]) != ["w", "b"] or not torch.equal(loaded["model"]["b"], torch.ones(2)):
                    problems.append(f"{what}: wrote {loaded}")
            except CkptfixError as e:
                problems.append(f"{what}: its output does not load: {e}")
    assert not problems, "\n".join(problems)


def test_case5_deep_json_header_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, hostile.deep_json_header(), Expect(FormatError), suffix=".safetensors")


def _consistent(tmp_path: Path, src: Path, *, key: str) -> list[str]:
    """Both paths accept ``src`` (outputs loadable, holding ``key``) or both refuse it with one CkptfixError."""
    (tmp_path / "parity").mkdir()
    problems = check_parity(tmp_path / "parity", src.read_bytes(), src.suffix)
    commands: list[list[str | os.PathLike[str]]] = [
        ["inspect", src],
        ["convert", src, tmp_path / "o.pt"],
        ["convert", src, tmp_path / "o2.pt", "--no-fast"],
    ]
    for args in commands:
        result = invoke(*args)
        if result.exit_code not in (0, 2):
            problems.append(f"ckptfix {args[0]}: exit {result.exit_code}: {result.stderr[:300]!r}")
        elif result.exit_code == 2 and cli_problem(result, str(src)):
            problems.append(f"ckptfix {args[0]}: {cli_problem(result, str(src))}")
        elif result.exit_code == 0 and args[0] == "convert":
            loaded = ckptfix.load(Path(args[2]))
            if key not in loaded.get("model", loaded):
                problems.append(f"ckptfix convert: the key {key!r} did not survive: {list(loaded)}")
    return problems


def test_case5_surrogate_in_a_safetensors_key(tmp_path: Path) -> None:
    raw = b'{"a\\ud800b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    src = tmp_path / "surrogate.safetensors"
    src.write_bytes(hostile.st_file(raw=raw, data=hostile.floats(1.0, 2.0)))
    problems = _consistent(tmp_path, src, key="a\ud800b")
    assert not problems, "\n".join(problems)


def test_case5_surrogate_in_a_pickle_key(tmp_path: Path) -> None:
    w = P.tensor(P.storage(P.string("0"), numel=2), shape=[2])
    src = tmp_path / "surrogate.pt"
    src.write_bytes(hostile.torch_zip_file(hostile.tensor_pickle([("a\ud800b", w)]), {"0": hostile.floats(1.0, 2.0)}))
    problems = _consistent(tmp_path, src, key="a\ud800b")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("content", ["valid", "truncated"])
def test_case5_non_utf8_file_names(tmp_path: Path, content: str) -> None:
    """A file name that is not UTF-8: converted on both paths, or refused on both in one line; never a crash."""
    folder = os.fsencode(tmp_path)
    src = folder + b"/ck\xffpt.pt"
    buffer = io.BytesIO()
    torch.save({"model": {"module.w": torch.arange(4.0)}}, buffer)
    data = buffer.getvalue() if content == "valid" else buffer.getvalue()[:300]
    with open(src, "wb") as f:
        f.write(data)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUTF8", "PYTHONIOENCODING", "LANG", "LC_ALL")}
    env["LC_ALL"] = "C.UTF-8"  # a UTF-8 terminal: stdout is strict about surrogates
    answers: dict[str, int] = {}
    problems: list[str] = []
    for flags in ([], [b"--no-fast"]):
        what = "convert" + (" --no-fast" if flags else "")
        out = folder + b"/out\xfe" + (b"-nf" if flags else b"") + b".pt"
        proc = subprocess.run(
            [*CKPTFIX, b"convert", src, out, *flags],
            capture_output=True,
            env=env,
            timeout=120,
        )
        answers[what] = proc.returncode
        stderr = proc.stderr.decode("utf-8", "replace").strip()
        if proc.returncode == 2:
            if "\n" in stderr or "ck" not in stderr or "Traceback" in stderr:
                problems.append(f"{what}: not a one-line error naming the file: {stderr[:300]!r}")
            if os.path.exists(out):
                problems.append(f"{what}: refused, but wrote its output")
        elif proc.returncode == 0:
            readable = tmp_path / f"copy-{len(flags)}.pt"  # read back under a plain name: only the output is judged
            with open(out, "rb") as f:
                readable.write_bytes(f.read())
            loaded = ckptfix.load(readable)
            if list(loaded["model"]) != ["w"] or not torch.equal(loaded["model"]["w"], torch.arange(4.0)):
                problems.append(f"{what}: wrote {loaded}")
        else:
            problems.append(f"{what}: exit {proc.returncode}: {stderr[-300:]!r}")
    if len(set(answers.values())) != 1:
        problems.append(f"the paths disagree (exit codes {answers})")
    if content == "truncated" and set(answers.values()) != {2}:
        problems.append(f"a truncated file was not refused: {answers}")
    with open(src, "rb") as f:
        if f.read() != data:
            problems.append("the input was modified")
    assert not problems, "\n".join(problems)


# --- case 6: sets and complex numbers --------------------------------------------------------------------------


def test_case6_sets_and_complex_numbers_in_a_config(tmp_path: Path) -> None:
    cfg = {"tags": {"a", "b"}, "frozen": 3, "z": complex(1.5, -2.0)}
    src = tmp_path / "cfg.pt"
    torch.save({"model": {"module.w": torch.arange(3.0)}, "cfg": cfg}, src)
    assert ckptfix.load(src)["cfg"] == cfg
    for fast in (True, False):
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(src, out, fast=fast)
        loaded = ckptfix.load(out)
        assert loaded["cfg"] == cfg and list(loaded["model"]) == ["w"]
    (tmp_path / "parity").mkdir()
    assert not check_parity(tmp_path / "parity", src.read_bytes(), ".pt")
    assert invoke("inspect", src).exit_code == 0
    result = invoke("convert", src, tmp_path / "cli.pt", "--allow-global", "__builtin__.set")
    assert result.exit_code == 0, result.stderr
    assert ckptfix.load(src, allow_globals=["__builtin__.set"])["cfg"] == cfg


def test_case6_python3_names_for_set_and_complex(tmp_path: Path) -> None:
    """``builtins.set``/``builtins.complex`` (torch.save writes ``__builtin__.set``): accepted on both paths."""
    tags = P.call(P.glob("builtins", "set"), P.lst(P.string("x")))
    z = P.call(P.glob("builtins", "complex"), P.real(0.0), P.real(1.0))
    src = tmp_path / "cfg.pt"
    src.write_bytes(hostile.one_tensor_with("cfg", P.dct([(P.string("tags"), tags), (P.string("z"), z)])))
    assert ckptfix.load(src)["cfg"] == {"tags": {"x"}, "z": 1j}
    (tmp_path / "parity").mkdir()
    assert not check_parity(tmp_path / "parity", src.read_bytes(), ".pt")


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


TWO = torch.tensor([1.0, 2.0])
CONTROLS: dict[str, tuple[Callable[[], bytes], str, torch.Tensor]] = {  # minus the attack: file, key, value
    "small": (lambda: hostile.small_checkpoint(1.0, 2.0), "w", TWO),
    "secret-beside-a-good-storage": (
        lambda: hostile.with_secret(
            hostile.tensor_pickle([("w", P.tensor(P.storage(P.string("0"), numel=2), shape=[2]))])
        ),
        "w",
        TWO,
    ),
    "config-entry": (lambda: hostile.one_tensor_with("cfg", P.dct([(P.string("lr"), P.real(0.1))])), "w", TWO),
    "shallow-dag": (lambda: hostile.torch_zip_file(hostile.dag_pickle(3), {"0": hostile.floats(1.0, 2.0)}), "w", TWO),
    "one-directory-entry": (lambda: hostile.many_entries(count=1, size=64), "w0", torch.zeros(16)),
    "not-expanded": (lambda: hostile.expanded(3.0, numel=4), "weight", torch.full((4,), 3.0)),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_controls_without_the_attack_are_accepted(tmp_path: Path, name: str) -> None:
    """Each generator minus its attack makes a file both paths accept: the refusals above are for the attack."""
    make, key, value = CONTROLS[name]
    data = make()
    assert not check_parity(tmp_path, data, ".pt")
    src = tmp_path / "control.pt"
    src.write_bytes(data)
    assert torch.equal(ckptfix.load(src)["model"][key], value)
    for fast in (True, False):
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(src, out, fast=fast)
        assert torch.equal(ckptfix.load(out)["model"][key], value)
        assert hostile.SECRET not in out.read_bytes()
    assert invoke("inspect", src).exit_code == 0


def test_generators_make_what_torch_reads() -> None:
    """The byte-level writers are right: torch itself reads an archive and a legacy file made by them."""
    loaded = torch.load(io.BytesIO(hostile.small_checkpoint(1.0, 2.0)), weights_only=True)
    assert torch.equal(loaded["model"]["w"], torch.tensor([1.0, 2.0]))
    with zipfile.ZipFile(io.BytesIO(hostile.small_checkpoint(1.0))) as zf:
        assert zf.testzip() is None
    legacy = hostile.legacy_file(pickle_of({"a": 1}))
    assert torch.load(io.BytesIO(legacy), weights_only=True) == {"a": 1}


def pickle_of(obj: Any) -> bytes:
    import pickle

    return pickle.dumps(obj, protocol=2)


# --- the fast reader (C unpickler) answers exactly as the reference reader ---------------------------------------

ALLOWED = allowlist.allowed_names(("argparse.Namespace",), source="test")


def _canonical(obj: Any, ids: dict[int, int]) -> Any:
    """A comparable image of an inert tree: types, values, names of globals, and which objects are shared."""
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        return ("float", struct.pack(">d", obj))  # NaN payloads and -0.0 compare too
    if id(obj) in ids:
        return ("shared", ids[id(obj)])
    ids[id(obj)] = len(ids)
    if isinstance(obj, dict):
        items = [(_canonical(k, ids), _canonical(v, ids)) for k, v in obj.items()]
        attrs = [(k, _canonical(v, ids)) for k, v in vars(obj).items()] if isinstance(obj, OrderedDict) else None
        return ("odict" if isinstance(obj, OrderedDict) else "dict", items, attrs)
    if isinstance(obj, (list, tuple, set)):
        return (type(obj).__name__, [_canonical(v, ids) for v in obj])
    if isinstance(obj, type) and issubclass(obj, inert.Global):
        return ("global", obj.full)
    if obj is OrderedDict:
        return ("global", "collections.OrderedDict")
    if isinstance(obj, inert.StorageRef):
        return ("storage", _canonical(obj.pid, ids))
    if isinstance(obj, inert.Inert):
        state = (obj.newobj, obj.has_state, _canonical(obj.args, ids), _canonical(obj.state, ids))
        return (type(obj).__name__, obj.func.full, state)
    raise AssertionError(f"unexpected {type(obj)} in an inert tree")


def reader_outcome(data: bytes | io.BytesIO) -> Any:
    """What unpickling.load answers: a stream always takes the reference reader, bytes the fast one where proven."""
    try:
        (tree,), storages = unpickling.load(data, source="in.pt", allowed=ALLOWED)
    except CkptfixError as e:
        return type(e).__name__, re.sub(r"0x[0-9a-f]+", "0x…", str(e))  # an object's address differs per run
    ids: dict[int, int] = {}
    return _canonical(tree, ids), sorted((k, _canonical(r, ids)) for k, r in storages.items())


def fast_reader_problem(data: bytes) -> str | None:
    fast, reference = reader_outcome(data), reader_outcome(io.BytesIO(data))
    return None if fast == reference else f"fast reader: {fast!r:.300}\nreference: {reference!r:.300}"


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
