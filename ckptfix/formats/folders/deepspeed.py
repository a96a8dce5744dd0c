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

Which file is which rank comes from its name (nothing inside says it); what a file is, from what it holds. The
layout math is pure (:func:`layout_partitioned`, :func:`layout_stage3`), the I/O is :func:`describe_run`.

The optimizer state (``describe_run(..., optimizer=True)``, :func:`load_optimizer`) is laid out the same way: each
flat group's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``; under ``base_optimizer_state`` for ZeRO-1/2,
``optimizer_state_dict`` for ZeRO-3, keyed by flat group) is partitioned exactly as its fp32 master partition
(ZeRO-1/2 save the moments with the last rank's padding, the master without it: the same leading elements), so
each parameter's moment is the byte ranges of its weight, read from the moment's record instead.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ckptfix.errors import FormatError
from ckptfix.formats.containers.ziparchive import Record
from ckptfix.formats.dtypes import DTYPES
from ckptfix.formats.pickles import inert
from ckptfix.formats.safety import allowlist

if TYPE_CHECKING:
    import torch

LATEST = "latest"
MAX_LATEST = 4096  # a tag name; anything larger is not DeepSpeed's ``latest`` file
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Files of expert- or pipeline-parallel runs: other layouts, which zero_to_fp32 does not consolidate either.
_OTHER_STATES = re.compile(r"^(?:.*expp_rank_\d+.*|layer_\d+-model_\d+-model_states)\.pt$")
_PLACEHOLDER_HINT = "pass the run folder (with its 'latest' file) or the tag folder (global_stepN/)"


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of ``path``, inside storage record ``record`` (CRC-checked as a whole)."""

    path: str
    offset: int
    nbytes: int
    record: Record


@dataclass(eq=False)
class ZeroTensor:
    """A consolidated tensor of a ZeRO run: its bytes are ``pieces`` in order (dtype ``stored``), cast to ``dtype``
    where zero_to_fp32 casts (a half-precision buffer becomes float32)."""

    __ckptfix_tensor__: ClassVar[bool] = True
    key: str
    stored: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    origin: str  # "fp32 master", "frozen" (training dtype: no master copy exists), "buffer" or "optimizer state"
    cast: str | None = None

    @property
    def dtype(self) -> str:
        return self.cast or self.stored

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


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

    @property
    def records(self) -> dict[str, list[Record]]:
        """The storage records the consolidated tensors are read from, per file (each once)."""
        out: dict[str, dict[str, Record]] = {}
        for t in [*self.state.values(), *optimizer_tensors(self.optimizer)]:
            for p in t.pieces:
                out.setdefault(p.path, {})[p.record.name] = p.record
        return {path: list(recs.values()) for path, recs in out.items()}


# -- detection -------------------------------------------------------------------------------------------


def is_deepspeed(path: str) -> bool:
    """A DeepSpeed run folder (a ``latest`` file naming a tag folder) or one tag folder (its rank files)."""
    if not os.path.isdir(path):
        return False
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        if _read_latest(latest, strict=False) is not None:
            return True  # a tag that is not there is refused, by name
        # a 'latest' naming no tag ('../x', an absolute path) beside a tag folder: refused naming 'latest', not
        # "no checkpoint here"
        try:
            return any(_holds_rank_files(os.path.join(path, n)) for n in _tags(path))
        except OSError:
            return False
    return _holds_rank_files(path)


def _holds_rank_files(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(OPTIM_FILE.match(n) for n in names) or any(MODEL_FILE.match(n) for n in names)


def _read_latest(path: str, *, strict: bool) -> str | None:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise OSError("not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_LATEST + 1)
    except OSError as e:
        if strict:
            raise FormatError(f"{path}: cannot read DeepSpeed's 'latest' file ({e}); pass the tag folder") from e
        return None
    tag = raw.decode("utf-8", "replace").strip()
    if len(raw) > MAX_LATEST or not tag or "\0" in tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        if strict:
            raise FormatError(f"{path}: does not name a tag folder (found {raw[:40]!r}); pass the tag folder itself")
        return None
    return tag


def tag_folder(path: str) -> str:
    """The folder holding the rank files: ``path/<latest>`` for a run folder, else ``path`` itself."""
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        return path
    tag = _read_latest(latest, strict=True)
    assert tag is not None  # strict: a bad tag raised
    tag_dir = os.path.join(path, tag)
    real = os.path.realpath(path)
    if os.path.commonpath([real, os.path.realpath(tag_dir)]) != real or not os.path.isdir(tag_dir):
        raise FormatError(
            f"{latest}: names tag '{tag}', which is not a folder here; the run is incomplete: pass a tag folder "
            f"that is there ({', '.join(_tags(path)) or 'none found'})"
        )
    return tag_dir


def _tags(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))


# -- reading the pickles ---------------------------------------------------------------------------------


def _read_pickle(path: str, *, allowed: frozenset[str]) -> tuple[Any, Any]:
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


def _flat(obj: Any, *, path: str, what: str) -> inert.InertTensor:
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


def _piece(t: inert.InertTensor, z: Any, *, path: str, start: int, count: int) -> Piece:
    """Elements ``[start, start + count)`` of contiguous tensor record ``t`` as a byte range of ``path``."""
    rec = z.archive.by_name[f"{z.archive.prefix}data/{t.storage.key}"]
    width = DTYPES[t.dtype].itemsize
    return Piece(path, rec.data_offset + (t.offset + start) * width, count * width, rec)


def _size(obj: Any, *, path: str, key: str) -> tuple[int, ...]:
    if isinstance(obj, inert.Inert) and obj.func.full == "torch.Size" and len(obj.args) == 1:
        dims = obj.args[0]
        if isinstance(dims, tuple) and all(type(d) is int and d >= 0 for d in dims):
            return dims
    if isinstance(obj, (tuple, list)) and all(type(d) is int and d >= 0 for d in obj):
        return tuple(obj)
    raise FormatError(f"{path}: shape of '{key}' is not a torch.Size; the file is damaged or not a DeepSpeed file")


def _stage(obj: Any, *, path: str) -> int:
    value = obj.args[0] if isinstance(obj, inert.Inert) and len(obj.args) == 1 else obj  # ZeroStageEnum(3)
    if type(value) is not int or value not in (1, 2, 3):
        raise FormatError(f"{path}: zero_stage is {value!r}, not 1, 2 or 3; not a ZeRO optimizer file ckptfix reads")
    return value


@dataclass
class _Optim:
    path: str
    rank: int
    stage: int
    world: int
    version: Any
    groups: list[tuple[inert.InertTensor, Any]]  # each group's flat fp32 partition on this rank, and its archive
    paddings: Any
    base: Any = None  # the wrapped optimizer's own state_dict (moments per flat group), as saved
    dynamic_scale: Any = None  # dynamic_loss_scale: True in fp16 runs' files (shared by every rank of one run)


def _optim_file(path: str, rank: int, *, allowed: frozenset[str]) -> _Optim:
    tree, z = _read_pickle(path, allowed=allowed)
    osd = tree.get("optimizer_state_dict")
    if not isinstance(osd, dict) or "zero_stage" not in osd or "partition_count" not in osd:
        raise FormatError(
            f"{path}: no optimizer_state_dict with zero_stage and partition_count; not a ZeRO optimizer file"
        )
    stage = _stage(osd["zero_stage"], path=path)
    count = osd["partition_count"]
    world = max(count) if isinstance(count, list) and count else count  # per group (experts may differ): the max
    if type(world) is not int or world < 1:
        raise FormatError(f"{path}: partition_count is {count!r}; the file is damaged")
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    flats = osd.get(key)
    if not isinstance(flats, list) or not flats:
        raise FormatError(f"{path}: ZeRO-{stage} optimizer file without its '{key}' (the fp32 master partitions)")
    groups = [(_flat(t, path=path, what=f"{key}[{i}]"), z) for i, t in enumerate(flats)]
    base = osd.get("base_optimizer_state" if stage <= 2 else "optimizer_state_dict")
    return _Optim(path, rank, stage, world, tree.get("ds_version", osd.get("ds_version")), groups,
                  osd.get("param_alignment_paddings"), base, osd.get("dynamic_loss_scale"))  # fmt: skip


# -- the layout (pure) -----------------------------------------------------------------------------------

# A run of elements: (rank, group, first element in that rank's partition of the group, count).
Segment = tuple[int, int, int, int]


def layout_partitioned(
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    sizes: list[list[int]],
    *,
    paddings: list[list[int]] | None = None,
    source: str,
) -> dict[str, list[Segment]]:
    """ZeRO-1/2: where each parameter's elements are. ``shapes[g]``: group ``g``'s parameters in order;
    ``sizes[r][g]``: rank ``r``'s partition length of group ``g`` (the ranks' partitions, joined, are the group)."""
    world = len(sizes)
    if paddings is not None and (len(paddings) != len(shapes) or not all(isinstance(p, list) for p in paddings)):
        raise FormatError(f"{source}: param_alignment_paddings is not one list per parameter group ({len(shapes)}); "
                          f"the rank files are damaged")  # fmt: skip
    out: dict[str, list[Segment]] = {}
    for g, params in enumerate(shapes):
        starts = [0]
        for r in range(world):
            starts.append(starts[-1] + sizes[r][g])
        avail = starts[-1]
        offset = 0
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(params):
            raise FormatError(f"{source}: group {g} has {len(params)} parameters but {len(pads)} alignment paddings")
        if pads is not None and not all(type(p) is int and p >= 0 for p in pads):  # a negative one overlaps two
            raise FormatError(f"{source}: param_alignment_paddings of group {g} are {pads!r}, not counts of elements; "
                              f"the rank files are damaged")  # fmt: skip
        for i, (name, shape) in enumerate(params):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise FormatError(
                    f"{source}: parameter '{name}' ends at element {offset + numel} of group {g}, whose partitions "
                    f"hold {avail}; the rank files are from different runs"
                )
            out[name] = _segments(starts, g, offset, numel)
            offset += numel + (pads[i] if pads is not None else 0)
        align = 2 * world  # zero_to_fp32's check: both sides padded to 2 * world (two unrelated paddings)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise FormatError(
                f"{source}: group {g}'s parameters take {offset} elements but its partitions hold {avail}; the rank "
                f"files are from different runs, or the shapes do not match the partitions"
            )
    return out


def _segments(starts: list[int], group: int, offset: int, numel: int) -> list[Segment]:
    segs: list[Segment] = []
    end = offset + numel
    for r in range(len(starts) - 1):
        lo, hi = max(offset, starts[r]), min(end, starts[r + 1])
        if lo < hi:
            segs.append((r, group, lo - starts[r], hi - lo))
    return segs


def layout_stage3(
    shapes: list[tuple[str, tuple[int, ...]]], sizes: list[list[int]], *, source: str
) -> dict[str, list[Segment]]:
    """ZeRO-3: each rank holds ``ceil(numel / world)`` elements of every parameter, in order, across its groups
    (``sizes[r][g]``); a parameter is its slice of each rank in rank order, cut to its size."""
    world = len(sizes)
    bounds = [0]
    for n in sizes[0]:
        bounds.append(bounds[-1] + n)
    if any(s != sizes[0] for s in sizes):
        raise FormatError(f"{source}: the ranks' fp32 partitions differ in size ({sizes[0]} vs others); the rank "
                          f"files are from different runs")  # fmt: skip
    out: dict[str, list[Segment]] = {}
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > bounds[-1]:  # checked before placing: every element placed lies in some group
            raise FormatError(
                f"{source}: parameter '{name}' needs element {offset + part} of each rank's partitions, which hold "
                f"{bounds[-1]}; the rank files are from different runs"
            )
        segs: list[Segment] = []
        left = numel
        for r in range(world):
            take = min(part, left)
            left -= take
            at = offset
            while take:  # a slice may cross from one group into the next
                g = next(i for i in range(len(sizes[r])) if bounds[i] <= at < bounds[i + 1])
                n = min(take, bounds[g + 1] - at)
                segs.append((r, g, at - bounds[g], n))
                at, take = at + n, take - n
        offset += part
        out[name] = segs
    if offset != bounds[-1]:
        raise FormatError(
            f"{source}: the parameters take {offset * world} elements but the partitions hold {bounds[-1] * world}; "
            f"the rank files are from different runs, or the shapes do not match the partitions"
        )
    return out


# -- the run ----------------------------------------------------------------------------------------------


def describe_run(path: str, *, allow_globals: Iterable[str] = (), optimizer: bool = False) -> ZeroRun:
    """Find and check a run's files and lay out its consolidated state dict; no tensor byte is read.
    ``optimizer=True`` lays out the optimizer's state too (:attr:`ZeroRun.optimizer`)."""
    root = os.fspath(path)
    tag_dir = tag_folder(root)
    allowed = allowlist.allowed_names(list(allow_globals), source=root)
    try:
        names = sorted(os.listdir(tag_dir))
    except OSError as e:
        raise FormatError(f"{tag_dir}: cannot list the folder ({e.strerror})") from e
    models: dict[int | None, str] = {}
    optims: dict[int, str] = {}
    for name in names:
        full = os.path.join(tag_dir, name)
        if (MODEL_FILE.match(name) or OPTIM_FILE.match(name)) is not None:
            _rank_file(full, tag_dir)
        if m := MODEL_FILE.match(name):
            _mp_rank(m.group(2), full)
            rank_of = int(m.group(1)) if m.group(1) is not None else None
            if rank_of in models:  # rank_1 and rank_01: which one is rank 1's is not for ckptfix to guess
                other = os.path.basename(models[rank_of])
                raise FormatError(
                    f"{full}: rank {rank_of} has two module files here ({other} too); keep one run's files"
                )
            models[rank_of] = full
        elif m := OPTIM_FILE.match(name):
            _mp_rank(m.group(2), full)
            rank = int(m.group(1))
            if rank in optims:
                raise FormatError(f"{full}: rank {rank} has two optimizer files here ({os.path.basename(optims[rank])}"
                                  f" too: fp32 and bf16 runs mixed); keep one run's files")  # fmt: skip
            optims[rank] = full
        elif _OTHER_STATES.match(name):
            raise FormatError(
                f"{full}: an expert- or pipeline-parallel DeepSpeed file, which ckptfix does not consolidate; "
                f"convert the run with DeepSpeed's ds_to_universal.py"
            )
    if not optims:
        module = next(iter(models.values()), None)
        hint = f"; {os.path.basename(module)} alone holds the training-dtype module" if module else ""
        raise FormatError(
            f"{tag_dir}: no ZeRO optimizer files (*_optim_states.pt), so no fp32 master weights to consolidate "
            f"(saved without the optimizer, or not a DeepSpeed ZeRO run){hint}"
        )
    first = _optim_file(optims[min(optims)], min(optims), allowed=allowed)
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
    ranks = [first] + [_optim_file(optims[r], r, allowed=allowed) for r in range(world) if r != first.rank]
    ranks.sort(key=lambda o: o.rank)
    for o in ranks:
        _same(o.path, "ZeRO stage", o.stage, stage, first.path)
        _same(o.path, "partition_count", o.world, world, first.path)
        _same(o.path, "ds_version", o.version, first.version, first.path)
        _same(o.path, "number of parameter groups", len(o.groups), len(first.groups), first.path)
        _same(o.path, "fp32 master dtype", [t.dtype for t, _ in o.groups], [t.dtype for t, _ in first.groups],
              first.path)  # fmt: skip
        # an fp16 run's files are named as an fp32 run's, and hold the same partition sizes: its loss scaler differs
        _same(o.path, "dynamic_loss_scale", o.dynamic_scale, first.dynamic_scale, first.path)
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
    module_trees = {r: _read_pickle(models[r], allowed=allowed) for r in wanted}
    main_path = models[wanted[0]]
    main, main_zip = module_trees[wanted[0]]
    for key in ("module", "buffer_names", "param_shapes"):
        if key not in main:
            raise FormatError(f"{main_path}: no '{key}'; not a DeepSpeed module file")
    module = main["module"]
    if not isinstance(module, dict) or not isinstance(main["param_shapes"], list):
        raise FormatError(f"{main_path}: 'module' or 'param_shapes' is not what DeepSpeed writes; the file is damaged")
    for r, (tree, _) in module_trees.items():
        path = models[r]
        _same(path, "ds_version", tree.get("ds_version"), first.version, first.path)
        if "dp_world_size" in tree:
            _same(path, "data-parallel world size", tree["dp_world_size"], world, first.path)
    groups = [[(str(k), _size(v, path=main_path, key=str(k))) for k, v in g.items()] for g in main["param_shapes"]]
    if len(groups) != len(first.groups):
        raise FormatError(f"{main_path}: {len(groups)} parameter groups but {first.path} holds {len(first.groups)}; "
                          f"the folder mixes two runs")  # fmt: skip
    sizes = [[t.numel() for t, _ in o.groups] for o in ranks]
    if stage <= 2:
        paddings = first.paddings if isinstance(first.paddings, list) else None
        layout = layout_partitioned(groups, sizes, paddings=paddings, source=tag_dir)
    else:
        layout = layout_stage3([p for g in groups for p in g], sizes, source=tag_dir)
    master = first.groups[0][0].dtype
    state: OrderedDict[str, ZeroTensor] = OrderedDict()
    # zero_to_fp32's order: buffers, frozen parameters, trainable parameters, tied names
    buffer_names = [str(n) for n in main["buffer_names"] if n in module]
    for name in buffer_names:
        value = module[name]
        if not isinstance(value, (inert.InertTensor, inert.InertParameter)):
            raise FormatError(f"{main_path}: buffer '{name}' is not a tensor; the file is damaged")
        t = inert.tensor_of(value)
        if not t.is_contiguous():
            raise FormatError(f"{main_path}: buffer '{name}' is not contiguous; the file is damaged")
        cast = "float32" if _floating(t.dtype) and t.dtype != "float32" else None  # zero_to_fp32: v.float()
        state[name] = ZeroTensor(name, t.dtype, t.shape, (_piece(t, main_zip, path=main_path, start=0,
                                 count=t.numel()),), "buffer", cast)  # fmt: skip
    frozen = main.get("frozen_param_shapes") or {}
    fragments = {r: tree.get("frozen_param_fragments") or {} for r, (tree, _) in module_trees.items()}
    for name, raw in frozen.items():
        shape = _size(raw, path=main_path, key=str(name))
        state[str(name)] = _frozen(str(name), shape, module_trees, fragments, models, stage=stage, world=world)
    train_dtype = _train_dtype(module, groups, state, fallback=master)
    shapes = dict(p for g in groups for p in g)
    for name, segs in layout.items():
        shape = shapes[name]
        pieces = tuple(_piece(ranks[r].groups[g][0], ranks[r].groups[g][1], path=ranks[r].path, start=s, count=n)
                       for r, g, s, n in segs)  # fmt: skip
        state[name] = ZeroTensor(name, master, shape, pieces, "fp32 master")
    for alias, target in (main.get("shared_params") or {}).items():
        if target in state:
            state[str(alias)] = state[target]  # one tensor under two names, as zero_to_fp32 returns it
    for zt in state.values():  # the layout checked above; this is the last word on sizes
        if sum(p.nbytes for p in zt.pieces) != math.prod(zt.shape) * DTYPES[zt.stored].itemsize:
            raise FormatError(f"{tag_dir}: '{zt.key}' gets {sum(p.nbytes for p in zt.pieces)} bytes for shape "
                              f"{list(zt.shape)}; the rank files are from different runs")  # fmt: skip
    ordered: OrderedDict[str, ZeroTensor] = OrderedDict((k, state[k]) for k in module if k in state)
    ordered.update((k, v) for k, v in state.items() if k not in ordered)  # the module's order, as model.state_dict()
    files = _run_files(models, ranks, stage=stage, train_dtype=train_dtype, master=master, module=module,
                       buffers=len(buffer_names), frozen=len(frozen))  # fmt: skip
    run = ZeroRun(root=root, tag_dir=tag_dir, stage=stage, world=world, train_dtype=train_dtype, master_dtype=master,
                  ds_version=first.version if isinstance(first.version, str) else None, files=files,
                  state=ordered)  # fmt: skip
    if stage == 1 and (left := [k for k in module if k not in ordered and not _is_placeholder(module[k])]):
        run.notes.append(
            f"{len(left)} key(s) of the module file ({', '.join(left[:3])}{', …' * (len(left) > 3)}) left out, as "
            f"zero_to_fp32 leaves them: ZeRO-1 saves frozen parameters only in the module file, in the training dtype"
        )
    if optimizer:
        run.optimizer = _optimizer_state(ranks, groups, layout, stage=stage, source=tag_dir)
    else:
        run.notes.append("optimizer state (Adam moments, step) not carried: the fp32 master weights only (--optimizer "
                         "carries it)")  # fmt: skip
    return run


