"""Regenerate ``fixtures/``: real checkpoints from real runs, and ``fixtures/MANIFEST.json`` describing them.

    python -m ckptfix.trainer.fixtures            # writes ./fixtures (about a minute on 2 CPU cores)
    python -m ckptfix.trainer.fixtures --cuda     # on a GPU machine: writes ./fixtures/cuda (seconds)

Each file's manifest record says how it was made (mode, trainer options, torch version), its layout and
format, its sha256, and the model's eval-mode output on :func:`ckptfix.trainer.model.probe_input`. The probe
is computed with plain torch (weights-only ``torch.load``, the known prefix cut off by hand,
``load_state_dict(strict=True)``), independent of ckptfix, so the tests check ckptfix against it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptfix.trainer.config import TrainConfig

MANIFEST = "MANIFEST.json"
COMMAND = "python -m ckptfix.trainer.fixtures"
CUDA_DIR = "cuda"  # fixtures/cuda: torch.save of tensors on a real GPU, made by ``COMMAND --cuda``
# Tiny runs: the fixtures test layouts and formats, not accuracy.
_RUN = ["--epochs", "1", "--samples", "256", "--val-samples", "64", "--batch-size", "32"]
# (file, trainer options, file the run writes, prefix its model keys carry)
_TRAINED: tuple[tuple[str, list[str], str, str], ...] = (
    ("single.pt", ["--mode", "single"], "checkpoint.pt", ""),
    ("dp_plain.pt", ["--mode", "dp"], "checkpoint.pt", ""),
    ("dp_wrapped.pt", ["--mode", "dp", "--save-layout", "wrapped"], "checkpoint.pt", "module."),
    ("ddp_plain.pt", ["--mode", "ddp"], "checkpoint.pt", ""),
)
_WRAPPER_PREFIX = {"compiled": "_orig_mod.", "ddp-compiled": "module._orig_mod.", "compiled-ddp": "_orig_mod.module."}
_CUDA_PREFIX = {"single": "", "ddp": "module.", "compiled": "_orig_mod."}
_DRIFT = ["--mode", "ddp", "--save-layout", "wrapped", "--no-buffer-sync", "--save-per-rank"]


def sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def platform_info() -> dict[str, str]:
    """What decides whether float results repeat bit for bit: torch version, CPU kind and kernels used."""
    import torch

    return {
        "torch": str(torch.__version__),
        "machine": platform.machine(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
    }


def reference_probe(state: dict[str, Any], prefix: str, *, config: TrainConfig | None = None) -> list[float]:
    """The probe output of the reference model holding ``state`` (keys carry ``prefix``), in plain torch."""
    from ckptfix.trainer.model import build_model, probe

    model = build_model(norm=config.norm if config else "batch", width=config.width if config else 8)
    plain = {k[len(prefix) :]: v for k, v in state.items()}
    model.load_state_dict(plain, strict=True)
    return [float(x) for x in probe(model).flatten()]


def _record(path: Path, *, how: dict[str, Any], layout: str, entry: str, probe: list[float]) -> dict[str, Any]:
    fmt = "safetensors" if path.suffix == ".safetensors" else "torch"
    return {
        "made_by": how,
        "layout": layout,
        "format": fmt,
        "entry": entry,
        "bytes": path.stat().st_size,
        "sha256": sha256(path),
        "probe": probe,
    }


def _torch_load(path: Path, **kwargs: Any) -> Any:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True, **kwargs)


def _train(argv: Sequence[str], out: Path) -> None:
    from ckptfix.trainer.config import parse_args
    from ckptfix.trainer.launch import launch_trainer, launcher_args
    from ckptfix.trainer.loop import train

    config = parse_args([*_RUN, *argv, "--out", str(out)])
    if config.mode == "ddp":
        launch_trainer([*_RUN, *argv, "--out", str(out)], launcher_args("2"))
    else:
        train(config)


def _wrapper_states(state: dict[str, Any], scratch: Path) -> dict[str, dict[str, Any]]:
    """State dicts of the real wrappers around a trained model: compile, DDP(compile), compile(DDP)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ckptfix.trainer.model import build_model

    model = build_model()
    model.load_state_dict(state)
    # torch.compile only wraps here: state_dict() never triggers a compilation.
    compiled: Any = torch.compile(model)
    out = {"compiled": dict(compiled.state_dict())}
    store = dist.FileStore(str(scratch / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        out["ddp-compiled"] = dict(DistributedDataParallel(compiled).state_dict())
        compiled_ddp: Any = torch.compile(DistributedDataParallel(model))
        out["compiled-ddp"] = dict(compiled_ddp.state_dict())
    finally:
        dist.destroy_process_group()
    return out


def generate(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Train the runs, write every fixture and the manifest into ``out_dir``; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {}  # each fixture's manifest record, by file name
    loaded: dict[str, Any] = {}  # each trained checkpoint read once, for its probe and the files made from it
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        _write_trained(out, scratch, files, loaded)
        _write_drifted(out, scratch, files, loaded)
        _write_wrapped(out, scratch, files, loaded["single.pt"]["model"])
        _write_resaved(out, files, loaded)
    return _write_manifest(out, command=COMMAND, platform=platform_info(), files=files)


def _write_trained(out: Path, scratch: Path, files: dict[str, Any], loaded: dict[str, Any]) -> None:
    """The checkpoints of the plain training runs (:data:`_TRAINED`), copied as the trainer wrote them."""
    import torch

    for name, argv, written, prefix in _TRAINED:
        run_dir = scratch / name
        _train(argv, run_dir)
        (out / name).write_bytes((run_dir / written).read_bytes())
        loaded[name] = _torch_load(out / name)
        how = {"mode": argv[1], "options": [*_RUN, *argv], "torch": str(torch.__version__)}
        files[name] = _record(
            out / name,
            how=how,
            layout="ddp" if prefix else "single",
            entry="model",
            probe=reference_probe(loaded[name]["model"], prefix),
        )


def _write_drifted(out: Path, scratch: Path, files: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Per-rank files with drifted BatchNorm statistics, saved wrapped as many DDP scripts do."""
    import torch

    drift_dir = scratch / "drift"
    _train(_DRIFT, drift_dir)
    how = {"mode": "ddp", "options": [*_RUN, *_DRIFT], "torch": str(torch.__version__)}
    for name, written in (
        ("ddp_wrapped.pt", "checkpoint.pt"),
        ("ddp_rank0.pt", "checkpoint.rank0.pt"),
        ("ddp_rank1.pt", "checkpoint.rank1.pt"),
    ):
        (out / name).write_bytes((drift_dir / written).read_bytes())
        loaded[name] = _torch_load(out / name)
        files[name] = _record(
            out / name,
            how=how,
            layout="ddp",
            entry="model",
            probe=reference_probe(loaded[name]["model"], "module."),
        )


def _write_wrapped(out: Path, scratch: Path, files: dict[str, Any], single: dict[str, Any]) -> None:
    """The state dicts of the real wrappers (compile, DDP(compile), compile(DDP)) around single.pt's model."""
    import torch

    import ckptfix

    single_how = {"mode": "single", "from": "single.pt", "torch": str(torch.__version__)}
    for layout, state in _wrapper_states(single, scratch).items():
        name = f"{layout.replace('-', '_')}.pt"
        ckptfix.save(state, out / name)
        how = {**single_how, "how": f"state_dict() of the real wrappers ({layout}) around single.pt's model"}
        files[name] = _record(
            out / name, how=how, layout=layout, entry="", probe=reference_probe(state, _WRAPPER_PREFIX[layout])
        )


def _write_resaved(out: Path, files: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Trained checkpoints saved again the ways other tools save them: safetensors, the legacy torch format, the
    ImageNet example's layout."""
    import torch

    import ckptfix
    from ckptfix.formats.output.atomic import atomic_output

    ddp = loaded["ddp_wrapped.pt"]
    name = "ddp_wrapped.safetensors"
    ckptfix.save(dict(ddp["model"]), out / name)
    how = {"mode": "ddp", "from": "ddp_wrapped.pt", "how": "ckptfix.save of its model entry"}
    files[name] = _record(out / name, how=how, layout="ddp", entry="", probe=files["ddp_wrapped.pt"]["probe"])

    # The pre-1.6 torch.save format (not a zip), as old DataParallel scripts wrote it.
    name = "legacy_dp.pt"
    with atomic_output(out / name) as f:
        torch.save(loaded["dp_wrapped.pt"], f, _use_new_zipfile_serialization=False)
    how = {"mode": "dp", "from": "dp_wrapped.pt", "how": "torch.save(..., _use_new_zipfile_serialization=False)"}
    files[name] = _record(out / name, how=how, layout="ddp", entry="model", probe=files["dp_wrapped.pt"]["probe"])

    # The PyTorch ImageNet example's layout: state_dict + args as an argparse.Namespace.
    name = "namespace_args.pt"
    args = argparse.Namespace(arch="ckptfix-cnn", lr=0.05, batch_size=32, epochs=1, workers=0)
    obj = {"epoch": ddp["epoch"], "arch": "ckptfix-cnn", "state_dict": ddp["model"], "best_acc1": 0.5}
    obj |= {"optimizer": ddp["optimizer"], "args": args}
    with atomic_output(out / name) as f:
        torch.save(obj, f)
    how = {"mode": "ddp", "from": "ddp_wrapped.pt", "how": "ImageNet-example layout, args=argparse.Namespace"}
    files[name] = _record(out / name, how=how, layout="ddp", entry="state_dict", probe=files["ddp_wrapped.pt"]["probe"])
    files[name]["allow_globals"] = ["argparse.Namespace"]


def _write_manifest(out: Path, *, command: str, platform: dict[str, str], files: dict[str, Any]) -> dict[str, Any]:
    from ckptfix.formats.output.atomic import atomic_output

    manifest = {
        "command": command,
        "platform": platform,
        "model": "ckptfix.trainer.model:build_model",
        "probe_input": "ckptfix.trainer.model:probe_input",
        "files": dict(sorted(files.items())),
    }
    with atomic_output(out / MANIFEST) as f:
        f.write((json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def storage_locations(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many storages of a .pt file carry each device tag, as plain torch reads them (on the CPU)."""
    import torch

    seen: dict[str, int] = {}

    def where(storage: Any, location: str) -> Any:
        seen[location] = seen.get(location, 0) + 1
        return storage

    torch.load(path, map_location=where, weights_only=True)
    return seen


def _cuda_states(state: dict[str, Any], scratch: Path) -> dict[str, tuple[str, Any]]:
    """What torch.save is given on a GPU, by fixture name: (layout, object)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ckptfix.trainer.model import build_model, probe_input

    torch.cuda.set_device(0)
    model = build_model().cuda()
    model.load_state_dict(state)
    # One real optimizer step on the GPU: momentum buffers on cuda:0, the RNG states beside them on the CPU.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(probe_input().cuda()).logsumexp(1).mean().backward()
    optimizer.step()
    full = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}
    full |= {"rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state()}
    out: dict[str, tuple[str, Any]] = {"cuda_full.pt": ("single", full)}
    out["cuda_dp.pt"] = ("ddp", torch.nn.DataParallel(model, device_ids=[0]).state_dict())
    compiled: Any = torch.compile(model)  # wraps only: state_dict() compiles nothing
    out["cuda_compiled.pt"] = ("compiled", dict(compiled.state_dict()))
    store = dist.FileStore(str(scratch / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        out["cuda_ddp.pt"] = ("ddp", {"model": DistributedDataParallel(model, device_ids=[0]).state_dict()})
    finally:
        dist.destroy_process_group()
    return out


def generate_cuda(out_dir: str | os.PathLike[str], *, source: str | os.PathLike[str]) -> dict[str, Any]:
    """On a GPU: ``source`` (fixtures/single.pt) trained one step on cuda:0 and saved by torch.save as a plain,
    DataParallel, compiled and DDP (NCCL) model, plus one in torch's legacy format; with a manifest."""
    import torch

    from ckptfix.formats.output.atomic import atomic_output

    if not torch.cuda.is_available():
        raise SystemExit(f"{COMMAND} --cuda: needs a CUDA GPU (torch.cuda.is_available() is False)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        states = _cuda_states(_torch_load(Path(source))["model"], Path(tmp))
    states["cuda_legacy_dp.pt"] = states["cuda_dp.pt"]
    for name, (layout, obj) in states.items():
        legacy = name == "cuda_legacy_dp.pt"
        with atomic_output(out / name) as f:
            torch.save(obj, f, **({"_use_new_zipfile_serialization": False} if legacy else {}))
        entry = "model" if "model" in obj else ""
        on_cpu = _torch_load(out / name)
        how = {"mode": "single", "from": Path(source).name, "torch": str(torch.__version__)}
        how["how"] = f"torch.save on {torch.cuda.get_device_name(0)}" + (" (legacy format)" if legacy else "")
        files[name] = _record(
            out / name,
            how=how,
            layout=layout,
            entry=entry,
            probe=reference_probe(on_cpu[entry] if entry else on_cpu, _CUDA_PREFIX[layout]),
        )
        files[name]["locations"] = storage_locations(out / name)
    gpu = {"gpu": torch.cuda.get_device_name(0), "cuda": str(torch.version.cuda)}
    return _write_manifest(out, command=f"{COMMAND} --cuda", platform={**platform_info(), **gpu}, files=files)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Regenerate the checkpoint fixtures.")
    parser.add_argument("--out", default=None, help="folder to write (default: ./fixtures, ./fixtures/cuda)")
    parser.add_argument("--cuda", action="store_true", help="on a GPU: the CUDA-saved fixtures from fixtures/single.pt")
    ns = parser.parse_args(argv)
    if ns.cuda:
        ns.out = ns.out or f"fixtures/{CUDA_DIR}"
        manifest = generate_cuda(ns.out, source="fixtures/single.pt")
    else:
        ns.out = ns.out or "fixtures"
        manifest = generate(ns.out)
    total = sum(f["bytes"] for f in manifest["files"].values())
    print(f"wrote {len(manifest['files'])} fixtures ({total / 1024:.0f} KiB) and {MANIFEST} to {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
