"""Convert one checkpoint file into another: read, transform, write; every check before the first byte out.

The route is decided once, by :func:`ckptfix.conversion.plan.plan_conversion`: a stream (:mod:`ckptfix.stream`) rewrites
only the pickle or header and copies tensor bytes; where it does not apply (a cast into a .pt, a legacy file, a
view safetensors cannot hold: said by the plan, or by the stream as it reads), the torch path loads and saves.
Both read the input through the same format readers, so they accept and refuse the same files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ckptfix.conversion.parameters import optimizer_parameters as optimizer_parameters
from ckptfix.conversion.parameters import parameters
from ckptfix.conversion.plan import STREAM_TENSORS, TENSORS_TO_TORCH, TO_DCP, Plan, plan_conversion
from ckptfix.conversion.run import run_conversion
from ckptfix.errors import UsageError
from ckptfix.formats.output.atomic import PathLike, check_output, check_output_folder
from ckptfix.formats.paths import resolve_output
from ckptfix.formats.rankfile import rank_file_note, refuse_rank_file
from ckptfix.formats.registry import describe_output, detect, read, write
from ckptfix.formats.safetensors.file import losses_note
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.torchio import devices, opaque
from ckptfix.notes import Kind, always
from ckptfix.signature import strict_keywords
from ckptfix.transforms.checkpoint import (
    Conversion,
    convert_checkpoint,
    is_tensor,
    model_entries,
    replace_model_tensors,
)
from ckptfix.transforms.layouts import Layout, parse_layout, parse_rename
from ckptfix.transforms.optim_form import Parameters, parse_form, reform

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
# The names people write for them (torch's own aliases, and the mixed-precision shorthands), case-insensitive.
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
    "f64": "float64",
}


def float_dtype(name: str | None) -> str | None:
    """The canonical name of a floating-point dtype (``bf16`` → ``bfloat16``); :class:`UsageError` otherwise."""
    if name is None:
        return None
    key = str(name).strip().lower().removeprefix("torch.")
    found = DTYPE_ALIASES.get(key, key)
    if found not in FLOAT_DTYPES:
        choices = ", ".join([*FLOAT_DTYPES, *DTYPE_ALIASES])
        raise UsageError(f"dtype={name!r}: not a floating-point dtype ckptfix casts to; choose one of {choices}")
    return found


def refuse_partial(obj: Any, *, source: str, entries: tuple[str, ...] | None) -> None:
    """A checkpoint read whole for its model (``entries``: the ones asked for, None for the model wherever it is):
    refused where its model is in an entry left unbuilt (one rank's DTensor or ShardedTensor shards among them) or
    is one rank's share of a sharded run (FSDP1 flat parameters, a lone DeepSpeed rank file)."""
    from ckptfix.formats.torchio.opaque import require

    require(obj, wanted=entries, source=source)
    # an entry named explicitly is taken as asked, even in a lone ZeRO optimizer file
    refuse_rank_file(obj, source=source, flat=True, model=entries is None)


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """What to do to the model entries; checked once, when it is made."""

    to: Layout | None = "single"
    strip_prefixes: tuple[str, ...] = ()
    add_prefixes: tuple[str, ...] = ()
    renames: tuple[str, ...] = ()
    entries: tuple[str, ...] | None = None
    model_only: bool = False
    dtype: str | None = None
    optimizer_form: str | None = None  # names | indices; None: names into a DCP folder where known (optim_form)
    parameters: Parameters | None = None  # from --model or --optimizer-factory, where the checkpoint does not say them

    def __post_init__(self) -> None:
        # frozen: the names people write (DDP, bf16, half) become the canonical ones once, here
        object.__setattr__(self, "to", parse_layout(self.to))
        object.__setattr__(self, "dtype", float_dtype(self.dtype))
        object.__setattr__(self, "optimizer_form", parse_form(self.optimizer_form))
        for rename in self.renames:
            parse_rename(rename)  # a bad pattern fails here, before any file is opened

    def apply(self, obj: Any, *, source: str, out_fmt: str = "torch") -> Conversion:
        """The layout conversion of ``obj`` and its optimizer state in the form ``out_fmt`` loads (a pure
        transform; the dtype cast is the torch path's)."""
        refuse_partial(obj, source=source, entries=self.entries)
        conversion = convert_checkpoint(
            obj,
            to=self.to,
            strip_prefixes=self.strip_prefixes,
            add_prefixes=self.add_prefixes,
            renames=self.renames,
            model_only=self.model_only,
            entries=self.entries,
            source=source,
        )
        if note := rank_file_note(obj, source=source):
            conversion.notes.append(note)
        if not self.model_only:
            from ckptfix.formats.records import identity

            conversion.notes += reform(
                conversion.obj,
                form=self.optimizer_form,
                dcp_out=out_fmt == "dcp",
                model_entries=[c.entry for c in conversion.changes],
                parameters=self.parameters,
                identity=identity,
                copy=_own_tensor,
                source=source,
            )
        return conversion


@strict_keywords
@deep
def convert_file(
    src: PathLike,
    dst: PathLike,
    *,
    to: Layout | None = "single",
    strip_prefixes: Iterable[str] = (),
    add_prefixes: Iterable[str] = (),
    renames: Iterable[str] = (),
    entries: Iterable[str] | None = None,
    model_only: bool = False,
    dtype: str | None = None,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    fast: bool = True,
    verify: bool = True,
    shard_size: int | None = None,
    overwrite: bool = False,
    optimizer: bool = False,
    format: str | None = None,
    optimizer_form: str | None = None,
    model: str | None = None,
    optimizer_factory: str | None = None,
) -> Conversion:
    """Convert checkpoint ``src`` into ``dst`` (format from its extension); returns what changed.

    ``src`` may be a folder (transformers shards, an accelerate ``save_state`` folder, a DCP folder) or its
    index file. ``dst`` ending in ``/`` (or an existing empty folder) gets a DCP folder; ``shard_size`` (bytes)
    writes transformers shards of at most that size beside ``dst`` (or in it, when it is a folder). ``format``
    (``hf``, ``dcp``, ``safetensors``, ``pt``) chooses a folder ``dst``'s format instead
    (:func:`~ckptfix.formats.paths.resolve_output`); ``result.wrote`` then says what the folder holds.

    An existing output is refused unless ``overwrite=True``, then replaced so that a failure leaves it as it was:
    a file atomically; a DCP folder (only one that holds nothing but a DCP checkpoint) and a shard set (the
    shards and index of ``dst``'s name, never other files beside them) written beside it, then swapped in.

    ``result.method`` says which path ran ("stream" or "torch") and ``result.notes`` why and what was copied.
    ``verify=False`` lets the fast path skip reading a .pt input for its CRCs when the output is a .pt: the
    output keeps the input's CRCs, so a corrupt record is still refused when the output is loaded. Every other
    conversion checks them (a .safetensors output has no CRCs; the torch path writes new ones).

    ``optimizer=True`` (a DeepSpeed ZeRO run into a ``.pt`` file only) writes ``{"model": the fp32 state dict,
    "optimizer": the full torch optimizer state dict}``: each rank's moments consolidated as the weights are.

    ``optimizer_form``: an optimizer entry keyed by parameter ``"names"`` (what ``set_optimizer_state_dict`` loads)
    or ``"indices"`` (what ``optimizer.load_state_dict`` loads); by default names into a DCP folder where the
    model entry says them, indices into a file. Names only where proven: the groups' ``param_names``, the model's
    order where one group holds every parameter, or ``optimizer_factory`` (``package.module:function``: called with
    the model ``model`` builds, it returns the optimizer the run built). ``model`` (``package.module:factory``)
    also says which tensors are parameters where the checkpoint does not (buffers only the model's code knows).

    >>> ckptfix.convert_file("ddp.pt", "model.safetensors", to="single")
    """
    options = ConvertOptions(
        to=to,
        strip_prefixes=tuple(strip_prefixes),
        add_prefixes=tuple(add_prefixes),
        renames=tuple(renames),
        entries=None if entries is None else tuple(entries),
        model_only=model_only,
        dtype=dtype,
        optimizer_form=optimizer_form,
        parameters=parameters(model, optimizer_factory),
    )
    return _convert(
        src,
        dst,
        options,
        format=format,
        shard_size=shard_size,
        allow=tuple(allow_globals),
        unsafe=unsafe,
        verify=verify,
        overwrite=overwrite,
        optimizer=optimizer,
        fast=fast,
    )


def _convert(
    src: PathLike,
    dst: PathLike,
    options: ConvertOptions,
    *,
    format: str | None,
    shard_size: int | None,
    allow: tuple[str, ...],
    unsafe: bool,
    verify: bool,
    overwrite: bool,
    optimizer: bool,
    fast: bool,
) -> Conversion:
    """:func:`convert_file` once its options are checked: the output checked, the input detected (once), the plan
    carried out (:func:`~ckptfix.conversion.run.run_conversion`)."""
    source = os.fspath(src)
    out, out_fmt, shard_size = resolve_output(dst, fmt=format, shard_size=shard_size)
    _check_output(
        src,
        out,
        out_fmt=out_fmt,
        shard_size=shard_size,
        overwrite=overwrite,
        optimizer=optimizer,
        model_only=options.model_only,
    )
    found = detect(src)
    job = _FileJob(
        source=source,
        dst=out,
        in_fmt=found.name,
        out_fmt=out_fmt,
        shard_size=shard_size,
        options=options,
        transform=_transform(options, source, in_kind=found.kind, out_fmt=out_fmt),
        allow=allow,
        unsafe=unsafe,
        verify=verify,
        overwrite=overwrite,
        optimizer=optimizer,
    )
    sharded = shard_size is not None
    plan = plan_conversion(
        in_fmt=found.name, out_fmt=out_fmt, fast=fast, dtype=options.dtype, unsafe=unsafe, sharded=sharded
    )
    return job.finish(run_conversion(plan, stream=lambda: job.stream(plan), torch=job.torch))


def _check_output(
    src: PathLike, dst: str, *, out_fmt: str, shard_size: int | None, overwrite: bool, optimizer: bool, model_only: bool
) -> None:
    """OUT as :func:`convert_file` may write it (a folder --format hf is :func:`~ckptfix.exporting.folder.export_hf`'s
    call; ``optimizer=True``, :func:`_check_optimizer`'s); an existing one only with ``overwrite``."""
    if out_fmt == "hf":
        raise UsageError(
            f"format='hf': call ckptfix.export_hf({os.fspath(src)!r}, {dst!r}), which takes config_from= and verify="
        )
    if optimizer:
        _check_optimizer(os.fspath(src), dst, out_fmt=out_fmt, model_only=model_only, shard_size=shard_size)
    if out_fmt == "dcp":
        check_output_folder(dst, inputs=(src,), overwrite=overwrite)
    elif shard_size is not None:
        from ckptfix.formats.hf.folder import check_shards_output

        check_shards_output(dst, inputs=(src,), overwrite=overwrite)
    else:
        check_output(dst, inputs=(src,), overwrite=overwrite)


@dataclass(frozen=True, kw_only=True)
class _FileJob:
    """One :func:`convert_file` call, as its stream and its torch path take it: where from and to, in what formats,
    and how."""

    source: str
    dst: str
    in_fmt: str
    out_fmt: str
    shard_size: int | None
    options: ConvertOptions
    transform: Callable[[Any], Conversion]
    allow: tuple[str, ...]
    unsafe: bool
    verify: bool
    overwrite: bool
    optimizer: bool

    def stream(self, plan: Plan) -> Conversion:
        """Run ``plan``'s stream route; :class:`~ckptfix.formats.copyable.Fallback` before anything is written where
        it does not apply."""
        if plan.route == TO_DCP:
            from ckptfix.stream.to_dcp import convert_to_dcp

            streamed: Conversion = convert_to_dcp(
                self.source,
                self.dst,
                in_fmt=self.in_fmt,
                dtype=self.options.dtype,
                transform=self.transform,
                allow_globals=self.allow,
                overwrite=self.overwrite,
                optimizer=self.optimizer,
            )
            _note_losses(streamed, self.out_fmt)
            return streamed
        if plan.route == TENSORS_TO_TORCH:  # optimizer=True, or a cast into one .pt
            from ckptfix.stream.folder_torch import convert_folder_to_torch

            return convert_folder_to_torch(
                self.source,
                self.dst,
                transform=self.transform,
                allow_globals=self.allow,
                optimizer=self.optimizer,
                dtype=self.options.dtype,
            )
        if plan.route == STREAM_TENSORS:
            from ckptfix.stream.folders import convert_folder

            return convert_folder(
                self.source,
                self.dst,
                transform=self.transform,
                allow_globals=self.allow,
                dtype=self.options.dtype,
                shard_size=self.shard_size,
                overwrite=self.overwrite,
            )
        from ckptfix.stream import fast_convert

        # it notes what a .safetensors output does not keep, as it goes
        return fast_convert(  # type: ignore[no-any-return]
            self.source,
            self.dst,
            in_fmt=self.in_fmt,
            out_fmt=self.out_fmt,
            transform=self.transform,
            allow_globals=self.allow,
            verify=self.verify,
        )

    def torch(self) -> Conversion:
        """Load with torch, transform, cast, save."""
        # a tensor saved on cuda:0 is written as one (the fast path copies its tag)
        with devices.keeping_locations():
            model_only = self.options.model_only
            obj = read(
                self.source,
                fmt=self.in_fmt,
                unsafe=self.unsafe,
                allow_globals=self.allow,
                model_only=model_only,
                opaque=True,
            )
            if self.optimizer:
                from ckptfix.formats.deepspeed.run import load_training_state

                obj = {"model": obj, **load_training_state(self.source, allow_globals=self.allow)}
            conversion = self.transform(obj)
            opaque.refuse_left(conversion.obj, source=self.source)
            if self.options.dtype is not None:
                cast_floating(conversion, self.options.dtype)
            write(conversion.obj, self.dst, fmt=self.out_fmt, shard_size=self.shard_size, overwrite=self.overwrite)
        return conversion

    def finish(self, conversion: Conversion) -> Conversion:
        """What either path says last: (torch) a CRC-less input, what a .safetensors or DCP output loses; what the
        output holds, and tied keys a .safetensors output stores once."""
        if conversion.method == "torch":
            if self.in_fmt == "torch-zip" and not self.unsafe:
                from ckptfix.formats.torchzip.archive import NO_CRC
                from ckptfix.formats.torchzip.reader import stores_crcs

                if not stores_crcs(self.source):  # the output gets CRCs of its own, computed by torch.save
                    conversion.notes.append(f"{NO_CRC} in the input")
            _note_losses(conversion, self.out_fmt)
        conversion.wrote = describe_output(self.dst, fmt=self.out_fmt, shard_size=self.shard_size)
        _note_tied(conversion, self.dst, out_fmt=self.out_fmt, shard_size=self.shard_size)
        return conversion


def _transform(options: ConvertOptions, source: str, *, in_kind: str, out_fmt: str) -> Callable[[Any], Conversion]:
    """``options.apply`` to what is read; a transformers folder (or its model file) into a .pt first gets back the
    tied copies save_pretrained leaves out (:mod:`ckptfix.exporting.ties`), which a model's strict load wants."""
    if out_fmt != "torch" or not _saved_pretrained(source, in_kind=in_kind):
        return lambda tree: options.apply(tree, source=source, out_fmt=out_fmt)
    from ckptfix.exporting.ties import saved_ties

    ties = saved_ties(source)

    def restoring(tree: Any) -> Conversion:
        tree, restored = ties.restore(tree)
        conversion = options.apply(tree, source=source, out_fmt=out_fmt)
        conversion.notes[:0] = ties.notes(restored)
        return conversion

    return restoring


def _saved_pretrained(source: str, *, in_kind: str) -> bool:
    """A transformers folder or index, or a model file beside a ``config.json`` (the folder module imported only
    then: a plain .pt conversion imports no more than it needs)."""
    if in_kind == "hf":
        return True
    if not os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(source)), "config.json")):
        return False
    from ckptfix.formats.hf.folder import is_model_file

    return is_model_file(source)


