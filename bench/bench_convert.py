"""Benchmark: `ckptfix convert` (streaming fast path) against cp and the torch round trip, side by side.

    python bench/bench_convert.py                  # ~2 GB DataParallel checkpoint, 3 runs each, warm cache
    python bench/bench_convert.py --size-mb 500 --cold
    python bench/bench_convert.py --quick          # tiny, seconds: a smoke test

Each method runs in its own process (wall time includes Python and torch start-up, as a user sees it) and its
peak RSS comes from wait4(). ``--cold`` evicts the input from the page cache before each run with
posix_fadvise(DONTNEED), which touches only this benchmark's files. ckptfix fsyncs its output (crash-safe
writes), so ``cp + sync`` is the fair reference for ratios; plain ``cp`` is listed too.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
NAIVE = (
    "import sys, torch; sd = torch.load(sys.argv[1], weights_only=True{mmap}); "
    "sd = {{k.removeprefix('module.'): v for k, v in sd.items()}}; torch.save(sd, sys.argv[2])"
)


def _make_inputs(folder: Path, size_mb: int) -> tuple[Path, Path]:
    # In a child process: a parent holding torch would inflate every child's peak RSS (fork copies it).
    subprocess.run([PY, __file__, "--make-inputs", str(folder), str(size_mb)], check=True)
    return folder / "in.pt", folder / "in.safetensors"


def _write_inputs(folder: Path, size_mb: int) -> None:
    import torch

    from ckptfix.formats import save

    layer = 16 << 20 if size_mb >= 64 else 1 << 18  # bytes per weight, biases and norms beside each
    n = max(1, (size_mb << 20) // layer)
    sd = {}
    for i in range(n):
        sd[f"module.blocks.{i}.weight"] = torch.randn(layer // 4 // 1024, 1024)
        sd[f"module.blocks.{i}.bias"] = torch.randn(1024)
        sd[f"module.blocks.{i}.norm.running_mean"] = torch.zeros(1024)
        sd[f"module.blocks.{i}.norm.num_batches_tracked"] = torch.tensor(7)
    pt, st = folder / "in.pt", folder / "in.safetensors"
    torch.save(sd, pt)
    save(sd, st)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _run(argv: list[str], out: Path) -> tuple[float, int]:
    if out.exists():
        out.unlink()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {err}")
    return wall, usage.ru_maxrss * 1024


def main() -> None:
    if sys.argv[1:2] == ["--make-inputs"]:
        _write_inputs(Path(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=2000, help="checkpoint size (default 2000)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint, one run: a smoke test")
    parser.add_argument("--cold", action="store_true", help="evict the input from the page cache before each run")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to put the files (default /tmp)")
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--only", action="append", default=[], help="run only methods containing this text")
    args = parser.parse_args()
    size_mb, repeat = (4, 1) if args.quick else (args.size_mb, args.repeat)
    folder = Path(tempfile.mkdtemp(prefix="ckptfix-bench-", dir=args.dir))
    ckptfix = [PY, "-m", "ckptfix", "convert"]
    try:
        pt, st = _make_inputs(folder, size_mb)
        o = folder / "out"
        methods = [
            ("cp", pt, ["cp", str(pt), f"{o}.pt"], ".pt"),
            ("cp + sync", pt, ["sh", "-c", f'cp "{pt}" "{o}.pt" && sync "{o}.pt"'], ".pt"),
            ("torch.load → strip → torch.save", pt, [PY, "-c", NAIVE.format(mmap=""), str(pt), f"{o}.pt"], ".pt"),
            (
                "torch.load(mmap=True) → save",
                pt,
                [PY, "-c", NAIVE.format(mmap=", mmap=True"), str(pt), f"{o}.pt"],
                ".pt",
            ),
            ("ckptfix convert pt→pt", pt, [*ckptfix, str(pt), f"{o}.pt"], ".pt"),
            ("ckptfix convert st→st", st, [*ckptfix, str(st), f"{o}.safetensors"], ".safetensors"),
            ("ckptfix convert pt→st", pt, [*ckptfix, str(pt), f"{o}.safetensors"], ".safetensors"),
            ("ckptfix convert st→pt", st, [*ckptfix, str(st), f"{o}.pt"], ".pt"),
            ("ckptfix convert pt→pt --no-fast", pt, [*ckptfix, "--no-fast", str(pt), f"{o}.pt"], ".pt"),
        ]
        if args.only:
            methods = [m for m in methods if m[0] in ("cp", "cp + sync") or any(t in m[0] for t in args.only)]
        rows = []
        for name, src, argv, ext in methods:
            if not args.cold:
                _run(argv, Path(f"{o}{ext}"))  # warm-up: inputs and Python/torch in the page cache
            times, rss = [], 0
            for _ in range(repeat):
                if args.cold:
                    _evict(src)
                wall, peak = _run(argv, Path(f"{o}{ext}"))
                times.append(wall)
                rss = max(rss, peak)
            rows.append((name, min(times), statistics.median(times), rss))
            print(
                f"{name}: min {min(times):.2f}s median {statistics.median(times):.2f}s rss {rss >> 20} MB",
                file=sys.stderr,
            )
        base = next(r[1] for r in rows if r[0] == "cp + sync")
        size = pt.stat().st_size
        cache = "cold" if args.cold else "warm"
        lines = [
            f"Input: {size / 1e9:.2f} GB DataParallel state dict ({size_mb} MB requested), {cache} page cache, "
            f"{repeat} runs each; {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
            f"Python {platform.python_version()}.",
            "",
            "| method | min (s) | median (s) | × cp + sync (min) | peak RSS (MB) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, lo, med, rss in rows:
            lines.append(f"| {name} | {lo:.2f} | {med:.2f} | {lo / base:.2f} | {rss / 2**20:.0f} |")
        table = "\n".join(lines)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
