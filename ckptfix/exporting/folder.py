"""``convert SRC OUT/ --format hf``: a folder transformers' ``from_pretrained`` loads, from any checkpoint read.

Everything is checked before a byte is written: transformers is there, the config is found (the source's folder, its
parent, or ``config_from``), the checkpoint's keys are exactly those of the model the config describes, built on the
meta device (:mod:`ckptfix.exporting.model`). The weights are then streamed as any conversion streams them
(:func:`ckptfix.stream.folders.convert_folder`: one tensor's bytes at a time, cast a block at a time), or loaded by
torch where the plan or the stream says so, into ``model.safetensors`` or shards and their index; the config (its
dtype set to the weights'), ``generation_config.json`` and the tokenizer's files go beside them. The folder is
written beside OUT and put in place whole, once complete (and, with ``verify``, once transformers has loaded it
and given the source's logits).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptfix.conversion.files import cast_floating, float_dtype, refuse_partial
from ckptfix.conversion.plan import plan_conversion
from ckptfix.conversion.run import run_conversion
from ckptfix.errors import MismatchError, OutputError
from ckptfix.exporting.classes import export_for
from ckptfix.exporting.model import (
    Exported,
    check_tied_values,
    config_with_dtype,
    export_state,
    load_config,
    meta_model,
    output_dtype,
    quiet_transformers,
)
from ckptfix.formats.hf.config import CONFIG, SIDE_FILES, ConfigFolder, find_config, write_side_files
from ckptfix.formats.output.atomic import PathLike, check_apart, fsync_dir, set_aside
from ckptfix.formats.paths import ONE_SHARD, resolve_output
from ckptfix.formats.registry import Format, detect, detect_format, read
from ckptfix.formats.safety.depth import deep
from ckptfix.notes import Level, Note, always
from ckptfix.signature import strict_keywords
from ckptfix.transforms.checkpoint import Conversion, EntryChange, apply_maps
from ckptfix.transforms.layouts import parse_rename

if TYPE_CHECKING:
    import torch

    from ckptfix.exporting.llama import Mapped
    from ckptfix.exporting.megatron import MegatronExport
    from ckptfix.merging.policy import MergeResult

WEIGHTS = "model.safetensors"


@strict_keywords
@deep
def export_hf(
    src: PathLike,
    out: PathLike,
    *,
    config_from: PathLike | None = None,
    architecture: str | None = None,
    dtype: str | None = None,
    shard_size: int | None = None,
    verify: bool = False,
    overwrite: bool = False,
    entry: str | None = None,
    strip_prefixes: Iterable[str] = (),
    renames: Iterable[str] = (),
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
    fast: bool = True,
    progress: bool = False,
) -> Conversion:
    """Write checkpoint ``src`` as folder ``out`` that ``from_pretrained(out)`` loads with no missing, unexpected or
    newly initialised weight; what was done (``notes``: tied copies left out, files copied; ``dropped``: optimizer, …).

    ``config_from`` is the folder of ``config.json`` (default: ``src``'s folder, then its parent). ``architecture``
    names the model class (default: the config's, else the one of its ``model_type`` the keys fill). ``dtype`` casts
    floating-point weights and sets the config's dtype; ``shard_size`` (bytes) writes shards and their index.
    ``verify=True`` loads ``out`` with transformers and compares its logits on a fixed input with the source weights'
    in the same model: not equal raises :class:`MismatchError`. ``out`` must be new or empty; ``overwrite=True``
    replaces a folder holding only what an export writes. ``progress`` shows a progress bar on a terminal while the
    weights are streamed.

    >>> ckptfix.export_hf("run/checkpoint-500/", "hf_model/", dtype="bf16")
    """
    dtype = float_dtype(dtype)
    rules = [parse_rename(r) for r in renames]
    resolve_output(out, fmt="hf")  # a file OUT is refused first, as convert refuses it for every folder format
    source, out_s = os.fspath(src), os.fspath(out).rstrip(os.sep) or os.sep
    # the input's format, asked once: a folder's first (a Megatron folder's config is built, not found), a file's
    # once its config and OUT are checked
    found_in = detect(src) if os.path.isdir(source) else None
    megatron = _megatron(found_in, source, config_from=config_from, dtype=dtype)
    found = megatron.found if megatron else find_config(src, config_from=config_from)
    config = megatron.config if megatron else load_config(found.folder)
    _check_out(out_s, inputs=(src, found.config_path, *found.files), overwrite=overwrite)
    export = _Export(
        source=source,
        found_in=found_in or detect(src),
        found=found,
        config=config,
        megatron=megatron,
        entry=entry,
        rules=rules,
        architecture=architecture,
        strip_prefixes=tuple(strip_prefixes),
    )
    allow = tuple(allow_globals)
    tmp = tempfile.mkdtemp(prefix=".ckptfix-hf.", suffix=".ckptfix-tmp", dir=_parent(out_s))
    try:
        result = _write_weights(
            source,
            os.path.join(tmp, WEIGHTS),
            in_fmt=export.found_in.name,
            transform=export.transform,
            dtype=dtype,
            shard_size=shard_size,
            allow=allow,
            unsafe=unsafe,
            fast=fast,
            check=export.check,
            progress=progress,
        )
        names = _side_files(tmp, result, export, dtype=dtype, built=bool(megatron and config_from is None))
        if verify:
            written = output_dtype(export.done[-1].state, dtype)
            result.notes.append(always(export.verify(tmp, allow=allow, unsafe=unsafe, dtype=written)))
        _put_in_place(tmp, out_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.wrote = _wrote(out_s, names)
    return result


def _megatron(
    found_in: Format | None, source: str, *, config_from: PathLike | None, dtype: str | None
) -> MegatronExport | None:
    """A Megatron folder's export (names mapped, config built or read from ``config_from``); None for any other."""
    if found_in is None or found_in.kind != "megatron":
        return None
    from ckptfix.exporting.megatron import for_export

    return for_export(source, config_from=config_from, dtype=dtype)


@dataclass(kw_only=True)
class _Export:
    """One :func:`export_hf` call's source and what it is exported as: its config, a Megatron folder's mapping, the
    options; ``done``: each :class:`Exported` :meth:`transform` made (the stream's, then the torch path's)."""

    source: str
    found_in: Format
    found: ConfigFolder
    config: Any
    megatron: MegatronExport | None
    entry: str | None
    rules: list[Any]
    architecture: str | None
    strip_prefixes: tuple[str, ...]
    done: list[Exported] = field(default_factory=list)

    @property
    def premap(self) -> Any:
        return self.megatron.premap if self.megatron else None

    def transform(self, tree: Any) -> Conversion:
        """The model state of ``tree`` as transformers' model of the config names it; what changed and was left out."""
        from ckptfix.loading.model import primary_entry

        source, entry = self.source, self.entry
        refuse_partial(tree, source=source, entries=(entry,) if entry else None)
        state, named, llama = source_state(tree, self.config, source=source, entry=entry, premap=self.premap)
        if self.rules:
            state = apply_maps(state, self.rules, source=source)
        exported = export_for(
            state,
            self.config,
            architecture=self.architecture,
            source=source,
            config_path=self.found.config_path,
            strip_prefixes=self.strip_prefixes,
        )
        self.done.append(exported)
        renamed = llama.renamed if llama else frozenset()
        change = EntryChange(
            entry or primary_entry(tree),
            llama.layout.name if llama else exported.report.layout_from,
            "transformers",
            len(exported.state),
            sum(k not in state or k in renamed for k in exported.state),
        )
        return Conversion(
            obj=exported.state,
            changes=[change],
            notes=[*(self.megatron.notes if self.megatron else ()), *named, *exported.notes],
            dropped=_left_out(tree, change.entry, hf=self.found_in.kind == "hf", source=source),
        )

    def check(self, read: Callable[[Any], bytes]) -> None:
        """:func:`~ckptfix.exporting.model.check_tied_values` of the export made last (``read(t)``: a tensor's
        bytes), as :func:`_write_weights` calls it."""
        check_tied_values(self.done[-1], read=read, source=self.source, config_path=self.found.config_path)

    def verify(self, folder: str, *, allow: tuple[str, ...], unsafe: bool, dtype: str | None) -> str:
        """:func:`verify_export` of ``folder`` against this source."""
        return verify_export(
            folder,
            self.source,
            self.found,
            self.done[-1],
            entry=self.entry,
            rules=self.rules,
            strip_prefixes=self.strip_prefixes,
            allow=allow,
            unsafe=unsafe,
            dtype=dtype,
            premap=self.premap,
            fmt=self.found_in.name,
        )


def _side_files(tmp: str, result: Conversion, export: _Export, *, dtype: str | None, built: bool) -> list[str]:
    """The config (its dtype the weights'), generation config and tokenizer's files written into ``tmp``, said in
    ``result.notes`` (a Megatron folder's ``built`` config under --verbose only); their names."""
    exported, found = export.done[-1], export.found
    written = output_dtype(exported.state, dtype)
    config_out = config_with_dtype(found.config, written, architecture=exported.architecture)
    names = write_side_files(tmp, found, config=config_out)
    said = "written" if built else f"copied from {found.folder}"
    mixed = "" if written else " (the weights mix dtypes: the config's dtype left as it was)"
    result.notes += [Note(f"{said}: {', '.join(names)}{mixed}", level=Level.VERBOSE if built else Level.ALWAYS)]
    result.notes += found.left_out
    return names


def _wrote(out: str, names: list[str]) -> str:
    """What the folder holds, for the "wrote" line: the weights' files, then the config and how many more."""
    shards = len([n for n in os.listdir(out) if n.startswith("model") and n.endswith(".safetensors")])
    return (
        "transformers folder: "
        + (f"{shards} shards and their index" if shards > 1 else WEIGHTS)
        + f", {CONFIG}"
        + (f" and {len(names) - 1} more" if len(names) > 1 else "")
    )


@strict_keywords
@deep
def merge_to_hf(
    paths: Sequence[PathLike],
    out: PathLike,
    *,
    config_from: PathLike | None = None,
    architecture: str | None = None,
    verify: bool = False,
    overwrite: bool = False,
    allow_globals: Iterable[str] = (),
    unsafe: bool = False,
    buffers: str = "pooled",
    atol: float = 0.0,
    buffer_keys: Iterable[str] = (),
    average: bool = False,
    weights: Sequence[float] | None = None,
    model: Any = None,
) -> tuple[MergeResult, Conversion | None]:
    """The rank files of one run (FSDP1/FSDP2 rank files, DDP ranks, as :func:`ckptfix.merging.files.merge_files` merges
    them, with its options of those names) as folder ``out`` that ``from_pretrained(out)`` loads, as
    :func:`export_hf` writes it; ``config_from`` defaults to the first file's folder, then its parent. The model is
    merged into a file beside ``out`` (removed after); where the ranks disagree nothing is written: the merge's
    ``diverged`` says why, and the export is None.

    >>> merged, exported = ckptfix.exporting.folder.merge_to_hf(["rank0.pt", "rank1.pt"], "hf_model/")
    """
    from ckptfix.merging.files import merge_files

    resolve_output(out, fmt="hf")
    out_s = os.fspath(out).rstrip(os.sep) or os.sep
    found = find_config(paths[0], config_from=config_from)  # refused before any file is merged
    _check_out(out_s, inputs=tuple(paths), overwrite=overwrite)
    allow = tuple(allow_globals)
    tmp = tempfile.mkdtemp(prefix=".ckptfix-merge.", suffix=".ckptfix-tmp", dir=_parent(out_s))
    try:
        merged = os.path.join(tmp, WEIGHTS)
        result = merge_files(
            paths,
            merged,
            model_only=True,
            allow_globals=allow,
            unsafe=unsafe,
            model=model,
            buffers=buffers,
            atol=atol,
            buffer_keys=buffer_keys,
            average=average,
            weights=weights,
        )
        if result.diverged:
            return result, None
        exported = export_hf(
            merged,
            out_s,
            config_from=found.folder,
            architecture=architecture,
            verify=verify,
            overwrite=overwrite,
            allow_globals=allow,
            unsafe=unsafe,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result, exported


def _write_weights(
    source: str,
    weights: str,
    *,
    in_fmt: str,
    transform: Any,
    dtype: str | None,
    shard_size: int | None,
    allow: tuple[str, ...],
    unsafe: bool,
    fast: bool,
    check: Callable[[Callable[[Any], bytes]], None],
    progress: bool,
) -> Conversion:
    """The weights, streamed where the plan and the stream allow, else loaded by torch; one file or shards.
    ``check(read)`` runs after ``transform``, before a byte is written (``read(t)``: a tensor's bytes)."""
    limit = shard_size or ONE_SHARD  # the shard writer: one file named model.safetensors, or shards and an index
    plan = plan_conversion(in_fmt=in_fmt, out_fmt="safetensors", fast=fast, dtype=dtype, unsafe=unsafe, sharded=True)

    def stream() -> Conversion:
        from ckptfix.stream.folders import convert_folder

        return convert_folder(
            source,
            weights,
            transform=transform,
            allow_globals=allow,
            dtype=dtype,
            shard_size=limit,
            check=check,
            progress=progress,
        )

    def torch() -> Conversion:
        from ckptfix.formats.registry import write
        from ckptfix.formats.safetensors.file import tensor_bytes

        obj = read(source, fmt=in_fmt, unsafe=unsafe, allow_globals=allow, model_only=True)
        result: Conversion = transform(obj)
        check(lambda t: bytes(tensor_bytes(t)))
        if dtype is not None:
            cast_floating(result, dtype)
        write(result.obj, weights, fmt="safetensors", shard_size=limit)
        return result

    return run_conversion(plan, stream=stream, torch=torch)


def _left_out(tree: Any, entry: str, *, hf: bool, source: str) -> list[str]:
    """The checkpoint's entries beside its model's (optimizer, step, …; an accelerate folder's, read or not, where
    ``hf``: the source is a transformers or accelerate folder): a transformers folder holds only the model."""
    if not entry or not isinstance(tree, Mapping):
        return []
    from ckptfix.formats.hf.folder import describe

    names = dict.fromkeys(map(str, tree))
    if hf and not (folder := describe(source)).flat:
        names.update(dict.fromkeys(folder.entries))  # an accelerate folder's training state, left unread
    return [name for name in names if name != entry]


_EXPORT_FILE = (CONFIG, *SIDE_FILES, WEIGHTS, WEIGHTS + ".index.json")


def _check_out(out: str, *, inputs: tuple[PathLike, ...], overwrite: bool) -> None:
    """OUT is new, or an empty folder, or (``overwrite``) a folder holding only what an export writes."""
    check_apart(out, inputs=inputs)
    _parent(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutputError(f"{out}: exists and is not a folder; --format hf writes a folder")
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if names and not overwrite:
        raise OutputError(
            f"{out}: exists and is not empty; write to a new or empty folder, or pass --force to replace it"
        )
    for name in names:
        path = os.path.join(out, name)
        shard = name.startswith("model-") and name.endswith(".safetensors")
        if not ((name in _EXPORT_FILE or shard) and stat.S_ISREG(os.lstat(path).st_mode)):
            raise OutputError(
                f"{path}: is not a file a transformers export writes, and --force replaces only such a "
                f"folder; remove it or write to a new folder"
            )


def _parent(out: str) -> str:
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise OutputError(f"{out}: folder '{parent}' does not exist; create it first")
    return parent


def _put_in_place(tmp: str, out: str) -> None:
    """The complete folder ``tmp`` becomes ``out``; an ``out`` already there (empty, or replaced with --force) is set
    aside first and removed once the new one is in, put back if the rename fails."""
    parent = _parent(out)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a folder of ours gets the umask's mode
    old = [out] if os.path.isdir(out) else []
    try:
        with set_aside(old, parent):
            os.rename(tmp, out)
    except OSError as e:
        raise OutputError(f"{out}: cannot put the folder in place ({e.strerror or e}); nothing changed") from e
    fsync_dir(parent)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@quiet_transformers()  # transformers' own warnings on loading are not ckptfix's to print
def verify_export(
    folder: str,
    source: str,
    found: ConfigFolder,
    exported: Exported,
    *,
    entry: str | None,
    rules: list[Any],
    strip_prefixes: Iterable[str],
    allow: tuple[str, ...],
    unsafe: bool,
    dtype: str | None,
    premap: Any = None,
    fmt: str | None = None,
) -> str:
    """Load ``folder`` with transformers and compare its logits on a fixed input with the source's weights loaded
    into the same model (a Megatron folder's as ``premap`` maps them: Megatron's forward is not run); the note saying
    what was compared and the largest difference. Raises :class:`MismatchError` when transformers
    reports a missing, unexpected or mismatched key, or the logits are not equal. ``fmt``: ``source``'s format
    (detected where not given)."""
    import torch

    from ckptfix.exporting.model import model_class

    config = load_config(folder)
    cls = model_class(config, config_path=os.path.join(folder, CONFIG))
    torch_dtype = getattr(torch, dtype) if dtype else torch.float32
    loaded, info = cls.from_pretrained(
        folder, output_loading_info=True, dtype=torch_dtype, local_files_only=True, trust_remote_code=False
    )
    wrong = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs" and v}
    if wrong or info.get("error_msgs"):
        raise MismatchError(f"{folder}: from_pretrained reports {wrong or info['error_msgs']}; nothing was written")
    obj = read(source, fmt=fmt or detect_format(source), unsafe=unsafe, allow_globals=allow, model_only=True)
    state, _, _ = source_state(
        obj, None if premap else load_config(found.folder), source=source, entry=entry, premap=premap
    )
    if rules:
        state = apply_maps(state, rules, source=source)
    source_config = load_config(folder if premap else found.folder)  # a Megatron folder's: the one built, written
    reference = _reference(cls, source_config, state, exported, strip_prefixes=strip_prefixes, dtype=torch_dtype)
    ids = _fixed_input(config)
    with torch.no_grad():
        got, want = _logits(loaded.eval(), ids), _logits(reference.eval(), ids)
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not torch.equal(got, want):
        raise MismatchError(
            f"{folder}: its logits differ from the source weights' by up to {diff:.3g} on a fixed "
            f"input; nothing was written"
        )
    if premap is not None:  # the map on both sides: what is checked is the folder written, not the map itself
        return (
            f"verified: from_pretrained loads every key; its logits equal those of the Megatron weights as ckptfix "
            f"maps them, in a {cls.__name__} built from the written config (largest difference {diff:g}); "
            f"Megatron's own forward was not run"
        )
    return f"verified: from_pretrained loads every key, logits equal the source's (largest difference {diff:g})"


def _reference(
    cls: Any, config: Any, state: Mapping[str, Any], exported: Exported, *, strip_prefixes: Any, dtype: Any
) -> Any:
    """The source weights in a model of ``cls`` made in ``dtype`` as from_pretrained makes it: loaded by
    :func:`ckptfix.load_into` (keys in the model's form, each cast as it is copied in), or, in save_pretrained's
    form, converted by transformers as it loads (its ``state_dict`` argument)."""
    from ckptfix.loading.model import load_into

    if exported.form == "model":
        model = cls._from_config(config, dtype=dtype)
        cast = {k: v.to(dtype) if getattr(v, "is_floating_point", bool)() else v for k, v in state.items()}
        load_into(model, cast, strip_prefixes=strip_prefixes)
        return model
    own = export_state(
        state, meta_model(cls, config), source="source", config_path=CONFIG, strip_prefixes=strip_prefixes
    )
    return cls.from_pretrained(None, config=config, state_dict=dict(own.state), dtype=dtype, trust_remote_code=False)


def source_state(
    tree: Any, config: Any, *, source: str, entry: str | None, premap: Any = None
) -> tuple[Mapping[str, Any], list[str], Mapped | None]:
    """The model state of checkpoint ``tree`` to export, notes on it, and what a Llama's mapping did: a Megatron
    folder's mapped by ``premap``, a torchtune or torchtitan Llama's mapped to transformers' names
    (:mod:`ckptfix.exporting.llama`), else as read."""
    from ckptfix.exporting.llama import model_state
    from ckptfix.loading.model import model_state_of

    if premap is None and (llama := model_state(tree, config, source=source, entry=entry)) is not None:
        return llama.state, llama.notes, llama
    state = model_state_of(tree, source=source, entry=entry)
    return (premap(state) if premap is not None else state), [], None


def _fixed_input(config: Any) -> torch.Tensor:
    import torch

    vocab = int(getattr(config, "vocab_size", 0) or 2)
    length = min(16, int(getattr(config, "max_position_embeddings", 16) or 16))
    return (torch.arange(length) * 7 % vocab).reshape(1, length)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    found = getattr(out, "logits", None)
    logits: torch.Tensor = found if found is not None else out[0]
    return logits


__all__ = ["export_hf", "verify_export"]
