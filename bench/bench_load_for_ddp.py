"""Every rank calling torch.load versus ckptfix.load_for_ddp: wall time, bytes read, peak memory per rank.

    python bench/bench_load_for_ddp.py --size-mb 300 --procs 2 3 4 --out bench/load_for_ddp.md

Each run starts fresh processes on a gloo group (127.0.0.1, a FileStore in a temp folder), builds a model of
about ``--size-mb`` on every rank, evicts the checkpoint from the page cache (posix_fadvise DONTNEED, so that
``read_bytes`` counts real disk reads), then times the load on every rank after a barrier. Per rank it records:
``read_bytes`` and ``rchar`` from /proc/self/io (disk reads; bytes through read() calls, which mmap bypasses),
and peak RSS (getrusage) above the RSS with the model built. The Markdown table reports the wall time of the
slowest rank, the sums of bytes over ranks, and the source's and the largest receiver's peak.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

METHODS = ("torch.load", "torch.load(mmap)", "load_for_ddp")
LAYER = 1024  # a Linear(1024, 1024) layer holds 4 MiB of float32 weights


def build(size_mb: float) -> Any:
    import torch
    from torch import nn

    layers = max(1, round(size_mb * 2**20 / (LAYER * LAYER * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(LAYER, LAYER) for _ in range(layers)])
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(os.getpid() % 7))  # touch every page, so the model is in the baseline RSS
    return model


def _io() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = int(value)
    return fields


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def worker(rank: int, world: int, tmp: str, method: str, size_mb: float, bucket_mb: float) -> None:
    import torch
    import torch.distributed as dist

    import ckptfix

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, f"store-{method}-{world}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    model = build(size_mb)
    path = Path(tmp) / "ckpt.pt"
    if rank == 0:
        _evict(path)
    dist.barrier()
    base_rss, io_before = _rss_kib(), _io()
    start = time.perf_counter()
    if method == "load_for_ddp":
        ckptfix.load_for_ddp(model, path, bucket_mb=bucket_mb)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=method.endswith("(mmap)"))
        model.load_state_dict(state)
        del state
    seconds = time.perf_counter() - start
    io_after = _io()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier()
    result = {
        "seconds": seconds,
        "read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
        "rchar": io_after["rchar"] - io_before["rchar"],
        "peak_over_base": max(0, peak_kib - base_rss) * 1024,
    }
    (Path(tmp) / f"r-{method}-{world}-{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def run(tmp: Path, method: str, world: int, size_mb: float, bucket_mb: float) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, str(tmp), method, size_mb, bucket_mb)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{method} with {world} processes failed: exit codes {[p.exitcode for p in procs]}")
    return [pickle.loads((tmp / f"r-{method}-{world}-{r}.pkl").read_bytes()) for r in range(world)]


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=300)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    parser.add_argument("--dir", type=Path, default=None, help="folder for the checkpoint (default: a temp folder)")
    args = parser.parse_args(argv)

    import torch

    with tempfile.TemporaryDirectory(dir=args.dir) as name:
        tmp = Path(name)
        model = build(args.size_mb)
        torch.save(model.state_dict(), tmp / "ckpt.pt")
        file_size = (tmp / "ckpt.pt").stat().st_size
        del model
        rows = [
            f"Checkpoint: {_mb(file_size)} MiB (float32 Linear layers), bucket {args.bucket_mb:g} MiB, gloo on "
            f"127.0.0.1, {os.cpu_count()} CPU cores, torch {torch.__version__}. Bytes are summed over ranks; "
            f"peaks are RSS above each rank's RSS with its own model built.",
            "",
            "| ranks | method | wall s (slowest rank) | read_bytes MiB | rchar MiB | src peak +MiB | "
            "max receiver peak +MiB |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for world in args.procs:
            for method in args.methods:
                results = run(tmp, method, world, args.size_mb, args.bucket_mb)
                row = (
                    f"| {world} | {method} | {max(r['seconds'] for r in results):.2f} | "
                    f"{_mb(sum(r['read_bytes'] for r in results))} | {_mb(sum(r['rchar'] for r in results))} | "
                    f"{_mb(results[0]['peak_over_base'])} | {_mb(max(r['peak_over_base'] for r in results[1:]))} |"
                )
                rows.append(row)
                print(row, flush=True)
    table = "\n".join(rows) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(table)


if __name__ == "__main__":
    sys.exit(main())
