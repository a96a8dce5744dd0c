"""Optimizer state in the two forms torch writes it: keyed by parameter index, or by parameter name.

``optimizer.state_dict()`` numbers the parameters in the order of its param groups (group 0's ``params``, then
group 1's, …, from 0) and keys ``state`` by those ints; ``optimizer.load_state_dict`` binds ``state[i]`` to the
i-th parameter of the optimizer it is called on. torch.distributed.checkpoint's ``get_optimizer_state_dict`` (what
an FSDP2 job saves, and what ``set_optimizer_state_dict`` loads) keys both ``state`` and every group's ``params`` by
the parameter's name instead: its fully qualified name in the unwrapped model (no ``module.``, no ``_orig_mod.``;
``fully_shard`` keeps the module's own names), a tied parameter once, under the name ``named_parameters()`` gives
it first. A DCP folder keeps every key as a string, so an index-keyed state comes back keyed ``'0'``, ``'1'``, ….

Pure: no torch, no I/O. Values (tensors or tensor records) are kept as they are; containers are new.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import UsageError
from ckptfix.notes import Kind, Level, Note, always

NAMES, INDICES = "names", "indices"
FORMS = (NAMES, INDICES)
# Buffers a state dict holds beside the parameters, which no optimizer steps: BatchNorm's running statistics.
_BUFFER_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")
_FLOATING = ("float16", "bfloat16", "float32", "float64")
# Notes said whatever the verbosity (:class:`~ckptfix.notes.Level`): what a resume loses (the output loads, and binds
# less), names taken from the model's order (proven, but by the count alone), and an optimizer a DCP folder keeps by
# index, which an FSDP2 job's set_optimizer_state_dict does not bind.
RESUME_LOSES = "a resume loses"
BY_MODEL_ORDER = "in the model's parameter order"
BY_INDEX = "stays keyed by index"
NAMES_FORM = "set_optimizer_state_dict's form"
HOW_TO_NAME = (
    "to key it by name (FSDP2), pass --optimizer-factory MOD:FN, the function the run built its optimizer "
    "with from the model, and --model MOD:FACTORY"
)


@dataclass(frozen=True)
class Parameters:
    """A model's parameters in ``named_parameters()`` order (tied ones once), or in an optimizer's built for it
    (``groups``): names, shapes, and where they come from (said in notes and errors)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    origin: str
    groups: tuple[int, ...] | None = None  # each param group's size where the names are an optimizer's, in its order


def parse_form(form: str | None) -> str | None:
    """``names`` or ``indices`` (None: the default for the output); :class:`UsageError` otherwise."""
    if form is None or form in FORMS:
        return form
    raise UsageError(
        f"optimizer_form={form!r}: choose names (get_optimizer_state_dict's form) or indices (optimizer.state_dict()'s)"
    )


def is_optimizer_state(value: object) -> bool:
    """A torch optimizer state dict: ``state`` a mapping, ``param_groups`` a list of dicts each with ``params``."""
    if not isinstance(value, Mapping) or not isinstance(value.get("state"), Mapping):
        return False
    groups = value.get("param_groups")
    return isinstance(groups, list) and all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    )


def optimizer_entries(obj: object) -> list[str]:
    """The top-level entries of ``obj`` that hold an optimizer state dict; ``[""]`` when ``obj`` is one."""
    if is_optimizer_state(obj):
        return [""]
    if not isinstance(obj, Mapping):
        return []
    return [k for k, v in obj.items() if isinstance(k, str) and is_optimizer_state(v)]


def order(osd: Mapping[str, Any]) -> list[Any]:
    """The parameters of ``osd`` in the optimizer's order: the groups' ``params`` one after the other."""
    return [p for group in osd["param_groups"] for p in group["params"]]


def form_of(osd: Mapping[str, Any]) -> str | None:
    """``indices`` or ``names`` by what the param groups list; None for neither (an empty or mixed optimizer)."""
    params = order(osd)
    if params and all(type(p) is int for p in params):
        return INDICES
    if params and all(isinstance(p, str) for p in params):
        return NAMES
    return None


