"""The end-to-end demo: train in single, DataParallel and 2-process DDP modes, then move every checkpoint
to every layout and format and load it into a plain and a wrapped model.

    python -m ckptfix.demo [--out DIR]

Prints one row per (source, target): whether the converted file loads strictly into a plain model and into
an ``nn.DataParallel``-wrapped one, the largest difference of the model's outputs on the validation set from
the model as trained, and its accuracy. Exits 1 if any row fails (a load error or any output difference).
About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ckptfix.errors import CkptfixError
from ckptfix.transforms import layouts

if TYPE_CHECKING:
    import torch

TARGETS = tuple(name for name in layouts.TARGETS if name != "dp")  # dp is an alias of ddp's key layout
FORMATS = (".pt", ".safetensors")
# The runs: the wrapped layout for dp and ddp is what many real scripts save, and what breaks loading.
RUNS: tuple[tuple[str, list[str]], ...] = (
    ("single", ["--mode", "single"]),
    ("dp", ["--mode", "dp", "--save-layout", "wrapped"]),
    ("ddp", ["--mode", "ddp", "--save-layout", "wrapped", "--scale-lr", "--warmup-epochs", "0.5"]),
)


@dataclass
class Row:
    source: str
    target: str
    plain: str = "-"
    wrapped: str = "-"
    delta: float = float("nan")
    accuracy: float = float("nan")

    @property
    def ok(self) -> bool:
        return self.plain == "ok" and self.wrapped == "ok" and self.delta == 0.0


def _train_all(out: Path, *, epochs: int, samples: int) -> dict[str, Path]:
    from ckptfix.trainer.config import parse_args
    from ckptfix.trainer.launch import launch_trainer, launcher_args
    from ckptfix.trainer.loop import CHECKPOINT_NAME, train

    common = ["--epochs", str(epochs), "--samples", str(samples), "--val-samples", "256"]
    checkpoints = {}
    for name, argv in RUNS:
        run_argv = [*argv, *common, "--out", str(out / "runs" / name)]
        print(f"== training: {name} ({' '.join(argv)})", flush=True)
        if name == "ddp":
            launch_trainer(run_argv, launcher_args("2"))
        else:
            train(parse_args(run_argv))
        checkpoints[name] = out / "runs" / name / CHECKPOINT_NAME
    return checkpoints


def _outputs(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    import torch

    model.eval()
    with torch.no_grad():
        result: torch.Tensor = model(images)
    return result


def _reference(path: Path, images: torch.Tensor) -> torch.Tensor:
    """Outputs of the model as trained, loaded with plain torch (the wrapper prefix cut off by hand)."""
    import torch

    from ckptfix.trainer.model import build_model

    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    if all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    model = build_model()
    model.load_state_dict(state, strict=True)
    return _outputs(model, images)


def _try_load(path: Path, *, wrap: bool, images: torch.Tensor) -> tuple[str, torch.Tensor | None]:
    from torch import nn

    import ckptfix
    from ckptfix.trainer.model import build_model

    model = build_model()
    target = nn.DataParallel(model) if wrap else model
    try:
        ckptfix.load_into(target, path, strict=True)
    except CkptfixError as e:
        return f"FAIL: {e}", None
    # DataParallel moved the model to cuda:0 on a GPU machine; the reference ran on the CPU, and float kernels
    # differ between devices in the last bits, so the outputs are compared where the reference was made.
    return "ok", _outputs(model.cpu(), images)


def _check(source: str, path: Path, out: Path, images: torch.Tensor, labels: torch.Tensor) -> list[Row]:
    from ckptfix.conversion.files import convert_file

    reference = _reference(path, images)
    rows = []
    for target in TARGETS:
        for ext in FORMATS:
            row = Row(source, f"{target}{ext}")
            dst = out / "converted" / f"{source}-to-{target}{ext}"
            try:
                # safetensors holds tensors only: the model entry goes alone.
                convert_file(  # --out DIR may hold a previous run's files: the demo's own, replaced
                    path, dst, to=cast("layouts.Layout", target), model_only=ext == ".safetensors", overwrite=True
                )
            except CkptfixError as e:
                row.plain = row.wrapped = f"FAIL: {e}"
                rows.append(row)
                continue
            deltas = []
            for wrap in (False, True):
                status, outputs = _try_load(dst, wrap=wrap, images=images)
                setattr(row, "wrapped" if wrap else "plain", status)
                if outputs is not None:
                    deltas.append(float((outputs - reference).abs().max()))
                    row.accuracy = float((outputs.argmax(1) == labels).float().mean())
            row.delta = max(deltas) if deltas else float("nan")
            rows.append(row)
    return rows


def render(rows: Sequence[Row], *, rich: bool) -> None:
    """Print the results table (rich on a terminal, plain text otherwise)."""
    header: tuple[str, ...] = ("source", "target", "plain load", "wrapped load", "max |Δ output|", "accuracy", "result")
    cells: list[tuple[str, ...]] = [
        (r.source, r.target, r.plain, r.wrapped, f"{r.delta:.3g}", f"{r.accuracy:.3f}", "ok" if r.ok else "FAIL")
        for r in rows
    ]
    if rich:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="ckptfix demo: every checkpoint to every layout and format")
        for name in header:
            table.add_column(name, overflow="fold")
        for line in cells:
            style = None if line[-1] == "ok" else "bold red"
            table.add_row(*line, style=style)
        Console().print(table)
        return
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    rule = tuple("-" * w for w in widths)
    for line in [header, rule, *cells]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def run(out: Path, *, epochs: int = 3, samples: int = 1024) -> list[Row]:
    """Train, convert, load and compare; returns the rows."""
    from ckptfix.trainer.data import VAL_SEED, make_images

    checkpoints = _train_all(out, epochs=epochs, samples=samples)
    (out / "converted").mkdir(parents=True, exist_ok=True)
    images, labels = make_images(256, seed=VAL_SEED)
    rows: list[Row] = []
    for source, path in checkpoints.items():
        rows += _check(source, path, out, images, labels)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptfix.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="keep runs and converted files here (default: a temp dir)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per training run")
    parser.add_argument("--samples", type=int, default=1024, help="training set size")
    ns = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if ns.out is None:
            with tempfile.TemporaryDirectory(prefix="ckptfix-demo-") as tmp:
                rows = run(Path(tmp), epochs=ns.epochs, samples=ns.samples)
        else:
            rows = run(Path(ns.out), epochs=ns.epochs, samples=ns.samples)
    except CkptfixError as e:
        print(f"ckptfix.demo: error: {e}", file=sys.stderr)
        return e.exit_code
    render(rows, rich=sys.stdout.isatty())
    failed = [r for r in rows if not r.ok]
    took = time.perf_counter() - started
    print(f"{len(rows) - len(failed)}/{len(rows)} rows ok in {took:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    from ckptfix.torchcompat import without_numpy_warning

    without_numpy_warning()
    sys.exit(main())
