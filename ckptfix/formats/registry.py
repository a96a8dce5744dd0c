"""Which format a path is, and the one entry point to read and write each: :data:`FORMATS` is the registry.

Each :class:`Format` says whether it claims a path (from its first bytes, or a folder's listing) and how to load
it; :func:`detect` asks them in order (a file: the first claim reads it; a folder: every folder format is asked,
and a folder two of them claim is refused naming both). The output format is decided by OUT's extension
(:func:`~ckptfix.formats.paths.output_format`), and written by the row whose ``output`` it is (:func:`write`).
Adding an input format is its package, one :data:`FORMATS` row (its claim, its loader, its ``open`` that every
command reads through; a folder format also ``describe``) and its tests; an output format, its writer
(:mod:`ckptfix.formats.writers`) in its row.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfix.errors import FormatError
from ckptfix.formats.output.atomic import PathLike, check_output
from ckptfix.formats.paths import (
    ONE_SHARD,
    output_format,
    refuse_remote,
)
from ckptfix.formats.records import FolderRecords

if TYPE_CHECKING:
    from ckptfix.formats.opened import Opened, OpenOptions
from ckptfix.formats.safety.depth import deep
from ckptfix.formats.writers import WriteOptions, dcp_write, file_writer, save_safetensors, save_torch


@dataclass(frozen=True)
class Probe:
    """What formats are told apart by: the path and, for a file, its first 32 bytes and its size, read once
    whatever the number of formats asking."""

    path: str
    folder: bool
    head: bytes = b""
    size: int = 0


@dataclass(frozen=True)
class ReadOptions:
    """How :func:`read` reads: the options of :func:`load`, given once to whichever format's loader."""

    unsafe: bool = False
    allow_globals: Iterable[str] = ()
    mmap: bool = True
    verify: bool = True
    model_only: bool = False
    opaque: bool = False  # a torch zip's entries needing globals outside the allowlist kept unbuilt


@dataclass(frozen=True)
class Format:
    """One input format: ``name`` is the family that code and ``--json`` use (``torch-zip``, ``torch-legacy``,
    ``safetensors``, ``folder``), ``kind`` the format itself (``dcp``, ``deepspeed``, ``hf`` …).

    ``claims`` answers from the :class:`Probe` alone (a folder's listing at most, as DCP's storage readers'
    ``validate_checkpoint_id`` does); it may refuse a path that looks like the format but cannot be read as
    one. ``load`` reads it into torch tensors.

    ``open(path, options)`` opens it as tensor records (:class:`~ckptfix.formats.opened.Opened`: the records, one
    table of open files, notes), what ``inspect``, ``diff``, ``merge``, ``load`` and every stream read through
    (:func:`open_format` asks it); it raises :class:`~ckptfix.formats.opened.Undescribed` where the records cannot
    stand in for what ``load`` gives. A folder format whose records are DCP chunks may give ``records(path,
    allow_globals)`` (its :class:`FolderRecords`) instead of ``open``. ``describe(summary)`` is what ``inspect``
    says of a folder format: the words for its format, and lines of its own (escaped by the renderer). With
    neither ``open`` nor ``records`` its loader reads it, tensors and all.

    A folder format says in ``called`` what its folders are (in a refusal naming two formats), and in ``beside``
    the folder kinds whose claim its folders meet by design (a Megatron folder is a DCP folder too): then it alone
    reads them.

    A format written as OUT says so here too: ``output`` is its name as :func:`output_format` and ``--format``
    give it (``torch``, ``safetensors``, ``dcp``), ``write(obj, path, options)`` writes it (:func:`write` asks no
    other place), and a folder format's ``wrote`` is what a conversion's "wrote" line calls its folder."""

    name: str
    kind: str
    claims: Callable[[Probe], bool]
    load: Callable[[PathLike, ReadOptions], Any]
    records: Callable[[str, tuple[str, ...]], FolderRecords] | None = None
    open: Callable[[str, OpenOptions], Opened] | None = None
    describe: Callable[[dict[str, Any]], tuple[str, list[str]]] | None = None
    called: str = ""  # what a folder of it is, in a refusal that names two formats
    beside: tuple[str, ...] = ()  # folder kinds whose claim its folders meet by design (read as this one)
    output: str = ""  # its name as OUT's format (output_format's), when it is written
    write: Callable[[Any, PathLike, WriteOptions], None] | None = None
    wrote: str = ""  # a folder format's words for the folder written ("DCP folder")


