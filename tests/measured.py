"""``ckptfix`` in a subprocess, measured (exit status, stderr, wall time, peak RSS), and the refusal contract:
exit 2, one line naming the file, the input's bytes unchanged, nothing left behind, bounded time and memory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

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


OUTPUTS = (["out.pt"], ["out.safetensors"], ["shards/", "--shard-size", "1MB"], ["dcp_out/"])  # relative to cwd
