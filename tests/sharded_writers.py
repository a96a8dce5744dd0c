"""Sharded checkpoints written by the real writers: torch.distributed.checkpoint from 2 gloo processes, with the
model under FSDP2 (``fully_shard``: each rank holds half of every parameter) or replicated (DDP).

Each run leaves in its folder: ``dcp/`` (``dcp.save`` of the model and optimizer state dicts), ``rank<R>.pt``
(``torch.save(model.state_dict())`` on every rank: DTensor shards under FSDP2), and ``full.pt`` (rank 0's
``get_model_state_dict(full_state_dict=True)`` and the full optimizer state: the truth to compare with).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckptfix.torchcompat import dcp_save_local
from tests.models import SmallNet, TiedNet, inputs, start_method

# FSDP2 (fully_shard) on the CPU with gloo: torch 2.6 and older fail inside it (no fully_shard export before 2.6, a
# CPU stream without record_event in 2.6); the rank-file tests that need a real run skip there.
FSDP2_ON_CPU = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)
NO_FSDP2_REASON = f"FSDP2 does not run on the CPU with torch {torch.__version__}"

WORLD = 2


def _worker(rank: int, store_path: str, out_dir: str, mode: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        model: torch.nn.Module = SmallNet(width=12 if mode.endswith("-wide") else 8)
        if mode.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import Shard

            # "-cols": matrices split by their last dimension, so DCP chunks are column blocks, not row ranges
            cols = mode.endswith("-cols")

            def place(p: torch.Tensor) -> Shard:  # FSDP2 shards dims other than 0 only evenly
                even = [d for d in range(1, p.ndim) if p.shape[d] % WORLD == 0]
                return Shard(even[-1] if cols and even else 0)

            fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)), shard_placement_fn=place)
        else:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(inputs(rank)).square().mean().backward()
        opt.step()
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(out / "dcp"))  # fmt: skip
        torch.save(model.state_dict(), out / f"rank{rank}.pt")
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        truth = {"model": get_model_state_dict(model, options=full),
                 "optim": get_optimizer_state_dict(model, opt, options=full)}  # fmt: skip
        if rank == 0:
            torch.save(truth, out / "full.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp1_worker(rank: int, store_path: str, out_dir: str, world: int, width: int, orig: bool, tied: bool,
                  mixed: bool) -> None:  # fmt: skip
    """FSDP1 (flat parameters) after one training step on rank-dependent data (so BatchNorm statistics differ):
    each rank's flat-parameter slice, its LOCAL_STATE_DICT and SHARDED_STATE_DICT (ShardedTensors; ``train<R>.pt``
    with the sharded optimizer state too), and rank 0's FULL_STATE_DICT (the truth). The head is its own FSDP
    unit, so keys nest under two flat parameters. A second model trained with AdamW writes its files too
    (:func:`_fsdp1_adamw`); ``full_optim.pt`` holds both optimizers' state under FULL_STATE_DICT. Other jobs (for
    LOCAL_STATE_DICT, without the AdamW model): ``orig``: ``use_orig_params=True`` (FSDP pads the flat parameter
    so that each parameter starts 16 bytes in, and to a multiple of the world size); ``tied``: :class:`TiedNet`;
    ``mixed``: ``MixedPrecision(param_dtype=torch.bfloat16)`` (the alignment is then 16 bytes of bfloat16) and no
    training step (CPU BatchNorm has no bfloat16 kernel)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, StateDictType

    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        net = TiedNet(width=width) if tied else SmallNet(width=width)
        how: dict[str, Any] = {"device_id": torch.device("cpu"), "use_orig_params": orig}
        if mixed:
            how["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
        net.head = FullyShardedDataParallel(net.head, **how)  # type: ignore[assignment]
        model = FullyShardedDataParallel(net, **how)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if not mixed:
            model(inputs(rank)).square().mean().backward()
            opt.step()
        if not orig:  # with the original parameters, named_parameters() holds no flat parameter
            torch.save({name: p.detach() for name, p in model.named_parameters()}, out / f"flat{rank}.pt")
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            torch.save(model.state_dict(), out / f"local{rank}.pt")
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            torch.save(model.state_dict(), out / f"sharded{rank}.pt")
            optim = FullyShardedDataParallel.optim_state_dict(model, opt)  # ShardedTensor momentum buffers
            torch.save({"model": model.state_dict(), "optim": optim, "epoch": 1}, out / f"train{rank}.pt")
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            full = model.state_dict()
            full_optim = FullyShardedDataParallel.optim_state_dict(model, opt)  # FQN keys, full tensors
        plain = not (orig or tied or mixed) and world == WORLD
        adamw = _fsdp1_adamw(rank, out, width) if plain else {}  # the optimizer's files: of the plain job only
        if rank == 0:
            torch.save(full, out / "full.pt")
            torch.save({"sgd": full_optim, **adamw}, out / "full_optim.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp1_model(width: int, *, seed: int = 0) -> torch.nn.Module:
    """SmallNet under FSDP1 on the CPU, its head its own FSDP unit (in a process group)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    net = SmallNet(width=width, seed=seed)
    net.head = FullyShardedDataParallel(net.head, device_id=torch.device("cpu"))  # type: ignore[assignment]
    return FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=False)


def _fsdp1_adamw(rank: int, out: Path, width: int) -> dict[str, Any]:
    """FSDP1 with AdamW (``exp_avg``, ``exp_avg_sq``, ``step``), two steps: ``adamw<R>.pt`` ({"model", "optim",
    "epoch"} after the first, SHARDED_STATE_DICT), ``adamw_optim<R>.pt`` (the optimizer state alone), then
    ``adamw_lr<R>.pt`` (the learning rate changed) and ``adamw_step2<R>.pt`` (after the second step): files whose
    state beside the shards differs. Returns the FULL_STATE_DICT model and optimizer state after the first step."""
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    model = _fsdp1_model(width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    def save(name: str, *, alone: str | None = None) -> None:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            optim = FullyShardedDataParallel.optim_state_dict(model, opt)  # ShardedTensor moments
            torch.save({"model": model.state_dict(), "optim": optim, "epoch": 1}, out / f"{name}{rank}.pt")
            if alone is not None:
                torch.save(optim, out / f"{alone}{rank}.pt")

    model(inputs(rank)).square().mean().backward()
    opt.step()
    save("adamw", alone="adamw_optim")
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        # copied: the state dict's buffers are the module's own, which the second step below changes
        truth = copy.deepcopy({"adamw_model": model.state_dict(),
                               "adamw": FullyShardedDataParallel.optim_state_dict(model, opt)})  # fmt: skip
    opt.param_groups[0]["lr"] = 0.02
    save("adamw_lr")
    model(inputs(rank + 2)).square().mean().backward()
    opt.step()
    save("adamw_step2")
    return truth


def write_fsdp1(
    out: Path, *, width: int = 8, world: int = WORLD, orig: bool = False, tied: bool = False, mixed: bool = False
) -> Path:
    """``flat<R>.pt``, ``local<R>.pt``, ``sharded<R>.pt``, ``train<R>.pt`` and the AdamW files of a 2-rank FSDP1
    job, ``full.pt`` (rank 0's FULL_STATE_DICT) and ``full_optim.pt`` (the optimizers' under FULL_STATE_DICT), in
    ``out``. ``width``: SmallNet's, another model for files of two runs. Other jobs, without the AdamW files and
    ``flat<R>.pt`` with ``orig``: ``world`` ranks; ``orig``: ``use_orig_params=True``; ``tied``:
    :class:`~tests.models.TiedNet` (a shared weight); ``mixed``: bfloat16 MixedPrecision, untrained."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    args = (str(out / "store"), str(out), world, width, orig, tied, mixed)
    mp.start_processes(_fsdp1_worker, args=args, nprocs=world, join=True, start_method=start_method())
    return out


def _fsdp1_resume_worker(rank: int, store_path: str, merged: str, out_path: str) -> None:
    """A fresh 2-rank FSDP1 job resuming from a merged ``{"model", "optim"}`` as FSDP documents it: the full model
    state dict loaded under FULL_STATE_DICT, the optimizer's through ``FSDP.optim_state_dict_to_load``; rank 0
    saves the optimizer state it then holds (under FULL_STATE_DICT)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        model = _fsdp1_model(8, seed=99)  # other weights, another learning rate: all must come from the file
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        state = torch.load(merged, weights_only=True)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(state["model"])
            opt.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, opt, state["optim"]))
            back = FullyShardedDataParallel.optim_state_dict(model, opt)
        if rank == 0:
            torch.save(back, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def resume_fsdp1(merged: Path, out: Path) -> dict[str, Any]:
    """Resume a 2-rank FSDP1 job (AdamW) from ``merged``; the optimizer state it holds afterwards."""
    import torch.multiprocessing as mp

    mp.start_processes(_fsdp1_resume_worker, args=(str(out.parent / "fsdp1-resume-store"), str(merged), str(out)),
                       nprocs=WORLD, join=True, start_method=start_method())  # fmt: skip
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


def _resume_worker(rank: int, store_path: str, ckpt_dir: str, out_path: str) -> None:
    """FSDP2 resuming from a DCP folder as training code does: ``dcp.load`` into the sharded model's state dict."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        model = SmallNet(width=8, seed=99)  # different weights: everything must come from the checkpoint
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, state["model"])
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def resume_fsdp2(ckpt_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Load ``ckpt_dir`` into a 2-rank FSDP2 model; its full state dict afterwards."""
    if not FSDP2_ON_CPU:
        pytest.skip(NO_FSDP2_REASON)
    import torch.multiprocessing as mp

    mp.start_processes(_resume_worker, args=(str(out.parent / "resume-store"), str(ckpt_dir), str(out)),
                       nprocs=WORLD, join=True, start_method=start_method())  # fmt: skip
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


MESH_2D = (2, 2)


def _mesh2d_worker(rank: int, store_path: str, out_dir: str) -> None:
    """4 ranks on a (2, 2) mesh: the model under HSDP (``fully_shard`` on the 2-D mesh: Replicate() across the first
    dimension, Shard(0) across the second), and a tensor sharded over both dimensions (Shard(0), Shard(1)) with
    uneven pieces."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    out = Path(out_dir)
    world = MESH_2D[0] * MESH_2D[1]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", MESH_2D, mesh_dim_names=("replicate", "shard"))
        model = SmallNet(width=8)
        fully_shard(model, mesh=mesh)
        model(inputs(rank)).square().mean().backward()
        block = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)  # 7 rows over 2, 5 columns over 2: uneven
        state = {**model.state_dict(), "extra.block": distribute_tensor(block, mesh, [Shard(0), Shard(1)])}
        torch.save(state, out / f"rank{rank}.pt")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({**full, "extra.block": block}, out / "full.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_2d(out: Path) -> Path:
    """``rank<R>.pt`` of 4 ranks on a (2, 2) mesh, and ``full.pt`` (the truth), in ``out``."""
    if not FSDP2_ON_CPU:
        pytest.skip(NO_FSDP2_REASON)
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_mesh2d_worker, args=(str(out / "store"), str(out)), nprocs=MESH_2D[0] * MESH_2D[1],
                       join=True, start_method=start_method())  # fmt: skip
    return out


def write(out: Path, mode: str) -> Path:
    """Run the 2-process job writing into ``out``. ``mode``: ``ddp``, ``fsdp2``, ``fsdp2-wide`` (a wider model) or
    ``fsdp2-cols`` (matrices sharded by columns)."""
    import torch.multiprocessing as mp

    if mode.startswith("fsdp2") and not FSDP2_ON_CPU:
        pytest.skip(NO_FSDP2_REASON)
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(str(out / "store"), str(out), mode), nprocs=WORLD, join=True,
                       start_method=start_method())  # fmt: skip
    return out