def restore_indices(osd: Mapping[str, Any], *, where: str) -> tuple[dict[str, Any], str | None]:
    """``osd`` with state keys ``'3'`` (a DCP folder's) put back as the int 3 where its param groups name 3; a
    note saying so, or, for keys that cannot be proven, what a resume loses. Anything else is kept as it is."""
    params = order(osd)
    if not params or not all(type(p) is int for p in params):
        return dict(osd), None
    named = set(params)
    state: dict[Any, Any] = {}
    restored, unbound = 0, []
    for key, value in osd["state"].items():
        if isinstance(key, str) and key.isdecimal() and str(int(key)) == key and int(key) in named:
            state[int(key)] = value
            restored += 1
        else:
            state[key] = value
            if key not in named:
                unbound.append(key)
    if restored and len(state) != len(osd["state"]):  # '3' and 3 both present: which is the real one is unknown
        return dict(osd), f"{where}: holds state keys both as strings and as ints; kept as they are"
    out = {**osd, "state": state}
    if unbound:
        return out, always(
            f"{where}: {len(unbound)} state key(s) (e.g. {unbound[0]!r}) are not parameters its "
            f"param_groups name; optimizer.load_state_dict binds none of them, so {RESUME_LOSES} their "
            f"moments and steps",
            kind=Kind.LOSS,
        )
    if restored:
        return out, f"{where}: {restored} state key(s) put back as the ints its param_groups name (DCP stores strings)"
    return out, None


def restore_all(obj: Any, *, source: str) -> tuple[Any, list[str]]:
    """:func:`restore_indices` for each optimizer entry of ``obj`` (a checkpoint read from a DCP folder), in a new
    top-level container; the notes."""
    found = [e for e in optimizer_entries(obj) if e != ""]
    if not found:
        return obj, []
    out, notes = dict(obj), []
    for entry in found:
        out[entry], note = restore_indices(obj[entry], where=f"{source}['{entry}']")
        notes += [note] if note else []
    return out, notes


def to_names(osd: Mapping[str, Any], params: Parameters | str | None, *, where: str) -> tuple[dict[str, Any], str]:
    """Index-keyed ``osd`` keyed by parameter name, as ``get_optimizer_state_dict`` returns it; and a note on where
    the names come from. Names are taken only where they are proven: the groups' own ``param_names`` (an
    optimizer built from ``named_parameters()``); else ``params`` in the optimizer's order (built by the job's own
    optimizer function), its groups the checkpoint's; else the model's order where one group holds every
    parameter. ``params`` a string: why the model's parameters cannot be told. Anything else is refused.

    Raises:
        UsageError: the names are not proven, or a count or a moment's shape does not fit (naming the group)."""
    ids = order(osd)
    if ids != list(range(len(ids))):
        raise UsageError(
            f"{where}: param_groups list {_sample(ids)}, not 0…{len(ids) - 1} as "
            f"optimizer.state_dict() numbers them; write it with --optimizer-form indices"
        )
    recorded = [n for g in osd["param_groups"] for n in g.get("param_names", ())]
    if len(recorded) == len(ids) and all(isinstance(n, str) for n in recorded):
        names, origin, level = recorded, "its param_groups' param_names", Level.VERBOSE
        shapes = _shapes_by_name(params if isinstance(params, Parameters) else None, names, where=where)
    else:
        names, shapes, origin, level = _proven_order(osd, params, where=where)
    if len(set(names)) != len(names):
        raise UsageError(f"{where}: a parameter name appears twice in {origin}; the names are not a mapping")
    groups, state, at = [], {}, 0
    for g, group in enumerate(osd["param_groups"]):
        count = len(group["params"])
        groups.append({**group, "params": names[at : at + count]})
        for i in group["params"]:
            if i in osd["state"] and shapes is not None:
                _check_shapes(
                    osd["state"][i],
                    shapes[i],
                    where=f"{where}.state.{i}",
                    name=names[i],
                    origin=f"{origin}, param group {g}",
                )
        at += count
    for key, value in osd["state"].items():
        if type(key) is not int or not 0 <= key < len(names):
            raise UsageError(
                f"{where}: state key {key!r} is not a parameter its param_groups name; write it with "
                f"--optimizer-form indices"
            )
        state[names[key]] = value
    note = Note(f"{where}: keyed by parameter name ({NAMES_FORM}), names from {origin}", level=level)
    return {**osd, "state": state, "param_groups": groups}, note


