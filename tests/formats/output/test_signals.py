"""SIGTERM, SIGINT and SIGHUP during a write: the temp file is removed and the exit status is the usual one.

Each case runs a real ``ckptfix`` (or a script calling ``ckptfix.save``) on inputs big enough that writing takes
a while, waits until its temp file appears, freezes it with SIGSTOP (so the signal lands mid-write however fast
the machine is), sends the signal, and lets it go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptfix
from tests.measured import CKPTFIX, ROOT, digest

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