def corrupt_chunk(folder: Path, fqn: str, *, record: str = "data/0") -> None:
    """Flip one byte inside record ``record`` (the tensor bytes, or ``data.pkl``: its pickle) of tensor ``fqn``'s
    archive in a one-process DCP folder (its CRC no longer matches)."""
    import pickle

    from ckptfix.formats.torchzip.archive import read_archive

    meta = pickle.loads((folder / ".metadata").read_bytes())  # our own file: safe to unpickle here
    span = next(info for index, info in meta.storage_data.items() if index.fqn == fqn)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    with open(folder / "__0_0.distcp", "rb") as f:
        records = read_archive(f.fileno(), "x", start=span.offset, end=span.offset + span.length).records
    tensor = next(r for r in records if r.name.endswith(record))
    data[tensor.data_offset + tensor.size // 2] ^= 0xFF
    (folder / "__0_0.distcp").write_bytes(bytes(data))


def _dcp_save(state: Any, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: the intent here
        dcp_save_local(state, checkpoint_id=str(folder))


def _dcp_truth(folder: Path, tmp: Path) -> Any:
    """What DCP's own reader makes of a folder."""
    dcp_to_torch_save(str(folder), str(tmp / "dcp_truth.pt"))
    return torch.load(tmp / "dcp_truth.pt", weights_only=True)
