"""Benchmark: a DeepSpeed ZeRO-3 bf16 run folder into one .safetensors file: `ckptfix convert` against DeepSpeed's
own `zero_to_fp32.py` (the script it copies beside every checkpoint) and `cp -r` + `sync` of the folder, in one run;
and into a DCP folder, streamed and (``--no-fast``) loaded whole into memory first.

    python bench/bench_deepspeed.py                      # ~2 GB run folder, 3 rounds, warm cache
    python bench/bench_deepspeed.py --layers 4 --repeat 1  # small, a smoke test
    python bench/bench_deepspeed.py --inputs DIR         # a run made before (bench/bench_deepspeed.py --make DIR)

The run is real: a model of ``--layers`` ``Linear(--width, --width)`` trained one step by DeepSpeed (CPU
accelerator, 2 gloo ranks, ZeRO-3, bf16, AdamW) and saved by ``engine.save_checkpoint``: per rank a module file
of placeholders and an optimizer file with the fp32 master partition and Adam's two moments (12 bytes a
parameter), so the folder is 3× the consolidated model. Needs ``pip install ckptfix[deepspeed]``.

Then ``--shard-size 500MB`` and ``--dtype bf16`` conversions (streamed), each beside the torch path that
loads the whole model (``--no-fast``, what they took before they streamed); ``--plain`` leaves those rows out.

Each method runs in its own process (peak RSS from wait4, wall time with start-up); the methods take turns within
each round; the median is reported. ckptfix and ``cp`` + ``sync`` make their output durable; ``zero_to_fp32.py``
does not, so it is timed as it is and then with a ``sync``.
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
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"DS_ACCELERATOR": "cpu"}


def _run(argv: list[str]) -> tuple[float, int]:
    return measured(argv, env=ENV)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make(folder: Path, *, width: int, layers: int) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.deepspeed_runs import make_run

    run = folder / "zero3_bf16"
    if not (run / "latest").exists():
        shutil.rmtree(run, ignore_errors=True)
        make_run(run, stage=3, dtype="bf16", width=width, layers=layers, timeout=3600)
    return run


def methods(run: Path, out: Path, *, options: bool) -> list[tuple[str, list[str], Path]]:
    script = run / "zero_to_fp32.py"  # DeepSpeed's own, copied beside the checkpoint by save_checkpoint
    z2f = [PY, str(script), str(run), str(out / "z2f"), "--safe_serialization", "--max_shard_size", "100GB"]
    rows = [
        ("`cp -r` + `sync`", ["sh", "-c", f"cp -r {run} {out / 'copy'} && sync"], out / "copy"),
        ("`ckptfix convert run/ model.safetensors`", [*CKPTFIX, "convert", str(run), str(out / "m.safetensors")],
         out / "m.safetensors"),
        ("`ckptfix convert run/ out/` (DCP folder, streamed)", [*CKPTFIX, "convert", str(run), f"{out / 'dcp'}/"],
         out / "dcp"),
        ("… `--no-fast` (DCP folder, loaded in memory: before)",
         [*CKPTFIX, "convert", "--no-fast", str(run), f"{out / 'dcp-mem'}/"], out / "dcp-mem"),
        ("`zero_to_fp32.py --safe_serialization`", z2f, out / "z2f"),
        ("… + `sync`", ["sh", "-c", " ".join(z2f) + " && sync"], out / "z2f"),
    ]  # fmt: skip
    if not options:
        return rows
    # --shard-size and --dtype stream as the plain conversion does; --no-fast is the torch path they took before
    shards = [*CKPTFIX, "convert", str(run), f"{out / 'shards'}/", "--shard-size", "500MB"]
    half = [*CKPTFIX, "convert", str(run), str(out / "bf16.safetensors"), "--dtype", "bf16"]
    return [
        *rows,
        ("`ckptfix convert run/ shards/ --shard-size 500MB`", shards, out / "shards"),
        ("… `--shard-size 500MB --no-fast` (the torch path)", [*shards, "--no-fast"], out / "shards"),
        ("`ckptfix convert run/ model.safetensors --dtype bf16`", half, out / "bf16.safetensors"),
        ("… `--dtype bf16 --no-fast` (the torch path)", [*half, "--no-fast"], out / "bf16.safetensors"),
    ]


def table(run: Path, out: Path, repeat: int, *, options: bool = True) -> str:
    todo = methods(run, out, options=options)
    for _, argv, dst in todo:  # warm-up: the folder, Python, torch and DeepSpeed in the page cache
        shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
        _run(argv)
    times: dict[str, list[float]] = {name: [] for name, *_ in todo}
    rss = dict.fromkeys(times, 0)
    for _ in range(repeat):
        for name, argv, dst in todo:
            shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
            subprocess.run(["sync"], check=True)  # the last method's write-back is not this one's
            wall, peak = _run(argv)
            times[name].append(wall)
            rss[name] = max(rss[name], peak)
            print(f"{name}: {wall:.2f} s, {peak >> 20} MB", file=sys.stderr)
    base = statistics.median(times[todo[0][0]])
    size, model = _du(run / (run / "latest").read_text().strip()), (out / "m.safetensors").stat().st_size
    lines = [
        f"ZeRO-3 bf16 run folder of 2 ranks, {size / 1e9:.2f} GB (model {model / 1e9:.2f} GB in fp32); median of "
        f"{repeat}, warm page cache; {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        "| method | wall s | × `cp -r` + `sync` | peak RSS MB |",
        "|---|---:|---:|---:|",
    ]
    for name, *_ in todo:
        med = statistics.median(times[name])
        lines.append(f"| {name} | {med:.2f} | {med / base:.2f} | {rss[name] >> 20} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=40, help="40 × Linear(2048, 2048): a 2.0 GB run folder")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--inputs", type=Path, help="a folder --make wrote before")
    parser.add_argument("--make", type=Path, help="only make the run folder here")
    parser.add_argument("--plain", action="store_true", help="leave out the --shard-size and --dtype rows")
    args = parser.parse_args()
    if args.make:
        print(make(args.make, width=args.width, layers=args.layers))
        return
    with tempfile.TemporaryDirectory(prefix="bench-deepspeed-", dir=os.environ.get("BENCH_DIR")) as tmp:
        folder = args.inputs or Path(tmp)
        run = make(folder, width=args.width, layers=args.layers)
        out = Path(tmp) / "out"
        out.mkdir()
        print(table(run, out, args.repeat, options=not args.plain))


if __name__ == "__main__":
    main()
