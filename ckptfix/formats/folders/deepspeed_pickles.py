"""One DeepSpeed rank file's pickle, read inertly: DeepSpeed's own classes stay unbuilt records, a flat partition
is a tensor record; and the checks that the files of one run agree."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.pickles import inert
from ckptfix.formats.safety import allowlist


def read_pickle(path: str, *, allowed: frozenset[str]) -> tuple[Any, Any]:
    """The inert tree of a rank file and its archive; DeepSpeed's own classes stay unbuilt records."""
    from ckptfix.formats.containers.torchzip import read_torch_zip

    refused: list[str] = []
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        z = read_torch_zip(fd, path, allowed=allowed, refused=refused)
    finally:
        os.close(fd)
    # DeepSpeed's classes are data here, never built; anything else outside the allowlist is refused as usual
    allowlist.refuse([n for n in refused if not n.startswith("deepspeed.")], source=path)
    if not isinstance(z.tree, dict):
        raise FormatError(f"{path}: holds a {type(z.tree).__name__}, not a DeepSpeed checkpoint dict")
    return z.tree, z


def flat_tensor(obj: Any, *, path: str, what: str) -> inert.InertTensor:
    """A flat partition: a plain tensor record, or DeepSpeed's ``_rebuild_from_type_v2`` wrapper (ZeRO-3 keeps
    ``ds_id`` in the tensor's ``__dict__``) around one."""
    if isinstance(obj, inert.Inert) and obj.func.full == "torch._tensor._rebuild_from_type_v2" and len(obj.args) == 4:
        func, cls, args, _state = obj.args
        if getattr(func, "full", "") in ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3") and (
            getattr(cls, "full", "") in ("torch.Tensor", "torch.nn.parameter.Parameter")
        ):
            obj = inert.tensor(func, args)
    if isinstance(obj, inert.InertParameter):
        obj = obj.data
    if not isinstance(obj, inert.InertTensor) or not obj.is_contiguous():
        raise FormatError(f"{path}: {what} is not a contiguous tensor; the file is damaged or not a DeepSpeed file")
    return obj


def shape_of(obj: Any, *, path: str, key: str) -> tuple[int, ...]:
    if isinstance(obj, inert.Inert) and obj.func.full == "torch.Size" and len(obj.args) == 1:
        dims = obj.args[0]
        if isinstance(dims, tuple) and all(type(d) is int and d >= 0 for d in dims):
            return dims
    if isinstance(obj, (tuple, list)) and all(type(d) is int and d >= 0 for d in obj):
        return tuple(obj)
    raise FormatError(f"{path}: shape of '{key}' is not a torch.Size; the file is damaged or not a DeepSpeed file")


def zero_stage(obj: Any, *, path: str) -> int:
    value = obj.args[0] if isinstance(obj, inert.Inert) and len(obj.args) == 1 else obj  # ZeroStageEnum(3)
    if type(value) is not int or value not in (1, 2, 3):
        raise FormatError(f"{path}: zero_stage is {value!r}, not 1, 2 or 3; not a ZeRO optimizer file ckptfix reads")
    return value


@dataclass
class OptimFile:
    path: str
    rank: int
    stage: int
    world: int
    version: Any
    groups: list[tuple[inert.InertTensor, Any]]  # each group's flat fp32 partition on this rank, and its archive
    paddings: Any
    base: Any = None  # the wrapped optimizer's own state_dict (moments per flat group), as saved
    dynamic_scale: Any = None  # dynamic_loss_scale: True in fp16 runs' files (shared by every rank of one run)


def optim_file(path: str, rank: int, *, allowed: frozenset[str]) -> OptimFile:
    tree, z = read_pickle(path, allowed=allowed)
    osd = tree.get("optimizer_state_dict")
    if not isinstance(osd, dict) or "zero_stage" not in osd or "partition_count" not in osd:
        raise FormatError(
            f"{path}: no optimizer_state_dict with zero_stage and partition_count; not a ZeRO optimizer file"
        )
    stage = zero_stage(osd["zero_stage"], path=path)
    count = osd["partition_count"]
    world = max(count) if isinstance(count, list) and count else count  # per group (experts may differ): the max
    if type(world) is not int or world < 1:
        raise FormatError(f"{path}: partition_count is {count!r}; the file is damaged")
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    flats = osd.get(key)
    if not isinstance(flats, list) or not flats:
        raise FormatError(f"{path}: ZeRO-{stage} optimizer file without its '{key}' (the fp32 master partitions)")
    groups = [(flat_tensor(t, path=path, what=f"{key}[{i}]"), z) for i, t in enumerate(flats)]
    base = osd.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict")
    return OptimFile(path, rank, stage, world, tree.get("ds_version", osd.get("ds_version")), groups,
                  osd.get("param_alignment_paddings"), base, osd.get("dynamic_loss_scale"))  # fmt: skip


def same(path: str, what: str, value: Any, expected: Any, first: str) -> None:
    if value != expected:
        raise FormatError(
            f"{path}: {what} {value!r}, but {os.path.basename(first)} says {expected!r}; the folder mixes two runs: "
            f"keep one run's files"
        )