def optimizer_tensors(opt: Mapping[str, Any] | None) -> list[ZeroTensor]:
    """The :class:`ZeroTensor` records of a laid-out optimizer state dict, in order."""
    if not opt:
        return []
    return [v for s in opt["state"].values() for v in s.values() if isinstance(v, ZeroTensor)]


def _optimizer_state(ranks: list[_Optim], groups: list[list[tuple[str, tuple[int, ...]]]],
                     layout: Mapping[str, list[Segment]], *, stage: int, source: str) -> dict[str, Any]:  # fmt: skip
    """The full torch ``optimizer.state_dict()`` of the consolidated model: each flat group's per-element state
    (Adam's ``exp_avg``, ``exp_avg_sq``) cut exactly as its fp32 master partition is (``layout``), its scalar state
    (``step``) given to each of its parameters, and the saved param groups' hyperparameters with parameter indices
    numbered in param-group order, as ``torch.optim.Optimizer.state_dict()`` numbers them."""
    first = ranks[0]
    bases = []
    for o in ranks:
        base = o.base
        if not isinstance(base, dict) or not isinstance(base.get("state"), dict) or not isinstance(
                base.get("param_groups"), list):  # fmt: skip
            hint = " (an elastic checkpoint: its moments are saved unpartitioned)" if isinstance(base, list) else ""
            raise FormatError(f"{o.path}: no optimizer state dict in the ZeRO-{stage} optimizer file{hint}; its "
                              f"optimizer state cannot be consolidated: convert without --optimizer")  # fmt: skip
        bases.append(base)
    saved_groups = bases[0]["param_groups"]
    order: list[int] = []  # the flat groups, in the saved param groups' order
    for pg in saved_groups:
        flat_ids = pg.get("params") if isinstance(pg, dict) else None
        if not isinstance(flat_ids, list) or not all(type(i) is int for i in flat_ids):
            raise FormatError(f"{first.path}: a saved param group without its parameter indices; the file is damaged")
        order.extend(flat_ids)
    if sorted(order) != list(range(len(groups))) or len(first.groups) != len(groups):
        raise FormatError(f"{first.path}: the saved param groups hold flat groups {order}, but the run has "
                          f"{len(groups)}; the file is damaged")  # fmt: skip
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    index = 0
    for pg in saved_groups:
        hyper = {str(k): v for k, v in pg.items() if k != "params"}
        if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert.walk(hyper)):
            raise FormatError(f"{first.path}: a param group's hyperparameters hold tensors or objects, which ckptfix "
                              f"does not carry; convert without --optimizer")  # fmt: skip
        ids: list[int] = []
        for k in pg["params"]:
            per_rank = [_group_state(o, b, k, source=source) for o, b in zip(ranks, bases, strict=True)]
            for name, shape in groups[k]:
                entry: dict[str, Any] = {}
                for key, value in per_rank[0].items():
                    if isinstance(value, inert.InertTensor) and value.shape == ():  # Adam's step: one per parameter
                        piece = _piece(value, first.groups[k][1], path=first.path, start=0, count=1)
                        entry[key] = ZeroTensor(f"{name}.{key}", value.dtype, (), (piece,), "optimizer state")
                    elif isinstance(value, inert.InertTensor):
                        entry[key] = ZeroTensor(f"{name}.{key}", value.dtype, shape, tuple(
                            _moment_piece(ranks, per_rank, key, r, g, s, n, group=k) for r, g, s, n in layout[name]
                        ), "optimizer state")  # fmt: skip
                    else:
                        entry[key] = value
                state[index] = entry
                ids.append(index)
                index += 1
        param_groups.append({**hyper, "params": ids})
    for zt in optimizer_tensors({"state": state}):
        if sum(p.nbytes for p in zt.pieces) != math.prod(zt.shape) * DTYPES[zt.stored].itemsize:
            raise FormatError(f"{source}: optimizer state '{zt.key}' gets {sum(p.nbytes for p in zt.pieces)} bytes "
                              f"for shape {list(zt.shape)}; the rank files are from different runs")  # fmt: skip
    return {"state": state, "param_groups": param_groups}