def detect(path: PathLike) -> Format:
    """The format of ``path``: the first of :data:`FORMATS` that claims it (a file by its first bytes), or the one
    folder format that claims a folder (by what it holds); :class:`FormatError` naming the path when none does, or
    naming both formats when two claim one folder."""
    source = os.fspath(path)
    refuse_remote(source)
    probe = _probe(source)
    if probe.folder:
        return _folder(probe)
    for fmt in FORMATS:
        if fmt.claims(probe):
            return fmt
    raise FormatError(
        f"{source}: not a checkpoint ckptfix can read (expected a torch zip, legacy torch or safetensors file, "
        f"found bytes {probe.head[:8]!r})"
    )


def _folder(probe: Probe) -> Format:
    """The folder format that claims a folder, every one asked: two that claim it (neither holding the other's files
    by design, ``Format.beside``) are refused naming both, never read as whichever was asked first; none: the
    transformers row, which says what a checkpoint folder holds."""
    claimed = [f for f in FORMATS if f.name == "folder" and f.claims(probe)]
    found = [f for f in claimed if not any(f.kind in other.beside for other in claimed)]
    if len(found) > 1:
        raise FormatError(_two_checkpoints(probe.path, found[0], found[1]))
    return found[0] if found else next(f for f in FORMATS if f.kind == "hf")


def _two_checkpoints(path: str, first: Format, second: Format) -> str:
    said = f"{path}: holds two checkpoints, {first.called} and {second.called}; ckptfix will not guess which is meant"
    if "hf" not in (first.kind, second.kind):
        return f"{said}: move one of them into a folder of its own"
    from ckptfix.formats.hf.folder import weight_files

    other = first if second.kind == "hf" else second
    names = weight_files(path)
    file = os.path.join(path, next((n for n in names if n.endswith(".index.json")), names[0]))
    return f"{said}: pass {file} for the transformers weights, or move them out of the folder to read {other.called}"


def folder_format(kind: str) -> Format | None:
    """The row of folder format ``kind`` (``OpenedFolder.kind``, ``inspect``'s ``folder.kind``), if one is."""
    return next((f for f in FORMATS if f.name == "folder" and f.kind == kind), None)


def open_format(found: Format, source: str, options: OpenOptions) -> Opened:
    """``source`` (of format ``found``) opened as tensor records by its row: its ``open``, or its ``records`` read
    through the folder's one table; :class:`~ckptfix.formats.opened.Undescribed` for a row with neither (its loader
    reads it, tensors and all)."""
    if found.open is not None:
        return found.open(source, options)
    if found.records is not None:
        from ckptfix.formats.dcp.opener import open_records

        records = found.records
        return open_records(source, options, read=lambda: records(source, options.allow_globals), kind=found.kind)
    from ckptfix.formats.copyable import Fallback, Reason
    from ckptfix.formats.opened import Undescribed

    kind = found.kind
    raise Undescribed(Fallback(Reason.READ_BY_LOADER, kind=kind), note=f"a {kind} checkpoint, read by its loader")


def detect_format(path: PathLike) -> str:
    """``torch-zip``, ``torch-legacy``, ``safetensors`` or ``folder``, from the first bytes of the file.

    ``folder`` is a folder of shards or training state, or a shard index file (JSON) in one.
    """
    return detect(path).name


def _probe(source: str) -> Probe:
    if os.path.isdir(source):
        return Probe(source, folder=True)
    try:
        mode = os.stat(source).st_mode
        if not stat.S_ISREG(mode):  # never opened: reading a FIFO waits for a writer, a device never ends
            raise FormatError(f"{source}: not a regular file (a FIFO, socket or device); pass a checkpoint file")
        with open(source, "rb") as f:
            head = f.read(32)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError as e:
        raise FormatError(f"{source}: no such file; check the path") from e
    except IsADirectoryError as e:
        raise FormatError(f"{source}: is a folder, not a checkpoint file") from e
    except OSError as e:
        raise FormatError(f"{source}: cannot read it ({e.strerror})") from e
    if not head:
        raise FormatError(f"{source}: file is empty; re-download or re-save it")
    return Probe(source, folder=False, head=head, size=size)


# -- each format's claim and loader (the modules are imported only when a probe may be theirs) ----------------


