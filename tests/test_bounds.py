"""Hardening round 3: every count that decides work or memory bounded by what is on disk, clear refusals (exit 2,
one line naming the file) where an internal error or a silent loss was, and a bounded run for each.

Each hostile input is built byte by byte or with torch; each case checks the exit status, the one-line message,
the input's bytes unchanged, no output or temp file left, and (resource cases) time and peak memory of the
process, measured in a subprocess.
"""

from __future__ import annotations

import _codecs
import ast
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "ckptfix"
CKPTFIX = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ckptfix"]
MAX_RSS_MB = 200  # the process's peak, torch imported or not
MAX_SECONDS = 5.0


# The measuring parent: a small process that starts the command and reports its exit status, wall time and peak
# RSS. (A child forked from pytest would count pytest's own pages, torch included, in its peak: Linux keeps the
# high-water mark across exec.)
_MEASURE = """
import os, subprocess, sys, time
start = time.monotonic()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), time.monotonic() - start, usage.ru_maxrss / 1024)
"""


def run(*args: str | os.PathLike[str], cwd: Path) -> tuple[int, str, float, float]:
    """``ckptfix ARGS`` in a subprocess: exit status, stderr, wall seconds and peak RSS (MB) of that process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", _MEASURE, *CKPTFIX, *map(os.fspath, args)]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    code, seconds, rss = proc.stdout.split()
    return int(code), proc.stderr, float(seconds), float(rss)


def digest(path: Path) -> str:
    if path.is_dir():
        return "".join(f"{p.relative_to(path)}:{digest(p)}" for p in sorted(path.rglob("*")) if p.is_file())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused(*args: str | os.PathLike[str], source: Path, cwd: Path, contains: str = "",
            bounded: bool = False) -> str:  # fmt: skip
    """Run ``ckptfix ARGS`` on ``source`` and check the refusal contract; returns the message."""
    before, listing = digest(source), sorted(os.listdir(cwd))
    code, stderr, seconds, rss = run(*args, cwd=cwd)
    message = stderr.strip()
    assert code == 2, f"exit {code}: {stderr[-2000:]}"
    assert "Traceback" not in stderr and "\n" not in message, message
    assert message.startswith("ckptfix: error:") and source.name in message, message
    assert contains in message, message
    assert digest(source) == before, "the input changed"
    assert sorted(os.listdir(cwd)) == listing, f"left behind: {set(os.listdir(cwd)) - set(listing)}"
    if bounded:
        assert seconds < MAX_SECONDS, f"took {seconds:.1f} s"
        assert rss < MAX_RSS_MB, f"peak RSS {rss:.0f} MB"
    return message


# --- item 7: no import circle in formats/ ------------------------------------------------------------------------


def test_allowlist_does_not_import_the_shard_reader() -> None:
    tree = ast.parse((ROOT / "ckptfix" / "formats" / "safety" / "allowlist.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {n for n in names if n.startswith("ckptfix.formats.") and n != "ckptfix.formats.dtypes"}, names


# --- item 1: counts in a pickle bounded by the file's bytes ------------------------------------------------------


class _Encoded:
    """Pickles as ``_codecs.encode(text, 'latin1')``: the bytes of a protocol-2 pickle."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> Any:
        return (_codecs.encode, (self.text, "latin1"))


class _Array:
    """Pickles as numpy does an ndarray (``_reconstruct`` then its state), with any shape: numpy not needed."""

    def __init__(self, shape: tuple[int, ...], descr: str, data: str) -> None:
        self.shape, self.descr, self.data = shape, descr, data

    def __reduce__(self) -> Any:
        np = pytest.importorskip("numpy")
        reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
        return (reconstruct, (np.ndarray, (0,), _Encoded("b")),
                (1, self.shape, np.dtype(self.descr), False, _Encoded(self.data)))  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "descr"),
    [((3_000_000, 0), "<U3"), ((10**9, 0), "<U3"), ((10**9,), "<U0"), ((2**64, 0), "<f8"), ((0, 2**63), "<U2")],
)
def test_sanitize_array_shape_bounded_by_file(tmp_path: Path, shape: tuple[int, ...], descr: str) -> None:
    src = tmp_path / "arrays.pt"
    torch.save({"w": torch.ones(2), "a": _Array(shape, descr, "")}, src)
    assert src.stat().st_size < 4096
    refused("sanitize", src, tmp_path / "out.pt", source=src, cwd=tmp_path, contains="key 'a'", bounded=True)