def _group_state(o: _Optim, base: Mapping[str, Any], k: int, *, source: str) -> dict[str, Any]:
    """Rank ``o``'s optimizer state of flat group ``k``: per-element tensors checked to match its fp32 partition."""
    raw = base["state"].get(k, {})
    if not isinstance(raw, dict):
        raise FormatError(f"{o.path}: the optimizer state of group {k} is not a dict; the file is damaged")
    flat = o.groups[k][0]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, (inert.Inert, inert.InertTensor)):
            t = _flat(value, path=o.path, what=f"optimizer state '{key}' of group {k}")
            # the fp32 partition is saved without the last rank's padding, the moments with it (at the end)
            if t.shape != () and (len(t.shape) != 1 or t.numel() < flat.numel()):
                raise FormatError(f"{o.path}: optimizer state '{key}' of group {k} has shape {list(t.shape)}, but "
                                  f"the fp32 partition has {list(flat.shape)}; the file is damaged")  # fmt: skip
            value = t
        elif any(isinstance(x, (inert.Inert, inert.StorageRef)) for x in inert.walk(value)):
            raise FormatError(f"{o.path}: optimizer state '{key}' of group {k} holds objects ckptfix does not carry")
        out[str(key)] = value
    return out


def _moment_piece(ranks: list[_Optim], per_rank: list[dict[str, Any]], key: str, r: int, g: int, start: int,
                  count: int, *, group: int) -> Piece:  # fmt: skip
    """A segment of the layout, read from rank ``r``'s per-element state ``key`` instead of its fp32 partition
    (ZeRO-3: a parameter's slice may cross into the next flat group ``g``)."""
    state = per_rank[r] if g == group else _group_state(ranks[r], ranks[r].base, g, source=ranks[r].path)
    t = state.get(key)
    if not isinstance(t, inert.InertTensor) or t.shape == ():
        raise FormatError(f"{ranks[r].path}: no optimizer state '{key}' for group {g}, which rank 0 has; the rank "
                          f"files are from different runs")  # fmt: skip
    return _piece(t, ranks[r].groups[g][1], path=ranks[r].path, start=start, count=count)


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))  # torch's is_floating_point: float8 variants included


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, (inert.InertTensor, inert.InertParameter)) and inert.tensor_of(value).numel() == 0


