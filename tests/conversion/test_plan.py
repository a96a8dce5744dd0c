"""The one plan per conversion (ckptfix.conversion.plan): the route each input and output take, or why torch does."""

from __future__ import annotations

import pytest

from ckptfix.conversion.plan import (
    DESCRIBE,
    STREAM_FILE,
    STREAM_TENSORS,
    TENSORS_TO_TORCH,
    TO_DCP,
    TORCH,
    Plan,
    plan_conversion,
    plan_reading,
)

UNSAFE = "the unsafe option runs the file's pickle, which only torch.load does"


@pytest.mark.parametrize(
    ("in_fmt", "out_fmt", "options", "route"),
    [
        ("torch-zip", "torch", {}, STREAM_FILE),
        ("torch-zip", "safetensors", {}, STREAM_FILE),
        ("safetensors", "torch", {}, STREAM_FILE),
        ("folder", "safetensors", {}, STREAM_TENSORS),
        ("folder", "torch", {}, TENSORS_TO_TORCH),
        ("safetensors", "safetensors", {"dtype": "bfloat16"}, STREAM_TENSORS),
        ("torch-zip", "safetensors", {"sharded": True}, STREAM_TENSORS),
        ("safetensors", "torch", {"dtype": "float16"}, TENSORS_TO_TORCH),
        ("torch-zip", "dcp", {}, TO_DCP),
        ("torch-zip", "dcp", {"dtype": "bfloat16"}, TO_DCP),
        ("folder", "dcp", {}, TO_DCP),
    ],
)
def test_stream_routes(in_fmt: str, out_fmt: str, options: dict[str, object], route: str) -> None:
    plan = plan_conversion(in_fmt=in_fmt, out_fmt=out_fmt, **options)  # type: ignore[arg-type]
    assert plan == Plan(route) and plan.streams and plan.reason is None


@pytest.mark.parametrize(
    ("in_fmt", "out_fmt", "options", "reason"),
    [
        ("torch-zip", "torch", {"fast": False}, "the torch path was asked for"),
        ("torch-zip", "torch", {"dtype": "float16"}, "casting to float16 needs torch"),
        ("torch-zip", "torch", {"unsafe": True}, UNSAFE),
        ("torch-legacy", "safetensors", {}, "the input is a legacy (pre-1.6, not zip) torch file"),
        ("torch-zip", "torch", {"sharded": True}, "shards are written one by one from the loaded checkpoint"),
        ("torch-legacy", "safetensors", {"sharded": True}, "shards are written one by one from the loaded checkpoint"),
        # the first reason that holds is the one given
        ("torch-legacy", "torch", {"fast": False, "unsafe": True}, "the torch path was asked for"),
    ],
)
def test_torch_route_says_why(in_fmt: str, out_fmt: str, options: dict[str, object], reason: str) -> None:
    plan = plan_conversion(in_fmt=in_fmt, out_fmt=out_fmt, **options)  # type: ignore[arg-type]
    assert plan == Plan(TORCH, reason) and not plan.streams


@pytest.mark.parametrize(
    ("fmt", "unsafe", "reason"),
    [
        ("torch-zip", False, None),
        ("safetensors", False, None),
        ("torch-zip", True, "--unsafe-pickle runs the full unpickler"),
        ("torch-legacy", False, "a legacy (pre-1.6) torch file, whose storages only torch reads"),
        ("folder", False, "a folder"),  # open_checkpoint opens a folder file by file before asking
    ],
)
def test_reading_describes_or_says_why_torch_loads(fmt: str, unsafe: bool, reason: str | None) -> None:
    plan = plan_reading(fmt, unsafe=unsafe)
    assert plan == (Plan(DESCRIBE) if reason is None else Plan(TORCH, reason))
