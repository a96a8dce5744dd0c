"""What every entry point makes of one hostile file (tests/hostile.py makes them byte by byte).

For every file: both conversion paths (``convert_file(fast=True/False)``, ``ckptfix convert [--no-fast]``),
``ckptfix.load`` and ``ckptfix inspect`` refuse it with the right error class (exit code 2), one line naming
the file, no output left, the input unchanged, and no payload run (a marker file the payload would create).
(A payload in an entry beside the model is listed by ``inspect`` as not loaded instead: formats/torchio/opaque.py.)
Inputs that could hang, recurse without end, allocate or write gigabytes, or poison the process run in a child
process under limits (:func:`run_ops`). The fast pickle reader is compared with the reference one
(:func:`fast_reader_problem`).
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import CkptfixError, UnsafeCheckpointError
from ckptfix.formats.pickles import inert, unpickling
from ckptfix.formats.safety import allowlist
from tests.parity import check_parity

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


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


def refused_everywhere(tmp_path: Path, data: bytes, expect: Expect, **kwargs: Any) -> None:
    problems = refusals(tmp_path, data, expect, **kwargs)
    assert not problems, "\n".join(problems)


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
