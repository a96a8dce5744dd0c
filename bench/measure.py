"""One command run in a child process, as every benchmark here measures it: wall time, and peak RSS from wait4
(the child's own, not the parent's)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def measured(argv: list[str], *, env: dict[str, str], cwd: Path | None = None) -> tuple[float, int]:
    """Run ``argv``; its wall time in seconds and peak RSS in bytes. A failure ends the benchmark, saying why."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {err[-2000:]}")
    return wall, usage.ru_maxrss * 1024
