"""A learnable image task that needs no download: short bars in four orientations on a noisy background.

The data set is a pure function of its seed, so every process of a DDP run (and every rerun) builds the same
samples; :class:`torch.utils.data.DistributedSampler` then hands each rank its own share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.utils.data import TensorDataset

IMAGE_SIZE = 12
NUM_CLASSES = 4
CLASS_NAMES = ("horizontal", "vertical", "diagonal", "anti-diagonal")
TRAIN_SEED = 1
VAL_SEED = 2
NOISE = 0.4


def make_images(n: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of shape (1, 12, 12) and their labels; one seed always gives the same tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    length = torch.randint(4, 8, (n, 1, 1), generator=g)
    row = torch.randint(0, IMAGE_SIZE, (n, 1, 1), generator=g)
    col = torch.randint(0, IMAGE_SIZE, (n, 1, 1), generator=g)
    amplitude = 1.0 + torch.rand(n, 1, 1, generator=g)
    ii = torch.arange(IMAGE_SIZE).view(1, -1, 1)
    jj = torch.arange(IMAGE_SIZE).view(1, 1, -1)
    # A bar starts at (row, col) and runs `length` pixels; starts near an edge are pulled in so it fits.
    row_in = torch.minimum(row, IMAGE_SIZE - length)
    col_in = torch.minimum(col, IMAGE_SIZE - length)
    col_anti = torch.maximum(col, length - 1)
    di, dj = ii - row_in, jj - col_in
    along_i = (di >= 0) & (di < length)
    along_j = (dj >= 0) & (dj < length)
    shapes = torch.stack(
        [
            (ii == row) & along_j,
            (jj == col) & along_i,
            (di == dj) & along_i,
            (di == col_anti - jj) & along_i,
        ]
    )  # (class, n, H, W)
    mask = shapes[labels, torch.arange(n)]
    noise = NOISE * torch.randn(n, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    images = (mask.float() * amplitude + noise).unsqueeze(1)
    return images, labels


def make_dataset(n: int, *, seed: int = TRAIN_SEED) -> TensorDataset:
    """The training (default seed) or validation (``seed=VAL_SEED``) set as a TensorDataset."""
    from torch.utils.data import TensorDataset

    images, labels = make_images(n, seed=seed)
    return TensorDataset(images, labels)
