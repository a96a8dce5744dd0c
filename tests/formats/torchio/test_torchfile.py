"""ckptfix.formats.torchio.torchfile: files loaded by torch itself, checked before and after."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import FormatError

# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


def test_an_input_rewritten_after_its_check_is_refused_on_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CRCs were checked before the rewrite: only the before/after comparison of the file can catch it
    import ckptfix.formats.torchio.torchfile as torchfile

    src = tmp_path / "in.pt"
    torch.save({"w": torch.ones(1000)}, src)
    time.sleep(0.05)  # file times tick at a few ms: the rewrite below must land on a later tick than the save
    real = torchfile.materialize

    def rewrite_then_build(described: Any, fd: int, *, mmap: bool = True) -> Any:
        with open(src, "r+b") as f:  # another process rewrites a record that has just passed its CRC check
            f.seek(described.archive.get("data/0").data_offset)
            f.write(b"\x00" * 16)
        return real(described, fd, mmap=mmap)

    monkeypatch.setattr(torchfile, "materialize", rewrite_then_build)
    with pytest.raises(FormatError, match=r"in\.pt: the file changed while it was being read"):
        ckptfix.load(src)
