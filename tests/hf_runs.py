"""Small transformers models trained on 2 gloo ranks (CPU), saved by the sharded writers
(tests/exporting/test_folder.py).

``write_fsdp2``: ``fully_shard`` on every decoder layer and the root, two AdamW steps, then ``dcp.save`` of
``get_state_dict`` (model and optimizer), each rank's ``torch.save(model.state_dict())`` (``rank{R}.pt``; FSDP1's
SHARDED_STATE_DICT the same way), and rank 0's ``get_model_state_dict(full_state_dict=True)`` as ``full.pt``
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


def blocks(model: Any) -> Any:
    """The repeated blocks (each its own FSDP unit): decoder layers, GPT-2's ``h``, BERT's encoder layers."""
    if hasattr(model, "model"):
        return model.model.layers
    return model.transformer.h if hasattr(model, "transformer") else model.encoder.layer


def loss_of(model: Any) -> Any:
    """A causal LM's loss on its own input; a bare encoder's (BERT) mean square output."""
    out = model(input_ids=IDS, labels=IDS) if hasattr(model, "lm_head") else model(input_ids=IDS)
    return out.loss if hasattr(model, "lm_head") else out.last_hidden_state.pow(2).mean()


def train(model: Any, *, steps: int = 2) -> torch.optim.Optimizer:
    """``steps`` AdamW steps of ``model`` on its :func:`loss_of`; the optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss_of(model).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _done(out_dir: str, rank: int) -> None:
    Path(f"{out_dir}.done{rank}").touch()  # this rank's work is over (tests.resume_runs.spawn)


def _spawn(target: Any, args: tuple[Any, ...], out: Path) -> None:
    from tests.resume_runs import spawn

    spawn(target, args, world=WORLD, done=out, start_method=start_method())


def _fsdp2_worker(rank: int, store_path: str, out_dir: str, arch: str, config: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        model = build(arch, config)
        for layer in blocks(model):
            fully_shard(layer)
        fully_shard(model)
        opt = train(model)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
        torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))  # DTensor shards, a file per rank
        _accelerate_save(model, opt, os.path.join(out_dir, "accelerate"), arch=arch, config=config)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "full.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _done(out_dir, rank)


def _accelerate_save(model: Any, opt: Any, out_dir: str, *, arch: str, config: dict[str, Any]) -> None:
    """What accelerate's ``save_state`` writes of an FSDP2 run (SHARDED_STATE_DICT): its own ``save_fsdp_model``
    (the DCP folder ``pytorch_model_fsdp_0/``, and with ``use_dcp=False`` a ``pytorch_model_fsdp_0_rank{R}.bin`` per
    rank) and ``save_fsdp_optimizer`` (``optimizer_0/``), and the config, where HF Trainer puts it. Called directly:
    accelerate turns FSDP on only for GPU-family devices (its ``AcceleratorState`` never sets
    ``DistributedType.FSDP`` beside ``MULTI_CPU``), so on the CPU its dispatcher cannot be the one to call them."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer

    # the process group is the run's own; accelerate reads the rank from the environment, as its launcher sets it
    rank = str(dist.get_rank())
    # (MASTER_ADDR and MASTER_PORT too, though the group they would start exists already and is taken as it is)
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(dist.get_world_size()), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))  # fmt: skip
    accelerator = Accelerator(cpu=True)
    assert accelerator.process_index == dist.get_rank() and accelerator.num_processes == dist.get_world_size()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, accelerator, model, out_dir)
    save_fsdp_model(plugin, accelerator, model, out_dir, use_dcp=False)
    save_fsdp_optimizer(plugin, accelerator, opt, model, out_dir)
    if accelerator.process_index == 0:
        build(arch, config).config.save_pretrained(out_dir)


def _fsdp1_worker(rank: int, store_path: str, out_dir: str, arch: str, config: dict[str, Any]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        net = build(arch, config)
        policy = ModuleWrapPolicy({type(blocks(net)[0])})  # each block its own FSDP unit: nested prefixes
        model = FullyShardedDataParallel(net, auto_wrap_policy=policy, device_id=torch.device("cpu"))
        train(model)  # FSDP passes attributes on to the module (loss_of asks for lm_head)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = model.state_dict()
            dcp.save({"model": sharded}, checkpoint_id=os.path.join(out_dir, "dcp"))
            torch.save(sharded, os.path.join(out_dir, f"rank{rank}.pt"))  # ShardedTensors, a file per rank
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            full = model.state_dict()
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "full.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _done(out_dir, rank)


def write_fsdp1(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """A DCP folder ``out/dcp`` of a 2-rank FSDP1 run's SHARDED_STATE_DICT, and ``out/full.pt`` (its
    FULL_STATE_DICT)."""

    out.mkdir(parents=True, exist_ok=True)
    _spawn(_fsdp1_worker, (str(out / "store"), str(out), arch, config), out)
    return out


def write_fsdp2(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """A DCP folder ``out/dcp`` of a 2-rank FSDP2 run, and ``out/full.pt`` (the full model state dict)."""

    out.mkdir(parents=True, exist_ok=True)
    _spawn(_fsdp2_worker, (str(out / "store"), str(out), arch, config), out)
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
    engine.backward(loss_of(engine))
    engine.step()
    engine.save_checkpoint(out_dir)
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    _done(out_dir, rank)


def write_zero3(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """A DeepSpeed ZeRO-3 run folder ``out`` (``latest``, ``global_step1/``) of a 2-rank run."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out.mkdir(parents=True, exist_ok=True)
    _spawn(_zero3_worker, (port, str(out), arch, config), out)
    return out


def _trainer_zero3_worker(out_dir: str, arch: str, config: dict[str, Any]) -> None:
    """One rank of ``Trainer.train()`` with DeepSpeed ZeRO-3 (the CPU accelerator), two steps, a checkpoint at the
    second; the rank from the environment, as the ``deepspeed`` and ``torchrun`` launchers set it."""
    import transformers as tf

    torch.set_num_threads(1)
    model = build(arch, config)
    data = [{"input_ids": IDS[0], "labels": IDS[0]}] * 4
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                 "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3},
                 "zero_allow_untested_optimizer": True}  # fmt: skip
    args = tf.TrainingArguments(out_dir, max_steps=2, save_steps=2, per_device_train_batch_size=1, report_to=[],
                                disable_tqdm=True, deepspeed=ds_config, use_cpu=True)  # fmt: skip
    # a bare encoder (BERT) has no loss of its own: the Trainer's compute_loss_func gives it loss_of's
    encoder = None if hasattr(model, "lm_head") else (lambda out, labels, **_: out.last_hidden_state.pow(2).mean())
    tf.Trainer(model=model, args=args, train_dataset=data, compute_loss_func=encoder).train()
    _done(out_dir, int(os.environ["RANK"]))


def write_trainer_zero3(out: Path, arch: str, config: dict[str, Any]) -> Path:
    """HF Trainer's ``checkpoint-2/`` of a 2-rank DeepSpeed ZeRO-3 run in ``out`` (``config.json``, ``latest``,
    ``global_step2/``' rank files, ``trainer_state.json``, …); returns the checkpoint folder."""
    import json

    from tests.deepspeed_runs import launch

    out.mkdir(parents=True, exist_ok=True)
    launch(["-m", "tests.hf_runs", "trainer-zero3", str(out), arch, json.dumps(config)], world=WORLD, done=out,
           what=f"HF Trainer with DeepSpeed ZeRO-3 ({arch})")  # fmt: skip
    return out / "checkpoint-2"


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1] == "trainer-zero3":
        _trainer_zero3_worker(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