def _dcp_claims(probe: Probe) -> bool:
    if not probe.folder:
        return False
    from ckptfix.formats.dcp.reader import is_dcp

    return is_dcp(probe.path)


def _dcp_open(path: str, options: OpenOptions) -> Opened:
    from ckptfix.formats.dcp.opener import open_dcp

    return open_dcp(path, options)


def _dcp_load(path: PathLike, options: ReadOptions) -> Any:
    from ckptfix.formats.dcp.load import load_dcp

    return load_dcp(os.fspath(path), allow_globals=options.allow_globals, mmap=options.mmap, verify=options.verify)


def _megatron_claims(probe: Probe) -> bool:
    if not probe.folder:
        return False
    from ckptfix.formats.megatron.reader import is_megatron

    return is_megatron(probe.path)


def _megatron_load(path: PathLike, options: ReadOptions) -> Any:
    from ckptfix.formats.megatron.reader import load_megatron

    return load_megatron(os.fspath(path), allow_globals=options.allow_globals)


def _megatron_open(path: str, options: OpenOptions) -> Opened:
    from ckptfix.formats.megatron.opener import open_megatron

    return open_megatron(path, options)


def _megatron_describe(summary: dict[str, Any]) -> tuple[str, list[str]]:
    from ckptfix.formats.megatron.reader import describe_summary

    return describe_summary(summary)


def _deepspeed_claims(probe: Probe) -> bool:
    if not probe.folder:
        return False
    from ckptfix.formats.deepspeed.files import is_deepspeed

    return is_deepspeed(probe.path)


def _deepspeed_open(path: str, options: OpenOptions) -> Opened:
    from ckptfix.formats.deepspeed.opener import open_run

    return open_run(path, options)


def _deepspeed_load(path: PathLike, options: ReadOptions) -> Any:
    from ckptfix.formats.deepspeed.run import load_run

    # the consolidated fp32 master weights, each partition's bytes read once
    return load_run(os.fspath(path), allow_globals=options.allow_globals, verify=options.verify)


def _torch_zip_claims(probe: Probe) -> bool:
    if not probe.head.startswith(b"PK\x03\x04"):
        return False
    folder = os.path.dirname(os.path.abspath(probe.path))
    if probe.path.endswith(".distcp") and os.path.isfile(os.path.join(folder, ".metadata")):
        raise FormatError(
            f"{probe.path}: is one data file of a torch.distributed.checkpoint folder, not a checkpoint on its own; "
            f"pass the folder {folder}"
        )
    return True


def _torch_zip_open(path: str, options: OpenOptions) -> Opened:
    from ckptfix.formats.torchio.opener import open_torch_zip

    return open_torch_zip(path, options)


def _legacy_claims(probe: Probe) -> bool:
    if probe.head[:1] != b"\x80":
        return False
    from ckptfix.formats.legacy.reader import MAGIC  # here: the legacy reader is for the rare old file only

    return MAGIC in probe.head


def _torch_load(name: str) -> Callable[[PathLike, ReadOptions], Any]:
    def load_torch_file(path: PathLike, options: ReadOptions) -> Any:
        from ckptfix.formats.torchio.torchfile import load_torch

        return load_torch(
            path,
            fmt=name,
            source=os.fspath(path),
            unsafe=options.unsafe,
            allow_globals=options.allow_globals,
            mmap=options.mmap,
            verify=options.verify,
            opaque=options.opaque,
        )

    return load_torch_file


def _safetensors_claims(probe: Probe) -> bool:
    head = probe.head
    if len(head) < 9 or head[8:9] not in (b"{", b"[", b" "):
        return False
    # an 8-byte little-endian header length, then the JSON header. Text never passes for one: eight bytes of text
    # read as a length are over 2**61.
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len + 8 <= probe.size:
        return True
    if not _json_text(probe):
        raise FormatError(f"{probe.path}: safetensors header runs past the end of the file; it is truncated")
    return False


def _safetensors_open(path: str, options: OpenOptions) -> Opened:
    from ckptfix.formats.torchio.opener import open_safetensors

    return open_safetensors(path, options)


def _safetensors_load(path: PathLike, options: ReadOptions) -> Any:
    from ckptfix.formats.safetensors.file import load_safetensors

    return load_safetensors(path, source=os.fspath(path))


