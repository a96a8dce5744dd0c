"""Benchmark: a `.pt` checkpoint with its optimizer into a DCP folder and back: `ckptfix convert` against torch's
`torch_save_to_dcp` and `dcp_to_torch_save`, and `cp` + `sync` of the same bytes, wall time and peak RSS.

    python bench/bench_to_dcp.py                   # ~1.5 GB: 0.5 GB model, AdamW's two moments; 3 runs each
    python bench/bench_to_dcp.py --quick           # tiny, one run: a smoke test
    python bench/bench_to_dcp.py --before /work/main/.venv/bin/python   # adds an older checkout's row
    python bench/bench_to_dcp.py --only ckptfix --repeat 5                # cp + sync and ckptfix alone

The input is a real training checkpoint: ``{"model": model.state_dict(), "optimizer": AdamW's state_dict(), "epoch"}``
after one step, saved by ``torch.save``. Each method runs in its own process (start-up included, as a user sees it)
with a warm page cache, the methods taking turns (one run each per round: a slow spell of the shared disk lands on
all of them); peak RSS comes from wait4 (bench/measure.py). ckptfix and torch's writer both fsync what they write,
so `cp` + `sync` is the reference for the ratio. ``--before PYTHON`` adds a row for ``PYTHON -m ckptfix`` (another
checkout's venv: the route before the torch-free writer).
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
from pathlib import Path

from measure import measured  # bench/measure.py, beside this script

PY = sys.executable
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TORCH_TO_DCP = (
    "import sys, warnings; warnings.simplefilter('ignore'); "
    "from torch.distributed.checkpoint.format_utils import torch_save_to_dcp as f; f(*sys.argv[1:])"
)
TORCH_FROM_DCP = TORCH_TO_DCP.replace("torch_save_to_dcp", "dcp_to_torch_save")


def _write_input(path: Path, layers: int, width: int) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--make-input":  # in a child: torch stays out of the parent
        _write_input(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="Linear layers (default 32)")
    parser.add_argument("--width", type=int, default=2048, help="their width (default 2048: 16 MiB a weight)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint, one run: a smoke test")
    parser.add_argument("--before", help="a Python whose ckptfix is the one to compare with (another checkout's)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to put the files (default /tmp)")
    parser.add_argument("--only", action="append", default=[], help="run only methods containing this text")
    args = parser.parse_args()
    layers, width, repeat = (2, 256, 1) if args.quick else (args.layers, args.width, args.repeat)
    work = Path(tempfile.mkdtemp(prefix="bench-to-dcp-", dir=args.dir))
    try:
        src = work / "in.pt"
        subprocess.run([PY, __file__, "--make-input", str(src), str(layers), str(width)], check=True)
        print(_table(work, src, args.before, repeat, only=args.only))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _table(work: Path, src: Path, before: str | None, repeat: int, *, only: list[str]) -> str:
    out = work / "out"
    methods = [
        ("`cp` + `sync`", ["sh", "-c", f'cp "{src}" "{out}.pt" && sync "{out}.pt"']),
        ("`ckptfix convert in.pt out/`", [PY, "-m", "ckptfix", "convert", str(src), f"{out}/"]),
        ("torch `torch_save_to_dcp`", [PY, "-c", TORCH_TO_DCP, str(src), str(out)]),
    ]
    if before:
        methods.append(("… before (torch's writer, meta tensors)", [before, "-m", "ckptfix", "convert", str(src),
                                                                    f"{out}/"]))  # fmt: skip
    into = _timed(work, _only(methods, only), repeat)
    # and back: torch's own DCP folder of the same checkpoint into one file
    folder = work / "in_dcp"
    subprocess.run([PY, "-c", TORCH_TO_DCP, str(src), str(folder)], check=True, env=ENV)
    back = [
        ("`cp -r` + `sync`", ["sh", "-c", f'cp -r "{folder}" "{out}" && sync "{out}"']),
        ("`ckptfix convert in/ out.pt`", [PY, "-m", "ckptfix", "convert", f"{folder}/", f"{out}.pt"]),
        ("torch `dcp_to_torch_save`", [PY, "-c", TORCH_FROM_DCP, str(folder), f"{out}.pt"]),
    ]
    if before:
        back.append(("… before", [before, "-m", "ckptfix", "convert", f"{folder}/", f"{out}.pt"]))
    size = sum(f.stat().st_size for f in folder.iterdir())
    lines = [
        f"Input: {src.stat().st_size / 1e9:.2f} GB `.pt` (model and AdamW state), warm page cache, median of "
        f"{repeat}; {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
        f"{platform.python_version()}.",
        "",
        *into,
        "",
        f"Back: torch's DCP folder of the same checkpoint ({size / 1e9:.2f} GB) into one `.pt`.",
        "",
        *_timed(work, _only(back, only), repeat),
    ]
    return "\n".join(lines)


def _only(methods: list[tuple[str, list[str]]], only: list[str]) -> list[tuple[str, list[str]]]:
    if not only:
        return methods
    return [m for i, m in enumerate(methods) if i == 0 or any(t in m[0] for t in only)]  # the reference stays


def _timed(work: Path, methods: list[tuple[str, list[str]]], repeat: int) -> list[str]:
    """The methods' rows (the first is the reference), each run in turn ``repeat`` times after a warm-up round."""
    out = work / "out"
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    rss = dict.fromkeys(times, 0)
    for round_ in range(repeat + 1):  # the first round warms the page cache and Python's files: not counted
        for name, argv in methods:
            shutil.rmtree(out, ignore_errors=True)
            Path(f"{out}.pt").unlink(missing_ok=True)
            wall, peak = measured(argv, env=ENV, cwd=work)  # not a checkout: -m finds the venv's ckptfix
            if round_:
                times[name].append(wall)
                rss[name] = max(rss[name], peak)
    reference = methods[0][0]
    base = statistics.median(times[reference])
    lines = [f"| method | wall s (median) | × {reference} | peak RSS MB |", "|---|---:|---:|---:|"]
    for name, runs in times.items():
        med = statistics.median(runs)
        lines.append(f"| {name} | {med:.2f} | {med / base:.2f} | {rss[name] >> 20} |")
        print(f"{name}: {', '.join(f'{t:.2f}' for t in runs)} s, {rss[name] >> 20} MB", file=sys.stderr)
    return lines


if __name__ == "__main__":
    main()
