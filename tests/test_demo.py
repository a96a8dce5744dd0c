"""ckptfix.demo's checking half, on a fixture (the full demo trains, and runs in CI as python -m ckptfix.demo)."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_demo_rows_pass_for_a_real_wrapped_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptfix import demo
    from ckptfix.trainer.data import VAL_SEED, make_images

    (tmp_path / "converted").mkdir()
    images, labels = make_images(64, seed=VAL_SEED)
    rows = demo._check("dp", FIXTURES / "dp_wrapped.pt", tmp_path, images, labels)
    assert len(rows) == len(demo.TARGETS) * len(demo.FORMATS)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    demo.render(rows, rich=False)
    out = capsys.readouterr().out
    assert "compiled-ddp.safetensors" in out and "FAIL" not in out


def test_demo_row_fails_on_any_output_difference() -> None:
    from ckptfix.demo import Row

    assert Row("dp", "single.pt", "ok", "ok", 0.0, 0.9).ok
    assert not Row("dp", "single.pt", "ok", "ok", 1e-7, 0.9).ok
    assert not Row("dp", "single.pt", "ok", "FAIL: x", 0.0, 0.9).ok
