"""Collective checkpoint loading and saving for DDP: one rank touches the file, every rank gets the result.

``load_for_ddp`` reads, converts and checks the checkpoint on rank ``src`` only, tells every rank whether that
worked before any tensor moves, and then broadcasts the weights (and the optimizer and other state) in bounded
buckets straight into each rank's own parameters. A failure anywhere, on the source or on a rank whose model
was built differently, makes every rank raise the same error within seconds, and a rank that hangs or dies
releases the others within ``timeout``; no rank is left in a collective (see ``protocol``).
``save_for_ddp`` writes once, atomically, from one rank and returns on every rank when the file is complete.

Nothing here is imported by the CLI at start-up; torch is imported inside the functions.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ckptfix.distributed import buckets, protocol, wire
from ckptfix.errors import DistributedError, MismatchError
from ckptfix.formats.safety.depth import deep

if TYPE_CHECKING:
    import torch

PathLike = str | os.PathLike[str]

DEFAULT_TIMEOUT = 600.0
DEFAULT_BUCKET_MB = 64.0


@deep
def load_for_ddp(
    model: torch.nn.Module,
    path: PathLike,
    *,
    src: int = 0,
    strict: bool = True,
    group: Any = None,
    broadcast_model: bool = True,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    bucket_mb: float = DEFAULT_BUCKET_MB,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` on every rank of ``group`` while reading it on rank ``src`` only.

    Call it on every rank of ``group`` (default: the world), before wrapping the model in DDP. Only rank
    ``src`` (a global rank, as in ``torch.distributed.broadcast``) opens ``path``; other ranks may pass a path
    that does not exist for them. The source loads weights-only with mmap, takes the model entry of a full
    checkpoint, converts it to its model's own layout (plain, compiled or already wrapped) and checks keys,
    shapes and dtypes. Every other rank checks the source's manifest against its own model (the models may
    differ in layout, not in shapes). Then the weights and every other tensor of the checkpoint are broadcast.

    With gloo, tensors travel on the CPU. With NCCL, they travel on ``torch.cuda.current_device()``: call
    ``torch.cuda.set_device(local_rank)`` before ``init_process_group`` and put the model there; a model on
    another GPU is refused on every rank.

    DDP's constructor broadcasts parameters and buffers from the group's first rank, so the model broadcast
    can be skipped with ``broadcast_model=False`` when ``src`` is that rank and DDP comes next. Keep it for
    wrappers that do not sync (FSDP, DataParallel, plain model averaging), when ``src`` is another rank, or to
    have identical weights before wrapping; the check, the error propagation and the returned state are the
    same either way.

    Args:
        strict: refuse a checkpoint that lacks a model key or has extra ones; ``False`` loads what fits
            (keys with a wrong shape are skipped; keys the checkpoint lacks keep each rank's own values).
        entry, strip_prefixes: as :func:`ckptfix.load_into`: the model entry to load (``"state_dict_ema"``), and
            prefixes removed from every key first. Like ``load_into``, a prefix that alone makes the keys fit the
            model is applied, and tied keys the file leaves out load through the key they share.
        allow_globals: extra pickle globals the checkpoint may use (``"argparse.Namespace"``); same on every rank.
        bucket_mb: broadcast bucket size; a receiver holds at most one bucket beyond its own model.
        timeout: seconds (or a ``timedelta``) a rank waits for the others at any step (the source's read,
            every rank's check, one broadcast) before every rank gives up with the same error.

    Returns:
        The checkpoint's entries other than the model's state dict (optimizer and scheduler state, epoch,
        other model entries such as an EMA copy, user entries), with their tensors on the CPU, on every rank;
        ``{}`` for a bare state dict. Entries that need globals outside the allowlist are left out, unbuilt (as
        ``load_into`` leaves them, see ``report.not_loaded``).

    Raises:
        CkptfixError: the same subclass and message on every rank, naming the rank that failed (the
            source's ``FormatError`` or ``UnsafeCheckpointError``, a ``MismatchError``, or
            ``DistributedError`` for ranks given different arguments, entries that cannot be broadcast, or a
            rank that hung, died or failed otherwise), within about ``timeout`` of the last step that
            completed; a rank that was frozen raises it as soon as it runs again. A failure before the
            transfer changes no model but the source's. After one during the transfer, a receiver's model is
            partly loaded and the process group may hold abandoned work: end the job (torchrun restarts it).

    >>> extras = ckptfix.load_for_ddp(model, "run/last.pt")      # every rank, before DDP(model)
    >>> optimizer.load_state_dict(extras["optimizer"]); start = extras["epoch"] + 1
    """
    options = _Options(strict, broadcast_model, entry, list(strip_prefixes), bucket_mb, sorted(allow_globals))
    session = _start(group, path, src=src, timeout=timeout, options=options)
    if session.is_src:
        plan, extras = _prepare_source(model, path, options, session)
    else:
        plan, extras = _prepare_receiver(model, options, session), {}
    _transfer(plan, session, options)
    session.finish()
    if session.is_src:
        return extras
    result: dict[str, Any] = buckets.fill_tensors(plan.skeleton, plan.extra_tensors)
    return result


