"""A termination signal that another thread takes while the main thread holds signals (atomic._hold_signals), and
one whose exception a callee swallows: the process still ends by the signal, with nothing left behind.

The kernel gives a signal that the main thread blocks to any other thread (torch starts some); that thread's C-level
handler then has Python run the handler in the main thread at its next instruction, blocked or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.formats.output.test_signals import _default_signals

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
