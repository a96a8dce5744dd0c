"""load_into reading a file straight into the model's own tensors (ckptfix.loading.placing): the same model as
load_state_dict gives, checks before the first byte is copied, and load_state_dict itself where only it is right."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import FormatError
from ckptfix.loading import placing
from tests.models import PROBE, SmallNet, make_net, wrap


def _states_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key].cpu(), sb[key].cpu()), key


@pytest.fixture
def placed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors each load_into copied straight from the file (none: load_state_dict did it)."""
    counts: list[int] = []
    real = placing.copy_jobs

    def counting(fd: int, jobs: Any, **kwargs: Any) -> None:
        counts.append(len(jobs))
        real(fd, jobs, **kwargs)

    monkeypatch.setattr(placing, "copy_jobs", counting)
    return counts


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
@pytest.mark.parametrize("kind", ["single", "dp"])
def test_a_file_lands_in_the_models_own_tensors(tmp_path: Path, ext: str, kind: str, placed: list[int]) -> None:
    path = tmp_path / f"model{ext}"
    source = wrap(kind, make_net()).cpu()
    ckptfix.save({"model": source.state_dict()} if ext == ".pt" else source.state_dict(), path)
    net = make_net(seed=4)
    own = {k: v.data_ptr() for k, v in net.state_dict().items()}
    report = ckptfix.load_into(net, path)
    assert report.ok and placed == [len(own)]
    _states_equal(net, make_net())
    assert {k: v.data_ptr() for k, v in net.state_dict().items()} == own  # copied into, not replaced
    assert torch.equal(net(PROBE), make_net()(PROBE))


def test_pieces_and_threads_and_the_staged_copy_put_every_byte_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.pt"
    torch.save(make_net().state_dict(), path)
    monkeypatch.setattr(placing, "PIECE", 40)  # many pieces per tensor, odd sizes, a short last one
    for staged in (False, True):
        net = make_net(seed=4)
        with ckptfix.reading.open_checkpoint(path) as opened:
            jobs, rest = placing.plan(opened.tree, net.state_dict(keep_vars=True), opened)
            assert not rest and len(jobs) == len(net.state_dict())
            with torch.no_grad():
                placing.copy_jobs(opened.fd or 0, jobs, source=str(path), workers=3, staged=staged)
        _states_equal(net, make_net())


def test_views_and_tied_weights_load_as_load_state_dict_loads_them(tmp_path: Path, placed: list[int]) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight
            self.proj = nn.Linear(4, 4)

    torch.manual_seed(1)
    source = Tied()
    state = source.state_dict()
    state["proj.weight"] = state["proj.weight"].t().contiguous().t()  # a transposed view: not as it lies
    path = tmp_path / "tied.pt"
    torch.save(state, path)
    want = Tied()
    want.load_state_dict(torch.load(path, weights_only=True))
    got = Tied()
    assert ckptfix.load_into(got, path).ok
    assert placed == [2]  # the tied weight once, the bias; the view the usual way
    _states_equal(got, want)
    assert got.head.weight is got.emb.weight


def test_a_bad_crc_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save(make_net().state_dict(), path)
    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)  # the biggest storage, loaded last or first
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's own
    data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    net = make_net(seed=4)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(FormatError, match="CRC"):
        ckptfix.load_into(net, path)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_model_with_load_hooks_is_loaded_by_load_state_dict(tmp_path: Path, placed: list[int]) -> None:
    path = tmp_path / "m.safetensors"
    ckptfix.save(make_net().state_dict(), path)
    net = make_net(seed=4)
    seen: list[str] = []
    if hasattr(net, "register_load_state_dict_pre_hook"):
        net.register_load_state_dict_pre_hook(lambda module, state, prefix, *args: seen.append(prefix))
    else:  # torch 2.4: only the private registration, without the module argument
        net._register_load_state_dict_pre_hook(lambda state, prefix, *args: seen.append(prefix))
    assert ckptfix.load_into(net, path).ok
    assert placed == [] and seen == [""]
    _states_equal(net, make_net())


def test_strict_false_leaves_the_missing_keys_and_ignores_the_unexpected(tmp_path: Path, placed: list[int]) -> None:
    state = make_net().state_dict()
    state.pop("head.bias")
    state["extra.weight"] = torch.ones(2)
    path = tmp_path / "partial.pt"
    torch.save(state, path)
    net = SmallNet(seed=4)
    before = net.head.bias.detach().clone()
    report = ckptfix.load_into(net, path, strict=False)
    assert report.missing == ["head.bias"] and report.unexpected == ["extra.weight"]
    assert torch.equal(net.head.bias, before) and torch.equal(net.head.weight, make_net().head.weight)
    assert placed == [len(state) - 1]
