"""ckptfix.loading.model: load_into and adapt_to_model fit a checkpoint's layout to the model's, refuse what does not
fit."""

from __future__ import annotations

import collections
import dataclasses
import enum
import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import LayoutError, MismatchError
from ckptfix.loading.model import adapt_to_model
from tests.dtype_files import _quantized_linear
from tests.models import KEYS, PROBE, WRAPPERS, Holder, SmallNet, TiedLM, make_net, wrap


@pytest.mark.parametrize("kind", ["dp", "compiled"])
def test_layout_only_difference_gives_the_convert_command(kind: str) -> None:
    net = SmallNet()
    state = (nn.DataParallel(net) if kind == "dp" else torch.compile(net)).state_dict()
    adapted, report = adapt_to_model(state, SmallNet(), source="run/ckpt.pt")
    assert set(adapted) == KEYS
    assert report.ok and not report.loads_as_is
    assert (report.layout_from, report.layout_to) == ("ddp" if kind == "dp" else "compiled", "single")
    assert report.fix_command("run/ckpt.pt") == "ckptfix convert run/ckpt.pt ckpt.single.pt --to single"


def test_no_model_state_is_a_layout_error_not_a_mismatch() -> None:
    with pytest.raises(LayoutError, match="holds no model state dict"):
        ckptfix.load_into(SmallNet(), {"epoch": 1})


def test_metadata_that_is_not_a_dict_is_a_mismatch() -> None:
    state = SmallNet().state_dict()
    state._metadata = [1, 2]  # type: ignore[attr-defined]
    _, report = adapt_to_model(state, SmallNet(), source="c.pt")
    assert report.bad_metadata == {"": "_metadata is a list, not a dict of module entries: delete it"}
    assert ckptfix.check(state, SmallNet()).bad_metadata == report.bad_metadata
    for strict in (True, False):
        with pytest.raises(MismatchError, match=r"^c\.pt: does not fit the model: 1 bad _metadata \(e\.g\. the root"):
            ckptfix.load_into(SmallNet(), state, strict=strict, source="c.pt")


@pytest.mark.parametrize("kind", WRAPPERS)
def test_load_into_adapts_to_the_models_own_layout(
    tmp_path: Path, kind: str, wrapped_state: Callable[[str], Any], gloo_world: None
) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"model": make_net().state_dict(), "epoch": 2}, path)
    net = make_net(seed=5)
    report = ckptfix.load_into(wrap(kind, net), path)  # on a GPU machine DataParallel's is a CUDA model
    assert report.ok
    assert torch.equal(net.cpu()(PROBE), make_net()(PROBE))


# --- models for the parity checks (TiedLM and Holder, factories for ``--model``, are in tests/models.py) ---------


class Twice(nn.Module):
    """Its root weight is also submodule ``a``'s: both 'm.' and 'm.a.' make a one-key checkpoint fit."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.weight = self.a.weight


def _lightning(state: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, Any]:
    """A full checkpoint shaped as Lightning saves one: the module's own keys under its attribute name."""
    return {"epoch": 1, "state_dict": {prefix + k: v for k, v in state.items()}, "optimizer_states": []}


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_load_into_strips_the_one_prefix_that_makes_the_keys_fit(tmp_path: Path, kind: str, gloo_world: None) -> None:
    path = tmp_path / "lightning.ckpt"
    torch.save(_lightning(make_net().state_dict()), path)
    net = SmallNet(seed=5)
    report = ckptfix.load_into(wrap(kind, net), path)
    assert report.renamed_prefix == ("model.", "") and report.ok and not report.loads_as_is
    assert report.entry == "state_dict"
    assert _same(net, make_net())
    assert ckptfix.check(path, wrap(kind, SmallNet())).renamed_prefix == ("model.", "")


def test_load_into_strips_a_prefix_under_a_ddp_prefix(tmp_path: Path) -> None:
    path = tmp_path / "ddp-lightning.ckpt"
    torch.save(_lightning(nn.DataParallel(make_net()).state_dict(), prefix="net."), path)  # net.module.…
    net = SmallNet(seed=5)
    report = ckptfix.load_into(net, path)  # net.module.x: one prefix, whatever its parts
    assert report.renamed_prefix == ("net.module.", "") and report.layout_from == "single"
    assert _same(net, make_net())
    net = SmallNet(seed=5)
    torch.save({"state_dict": {f"module.net.{k}": v for k, v in make_net().state_dict().items()}}, path)
    report = ckptfix.load_into(net, path)
    assert report.renamed_prefix == ("net.", "") and report.layout_from == "ddp"
    assert _same(net, make_net())