def _hf_claims(probe: Probe) -> bool:
    # a folder of transformers weights, or a shard index (JSON): hf.describe checks that it is one
    if not probe.folder:
        return _json_text(probe)
    from ckptfix.formats.hf.folder import weight_files

    return bool(weight_files(probe.path))


def _hf_open(path: str, options: OpenOptions) -> Opened:
    from ckptfix.formats.hf.opener import open_hf

    return open_hf(path, options, detect_format=detect_format)


def _hf_load(path: PathLike, options: ReadOptions) -> Any:
    from ckptfix.formats.hf.folder import load_folder

    def shard(file: str) -> Any:
        return detect(file).load(file, dataclasses.replace(options, model_only=False, opaque=False))

    return load_folder(path, read=shard, model_only=options.model_only)


def _json_text(probe: Probe) -> bool:
    return probe.head.lstrip().startswith(b"{")


FORMATS: tuple[Format, ...] = (  # in the order they are asked: the first to claim a file reads it
    # a Megatron torch_dist folder is a DCP folder too; HF Trainer saves the model beside a DeepSpeed run's tag folder
    Format(
        "folder",
        "megatron",
        _megatron_claims,
        _megatron_load,
        open=_megatron_open,
        describe=_megatron_describe,
        called="a Megatron checkpoint (metadata.json)",
        beside=("dcp",),
    ),
    Format(
        "folder",
        "dcp",
        _dcp_claims,
        _dcp_load,
        open=_dcp_open,
        called="a torch.distributed.checkpoint (DCP) folder (.metadata)",
        output="dcp",
        write=dcp_write,
        wrote="DCP folder",
    ),
    Format(
        "folder",
        "deepspeed",
        _deepspeed_claims,
        _deepspeed_load,
        open=_deepspeed_open,
        called="a DeepSpeed run (latest, rank files)",
        beside=("hf",),
    ),
    Format(
        "torch-zip",
        "torch-zip",
        _torch_zip_claims,
        _torch_load("torch-zip"),
        open=_torch_zip_open,
        output="torch",
        write=file_writer(save_torch),
    ),
    Format("torch-legacy", "torch-legacy", _legacy_claims, _torch_load("torch-legacy")),
    Format(
        "safetensors",
        "safetensors",
        _safetensors_claims,
        _safetensors_load,
        open=_safetensors_open,
        output="safetensors",
        write=file_writer(save_safetensors),
    ),
    # transformers shards with their index, accelerate folders; last: a folder no row claims is its to explain
    Format(
        "folder",
        "hf",
        _hf_claims,
        _hf_load,
        open=_hf_open,
        called="transformers weights (an index or model file)",
        output="hf",  # written by ckptfix.export_hf, which makes the folder from_pretrained loads
        wrote="transformers folder",
    ),
)


def describe_output(path: PathLike, *, fmt: str, shard_size: int | None) -> str:
    """What a conversion wrote, for its "wrote" line (``DCP folder``, ``3 safetensors shards and their index``);
    ``""`` for one file OUT named by its extension."""
    row = _output_row(fmt)
    if row.wrote:  # a folder format
        return row.wrote
    out, what = os.fspath(path), row.output
    if shard_size is None:
        return ""
    from ckptfix.formats.hf.folder import shard_set

    files = [f for f in shard_set(out) if not f.endswith(".index.json")]
    if shard_size == ONE_SHARD:
        return f"{what} file {os.path.basename(out)} in the folder"
    if len(files) == 1:
        return f"1 {what} shard, {os.path.basename(files[0])}: no index needed"
    return f"{len(files)} {what} shards and their index {os.path.basename(out)}.index.json"


@deep
def load(
    path: PathLike,
    *,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    mmap: bool = True,
    verify: bool = True,
    model_only: bool = False,
) -> Any:
    """Load a checkpoint safely: weights-only, onto the CPU, memory-mapped where the format allows.

    ``allow_globals`` names extra classes the pickle may build (``argparse.Namespace``); never ``os.system``
    and the like. ``unsafe=True`` runs the full unpickler: only for files you fully trust. ``path`` may be a
    folder (transformers shards with their index, an accelerate ``save_state`` folder) or its index file;
    ``model_only=True`` leaves a folder's optimizer, scheduler and RNG files unread.

    >>> ckpt = ckptfix.load("run/last.pt")
    """
    options = ReadOptions(unsafe=unsafe, allow_globals=allow_globals, mmap=mmap, verify=verify, model_only=model_only)
    found = detect(path)
    obj = found.load(path, options)
    if found.kind == "dcp":  # DCP stores an optimizer's int keys as strings: put back where param_groups name them
        import warnings

        from ckptfix.notes import Kind, kind_of
        from ckptfix.transforms.optim_form import restore_all

        obj, notes = restore_all(obj, source=os.fspath(path))
        for note in notes:
            if kind_of(note) is Kind.LOSS:
                warnings.warn(note, stacklevel=2)
    return obj


