"""DeepSpeed ZeRO checkpoint folders, read without running their pickles and without loading the partitions.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/`` with:

- the module file, ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  per rank (ZeRO-3): the module's state dict in the training dtype (ZeRO-3: parameters are empty ``[0]``
  placeholders), ``buffer_names``, ``param_shapes`` (one ordered dict per parameter group: the order the flat
  partitions hold them in), ``frozen_param_shapes``/``frozen_param_fragments`` (parameters outside the optimizer;
  ZeRO-3: each rank's partition of them), ``shared_params`` (tied names), ``ds_version``;
- one optimizer file per rank, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: under
  ``optimizer_state_dict`` the ZeRO stage, ``partition_count`` and the rank's fp32 master partition of each group
  (``single_partition_of_fp32_groups``, ZeRO-1/2; ``fp32_flat_groups``, ZeRO-3), next to the optimizer's own state
  and the loss scaler's (``loss_scaler``, ``dynamic_loss_scale``, ``overflow``: an fp16 run's ``DynamicLossScaler``;
  the master partitions and moments are saved unscaled, so nothing of it is needed). Only bf16 runs prefix ``bf16_``:
  fp16 and fp32 runs name their files alike, and the module file's dtype tells them apart.

Every file is an ordinary torch zip: its pickle is read inertly (DeepSpeed's own classes, ``ZeroStageEnum``,
``LossScaler``, ``fragment_address``, stay unbuilt records), and a flat partition is a storage record whose bytes
are a known range of the file. So each consolidated tensor is a list of byte ranges (:class:`Piece`) computed from
the shapes alone, exactly as ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` slices the partitions:

- ZeRO-1/2: group ``g``'s full flat vector is the ranks' partitions one after another; its parameters lie in it in
  ``param_shapes`` order (plus ``param_alignment_paddings`` where saved).
- ZeRO-3: each rank holds ``ceil(numel / world)`` elements of every parameter, one after another across its
  groups; a parameter is its slice of rank 0, then of rank 1, …, cut to its size (the last rank's padding).

Which file is which rank comes from its name (:mod:`.files`, which also says what to do with one rank's file passed
alone); what a file is, from what it holds (:mod:`.pickles`), which checks what each file records of itself against
its name and the run: a ZeRO-1/2 optimizer file's ``param_slice_mappings`` and partition lengths (its rank), every
file's ``ds_config`` (stage, precision). ZeRO-3 files record nothing of their rank. The layout math is pure
(:mod:`.layout`), the records and their reading are :mod:`.tensors`, the I/O is :func:`describe_run`.

The optimizer state (``describe_run(..., optimizer=True)``, :func:`load_training_state`) is laid out the same way, by
:mod:`.optimizer`; what else the run carries (scheduler, counters, client state) by :mod:`.state`.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import FormatError
from ckptfix.formats.deepspeed.files import (
    is_deepspeed,
    rank_files,
    tag_folder,
)
from ckptfix.formats.deepspeed.layout import Segment, layout_partitioned, layout_stage3
from ckptfix.formats.deepspeed.optimizer import optimizer_state, optimizer_tensors
from ckptfix.formats.deepspeed.pickles import (
    OptimFile,
    check_partitions,
    check_saved_names,
    module_trees,
    optimizer_ranks,
    param_groups,
    shape_of,
)
from ckptfix.formats.deepspeed.state import carried_state
from ckptfix.formats.deepspeed.tensors import Piece, ZeroTensor, check_bytes, piece, read_zero_tensor, tensors_in
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import map_tree
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchzip.archive import Record

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class RunFile:
    """One file of the run and what it holds (for ``inspect``)."""

    path: str
    role: str  # "module" or "optimizer"
    rank: int | None
    holds: str


@dataclass
class ZeroRun:
    """A checked ZeRO run: the consolidated state dict as records, no tensor byte read."""

    root: str  # the folder passed
    tag_dir: str  # the folder holding the rank files
    stage: int
    world: int
    train_dtype: str
    master_dtype: str
    ds_version: str | None
    files: list[RunFile]
    state: OrderedDict[str, ZeroTensor]
    notes: list[str] = field(default_factory=list)
    # with ``optimizer=True``: a torch ``optimizer.state_dict()`` of :class:`ZeroTensor` records (moments, steps)
    optimizer: dict[str, Any] | None = None
    # with ``optimizer=True``: the run's scheduler, counters, client state and loss scaler (:mod:`.state`)
    carried: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> dict[str, list[Record]]:
        """The storage records the consolidated tensors are read from, per file (each once)."""
        out: dict[str, dict[str, Record]] = {}
        for t in [*self.state.values(), *optimizer_tensors(self.optimizer), *tensors_in(self.carried)]:
            for p in t.pieces:
                out.setdefault(p.path, {})[p.record.name] = p.record
        return {path: list(recs.values()) for path, recs in out.items()}


# -- the run ----------------------------------------------------------------------------------------------


def describe_run(path: str, *, allow_globals: Iterable[str] = (), optimizer: bool = False) -> ZeroRun:
    """Find and check a run's files and lay out its consolidated state dict; no tensor byte is read.
    ``optimizer=True`` lays out the optimizer's state too (:attr:`ZeroRun.optimizer`)."""
    root = os.fspath(path)
    tag_dir = tag_folder(root)
    allowed = allowlist.allowed_names(list(allow_globals), source=root)
    models, optims = rank_files(tag_dir)
    ranks = optimizer_ranks(optims, tag_dir=tag_dir, allowed=allowed)
    first, stage, world = ranks[0], ranks[0].stage, ranks[0].world
    trees = module_trees(models, first, tag_dir=tag_dir, allowed=allowed)
    main_rank = next(iter(trees))  # None (ZeRO-1/2's one module file) or rank 0
    main_path, (main, main_zip) = models[main_rank], trees[main_rank]
    module = main["module"]
    groups = param_groups(main, first, path=main_path)
    layout = _layout(groups, ranks, source=tag_dir)
    if stage <= 2:
        check_partitions(ranks, groups)
    check_saved_names(models, trees, ranks)
    master = first.groups[0][0].dtype
    # zero_to_fp32's order: buffers, frozen parameters, trainable parameters, tied names
    buffer_names = [str(n) for n in main["buffer_names"] if n in module]
    state = _buffers(module, buffer_names, main_zip, path=main_path)
    frozen = main.get("frozen_param_shapes") or {}
    fragments = {r: tree.get("frozen_param_fragments") or {} for r, (tree, _) in trees.items()}
    for name, raw in frozen.items():
        shape = shape_of(raw, path=main_path, key=str(name))
        state[str(name)] = _frozen(str(name), shape, trees, fragments, models, stage=stage, world=world)
    train_dtype = _train_dtype(module, groups, state, fallback=master)
    state.update(_masters(layout, groups, ranks, master=master))
    for alias, target in (main.get("shared_params") or {}).items():
        if target in state:
            state[str(alias)] = state[target]  # one tensor under two names, as zero_to_fp32 returns it
    check_bytes(state.values(), source=tag_dir, what="")  # the layout checked above; this is the last word on sizes
    ordered: OrderedDict[str, ZeroTensor] = OrderedDict((k, state[k]) for k in module if k in state)
    ordered.update((k, v) for k, v in state.items() if k not in ordered)  # the module's order, as model.state_dict()
    files = _run_files(
        models,
        ranks,
        stage=stage,
        train_dtype=train_dtype,
        master=master,
        module=module,
        buffers=len(buffer_names),
        frozen=len(frozen),
    )
    run = ZeroRun(
        root=root,
        tag_dir=tag_dir,
        stage=stage,
        world=world,
        train_dtype=train_dtype,
        master_dtype=master,
        ds_version=first.version if isinstance(first.version, str) else None,
        files=files,
        state=ordered,
    )
    if stage == 1 and (note := _left_out(module, ordered)):
        run.notes.append(note)
    if optimizer:
        run.optimizer = optimizer_state(ranks, groups, layout, stage=stage, source=tag_dir)

        def tensor(t: inert.InertTensor, key: str) -> ZeroTensor:
            return ZeroTensor(
                key, t.dtype, t.shape, (piece(t, main_zip, path=main_path, start=0, count=t.numel()),), "run state"
            )

        run.carried, left = carried_state(main, first.loss_scaler, tensor=tensor)
        run.notes.extend(left)
    else:
        run.notes.append(
            "optimizer state (Adam moments, step) not carried: the fp32 master weights only (--optimizer carries it)"
        )
    return run


