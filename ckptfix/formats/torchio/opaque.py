"""Entries of a checkpoint that need globals outside the allowlist, kept as opaque records instead of a refusal.

The inert reader builds a stand-in record for every global, allowed or not, and calls none of them. When a file
names globals outside the allowlist, every top-level entry that holds one becomes an :class:`OpaqueEntry`: a
description (which classes, how many, whether any can run code) around the entry's inert records. The other
entries are read, converted and written as usual, so the weights next to an mmengine ``message_hub`` or a
payload are rescued without anything of the file being imported or called. What each operation does with them:

- ``ckptfix.load`` needs every value: it refuses, naming the opaque entries and what rescues the weights;
- ``load_into``, ``check``, ``validate``, ``inspect`` need only the model entry: they work, and say what was not
  loaded (``report.not_loaded``);
- ``convert --model-only`` / ``--entry`` drop them; a full ``.pt`` to ``.pt`` conversion on the streaming path
  writes them back as the same records (:func:`carry`: equivalent opcodes, never executed), saying which can run
  code: the output is then exactly as safe to load as the input, and ckptfix reports it the same way; a
  ``.safetensors`` output and the torch path never hold them.

A refused global found outside any top-level entry (the checkpoint is not a mapping, a key is one, or the
pickle built it and threw it away), or anywhere in a bare state dict, rescues nothing: the file is refused as
before.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptfix.errors import CkptfixError
from ckptfix.formats.pickles import inert
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchzip.reader import TorchZip, read_torch_zip
from ckptfix.notes import always

# What a record builds, where its function's name would mislead (numpy pickles an array as a call of _reconstruct).
_BUILDS = {
    **{f"{m}.multiarray._reconstruct": "numpy.ndarray" for m in ("numpy.core", "numpy._core")},
    **{f"{m}.multiarray.scalar": "numpy scalar" for m in ("numpy.core", "numpy._core")},
}


@dataclass(frozen=True, eq=False)
class OpaqueEntry:
    """A top-level entry left unbuilt: its pickle records (``records``), never imported, called or loaded."""

    name: str
    needs: tuple[str, ...]  # the globals outside the allowlist it names
    classes: tuple[tuple[str, int], ...]  # what its outermost such records build, with counts
    records: Any  # the entry's inert tree, as the reader built it

    @property
    def runs_code(self) -> tuple[str, ...]:
        """The globals it names that can run code (``builtins.getattr``, ``posix.system``, ...)."""
        return tuple(n for n in self.needs if allowlist.can_run_code(n))

    def what(self) -> str:
        """``mmengine.logging.history_buffer.HistoryBuffer ×12``."""
        return ", ".join(f"{name} ×{count}" for name, count in self.classes)

    def describe(self) -> str:
        """``mmengine.logging.history_buffer.HistoryBuffer ×12, not loaded`` (and what can run code)."""
        danger = self.runs_code
        return f"{self.what()}, not loaded" + (
            f"; it calls {', '.join(danger)}, which can run code (nothing was run)" if danger else ""
        )

    def __repr__(self) -> str:
        return f"<opaque entry {self.name!r}: {self.describe()}>"


def describe(
    fd: int, source: str, *, allowed: frozenset[str], verify: bool = False, keep: bool = True, plain: bool = True
) -> TorchZip:
    """:func:`read_torch_zip` whose tree has an :class:`OpaqueEntry` for each entry needing a refused global.

    ``keep=False`` (an operation that needs every value) refuses such a file, naming the opaque entries and what
    rescues the weights; a file whose refused globals are not all inside top-level entries is always refused.
    ``plain``: see :func:`.unpickling.load`.
    """
    refused: list[str] = []
    z = read_torch_zip(fd, source, allowed=allowed, verify=verify, refused=refused, plain=plain)
    return wrapped(z, refused, source=source, keep=keep)


def wrapped(z: TorchZip, refused: list[str], *, source: str, keep: bool = True) -> TorchZip:
    """:func:`describe` of an archive already read, its pickle naming ``refused`` outside the allowlist."""
    if not refused:
        return z
    tree = wrap(z.tree, refused, source=source)
    if not keep:
        raise refusal(tree, source=source)
    return replace(z, tree=tree)


def wrap(tree: Any, refused: Iterable[str], *, source: str) -> Any:
    """``tree`` (a checkpoint's inert tree) with each top-level entry that names a refused global replaced by its
    :class:`OpaqueEntry`; raises the refusal when a refused global sits anywhere else."""
    from ckptfix.transforms.checkpoint import is_state_dict

    names = {allowlist.canonical(n) for n in refused}
    if (
        not isinstance(tree, dict)
        or not all(type(k) is str for k in tree)
        or is_state_dict(tree)  # a bare state dict: every entry is part of the model
        or _found(_attrs(tree), names)[0]
    ):
        allowlist.refuse(names, source=source)
    out: dict[str, Any] = OrderedDict() if isinstance(tree, OrderedDict) else {}
    seen: set[str] = set()
    for key, value in tree.items():
        needs, classes = _found(value, names)
        seen |= needs
        out[key] = (
            OpaqueEntry(key, tuple(sorted(needs)), tuple(sorted(classes.items(), key=lambda c: (-c[1], c[0]))), value)
            if needs
            else value
        )
    _copy_attrs(tree, out)  # an OrderedDict's attributes, checked above to name none
    if seen != names:  # built and thrown away: nothing to rescue around, and it would run under torch.load
        allowlist.refuse(names, source=source)
    return out


def _found(value: Any, names: set[str]) -> tuple[set[str], Counter[str]]:
    """The refused globals ``value`` names, and what its outermost records of them build, counted."""
    needs: set[str] = set()
    classes: Counter[str] = Counter()
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, inside = stack.pop()
        if isinstance(item, (str, int, float, bytes, inert.StorageRef)) or item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type) and issubclass(item, inert.Global):
            if item.full in names:
                needs.add(item.full)
                classes[item.full] += not inside
            continue
        if isinstance(item, inert.Inert):
            hit = item.func.full in names
            if hit:
                needs.add(item.func.full)
                classes[_BUILDS.get(item.func.full, item.func.full)] += not inside
            stack.extend((kid, inside or hit) for kid in (item.args, item.state))
        elif isinstance(item, dict):
            stack.extend((kid, inside) for kid in (*item.keys(), *item.values(), *_attrs(item).values()))
        elif isinstance(item, (list, tuple)):
            stack.extend((kid, inside) for kid in item)
    return needs, +classes


def _attrs(obj: Any) -> dict[str, Any]:
    return getattr(obj, "__dict__", {})  # an OrderedDict's attributes (_metadata); a dict has none


def _copy_attrs(src: Any, dst: Any) -> None:
    if _attrs(src):
        dst.__dict__.update(_attrs(src))


def entries(obj: Any) -> list[OpaqueEntry]:
    """The opaque entries of a checkpoint (its top-level values)."""
    return [v for v in obj.values() if isinstance(v, OpaqueEntry)] if isinstance(obj, Mapping) else []


def not_loaded(obj: Any) -> dict[str, str]:
    """Entry name -> what it holds, for every opaque entry of ``obj`` (for reports)."""
    return {e.name: e.describe() for e in entries(obj)}


def require(obj: Any, *, wanted: Iterable[str] | None, source: str) -> None:
    """Refuse, as ``ckptfix.load`` would, when an entry the operation needs is opaque: one it names in ``wanted``,
    or, naming none, one that would be taken for a model entry (another must not be picked in its place)."""
    from ckptfix.transforms.checkpoint import model_entry_name

    unbuilt = [e.name for e in entries(obj)]
    names = set(wanted or ())
    if any(name in names for name in unbuilt) or (
        not names and unbuilt and (any(model_entry_name(n) for n in unbuilt) or _tensors_only(obj))
    ):
        raise refusal(obj, source=source)


def _tensors_only(obj: Mapping[Any, Any]) -> bool:
    """Whether ``obj`` is a state dict of its own, some tensors unbuilt (one rank's DTensors, whatever their keys
    are called): the model is then what is unbuilt."""
    from ckptfix.transforms.checkpoint import is_tensor

    return all(isinstance(v, OpaqueEntry) or is_tensor(v) for v in obj.values())


def refusal(obj: Any, *, source: str) -> CkptfixError:
    """The allowlist's refusal of every global the opaque entries need, with what rescues the weights."""
    from ckptfix.formats.deepspeed.files import refuse_optimizer_partition
    from ckptfix.transforms.checkpoint import model_entries

    try:  # one rank's DeepSpeed optimizer file: the folder is what to pass, not unsafe=True
        refuse_optimizer_partition(obj, source=source)
    except CkptfixError as e:
        return e
    found = entries(obj)
    try:
        allowlist.refuse([n for e in found for n in e.needs], source=source)
    except CkptfixError as e:
        models = model_entries(obj)
        if models and models != [""]:
            names = ", ".join(f"'{o.name}'" for o in found)
            weights = ", ".join(f"'{m}'" for m in models)
            e.args = (
                f"{e.args[0]}. The weights in {weights} need none of it ({names} would stay unloaded): convert "
                f"with model_only=True (or entries='{models[0]}'), or load them with ckptfix.load_into",
            )
        return e
    raise AssertionError("opaque entries need globals the allowlist refuses")  # pragma: no cover


def carry(obj: Any, *, out_fmt: str, source: str, notes: list[str]) -> Any:
    """``obj`` as the streaming path writes it to ``out_fmt``: opaque entries back as their records (.pt), said in
    ``notes`` with the code they can run. Refuses any opaque entry in a .safetensors output."""
    found = entries(obj)
    if not found:
        return obj
    if out_fmt != "torch":  # as ckptfix.load refuses it: the values are needed
        raise refusal(obj, source=source)
    out: Any = OrderedDict() if isinstance(obj, OrderedDict) else {}
    for key, value in obj.items():
        out[key] = value.records if isinstance(value, OpaqueEntry) else value
    _copy_attrs(obj, out)
    notes.append(always(KEPT + "; ".join(f"'{e.name}' ({_kept(e)})" for e in found)))
    return out


KEPT = "kept as their pickle records, copied, never executed: "


def _kept(entry: OpaqueEntry) -> str:
    if not entry.runs_code:
        return entry.what()
    return (
        f"{entry.what()}; it calls {', '.join(entry.runs_code)}, which can run code: load the output only as you "
        f"would the input, or leave it out with --model-only"
    )


def refuse_left(obj: Any, *, source: str) -> None:
    """Refuse, as ``ckptfix.load`` does, when ``obj`` still holds an opaque entry: the torch path writes only
    values it built (the streaming path copies such entries into a .pt output, see :func:`carry`)."""
    if entries(obj):
        raise refusal(obj, source=source)


__all__ = [
    "KEPT",
    "OpaqueEntry",
    "carry",
    "describe",
    "entries",
    "not_loaded",
    "refusal",
    "refuse_left",
    "require",
    "wrap",
]
