from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch

import ckptfix
from ckptfix.errors import LayoutError, UsageError
from ckptfix.transforms import layouts
from ckptfix.transforms.checkpoint import convert, convert_checkpoint
from tests.assertions import assert_same
from tests.models import PREFIX, WRAPPERS, SmallNet, make_net


@pytest.mark.parametrize("kind", WRAPPERS)
def test_detect_real_wrappers(kind: str, wrapped_state: Callable[[str], dict[str, torch.Tensor]]) -> None:
    state = wrapped_state(kind)
    assert all(k.startswith(PREFIX[kind]) for k in state)
    expected = "ddp" if kind == "dp" else kind
    assert layouts.detect(state.keys()).name == expected


@pytest.mark.parametrize("source", WRAPPERS)
@pytest.mark.parametrize("target", WRAPPERS)
def test_convert_every_pair(source: str, target: str, wrapped_state: Callable[[str], dict[str, torch.Tensor]]) -> None:
    state = wrapped_state(source)
    out = convert(state, to=target)
    want = wrapped_state(target)
    assert list(out) == list(want)
    for key in want:
        assert torch.equal(out[key], want[key])
    # the layouts reported are what detect() says of the keys before and after
    change = convert_checkpoint(state, to=target).changes[0]
    assert (change.layout_from, change.layout_to) == (layouts.detect(state).name, layouts.detect(out).name)


def test_converted_state_loads_strictly_and_matches_output(
    wrapped_state: Callable[[str], dict[str, torch.Tensor]],
) -> None:
    from tests.models import PROBE

    reference = make_net()
    for kind in WRAPPERS:
        fresh = make_net(seed=123)
        fresh.load_state_dict(convert(wrapped_state(kind), to="single"), strict=True)
        assert torch.equal(fresh(PROBE), reference(PROBE))


def test_mixed_wrapped_and_plain_keys_is_an_error_naming_both() -> None:
    with pytest.raises(LayoutError, match=r"'module\.x' and 'x'"):
        layouts.detect(["module.x", "x", "module.y"])


def test_partial_prefix_is_not_stripped_and_is_said() -> None:
    # Some keys with the prefix, some without: a partly wrapped state dict, or a submodule really called "module".
    # Neither is guessed: the prefix is not peeled, and a layout change says so instead of passing it through.
    assert layouts.detect(["module.weight", "head.weight"]).chain == ()
    state = {"module.weight": torch.zeros(1), "head.weight": torch.zeros(1)}
    with pytest.raises(LayoutError, match=r"1 of 2 keys start with 'module\.' \(e\.g\. 'module\.weight'\)"):
        convert(state, to="single")
    assert list(convert(state, to=None)) == ["module.weight", "head.weight"]  # kept as they are when asked


def test_double_module_prefix_peels_twice() -> None:
    found = layouts.detect(["module.module.a", "module.module.b"])
    assert found.chain == ("ddp", "ddp")
    assert list(convert({"module.module.a": torch.zeros(1)}, to="single")) == ["a"]


def test_inner_wrappers_are_removed() -> None:
    state = {
        "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.weight": torch.zeros(1),
        "_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.bias": torch.zeros(1),
    }
    assert layouts.detect(state).inner == ("fsdp", "checkpoint")
    assert list(convert(state, to="single")) == ["layers.0.weight", "layers.0.bias"]


def test_unknown_target_lists_choices() -> None:
    with pytest.raises(UsageError, match="to='fsdp': unknown layout; choose one of single, dp, ddp"):
        convert({"a": torch.zeros(1)}, to="fsdp")
    assert issubclass(UsageError, ValueError)


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


def test_prefixes_inside_keys_are_left_alone() -> None:
    state = {"encoder.module.weight": torch.zeros(1), "decoder._orig_mod.bias": torch.zeros(1)}
    assert list(ckptfix.convert(state, to="single")) == list(state)
    assert list(ckptfix.convert(state, to="ddp")) == ["module." + k for k in state]


# Faithful to what torch and safetensors write: math bits, container types, key order of empty tensors.


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
