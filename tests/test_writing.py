"""ckptfix.writing: a checkpoint written as its tensors arrive (what ``merge`` streams into), header first.

Inputs come from torch.save and safetensors; outputs are read back with torch.load and safetensors' own loader.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptfix.formats.copyable import Fallback
from ckptfix.formats.opened import in_memory
from ckptfix.formats.records import map_tree
from ckptfix.reading import open_checkpoint
from ckptfix.writing import Placeholder, streamed_writer
from tests.hostile import parse_st


def _placeholders(state: dict[str, torch.Tensor]) -> dict[str, Placeholder]:
    """One Placeholder per distinct tensor of ``state`` (tied names share one, as merge's template does)."""
    made: dict[int, Placeholder] = {}
    return {
        k: made.setdefault(id(v), Placeholder(str(v.dtype).removeprefix("torch."), tuple(v.shape)))
        for k, v in state.items()
    }


def _computed() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shared = torch.randn(5, 3)
    return {
        "embed.weight": shared,
        "head.weight": shared,  # tied: one tensor under two names
        "head.bias": torch.randn(5, dtype=torch.float64),
        "steps": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(4, 2).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
    }


def _write_all(tree: Any, values: dict[str, Any], out: Path, *, fmt: str, base: Any) -> None:
    with streamed_writer(tree, out, fmt=fmt, base=base) as writer:
        for key, value in tree.items():
            writer.put(value, values[key])


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_placeholders_written_load_equal(tmp_path: Path, fmt: str) -> None:
    state = _computed()
    tree = _placeholders(state)
    out = tmp_path / ("out.pt" if fmt == "torch-zip" else "out.safetensors")
    _write_all(tree, state, out, fmt=fmt, base=in_memory({}, source="merge"))
    back = torch.load(out, weights_only=True) if fmt == "torch-zip" else load_file(out)
    # safetensors stores a tied pair once, under its first name (as safetensors' save_model drops the other)
    want = [k for k in state if fmt == "torch-zip" or k != "head.weight"]
    if fmt == "safetensors":  # load_file gives the keys by name (safetensors 0.4.0, the floor) or by place: the header
        header, _ = parse_st(out.read_bytes())  # says where each tensor lies
        back = {k: back[k] for k in sorted(set(header) - {"__metadata__"}, key=lambda k: header[k]["data_offsets"])}
    assert list(back) == want
    for key, value in back.items():
        assert value.dtype == state[key].dtype and torch.equal(value, state[key]), key


def test_tied_names_share_storage_in_a_pt(tmp_path: Path) -> None:
    state = _computed()
    tree = _placeholders(state)
    out = tmp_path / "out.pt"
    _write_all(tree, state, out, fmt="torch-zip", base=in_memory({}, source="merge"))
    back = torch.load(out, weights_only=True)
    assert back["embed.weight"].untyped_storage().data_ptr() == back["head.weight"].untyped_storage().data_ptr()
    back["embed.weight"][0, 0] = 123.0  # one tensor: a change under one name shows under the other
    assert back["head.weight"][0, 0].item() == 123.0
    assert back["head.bias"].untyped_storage().data_ptr() != back["embed.weight"].untyped_storage().data_ptr()


def test_a_described_pt_kept_and_computed_values_mixed(tmp_path: Path) -> None:
    """The merge case: the first input's records kept (a view and a tied pair among them), one tensor computed."""
    torch.manual_seed(1)
    base = torch.randn(6, 4)
    src = {
        "a": base,
        "b": base,  # tied
        "row": base[2],  # a view into the same storage
        "c": torch.randn(3),
        "meta": {"epoch": 3},
    }
    path = tmp_path / "in.pt"
    torch.save(src, path)
    before = path.read_bytes()
    new_c = torch.arange(3, dtype=torch.float32)
    out = tmp_path / "out.pt"
    with open_checkpoint(path) as opened:
        assert opened.described
        tree = dict(opened.tree)
        tree["c"] = Placeholder("float32", (3,))
        with streamed_writer(tree, out, fmt="torch-zip", base=opened) as writer:
            for key in ("a", "b", "row"):
                writer.put(tree[key], opened.tensor(tree[key]))
            writer.put(tree["c"], new_c)
    back = torch.load(out, weights_only=True)
    assert set(back) == {"a", "b", "row", "c", "meta"}
    assert torch.equal(back["a"], base) and torch.equal(back["b"], base) and torch.equal(back["row"], base[2])
    assert torch.equal(back["c"], new_c)
    assert back["meta"] == {"epoch": 3}
    ptr = back["a"].untyped_storage().data_ptr()
    assert back["b"].untyped_storage().data_ptr() == ptr and back["row"].untyped_storage().data_ptr() == ptr
    assert path.read_bytes() == before  # the input is never changed


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_a_failure_leaves_no_output_and_the_old_file(tmp_path: Path, fmt: str) -> None:
    state = _computed()
    tree = _placeholders(state)
    out = tmp_path / "out.bin"
    out.write_bytes(b"the previous output")
    base = in_memory({}, source="merge")
    with pytest.raises(RuntimeError, match="boom"), streamed_writer(tree, out, fmt=fmt, base=base) as writer:
        writer.put(tree["head.bias"], state["head.bias"])
        raise RuntimeError("boom")
    assert out.read_bytes() == b"the previous output"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]  # no temp file left behind


def test_safetensors_with_a_tensor_never_handed_over_is_not_written(tmp_path: Path) -> None:
    state = _computed()
    tree = _placeholders(state)
    out = tmp_path / "out.safetensors"
    base = in_memory({}, source="merge")
    with pytest.raises(RuntimeError, match="never"), streamed_writer(tree, out, fmt="safetensors", base=base) as w:
        w.put(tree["head.bias"], state["head.bias"])
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors"])
def test_real_tensors_fall_back_before_anything_is_written(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out.bin"
    with pytest.raises(Fallback):
        streamed_writer({"w": torch.ones(2)}, out, fmt=fmt, base=in_memory({}, source="merge"))
    assert os.listdir(tmp_path) == []


def test_a_safetensors_input_rewritten_through_its_records(tmp_path: Path) -> None:
    """A safetensors file's records (read on demand) written to a .pt: torch.load gives the values safetensors
    saved."""
    torch.manual_seed(2)
    src = {"x": torch.randn(3, 2), "y": torch.arange(5, dtype=torch.int16)}
    path = tmp_path / "in.safetensors"
    save_file(src, path)
    out = tmp_path / "out.pt"
    with open_checkpoint(path) as opened:
        tree = map_tree(opened.tree, lambda r: r)
        _write_all(tree, {k: opened.tensor(v) for k, v in tree.items()}, out, fmt="torch-zip", base=opened)
    back = torch.load(out, weights_only=True)
    assert list(back) == ["x", "y"]
    assert all(torch.equal(back[k], src[k]) and back[k].dtype == src[k].dtype for k in src)
