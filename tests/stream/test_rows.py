"""ckptfix/stream/rows.py: a tensor of row ranges of another, its bytes as sub-runs of the source's file runs."""

from __future__ import annotations

import torch

from ckptfix.stream.rows import RowsTensor, rows_of, rows_ranges, sub_ranges
from ckptfix.writing import Placeholder


def test_sub_ranges_cross_the_runs_they_fall_in() -> None:
    runs = [("a", 100, 8), ("b", 0, 4), ("a", 500, 8)]  # 20 bytes in three runs of two files
    assert sub_ranges(runs, 0, 20) == runs
    assert sub_ranges(runs, 6, 14) == [("a", 106, 2), ("b", 0, 4), ("a", 500, 2)]
    assert sub_ranges(runs, 8, 12) == [("b", 0, 4)] and sub_ranges(runs, 5, 5) == []


def test_rows_of_a_tensor_equal_torchs_slices_and_their_bytes() -> None:
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    data = whole.numpy().tobytes()
    runs = [("f", 0, 40), ("f", 40, len(data) - 40)]  # a chunk border inside row 2
    t = RowsTensor("w", Placeholder("float32", (6, 4)), ((0, 1), (3, 5)))
    assert (t.shape, t.dtype, t.nbytes) == ((3, 4), "float32", 48)
    want = torch.cat([whole[0:1], whole[3:5]])
    assert torch.equal(rows_of(t, whole), want)
    ranges = rows_ranges(t, runs)
    assert ranges is not None and b"".join(data[o : o + n] for _, o, n in ranges) == want.numpy().tobytes()
    assert rows_ranges(t, None) is None
