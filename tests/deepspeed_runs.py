"""Real DeepSpeed ZeRO checkpoints for the tests: a small model trained for one step on 2 gloo ranks (CPU), then
``engine.save_checkpoint``. ``python -m tests.deepspeed_runs OUT --stage 3 --dtype fp16`` makes one run folder.

The model has what the consolidation must get right: a frozen layer (not in the optimizer: ZeRO-2/3 save it
apart), a weight tied to another (saved once, named in ``shared_params``), two parameter groups, odd sizes (every
partition padded), and buffers (BatchNorm statistics in fp32 runs; DeepSpeed casts the parameters of a bf16 or
fp16 run but keeps the buffers fp32, and CPU ``batch_norm`` has no kernel for half-precision weights beside fp32
statistics, so those runs use LayerNorm and a buffer of their own). Each rank is a process of its own
(``subprocess``), joined through a TCP store on a free port of 127.0.0.1.

fp16 on the CPU: DeepSpeed's CPU accelerator reports fp16 as supported only where oneDNN has fp16 kernels
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16 CPUs); elsewhere ``initialize``
raises "Type fp16 is not supported on your device." torch's own CPU kernels run fp16 Embedding, Linear and
LayerNorm on any CPU, so fp16 runs report it supported (``FP16_PATCH``); nothing else is touched: the engine, the
ZeRO optimizer, its dynamic loss scaler and ``save_checkpoint`` are DeepSpeed's own, and so are the files.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_run(out: Path, *, stage: int, dtype: str = "fp32", world: int = 2, width: int = 0, layers: int = 0,
             timeout: float = 600.0) -> Path:  # fmt: skip
    """Train and save one run into ``out`` (``out/latest``, ``out/global_step1/…``); returns ``out``.

    ``width`` and ``layers`` > 0 make a wide model of ``layers`` square ``Linear(width, width)`` instead (the
    benchmark's), no frozen or tied weights."""
    cmd = ["-m", "tests.deepspeed_runs", str(out), "--stage", str(stage), "--dtype", dtype, "--worker",
           "--width", str(width), "--layers", str(layers)]  # fmt: skip
    launch(cmd, world=world, done=out, what=f"deepspeed run (stage {stage}, {dtype})", timeout=timeout)
    return out


def launch(args: list[str], *, world: int, done: Path, what: str, timeout: float = 600.0) -> None:
    """``python {args}`` once per rank, each a process of its own (DeepSpeed reads its rank from the environment),
    joined on a free port of 127.0.0.1; each rank touches ``{done}.done{rank}`` when its work is over.

    gloo's threads can outlive a rank's process group and abort its exit ("terminate called without an active
    exception", pytorch/pytorch#190489) after the rank is done, as :func:`tests.resume_runs.run_ranks` also
    allows: only a rank that had not finished, or that ended any other way, is a failure of the run."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, *args], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]  # fmt: skip
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        finished = Path(f"{done}.done{rank}").exists()
        if p.returncode and not (p.returncode == -signal.SIGABRT and finished):
            raise RuntimeError(
                f"{what} failed (rank {rank}, exit {p.returncode}):\n" + "\n".join(o[-4000:] for o in outputs)
            )


FP16_PATCH = (
    "deepspeed.accelerator.get_accelerator().is_fp16_supported reports True (DeepSpeed's CPU accelerator says so "
    "only on CPUs with oneDNN fp16 kernels; torch's CPU kernels run the model in fp16 on any CPU)"
)


def _report_fp16_supported() -> None:
    """FP16_PATCH, for this process only (the MANIFEST records what DeepSpeed's own check says on the machine)."""
    from deepspeed.accelerator import get_accelerator

    # the instance's, not the class's: supported_dtypes() and engine._do_sanity_check() ask it through self
    get_accelerator().is_fp16_supported = lambda: True


def _worker(out: Path, *, stage: int, dtype: str, width: int, layers: int) -> None:
    import deepspeed
    import torch
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    if dtype == "fp16":
        _report_fp16_supported()
    torch.manual_seed(0)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(17, 7)
            self.body = nn.Linear(7, 9)
            self.norm: nn.Module = nn.LayerNorm(9) if half else nn.BatchNorm1d(9)
            self.frozen = nn.Linear(9, 7)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(7, 17, bias=False)
            self.head.weight = self.embed.weight  # tied: one parameter under two names
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.frozen(self.norm(self.body(self.embed(ids)))))  # type: ignore[no-any-return]

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)  # type: ignore[no-any-return]

    model: nn.Module = Wide() if width else Net()
    if width:
        groups = [{"params": list(model.parameters())}]
    else:
        decay = [model.embed.weight, model.body.weight]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and n not in ("embed.weight", "body.weight")]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.05)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if dtype == "fp16":  # only here: the config is saved in every module file, and the fp32/bf16 runs stay as they were
        # dynamic loss scaling (its state is saved) from 2**4: the default 2**16 overflows fp16 gradients at step 1,
        # and DeepSpeed would skip that step, leaving no optimizer state to consolidate
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if width:
        x = torch.randn(2, width, dtype=half or torch.float32)
        loss = engine(x).float().square().mean()
    else:
        ids = torch.randint(0, 17, (2, 5)) if not isinstance(model.norm, nn.BatchNorm1d) else torch.randint(0, 17, (2,))
        loss = engine(ids).float().square().mean()
    engine.backward(loss)
    engine.step()
    if not engine.was_step_applied():
        raise RuntimeError(f"the step was skipped (loss scale {engine.optimizer.cur_scale}): nothing trained")
    engine.save_checkpoint(str(out))
    # ranks leave together, the process group torn down: a ZeRO-3 rank exiting with gloo's threads alive was seen to
    # abort ("terminate called without an active exception") after its files were complete
    rank = deepspeed.comm.get_rank()
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    Path(f"{out}.done{rank}").touch()  # this rank's work is over: what launch() asks of a rank that aborts on exit