def _proven_order(
    osd: Mapping[str, Any], params: Parameters | str | None, *, where: str
) -> tuple[list[str], list[tuple[int, ...]], str, Level]:
    """The names of ``osd``'s parameters in its order (and their shapes, and where from) where ``params`` proves
    them: built by the job's own optimizer function with the same groups, or the model's order for one group (said
    whatever the verbosity: proven by the count alone)."""
    groups, count = osd["param_groups"], len(order(osd))
    if isinstance(params, Parameters) and params.groups is not None:
        if len(params.groups) != len(groups):
            raise UsageError(
                f"{where}: {len(groups)} param group(s), but {params.origin} builds "
                f"{len(params.groups)}; pass the function the run built its optimizer with"
            )
        for g, (group, size) in enumerate(zip(groups, params.groups, strict=True)):
            if len(group["params"]) != size:
                raise UsageError(
                    f"{where}: param group {g} holds {len(group['params'])} parameters, but group {g} "
                    f"of {params.origin} holds {size}; pass the function the run built its optimizer "
                    f"with"
                )
        return list(params.names), list(params.shapes), params.origin, Level.VERBOSE
    if len(groups) != 1:
        raise UsageError(
            f"{where}: its {len(groups)} param groups record no param_names, and the model's order "
            f"names the parameters only where one group holds them all; {HOW_TO_NAME}"
        )
    if not isinstance(params, Parameters):
        why = params or f"no model entry names its {count} parameters; pass --model MOD:FACTORY"
        raise UsageError(f"{where}: {why}")
    if len(params.names) != count:
        raise UsageError(
            f"{where}: param_groups list {count} parameters but {params.origin} has "
            f"{len(params.names)}; pass --model MOD:FACTORY for the model it was saved with, or "
            f"write it with --optimizer-form indices"
        )
    origin = f"{params.origin}, {BY_MODEL_ORDER} (its one param group holds every parameter)"
    return list(params.names), list(params.shapes), origin, Level.ALWAYS


