"""Faithful to every file torch and safetensors write: math bits, container types, key order of empty tensors.

Each case runs on both conversion paths: the fast one (``convert_file(src, dst)``, which may step aside) and the
torch one (``fast=False``), and through the CLI (``ckptfix convert [--no-fast]``).
"""

from __future__ import annotations

import json
import struct
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.torchcompat import dcp_save_local
from tests import st_spec
from tests.assertions import assert_same
from tests.models import SmallNet

PATHS = [pytest.param(True, id="fast"), pytest.param(False, id="torch")]


def _bits_state() -> dict[str, torch.Tensor]:
    """Conjugate and negative views, one sharing the storage of a plain tensor (they are not tied weights)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j])
    return {
        "plain": z,
        "conj": torch.conj(z),
        "neg": torch._neg_view(torch.tensor([1.0, -2.0, 3.5])),
        "both": torch._neg_view(torch.conj(torch.tensor([2 - 1j, -3j]))),
        "neg_int": torch._neg_view(torch.tensor([7, -8])),
    }


def _values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().resolve_neg() for k, v in state.items()}


def _assert_values(got: Any, want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), (key, got[key], value)


def _dcp_save(state: Any, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: the intent here
        dcp_save_local(state, checkpoint_id=str(folder))


def _dcp_truth(folder: Path, tmp: Path) -> Any:
    """What DCP's own reader makes of a folder."""
    dcp_to_torch_save(str(folder), str(tmp / "dcp_truth.pt"))
    return torch.load(tmp / "dcp_truth.pt", weights_only=True)


# -- math bits ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast", PATHS)
def test_math_bits_are_resolved_in_safetensors_and_kept_in_pt(tmp_path: Path, fast: bool) -> None:
    state = _bits_state()
    torch.save(state, tmp_path / "c.pt")
    result = ckptfix.convert_file(tmp_path / "c.pt", tmp_path / "c.safetensors", fast=fast)
    _assert_values(st_spec.load_file(tmp_path / "c.safetensors"), _values(state))
    _assert_values(ckptfix.load(tmp_path / "c.safetensors"), _values(state))
    if fast:  # resolving is a copy: the fast path stepped aside, and said why
        assert result.method == "torch" and any("conj view" in note for note in result.notes), result.notes
    # torch.save records the bits: a .pt keeps them, and the fast path copies the pickle's records as they are
    result = ckptfix.convert_file(tmp_path / "c.pt", tmp_path / "out.pt", fast=fast)
    assert result.method == ("stream" if fast else "torch")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_values(got, state)  # torch.equal compares values, bits applied
    assert [(t.is_conj(), t.is_neg()) for t in got.values()] == [(t.is_conj(), t.is_neg()) for t in state.values()]
    loaded = ckptfix.load(tmp_path / "c.pt")
    _assert_values(loaded, torch.load(tmp_path / "c.pt", weights_only=True))
    assert [t.is_conj() for t in loaded.values()] == [t.is_conj() for t in state.values()]


def test_math_bits_survive_shards_and_a_dcp_output(tmp_path: Path) -> None:
    state = _bits_state()
    torch.save(state, tmp_path / "c.pt")
    (tmp_path / "shards").mkdir()
    ckptfix.convert_file(tmp_path / "c.pt", tmp_path / "shards" / "model.safetensors", shard_size=32)
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    _assert_values(ckptfix.load(tmp_path / "shards"), _values(state))
    ckptfix.convert_file(tmp_path / "c.pt", f"{tmp_path / 'dcp'}/")
    _assert_values(_dcp_truth(tmp_path / "dcp", tmp_path), _values(state))
    _assert_values(ckptfix.load(tmp_path / "dcp"), _values(state))


@pytest.mark.parametrize("ext", ["pt", "safetensors"])
@pytest.mark.parametrize("fast", PATHS)
def test_math_bits_of_a_dcp_input_are_resolved(tmp_path: Path, fast: bool, ext: str) -> None:
    state = _bits_state()
    _dcp_save(state, tmp_path / "dcp")  # dcp.save pickles each tensor as torch.save does: bits and all
    out = tmp_path / f"out.{ext}"
    ckptfix.convert_file(tmp_path / "dcp", out, fast=fast)
    got = torch.load(out, weights_only=True) if ext == "pt" else st_spec.load_file(out)
    _assert_values(got, _values(state))
    _assert_values(ckptfix.load(tmp_path / "dcp"), _values(_dcp_truth(tmp_path / "dcp", tmp_path)))


