"""The pickles of a DeepSpeed run's rank files, read inertly (DeepSpeed's own classes stay unbuilt records, a flat
partition is a tensor record): every rank's optimizer file, the module files the stage needs, each group's
optimizer state; and the checks that all of them are one run's."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.deepspeed.files import MODEL_FILE, OPTIM_FILE
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.safety import allowlist


def read_pickle(path: str, *, allowed: frozenset[str]) -> tuple[Any, Any]:
    """The inert tree of a rank file and its archive; DeepSpeed's own classes stay unbuilt records."""
    from ckptfix.formats.torchzip.reader import read_torch_zip

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
    mappings: Any = None  # ZeRO-1/2's param_slice_mappings: which slice of which parameter this rank's partition holds
    group_paddings: Any = None  # ZeRO-1/2: each group's padding cut from this rank's partition (the last rank's)
    config: Any = None  # ds_config, as the run was configured (stage, precision)
    saved_as: str | None = None  # the file name torch.save was given, where its archive keeps one (saved_name)
    loss_scaler: Any = None  # the run's loss scaler (an fp16 run's DynamicLossScaler), as saved


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
    return OptimFile(
        path,
        rank,
        stage,
        world,
        tree.get("ds_version", osd.get("ds_version")),
        groups,
        osd.get("param_alignment_paddings"),
        base,
        osd.get("dynamic_loss_scale"),
        osd.get("param_slice_mappings"),
        osd.get("group_paddings"),
        tree.get("ds_config"),
        saved_name(z),
        osd.get("loss_scaler"),
    )


RENAMED = "the rank files were renamed or swapped: give each file its own rank's name"


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
        same(
            o.path, "fp32 master dtype", [t.dtype for t, _ in o.groups], [t.dtype for t, _ in first.groups], first.path
        )
        # an fp16 run's files are named as an fp32 run's, and hold the same partition sizes: its loss scaler differs
        same(o.path, "dynamic_loss_scale", o.dynamic_scale, first.dynamic_scale, first.path)
        same_config(o.path, o.config, first)
    return ranks


def config_claims(config: Any) -> dict[str, Any]:
    """What a rank file's ``ds_config`` says of its run, where it says it: the ZeRO stage and the precision."""
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and type(zero.get("stage")) is int:
        out["ZeRO stage"] = zero["stage"]
    enabled: dict[str, bool] = {}
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = config.get(key)
        value = section.get("enabled", False) if isinstance(section, dict) else False
        if type(value) is not bool:  # "auto", left for a trainer to fill in: nothing claimed
            return out
        enabled[name] = enabled.get(name, False) or value
    out["precision"] = "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"
    return out


def same_config(path: str, config: Any, first: OptimFile) -> None:
    """Rank file ``path``'s ``ds_config`` says the run ``first`` says: the optimizer file's own ``zero_stage``, and
    the precision its ``ds_config`` gives (a file copied in from another run of the same shapes records its own)."""
    claims, expected = config_claims(config), config_claims(first.config)
    expected["ZeRO stage"] = first.stage
    for what, value in claims.items():
        if what in expected:
            same(path, f"ds_config's {what}", value, expected[what], first.path)


def module_trees(
    models: Mapping[int | None, str], first: OptimFile, *, tag_dir: str, allowed: frozenset[str]
) -> dict[int | None, tuple[Any, Any]]:
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
        same_config(path, tree.get("ds_config"), first)
        if "dp_world_size" in tree:
            same(path, "data-parallel world size", tree["dp_world_size"], world, first.path)
    if stage == 3:
        check_tied_names_rank(trees, models)
    return trees