def _note_tied(conversion: Conversion, dst: str, *, out_fmt: str, shard_size: int | None) -> None:
    """A tensor under two names that a .safetensors output stores once: said, with what gives both names back."""
    if out_fmt != "safetensors":
        return
    from ckptfix.formats.safetensors.file import tied_note

    paths = [dst]
    if shard_size is not None:  # the folder module only when shards were written
        from ckptfix.formats.hf.folder import shard_set

        paths = [p for p in shard_set(dst) if not p.endswith(".index.json")]
    if note := tied_note(paths):
        conversion.notes.insert(0, always(note, kind=Kind.TIES))  # the route's note stays the last


def _own_tensor(value: Any) -> Any:
    """A copy of a torch tensor; for a record (a stream reads no values), the torch path, which copies."""
    from ckptfix.formats.copyable import Fallback, Reason

    if not hasattr(value, "clone"):
        raise Fallback(Reason.SHARED_STEP)
    copied = value.clone()
    devices.inherit(copied, value)
    return copied


def _check_optimizer(source: str, dst: PathLike, *, out_fmt: str, model_only: bool, shard_size: int | None) -> None:
    """``optimizer=True``: a DeepSpeed ZeRO run into one ``.pt`` file or a DCP folder, nothing else (a usage error
    naming both)."""
    from ckptfix.formats.deepspeed.run import is_deepspeed

    if model_only:
        raise UsageError(
            "optimizer=True and model_only=True ask for opposite things (the optimizer state, the model "
            "alone); drop one"
        )
    if out_fmt not in ("torch", "dcp") or shard_size is not None:
        what = "transformers shards" if shard_size is not None else "a .safetensors file (tensors only)"
        raise UsageError(
            f"optimizer=True writes {{model, optimizer}} into one .pt file or a DCP folder, but "
            f"{os.fspath(dst)} asks for {what}; write a .pt or a folder/, or drop "
            f"optimizer=True"
        )
    if not is_deepspeed(source):
        raise UsageError(
            f"optimizer=True applies to a DeepSpeed ZeRO run folder, and {source} is not one; drop "
            f"optimizer=True (a .pt input keeps its optimizer entry as it is)"
        )


