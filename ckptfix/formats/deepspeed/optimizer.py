"""A ZeRO run's optimizer state, laid out as the consolidated model's ``optimizer.state_dict()`` of records.

Each flat group's per-element state (Adam's ``exp_avg``, ``exp_avg_sq``; under ``base_optimizer_state`` for
ZeRO-1/2, ``optimizer_state_dict`` for ZeRO-3, keyed by flat group) is partitioned exactly as its fp32 master
partition (ZeRO-1/2 save the moments with the last rank's padding, the master without it: the same leading
elements), so each parameter's moment is the byte ranges of its weight (:mod:`.layout`), read from the moment's
record instead. No tensor byte is read here: :func:`~.tensors.read_zero_tensor` reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.deepspeed.layout import Segment
from ckptfix.formats.deepspeed.pickles import OptimFile, group_state
from ckptfix.formats.deepspeed.tensors import Piece, ZeroTensor, check_bytes, piece
from ckptfix.formats.pickles import inert, inert_trees

Groups = list[list[tuple[str, tuple[int, ...]]]]  # each flat group's parameters: (name, shape), in flat order


def optimizer_tensors(opt: Mapping[str, Any] | None) -> list[ZeroTensor]:
    """The :class:`ZeroTensor` records of a laid-out optimizer state dict, in order."""
    if not opt:
        return []
    return [v for s in opt["state"].values() for v in s.values() if isinstance(v, ZeroTensor)]


def optimizer_state(
    ranks: list[OptimFile], groups: Groups, layout: Mapping[str, list[Segment]], *, stage: int, source: str
) -> dict[str, Any]:
    """The full torch ``optimizer.state_dict()`` of the consolidated model: each flat group's per-element state
    (Adam's ``exp_avg``, ``exp_avg_sq``) cut exactly as its fp32 master partition is (``layout``), its scalar state
    (``step``) given to each of its parameters, and the saved param groups' hyperparameters with parameter indices
    numbered in param-group order, as ``torch.optim.Optimizer.state_dict()`` numbers them, and each group's
    ``param_names`` (the run's ``param_shapes`` names; frozen parameters are in no group)."""
    bases = _saved_states(ranks, stage=stage)
    saved_groups = bases[0]["param_groups"]
    _check_flat_groups(ranks[0], saved_groups, groups)
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    for pg in saved_groups:
        hyper = _hyperparameters(pg, source=ranks[0].path)
        ids: list[int] = []
        names: list[str] = []
        for k in pg["params"]:
            per_rank = [group_state(o, b, k, source=source) for o, b in zip(ranks, bases, strict=True)]
            for name, shape in groups[k]:
                index = len(state)  # numbered in param-group order
                state[index] = _parameter_state(ranks, per_rank, layout, name, shape, group=k)
                ids.append(index)
                names.append(name)
        # each parameter's name from the run's param_shapes (the flat order its partitions hold), as torch >= 2.6
        # saves a named group's: the name-keyed form (optim_form.to_names) needs no guess from the model's order
        param_groups.append({**hyper, "params": ids, "param_names": names})
    check_bytes(optimizer_tensors({"state": state}), source=source, what="optimizer state ")
    return {"state": state, "param_groups": param_groups}


def _saved_states(ranks: list[OptimFile], *, stage: int) -> list[dict[str, Any]]:
    """Each rank's saved optimizer state dict (``state`` and ``param_groups``); else refused, naming the file."""
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
    return bases


def _check_flat_groups(first: OptimFile, saved_groups: list[Any], groups: Groups) -> None:
    """The saved param groups name every flat group of the run once, by index."""
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


def _hyperparameters(pg: dict[str, Any], *, source: str) -> dict[str, Any]:
    """A saved param group's hyperparameters: plain values only (its ``params`` renumbered by the caller)."""
    # DeepSpeed's own param_names (torch >= 2.6, named groups) name its flat parameters, not the model's
    hyper = {str(k): v for k, v in pg.items() if k not in ("params", "param_names")}
    if any(isinstance(o, (inert.Inert, inert.StorageRef)) for o in inert_trees.walk(hyper)):
        raise FormatError(
            f"{source}: a param group's hyperparameters hold tensors or objects, which ckptfix "
            f"does not carry; convert without --optimizer"
        )
    return hyper


def _parameter_state(
    ranks: list[OptimFile],
    per_rank: list[dict[str, Any]],
    layout: Mapping[str, list[Segment]],
    name: str,
    shape: tuple[int, ...],
    *,
    group: int,
) -> dict[str, Any]:
    """One parameter's state: each per-element buffer the byte ranges of its weight (``layout[name]``), read from
    the buffer instead; a scalar (Adam's ``step``) one per parameter; anything else as rank 0 saved it."""
    first = ranks[0]
    entry: dict[str, Any] = {}
    for key, value in per_rank[0].items():
        if isinstance(value, inert.InertTensor) and value.shape == ():  # Adam's step: one per parameter
            step = piece(value, first.groups[group][1], path=first.path, start=0, count=1)
            entry[key] = ZeroTensor(f"{name}.{key}", value.dtype, (), (step,), "optimizer state")
        elif isinstance(value, inert.InertTensor):
            pieces = tuple(_moment_piece(ranks, per_rank, key, r, g, s, n, group=group) for r, g, s, n in layout[name])
            entry[key] = ZeroTensor(f"{name}.{key}", value.dtype, shape, pieces, "optimizer state")
        else:
            entry[key] = value
    return entry


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
    return piece(t, ranks[r].groups[g][1], path=ranks[r].path, start=start, count=count)


__all__ = ["optimizer_state", "optimizer_tensors"]
