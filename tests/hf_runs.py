"""Small transformers models trained on 2 gloo ranks (CPU), saved by the sharded writers (tests/test_hf_export.py).

``write_fsdp2``: ``fully_shard`` on every decoder layer and the root, two AdamW steps, then ``dcp.save`` of
``get_state_dict`` (model and optimizer), and rank 0's ``get_model_state_dict(full_state_dict=True)`` as ``full.pt``
(the truth). ``write_zero3``: DeepSpeed ZeRO-3 (CPU accelerator), one step, ``engine.save_checkpoint``; its truth is
DeepSpeed's own consolidation (``get_fp32_state_dict_from_zero_checkpoint``). Every rank builds the model from the
same config and seed.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch

from tests.models import start_method

WORLD = 2
IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def build(arch: str, config: dict[str, Any]) -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**config)
    return getattr(transformers, arch)(cfg)


def _fsdp2_worker(rank: int, store_path: str, out_dir: str, arch: str, config: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        model = build(arch, config)
        for layer in model.model.layers if hasattr(model, "model") else model.transformer.h:  # GPT-2's blocks
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(input_ids=IDS, labels=IDS).loss.backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "full.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp1_worker(rank: int, store_path: str, out_dir: str, arch: str, config: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        net = build(arch, config)
        blocks = net.model.layers if hasattr(net, "model") else net.transformer.h
        policy = ModuleWrapPolicy({type(blocks[0])})  # each decoder layer its own FSDP unit: nested prefixes
        model = FullyShardedDataParallel(net, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(input_ids=IDS, labels=IDS).loss.backward()
            opt.step()
            opt.zero_grad()
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(out_dir, "dcp"))
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            full = model.state_dict()
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "full.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_fsdp1(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """A DCP folder ``out/dcp`` of a 2-rank FSDP1 run's SHARDED_STATE_DICT, and ``out/full.pt`` (its
    FULL_STATE_DICT)."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_fsdp1_worker, args=(str(out / "store"), str(out), arch, config), nprocs=WORLD, join=True,
                       start_method=start_method())  # fmt: skip
    return out


def write_fsdp2(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """A DCP folder ``out/dcp`` of a 2-rank FSDP2 run, and ``out/full.pt`` (the full model state dict)."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_fsdp2_worker, args=(str(out / "store"), str(out), arch, config), nprocs=WORLD, join=True,
                       start_method=start_method())  # fmt: skip
    return out


def _zero3_worker(rank: int, port: int, out_dir: str, arch: str, config: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), DS_ACCELERATOR="cpu")  # fmt: skip
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build(arch, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    loss = engine(input_ids=IDS, labels=IDS).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out_dir)
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


def write_zero3(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """A DeepSpeed ZeRO-3 run folder ``out`` (``latest``, ``global_step1/``) of a 2-rank run."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_zero3_worker, args=(port, str(out), arch, config), nprocs=WORLD, join=True,
                       start_method=start_method())  # fmt: skip
    return out
