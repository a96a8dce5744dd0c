"""The reference trainer: single-device, nn.DataParallel and DDP, the way the PyTorch DDP guides teach it.

Launch it with ``ckptfix train --mode ddp --nproc-per-node 2 --epochs 2 --out runs/ddp`` or directly with
``torchrun --nproc-per-node 2 -m ckptfix.trainer --mode ddp --epochs 2 --out runs/ddp``. It also writes the
real checkpoints in ``fixtures/`` (``python -m ckptfix.trainer.fixtures``). Nothing here is imported at CLI
start-up: submodules import torch.
"""

from __future__ import annotations
