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

Which file is which rank comes from its name (:mod:`.deepspeed_files`, which also says what to do with one rank's
file passed alone); what a file is, from what it holds (:mod:`.deepspeed_pickles`), which checks what each file
records of itself against its name and the run: a ZeRO-1/2 optimizer file's ``param_slice_mappings`` and partition
lengths (its rank), every file's ``ds_config`` (stage, precision). ZeRO-3 files record nothing of their rank. The
layout math is pure (:mod:`.deepspeed_layout`), the I/O is :func:`describe_run`.

The optimizer state (``describe_run(..., optimizer=True)``, :func:`load_training_state`) is laid out the same way: each
flat group's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``; under ``base_optimizer_state`` for ZeRO-1/2,
``optimizer_state_dict`` for ZeRO-3, keyed by flat group) is partitioned exactly as its fp32 master partition
(ZeRO-1/2 save the moments with the last rank's padding, the master without it: the same leading elements), so
each parameter's moment is the byte ranges of its weight, read from the moment's record instead.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.errors import FormatError
from ckptfix.formats.containers.ziparchive import Record
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.folders.deepspeed_files import (
    CONVERT_THE_RUN,
    is_deepspeed,
    lone_module_note,
    lone_module_summary,
    rank_files,
    refuse_optimizer_partition,
    refuse_placeholders,
    tag_folder,
)
from ckptfix.formats.folders.deepspeed_layout import Segment, layout_partitioned, layout_stage3
from ckptfix.formats.folders.deepspeed_pickles import (
    OptimFile,
    check_partitions,
    check_saved_names,
    group_state,
    module_trees,
    optimizer_ranks,
    param_groups,
    shape_of,
)
from ckptfix.formats.folders.deepspeed_state import carried_state
from ckptfix.formats.pickles import inert, inert_trees
from ckptfix.formats.records import Holder, TensorRecord, map_tree
from ckptfix.formats.safety import allowlist

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of ``path``, inside storage record ``record`` (CRC-checked as a whole)."""

    path: str
    offset: int
    nbytes: int
    record: Record


@dataclass(eq=False)
class ZeroTensor(TensorRecord):
    """A consolidated tensor of a ZeRO run: its bytes are ``pieces`` in order (dtype ``stored``), cast to ``dtype``
    where zero_to_fp32 casts (a half-precision buffer becomes float32)."""

    key: str
    stored: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    origin: str  # "fp32 master", "frozen" (no master copy exists), "buffer", "optimizer state" or "run state"
    cast: str | None = None

    @property
    def dtype(self) -> str:
        return self.cast or self.stored

    @property
    def stored_dtype(self) -> str:
        return self.stored

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def identity(self) -> Hashable:
        # tied names share the one record; the origin keeps a client_state entry apart from a parameter of its name
        return ("zero", self.origin, self.key)

    def _storage(self) -> Hashable:
        return ("zero", self.origin, self.key)

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        return [(p.path, p.offset, p.nbytes) for p in self.pieces if p.nbytes]  # in dtype ``stored``

    def read(self, holder: Holder) -> torch.Tensor:
        """Its pieces read from the rank files ``holder`` opened, each record touched CRC-checked once."""
        return read_zero_tensor(self, holder.file_fd, verified=holder.checked_records)


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
    # with ``optimizer=True``: the run's scheduler, counters, client state and loss scaler (:mod:`.deepspeed_state`)
    carried: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> dict[str, list[Record]]:
        """The storage records the consolidated tensors are read from, per file (each once)."""
        out: dict[str, dict[str, Record]] = {}
        for t in [*self.state.values(), *optimizer_tensors(self.optimizer), *_tensors(self.carried)]:
            for p in t.pieces:
                out.setdefault(p.path, {})[p.record.name] = p.record
        return {path: list(recs.values()) for path, recs in out.items()}


# -- reading the pickles ---------------------------------------------------------------------------------


# -- the layout (pure) -----------------------------------------------------------------------------------


def _piece(t: inert.InertTensor, z: Any, *, path: str, start: int, count: int) -> Piece:
    """Elements ``[start, start + count)`` of contiguous tensor record ``t`` as a byte range of ``path``."""
    rec = z.archive.storage(t.storage.key)
    width = DTYPES[t.dtype].itemsize
    return Piece(path, rec.data_offset + (t.offset + start) * width, count * width, rec)


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
    _check_bytes(state.values(), source=tag_dir, what="")  # the layout checked above; this is the last word on sizes
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
        run.optimizer = _optimizer_state(ranks, groups, layout, stage=stage, source=tag_dir)

        def tensor(t: inert.InertTensor, key: str) -> ZeroTensor:
            return ZeroTensor(
                key, t.dtype, t.shape, (_piece(t, main_zip, path=main_path, start=0, count=t.numel()),), "run state"
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
            name, t.dtype, t.shape, (_piece(t, main_zip, path=path, start=0, count=t.numel()),), "buffer", cast
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
            _piece(ranks[r].groups[g][0], ranks[r].groups[g][1], path=ranks[r].path, start=s, count=n)
            for r, g, s, n in segs
        )
        out[name] = ZeroTensor(name, master, shapes[name], pieces, "fp32 master")
    return out


def _check_bytes(tensors: Iterable[ZeroTensor], *, source: str, what: str) -> None:
    """Each tensor's pieces hold exactly its shape's bytes (``what`` names the kind in the message)."""
    for zt in tensors:
        if sum(p.nbytes for p in zt.pieces) != math.prod(zt.shape) * DTYPES[zt.stored].itemsize:
            raise FormatError(
                f"{source}: {what}'{zt.key}' gets {sum(p.nbytes for p in zt.pieces)} bytes "
                f"for shape {list(zt.shape)}; the rank files are from different runs"
            )


def _tensors(tree: Any) -> list[ZeroTensor]:
    found: list[ZeroTensor] = []
    map_tree(tree, found.append, leaf=ZeroTensor)
    return found


def optimizer_tensors(opt: Mapping[str, Any] | None) -> list[ZeroTensor]:
    """The :class:`ZeroTensor` records of a laid-out optimizer state dict, in order."""
    if not opt:
        return []
    return [v for s in opt["state"].values() for v in s.values() if isinstance(v, ZeroTensor)]


def _optimizer_state(
    ranks: list[OptimFile],
    groups: list[list[tuple[str, tuple[int, ...]]]],
    layout: Mapping[str, list[Segment]],
    *,
    stage: int,
    source: str,
) -> dict[str, Any]:
    """The full torch ``optimizer.state_dict()`` of the consolidated model: each flat group's per-element state
    (Adam's ``exp_avg``, ``exp_avg_sq``) cut exactly as its fp32 master partition is (``layout``), its scalar state
    (``step``) given to each of its parameters, and the saved param groups' hyperparameters with parameter indices
    numbered in param-group order, as ``torch.optim.Optimizer.state_dict()`` numbers them, and each group's
    ``param_names`` (the run's ``param_shapes`` names; frozen parameters are in no group)."""
    first = ranks[0]
    bases = []
    for o in ranks:
        base = o.base
        if (
            not isinstance(base, dict)
            or not isinstance(base.get("state"), dict)
            or not isinstance(base.get("param_groups"), list)
        ):
            hint = " (an elastic checkpoint: its moments are saved unpartitioned)" if isinstance(base, list) else ""
            raise FormatError(
                f"{o.path}: no optimizer state dict in the ZeRO-{stage} optimizer file{hint}; its "
                f"optimizer state cannot be consolidated: convert without --optimizer"
            )
        bases.append(base)
    saved_groups = bases[0]["param_groups"]
    order: list[int] = []  # the flat groups, in the saved param groups' order
    for pg in saved_groups:
        flat_ids = pg.get("params") if isinstance(pg, dict) else None
        if not isinstance(flat_ids, list) or not all(type(i) is int for i in flat_ids):
            raise FormatError(f"{first.path}: a saved param group without its parameter indices; the file is damaged")
        order.extend(flat_ids)
    if sorted(order) != list(range(len(groups))) or len(first.groups) != len(groups):
        raise FormatError(
            f"{first.path}: the saved param groups hold flat groups {order}, but the run has "
            f"{len(groups)}; the file is damaged"
        )
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    index = 0
    for pg in saved_groups:
        # DeepSpeed's own param_names (torch >= 2.6, named groups) name its flat parameters, not the model's
        hyper = {str(k): v for k, v in pg.items() if k not in ("params", "param_names")}
        if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert_trees.walk(hyper)):
            raise FormatError(
                f"{first.path}: a param group's hyperparameters hold tensors or objects, which ckptfix "
                f"does not carry; convert without --optimizer"
            )
        ids: list[int] = []
        names: list[str] = []
        for k in pg["params"]:
            per_rank = [group_state(o, b, k, source=source) for o, b in zip(ranks, bases, strict=True)]
            for name, shape in groups[k]:
                entry: dict[str, Any] = {}
                for key, value in per_rank[0].items():
                    if isinstance(value, inert.InertTensor) and value.shape == ():  # Adam's step: one per parameter
                        piece = _piece(value, first.groups[k][1], path=first.path, start=0, count=1)
                        entry[key] = ZeroTensor(f"{name}.{key}", value.dtype, (), (piece,), "optimizer state")
                    elif isinstance(value, inert.InertTensor):
                        entry[key] = ZeroTensor(
                            f"{name}.{key}",
                            value.dtype,
                            shape,
                            tuple(
                                _moment_piece(ranks, per_rank, key, r, g, s, n, group=k) for r, g, s, n in layout[name]
                            ),
                            "optimizer state",
                        )
                    else:
                        entry[key] = value
                state[index] = entry
                ids.append(index)
                names.append(name)
                index += 1
        # each parameter's name from the run's param_shapes (the flat order its partitions hold), as torch >= 2.6
        # saves a named group's: the name-keyed form (optim_form.to_names) needs no guess from the model's order
        param_groups.append({**hyper, "params": ids, "param_names": names})
    _check_bytes(optimizer_tensors({"state": state}), source=source, what="optimizer state ")
    return {"state": state, "param_groups": param_groups}


def _moment_piece(
    ranks: list[OptimFile],
    per_rank: list[dict[str, Any]],
    key: str,
    r: int,
    g: int,
    start: int,
    count: int,
    *,
    group: int,
) -> Piece:
    """A segment of the layout, read from rank ``r``'s per-element state ``key`` instead of its fp32 partition
    (ZeRO-3: a parameter's slice may cross into the next flat group ``g``)."""
    state = per_rank[r] if g == group else group_state(ranks[r], ranks[r].base, g, source=ranks[r].path)
    t = state.get(key)
    if not isinstance(t, inert.InertTensor) or t.shape == ():
        raise FormatError(
            f"{ranks[r].path}: no optimizer state '{key}' for group {g}, which rank 0 has; the rank "
            f"files are from different runs"
        )
    return _piece(t, ranks[r].groups[g][1], path=ranks[r].path, start=start, count=count)


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
            pieces.append(_piece(t, trees[r][1], path=models[r], start=0, count=take))
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


# -- reading bytes ----------------------------------------------------------------------------------------


def read_zero_tensor(t: ZeroTensor, fd_of: Any, *, verified: set[tuple[str, str]] | None = None) -> torch.Tensor:
    """The consolidated tensor in memory of its own: its pieces read and joined, cast where zero_to_fp32 casts.
    ``fd_of(path)`` gives an open file; with ``verified``, each storage record touched is CRC-checked once."""
    import torch

    from ckptfix.formats.containers.ziparchive import verify_records

    data = bytearray(sum(p.nbytes for p in t.pieces))
    at = 0
    for p in t.pieces:
        fd = fd_of(p.path)
        if verified is not None and (p.path, p.record.name) not in verified:
            verify_records(fd, p.path, [p.record])
            verified.add((p.path, p.record.name))
        view = memoryview(data)[at : at + p.nbytes]
        done = 0
        while done < p.nbytes:
            n = os.preadv(fd, [view[done:]], p.offset + done)
            if n == 0:
                raise FormatError(f"{p.path}: ends inside '{t.key}'; it is truncated: copy the run folder again")
            done += n
        at += p.nbytes
    stored = getattr(torch, t.stored)
    out = torch.frombuffer(data, dtype=torch.uint8).view(stored) if data else torch.empty(0, dtype=stored)
    out = out.reshape(t.shape)
    return out.to(getattr(torch, t.cast)) if t.cast else out


def load_training_state(path: str, *, allow_globals: Iterable[str] = (), verify: bool = True) -> dict[str, Any]:
    """What a ZeRO run holds beyond the model, in memory: under ``optimizer`` the consolidated optimizer state dict
    (what ``torch.optim.Optimizer.state_dict()`` returns for the plain model with the same param groups), beside
    it the run's carried entries (:mod:`.deepspeed_state`)."""
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
    "CONVERT_THE_RUN",
    "Piece",
    "RunFile",
    "ZeroRun",
    "ZeroTensor",
    "describe_run",
    "is_deepspeed",
    "load_run",
    "load_training_state",
    "lone_module_note",
    "lone_module_summary",
    "optimizer_tensors",
    "read_zero_tensor",
    "refuse_optimizer_partition",
    "refuse_placeholders",
]
