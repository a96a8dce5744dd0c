"""The reference model: a small CNN with BatchNorm, and the fixed probe input its fixtures are checked on.

``ckptfix validate ckpt.pt --model ckptfix.trainer.model:build_model`` builds it through :func:`build_model`.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

from ckptfix.trainer.data import IMAGE_SIZE, NUM_CLASSES

if TYPE_CHECKING:
    import torch

NORMS = ("batch", "none")
PROBE_SEED = 20240601
PROBE_SAMPLES = 4


def build_model(*, norm: str = "batch", width: int = 8, num_classes: int = NUM_CLASSES) -> torch.nn.Module:
    """The reference CNN: three conv blocks (conv, norm, ReLU), global average pooling, a linear head.

    ``norm="none"`` puts an Identity where BatchNorm was (same key indices, no running statistics), which
    makes a DDP run comparable step for step with a single-process run on the same global batch.

    >>> model = build_model()
    >>> model(torch.zeros(2, 1, 12, 12)).shape
    torch.Size([2, 4])
    """
    import torch
    from torch import nn

    from ckptfix.errors import CkptfixError

    if norm not in NORMS:
        raise CkptfixError(f"build_model: unknown norm '{norm}'; choose one of {', '.join(NORMS)}")
    layers: list[nn.Module] = []
    channels = [1, width, 2 * width, 4 * width]
    for i, (c_in, c_out) in enumerate(itertools.pairwise(channels)):
        # A conv bias right before BatchNorm is cancelled by its mean subtraction; keep it only without BN.
        layers.append(nn.Conv2d(c_in, c_out, 3, padding=1, stride=1 if i == 0 else 2, bias=norm == "none"))
        layers.append(nn.BatchNorm2d(c_out) if norm == "batch" else nn.Identity())
        layers.append(nn.ReLU(inplace=True))
    # Named children give readable keys (features.0.weight, classifier.bias) in every message and fixture.
    return nn.Sequential(
        OrderedDict(
            features=nn.Sequential(*layers),
            pool=_global_average_pool()(),
            flatten=nn.Flatten(),
            classifier=nn.Linear(channels[-1], num_classes),
        )
    ).to(torch.float32)


@functools.cache
def _global_average_pool() -> type[torch.nn.Module]:
    from torch import nn

    class GlobalAveragePool(nn.Module):
        """The mean over height and width, as ``AdaptiveAvgPool2d(1)`` computes it, but with a deterministic
        backward on CUDA (AdaptiveAvgPool2d's refuses to run under ``torch.use_deterministic_algorithms``)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean((2, 3), keepdim=True)

    return GlobalAveragePool


def probe_input() -> torch.Tensor:
    """The fixed input whose outputs the fixture manifest records (rebuilt bit for bit from a seed)."""
    import torch

    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn(PROBE_SAMPLES, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)


def probe(model: torch.nn.Module) -> torch.Tensor:
    """The model's eval-mode output on :func:`probe_input` (BatchNorm uses its running statistics)."""
    import torch

    was_training, threads = model.training, torch.get_num_threads()
    model.eval()
    # One thread: the recorded outputs must not depend on how many threads split a reduction.
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            output: torch.Tensor = model(probe_input())
            return output.detach().clone()
    finally:
        torch.set_num_threads(threads)
        model.train(was_training)
