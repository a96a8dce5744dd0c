"""ckptfix.formats.output.atomic: outputs written whole or not at all, never onto an input, with the mode the umask
gives.

``--force`` (``overwrite=True``) is one rule for files and folders: an existing output is refused (exit 2, naming
the flag) unless asked, and then replaced only once the new one is whole; a folder output (a DCP folder, a shard
set) is written beside the old one and swapped in, never onto anything but a checkpoint, never onto an input."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.conversion.files import convert_file
from ckptfix.errors import OutputError
from tests.inputs import _hf, _tree_hash
from tests.measured import CKPTFIX, ROOT, digest
from tests.models import make_file, make_net, wrap

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
SINGLE, DDP = FIXTURES / "single.pt", FIXTURES / "ddp_wrapped.pt"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (relative) and its SHA-256: what a refusal or a failure must leave as it was."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


def refused(result: Result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert "\n" not in message and message.startswith("ckptfix: error: ")
    for word in words:
        assert word in message, message
    return message


def model(path: Path) -> dict[str, torch.Tensor]:
    loaded = ckptfix.load(path)
    return loaded.get("model", loaded)  # type: ignore[no-any-return]


# -- DCP folders ------------------------------------------------------------------------------------------------


def test_a_dcp_folder_is_replaced_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    assert run("convert", SINGLE, f"{out}/").exit_code == 0
    before = tree(tmp_path)
    refused(run("convert", DDP, f"{out}/"), str(out), "exists and is not empty", "--force")
    assert tree(tmp_path) == before
    result = run("convert", DDP, f"{out}/", "--force", "--to", "ddp")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == ["dcp"]  # no temp folder, no old folder left beside it
    assert all(k.startswith("module.") for k in model(out))  # the new checkpoint (the old one was single)


def test_force_replaces_only_a_dcp_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / ".metadata").write_bytes(b"x")
    (out / "notes.txt").write_text("precious")
    before = tree(tmp_path)
    refused(run("convert", SINGLE, f"{out}/", "--force"), "notes.txt", "is not a file of a DCP checkpoint", "--force")
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()
    refused(run("convert", SINGLE, f"{out}/", "--force"), "sub", "is not a file of a DCP checkpoint")
    (out / "sub").rmdir()
    os.symlink(SINGLE, out / "__0_0.distcp")
    refused(run("convert", SINGLE, f"{out}/", "--force"), "__0_0.distcp")
    assert tree(tmp_path) == {**{k: v for k, v in before.items() if "notes" not in k}, "mine/__0_0.distcp": tree(
        FIXTURES)["single.pt"]}  # fmt: skip


def test_force_never_replaces_the_input(tmp_path: Path) -> None:
    dcp = tmp_path / "dcp"
    assert run("convert", SINGLE, f"{dcp}/").exit_code == 0
    before = tree(tmp_path)
    refused(run("convert", dcp, f"{dcp}/", "--force"), "input")
    inner = dcp / "__0_0.distcp"
    refused(run("convert", inner, f"{dcp}/", "--force", "--no-fast"), "input")
    assert tree(tmp_path) == before


def test_a_failed_write_leaves_the_old_dcp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dcp"
    ckptfix.save({"w": torch.zeros(2)}, f"{out}/")
    before = tree(tmp_path)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ckptfix.torchcompat.dcp_save_local", broken)
    with pytest.raises(OSError, match="No space"):
        ckptfix.save({"w": torch.ones(2)}, f"{out}/", overwrite=True)
    assert tree(tmp_path) == before


def test_a_failed_swap_puts_the_old_dcp_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dcp"
    ckptfix.save({"w": torch.zeros(2)}, f"{out}/")
    before = tree(tmp_path)
    rename = os.rename

    def failing(src: str, dst: str) -> None:  # the old folder goes aside; the new one cannot come in
        if os.fspath(dst) == str(out) and ".ckptfix-old." not in os.fspath(src):
            raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OutputError, match=r"cannot put the new folder in place \(Input/output error\); nothing"):
        ckptfix.save({"w": torch.ones(2)}, f"{out}/", overwrite=True)
    monkeypatch.undo()
    assert tree(tmp_path) == before
    assert torch.equal(ckptfix.load(out)["w"], torch.zeros(2))
    ckptfix.save({"w": torch.ones(2)}, f"{out}/", overwrite=True)
    assert torch.equal(ckptfix.load(out)["w"], torch.ones(2)) and sorted(os.listdir(tmp_path)) == ["dcp"]


# -- shard sets -----------------------------------------------------------------------------------------------------


def test_a_shard_set_is_replaced_only_with_force(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    assert run("convert", SINGLE, f"{folder}/", "--model-only", "--shard-size", "10kB").exit_code == 0
    (folder / "config.json").write_text("{}")  # what a transformers folder holds beside its shards
    old = sorted(os.listdir(folder))
    assert old == ["config.json", *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
                   "model.safetensors.index.json"]  # fmt: skip
    before = tree(tmp_path)
    # a set of another count would leave the old shards beside the new index: refused as well
    refused(run("convert", SINGLE, f"{folder}/", "--model-only", "--shard-size", "5kB"), "already exists", "--force")
    assert tree(tmp_path) == before
    result = run("convert", SINGLE, f"{folder}/", "--model-only", "--shard-size", "5kB", "--force")
    assert result.exit_code == 0, result.output
    new = sorted(os.listdir(folder))
    assert new == ["config.json", *(f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)),
                   "model.safetensors.index.json"]  # fmt: skip
    assert (folder / "config.json").read_text() == "{}"  # never touched
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    expected = model(SINGLE)
    assert sorted(model(folder)) == sorted(expected)
    # one shard: written as OUT itself, the old set and its index gone
    result = run("convert", SINGLE, folder / "model.safetensors", "--model-only", "--shard-size", "1GB", "--force")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


def test_force_never_replaces_a_shard_that_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=10_000)
    before = tree(tmp_path)
    shard = folder / "model-00001-of-00003.safetensors"
    refused(run("convert", shard, folder / "model.safetensors", "--shard-size", "5kB", "--force"), str(shard), "input")
    assert tree(tmp_path) == before
    with pytest.raises(OutputError, match="input"):
        ckptfix.convert_file(shard, folder / "model.safetensors", shard_size=5000, overwrite=True)
    assert tree(tmp_path) == before


def test_a_failed_shard_write_leaves_the_old_set(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=10_000)
    before = tree(tmp_path)
    bad = {**model(SINGLE), "zz": torch.zeros(2, dtype=torch.complex32)}  # safetensors cannot store it: the last
    with pytest.raises(OutputError):  # shard fails
        ckptfix.save(bad, folder / "model.safetensors", shard_size=5000, overwrite=True)
    assert tree(tmp_path) == before
    with pytest.raises(OutputError, match=r"already exists.*overwrite=True"):
        ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=5000)
    assert tree(tmp_path) == before


def test_a_failed_shard_swap_puts_the_old_set_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "hf"
    ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=10_000)
    before = tree(tmp_path)
    rename = os.rename
    calls: list[str] = []

    def failing(src: str, dst: str) -> None:  # the last new file (the index) cannot come in
        if os.path.dirname(os.fspath(dst)) == str(folder):
            calls.append(os.fspath(dst))
            if len(calls) == 5:  # after the 3 old files went aside, the 4 new ones come in
                raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OutputError, match="cannot put the new shards in place"):
        ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=5000, overwrite=True)
    monkeypatch.undo()
    assert tree(tmp_path) == before


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


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


# Inputs are never outputs: an output that is, or sits inside, anything the command reads is refused with exit 2
# naming both, before anything is written (hard and symbolic links included).


@pytest.mark.parametrize("command", ["convert", "sanitize", "merge"])
@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_link_to_the_input_is_the_input(tmp_path: Path, command: str, link: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, src)
    other = tmp_path / "other.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, other)
    out = tmp_path / "alias.pt"
    (os.link if link == "hard" else os.symlink)(src, out)
    args = {"convert": ["convert", str(src), str(out)], "sanitize": ["sanitize", str(src), str(out)],
            "merge": ["merge", str(other), str(src), "-o", str(out)]}[command]  # fmt: skip
    before = src.read_bytes()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert str(out) in result.output and "input" in result.output
    assert src.read_bytes() == before


def test_the_library_refuses_alike(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "in", "model.safetensors")
    before = _tree_hash(folder)
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, folder / "x.pt")
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, str(folder / "dcp") + "/")  # a DCP folder output
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, folder / "sub" / "m.safetensors", shard_size=600)
    with pytest.raises(OutputError, match="holds the input folder"):
        ckptfix.convert_file(folder, str(tmp_path) + "/")
    assert _tree_hash(folder) == before


@pytest.mark.parametrize("command", ["convert", "sanitize", "merge"])
def test_an_existing_output_is_replaced_only_when_asked(tmp_path: Path, command: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, src)
    out = tmp_path / "out.pt"
    out.write_bytes(b"precious")
    args = {"convert": ["convert", str(src), str(out)], "sanitize": ["sanitize", str(src), str(out)],
            "merge": ["merge", str(src), str(src), "-o", str(out)]}[command]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and f"{out}: already exists" in result.output and "--force" in result.output
    assert out.read_bytes() == b"precious"
    result = CliRunner().invoke(cli, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert any(k.endswith("head.weight") for k in torch.load(out, weights_only=True)["model"])


def test_the_library_refuses_an_existing_output_unless_overwrite(tmp_path: Path) -> None:
    src, out = tmp_path / "in.pt", tmp_path / "out.safetensors"
    torch.save(make_net().state_dict(), src)
    out.write_bytes(b"precious")
    for call in (lambda **kw: ckptfix.convert_file(src, out, **kw), lambda **kw: ckptfix.sanitize(src, out, **kw)):
        with pytest.raises(OutputError, match=r"already exists; write to a new path, or pass overwrite=True"):
            call()
        assert out.read_bytes() == b"precious"
    ckptfix.convert_file(src, out, overwrite=True)
    assert "head.weight" in ckptfix.load(out)


# Outputs get the mode the umask gives, as open/mkdir would (docs/safety.md): files 0666 & ~umask, folders (a DCP
# checkpoint, written in a private staging folder and renamed into place) 0777 & ~umask; an existing empty folder
# written into keeps its own mode.


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def source(tmp_path: Path) -> Path:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, src)
    return src


def convert(*args: str) -> None:
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 0, result.output


def test_file_outputs_follow_the_umask(umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    for name in ("out.safetensors", "out.pt"):
        convert(str(src), str(tmp_path / name))
        assert mode(tmp_path / name) == 0o666 & ~umask, name
    shards = tmp_path / "shards"
    shards.mkdir()
    convert(str(src), str(shards / "model.safetensors"), "--shard-size", "20")
    assert len(list(shards.iterdir())) > 2
    for f in shards.iterdir():
        assert mode(f) == 0o666 & ~umask, f.name


@pytest.mark.parametrize("how", ["convert", "save"])
def test_dcp_folders_follow_the_umask(how: str, umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    for name in ("run_dcp", "hf_dir"):
        out = tmp_path / name
        if how == "convert":  # streamed
            convert(str(src), f"{out}/")
        else:
            ckptfix.save(ckptfix.load(src), f"{out}/")
        assert mode(out) == 0o777 & ~umask, name
        assert os.listdir(out)
        for f in out.iterdir():
            assert mode(f) == 0o666 & ~umask, f.name
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".ckptfix-tmp")]


def test_an_existing_empty_folder_keeps_its_mode(umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    out = tmp_path / "run_dcp"
    out.mkdir()
    out.chmod(0o755)
    convert(str(src), str(out))
    assert mode(out) == 0o755
    out2 = tmp_path / "shared_dcp"
    out2.mkdir()
    out2.chmod(0o2770)  # setgid, group-writable: a team's folder stays one
    ckptfix.save(ckptfix.load(src), str(out2))
    assert mode(out2) == 0o2770


# ----------------------------------------------------------------------------------------------------------------------
# SIGTERM, SIGINT and SIGHUP during a write: the temp file is removed and the exit status is the usual one.
#
# Each case runs a real ``ckptfix`` (or a script calling ``ckptfix.save``) on inputs big enough that writing takes
# a while, waits until its temp file appears, freezes it with SIGSTOP (so the signal lands mid-write however fast
# the machine is), sends the signal, and lets it go on.


KEYS = 48  # 1 MiB each: writing takes long enough to be caught in the act, the files stay small


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("signals")
    files = []
    for rank in range(2):
        gen = torch.Generator().manual_seed(0)
        state = {f"layer{i}.weight": torch.randn(512, 512, generator=gen) for i in range(KEYS)}
        state["bn.running_mean"] = torch.full((8,), float(rank))
        state["bn.running_var"] = torch.ones(8)
        files.append(folder / f"rank{rank}.pt")
        torch.save({"model": state, "epoch": 1}, files[-1])
    return files


def _temp_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.ckptfix-tmp"))


def _default_signals() -> None:
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def _stopped(pid: int) -> bool:
    """Whether ``pid`` has stopped (SIGSTOP takes effect only once it leaves a system call such as fsync)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
    except (OSError, IndexError):
        return True  # no /proc (or gone): as before, trust the signal