def test_load_into_adds_the_prefix_a_wrapper_module_needs() -> None:
    holder = Holder()
    report = ckptfix.load_into(holder, make_net().state_dict())
    assert report.renamed_prefix == ("", "net.")
    assert _same(holder.net, make_net())


def test_a_prefix_is_never_applied_when_the_keys_fit_only_in_part() -> None:
    checkpoint = _lightning(make_net().state_dict())
    checkpoint["state_dict"]["criterion.pos_weight"] = torch.ones(3)
    net = SmallNet(seed=5)
    before = net.state_dict()
    with pytest.raises(MismatchError, match=r"16 missing .* 17 unexpected"):
        ckptfix.load_into(net, checkpoint)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    report = ckptfix.check(checkpoint, SmallNet())
    assert report.renamed_prefix is None and "criterion.pos_weight" in report.unexpected
    with pytest.raises(LayoutError, match=r"'criterion\.pos_weight'; every key must start with it$"):
        ckptfix.load_into(net, checkpoint, strip_prefixes=["model."])  # all-or-nothing, as convert's


def test_two_prefixes_that_fit_are_never_guessed_between() -> None:
    state = {"m.a.weight": torch.ones(2, 2)}
    with pytest.raises(MismatchError, match="2 missing"):
        ckptfix.load_into(Twice(), state)
    assert ckptfix.check(state, Twice()).renamed_prefix is None


def test_strip_prefixes_goes_first_and_is_all_or_nothing() -> None:
    state = {f"student.{k}": v for k, v in make_net().state_dict().items()}
    net = SmallNet(seed=5)
    ckptfix.load_into(net, {"model": state}, strip_prefixes=["student."])
    assert _same(net, make_net())
    state["teacher.x"] = torch.ones(1)
    with pytest.raises(LayoutError, match=r"strip_prefixes='student\.' does not match key 'teacher\.x'"):
        ckptfix.load_into(net, state, strip_prefixes=["student."])
    with pytest.raises(TypeError, match="did you mean 'strip_prefixes'"):
        ckptfix.load_into(net, state, strip_prefix=["student."])  # type: ignore[call-arg]


def test_entry_picks_the_ema_weights(tmp_path: Path) -> None:
    path = tmp_path / "timm-like.pth.tar"
    torch.save(
        {"epoch": 3, "state_dict": make_net().state_dict(), "state_dict_ema": make_net(seed=9).state_dict()}, path
    )
    net = SmallNet(seed=5)
    assert ckptfix.load_into(net, path).entry == "state_dict"  # the training weights by default
    assert _same(net, make_net())
    assert ckptfix.load_into(net, path, entry="state_dict_ema").entry == "state_dict_ema"
    assert _same(net, make_net(seed=9))
    assert ckptfix.check(path, SmallNet(), entry="state_dict_ema").entry == "state_dict_ema"
    with pytest.raises(LayoutError, match=r"no model state dict under 'ema' \(model entries: 'state_dict', "
                       r"'state_dict_ema'\); pick one with entry="):  # fmt: skip
        ckptfix.load_into(net, path, entry="ema")


def test_tied_keys_the_checkpoint_leaves_out_load_through_the_key_they_share(tmp_path: Path) -> None:
    state = TiedLM().state_dict()
    del state["head.weight"]  # as transformers saves GPT-2: lm_head.weight is wte.weight
    path = tmp_path / "lm.pt"
    torch.save(state, path)
    model = TiedLM(seed=4)
    report = ckptfix.load_into(model, path)
    assert report.tied == {"head.weight": "emb.weight"} and report.ok and report.loads_as_is
    assert torch.equal(model.emb.weight, TiedLM().emb.weight) and model.head.weight is model.emb.weight
    assert ckptfix.check(path, TiedLM()).tied == {"head.weight": "emb.weight"}
    assert ckptfix.load_into(TiedLM(seed=4), path, strict=False).tied == report.tied
    with pytest.raises(RuntimeError, match="Missing key"):
        TiedLM().load_state_dict(ckptfix.load(path))  # the premise: torch alone refuses it