def test_diff_reads_the_math_bits_of_a_dcp_folder(tmp_path: Path) -> None:
    state = _bits_state()
    _dcp_save(state, tmp_path / "dcp")
    torch.save(_values(state), tmp_path / "values.pt")
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "dcp"), str(tmp_path / "values.pt")])
    assert result.exit_code == 0 and result.output.rstrip().endswith("equal"), result.output


@pytest.mark.parametrize("flag", [[], ["--no-fast"]], ids=["fast", "torch"])
def test_cli_convert_resolves_math_bits_and_inspect_reads_them(tmp_path: Path, flag: list[str]) -> None:
    state = {"w": torch.conj(torch.tensor([1 + 2j, 3 - 4j]))}
    torch.save(state, tmp_path / "c.pt")
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(tmp_path / "c.pt"), str(tmp_path / "c.safetensors"), *flag])
    assert result.exit_code == 0, result.output
    assert torch.equal(st_spec.load_file(tmp_path / "c.safetensors")["w"], torch.tensor([1 - 2j, 3 + 4j]))
    for path in ("c.pt", "c.safetensors"):
        shown = runner.invoke(cli, ["inspect", str(tmp_path / path)])
        assert shown.exit_code == 0, shown.output


@pytest.mark.parametrize("fast", PATHS)
def test_a_conj_bit_on_a_real_tensor_is_refused(tmp_path: Path, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.tensor([1.0, 2.0])
    get = torch._utils.get_tensor_metadata
    monkeypatch.setattr(torch._utils, "get_tensor_metadata", lambda t: {"conj": True} if t is real else get(t))
    torch.save({"x": real}, tmp_path / "crafted.pt")  # torch.load trips an internal assert on this file
    monkeypatch.undo()
    with pytest.raises(FormatError, match="conj bit set but dtype float32"):
        ckptfix.convert_file(tmp_path / "crafted.pt", tmp_path / "out.safetensors", fast=fast)
    with pytest.raises(FormatError, match=r"crafted\.pt: tensor .* conj bit"):
        ckptfix.load(tmp_path / "crafted.pt")


# -- container types ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("to", ["single", "ddp"])
@pytest.mark.parametrize("fast", PATHS)
def test_a_plain_dict_state_dict_stays_a_dict(tmp_path: Path, fast: bool, to: str) -> None:
    state = {"x": torch.randn(2, 2), "y": torch.arange(3)}
    torch.save(state, tmp_path / "a.pt")
    ckptfix.convert_file(tmp_path / "a.pt", tmp_path / "b.pt", fast=fast, to=to)
    got = torch.load(tmp_path / "b.pt", weights_only=True)
    prefix = "module." if to == "ddp" else ""
    assert_same(got, {prefix + k: v for k, v in state.items()})
    assert type(got) is dict


@pytest.mark.parametrize("fast", PATHS)
def test_nested_entries_keep_their_container_and_metadata(tmp_path: Path, fast: bool) -> None:
    model = SmallNet().state_dict()  # an OrderedDict with _metadata
    ema = {f"module.{k}": v.clone() for k, v in model.items()}  # a plain dict, DDP-wrapped
    torch.save({"model": model, "ema": ema, "epoch": 3}, tmp_path / "a.pt")
    ckptfix.convert_file(tmp_path / "a.pt", tmp_path / "b.pt", fast=fast)
    got = torch.load(tmp_path / "b.pt", weights_only=True)
    assert type(got) is dict and type(got["model"]) is OrderedDict and type(got["ema"]) is dict
    assert_same(got["model"], model)  # _metadata included
    assert_same(got["ema"], {k.removeprefix("module."): v for k, v in ema.items()})


def test_layout_conversions_keep_the_container() -> None:
    plain = {"module.fc.weight": torch.ones(2, 2)}
    assert type(ckptfix.convert(plain, to="single")) is dict
    assert type(ckptfix.convert(plain, to="ddp", strip_prefixes=["module."])) is dict
    ordered = SmallNet().state_dict()
    wrapped = ckptfix.convert(ordered, to="ddp")
    assert type(wrapped) is OrderedDict and wrapped._metadata["module"] == ordered._metadata[""]
    back = ckptfix.convert({"model": wrapped, "step": 1}, to="single")
    assert type(back) is dict and type(back["model"]) is OrderedDict
    assert_same(back["model"], ordered)


@pytest.mark.parametrize("fast", PATHS)
def test_a_dcp_folder_to_pt_gives_what_dcp_itself_gives(tmp_path: Path, fast: bool) -> None:
    # DCP records no container type: its reader rebuilds plain dicts, and so does ckptfix
    _dcp_save({"model": SmallNet().state_dict(), "step": 3}, tmp_path / "dcp")
    ckptfix.convert_file(tmp_path / "dcp", tmp_path / "out.pt", fast=fast)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(got, _dcp_truth(tmp_path / "dcp", tmp_path))
    assert type(got) is dict and type(got["model"]) is dict


@pytest.mark.parametrize("flag", [[], ["--no-fast"]], ids=["fast", "torch"])
def test_cli_convert_keeps_a_dict(tmp_path: Path, flag: list[str]) -> None:
    torch.save({"x": torch.randn(2, 2)}, tmp_path / "a.pt")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), *flag])
    assert result.exit_code == 0, result.output
    assert type(torch.load(tmp_path / "b.pt", weights_only=True)) is dict


