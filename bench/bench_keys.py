"""Benchmark: how `ckptfix convert` (and `ckptfix.load`) scale with the number of tensors, beside torch.

    python bench/bench_keys.py                          # 1k, 10k, 100k tensors (a few minutes)
    python bench/bench_keys.py --sizes 1000000          # 1M tensors: the torch round trips take many minutes
    python bench/bench_keys.py --sizes 1000 --only convert   # ckptfix rows only

The input is the worst case for per-key costs: N tiny tensors, ``{f"module.layer{i}.weight": torch.zeros(2)}``,
saved by ``torch.save`` (.pt) and by ``safetensors.torch.save_file`` (.safetensors). Every method runs in its
own process; wall time includes Python start-up, peak RSS comes from wait4(); medians of ``--repeat`` runs.
"µs/key" is wall time over N; "µs/key past start-up" subtracts the same command on a one-tensor file, which is
what grows with N. ckptfix's modules are compiled first and the children run without PYTHONDONTWRITEBYTECODE, as
an installed copy runs (without .pyc files every run would compile ckptfix: 0.04 s of a 0.06 s start-up).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import measured  # bench/measure.py, beside this script

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
MAKE = (
    "import sys, torch; from safetensors.torch import save_file; n = int(sys.argv[1]); "
    "sd = {f'module.layer{i}.weight': torch.zeros(2) for i in range(n)}; "
    "torch.save(sd, sys.argv[2]); save_file(sd, sys.argv[3])"
)
STRIP = "sd = {k.removeprefix('module.'): v for k, v in sd.items()}; "
TORCH = {
    "pt→pt": "import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
    + STRIP
    + "torch.save(sd, sys.argv[2])",
    "pt→st": "import sys, torch; from safetensors.torch import save_file; sd = torch.load(sys.argv[1], "
    "weights_only=True); " + STRIP + "save_file(sd, sys.argv[2])",
    "st→st": "import sys; from safetensors.torch import load_file, save_file; sd = load_file(sys.argv[1]); "
    + STRIP
    + "save_file(sd, sys.argv[2])",
    "st→pt": "import sys, torch; from safetensors.torch import load_file; sd = load_file(sys.argv[1]); "
    + STRIP
    + "torch.save(sd, sys.argv[2])",
    "load .pt": "import sys, torch; torch.load(sys.argv[1], weights_only=True)",
}
TORCH_NAME = {
    "pt→pt": "torch.load → torch.save",
    "pt→st": "torch.load → safetensors save_file",
    "st→st": "safetensors load_file → save_file",
    "st→pt": "safetensors load_file → torch.save",
    "load .pt": "torch.load(weights_only=True)",
}
CKPTFIX_LOAD = "import sys, ckptfix; ckptfix.load(sys.argv[1])"


def _run(argv: list[str]) -> tuple[float, int]:
    return measured(argv, env=ENV)


def _median(argv: list[str], out: Path | None, repeat: int) -> tuple[float, int]:
    walls, peak = [], 0
    for _ in range(repeat):
        if out is not None and out.exists():
            out.unlink()
        wall, rss = _run(argv)
        walls.append(wall)
        peak = max(peak, rss)
    return statistics.median(walls), peak


def _commands(pt: Path, st: Path, o: Path) -> dict[str, tuple[list[str], list[str], Path | None]]:
    """Per operation: the ckptfix command, the torch command and the output they write."""
    ins = {"pt→pt": (pt, ".pt"), "pt→st": (pt, ".safetensors"), "st→st": (st, ".safetensors"), "st→pt": (st, ".pt")}
    out: dict[str, tuple[list[str], list[str], Path | None]] = {}
    for op, (src, ext) in ins.items():
        dst = o.with_suffix(ext)
        mine = [PY, "-m", "ckptfix", "convert", str(src), str(dst), "--force"]
        out[op] = (mine, [PY, "-c", TORCH[op], str(src), str(dst)], dst)
    out["load .pt"] = ([PY, "-c", CKPTFIX_LOAD, str(pt)], [PY, "-c", TORCH["load .pt"], str(pt)], None)
    return out


def _inputs(folder: Path, n: int) -> tuple[Path, Path]:
    pt, st = folder / f"in{n}.pt", folder / f"in{n}.safetensors"
    if not pt.exists():
        subprocess.run([PY, "-c", MAKE, str(n), str(pt), str(st)], check=True)  # a child: no torch in this process
    return pt, st


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000], help="tensor counts")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method (the median is reported)")
    parser.add_argument("--only", choices=["convert", "torch"], help="run only ckptfix's or only torch's rows")
    parser.add_argument("--ops", nargs="+", default=["pt→pt", "pt→st", "st→st", "st→pt", "load .pt"])
    parser.add_argument("--dir", type=Path, default=None, help="where to write inputs and outputs (default: /tmp)")
    args = parser.parse_args()
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "ckptfix")], check=True)  # as installing does
    with tempfile.TemporaryDirectory(prefix="ckptfix-keys-", dir=args.dir) as tmp:
        folder = Path(tmp)
        pt1, st1 = _inputs(folder, 1)
        start_up = {
            op: _median(ck, out, max(args.repeat, 3))[0]
            for op, (ck, _, out) in _commands(pt1, st1, folder / "o").items()
        }
        print(f"start-up (one tensor): {start_up}", file=sys.stderr)
        lines = [
            f"N tiny tensors (`torch.zeros(2)` each), warm page cache, median of {args.repeat}; {platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}.",
            "",
            "| tensors | operation | ckptfix s | µs/key | µs/key past start-up | peak RSS MB | torch equivalent "
            "| torch s | torch µs/key | torch RSS MB | ckptfix / torch |",
            "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        ]
        for n in args.sizes:
            pt, st = _inputs(folder, n)
            for op, (ck, tc, out) in _commands(pt, st, folder / "o").items():
                if op not in args.ops:
                    continue
                mine = _median(ck, out, args.repeat) if args.only != "torch" else (float("nan"), 0)
                theirs = _median(tc, out, args.repeat) if args.only != "convert" else (float("nan"), 0)
                marginal = (mine[0] - start_up[op]) / n * 1e6
                row = (
                    f"| {n:,} | {op} | {mine[0]:.2f} | {mine[0] / n * 1e6:.1f} | {marginal:.1f} | "
                    f"{mine[1] / 2**20:.0f} | {TORCH_NAME[op]} | {theirs[0]:.2f} | {theirs[0] / n * 1e6:.1f} | "
                    f"{theirs[1] / 2**20:.0f} | {mine[0] / theirs[0]:.2f}× |"
                )
                print(f"{row}  load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                lines.append(row)
            pt.unlink()
            st.unlink()
        print("\n".join(lines))


if __name__ == "__main__":
    main()