def _frozen(name: str, shape: tuple[int, ...], trees: Mapping[int | None, tuple[Any, Any]],
            fragments: Mapping[int | None, Any], models: Mapping[int | None, str], *, stage: int,
            world: int) -> ZeroTensor:  # fmt: skip
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
            raise FormatError(f"{models[r]}: frozen parameter '{name}' is {t.dtype} here, {dtype} on rank 0; the "
                              f"folder mixes two runs")  # fmt: skip
        dtype = t.dtype
        # ZeRO-2 saves the parameter whole, ZeRO-3 each rank's padded partition: any other size misplaces elements
        want = numel if stage <= 2 else math.ceil(numel / world)
        if t.numel() != want:
            raise FormatError(f"{models[r]}: frozen parameter '{name}' of shape {list(shape)} has {t.numel()} "
                              f"elements here, not {want}; the rank files are from different runs")  # fmt: skip
        take = min(t.numel(), left)
        if take:
            pieces.append(_piece(t, trees[r][1], path=models[r], start=0, count=take))
        left -= take
    if left or dtype is None:
        raise FormatError(f"{models[None if stage <= 2 else 0]}: frozen parameter '{name}' of shape {list(shape)} "
                          f"has {numel - left} elements saved; the rank files are from different runs")  # fmt: skip
    return ZeroTensor(name, dtype, shape, tuple(pieces), "frozen")