def _layout(
    groups: list[list[tuple[str, tuple[int, ...]]]], ranks: list[OptimFile], *, source: str
) -> dict[str, list[Segment]]:
    """Where each trainable parameter lies in the ranks' flat fp32 partitions, by the stage's layout."""
    first = ranks[0]
    sizes = [[t.numel() for t, _ in o.groups] for o in ranks]
    if first.stage <= 2:
        paddings = first.paddings if isinstance(first.paddings, list) else None
        return layout_partitioned(groups, sizes, paddings=paddings, source=source)
    return layout_stage3([p for g in groups for p in g], sizes, source=source)


def _left_out(module: Mapping[str, Any], ordered: Mapping[str, ZeroTensor]) -> str | None:
    """ZeRO-1: what the module file holds beyond the consolidated state dict (frozen parameters in the training
    dtype, left out as zero_to_fp32 leaves them), said once."""
    if not (left := [k for k in module if k not in ordered and not _is_placeholder(module[k])]):
        return None
    return (
        f"{len(left)} key(s) of the module file ({', '.join(left[:3])}{', …' * (len(left) > 3)}) left out, as "
        f"zero_to_fp32 leaves them: ZeRO-1 saves frozen parameters only in the module file, in the training dtype"
    )


def _buffers(module: Mapping[str, Any], names: list[str], main_zip: Any, *, path: str) -> OrderedDict[str, ZeroTensor]:
    """The buffers, whole in the module file; floating ones cast to float32, as zero_to_fp32 does."""
    state: OrderedDict[str, ZeroTensor] = OrderedDict()
    for name in names:
        value = module[name]
        if not isinstance(value, (inert.InertTensor, inert.InertParameter)):
            raise FormatError(f"{path}: buffer '{name}' is not a tensor; the file is damaged")
        t = inert.tensor_of(value)
        if not t.is_contiguous():
            raise FormatError(f"{path}: buffer '{name}' is not contiguous; the file is damaged")
        cast = "float32" if _floating(t.dtype) and t.dtype != "float32" else None  # zero_to_fp32: v.float()
        state[name] = ZeroTensor(
            name, t.dtype, t.shape, (piece(t, main_zip, path=path, start=0, count=t.numel()),), "buffer", cast
        )
    return state