@dataclass(frozen=True)
class _Options:
    """The arguments every rank must agree on before anything else: they decide which rank broadcasts what, in
    which pieces. Given positionally, in this order (the order the ranks compare them in)."""

    strict: bool
    broadcast_model: bool
    entry: str | None
    strip_prefixes: list[str]
    bucket_mb: float
    allow_globals: list[str]  # sorted


def _start(group: Any, path: PathLike, *, src: int, timeout: float | timedelta, options: _Options) -> protocol.Session:
    """The ``start`` phase: every rank agrees on the arguments; then a ``broadcast_model=False`` that DDP would
    not make up for is refused."""
    session = protocol.open_session(
        group, src=src, timeout=timeout, call="load_for_ddp", path=os.fspath(path), options=asdict(options)
    )
    if not options.broadcast_model and src != session.ranks[0]:
        raise DistributedError(
            f"broadcast_model=False needs src to be the group's first rank {session.ranks[0]} (DDP syncs from "
            f"there), got src={src}; keep broadcast_model=True"
        )
    return session


def _prepare_source(
    model: torch.nn.Module, path: PathLike, options: _Options, session: protocol.Session
) -> tuple[_Plan, dict[str, Any]]:
    """The source's ``status`` phase (its read, or its failure, announced) and its part of the ``check`` phase."""
    try:
        plan, extras = _read_on_source(model, path, options, session)
    except Exception as e:
        session.fail("status", e)
    session.announce(wire.dumps((plan.manifest, plan.skeleton, plan.extra_entries)))
    session.agree(None)
    return plan, extras


def _prepare_receiver(model: torch.nn.Module, options: _Options, session: protocol.Session) -> _Plan:
    """A receiver's ``status`` phase (the source's payload heard) and its part of the ``check`` phase."""
    received = _check_receiver(
        model, session.hear(), strict=options.strict, allowed=options.allow_globals, session=session
    )
    session.agree(received if isinstance(received, Exception) else None)
    if isinstance(received, Exception):  # agree() raised it on every rank already; this is for mypy
        raise received
    return received


@dataclass
class _Plan:
    """What one rank sends or receives: its own state (filled in place), the manifest, the other entries."""

    own: dict[str, Any]
    prefix: str  # this rank's layout prefix: the manifest names keys in the single layout
    manifest: list[buckets.Entry]
    skeleton: Any  # the checkpoint's other entries, each tensor replaced by a buckets.TensorRef
    extra_entries: list[buckets.Entry]
    extra_tensors: list[torch.Tensor] = field(default_factory=list)  # the source's, or a receiver's new ones


