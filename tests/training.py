"""The reference trainer (``ckptfix.trainer``) as the tests run it: small runs' options, the committed fixtures it
made, and ``ckptfix`` in a subprocess from the checkout (for the commands that start processes of their own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
SMALL = {"samples": 256, "val_samples": 64, "batch_size": 32}
SMALL_ARGS = ["--samples", "256", "--val-samples", "64", "--batch-size", "32"]


def ckptfix_process(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ckptfix", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
