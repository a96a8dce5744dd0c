"""Benchmark: a Megatron-Core ``torch_dist`` folder (TP 2, bf16) into one .safetensors file, one .pt file and a
transformers folder (``--format hf``: Llama names, QKV and gate/up split) with ``ckptfix convert``, against
``cp -r`` + ``sync`` of the folder and Megatron's own conversion on the CPU (its ``dist_checkpointing.load`` into
a TP=1, PP=1 ``GPTModel``, then ``save_file`` of its ``state_dict()``).

    python bench/bench_megatron.py --make DIR --mcore mcore-venv/bin/python   # ~1.2 GB run, then measure
    python bench/bench_megatron.py --inputs DIR --mcore mcore-venv/bin/python # a run made before

The run is Megatron-Core's own (``tests/megatron_runs.py``, the ``bench_tp2_bf16`` run, ``--size`` scaling the
fixtures' model): a GPTModel trained ``steps`` steps on 2 gloo ranks on the CPU and saved by
``dist_checkpointing.save``. megatron-core is no dependency of ckptfix: ``--mcore`` names the Python of a venv that
has it (without it, Megatron's own row is left out). Each method runs in its own process (peak RSS from wait4,
wall time with start-up); the methods take turns within each round; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import measured  # bench/measure.py, beside this script

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
RUN = "bench_tp2_bf16"
SIZE = "hidden=2048,layers=10,ffn=5632,vocab=32000,heads=16,groups=4,steps=1"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _largest(folder: Path) -> int:
    """The largest tensor of the converted model, in bytes (from the metadata: nothing read)."""
    sys.path.insert(0, str(ROOT))
    from ckptfix.formats.megatron.reader import describe

    return max(t.nbytes for t in describe(str(folder)).state.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", type=Path, help="make the run in this folder first")
    parser.add_argument("--inputs", type=Path, help="a folder --make filled before")
    parser.add_argument("--mcore", help="the Python of a venv with megatron-core")
    parser.add_argument("--size", default=SIZE)
    parser.add_argument("--repeat", type=int, default=3)
    a = parser.parse_args()
    base = a.make or a.inputs
    if base is None:
        raise SystemExit("pass --make DIR (and --mcore PYTHON) or --inputs DIR")
    src = base / RUN
    if a.make is not None and not src.is_dir():
        if a.mcore is None:
            raise SystemExit("--make needs --mcore: the Python of a venv with megatron-core")
        base.mkdir(parents=True, exist_ok=True)
        env = dict(ENV, PYTHONPATH=str(ROOT))
        subprocess.run([a.mcore, "-m", "tests.megatron_runs", str(base), "--run", RUN, "--size", a.size], check=True,
                       cwd=ROOT, env=env)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-megatron-", dir=base))
    methods: dict[str, list[str]] = {
        "cp -r + sync": ["sh", "-c", f'cp -r "{src}" "{work}/copy" && sync'],
        "ckptfix convert → .safetensors": [PY, "-m", "ckptfix", "convert", str(src), str(work / "out.safetensors")],
        "ckptfix convert → .pt": [PY, "-m", "ckptfix", "convert", str(src), str(work / "out.pt")],
        "ckptfix convert → HF folder (--format hf)": [PY, "-m", "ckptfix", "convert", str(src), str(work / "hf"),
                                                      "--format", "hf"],
    }  # fmt: skip
    if a.mcore is not None:  # Megatron's own: load into a TP=1, PP=1 model, save_file its state_dict (then sync)
        own = f'"{a.mcore}" -m tests.megatron_runs "{work}" --run {RUN} --role expected --size "{a.size}" && sync'
        methods["Megatron load (TP1/PP1) + save_file + sync"] = ["sh", "-c", own]
        shutil.copytree(src, work / RUN)  # the role reads WORK/RUN and writes WORK/RUN.expected.safetensors
    env = dict(ENV, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, list[int]] = {m: [] for m in methods}
    try:
        for _ in range(a.repeat):
            for name, argv in methods.items():
                for p in (work / "copy", work / "out.safetensors", work / "out.pt", work / "hf"):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                with socket.socket() as sock:  # Megatron's one rank joins its process group on a free port
                    sock.bind(("127.0.0.1", 0))
                    env["MASTER_PORT"] = str(sock.getsockname()[1])
                wall, rss = measured(argv, env=env, cwd=ROOT)
                times[name].append(wall)
                peaks[name].append(rss)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size, largest = _du(src), _largest(src)
    print(f"Input: {size / 1e9:.2f} GB Megatron-Core torch_dist folder ({RUN}, --size {a.size}), largest tensor "
          f"{largest / 1e6:.0f} MB, warm page cache, {a.repeat} runs each; {platform.machine()}, {os.cpu_count()} "
          f"CPUs, Python {platform.python_version()}.\n")  # fmt: skip
    cp = min(times["cp -r + sync"])
    print("| method | min (s) | median (s) | × cp -r + sync (min) | peak RSS (MB) |")
    print("|---|---:|---:|---:|---:|")
    for name in methods:
        t = times[name]
        print(f"| {name} | {min(t):.2f} | {statistics.median(t):.2f} | {min(t) / cp:.2f} | "
              f"{max(peaks[name]) / 1e6:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
