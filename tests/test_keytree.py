from __future__ import annotations

import pytest

from ckptfix.keytree import brace, expand, group_keys


def resnet50_keys() -> list[str]:
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    keys = ["conv1.weight", *(f"bn1.{s}" for s in bn)]
    for layer, blocks in zip(range(1, 5), [3, 4, 6, 3], strict=True):
        for block in range(blocks):
            for i in range(1, 4):
                keys.append(f"layer{layer}.{block}.conv{i}.weight")
                keys += [f"layer{layer}.{block}.bn{i}.{s}" for s in bn]
            if block == 0:
                keys.append(f"layer{layer}.0.downsample.0.weight")
                keys += [f"layer{layer}.0.downsample.1.{s}" for s in bn]
    return [*keys, "fc.weight", "fc.bias"]


def test_resnet50_reads_in_a_screen_and_expands_back() -> None:
    keys = resnet50_keys()
    lines = group_keys(keys)
    assert len(keys) == 320
    assert len(lines) <= 25
    assert "layer3.{1..5}.{bn1,bn2,bn3}.{weight,bias,running_mean,running_var,num_batches_tracked}" in lines
    assert sorted(k for line in lines for k in expand(line)) == sorted(keys)


@pytest.mark.parametrize(
    ("names", "text"),
    [
        (["a"], "a"),
        (["0", "1"], "{0,1}"),
        (["0", "1", "2", "5"], "{0..2,5}"),
        (["weight", "bias"], "{weight,bias}"),
    ],
)
def test_brace(names: list[str], text: str) -> None:
    assert brace(names) == text


def test_mixed_depths() -> None:
    assert group_keys(["a.0.weight", "a.0.bias", "a.1.weight", "a.1.bias", "b"]) == [
        "a.{0,1}.{weight,bias}",
        "b",
    ]
    assert group_keys(["x.weight", "x.y.z"]) == ["x.weight", "x.y.z"]
