"""Benchmark: how every ckptfix command scales with the file size, beside the torch code that does the same.

    python bench/bench_sizes.py                         # 0.1 GB, 3 runs each: a minute
    python bench/bench_sizes.py --sizes 0.1 1 10        # the README table (10 GB needs ~35 GB of free disk)
    python bench/bench_sizes.py --sizes 1 --ops inspect validate --repeat 5

Inputs are state dicts of ``Linear(2048, 2048, bias=False)`` weights (16 MiB each, float32) written in torch.save's
layout (the same zip records, the same pickle torch writes for them) as sparse files: the tensor bytes are holes,
read back as zeros, so a 10 GB input takes no disk and no time to make; only what an operation writes is real.
``b.pt`` differs from ``a.pt`` in its first tensor (for ``diff``); ``a2.pt`` equals ``a.pt`` (the second rank of
``merge``). Every method runs in its own process, as a user runs it (wall time includes Python and torch
start-up); peak RSS is the child's ``ru_maxrss`` from wait4() (mapped file pages a process touched count too).
Outputs are fsynced on both sides (ckptfix always does; the torch rows call ``os.fsync``), and deleted after each
run. Runs alternate ckptfix / torch; the table shows medians.

| operation | ckptfix | torch equivalent |
|---|---|---|
| convert .pt | ``ckptfix convert a.pt o.pt --to ddp`` | ``torch.load`` → add ``module.`` → ``torch.save`` + fsync |
| convert .safetensors | ``ckptfix convert a.pt o.safetensors --to ddp`` | ``torch.load`` → ``save_file`` + fsync |
| inspect | ``ckptfix inspect a.pt`` | ``torch.load(mmap=True)``, keys, shapes, dtypes, sizes |
| validate | ``ckptfix validate a.pt --model …`` | build the model, ``torch.load(mmap=True)``, ``load_state_dict`` |
| diff | ``ckptfix diff a.pt b.pt`` | ``torch.load(mmap=True)`` both, ``torch.equal`` per key, max abs diff where not |
| merge | ``ckptfix merge a.pt a2.pt -o m.pt`` | ``torch.load(mmap=True)`` both, average, ``torch.save`` + fsync |
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import OrderedDict
from pathlib import Path

PY = sys.executable
_SCRIPT = Path(PY).parent / "ckptfix"
CKPTFIX = [str(_SCRIPT)] if _SCRIPT.exists() else [PY, "-m", "ckptfix"]
DIM = 2048
TENSOR = DIM * DIM * 4  # bytes per weight
ONES = b"\x00\x00\x80\x3f" * (DIM * DIM)  # float32 1.0: the tensor b.pt has where a.pt has zeros

MODEL = f'''
import torch
from torch import nn


def build(layers: int) -> nn.Module:
    """The model the benchmark's checkpoints are the state dict of (allocated, not initialised: both sides pay
    the same and neither pays for random numbers)."""
    return nn.Sequential(*[nn.Linear({DIM}, {DIM}, bias=False, device="meta") for _ in range(layers)]).to_empty(
        device="cpu"
    )
'''

_SYNC = "import os\ndef synced(path):\n    fd = os.open(path, os.O_RDONLY)\n    os.fsync(fd)\n    os.close(fd)\n"
TORCH = {
    "convert .pt": _SYNC + "import sys, torch\n"
    "sd = torch.load(sys.argv[1], weights_only=True)\n"
    "sd = {'module.' + k: v for k, v in sd.items()}\n"
    "torch.save(sd, sys.argv[2]); synced(sys.argv[2])\n",
    "convert .safetensors": _SYNC + "import sys, torch\nfrom safetensors.torch import save_file\n"
    "sd = torch.load(sys.argv[1], weights_only=True)\n"
    "save_file({'module.' + k: v for k, v in sd.items()}, sys.argv[2]); synced(sys.argv[2])\n",
    "inspect": "import sys, torch\n"
    "sd = torch.load(sys.argv[1], weights_only=True, mmap=True)\n"
    "print(len(sd), sum(t.numel() * t.element_size() for t in sd.values()))\n"
    "for k, t in sd.items(): print(k, tuple(t.shape), t.dtype)\n",
    "validate": "import sys, json, torch, sizes_model\n"
    "model = sizes_model.build(**json.loads(sys.argv[2]))\n"
    "sd = torch.load(sys.argv[1], weights_only=True, mmap=True)\n"
    "model.load_state_dict(sd, strict=True)\n",
    "diff": "import sys, torch\n"
    "a = torch.load(sys.argv[1], weights_only=True, mmap=True)\n"
    "b = torch.load(sys.argv[2], weights_only=True, mmap=True)\n"
    "print(sorted(set(a) ^ set(b)))\n"
    "for k in a.keys() & b.keys():\n"
    "    if not torch.equal(a[k], b[k]): print(k, (a[k].double() - b[k].double()).abs().max().item())\n",
    "merge": _SYNC + "import sys, torch\n"
    "sds = [torch.load(p, weights_only=True, mmap=True) for p in sys.argv[2:]]\n"
    "out = {k: sum(sd[k] for sd in sds) / len(sds) for k in sds[0]}\n"
    "torch.save(out, sys.argv[1]); synced(sys.argv[1])\n",
}
OPS = tuple(TORCH)


def write_sparse_checkpoint(path: Path, layers: int, *, first: bytes | None = None) -> None:
    """A state dict of ``layers`` weights in torch.save's zip layout, each tensor's bytes a hole (zeros).

    ``first``: the real bytes of tensor 0 (``b.pt`` of the diff). Uses ckptfix's own torch-zip writer (the one its
    .safetensors → .pt conversion writes with), so the file is what torch.save would write, sparse.
    """
    from ckptfix.formats.pickles import pickling
    from ckptfix.formats.torchzip.archive import ZipWriter
    from ckptfix.formats.torchzip.reader import HEAD, TAIL, stand_ins, tensor_record

    glob = stand_ins()
    tree = OrderedDict(
        (f"{i}.weight", tensor_record("float32", (DIM, DIM), str(i), TENSOR, glob=glob)) for i in range(layers)
    )
    pkl = pickling.dump(tree)
    zero_crc = zlib.crc32(bytes(TENSOR))
    prefix = f"{path.stem}/"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writer = ZipWriter(fd)
        writer.add(prefix + "data.pkl", pkl, zlib.crc32(pkl))
        for name, data in HEAD:
            writer.add(prefix + name, data, zlib.crc32(data))
        for i in range(layers):
            offset = writer.begin(f"{prefix}data/{i}", TENSOR)
            if i == 0 and first is not None:
                os.pwrite(fd, first, offset)
            writer.end(zero_crc if i or first is None else zlib.crc32(first))
        for name, data in TAIL:
            writer.add(prefix + name, data, zlib.crc32(data))
        writer.add(prefix + ".data/serialization_id", b"0" * 40, zlib.crc32(b"0" * 40))
        writer.finish()
    finally:
        os.close(fd)


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()  # before wait4: a child must not block on a full pipe
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):  # diff exits 1 when the files differ, as asked
        raise SystemExit(f"{' '.join(argv)} exited {code}: {err.strip()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def _commands(folder: Path, layers: int) -> dict[str, tuple[list[str], list[str], Path | None]]:
    """Per operation: the ckptfix command, the torch command and the output both write (deleted after a run)."""
    a, a2, b = folder / "a.pt", folder / "a2.pt", folder / "b.pt"
    kwargs = json.dumps({"layers": layers})
    o_pt, o_st = folder / "o.pt", folder / "o.safetensors"

    def torch(op: str, *args: Path | str) -> list[str]:
        return [PY, "-c", TORCH[op], *map(str, args)]

    return {
        "convert .pt": (
            [*CKPTFIX, "convert", str(a), str(o_pt), "--to", "ddp", "--force"],
            torch("convert .pt", a, o_pt),
            o_pt,
        ),
        "convert .safetensors": (
            [*CKPTFIX, "convert", str(a), str(o_st), "--to", "ddp", "--force"],
            torch("convert .safetensors", a, o_st),
            o_st,
        ),
        "inspect": ([*CKPTFIX, "inspect", str(a)], torch("inspect", a), None),
        "validate": (
            [*CKPTFIX, "validate", str(a), "--model", "sizes_model:build", "--kwargs", kwargs],
            torch("validate", a, kwargs),
            None,
        ),
        "diff": ([*CKPTFIX, "diff", str(a), str(b)], torch("diff", a, b), None),
        "merge": ([*CKPTFIX, "merge", str(a), str(a2), "-o", str(o_pt), "--force"], torch("merge", o_pt, a, a2), o_pt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1], help="checkpoint sizes in GB (10^9 bytes)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method (the median is reported)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--dir", type=Path, default=None, help="where inputs and outputs go (default: the temp dir)")
    args = parser.parse_args()
    rows = [
        "| size | operation | ckptfix s | ckptfix peak RSS MB | torch s | torch peak RSS MB | ckptfix / torch (time) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="ckptfix-sizes-", dir=args.dir) as tmp:
        folder = Path(tmp)
        (folder / "sizes_model.py").write_text(MODEL)
        # children import ckptfix and the model from here; .pyc files are kept, as an install would have them
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")]))
        for size in args.sizes:
            layers = max(1, round(size * 1e9 / TENSOR))
            write_sparse_checkpoint(folder / "a.pt", layers)
            write_sparse_checkpoint(folder / "a2.pt", layers)
            write_sparse_checkpoint(folder / "b.pt", layers, first=ONES)
            gb = (folder / "a.pt").stat().st_size / 1e9
            for op, (mine, theirs, out) in _commands(folder, layers).items():
                if op not in args.ops:
                    continue
                runs: dict[str, list[tuple[float, int]]] = {"ckptfix": [], "torch": []}
                for _ in range(args.repeat):
                    for who, argv in (("ckptfix", mine), ("torch", theirs)):
                        runs[who].append(_run(argv, env))
                        if out is not None and out.exists():
                            out.unlink()
                (cw, cr), (tw, tr) = ((statistics.median(w for w, _ in r), max(m for _, m in r)) for r in runs.values())
                load = os.getloadavg()[0]
                row = (
                    f"| {gb:.2f} GB | {op} | {cw:.2f} | {cr / 2**20:.0f} | {tw:.2f} | {tr / 2**20:.0f} | "
                    f"{cw / tw:.2f}× |"
                )
                print(f"{row}  load {load:.1f}", file=sys.stderr, flush=True)
                rows.append(row)
            for name in ("a.pt", "a2.pt", "b.pt"):
                (folder / name).unlink()
    print(
        f"Sparse inputs of 16 MiB float32 weights, warm page cache, median of {args.repeat} (peak RSS: the largest); "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}.\n"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