def check_tied_names_rank(trees: Mapping[int | None, tuple[Any, Any]], models: Mapping[int | None, str]) -> None:
    """ZeRO-3: what a module file's pickle says of its rank. All it holds is the same on every rank but for values
    (buffers, each rank's fragment of the frozen parameters) and one field: DeepSpeed's
    ``_get_shared_params`` fills ``shared_params`` (the tied names) on the job's rank 0 alone, whose file is
    ``zero_pp_rank_0`` (rank 0 is first in its data-parallel group). So in a model with tied parameters the file
    that names them is rank 0's; in a model without any, nothing is claimed. A swap of rank 0's file with another
    would otherwise drop the tied names (read from rank 0's file) and join the frozen parameters out of order."""
    tied = [
        r for r, (tree, _) in trees.items() if isinstance(tree.get("shared_params"), dict) and tree["shared_params"]
    ]
    for r in tied:
        if r != 0 and 0 in models:
            has = "names them too" if 0 in tied else "names none"
            raise FormatError(
                f"{models[r]}: its shared_params name tied parameters, which DeepSpeed saves in rank 0's module file "
                f"alone, but its name says rank {r} ({os.path.basename(models[0])} {has}); {RENAMED}"
            )


def param_groups(main: Mapping[str, Any], first: OptimFile, *, path: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The module file's ``param_shapes``: each optimizer group's parameters in the order its flat partition holds
    them; as many groups as the optimizer files hold."""
    groups = [[(str(k), shape_of(v, path=path, key=str(k))) for k, v in g.items()] for g in main["param_shapes"]]
    if len(groups) != len(first.groups):
        raise FormatError(
            f"{path}: {len(groups)} parameter groups but {first.path} holds {len(first.groups)}; "
            f"the folder mixes two runs"
        )
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
                raise FormatError(
                    f"{o.path}: optimizer state '{key}' of group {k} has shape {list(t.shape)}, but "
                    f"the fp32 partition has {list(flat.shape)}; the file is damaged"
                )
            value = t
        elif any(isinstance(x, (inert.Inert, inert.StorageRef)) for x in inert_trees.walk(value)):
            raise FormatError(f"{o.path}: optimizer state '{key}' of group {k} holds objects ckptfix does not carry")
        out[str(key)] = value
    return out


def check_partitions(ranks: list[OptimFile], groups: list[list[tuple[str, tuple[int, ...]]]]) -> None:
    """ZeRO-1/2: each optimizer file holds the partition its name's rank holds. Its rank is only in its name, but
    it records which slices of which parameters it holds (``param_slice_mappings``, where DeepSpeed saved them)
    and its partition lengths (every rank's the same but the last's, cut by its padding): a file renamed or
    swapped with another rank's would otherwise be joined in the wrong order."""
    world = len(ranks)
    for g, params in enumerate(groups):
        sizes = [o.groups[g][0].numel() for o in ranks]
        offsets = _offsets(params, ranks[0].paddings, g)
        if offsets is not None:
            full = max(n + _padding(o, g) for n, o in zip(sizes, ranks, strict=True))
            claims = [_fragments(o, g) for o in ranks]
            for o, claim in zip(ranks, claims, strict=True):
                if claim is None or claim == _expected(offsets, o.rank, full):
                    continue
                other = next((r for r in range(world) if claim == _expected(offsets, r, full)), None)
                if other is None:
                    continue  # not any rank's: the sizes below, or the layout, say what is wrong
                holder = next(
                    (p.path for p, c in zip(ranks, claims, strict=True) if c == _expected(offsets, o.rank, full)), None
                )
                also = f" ({os.path.basename(holder)} holds rank {o.rank}'s)" if holder else ""
                raise FormatError(
                    f"{o.path}: its param_slice_mappings are rank {other}'s partition, but its name says "
                    f"rank {o.rank}{also}; {RENAMED}"
                )
        for o, n in zip(ranks[1:], sizes[1:], strict=True):
            last = o.rank == world - 1
            if n > sizes[0] or (n != sizes[0] and not last):
                raise FormatError(
                    f"{o.path}: group {g}'s partition holds {n} elements, {'more than' if n > sizes[0] else 'not'} "
                    f"the {sizes[0]} of {os.path.basename(ranks[0].path)}; only the last rank's partition is shorter: "
                    f"{RENAMED}"
                )


def saved_name(z: Any) -> str | None:
    """The rank file name ``torch.save`` was given, where the archive keeps it: torch names the archive's one
    folder after the file it saves to (``zero_pp_rank_1_mp_rank_00_optim_states/data.pkl``; a save to
    ``NAME.pt.tmp`` keeps ``NAME.pt``), and ``archive`` when it saves through a file object (DeepSpeed's fast
    checkpoint writer). None where the folder is not a DeepSpeed rank file's name: nothing is claimed then."""
    name = z.archive.prefix.rstrip("/").removesuffix(".pt") + ".pt"
    return name if _identity(name) is not None else None


def _identity(name: str) -> tuple[str, str | None, str] | None:
    """What a rank file's name says it is: module or optimizer file, of which rank (None: ZeRO-1/2's one module
    file) and model-parallel rank; a ``bf16_`` prefix says nothing of the rank."""
    if m := MODEL_FILE.match(name):
        return "module", m.group(1), m.group(2)
    if m := OPTIM_FILE.match(name):
        return "optimizer", m.group(1), m.group(2)
    return None


def check_saved_names(
    models: Mapping[int | None, str], trees: Mapping[int | None, tuple[Any, Any]], ranks: list[OptimFile]
) -> None:
    """Every stage: each rank file is the file its name says, where its archive says which it was saved as. Its
    rank is in its name and, where torch.save was given its path (DeepSpeed's default checkpoint engine), in its
    archive too; a ZeRO-3 file records nothing else of its rank (but rank 0's tied names), so a swap of its
    optimizer files would otherwise be joined in the wrong order."""
    saved = {**{models[r]: saved_name(z) for r, (_, z) in trees.items()}, **{o.path: o.saved_as for o in ranks}}
    for path, was in saved.items():
        name = os.path.basename(path)
        if was is None or _identity(was) == _identity(name):
            continue
        holder = next((p for p, w in saved.items() if w is not None and _identity(w) == _identity(name)), None)
        also = f" ({os.path.basename(holder)} was saved as {name})" if holder else ""
        raise FormatError(
            f"{path}: torch.save wrote it as {was} (its archive keeps the name), but it is named "
            f"{name}{also}; {RENAMED}"
        )


def _offsets(params: list[tuple[str, tuple[int, ...]]], paddings: Any, g: int) -> list[tuple[str, int, int]] | None:
    """Group ``g``'s parameters as (name, first element, count) in its flat vector; None where the alignment
    paddings are not usable (the layout refuses them)."""
    pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
    if pads is not None and (
        not isinstance(pads, list) or len(pads) != len(params) or not all(type(p) is int and p >= 0 for p in pads)
    ):
        return None
    out: list[tuple[str, int, int]] = []
    at = 0
    for i, (name, shape) in enumerate(params):
        numel = math.prod(shape)
        out.append((name, at, numel))
        at += numel + (pads[i] if pads is not None else 0)
    return out


def _padding(o: OptimFile, g: int) -> int:
    pads = o.group_paddings
    value = pads[g] if isinstance(pads, list) and g < len(pads) else 0
    return value if type(value) is int and value >= 0 else 0


def _expected(offsets: list[tuple[str, int, int]], rank: int, full: int) -> dict[str, tuple[int, int]]:
    """Which slices (start in the partition, count) of which parameters rank ``rank``'s partition holds."""
    lo, hi = rank * full, (rank + 1) * full
    out: dict[str, tuple[int, int]] = {}
    for name, at, numel in offsets:
        start, end = max(at, lo), min(at + numel, hi)
        if start < end:
            out[name] = (start - lo, end - start)
    return out


def _fragments(o: OptimFile, g: int) -> dict[str, tuple[int, int]] | None:
    """Group ``g``'s ``param_slice_mappings`` of rank file ``o`` as {name: (start, count)}; None where it saved
    none, or not as DeepSpeed writes them (``fragment_address`` records): nothing is claimed then."""
    maps = o.mappings
    raw = maps[g] if isinstance(maps, list) and g < len(maps) else None
    if not isinstance(raw, dict):
        return None
    out: dict[str, tuple[int, int]] = {}
    for name, frag in raw.items():
        state = frag.state if isinstance(frag, inert.Inert) else None
        if not isinstance(state, dict) or not all(type(state.get(k)) is int for k in ("start", "numel")):
            return None
        out[str(name)] = (state["start"], state["numel"])
    return out