def _transfer(plan: _Plan, session: protocol.Session, options: _Options) -> None:
    """The ``transfer`` phase's broadcasts: a failure on any rank is raised alike on every rank."""
    try:
        _broadcast(plan, session, broadcast_model=options.broadcast_model, bucket_mb=options.bucket_mb)
    except Exception as e:
        if session.failed:  # the error every rank raises, already agreed on
            raise
        session.fail("transfer", e)


def _broadcast(plan: _Plan, session: protocol.Session, *, broadcast_model: bool, bucket_mb: float) -> None:
    import torch

    bucket_bytes = max(1, int(bucket_mb * 2**20))
    if broadcast_model:
        tensors = [plan.own[plan.prefix + entry.key] for entry in plan.manifest]
        buckets.run(
            buckets.plan(plan.manifest, bucket_bytes),
            tensors,
            send=session.is_src,
            device=session.device,
            broadcast=session.broadcast,
        )
    if not session.is_src:
        plan.extra_tensors = [torch.empty(e.shape, dtype=e.torch_dtype()) for e in plan.extra_entries]
    buckets.run(
        buckets.plan(plan.extra_entries, bucket_bytes),
        plan.extra_tensors,
        send=session.is_src,
        device=session.device,
        broadcast=session.broadcast,
    )


def _layout_prefix(own: Mapping[str, Any]) -> str:
    from ckptfix.transforms import layouts

    return layouts.chain_prefix(layouts.detect(own.keys(), source="model").chain)


def _read_on_source(
    model: torch.nn.Module, path: PathLike, options: _Options, session: protocol.Session
) -> tuple[_Plan, dict[str, Any]]:
    """Load, convert, check and apply the checkpoint on the source; refuse entries that cannot travel."""
    source = os.fspath(path)
    _check_device(model, session)
    obj, adapted = _read_adapted(model, path, options, source=source)
    extras = _extras(obj, options.entry, source=source)
    entries: list[buckets.Entry] = []
    tensors: list[torch.Tensor] = []
    skeleton = buckets.strip_tensors(extras, entries, tensors)
    # Before the model changes and before any rank is told to go on: a refusal here reaches every rank as is.
    wire.check_sendable(skeleton, entries, tensors, source=source, allowed=options.allow_globals)
    model.load_state_dict(adapted, strict=options.strict)
    own = model.state_dict()
    prefix = _layout_prefix(own)
    # The manifest names keys in the single layout, so a rank whose model is wrapped differently still fits.
    manifest = [buckets.Entry.of(key[len(prefix) :], own[key]) for key in adapted if key in own]
    return _Plan(own, prefix, manifest, skeleton, entries, tensors), extras


def _read_adapted(
    model: torch.nn.Module, path: PathLike, options: _Options, *, source: str
) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The checkpoint as read, and its model state converted to ``model``'s layout and checked against it."""
    from ckptfix.formats import registry
    from ckptfix.formats.torchio import opaque
    from ckptfix.loading.model import adapt_to_model, model_state_of, ready_to_load

    # entries needing globals outside the allowlist stay unbuilt (not returned); the model entry must not be one
    obj = registry.read(path, fmt=registry.detect_format(path), allow_globals=options.allow_globals, opaque=True)
    opaque.require(obj, wanted=[options.entry] if options.entry else None, source=source)
    state = model_state_of(obj, source=source, entry=options.entry)
    adapted, report = adapt_to_model(state, model, source=source, strip_prefixes=options.strip_prefixes)
    report.raise_if_failed(strict=options.strict)
    # ready to load: tied keys added, wrong shapes dropped unless strict
    return obj, ready_to_load(adapted, report, strict=options.strict)


def _extras(obj: Mapping[str, Any], entry: str | None, *, source: str) -> dict[str, Any]:
    """The checkpoint's entries besides the model's (none for a bare state dict), less those left unbuilt."""
    from ckptfix.formats.torchio import opaque
    from ckptfix.loading.model import primary_entry

    primary = entry or primary_entry(obj)
    extras = {k: v for k, v in obj.items() if k != primary and not isinstance(v, opaque.OpaqueEntry)} if primary else {}
    left = opaque.not_loaded(obj)
    if left:  # said where the file was read (the source's log): the caller may be looking for the entry
        warnings.warn(
            f"{source}: left out of the returned entries, not built: "
            + "; ".join(f"'{name}' ({what})" for name, what in left.items())
            + ". Pass allow_globals= for its classes if you trust the file",
            stacklevel=6,  # the caller of load_for_ddp: past _read_on_source, _prepare_source and the depth wrapper
        )
    return extras


