"""The pickles of a DeepSpeed run's rank files, read inertly (DeepSpeed's own classes stay unbuilt records, a flat
partition is a tensor record): every rank's optimizer file, the module files the stage needs, each group's
optimizer state; and the checks that all of them are one run's."""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def optimizer_ranks(optims: Mapping[int, str], *, tag_dir: str, allowed: frozenset[str]) -> list[OptimFile]:
    """Every rank's optimizer file, read, in rank order: one per rank of the run (``partition_count``), no more,
    all saying the same of the run."""
    first = optim_file(optims[min(optims)], min(optims), allowed=allowed)
    stage, world = first.stage, first.world
    present = sum(1 for r in optims if r < world)  # never counted up to the declared world: it may be 2**40
    if present < world:
        gap = next(r for r in range(len(optims) + 1) if r not in optims)  # one of 0..len(optims) is absent
        name = os.path.basename(optims[min(optims)]).replace(f"rank_{min(optims)}_", f"rank_{gap}_", 1)
        raise FormatError(
            f"{os.path.join(tag_dir, name)}: missing ({world - present} of {world} ranks' optimizer files missing); "
            f"every rank's file is needed: copy the whole tag folder"
        )
    extra = [r for r in optims if r >= world]
    if extra:
        raise FormatError(
            f"{optims[extra[0]]}: rank {extra[0]} of a run of {world} ranks ({os.path.basename(first.path)} says "
            f"partition_count {world}); the folder mixes two runs: keep one run's files"
        )
    ranks = [first] + [optim_file(optims[r], r, allowed=allowed) for r in range(world) if r != first.rank]
    ranks.sort(key=lambda o: o.rank)
    for o in ranks:
        same(o.path, "ZeRO stage", o.stage, stage, first.path)
        same(o.path, "partition_count", o.world, world, first.path)
        same(o.path, "ds_version", o.version, first.version, first.path)
        same(o.path, "number of parameter groups", len(o.groups), len(first.groups), first.path)
        same(o.path, "fp32 master dtype", [t.dtype for t, _ in o.groups], [t.dtype for t, _ in first.groups],
             first.path)  # fmt: skip
        # an fp16 run's files are named as an fp32 run's, and hold the same partition sizes: its loss scaler differs
        same(o.path, "dynamic_loss_scale", o.dynamic_scale, first.dynamic_scale, first.path)
    return ranks


def module_trees(models: Mapping[int | None, str], first: OptimFile, *, tag_dir: str,
                  allowed: frozenset[str]) -> dict[int | None, tuple[Any, Any]]:  # fmt: skip
    """The module files the stage needs (ZeRO-1/2: the one file; ZeRO-3: one per rank), read, the main one first:
    none missing, none of another run, each saying the same of the run."""
    stage, world = first.stage, first.world
    wanted: list[int | None] = [None] if stage <= 2 else list(range(world))
    for r in wanted:
        if r not in models:
            name = "mp_rank_00_model_states.pt" if r is None else f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            raise FormatError(
                f"{os.path.join(tag_dir, name)}: missing (ZeRO-{stage} run of {world} ranks: the module file"
                f"{'s' if r is not None else ''} {'are' if r is not None else 'is'} needed); copy the whole tag folder"
            )
    stray = [r for r in models if r not in wanted]
    if stray:
        raise FormatError(
            f"{models[stray[0]]}: a module file of a ZeRO-{1 if stray[0] is None else 3} run beside ZeRO-{stage} "
            f"optimizer files; the folder mixes two runs: keep one run's files"
        )
    trees = {r: read_pickle(models[r], allowed=allowed) for r in wanted}
    main_path = models[wanted[0]]
    main = trees[wanted[0]][0]
    for key in ("module", "buffer_names", "param_shapes"):
        if key not in main:
            raise FormatError(f"{main_path}: no '{key}'; not a DeepSpeed module file")
    if not isinstance(main["module"], dict) or not isinstance(main["param_shapes"], list):
        raise FormatError(f"{main_path}: 'module' or 'param_shapes' is not what DeepSpeed writes; the file is damaged")
    for r, (tree, _) in trees.items():
        path = models[r]
        same(path, "ds_version", tree.get("ds_version"), first.version, first.path)
        if "dp_world_size" in tree:
            same(path, "data-parallel world size", tree["dp_world_size"], world, first.path)
    return trees


def param_groups(main: Mapping[str, Any], first: OptimFile, *, path: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The module file's ``param_shapes``: each optimizer group's parameters in the order its flat partition holds
    them; as many groups as the optimizer files hold."""
    groups = [[(str(k), shape_of(v, path=path, key=str(k))) for k, v in g.items()] for g in main["param_shapes"]]
    if len(groups) != len(first.groups):
        raise FormatError(f"{path}: {len(groups)} parameter groups but {first.path} holds {len(first.groups)}; "
                          f"the folder mixes two runs")  # fmt: skip
    return groups


def group_state(o: OptimFile, base: Mapping[str, Any], k: int, *, source: str) -> dict[str, Any]:
    """Rank ``o``'s optimizer state of flat group ``k``: per-element tensors checked to match its fp32 partition."""
    raw = base["state"].get(k, {})
    if not isinstance(raw, dict):
        raise FormatError(f"{o.path}: the optimizer state of group {k} is not a dict; the file is damaged")
    flat = o.groups[k][0]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, (inert.Inert, inert.InertTensor)):
            t = flat_tensor(value, path=o.path, what=f"optimizer state '{key}' of group {k}")
            # the fp32 partition is saved without the last rank's padding, the moments with it (at the end)
            if t.shape != () and (len(t.shape) != 1 or t.numel() < flat.numel()):
                raise FormatError(f"{o.path}: optimizer state '{key}' of group {k} has shape {list(t.shape)}, but "
                                  f"the fp32 partition has {list(flat.shape)}; the file is damaged")  # fmt: skip
            value = t
        elif any(isinstance(x, (inert.Inert, inert.StorageRef)) for x in inert.walk(value)):
            raise FormatError(f"{o.path}: optimizer state '{key}' of group {k} holds objects ckptfix does not carry")
        out[str(key)] = value
    return out