def test_tied_keys_count_only_when_their_partner_is_there() -> None:
    report = ckptfix.check({"other": torch.ones(1)}, TiedLM())
    assert report.tied == {} and set(report.missing) == {"emb.weight", "head.weight"}


def test_check_reads_no_tensor_byte(tmp_path: Path) -> None:
    path = tmp_path / "damaged.pt"
    torch.save({"model": make_net().state_dict()}, path)
    data = bytearray(path.read_bytes())
    offset = data.index(b"data/0") + 200  # inside the first storage record's bytes, past its header
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ckptfix.FormatError, match="CRC"):
        ckptfix.load(path)  # reading the bytes finds the damage
    assert ckptfix.check(path, SmallNet()).loads_as_is  # the check never reads them


# --- allow_globals: the data classes of the user's own code, named one by one ------------------------------------


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass
class RunConfig:
    lr: float = 0.1
    mode: Mode = Mode.EVAL
    root: pathlib.PurePosixPath = dataclasses.field(default_factory=lambda: pathlib.PurePosixPath("/data"))


Point = collections.namedtuple("Point", "x y")


class Plain:
    """A class that is neither an enum, a dataclass nor a named tuple."""


OWN = [f"tests.loading.test_model.{n}" for n in ("RunConfig", "Mode", "Point")] + ["pathlib.PurePosixPath"]


def test_enums_dataclasses_and_named_tuples_of_the_users_code_load_when_named(tmp_path: Path) -> None:
    path = tmp_path / "cfg.pt"
    extras = {"config": RunConfig(), "mode": Mode.TRAIN, "best": Point(1, 2.5)}
    torch.save({"model": make_net().state_dict(), **extras}, path)
    with pytest.raises(ckptfix.UnsafeCheckpointError) as refused:
        ckptfix.load(path)
    message = str(refused.value)
    assert "allow_globals='tests.loading.test_model.RunConfig'" in message and "unsafe=True opens it too but" in message
    net = SmallNet(seed=5)  # the weights need none of them: they load, and the report says what was not loaded
    assert set(ckptfix.load_into(net, path).not_loaded) == set(extras) and _same(net, make_net())
    net = SmallNet(seed=5)
    assert ckptfix.load_into(net, path, allow_globals=OWN).ok and _same(net, make_net())
    loaded = ckptfix.load(path, allow_globals=OWN)
    assert {k: loaded[k] for k in extras} == extras and loaded["mode"] is Mode.TRAIN
    for fast in (True, False):  # both conversion paths keep them
        out = tmp_path / f"out-{fast}.pt"
        ckptfix.convert_file(path, out, fast=fast, allow_globals=OWN)
        assert {k: v for k, v in ckptfix.load(out, allow_globals=OWN).items() if k in extras} == extras


def test_other_classes_of_the_users_code_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"model": make_net().state_dict(), "obj": Plain()}, path)
    with pytest.raises(ckptfix.UnsafeCheckpointError) as refused:
        ckptfix.load(path)
    assert "not a known-safe class" in str(refused.value) and "allow_globals" not in str(refused.value)
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='tests\.loading\.test_model\.Plain': "
                       r"refused, not a known-safe class .*; only unsafe=True opens this file"):  # fmt: skip
        ckptfix.load(path, allow_globals=["tests.loading.test_model.Plain"])
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"refused, not a known-safe class .*cannot be imported"):
        ckptfix.load(path, allow_globals=["no_such_pkg_ckptfix.Config"])


# Faithful to every file torch can write (dtypes, CRC-less saves, odd keys, layouts, devices), each made by torch
# itself: carried bit for bit, or refused with exit 2 in one line saying it is not supported yet; never called
# corrupt.


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_quantized_modules_state_dict_loads_into_it(tmp_path: Path) -> None:
    src = tmp_path / "qlinear.pt"
    source = _quantized_linear()
    torch.save(source.state_dict(), src)  # its _packed_params.dtype is a torch.dtype, not a tensor
    model = torch.ao.nn.quantized.Linear(4, 3)
    report = ckptfix.load_into(model, src)
    assert report.ok
    assert torch.equal(model.weight().int_repr(), source.weight().int_repr())
    assert torch.equal(model.bias(), source.bias())
    assert ckptfix.check(src, torch.ao.nn.quantized.Linear(4, 3)).ok
