"""Start-up of each ``ckptfix`` command on the small fixtures: wall time, peak RSS and whether torch was imported.

Every row is a fresh ``python -m ckptfix …`` process, so a time is Python's start-up, the imports and the work
(milliseconds on these 30-70 kB files): the minimum of ``--repeat`` runs, which a busy machine inflates least.
torch is checked in one more run with an exit hook that prints ``'torch' in sys.modules``.

    python bench/bench_startup.py [--repeat 5] [--python /path/to/python]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
COMMANDS = ("convert", "diff", "inspect", "merge", "sanitize", "train", "validate")

_PROBE = (
    "import atexit, sys\n"
    "flag = sys.argv.pop(1)\n"
    "atexit.register(lambda: print('torch' in sys.modules, file=open(flag, 'w')))\n"
    "sys.argv[0] = 'ckptfix'\n"
    "from ckptfix.cli import main\n"
    "main()\n"
)


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    f = str(FIX)
    out = str(tmp / "out.pt")
    return [
        ("ckptfix --version", ["--version"]),
        ("ckptfix --help", ["--help"]),
        *((f"{name} --help", [name, "--help"]) for name in COMMANDS),
        ("inspect (28 kB .safetensors)", ["inspect", f"{f}/ddp_wrapped.safetensors"]),
        ("convert .pt -> .pt", ["convert", f"{f}/ddp_wrapped.pt", out, "--force"]),
        ("diff equal (same file)", ["diff", f"{f}/single.pt", f"{f}/single.pt"]),
        ("diff equal, layouts differ", ["diff", f"{f}/compiled.pt", f"{f}/compiled_ddp.pt"]),
        (
            "diff equal model, .pt vs .safetensors",
            ["diff", f"{f}/ddp_wrapped.pt", f"{f}/ddp_wrapped.safetensors", "--entry", "model"],
        ),
        ("diff other entries differ", ["diff", f"{f}/ddp_wrapped.pt", f"{f}/ddp_plain.pt"]),
        ("diff entries only in A", ["diff", f"{f}/ddp_wrapped.pt", f"{f}/ddp_wrapped.safetensors"]),
        ("diff values differ (|Δ| computed)", ["diff", f"{f}/ddp_rank0.pt", f"{f}/ddp_rank1.pt"]),
        ("merge identical ranks", ["merge", f"{f}/ddp_rank0.pt", f"{f}/ddp_rank0.pt", "-o", out, "--force"]),
        (
            "merge 2 ranks (BN stats averaged)",
            ["merge", f"{f}/ddp_rank0.pt", f"{f}/ddp_rank1.pt", "-o", out, "--force"],
        ),
        (
            "validate (needs the model)",
            ["validate", f"{f}/single.pt", "--model", "ckptfix.trainer.model:build_model"],
        ),
    ]


def run_once(python: str, args: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS in MB and exit status of one ``python -m ckptfix ARGS``."""
    start = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "ckptfix", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, proc.returncode


def imports_torch(python: str, args: list[str], tmp: Path) -> bool:
    flag = tmp / "torch.txt"
    subprocess.run([python, "-c", _PROBE, str(flag), *args], capture_output=True, check=False)
    return flag.read_text().strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--python", default=sys.executable)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"| command | min s of {opts.repeat} | peak RSS MB | exit | imports torch |")
        print("|---|---:|---:|---:|---|")
        for name, args in cases(tmp):
            runs = [run_once(opts.python, args) for _ in range(opts.repeat)]
            best = min(runs)
            torch = imports_torch(opts.python, args, tmp)
            rss = max(r[1] for r in runs)
            print(f"| {name} | {best[0]:.3f} | {rss:.0f} | {best[2]} | {'yes' if torch else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