def _note_losses(conversion: Conversion, out_fmt: str) -> None:
    if out_fmt == "safetensors" and (lost := safetensors_losses(conversion.obj)):
        conversion.notes.append(lost)
    if out_fmt == "dcp" and (named := _non_string_keys(conversion.obj)):
        count, first = named
        conversion.notes.append(
            always(
                f"{DCP_STRING_KEYS}: {count} non-string key(s) become strings (e.g. '{first}'), as torch's DCP "
                f"writer stores every key; write a .pt to keep them",
                kind=Kind.LOSS,
            )
        )


DCP_STRING_KEYS = "DCP keeps keys as strings"  # said whatever the verbosity: a value read back differs


def _non_string_keys(obj: Any, path: str = "") -> tuple[int, str] | None:
    """How many dict keys under ``obj`` are not strings (an optimizer's ``state`` is keyed by int), and the first."""
    count, first = 0, ""
    if isinstance(obj, dict):
        for key, value in obj.items():
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                count, first = count + 1, first or where
            if found := _non_string_keys(value, where):
                count, first = count + found[0], first or found[1]
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            if found := _non_string_keys(value, f"{path}.{i}" if path else str(i)):
                count, first = count + found[0], first or found[1]
    return (count, first) if count else None


def safetensors_losses(obj: Any) -> str | None:
    """What a .safetensors copy of ``obj`` cannot keep (values are exact): said once, under ``-v``."""
    from ckptfix.formats.records import is_record

    entries = model_entries(obj)
    states = [obj] if entries == [""] else [obj[e] for e in entries]
    params = views = grads = 0
    for value in (v for state in states for v in state.values()):
        if is_record(value):  # a .pt's tensor or Parameter, read without torch
            params += value.is_parameter
            views += not value.zip_tensor.is_contiguous()
            grads += value.requires_grad
        elif is_tensor(value) and hasattr(value, "requires_grad"):  # a torch tensor (not a safetensors record)
            params += type(value).__name__ == "Parameter"
            views += not value.is_contiguous() or value.untyped_storage().nbytes() > value.nbytes
            grads += bool(value.requires_grad)
    return losses_note(params=params, views=views, grads=grads)


def cast_floating(conversion: Conversion, dtype: str) -> None:
    """Cast floating-point tensors of the converted model entries to ``dtype`` (integer buffers stay); a tensor
    under two names (tied weights) is cast once and stays one tensor."""
    import torch

    target = getattr(torch, dtype)

    def cast(key: str, t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return None
        new = t.to(target)
        devices.inherit(new, t)
        return new

    replace_model_tensors(conversion, cast)


__all__ = ["ConvertOptions", "convert_file"]