def _masters(
    layout: Mapping[str, list[Segment]],
    groups: list[list[tuple[str, tuple[int, ...]]]],
    ranks: list[OptimFile],
    *,
    master: str,
) -> dict[str, ZeroTensor]:
    """The trainable parameters: each the byte ranges of its fp32 master partitions that ``layout`` gives."""
    shapes = dict(p for g in groups for p in g)
    out: dict[str, ZeroTensor] = {}
    for name, segs in layout.items():
        pieces = tuple(
            piece(ranks[r].groups[g][0], ranks[r].groups[g][1], path=ranks[r].path, start=s, count=n)
            for r, g, s, n in segs
        )
        out[name] = ZeroTensor(name, master, shapes[name], pieces, "fp32 master")
    return out


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))  # torch's is_floating_point: float8 variants included


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, (inert.InertTensor, inert.InertParameter)) and inert.tensor_of(value).numel() == 0


def _frozen(
    name: str,
    shape: tuple[int, ...],
    trees: Mapping[int | None, tuple[Any, Any]],
    fragments: Mapping[int | None, Any],
    models: Mapping[int | None, str],
    *,
    stage: int,
    world: int,
) -> ZeroTensor:
    """A frozen parameter: rank 0's whole tensor (ZeRO-2), or each rank's partition in order, cut (ZeRO-3)."""
    numel = math.prod(shape)
    pieces: list[Piece] = []
    left = numel
    dtype = None
    for r in [None] if stage <= 2 else range(world):
        frag = fragments[r].get(name)
        if frag is None:
            raise FormatError(f"{models[r]}: frozen parameter '{name}' has no fragment; the file is damaged")
        t = inert.tensor_of(frag) if isinstance(frag, (inert.InertTensor, inert.InertParameter)) else None
        if t is None or not t.is_contiguous():
            raise FormatError(f"{models[r]}: frozen parameter '{name}' is not a contiguous tensor; the file is damaged")
        if dtype is not None and t.dtype != dtype:
            raise FormatError(
                f"{models[r]}: frozen parameter '{name}' is {t.dtype} here, {dtype} on rank 0; the "
                f"folder mixes two runs"
            )
        dtype = t.dtype
        # ZeRO-2 saves the parameter whole, ZeRO-3 each rank's padded partition: any other size misplaces elements
        want = numel if stage <= 2 else math.ceil(numel / world)
        if t.numel() != want:
            raise FormatError(
                f"{models[r]}: frozen parameter '{name}' of shape {list(shape)} has {t.numel()} "
                f"elements here, not {want}; the rank files are from different runs"
            )
        take = min(t.numel(), left)
        if take:
            pieces.append(piece(t, trees[r][1], path=models[r], start=0, count=take))
        left -= take
    if left or dtype is None:
        raise FormatError(
            f"{models[None if stage <= 2 else 0]}: frozen parameter '{name}' of shape {list(shape)} "
            f"has {numel - left} elements saved; the rank files are from different runs"
        )
    return ZeroTensor(name, dtype, shape, tuple(pieces), "frozen")


