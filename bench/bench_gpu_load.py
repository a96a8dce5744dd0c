"""Loading a checkpoint into a model already on the GPU: torch, safetensors and ckptfix.load_into side by side.

    python bench/bench_gpu_load.py --gb 1.6 4.3 --rounds 3 --out gpu_load.md

For each size, a model of ``Linear(4096, 4096, bias=False)`` layers (64 MiB of float32 each) is saved once as
``.pt`` (torch.save) and ``.safetensors``, read once so the page cache holds both (warm runs), and then loaded by
each method in a fresh process, the methods taking turns for ``--rounds`` rounds. Each process builds the model on
the GPU first (not timed), then times the load to a ready model (``torch.cuda.synchronize``), and reports its peak
host RSS above the RSS before the load (VmHWM, reset before the load) and its peak GPU memory above the model's own
(``max_memory_allocated``). The loaded weights are checked against the file. Runs on the CPU too (``--device
cpu``), for the same table without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

METHODS = {
    "torch.load(cuda, mmap) + load_state_dict": "torch_device",
    "torch.load(cpu, mmap) + load_state_dict": "torch_cpu",
    "safetensors load_file(cuda) + load_state_dict": "st_device",
    "ckptfix.load_into(.pt)": "ckptfix_pt",
    "ckptfix.load_into(.safetensors)": "ckptfix_st",
}
WIDTH = 4096


def _model(layers: int, device: str) -> Any:
    import torch
    from torch import nn

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    return model.to_empty(device=device)


def _status(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    # VmHWM restarts from the RSS now (Linux 4.0+). getrusage's ru_maxrss cannot be reset, and an exec'd child
    # starts with its parent's peak: it would report the parent's memory, not the load's.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(method: str, folder: str, layers: int, device: str) -> dict[str, float]:
    """One load in this process; returns seconds, peak host and device bytes above the start."""
    import torch

    import ckptfix

    pt, st = os.path.join(folder, "model.pt"), os.path.join(folder, "model.safetensors")
    model = _model(layers, device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_gpu = torch.cuda.memory_allocated() if cuda else 0
    _reset_peak()
    base_rss = _status("VmRSS")
    started = time.perf_counter()
    if method == "torch_device":
        model.load_state_dict(torch.load(pt, map_location=device, mmap=True, weights_only=True))
    elif method == "torch_cpu":
        model.load_state_dict(torch.load(pt, map_location="cpu", mmap=True, weights_only=True))
    elif method == "st_device":
        from safetensors.torch import load_file

        model.load_state_dict(load_file(st, device=device))
    elif method == "ckptfix_pt":
        ckptfix.load_into(model, pt)
    elif method == "ckptfix_st":
        ckptfix.load_into(model, st)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak_rss = _status("VmHWM") - base_rss
    peak_gpu = (torch.cuda.max_memory_allocated() - base_gpu) if cuda else 0
    from safetensors import safe_open

    with safe_open(st, framework="pt") as f:  # first and last layer as the file holds them
        for index in (0, layers - 1):
            want = f.get_tensor(f"{index}.weight")
            if not torch.equal(model[index].weight.detach().cpu(), want):
                raise SystemExit(f"{method}: layer {index} differs from the file")
    return {"seconds": seconds, "rss": max(0, peak_rss), "gpu": peak_gpu}


def make_files(folder: Path, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    model = _model(layers, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1, 1, generator=generator)
    state = model.state_dict()
    torch.save(state, folder / "model.pt")
    save_file(state, str(folder / "model.safetensors"))
    for name in ("model.pt", "model.safetensors"):  # warm: both files in the page cache
        with open(folder / name, "rb") as f:
            while f.read(1 << 26):
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[1.6], help="model sizes in GB (10^9 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp folder)")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "FOLDER", "LAYERS"), help=argparse.SUPPRESS)
    parser.add_argument("--make", nargs=2, metavar=("FOLDER", "LAYERS"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.make:
        make_files(Path(ns.make[0]), int(ns.make[1]))
        return 0
    if ns.child:
        print(json.dumps(child(ns.child[0], ns.child[1], int(ns.child[2]), ns.device)))
        return 0
    import torch

    gpu = torch.cuda.get_device_name() if ns.device.startswith("cuda") else "CPU"
    lines = [
        f"Loading into a model already on {ns.device} ({gpu}), warm page cache, a fresh process per load, "
        f"median of {ns.rounds} (min in brackets); torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}.",
        "",
        "| model | method | time to a ready model | GB/s | peak host RSS above start | peak GPU memory above model |",
        "|---|---|---|---|---|---|",
    ]
    for gb in ns.gb:
        layers = max(1, round(gb * 1e9 / (WIDTH * WIDTH * 4)))
        with tempfile.TemporaryDirectory(prefix="ckptfix-gpu-load-", dir=ns.dir) as tmp:
            # in a process of its own: this one stays small while it starts the loads
            maker = [sys.executable, __file__, "--make", tmp, str(layers)]
            subprocess.run(maker, check=True, timeout=600)
            size = os.path.getsize(os.path.join(tmp, "model.pt"))
            results: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
            for _ in range(ns.rounds):
                for name, method in METHODS.items():
                    args = ["--child", method, tmp, str(layers), "--device", ns.device]
                    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=600)
                    if out.returncode != 0:
                        print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                        return 1
                    results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for name, runs in results.items():
                times = [r["seconds"] for r in runs]
                median = statistics.median(times)
                lines.append(
                    f"| {size / 1e9:.2f} GB | {name} | {median:.3f} s ({min(times):.3f}) | {size / median / 1e9:.1f} "
                    f"| {max(r['rss'] for r in runs) / 1e6:,.0f} MB | {max(r['gpu'] for r in runs) / 1e6:,.0f} MB |"
                )
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if ns.out:
        Path(ns.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