def _holds(pid: int, signum: int) -> bool:
    """Whether the main thread of ``pid`` holds ``signum``: it is creating its temp file or renaming it into
    place (atomic._hold_signals); a signal then comes after the rename, and a complete output is kept by design."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    blocked = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigBlk:")]
    return bool(blocked) and bool(blocked[0] >> (signum - 1) & 1)


def _signal_mid_write(command: list[str], folder: Path, signum: int) -> tuple[int, str]:
    """Run ``command``; once its temp file exists, deliver ``signum`` while it is frozen; return its exit status
    and what it printed on stderr (prefixed with ``held:`` when it was frozen with the signal held)."""
    # The child starts with every signal at its default, as from a terminal: a shell running this test suite in
    # the background (`pytest &`) would have it inherit SIGINT ignored, and an ignored Ctrl-C is not sent by anyone.
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=folder,
                             preexec_fn=_default_signals)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _temp_files(folder):
            if child.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no temp file appeared; exit {child.returncode}: {child.stderr.read()!r}")
            time.sleep(0.0005)
        child.send_signal(signal.SIGSTOP)
        while not _stopped(child.pid) and child.poll() is None:
            time.sleep(0.0005)
        if not _temp_files(folder):  # it finished writing in the instant before it stopped: not mid-write
            child.send_signal(signal.SIGCONT)
            pytest.skip("the write finished before the signal could land")
        held = "held:" if _holds(child.pid, signum) else ""
        child.send_signal(signum)
        child.send_signal(signal.SIGCONT)
        child.wait(timeout=60)
        return child.returncode, held + child.stderr.read().decode(errors="replace")[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
CLI = [sys.executable, "-m", "ckptfix"]


def _command(kind: str, ranks: list[Path], out: Path) -> list[str]:
    if kind == "merge":
        return [*CLI, "merge", str(ranks[0]), str(ranks[1]), "-o", str(out)]
    if kind == "convert":
        return [*CLI, "convert", str(ranks[0]), str(out), "--model-only"]
    script = "import sys, torch, ckptfix; ckptfix.save(torch.load(sys.argv[1]), sys.argv[2])"
    return [sys.executable, "-c", script, str(ranks[0]), str(out)]


def _check(kind: str, signum: int, ranks: list[Path], tmp_path: Path) -> None:
    out = tmp_path / ("merged.pt" if kind != "convert" else "model.safetensors")
    status, stderr = _signal_mid_write(_command(kind, ranks, out), tmp_path, signum)
    assert _temp_files(tmp_path) == [], f"the temp file was left behind (exit {status}): {stderr}"
    if stderr.startswith("held:") and out.exists():  # frozen while renaming: the signal came after, the output is whole
        written = ckptfix.load(out)
        expected = torch.load(ranks[0], weights_only=True)["model"]["layer0.weight"]
        assert torch.equal(written.get("model", written)["layer0.weight"], expected)
        assert status in (0, -signum, 128 + signum), stderr
        return
    assert not out.exists(), (status, stderr)
    if kind == "save":  # a library call: the process ends by the signal itself, as it would have without ckptfix
        assert status in (-signum, 128 + signum), stderr
    else:  # the CLI exits 128 + N, as a shell reports a program a signal stopped
        assert status == 128 + signum, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_after_the_rename_says_the_output_was_written(tmp_path: Path, signum: int) -> None:
    # The signal lands once the output is in place, while the folder entry is synced: the output stays, complete,
    # and the message says so instead of "no output was written".
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    late = (
        "import os, sys, ckptfix.formats.output.atomic as a; sync = a.fsync_dir; "
        f"a.fsync_dir = lambda f: (sync(f), os.kill(os.getpid(), {int(signum)})); "
        "from ckptfix.cli import main; sys.argv[0] = 'ckptfix'; main()"
    )
    done = subprocess.run([sys.executable, "-c", late, "convert", str(src), str(out)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_default_signals)  # fmt: skip
    assert done.returncode == (128 + signum if signum != signal.SIGINT else 130), done.stderr
    what = "terminated by SIGTERM" if signum == signal.SIGTERM else "interrupted"
    assert done.stderr.strip().splitlines()[-1] == f"ckptfix: {what} after writing {out} in full", done.stderr
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(4.0))
    assert _temp_files(tmp_path) == []


def test_a_sigterm_after_the_command_returned_says_the_output_was_written(tmp_path: Path) -> None:
    # A fast machine finishes the command before a scheduler's SIGTERM lands: the process is on its way out, and
    # the line must still say the output is there, complete (it used to exit 143 saying nothing).
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    late = (
        "import os, sys, signal, ckptfix.cli as c; invoke = c._Group.invoke; "
        "c._Group.invoke = lambda self, ctx: (invoke(self, ctx), os.kill(os.getpid(), signal.SIGTERM))[0]; "
        "sys.argv[0] = 'ckptfix'; c.main()"
    )
    done = subprocess.run([sys.executable, "-c", late, "convert", str(src), str(out)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_default_signals)  # fmt: skip
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"ckptfix: terminated by SIGTERM after writing {out} in full"
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(4.0))


def test_sigterm_during_merge_removes_the_temp_file(ranks: list[Path], tmp_path: Path) -> None:
    _check("merge", signal.SIGTERM, ranks, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["merge", "convert", "save"])
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_each_signal_during_each_write_removes_the_temp_file(
    kind: str, signum: int, ranks: list[Path], tmp_path: Path
) -> None:
    _check(kind, signum, ranks, tmp_path)


def test_a_program_s_own_handler_is_left_alone(tmp_path: Path) -> None:
    script = (
        "import signal, sys\n"
        "from ckptfix.formats.output.atomic import unwinding_signals\n"
        "mine = lambda *a: None\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a shell starts it (nohup would have it ignored)\n"
        "with unwinding_signals():\n"
        "    assert signal.getsignal(signal.SIGTERM) is mine\n"
        "    assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL\n"
        "assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


class _Interrupt(BaseException):
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupt


def test_a_signal_during_the_wait_for_a_worker_still_waits_for_it() -> None:
    # A worker thread left running in torch code when the interpreter exits is ended inside it: "terminate called
    # without an active exception", exit 134 instead of 143. An interrupted Thread.join marks the thread ended while
    # it runs on (CPython 3.11), so the wait after the signal must not trust it.
    import threading

    from ckptfix.stream.folders import InOrder

    release, ended = threading.Event(), []

    def work(item: int) -> None:
        release.wait()
        time.sleep(0.05)
        ended.append(item)

    copier = InOrder(work)
    copier.put(1)
    old = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        threading.Timer(0.4, release.set).start()
        with pytest.raises(_Interrupt):
            copier.finish()
        copier.cancel()
        assert ended == [1], "cancel() returned while the worker was still at work"
    finally:
        signal.signal(signal.SIGUSR1, old)
        release.set()


# Bounded work: counts that decide work or memory bounded by the file's bytes, refused in one line (exit 2, naming the
# file), input unchanged, nothing left behind (tests/measured.py runs the command and measures it).


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


# ----------------------------------------------------------------------------------------------------------------------
# A termination signal that another thread takes while the main thread holds signals (atomic._hold_signals), and
# one whose exception a callee swallows: the process still ends by the signal, with nothing left behind.
#
# The kernel gives a signal that the main thread blocks to any other thread (torch starts some); that thread's C-level
# handler then has Python run the handler in the main thread at its next instruction, blocked or not.


# A thread that does not block signals (as torch's), then the case's change, then a write.
PRELUDE = """
import os, signal, sys, threading, time
import ckptfix.formats.output.atomic as a
threading.Thread(target=threading.Event().wait, daemon=True).start()
def term():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)  # the other thread's C-level handler runs; the main thread runs the Python one when it resumes
"""
CASES = {
    # Right after the temp file is created, before its name is known to the code that removes it.
    "creating": "create = a._create_temp\na._create_temp = lambda *args: (create(*args), term())[0]\n",
    # Raised inside the block and swallowed there, as torch's C++ can swallow one raised in its callbacks.
    "swallowed": "",
}
WRITE = """
with a.atomic_output(sys.argv[1]) as f:
    f.write(b"x")
    if {swallow}:
        try:
            term()
        except a.Terminated:
            pass
"""


@pytest.mark.parametrize("case", CASES)
def test_sigterm_taken_by_another_thread_ends_the_process_with_nothing_left(tmp_path: Path, case: str) -> None:
    script = PRELUDE + CASES[case] + WRITE.format(swallow=case == "swallowed")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.pt")], capture_output=True, text=True,
                          timeout=60, preexec_fn=_default_signals)  # fmt: skip
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert sorted(os.listdir(tmp_path)) == [], "a temp file or an output was left behind"