# -- key order of zero-size tensors ------------------------------------------------------------------------------


def _header_keys(path: Path) -> list[str]:
    """The tensor names in the order the file's JSON header lists them."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k, _ in json.loads(raw[8 : 8 + n], object_pairs_hook=list) if k != "__metadata__"]


@pytest.mark.parametrize("formats", [("pt", "safetensors"), ("safetensors", "safetensors"), ("safetensors", "pt")])
@pytest.mark.parametrize("fast", PATHS)
def test_zero_size_tensors_keep_their_key_order(tmp_path: Path, fast: bool, formats: tuple[str, str]) -> None:
    # z20, z0 and z023 share one offset: their order is the JSON header's alone (sorted by name, it changed)
    state = {"w": torch.randn(3), "z20": torch.zeros(0), "z0": torch.zeros(0, 3), "z023": torch.zeros(2, 0),
             "b": torch.ones(2), "a": torch.zeros(0, dtype=torch.int64)}  # fmt: skip
    src, dst = tmp_path / f"in.{formats[0]}", tmp_path / f"out.{formats[1]}"
    ckptfix.save(state, src)
    ckptfix.convert_file(src, dst, fast=fast)
    assert_same(dict(ckptfix.load(dst)), state)  # key order included (.safetensors records no container type)
    if formats[1] == "pt":
        assert list(torch.load(dst, weights_only=True)) == list(state)
        return
    assert _header_keys(dst) == list(state)
    with safetensors.safe_open(dst, "pt") as f:  # the library lists names sorted, whatever the file says
        assert list(f.keys()) == sorted(state)
        for key, value in state.items():
            assert torch.equal(f.get_tensor(key), value), key


def test_a_dcp_output_says_which_keys_become_strings(tmp_path: Path) -> None:
    # DCP stores every key as a string: an optimizer's int-keyed state comes back keyed '0', '1', ...
    net = SmallNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "full.pt")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "full.pt"), str(tmp_path / "dcp") + "/"])
    assert result.exit_code == 0, result.output
    count = len(opt.state_dict()["state"])  # its keys; param_groups' lists of ints stay ints
    assert (
        f"ckptfix: DCP keeps keys as strings: {count} non-string key(s) become strings (e.g. 'optimizer.state.0')"
        in result.stderr
    )
    assert set(ckptfix.load(tmp_path / "dcp")["optimizer"]["state"]) == {str(k) for k in opt.state_dict()["state"]}
    plain = CliRunner().invoke(cli, ["convert", str(tmp_path / "full.pt"), str(tmp_path / "m") + "/", "--model-only"])
    assert plain.exit_code == 0 and "DCP keeps keys as strings" not in plain.stderr