def to_indices(osd: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Name-keyed ``osd`` keyed by index, as ``optimizer.state_dict()`` keys it: the i-th name of the groups'
    ``params`` (in their order, which is the optimizer's) is i."""
    names = order(osd)
    index = {name: i for i, name in enumerate(names)}
    if len(index) != len(names):
        raise UsageError(f"{where}: a parameter name appears in two param_groups; the names are not a mapping")
    state: dict[int, Any] = {}
    for key, value in osd["state"].items():
        if key not in index:
            raise UsageError(
                f"{where}: state key {key!r} is not a parameter its param_groups name; write it with "
                f"--optimizer-form names"
            )
        state[index[key]] = value
    groups, at = [], 0
    for group in osd["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": list(range(at, at + count))})
        at += count
    return {**osd, "state": state, "param_groups": groups}


def entry_parameters(
    state: Mapping[str, Any], *, count: int, identity: Callable[[Any], Hashable], entry: str
) -> Parameters | str:
    """The parameters of a model entry (single-layout keys) in ``named_parameters()`` order, for an optimizer of
    ``count`` parameters: its keys, a tensor under two names once, BatchNorm's running statistics left out when
    the count asks; or why they cannot be told (a model holds buffers only its code knows)."""
    seen: set[Hashable] = set()
    keys: list[str] = []
    for key, value in state.items():
        ident = identity(value)
        if ident not in seen:
            seen.add(ident)
            keys.append(key)
    origin = f"model entry '{entry}'" if entry else "the state dict"
    if len(keys) != count:
        keys = [k for k in keys if not k.endswith(_BUFFER_SUFFIXES) and _dtype(state[k]) in _FLOATING]
        origin += " (its running statistics left out)"
    if len(keys) != count:
        return (
            f"{origin} has {len(keys)} tensors that may be parameters and the optimizer {count}: which are "
            f"buffers only the model's code knows; pass --model MOD:FACTORY"
        )
    return Parameters(tuple(keys), tuple(tuple(state[k].shape) for k in keys), origin)


def _dtype(value: Any) -> str:
    return str(value.dtype).removeprefix("torch.")


def _shapes_by_name(params: Parameters | None, names: Sequence[str], *, where: str) -> list[tuple[int, ...]] | None:
    if params is None:
        return None
    by_name = dict(zip(params.names, params.shapes, strict=True))
    if missing := [n for n in names if n not in by_name]:
        raise UsageError(
            f"{where}: its param_groups' param_names name '{missing[0]}', which {params.origin} "
            f"does not have; pass --model MOD:FACTORY for the model it was saved with"
        )
    return [by_name[n] for n in names]


def unwrapped_names(osd: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """``osd`` with its groups' ``param_names`` in the unwrapped model's names (an optimizer built from a DDP or
    compiled model's ``named_parameters()`` records ``module.`` and ``_orig_mod.``, which torch's FQNs leave out)."""
    from ckptfix.transforms import layouts
    from ckptfix.transforms.checkpoint import apply_maps

    names = [n for g in osd["param_groups"] for n in g.get("param_names", ())]
    if not names or not all(isinstance(n, str) for n in names):
        return dict(osd)
    _, maps = layouts.conversion_maps(names, to="single", source=f"{where} param_names")
    renamed = iter(apply_maps(dict.fromkeys(names), maps, source=f"{where} param_names"))
    groups = [
        {**g, "param_names": [next(renamed) for _ in g["param_names"]]} if "param_names" in g else g
        for g in osd["param_groups"]
    ]
    return {**osd, "param_groups": groups}


def _check_shapes(value: Any, shape: tuple[int, ...], *, where: str, name: str, origin: str) -> None:
    """A moment (``exp_avg``, ``momentum_buffer``) has its parameter's shape; a scalar (``step``) any."""
    if not isinstance(value, Mapping):
        return
    for key, moment in value.items():
        got = getattr(moment, "shape", None)
        if got is not None and len(got) > 0 and tuple(got) != shape:
            raise UsageError(
                f"{where}.{key}: shape {list(got)}, but parameter '{name}' ({origin}) has "
                f"{list(shape)}; these are not the parameters it steps: {HOW_TO_NAME}"
            )


def _sample(values: Sequence[Any]) -> str:
    head = ", ".join(repr(v) for v in values[:4])
    return f"[{head}{', …' if len(values) > 4 else ''}]"


def unshare_steps(
    osd: Mapping[str, Any], *, identity: Callable[[Any], Hashable], copy: Callable[[Any], Any], where: str
) -> tuple[dict[str, Any], str | None]:
    """``osd`` with each scalar state (``step``) that is one tensor with another parameter's put in a tensor of its
    own (``copy``), and a note: FSDP1 keeps one ``step`` per flat parameter, shared by its parameters' entries, and
    a plain AdamW adds 1 to each in place, so a shared one would count every parameter's step."""
    seen: set[Hashable] = set()
    state: dict[Any, Any] = {}
    copied = 0
    for key, entry in osd["state"].items():
        if not isinstance(entry, Mapping):
            state[key] = entry
            continue
        new = dict(entry)
        for name, value in entry.items():
            if getattr(value, "shape", None) is None or len(value.shape) != 0:
                continue
            ident = identity(value)
            if ident in seen:
                new[name], copied = copy(value), copied + 1
            seen.add(ident)
        state[key] = new
    if not copied:
        return dict(osd), None
    said = (
        f"{where}: {copied} scalar state tensor(s) (step) shared between parameters copied apart, so that a "
        f"plain optimizer counts each parameter's steps once"
    )
    return {**osd, "state": state}, said


def reform(
    obj: Any,
    *,
    form: str | None,
    dcp_out: bool,
    model_entries: Sequence[str],
    parameters: Parameters | None,
    identity: Callable[[Any], Hashable],
    copy: Callable[[Any], Any],
    source: str,
) -> list[str]:
    """Put each optimizer entry of ``obj`` (a converted checkpoint, a new container: changed in place) in
    ``form``: by default names for a DCP output when the model's parameter names are known, indices otherwise;
    the notes say what changed and why. A DCP folder's string keys are put back as ints first."""
    from ckptfix.errors import CkptfixError

    notes: list[str] = []
    found = [e for e in optimizer_entries(obj) if e != ""]
    for entry in found:
        where = f"{source}['{entry}']"
        osd, note = restore_indices(obj[entry], where=where)
        notes += [note] if note else []
        target = form or (NAMES if dcp_out else INDICES)
        current = form_of(osd)
        if target == INDICES and current == NAMES:
            osd = to_indices(osd, where=where)
            notes.append(f"{where}: keyed by index (optimizer.load_state_dict's form), in its param_groups' order")
        elif target == NAMES and current == INDICES:
            try:
                params = parameters or _entry_parameters(obj, osd, model_entries, identity=identity, where=where)
                osd, note = to_names(unwrapped_names(osd, where=where), params, where=where)
                notes.append(note)
            except CkptfixError as e:
                if form is not None or parameters is not None:  # names asked for, or the model given to name them
                    raise
                why = str(e).removeprefix(f"{where}: ")
                notes.append(
                    always(
                        f"{where}: {BY_INDEX} (optimizer.load_state_dict's form), which an FSDP2 job's "
                        f"set_optimizer_state_dict does not bind: {why}"
                    )
                )
        if not dcp_out:  # a DCP folder stores each key apart: nothing stays shared
            osd, note = unshare_steps(osd, identity=identity, copy=copy, where=where)
            notes += [note] if note else []
        obj[entry] = osd
    return notes


def _entry_parameters(
    obj: Any, osd: Mapping[str, Any], model_entries: Sequence[str], *, identity: Callable[[Any], Hashable], where: str
) -> Parameters | str:
    """The parameters of ``obj``'s one model entry (:func:`entry_parameters`), or why they cannot be told."""
    from ckptfix.transforms.checkpoint import convert_checkpoint, get_entry

    if len(model_entries) != 1:
        return (
            f"the checkpoint holds {len(model_entries)} model entries, and which one it steps is not said; "
            f"pass --model MOD:FACTORY"
        )
    state = convert_checkpoint(get_entry(obj, model_entries[0]), to="single", source=where).obj
    return entry_parameters(state, count=len(order(osd)), identity=identity, entry=model_entries[0])