RUNS = [(stage, dtype) for stage in (1, 2, 3) for dtype in ("fp32", "bf16", "fp16")]


def reference(run: Path) -> dict[str, object]:
    """DeepSpeed's own consolidation of ``run`` (its ``get_fp32_state_dict_from_zero_checkpoint``), quietly."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(run)))


MANIFEST = "MANIFEST.json"


def make_fixtures(out: Path) -> None:
    """fixtures/deepspeed/: one run per stage and dtype (without DeepSpeed's copied scripts) and, beside each,
    DeepSpeed's own consolidation of it (``<run>.expected.pt``) for the tests that run without DeepSpeed; then
    ``MANIFEST.json``.

    Bytes repeat from run to run except ZeRO-3's padding: the last rank's flat partition ends in ``torch.empty``
    padding that DeepSpeed never writes, so those files (and the consolidation's storage) differ in bytes only."""
    import shutil

    import torch

    out.mkdir(parents=True, exist_ok=True)
    for stage, dtype in RUNS:
        run = out / f"zero{stage}_{dtype}"
        shutil.rmtree(run, ignore_errors=True)
        make_run(run, stage=stage, dtype=dtype)
        for script in run.glob("*.py"):
            script.unlink()
        torch.save(reference(run), out / f"zero{stage}_{dtype}.expected.pt")
    write_manifest(out)


def _run_record(stage: int, dtype: str) -> dict[str, object]:
    return {"stage": stage, "dtype": dtype, "world_size": 2, "steps": 1,
            "patched": [FP16_PATCH] if dtype == "fp16" else []}  # fmt: skip


def write_manifest(out: Path) -> None:
    """``out/MANIFEST.json``: how the runs were made (versions, the fp16 patch) and every file's checksum."""
    import json
    import platform

    import deepspeed
    import torch

    from ckptfix.trainer.fixtures import platform_info, sha256

    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "command": "python -m tests.deepspeed_runs fixtures/deepspeed --fixtures",
        "platform": {
            **platform_info(),
            "deepspeed": deepspeed.__version__,
            "python": platform.python_version(),
            # what DeepSpeed's CPU accelerator asks before it allows fp16: where True, FP16_PATCH changed nothing
            "onednn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        },
        "runs": {f"zero{stage}_{dtype}": _run_record(stage, dtype) for stage, dtype in RUNS},
        "files": {p.relative_to(out).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--fixtures", action="store_true", help="make every stage and dtype into OUT (fixtures)")
    args = parser.parse_args()
    if args.fixtures:
        make_fixtures(args.out)
    elif args.worker:
        _worker(args.out, stage=args.stage, dtype=args.dtype, width=args.width, layers=args.layers)
    else:
        make_run(args.out, stage=args.stage, dtype=args.dtype, world=args.world, width=args.width, layers=args.layers)


if __name__ == "__main__":
    main()