def _train_dtype(module: Mapping[str, Any], groups: list[list[tuple[str, tuple[int, ...]]]],
                 state: Mapping[str, ZeroTensor], *, fallback: str) -> str:  # fmt: skip
    """The dtype the module trained in: its trainable parameters' records (ZeRO-3 placeholders keep it)."""
    for g in groups:
        for name, _ in g:
            value = module.get(name)
            if isinstance(value, (inert.InertTensor, inert.InertParameter)):
                return inert.tensor_of(value).dtype
    return fallback


def _run_files(models: Mapping[int | None, str], ranks: list[_Optim], *, stage: int, train_dtype: str, master: str,
               module: Mapping[str, Any], buffers: int, frozen: int) -> list[RunFile]:  # fmt: skip
    files: list[RunFile] = []
    for r, path in sorted(models.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        if stage <= 2:
            holds = (f"module state dict in {train_dtype} ({len(module)} keys), shapes, {buffers} buffers"
                     f"{f', {frozen} frozen parameters' if frozen else ''}")  # fmt: skip
        else:
            holds = (f"rank {r}'s module file: [0] placeholders for parameters, {buffers} buffers"
                     f"{f', its partition of {frozen} frozen parameters' if frozen else ''}")  # fmt: skip
        files.append(RunFile(path, "module", r, holds))
    for o in ranks:
        n = sum(t.numel() for t, _ in o.groups)
        files.append(RunFile(o.path, "optimizer", o.rank, f"rank {o.rank}'s {master} master partition ({len(o.groups)} "
                             f"group{'s' * (len(o.groups) != 1)}, {n:,} elements) and optimizer state"))  # fmt: skip
    return files


def _rank_file(path: str, tag_dir: str) -> None:
    """A rank file checked before it is opened: opening a FIFO blocks, a device never ends, a link may lead out."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise FormatError(f"{path}: cannot read it ({e.strerror}); copy the whole tag folder again") from e
    if not stat.S_ISREG(mode):
        raise FormatError(f"{path}: not a regular file (a FIFO, socket, device or folder); copy the whole tag folder "
                          f"again")  # fmt: skip
    real = os.path.realpath(tag_dir)
    if os.path.commonpath([real, os.path.realpath(path)]) != real:
        raise FormatError(f"{path}: a link to outside the folder; refusing it: copy the file itself into the folder")


def _mp_rank(text: str, path: str) -> None:
    if int(text) != 0:
        raise FormatError(
            f"{path}: model-parallel rank {int(text)} (tensor- or pipeline-parallel run), which ckptfix does not "
            f"consolidate; convert the run with DeepSpeed's ds_to_universal.py"
        )


def _same(path: str, what: str, value: Any, expected: Any, first: str) -> None:
    if value != expected:
        raise FormatError(
            f"{path}: {what} {value!r}, but {os.path.basename(first)} says {expected!r}; the folder mixes two runs: "
            f"keep one run's files"
        )


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


def load_optimizer(path: str, *, allow_globals: Iterable[str] = (), verify: bool = True) -> dict[str, Any]:
    """The consolidated optimizer state dict of a ZeRO run, in memory: what ``torch.optim.Optimizer.state_dict()``
    returns for the plain model with the same param groups."""
    run = describe_run(path, allow_globals=allow_globals, optimizer=True)
    assert run.optimizer is not None  # optimizer=True
    fds: dict[str, int] = {}

    def fd_of(p: str) -> int:
        if p not in fds:
            fds[p] = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fds[p]

    verified: set[tuple[str, str]] | None = set() if verify else None
    try:
        state = {i: {k: read_zero_tensor(v, fd_of, verified=verified) if isinstance(v, ZeroTensor) else v
                     for k, v in s.items()} for i, s in run.optimizer["state"].items()}  # fmt: skip
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"state": state, "param_groups": [dict(g) for g in run.optimizer["param_groups"]]}


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


# -- lone rank files --------------------------------------------------------------------------------------


def module_file_kind(obj: Any) -> int | None:
    """For a DeepSpeed module file (``*_model_states.pt``) read on its own: 3 when its parameters are ZeRO-3's
    empty placeholders, 1 (ZeRO-1/2: real weights in the training dtype); None for any other checkpoint."""
    if not isinstance(obj, Mapping) or not all(k in obj for k in ("module", "param_shapes", "buffer_names")):
        return None
    module, shapes = obj["module"], obj["param_shapes"]
    if not isinstance(module, Mapping) or not isinstance(shapes, list):
        return None
    for group in shapes:
        if not isinstance(group, Mapping):
            return None
        for name in group:
            value = module.get(name)
            if value is not None and _numel(value) == 0:
                return 3
    return 1


def _numel(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    return math.prod(shape) if shape is not None else None


def placeholder_keys(obj: Any) -> list[str]:
    """The module keys of a lone ZeRO-3 module file that are ``[0]`` placeholders (none for any other file)."""
    if module_file_kind(obj) != 3:
        return []
    module = obj["module"]
    names = {name for group in obj["param_shapes"] for name in group}
    for also in ("frozen_param_shapes", "shared_params"):  # ZeRO-3 empties frozen and tied parameters too
        names.update(obj[also] if isinstance(obj.get(also), Mapping) else ())
    return [name for name in module if name in names and _numel(module[name]) == 0]


def folder_to_pass(source: str) -> str | None:
    """The folder that holds the run a lone module file ``source`` belongs to: the run folder when its ``latest``
    names this file's tag, else the tag folder; None where no optimizer file lies beside it (a copy taken out)."""
    folder = os.path.dirname(os.path.abspath(source))
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if not any(OPTIM_FILE.match(n) for n in names):
        return None
    run = os.path.dirname(folder)
    latest = os.path.join(run, LATEST)
    if os.path.isfile(latest) and _read_latest(latest, strict=False) == os.path.basename(folder):
        return run
    return folder  # the run's latest names another tag: the folder this file's step is in


CONVERT_THE_RUN = "its folder holds the whole model, consolidated by: ckptfix convert {folder} model.safetensors"


def refuse_placeholders(obj: Any, *, source: str, instead: str = "pass the folder instead: {folder}") -> None:
    """A lone ZeRO-3 module file holds ``[0]`` placeholders, never weights: refuse it, naming the folder to pass.

    ``instead`` is what to do, ``{folder}`` standing for the run's folder (``CONVERT_THE_RUN`` where the command
    takes no folder, or joining rank files is not the way)."""
    if module_file_kind(obj) == 3:
        folder = folder_to_pass(source) or "<the run's global_stepN/ folder, with every rank's files>"
        raise FormatError(
            f"{source}: one rank's module file of a DeepSpeed ZeRO-3 run: its parameters are empty [0] placeholders "
            f"(the weights are partitioned across the *_optim_states.pt files); {instead.format(folder=folder)}"
        )


def refuse_optimizer_partition(obj: Any, *, source: str) -> None:
    """One rank's ``*_optim_states.pt`` alone holds flat slices of the fp32 master weights, no state dict: where a
    model is wanted, say so and name the folder (instead of "no model state dict … name it with --entry")."""
    if (
        not isinstance(obj, Mapping)
        or "module" in obj
        or not all(k in obj for k in ("optimizer_state_dict", "ds_config", "ds_version"))
    ):
        return
    folder = folder_to_pass(source) or "<the run's global_stepN/ folder, with every rank's files>"
    raise FormatError(
        f"{source}: one rank's optimizer file of a DeepSpeed ZeRO run: flat partitions of the fp32 master weights "
        f"and optimizer state, no state dict; pass the folder instead: {folder}"
    )


def lone_module_note(obj: Any, *, source: str) -> str | None:
    """What to say when a ZeRO-1/2 module file is converted on its own: its weights are the training dtype's."""
    if module_file_kind(obj) != 1:
        return None
    folder = os.path.dirname(os.path.abspath(source))
    return (
        f"{os.path.basename(source)} is DeepSpeed's module file: its weights are the training dtype's, not the fp32 "
        f"master weights; for those pass the folder {folder}"
    )


def lone_module_summary(obj: Any, *, source: str) -> dict[str, Any] | None:
    """For ``inspect`` of a DeepSpeed module file on its own: what its tensors are and which folder to pass."""
    kind = module_file_kind(obj)
    if kind is None:
        return None
    folder = folder_to_pass(source)
    if kind == 1:
        return {"stage": "1/2", "placeholders": [], "folder": folder, "note": lone_module_note(obj, source=source)}
    keys = placeholder_keys(obj)
    where = f"inspect or convert the folder: {folder}" if folder else "pass the run's tag folder, every rank's files"
    note = (
        f"one rank's module file of a DeepSpeed ZeRO-3 run: its {len(keys)} parameter(s) shown as [0] are "
        f"placeholders, not weights (the weights are partitioned across the *_optim_states.pt files); {where}"
    )
    return {"stage": 3, "placeholders": keys, "folder": folder, "note": note}


__all__ = [
    "CONVERT_THE_RUN",
    "Piece",
    "RunFile",
    "ZeroRun",
    "ZeroTensor",
    "describe_run",
    "folder_to_pass",
    "is_deepspeed",
    "layout_partitioned",
    "layout_stage3",
    "load_optimizer",
    "load_run",
    "lone_module_note",
    "lone_module_summary",
    "module_file_kind",
    "optimizer_tensors",
    "placeholder_keys",
    "read_zero_tensor",
    "refuse_optimizer_partition",
    "refuse_placeholders",
    "tag_folder",
]
