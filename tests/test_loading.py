"""ckptfix.loading: load_into and adapt_to_model fit a checkpoint's layout to the model's, refuse what does not fit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import LayoutError, MismatchError
from ckptfix.loading import adapt_to_model
from tests.models import KEYS, PROBE, WRAPPERS, SmallNet, make_net, wrap


@pytest.mark.parametrize("kind", ["dp", "compiled"])
def test_layout_only_difference_gives_the_convert_command(kind: str) -> None:
    net = SmallNet()
    state = (nn.DataParallel(net) if kind == "dp" else torch.compile(net)).state_dict()
    adapted, report = adapt_to_model(state, SmallNet(), source="run/ckpt.pt")
    assert set(adapted) == KEYS
    assert report.ok and not report.loads_as_is
    assert (report.layout_from, report.layout_to) == ("ddp" if kind == "dp" else "compiled", "single")
    assert report.fix_command("run/ckpt.pt") == "ckptfix convert run/ckpt.pt run/ckpt.single.pt --to single"


def test_no_model_state_is_a_layout_error_not_a_mismatch() -> None:
    with pytest.raises(LayoutError, match="holds no model state dict"):
        ckptfix.load_into(SmallNet(), {"epoch": 1})


def test_metadata_that_is_not_a_dict_is_a_mismatch() -> None:
    state = SmallNet().state_dict()
    state._metadata = [1, 2]  # type: ignore[attr-defined]
    with pytest.raises(MismatchError, match=r"^c\.pt: its _metadata is a list, not a dict of module entries"):
        adapt_to_model(state, SmallNet(), source="c.pt")
    assert ckptfix.check(state, SmallNet()).bad_metadata == {
        "": "_metadata is a list, not a dict of module entries: delete it"
    }


@pytest.mark.parametrize("kind", WRAPPERS)
def test_load_into_adapts_to_the_models_own_layout(
    tmp_path: Path, kind: str, wrapped_state: Callable[[str], Any], gloo_world: None
) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"model": make_net().state_dict(), "epoch": 2}, path)
    net = make_net(seed=5)
    report = ckptfix.load_into(wrap(kind, net), path)
    assert report.ok
    assert torch.equal(net(PROBE), make_net()(PROBE))