def _train_dtype(
    module: Mapping[str, Any],
    groups: list[list[tuple[str, tuple[int, ...]]]],
    state: Mapping[str, ZeroTensor],
    *,
    fallback: str,
) -> str:
    """The dtype the module trained in: its trainable parameters' records (ZeRO-3 placeholders keep it)."""
    for g in groups:
        for name, _ in g:
            value = module.get(name)
            if isinstance(value, (inert.InertTensor, inert.InertParameter)):
                return inert.tensor_of(value).dtype
    return fallback


def _run_files(
    models: Mapping[int | None, str],
    ranks: list[OptimFile],
    *,
    stage: int,
    train_dtype: str,
    master: str,
    module: Mapping[str, Any],
    buffers: int,
    frozen: int,
) -> list[RunFile]:
    files: list[RunFile] = []
    for r, path in sorted(models.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        if stage <= 2:
            holds = (
                f"module state dict in {train_dtype} ({len(module)} keys), shapes, {buffers} buffers"
                f"{f', {frozen} frozen parameters' if frozen else ''}"
            )
        else:
            holds = (
                f"rank {r}'s module file: [0] placeholders for parameters, {buffers} buffers"
                f"{f', its partition of {frozen} frozen parameters' if frozen else ''}"
            )
        files.append(RunFile(path, "module", r, holds))
    for o in ranks:
        n = sum(t.numel() for t, _ in o.groups)
        files.append(
            RunFile(
                o.path,
                "optimizer",
                o.rank,
                f"rank {o.rank}'s {master} master partition ({len(o.groups)} "
                f"group{'s' * (len(o.groups) != 1)}, {n:,} elements) and optimizer state",
            )
        )
    return files


# -- the run in memory ------------------------------------------------------------------------------------


def load_training_state(path: str, *, allow_globals: Iterable[str] = (), verify: bool = True) -> dict[str, Any]:
    """What a ZeRO run holds beyond the model, in memory: under ``optimizer`` the consolidated optimizer state dict
    (what ``torch.optim.Optimizer.state_dict()`` returns for the plain model with the same param groups), beside
    it the run's carried entries (:mod:`.state`)."""
    run = describe_run(path, allow_globals=allow_globals, optimizer=True)
    assert run.optimizer is not None  # optimizer=True
    fds: dict[str, int] = {}

    def fd_of(p: str) -> int:
        if p not in fds:
            fds[p] = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fds[p]

    verified: set[tuple[str, str]] | None = set() if verify else None
    try:
        state = {
            i: {
                k: read_zero_tensor(v, fd_of, verified=verified) if isinstance(v, ZeroTensor) else v
                for k, v in s.items()
            }
            for i, s in run.optimizer["state"].items()
        }
        carried = map_tree(run.carried, lambda t: read_zero_tensor(t, fd_of, verified=verified), leaf=ZeroTensor)
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"optimizer": {"state": state, "param_groups": [dict(g) for g in run.optimizer["param_groups"]]}, **carried}


def load_run(path: str, *, allow_globals: Iterable[str] = (), verify: bool = True) -> OrderedDict[str, Any]:
    """The consolidated fp32 state dict of a ZeRO run, in memory (tied names share one tensor)."""
    run = describe_run(path, allow_globals=allow_globals)
    fds: dict[str, int] = {}

    def fd_of(p: str) -> int:
        if p not in fds:
            fds[p] = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fds[p]

    out: OrderedDict[str, Any] = OrderedDict()
    done: dict[int, Any] = {}
    verified: set[tuple[str, str]] | None = set() if verify else None
    try:
        for key, t in run.state.items():
            if id(t) not in done:
                done[id(t)] = read_zero_tensor(t, fd_of, verified=verified)
            out[key] = done[id(t)]
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


__all__ = [
    "RunFile",
    "ZeroRun",
    "describe_run",
    "is_deepspeed",
    "load_run",
    "load_training_state",
]