def _check_receiver(
    model: torch.nn.Module, payload: bytes, *, strict: bool, allowed: list[str], session: protocol.Session
) -> _Plan | Exception:
    """This rank's plan, or its problem with the source's payload (returned, so that every rank hears of it)."""
    from ckptfix.loading.report import compare_keys

    try:
        manifest, skeleton, extra_entries = wire.loads(payload, allowed=allowed)
        own = model.state_dict()
        prefix = _layout_prefix(own)
        _check_device(model, session)
        # Messages name the source's path: a receiver's own path argument may mean nothing on its machine.
        report = compare_keys({prefix + e.key: e.meta() for e in manifest}, model, source=session.source_path)
    except Exception as e:
        return e
    if not strict:
        report.missing = []
    if report.ok:
        return _Plan(own, prefix, manifest, skeleton, extra_entries)
    return MismatchError(
        f"{session.source_path} as loaded on rank {session.src} does not fit the model on rank {session.rank}: "
        f"{report.summary()}; build the same model on every rank"
    )


def _check_device(model: torch.nn.Module, session: protocol.Session) -> None:
    # Under NCCL a model on the wrong GPU is almost always a missing torch.cuda.set_device(local_rank), which
    # would otherwise surface as an NCCL hang or a "duplicate GPU" error far from its cause.
    if session.device.type != "cuda":
        return
    for name, tensor in model.state_dict().items():
        if tensor.device.type == "cuda" and tensor.device != session.device:
            raise DistributedError(
                f"model tensor '{name}' is on {tensor.device} but this rank's current device is {session.device}; "
                f"call torch.cuda.set_device(local_rank) before init_process_group and move the model there"
            )


@deep
def save_for_ddp(
    obj: torch.nn.Module | Mapping[str, Any],
    path: PathLike,
    *,
    src: int = 0,
    group: Any = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Write a model or checkpoint once, from rank ``src``, and return on every rank when the file is complete.

    A module is saved as its state dict in the single layout (DDP and ``torch.compile`` prefixes removed); a
    checkpoint mapping has its model entries converted to the single layout and keeps every other entry. The
    write is atomic (temp file, fsync, rename). Any failure raises the same error on every rank.

    >>> ckptfix.save_for_ddp({"model": ddp_model, "optimizer": opt.state_dict(), "epoch": epoch}, "last.pt")
    """
    session = protocol.open_session(
        group, src=src, timeout=timeout, call="save_for_ddp", path=os.fspath(path), options={}
    )
    if not session.is_src:
        session.hear()
        session.close("status")
        return
    try:
        from ckptfix.formats.registry import save

        save(_unwrapped(obj, source=os.fspath(path)), path)
    except Exception as e:
        session.fail("status", e)
    session.announce(b"")
    session.close("status")


def _unwrapped(obj: Any, *, source: str) -> Any:
    import torch

    from ckptfix.transforms.checkpoint import convert, model_entries

    if isinstance(obj, torch.nn.Module):
        return convert(obj.state_dict(), to="single", source=source)
    if not isinstance(obj, Mapping):
        raise DistributedError(f"{source}: save_for_ddp takes a module or a checkpoint dict, got {type(obj).__name__}")
    # Modules inside a checkpoint dict ({"model": ddp_model, ...}) are saved as their state dicts.
    flat = {k: v.state_dict() if isinstance(v, torch.nn.Module) else v for k, v in obj.items()}
    return convert(flat, to="single", source=source) if model_entries(flat) else flat


__all__ = ["load_for_ddp", "save_for_ddp"]