def test_sanitize_small_empty_string_arrays_still_convert(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    src = tmp_path / "arrays.pt"
    torch.save({"a": _Array((3, 0), "<U3", ""), "b": np.array([["x", "yz"]])}, src)
    code, stderr, _, _ = run("sanitize", src, tmp_path / "out.pt", cwd=tmp_path)
    assert code == 0, stderr
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out == {"a": [[], [], []], "b": [["x", "yz"]]}


# --- items 2, 3, 5: DCP plans bounded by the data files, one path per planner entry, clear refusals ---------------


def _dcp(tmp_path: Path, edit: Any) -> Path:
    """A real one-process DCP folder whose Metadata object ``edit`` changes, pickled back as torch does."""
    import pickle

    from ckptfix.torchcompat import dcp_save_local

    folder = tmp_path / "dcp"
    state = {"model": {"a": torch.ones(3), "b": torch.zeros(2, 2), "c": torch.arange(4.0)}, "step": 3}
    dcp_save_local(state, checkpoint_id=str(folder))
    meta = folder / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # our own file
    edit(metadata)
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    return folder


def test_dcp_metadata_bounded_by_its_data_files(tmp_path: Path) -> None:
    def many(m: Any) -> None:
        m.planner_data = [{} for _ in range(8_000_000)]  # 16 MB of pickle, over 2 GB unpickled

    folder = _dcp(tmp_path, many)
    assert (folder / ".metadata").stat().st_size > 15 << 20
    for command in (["inspect", folder], ["convert", folder, tmp_path / "out.safetensors"]):
        refused(*command, source=folder, cwd=tmp_path, contains="bytes of metadata for", bounded=True)


def test_dcp_planner_entries_one_path_each(tmp_path: Path) -> None:
    def same(m: Any) -> None:
        m.planner_data["model.b"] = m.planner_data["model.a"]

    folder = _dcp(tmp_path, same)
    message = refused("convert", folder, tmp_path / "out.safetensors", source=folder, cwd=tmp_path)
    assert "'model.a'" in message and "'model.b'" in message and "one path per planner entry" in message


def test_dcp_planner_entry_under_another_value(tmp_path: Path) -> None:
    def under(m: Any) -> None:
        m.planner_data["model.a"] = ("step", "a")

    folder = _dcp(tmp_path, under)
    message = refused("convert", folder, tmp_path / "out.pt", source=folder, cwd=tmp_path)
    assert "'model.a'" in message and "'step'" in message


@pytest.mark.parametrize("name", ["__0_0.distcp\0x", "__0_0\ud800.distcp"])
def test_dcp_relative_path_no_file_can_have(tmp_path: Path, name: str) -> None:
    def rename(m: Any) -> None:
        for info in m.storage_data.values():
            info.relative_path = name

    folder = _dcp(tmp_path, rename)
    refused("inspect", folder, source=folder, cwd=tmp_path, contains="a name no file can have")


@pytest.mark.parametrize("glob", ["Size", "FloatStorage", "UntypedStorage"])
def test_dcp_dtype_not_a_dtype(tmp_path: Path, glob: str) -> None:
    def dtype(m: Any) -> None:
        m.state_dict_metadata["model.a"].properties.dtype = getattr(torch, glob)

    folder = _dcp(tmp_path, dtype)
    message = refused("convert", folder, tmp_path / "out.pt", source=folder, cwd=tmp_path, contains="dtype torch.")
    assert f"{glob}, which is not a torch dtype" in message


@pytest.mark.parametrize(("size", "says"), [(2**44, "needs 70368744177664 bytes"), (-6, "non-negative")])
def test_dcp_global_shape_bounded_by_its_bytes(tmp_path: Path, size: int, says: str) -> None:
    def shape(m: Any) -> None:
        entry = m.state_dict_metadata["model.a"]
        entry.size = entry.chunks[0].sizes = torch.Size([size])

    folder = _dcp(tmp_path, shape)
    for command in (["inspect", folder], ["convert", folder, tmp_path / "out.pt"], ["diff", folder, folder]):
        refused(*command, source=folder, cwd=tmp_path, contains=says, bounded=True)


def test_dcp_items_sharing_bytes(tmp_path: Path) -> None:
    def share(m: Any) -> None:
        infos = list(m.storage_data.values())
        infos[1].offset, infos[1].length = infos[0].offset, infos[0].length

    folder = _dcp(tmp_path, share)
    refused("convert", folder, tmp_path / "out.pt", source=folder, cwd=tmp_path, contains="stored in the same bytes")


# --- item 4: what a .pt output refuses, .safetensors and folder outputs refuse; headers the library reads ---------


def _safetensors_by_hand(path: Path, shape: list[int]) -> None:
    import json
    import struct

    raw = json.dumps({"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


OUTPUTS = (["out.pt"], ["out.safetensors"], ["shards/", "--shard-size", "1MB"], ["dcp_out/"])  # relative to cwd


@pytest.mark.parametrize("size", [2**64, 2**63])
def test_empty_tensor_past_64_bits_from_safetensors(tmp_path: Path, size: int) -> None:
    src = tmp_path / "in.safetensors"
    _safetensors_by_hand(src, [0, size])
    for out, *options in OUTPUTS:
        refused("convert", src, out, *options, source=src, cwd=tmp_path, contains="past 64 bits")


@pytest.mark.parametrize("size", [2**64, 2**63])
def test_empty_tensor_past_64_bits_from_dcp(tmp_path: Path, size: int) -> None:
    def shape(m: Any) -> None:
        entry = m.state_dict_metadata["model.b"]
        entry.size = entry.chunks[0].sizes = torch.Size([0, size])

    folder = _dcp(tmp_path, shape)
    for out, *options in OUTPUTS:
        message = refused("convert", folder, out, *options, source=folder, cwd=tmp_path)
        assert "'model.b'" in message and "past 64 bits" in message


def test_written_headers_are_ones_the_library_reads(tmp_path: Path) -> None:
    from ckptfix.errors import OutputError
    from ckptfix.formats.containers.safetensors import LIBRARY_MAX_HEADER, encode_header

    with pytest.raises(OutputError, match=r"^x\.safetensors: key 'e' has shape \[0, 18446744073709551616\]"):
        encode_header({"e": None}, {}, [("e", "float32", (0, 2**64), 0)], {}, out="x.safetensors")
    many = [(f"k{i:07d}", "float32", (0,), 0) for i in range(LIBRARY_MAX_HEADER // 60)]
    with pytest.raises(OutputError, match=r"^x\.safetensors: its safetensors header would take \d+ bytes"):
        encode_header(dict.fromkeys(k for k, *_ in many), {}, many, {}, out="x.safetensors")
    safetensors = pytest.importorskip("safetensors.torch")
    fine = [("e", "float32", (0, 2**62), 0)]
    path = tmp_path / "ok.safetensors"
    path.write_bytes(encode_header({"e": None}, {}, fine, {}, out=str(path)))
    assert safetensors.load_file(path)["e"].shape == (0, 2**62)


# --- item 5: clear refusals (or plain handling) where an internal error was ---------------------------------------


@pytest.mark.parametrize(
    ("dtype", "shape", "says"),
    [("Size", (2,), "dtype is Size"), ("FloatStorage", (2,), "dtype is FloatStorage"),
     ("", (2,), "dtype is not a dtype"), ("float32", (2**61, 2**61, 0), "past 64 bits")],
)  # fmt: skip
def test_dtensor_dtype_and_shape_proven(dtype: str, shape: tuple[int, ...], says: str) -> None:
    from ckptfix.errors import FormatError
    from ckptfix.formats.folders import fsdp as shards

    with pytest.raises(FormatError, match=rf"^rank1\.pt: key 'w': its DTensor .*{says}"):
        shards._check_piece("w", dtype=dtype, shape=shape, mesh=(2,), coordinate=(0,), placements=(("replicate", 0),),
                            source="rank1.pt")  # fmt: skip


class _NamespaceKey:
    """Hashable here; pickles as an ``argparse.Namespace`` (which sanitize rewrites as a dict: no key)."""

    def __hash__(self) -> int:
        return 1

    def __reduce__(self) -> Any:
        import argparse

        return (argparse.Namespace, (), {"lr": 0.1})


def test_sanitize_namespace_as_a_dict_key_is_dropped_and_listed(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2), "cfg": {_NamespaceKey(): 3, "b": 4}}, src)
    before = digest(src)
    code, stderr, _, _ = run("sanitize", src, "out.pt", cwd=tmp_path)
    assert code == 0, stderr
    assert digest(src) == before
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["cfg"] == {"b": 4} and torch.equal(out["w"], torch.ones(2))


def _save_deep(obj: Any, path: Path) -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 5000)  # pickling recurses per level; pytest's own frames are below
    try:
        torch.save(obj, path)
    except RecursionError:  # Python 3.12.0-3.12.1: a fixed C recursion limit stops the pickler itself
        pytest.skip(f"Python {sys.version.split()[0]} cannot pickle this deep (its C recursion limit)")
    finally:
        sys.setrecursionlimit(limit)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [250, 330, 999])
def test_deep_nesting_torch_opens_is_walked_by_every_command(tmp_path: Path, depth: int) -> None:
    src = tmp_path / "deep.pt"
    _save_deep({"model": {"w": torch.ones(2)}, "deep": _nested(depth)}, src)
    assert torch.load(src, weights_only=True)["model"]["w"].shape == (2,)
    before = digest(src)
    commands = [["inspect", src], ["inspect", "--json", src], ["sanitize", src, "s.pt"], ["convert", src, "c.pt"],
                ["convert", src, "d.pt", "--to", "ddp"], ["convert", src, "c.safetensors"], ["convert", src, "dcp/"],
                ["diff", src, src]]  # fmt: skip
    for command in commands:
        code, stderr, _, _ = run(*command, cwd=tmp_path)
        assert code == 0, f"{command[0]}: exit {code}: {stderr[-500:]}"
    assert digest(src) == before
    for name in ("s.pt", "c.pt", "d.pt"):
        torch.load(tmp_path / name, weights_only=True)


def test_nesting_past_the_documented_depth_is_refused_everywhere(tmp_path: Path) -> None:
    from ckptfix.formats.safety.depth import MAX_DEPTH

    src = tmp_path / "deep.pt"
    _save_deep({"model": {"w": torch.ones(2)}, "deep": _nested(MAX_DEPTH + 1)}, src)
    for command in (["inspect", src], ["sanitize", src, "s.pt"], ["convert", src, "c.pt"],
                    ["convert", src, "c.safetensors"], ["diff", src, src]):  # fmt: skip
        refused(*command, source=src, cwd=tmp_path, contains=f"more than {MAX_DEPTH} deep")


# --- item 6: SIGTERM honoured within a second during long steps ---------------------------------------------------


@pytest.fixture(scope="module")
def big_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two rank files of one run (64 MiB each): equal parameters, BatchNorm statistics that differ."""
    folder = tmp_path_factory.mktemp("term")
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(512, 512, generator=gen) for i in range(64)}
    files = []
    for rank in range(2):
        files.append(folder / f"rank{rank}.pt")
        torch.save({"model": {**state, "bn.running_mean": torch.full((8,), float(rank))}, "epoch": 1}, files[-1])
    return files


def _busy_with(pid: int, name: str, folder: Path) -> bool:
    """Whether process ``pid`` has ``name`` open or mapped, or a temp file exists in ``folder``."""
    try:
        fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return any(f.endswith(name) for f in fds) or name in maps or any(folder.glob(".*.ckptfix-tmp"))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to know the command is at work")
@pytest.mark.parametrize(
    ("command", "wait_for"),
    [(["merge", "rank0.pt", "rank1.pt", "-o", "out.safetensors"], "rank1.pt"),
     (["merge", "rank0.pt", "rank1.pt", "-o", "out.pt"], "tmp"),
     (["sanitize", "rank0.pt", "out.pt"], "tmp"),
     (["convert", "rank0.pt", "out.pt", "--to", "ddp"], "tmp"),
     (["convert", "rank0.pt", "out.pt", "--to", "ddp", "--no-fast"], "tmp")],
    ids=["merge-reading", "merge-writing", "sanitize-writing", "convert-writing", "convert-writing-torch"],
)  # fmt: skip
def test_sigterm_ends_a_long_step_within_a_second(big_ranks: list[Path], command: list[str], wait_for: str) -> None:
    import signal

    folder = big_ranks[0].parent
    out = command[command.index("-o") + 1] if "-o" in command else command[2]
    (folder / out).unlink(missing_ok=True)  # an earlier case's complete output (it finished before its signal)
    before = [digest(p) for p in big_ranks]
    listing = sorted(os.listdir(folder))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    default = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # noqa: E731 - as from a terminal
    child = subprocess.Popen([*CKPTFIX, *command], cwd=folder, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, preexec_fn=default)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (
            any(folder.glob(".*.ckptfix-tmp")) if wait_for == "tmp" else _busy_with(child.pid, wait_for, folder)
        ):
            assert child.poll() is None, f"finished before the signal: {child.stderr.read()!r}"
            assert time.monotonic() < deadline, "never got busy"
            time.sleep(0.002)
        time.sleep(0.05)
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
        latency = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    message = err.decode().strip().splitlines()[-1] if err.strip() else ""
    assert child.returncode in (0, 128 + signal.SIGTERM, -signal.SIGTERM), (child.returncode, err[-500:])
    assert latency < 3.0, f"took {latency:.2f} s to end after SIGTERM"
    assert "Traceback" not in err.decode()
    left = set(os.listdir(folder)) - set(listing)
    if message.endswith(" in full"):  # a fast machine finished the rename before the signal came: it says so
        assert message == f"ckptfix: terminated by SIGTERM after writing {out} in full" and left == {out}
        assert ckptfix.load(folder / out)
    elif child.returncode == 0 or (not message and child.returncode == -signal.SIGTERM):
        # The command had finished (a streamed conversion takes milliseconds) before the signal came, or while
        # Python shut down, which restores the default handler: the output is in place, complete (after its fsync).
        assert left == {out} and ckptfix.load(folder / out)
    else:
        assert message in ("", "ckptfix: terminated by SIGTERM; no output was written"), message
        assert not left, f"left behind: {left}"
    assert [digest(p) for p in big_ranks] == before


def test_the_library_walks_deep_nesting_as_the_cli_does(tmp_path: Path) -> None:
    import ckptfix

    # In this process, at Python's default recursion limit: each public call raises it for itself, and only then.
    src = tmp_path / "deep.pt"
    _save_deep({"model": {"w": torch.ones(2)}, "deep": _nested(330)}, src)
    limit = sys.getrecursionlimit()
    assert ckptfix.load(src)["model"]["w"].shape == (2,)
    for fast in (True, False):
        ckptfix.convert_file(src, tmp_path / f"c{fast}.pt", fast=fast)
    ckptfix.sanitize(src, tmp_path / "s.pt")
    assert ckptfix.summarize(src)["models"]
    assert ckptfix.diff(ckptfix.load(src), ckptfix.load(tmp_path / "cTrue.pt")).equal
    assert sys.getrecursionlimit() == limit
