"""Benchmark: checkpoint folders (DCP from 2 gloo ranks, DDP and FSDP2; transformers-style safetensors shards) into
one .safetensors or .pt file: `ckptfix convert` against torch's `dcp_to_torch_save`, `accelerate merge-weights` and
`cp -r` + `sync`, side by side in one run.

    python bench/bench_folders.py                 # ~2 GB model, 3 runs each, warm cache
    python bench/bench_folders.py --size-mb 256 --repeat 1
    python bench/bench_folders.py --quick         # tiny, seconds: a smoke test

Each method runs in its own process; wall time includes Python and torch start-up, peak RSS comes from wait4().
ckptfix runs as its console script with its modules compiled first, as installing leaves them (children run
without PYTHONDONTWRITEBYTECODE, so no run pays for compiling ckptfix).
ckptfix and `cp + sync` make their output durable; torch's and accelerate's converters do not (they are timed
as they are, and then with a `sync`).
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
ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(PY).parent / "ckptfix"
CKPTFIX = [str(_SCRIPT)] if _SCRIPT.exists() else [PY, "-m", "ckptfix"]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TORCH_DCP = "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(*sys.argv[1:])"


def _worker(rank: int, store: str, out: str, mode: str, size_mb: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        width = 1024
        layers = max(1, (size_mb << 20) // (width * width * 4))
        model: torch.nn.Module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        if mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        else:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _make(folder: Path, size_mb: int) -> dict[str, Path]:
    subprocess.run([PY, __file__, "--make", str(folder), str(size_mb)], check=True, cwd=ROOT)
    return {"dcp-ddp": folder / "dcp-ddp", "dcp-fsdp2": folder / "dcp-fsdp2", "hf-shards": folder / "hf"}


def _write(folder: Path, size_mb: int) -> None:
    import torch.multiprocessing as mp

    for mode in ("ddp", "fsdp2"):
        out = folder / f"dcp-{mode}"
        mp.start_processes(_worker, args=(str(folder / f"store-{mode}"), str(out), mode, size_mb), nprocs=2,
                           join=True, start_method="fork")  # fmt: skip
    import ckptfix

    state = ckptfix.load(folder / "dcp-ddp")["model"]
    (folder / "hf").mkdir()
    ckptfix.save(state, folder / "hf" / "model.safetensors", shard_size=max(1, size_mb // 4) << 20)


def _run(argv: list[str]) -> tuple[float, int]:
    return measured(argv, env=ENV, cwd=ROOT)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _methods(src: Path, out: Path, kind: str) -> list[tuple[str, list[str]]]:
    ckptfix = [*CKPTFIX, "convert", str(src), str(out / "ckptfix.safetensors"), "--force"]
    if kind.startswith("dcp"):
        ckptfix += ["--model-only", "--entry", "model"]
    methods = [
        ("cp -r + sync", ["sh", "-c", f"cp -r {src} {out / 'copy'} && sync"]),
        ("ckptfix convert → .safetensors", ckptfix),
        # the whole checkpoint, as dcp_to_torch_save writes it
        ("ckptfix convert → .pt", [*CKPTFIX, "convert", str(src), str(out / "ckptfix.pt"), "--force"]),
    ]
    if kind.startswith("dcp"):
        methods.append(("torch dcp_to_torch_save → .pt", [PY, "-c", TORCH_DCP, str(src), str(out / "torch.pt")]))
        methods.append(("  + sync", ["sh", "-c", f"{PY} -c '{TORCH_DCP}' {src} {out / 'torch2.pt'} && sync"]))
        accelerate = shutil.which("accelerate", path=str(Path(PY).parent))
        if accelerate:
            methods.append(("accelerate merge-weights", [accelerate, "merge-weights", str(src), str(out / "acc")]))
    return methods


def _table(folder: Path, inputs: dict[str, Path], repeat: int) -> str:
    lines = ["| input | method | wall s (median) | × cp -r + sync | peak RSS MB |", "|---|---|---:|---:|---:|"]
    for kind, src in inputs.items():
        methods = _methods(src, folder / "out", kind)
        walls: dict[str, list[float]] = {name: [] for name, _ in methods}
        rss: dict[str, int] = dict.fromkeys(walls, 0)
        for _ in range(repeat):  # methods alternate within each round: a slow spell of the disk hits them all
            for name, argv in methods:
                shutil.rmtree(folder / "out", ignore_errors=True)
                (folder / "out").mkdir()
                subprocess.run(["sync"], check=True)  # the last method's write-back is not this one's
                wall, peak = _run(argv)
                walls[name].append(wall)
                rss[name] = max(rss[name], peak)
        base = statistics.median(walls[methods[0][0]])
        for name, _ in methods:
            median = statistics.median(walls[name])
            lines.append(f"| {kind} ({_du(src) / 1e9:.2f} GB) | {name} | {median:.2f} | {median / base:.2f} | "
                         f"{rss[name] / 1e6:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--make", nargs=2, metavar=("DIR", "SIZE_MB"), help="only make the inputs, in DIR")
    parser.add_argument("--inputs", help="time the inputs --make made in this folder instead of making new ones")
    args = parser.parse_args()
    if args.make:
        _write(Path(args.make[0]), int(args.make[1]))
        return
    size_mb, repeat = (16, 1) if args.quick else (args.size_mb, args.repeat)
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "ckptfix")], check=True)  # as installing does
    if args.inputs:  # folders made before by --make (python bench/bench_folders.py --make DIR SIZE_MB)
        made = Path(args.inputs)
        inputs = {"dcp-ddp": made / "dcp-ddp", "dcp-fsdp2": made / "dcp-fsdp2", "hf-shards": made / "hf"}
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            print(f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, inputs in {made}, "
                  f"median of {repeat}, warm cache")  # fmt: skip
            print(_table(Path(tmp), inputs, repeat))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        inputs = _make(folder, size_mb)
        print(f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, {size_mb} MB model, "
              f"median of {repeat}, warm cache")  # fmt: skip
        print(_table(folder, inputs, repeat))


if __name__ == "__main__":
    main()