def read(
    path: PathLike,
    *,
    fmt: str,
    unsafe: bool = False,
    allow_globals: Iterable[str] = (),
    mmap: bool = True,
    verify: bool = True,
    model_only: bool = False,
    opaque: bool = False,
) -> Any:
    """:func:`load` for a file whose format was already detected (``folder``: which folder, the registry says);
    ``opaque``: see :func:`.torchfile.load_torch`."""
    found = detect(path) if fmt == "folder" else next((f for f in FORMATS if f.name == fmt), None)
    if found is None:  # a caller's slip: fmt comes from detect_format
        raise ValueError(f"fmt={fmt!r}: not a format name; use detect_format(path)")
    options = ReadOptions(
        unsafe=unsafe, allow_globals=allow_globals, mmap=mmap, verify=verify, model_only=model_only, opaque=opaque
    )
    return found.load(path, options)


@deep
def save(obj: Any, path: PathLike, *, shard_size: int | None = None, overwrite: bool = False) -> None:
    """Write ``obj`` atomically in the format OUT's extension names (temp file, fsync, rename).

    With ``shard_size`` (bytes) a state dict is written as transformers shards of at most that size beside
    OUT (``model-00001-of-00003.safetensors`` …) with OUT's index (``model.safetensors.index.json``); OUT may
    be a folder (``model.safetensors`` in it). A folder OUT without ``shard_size`` (ending in ``/``, or an
    existing empty folder) gets a torch.distributed.checkpoint (DCP) folder.

    A file OUT is replaced if it exists, as ``torch.save`` replaces it. An existing DCP folder (not empty) or
    shard set of OUT's name is refused unless ``overwrite=True``, which replaces it only when it holds nothing
    but a checkpoint's files, and only once the new one is complete.

    >>> ckptfix.save({"model": model.state_dict(), "epoch": 3}, "run/last.pt")
    """
    row = _output_row(output_format(path))
    if shard_size is not None and row.wrote:  # a folder OUT: the shards in it, named as transformers names them
        path = os.path.join(path, "model.safetensors")
        row = _output_row(output_format(path))
    if not row.wrote and shard_size is None:  # a folder's writer and the shard writer check their folders themselves
        check_output(path)
    _write(row, obj, path, WriteOptions(shard_size=shard_size, overwrite=overwrite))


def write(obj: Any, path: PathLike, *, fmt: str, shard_size: int | None = None, overwrite: bool = False) -> None:
    """:func:`save` to an output already checked, in format ``fmt`` (a row's ``output``); ``overwrite`` lets a DCP
    folder or a shard set replace the one already there (a file output is replaced whatever it says: its check came
    before)."""
    _write(_output_row(fmt), obj, path, WriteOptions(shard_size=shard_size, overwrite=overwrite))


def _output_row(fmt: str) -> Format:
    """The row of the format written as ``fmt`` (:func:`output_format`'s name for it)."""
    found = next((f for f in FORMATS if f.output == fmt), None)
    if found is None:  # a caller's slip: fmt comes from output_format or resolve_output
        raise ValueError(f"fmt={fmt!r}: not an output format; use output_format(path)")
    return found


def _write(row: Format, obj: Any, path: PathLike, options: WriteOptions) -> None:
    if row.write is None:  # a caller's slip: hf folders are written by ckptfix.export_hf
        raise ValueError(f"fmt={row.output!r}: ckptfix.export_hf writes it, not registry.write")
    row.write(obj, path, options)


__all__ = [
    "FORMATS",
    "Format",
    "Probe",
    "ReadOptions",
    "WriteOptions",
    "describe_output",
    "detect",
    "detect_format",
    "folder_format",
    "load",
    "open_format",
    "read",
    "save",
    "write",
]
