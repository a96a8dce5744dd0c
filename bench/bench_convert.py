"""Benchmark: `ckptfix convert` (streaming fast path) against cp and the torch round trip, side by side.

    python bench/bench_convert.py                  # ~2 GB DataParallel checkpoint, 3 runs each, warm cache
    python bench/bench_convert.py --size-mb 500 --cold
    python bench/bench_convert.py --xfs            # on a loop-mounted XFS with reflink (root): blocks shared
    python bench/bench_convert.py --quick          # tiny, seconds: a smoke test

Each method runs in its own process (wall time includes Python and torch start-up, as a user sees it) and its
peak RSS comes from wait4(). ckptfix runs as its console script, as a user types it, with its modules compiled
first, as installing leaves them (children run without PYTHONDONTWRITEBYTECODE: without .pyc files every run
would compile ckptfix, some 0.1 s that no installed copy pays). ``--cold`` evicts the input from the page cache
before each run with posix_fadvise(DONTNEED), which touches only this benchmark's files. ckptfix fsyncs its
output (crash-safe writes), so ``cp + sync`` is the fair reference for ratios; plain ``cp`` is listed too.

Warm runs read inputs the page cache holds as they were written (large folios, here 2 MiB): read back after an
eviction (a ``--cold`` run, ``cp``), the same file sits in 4 KiB pages, and reading it took 1.35x as long (``cat``
98 ms against 72 for 2.1 GB), hashing it mapped on two threads 1.5x. Compare warm tables taken on fresh inputs only.

Methods take turns (one run each per round) so that a slow spell lands on all of them. Cold runs on a machine whose
memory is full of page cache also time the kernel reclaiming it: a bare 1 MiB read loop over the 2.1 GB input took
0.62 to 0.98 s there, 0.63-0.65 s after ``sync; echo 1 > /proc/sys/vm/drop_caches`` (root; it empties the whole
machine's page cache, so the benchmark leaves it to you).

``--xfs`` makes a sparse XFS image (``mkfs.xfs -m reflink=1``) in ``--dir``, attaches it to a loop device with
direct I/O (so the host's page cache does not hold a second copy), mounts it, and always unmounts and detaches
it at the end. Its table adds the blocks each method allocated (free space before and after, from statvfs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from measure import measured  # bench/measure.py, beside this script

PY = sys.executable
_SCRIPT = Path(PY).parent / "ckptfix"
CKPTFIX = [str(_SCRIPT)] if _SCRIPT.exists() else [PY, "-m", "ckptfix"]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
NAIVE = (
    "import sys, torch; sd = torch.load(sys.argv[1], weights_only=True{mmap}); "
    "sd = {{k.removeprefix('module.'): v for k, v in sd.items()}}; torch.save(sd, sys.argv[2])"
)
Method = tuple[str, Path, list[str], Path]  # name, input, argv, output


def _make_inputs(folder: Path, size_mb: int) -> tuple[Path, Path]:
    # In a child process: a parent holding torch would inflate every child's peak RSS (fork copies it).
    subprocess.run([PY, __file__, "--make-inputs", str(folder), str(size_mb)], check=True)
    return folder / "in.pt", folder / "in.safetensors"


def _write_inputs(folder: Path, size_mb: int) -> None:
    import torch

    from ckptfix.formats.registry import save

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


def _used(folder: Path) -> int:
    """Bytes allocated on the file system, once it is done freeing deleted files (XFS frees in the background)."""
    os.sync()
    last, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        s = os.statvfs(folder)
        used = (s.f_blocks - s.f_bfree) * s.f_frsize
        if used == last:
            return used
        last = used
        time.sleep(0.2)
    return last


def _run(argv: list[str], out: Path) -> tuple[float, int]:
    if out.exists():
        out.unlink()
    return measured(argv, env=ENV)


def _measure(
    methods: list[Method], *, repeat: int, cold: bool, blocks: bool
) -> list[tuple[str, float, float, int, int]]:
    """(name, min s, median s, peak RSS, new bytes allocated) per method; the last only with ``blocks``.

    The methods take turns, one run each per round: a slow spell of the disk or the host (the page cache
    reclaiming memory, a neighbour's I/O) then lands on every method instead of on whichever ran during it.
    """
    if not cold:
        for _, _, argv, out in methods:
            _run(argv, out)  # warm-up: inputs and Python/torch in the page cache
    times: dict[str, list[float]] = {name: [] for name, *_ in methods}
    rss = dict.fromkeys(times, 0)
    grew = dict.fromkeys(times, 0)
    for _ in range(repeat):
        for name, src, argv, out in methods:
            if cold:
                _evict(src)
            if out.exists():
                out.unlink()
            before = _used(out.parent) if blocks else 0
            wall, peak = _run(argv, out)
            grew[name] = max(grew[name], _used(out.parent) - before) if blocks else 0
            times[name].append(wall)
            rss[name] = max(rss[name], peak)
    rows = []
    for name, runs in times.items():
        lo, med = min(runs), statistics.median(runs)
        rows.append((name, lo, med, rss[name], grew[name]))
        new = grew[name] >> 20
        print(f"{name}: min {lo:.3f}s median {med:.3f}s rss {rss[name] >> 20} MB new {new} MB", file=sys.stderr)
    return rows


def _header(size: int, size_mb: int, cache: str, repeat: int, where: str) -> str:
    return (
        f"Input: {size / 1e9:.2f} GB DataParallel state dict ({size_mb} MB requested), {cache} page cache, "
        f"{repeat} runs each, {where}; {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}."
    )


def _standard(folder: Path, pt: Path, st: Path, args: argparse.Namespace, size_mb: int, repeat: int) -> str:
    o = folder / "out"
    ckptfix = [*CKPTFIX, "convert", "--force"]
    methods: list[Method] = [
        ("cp", pt, ["cp", str(pt), f"{o}.pt"], Path(f"{o}.pt")),
        ("cp + sync", pt, ["sh", "-c", f'cp "{pt}" "{o}.pt" && sync "{o}.pt"'], Path(f"{o}.pt")),
        ("torch.load → strip → torch.save", pt, [PY, "-c", NAIVE.format(mmap=""), str(pt), f"{o}.pt"], Path(f"{o}.pt")),
        (
            "torch.load(mmap=True) → save",
            pt,
            [PY, "-c", NAIVE.format(mmap=", mmap=True"), str(pt), f"{o}.pt"],
            Path(f"{o}.pt"),
        ),
        ("ckptfix convert pt→pt", pt, [*ckptfix, str(pt), f"{o}.pt"], Path(f"{o}.pt")),
        ("ckptfix convert st→st", st, [*ckptfix, str(st), f"{o}.safetensors"], Path(f"{o}.safetensors")),
        ("ckptfix convert pt→st", pt, [*ckptfix, str(pt), f"{o}.safetensors"], Path(f"{o}.safetensors")),
        ("ckptfix convert st→pt", st, [*ckptfix, str(st), f"{o}.pt"], Path(f"{o}.pt")),
        ("ckptfix convert pt→pt --no-fast", pt, [*ckptfix, "--no-fast", str(pt), f"{o}.pt"], Path(f"{o}.pt")),
    ]
    if args.only:
        methods = [m for m in methods if m[0] in ("cp", "cp + sync") or any(t in m[0] for t in args.only)]
    rows = _measure(methods, repeat=repeat, cold=args.cold, blocks=False)
    base = next(r[1] for r in rows if r[0] == "cp + sync")
    lines = [
        _header(pt.stat().st_size, size_mb, "cold" if args.cold else "warm", repeat, f"in {args.dir}"),
        "",
        "| method | min (s) | median (s) | × cp + sync (min) | peak RSS (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {n} | {lo:.2f} | {med:.2f} | {lo / base:.2f} | {rss / 2**20:.0f} |" for n, lo, med, rss, _ in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def _xfs_mount(folder: Path, size: int) -> Iterator[Path]:
    """A sparse XFS image with reflink on a direct-I/O loop device, mounted; unmounted and detached at the end."""
    if os.name != "posix" or os.geteuid() != 0:
        raise SystemExit("--xfs: skipped, mounting a loop image needs root")
    if shutil.which("mkfs.xfs") is None:
        raise SystemExit("--xfs: skipped, mkfs.xfs not found (Debian/Ubuntu: apt-get install -y xfsprogs)")
    image, mnt = folder / "xfs.img", folder / "xfs"
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    found = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(image)], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--xfs: skipped, no loop device: {found.stderr.strip()}")
    device = found.stdout.strip()
    try:
        mnt.mkdir()
        mounted = subprocess.run(["mount", device, str(mnt)], capture_output=True, text=True)
        if mounted.returncode != 0:
            raise SystemExit(f"--xfs: skipped, cannot mount {device}: {mounted.stderr.strip()}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        subprocess.run(["losetup", "-d", device], check=True)


def _xfs(folder: Path, args: argparse.Namespace, size_mb: int, repeat: int) -> str:
    # inputs, three outputs that cannot share (cp --reflink=never, the round trip, pt→st) and some room
    with _xfs_mount(folder, (size_mb << 20) * 6 + (1 << 30)) as fs:
        pt, st = _make_inputs(fs, size_mb)
        o = fs / "out"
        cli = [*CKPTFIX, "convert", "--force"]
        methods: list[Method] = [
            ("cat IN > /dev/null (read once)", pt, ["sh", "-c", f'cat "{pt}" > /dev/null'], Path(f"{o}.none")),
            ("ckptfix --version (start-up: Python, click)", pt, [*CKPTFIX, "--version"], Path(f"{o}.none")),
            ("cp --reflink=always", pt, ["cp", "--reflink=always", str(pt), f"{o}.pt"], Path(f"{o}.pt")),
            ("cp --reflink=never + sync", pt, ["sh", "-c", f'cp --reflink=never "{pt}" "{o}.pt" && sync "{o}.pt"'],
             Path(f"{o}.pt")),
            ("torch.load → strip → torch.save + sync", pt,
             ["sh", "-c", f'"{PY}" -c "$0" "{pt}" "{o}.pt" && sync "{o}.pt"', NAIVE.format(mmap="")], Path(f"{o}.pt")),
            ("ckptfix convert pt→pt", pt, [*cli, str(pt), f"{o}.pt"], Path(f"{o}.pt")),
            ("ckptfix convert pt→pt --no-verify", pt, [*cli, "--no-verify", str(pt), f"{o}.pt"], Path(f"{o}.pt")),
            ("ckptfix convert st→st (no CRCs to verify)", st, [*cli, str(st), f"{o}.safetensors"],
             Path(f"{o}.safetensors")),
            ("ckptfix convert st→pt (CRCs computed)", st, [*cli, str(st), f"{o}.pt"], Path(f"{o}.pt")),
            ("ckptfix convert pt→st", pt, [*cli, str(pt), f"{o}.safetensors"], Path(f"{o}.safetensors")),
        ]  # fmt: skip
        if args.only:
            kept = ("cat", "ckptfix --version")
            methods = [m for m in methods if m[0].startswith(kept) or any(t in m[0] for t in args.only)]
        rows = _measure(methods, repeat=repeat, cold=args.cold, blocks=True)
        size = pt.stat().st_size
    read = rows[0][1]
    lines = [
        _header(size, size_mb, "cold" if args.cold else "warm", repeat, "on a loop-mounted XFS with reflink"),
        "",
        "| method | min (s) | median (s) | × reading it (min) | peak RSS (MB) | new blocks (MB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {n} | {lo:.3f} | {med:.3f} | {lo / read:.2f} | {rss / 2**20:.0f} | {grew / 1e6:.1f} |"
        for n, lo, med, rss, grew in rows  # three decimals: where blocks are shared, runs take tenths of a second
    ]
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--make-inputs"]:
        _write_inputs(Path(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=2000, help="checkpoint size (default 2000)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (default 3)")
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint, one run: a smoke test")
    parser.add_argument("--cold", action="store_true", help="evict the input from the page cache before each run")
    parser.add_argument("--xfs", action="store_true", help="run on a loop-mounted XFS image with reflink (root)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to put the files (default /tmp)")
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--only", action="append", default=[], help="run only methods containing this text")
    args = parser.parse_args()
    size_mb, repeat = (4, 1) if args.quick else (args.size_mb, args.repeat)
    # Compile ckptfix as installing does, so that no timed run pays for it (cold runs, which have no warm-up, too).
    spec = importlib.util.find_spec("ckptfix")  # the copy the children import: this checkout or site-packages
    for where in (spec.submodule_search_locations or []) if spec else []:
        subprocess.run([PY, "-m", "compileall", "-q", where], check=True)
    folder = Path(tempfile.mkdtemp(prefix="ckptfix-bench-", dir=args.dir))
    try:
        if args.xfs:
            table = _xfs(folder, args, size_mb, repeat)
        else:
            pt, st = _make_inputs(folder, size_mb)
            table = _standard(folder, pt, st, args, size_mb, repeat)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
