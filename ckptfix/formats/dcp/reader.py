"""torch.distributed.checkpoint (DCP) folders, read without running their pickles.

A DCP folder is a ``.metadata`` pickle (plain dataclasses: which tensors exist, their dtypes and global shapes,
how each is chunked, and where each chunk's bytes are) and ``__R_S.distcp`` files that hold, per chunk, a whole
``torch.save`` archive of that chunk (or of a non-tensor value). DCP's own reader unpickles ``.metadata`` with
plain ``pickle.load``; ckptfix reads it inertly, with exactly the classes below allowed as data, and reads each
chunk's archive with the same reader and rules as a ``.pt`` file.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.errors import FormatError
from ckptfix.formats.copyable import Fallback, Reason, foreign_byte_order, math_bit_view
from ckptfix.formats.dtypes import DTYPES, nbytes, shape_problem
from ckptfix.formats.output.crc import Check, check_crc
from ckptfix.formats.pickles import inert, unpickling
from ckptfix.formats.records import FileTable, Holder, RunReader, TensorRecord
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchzip.reader import TorchZip, read_torch_zip

METADATA = ".metadata"
MAX_METADATA = 1 << 30
MAX_CHUNKS = 1 << 16  # per tensor; the overlap check is quadratic in it
# A plan is smaller than the data it describes: each stored item is a whole torch.save archive (a kilobyte or more)
# and takes a few hundred bytes of metadata. Metadata past the folder's data files by more than this is refused
# unread: unpickling costs over a hundred bytes of memory per byte of a crafted pickle (8M empty dicts in 16 MB).
METADATA_SLACK = 1 << 20
_META = "torch.distributed.checkpoint.metadata."
_CLASSES = frozenset(
    {
        _META + n
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
        "torch.serialization._get_layout",
        "torch.Size",
    }
    # the save plans a planner may keep in the metadata (``all_local_plans``: Megatron-Core's cached plans); read as
    # records like the rest, never used
    | {
        "torch.distributed.checkpoint.planner." + n
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    }
)


@dataclass(frozen=True)
class Span:
    """Where one stored item's ``torch.save`` archive lies: file, first byte, length."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    span: Span
    stored: tuple[int, ...] | None = None  # the stored tensor's shape, where it is ``sizes`` after leading 1s


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def rows(entry: TensorEntry, c: Chunk) -> bool:
    """True when the chunk is a whole range of rows: a contiguous byte range of the full tensor."""
    return all(o == 0 for o in c.offsets[1:]) and c.sizes[1:] == entry.shape[1:]


@dataclass(eq=False)
class DcpTensor(TensorRecord):
    """A full tensor of a DCP folder, known from the metadata: its bytes come from its chunks."""

    on_demand: ClassVar[bool] = True
    streamable: ClassVar[bool] = True

    key: str
    entry: TensorEntry

    @property
    def dtype(self) -> str:
        return self.entry.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def identity(self) -> Hashable:
        return ("dcp", self.key)  # tied names share the one record

    def _storage(self) -> Hashable:
        return ("dcp", self.key)

    def read(self, holder: Holder) -> Any:
        return read_dcp_tensor(self, holder.file_fd, allowed=holder.allowed)

    def read_runs(self, reader: RunReader, *, key: str) -> Any:
        """Its chunks' bytes, where preparing it located them: chunks of whole rows read in order as the tensor,
        blocks gathered into it (the one tensor in memory)."""
        import torch

        entry, item = self.entry, DTYPES[self.entry.dtype].itemsize
        runs = [(*reader.located(c), math.prod(c.sizes) * item) for c in entry.chunks]
        if all(rows(entry, c) for c in entry.chunks):  # sorted by offsets: the row ranges are the tensor in order
            return reader.runs(runs, entry.dtype, entry.shape, key=key)
        full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        for c, run in zip(entry.chunks, runs, strict=True):
            chunk_region(full, c).copy_(reader.runs([run], entry.dtype, c.sizes, key=key))
        return full

    def spread(self) -> tuple[str, str]:  # 2 row chunks in __0_0.distcp, __1_0.distcp
        kind = "row" if all(rows(self.entry, c) for c in self.entry.chunks) else "block"
        files, n = sorted({os.path.basename(c.span.path) for c in self.entry.chunks}), len(self.entry.chunks)
        return "chunking", f"{n} {kind} chunk{'s' * (n != 1)} in {', '.join(files)}"

    streams_bytes: ClassVar[bool] = True

    def prepare_copy(self, files: FileTable, *, allowed: frozenset[str]) -> None:
        """Its chunks' archives parsed to find where its bytes lie, their pickles checked, their records' CRCs
        queued (q, k and v of one fused tensor: its chunks parsed and checked once)."""
        for c in self.entry.chunks:
            if id(c) not in files.located:
                _locate(c, files, entry=self.entry, key=self.key, allowed=allowed)

    def stored_ranges(self, files: FileTable) -> list[tuple[str, int, int]] | None:
        """Row chunks (sorted by offsets: rows in order, tiling checked) as runs; None when some are blocks."""
        entry, item = self.entry, DTYPES[self.entry.dtype].itemsize
        if entry.nbytes == 0:
            return []
        if not all(rows(entry, c) for c in entry.chunks):
            return None
        return [(c.span.path, files.located[id(c)][1], math.prod(c.sizes) * item) for c in entry.chunks]

    def write_made(self, write: Callable[[Any], Any], files: FileTable) -> str:
        from ckptfix.formats.safetensors.file import tensor_bytes

        write(tensor_bytes(self.gathered(files)))
        return "gathered"

    def gathered(self, files: FileTable) -> Any:
        """The full tensor of chunks that are blocks: the bounded buffer, one tensor, never the whole folder."""
        import torch

        entry = self.entry
        dtype = getattr(torch, entry.dtype)
        full = torch.empty(entry.shape, dtype=dtype)
        for c in entry.chunks:
            if n := math.prod(c.sizes) * DTYPES[entry.dtype].itemsize:
                buf = files.read(c.span.path, files.located[id(c)][1], n)
                chunk_region(full, c).copy_(torch.frombuffer(buf, dtype=dtype).reshape(c.sizes))
        return full


def _locate(c: Chunk, files: FileTable, *, entry: TensorEntry, key: str, allowed: frozenset[str]) -> None:
    """Parse the chunk's archive (its pickle checked now, its records' CRCs queued) and record where its bytes
    (row-major, contiguous) are."""
    z, t = chunk_record(c, files.fd, entry=entry, key=key, allowed=allowed)
    if order := foreign_byte_order(z):  # torch's DCP reader torch.loads each chunk, which swaps its bytes
        raise Fallback(Reason.CHUNK_BYTE_ORDER, key=key, order=order)
    if bits := math_bit_view(t):  # dcp.save pickles a conj or neg view as torch.save does: bit and all
        raise Fallback(Reason.CHUNK_MATH_BIT_VIEW, key=key, bits=bits)
    rec = z.archive.storage(t.storage.key)
    files.located[id(c)] = (files.fd(c.span.path), rec.data_offset + t.offset * DTYPES[entry.dtype].itemsize)
    files.checks.setdefault(c.span.path, []).extend(
        Check(f"{r.name} (chunk of '{key}' at {list(c.offsets)})", r.data_offset, r.size, r.crc)
        for r in z.archive.records
    )


@dataclass(frozen=True)
class Dcp:
    """A checked DCP folder: tensors and other values by flat key, and each key's path in the nested dict."""

    root: str
    tensors: dict[str, TensorEntry]
    values: dict[str, Span]
    paths: dict[str, tuple[str | int, ...]]

    @property
    def files(self) -> set[str]:
        """The data files its chunks and values are in."""
        return {span.path for span in spans_of(self)}


def is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def _fields(obj: Any, cls: str, names: tuple[str, ...], *, source: str) -> dict[str, Any]:
    """The dataclass fields of an inert ``cls`` record (state as a dict, or as a tuple in field order)."""
    if not isinstance(obj, inert.Inert) or obj.func.full != cls:
        raise FormatError(
            f"{source}: expected a {cls.rsplit('.', 1)[1]} record, found {type(obj).__name__}; the "
            f"metadata is damaged or from an unsupported torch"
        )
    state = obj.state if obj.has_state else {}
    if isinstance(state, tuple):
        state = dict(zip(names, state, strict=False))
    if not isinstance(state, dict):
        raise FormatError(f"{source}: {cls.rsplit('.', 1)[1]} record has no fields; the metadata is damaged")
    return state


def _size(obj: Any, *, source: str, key: str) -> tuple[int, ...]:
    if isinstance(obj, inert.Inert) and obj.func.full == "torch.Size" and len(obj.args) == 1:
        dims = obj.args[0]
        if isinstance(dims, tuple) and all(type(d) is int and d >= 0 for d in dims):
            if problem := shape_problem(dims):
                raise FormatError(f"{source}: tensor '{key}': size {list(dims)} has {problem}; the metadata is damaged")
            return dims
    raise FormatError(
        f"{source}: tensor '{key}': a size is not a torch.Size of non-negative ints; the metadata is damaged"
    )


def read_dcp(root: str) -> Dcp:
    """Read and check ``root/.metadata``: every chunk inside its tensor, chunks tiling it exactly, every byte span
    inside a file of the folder. No chunk data is read."""
    from ckptfix.formats.hf.index import inside

    source = os.path.join(root, METADATA)
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > METADATA_SLACK and size > METADATA_SLACK + (on_disk := _data_bytes(root)):
            raise FormatError(
                f"{source}: {size} bytes of metadata for {on_disk} bytes of data files; a DCP plan is smaller "
                f"than the data it describes: the metadata is damaged or crafted, or the folder incomplete"
            )
        data = f.read(MAX_METADATA + 1)
    if len(data) > MAX_METADATA:
        raise FormatError(f"{source}: over 1 GiB of metadata; refusing it")
    allowed = allowlist.allowed_names([], source=source) | _CLASSES
    (tree,), _ = unpickling.load(data, source=source, allowed=allowed, protocol4=True)
    meta = _fields(tree, _META + "Metadata", (), source=source)
    entries = meta.get("state_dict_metadata")
    storage = meta.get("storage_data")
    planner = meta.get("planner_data") or {}
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise FormatError(f"{source}: no state_dict_metadata or storage_data; not a DCP checkpoint ckptfix reads")
    if not isinstance(planner, dict):
        raise FormatError(
            f"{source}: its planner_data is a {type(planner).__name__}, not a dict of key paths; the "
            f"metadata is damaged"
        )
    spans = _spans(storage, root=root, source=source, inside=inside)
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, Span] = {}
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise FormatError(f"{source}: a key is {type(key).__name__}, not a string; the metadata is damaged")
        if isinstance(entry, inert.Inert) and entry.func.full == _META + "BytesStorageMetadata":
            if (key, None) not in spans:
                raise FormatError(f"{source}: value '{key}' has no stored bytes; the checkpoint is incomplete")
            values[key] = spans[(key, None)]
        else:
            tensors[key] = _tensor(key, entry, spans, source=source)
    paths = {key: _path(key, planner.get(key), source=source) for key in entries}
    _check_paths(paths, source=source)
    return Dcp(root=root, tensors=tensors, values=values, paths=paths)


def _data_bytes(root: str) -> int:
    """Bytes in the regular files of ``root`` beside its metadata (nothing opened: FIFOs and devices count 0)."""
    total = 0
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name != METADATA:
                try:
                    total += entry.stat().st_size if entry.is_file() else 0
                except OSError:
                    continue
    return total


def _check_paths(paths: dict[str, tuple[str | int, ...]], *, source: str) -> None:
    """One place per planner entry: no two keys at the same path, none under another's value (either would drop a
    value when the nested dict is rebuilt). Linear in the paths' total length."""
    owner: dict[tuple[Any, ...], str] = {}
    for key, path in paths.items():
        typed = tuple((type(p).__name__, p) for p in path)  # 1 and "1" are two places, as are True and 1
        if (other := owner.get(typed)) is not None:
            raise FormatError(
                f"{source}: keys '{other}' and '{key}' both have planner path {list(path)}; one path "
                f"per planner entry: the metadata is damaged or crafted"
            )
        owner[typed] = key
    for key, path in paths.items():
        typed = tuple((type(p).__name__, p) for p in path)
        for end in range(1, len(typed)):
            if (other := owner.get(typed[:end])) is not None:
                raise FormatError(
                    f"{source}: key '{key}' (planner path {list(path)}) lies under the value of key "
                    f"'{other}' ({list(path[:end])}); the metadata is damaged or crafted"
                )


def _spans(storage: dict[Any, Any], *, root: str, source: str, inside: Any) -> dict[tuple[str, Any], Span]:
    sizes: dict[str, int] = {}
    paths: dict[str, str] = {}
    out: dict[tuple[str, Any], Span] = {}
    for index, info in storage.items():
        idx = _fields(index, _META + "MetadataIndex", ("fqn", "offset", "index"), source=source)
        where = _fields(
            info,
            "torch.distributed.checkpoint.filesystem._StorageInfo",
            ("relative_path", "offset", "length", "transform_descriptors"),
            source=source,
        )
        fqn, name = idx.get("fqn"), where.get("relative_path")
        offset, length = where.get("offset"), where.get("length")
        if not isinstance(fqn, str) or not isinstance(name, str) or type(offset) is not int or type(length) is not int:
            raise FormatError(f"{source}: a storage entry is malformed; the metadata is damaged")
        if where.get("transform_descriptors"):
            raise FormatError(
                f"{source}: '{fqn}' is stored through {where['transform_descriptors']} (a DCP storage extension); "
                f"ckptfix reads plain DCP: re-save without extensions"
            )
        path = paths.get(name)
        if path is None:  # a few files hold thousands of chunks: each name is resolved and checked once
            path = paths[name] = inside(root, name, source=source, key=fqn)
            sizes[path] = os.path.getsize(path)
        if offset < 0 or length <= 0 or offset + length > sizes[path]:
            raise FormatError(
                f"{source}: '{fqn}' is stored at bytes {offset}..{offset + length} of {name}, which "
                f"has {sizes[path]}; the file is truncated: copy the folder again"
            )
        chunk = None if idx.get("offset") is None else _size(idx["offset"], source=source, key=fqn)
        out[(fqn, chunk)] = Span(path, offset, length)
    _check_apart(out, source=source)
    return out


def _check_apart(spans: dict[tuple[str, Any], Span], *, source: str) -> None:
    """No two stored items share bytes (DCP writes each once): then every tensor's bytes, each chunk no larger than
    its span, add up to no more than the data files hold. O(n log n)."""
    keys = list(spans)
    ordered = sorted((s.path, s.offset, s.offset + s.length, i) for i, s in enumerate(spans.values()))
    for (path_a, _, end_a, a), (path_b, start_b, _, b) in itertools.pairwise(ordered):
        if path_a == path_b and start_b < end_a:
            raise FormatError(
                f"{source}: '{keys[a][0]}' and '{keys[b][0]}' are stored in the same bytes of "
                f"{os.path.basename(path_a)} (from byte {start_b}); the metadata is damaged or "
                f"crafted"
            )


def _tensor(key: str, entry: Any, spans: dict[tuple[str, Any], Span], *, source: str) -> TensorEntry:
    fields = _fields(entry, _META + "TensorStorageMetadata", ("properties", "size", "chunks"), source=source)
    props = _fields(
        fields.get("properties"),
        _META + "TensorProperties",
        ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
        source=source,
    )
    dtype_glob = props.get("dtype")
    dtype = getattr(dtype_glob, "full", "").removeprefix("torch.")
    if dtype not in DTYPES or not isinstance(dtype_glob, type):
        what = getattr(dtype_glob, "full", None) or getattr(getattr(dtype_glob, "func", None), "full", None)
        raise FormatError(
            f"{source}: tensor '{key}' has dtype {what or type(dtype_glob).__name__}, which is not a torch dtype "
            f"ckptfix knows; the metadata is damaged or from an unsupported torch"
        )
    shape = _size(fields.get("size"), source=source, key=key)
    raw_chunks = fields.get("chunks")
    if not isinstance(raw_chunks, list) or len(raw_chunks) > MAX_CHUNKS:
        raise FormatError(f"{source}: tensor '{key}' has no chunk list (or over {MAX_CHUNKS}); metadata damaged")
    boxes = []
    for raw in raw_chunks:
        c = _fields(raw, _META + "ChunkStorageMetadata", ("offsets", "sizes"), source=source)
        boxes.append((_size(c.get("offsets"), source=source, key=key), _size(c.get("sizes"), source=source, key=key)))
    _check_tiling(key, shape, boxes, source=source)
    chunks = []
    for offsets, sizes in sorted(boxes):
        span = spans.get((key, offsets))
        if span is None:
            raise FormatError(
                f"{source}: tensor '{key}' chunk at {list(offsets)} has no stored bytes; the "
                f"checkpoint is incomplete (a rank's file missing?)"
            )
        if (need := nbytes(dtype, math.prod(sizes))) > span.length:
            raise FormatError(
                f"{source}: tensor '{key}' chunk at {list(offsets)} of size {list(sizes)} needs {need} "
                f"bytes, stored in {span.length}; the metadata is damaged or crafted"
            )
        chunks.append(Chunk(offsets, sizes, span))
    return TensorEntry(dtype=dtype, shape=shape, chunks=tuple(chunks))


Box = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's offsets and sizes


_PAIRWISE = 512  # chunks off a grid are checked pair by pair up to this many (a grid is checked in O(n log n))


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box], *, source: str) -> None:
    """Chunks lie inside the tensor, do not overlap, and cover it, proven before any byte is placed.

    DCP and DTensor chunk a tensor on a grid: in each dimension the chunks' extents partition it, and each cell of
    that grid is one chunk. That is checked by sorting, in O(n log n) however many chunks a file declares; a
    tiling off a grid (rare) is checked pair by pair, up to :data:`_PAIRWISE` chunks.
    """
    for offsets, sizes in boxes:
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True))
        ):
            raise FormatError(
                f"{source}: tensor '{key}' {list(shape)} has a chunk at {list(offsets)} of size "
                f"{list(sizes)} outside it; the metadata is damaged"
            )
    solid = [box for box in boxes if all(box[1])]  # a zero-size chunk holds nothing (and may be listed often)
    total = math.prod(shape)
    if total == 0 or _on_grid(shape, solid):
        return
    covered = sum(math.prod(sizes) for _, sizes in solid)
    if covered < total:
        raise FormatError(
            f"{source}: tensor '{key}' {list(shape)}: its chunks cover {covered} of {total} elements; "
            f"the checkpoint is incomplete (a rank's file missing?)"
        )
    if len(solid) > _PAIRWISE:
        raise FormatError(
            f"{source}: tensor '{key}' has {len(solid)} chunks that overlap or lie off a grid; the metadata is damaged"
        )
    for i, (a_off, a_size) in enumerate(solid):
        for b_off, b_size in solid[i + 1 :]:
            if all(ao < bo + bs and bo < ao + an for ao, an, bo, bs in zip(a_off, a_size, b_off, b_size, strict=True)):
                raise FormatError(
                    f"{source}: tensor '{key}' has overlapping chunks at {list(a_off)} and "
                    f"{list(b_off)}; the metadata is damaged"
                )


def _on_grid(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether ``boxes`` (inside ``shape``, none empty) are the cells of a grid over it, each cell once: then they
    tile it exactly. Per dimension the distinct extents must partition it; distinct boxes, as many as cells."""
    if len(set(boxes)) != len(boxes):
        return False
    cells = 1
    for dim, size in enumerate(shape):
        end = 0
        extents = sorted({(offsets[dim], sizes[dim]) for offsets, sizes in boxes})
        for start, length in extents:
            if start != end:  # a gap, or two extents overlapping
                return False
            end = start + length
        cells *= len(extents)
        if end != size or cells > len(boxes):
            return False
    return cells == len(boxes)


def _path(key: str, path: Any, *, source: str) -> tuple[str | int, ...]:
    if path is None:
        return (key,)
    if isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path):
        return path
    raise FormatError(f"{source}: key '{key}' has a malformed planner path {path!r}; the metadata is damaged")


def nest(flat: dict[str, Any], paths: dict[str, tuple[str | int, ...]]) -> Any:
    """DCP's flat keys put back where the planner took them from (``('model', 'fc.weight')`` → nested dict)."""
    out: dict[Any, Any] = {}
    for key, value in flat.items():
        *parents, last = paths.get(key, (key,))
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise FormatError(f"key '{key}' nests under a value; the metadata is damaged")
        node[last] = value
    return _lists(out)


def _lists(node: Any) -> Any:
    # DCP flattens lists (optimizer param_groups) to integer path parts: rebuild them as lists
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(type(k) is int for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def spans_of(d: Dcp) -> Iterator[Span]:
    for t in d.tensors.values():
        for c in t.chunks:
            yield c.span
    yield from d.values.values()


def gather(torch: Any, entry: TensorEntry, parts: Iterable[tuple[Chunk, Any]]) -> Any:
    """The full tensor of ``entry`` from its chunks' parts, taken one at a time as they are read: a tensor stored
    whole is its one part; the others are copied into place."""
    out = None
    for c, part in parts:
        if len(entry.chunks) == 1:
            return part
        if out is None:
            out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        chunk_region(out, c).copy_(part)
    return out if out is not None else torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))


def chunk_record(
    c: Chunk, fd_of: Callable[[str], int], *, entry: TensorEntry, key: str, allowed: frozenset[str]
) -> tuple[TorchZip, inert.InertTensor]:
    """The chunk's parsed archive and tensor record (its pickle checked); refused unless it is the tensor the
    metadata says."""
    z = read_torch_zip(
        fd_of(c.span.path), c.span.path, allowed=allowed, start=c.span.offset, end=c.span.offset + c.span.length
    )
    t, shape = z.tree, c.sizes if c.stored is None else c.stored
    if not isinstance(t, inert.InertTensor) or t.shape != shape or t.dtype != entry.dtype or not t.is_contiguous():
        raise FormatError(
            f"{c.span.path}: chunk of '{key}' at {list(c.offsets)} is not a contiguous {entry.dtype} tensor of "
            f"shape {list(shape)}; the folder mixes two checkpoints: copy it again"
        )
    return z, t


def read_dcp_tensor(t: DcpTensor, fd_of: Callable[[str], int], *, allowed: frozenset[str]) -> Any:
    """The full tensor ``t`` stands for, in memory of its own: each chunk's record read and CRC-checked, the
    chunks copied into place (a tensor stored whole is its one chunk). Each chunk's values are what torch's DCP
    reader (``torch.load`` of the chunk) gives: big-endian bytes swapped, a conj or neg bit applied."""
    import torch

    entry = t.entry
    dtype = getattr(torch, entry.dtype)
    item = DTYPES[entry.dtype].itemsize

    def part(c: Chunk) -> Any:
        z, record = chunk_record(c, fd_of, entry=entry, key=t.key, allowed=allowed)
        rec = z.archive.storage(record.storage.key)
        data = bytearray(rec.size)
        if os.preadv(fd_of(c.span.path), [data], rec.data_offset) != rec.size:
            raise FormatError(f"{c.span.path}: ends inside chunk of '{t.key}'; it is truncated: copy the folder again")
        check_crc(c.span.path, rec.name, rec.crc, zlib.crc32(data))
        n = math.prod(c.sizes)
        start = record.offset * item
        stored = torch.frombuffer(data, dtype=torch.uint8) if n else None
        if stored is not None and foreign_byte_order(z):  # swapped as torch.load swaps a storage
            stored.untyped_storage().byteswap(dtype)  # type: ignore[no-untyped-call]
        out = (
            stored[start : start + n * item].view(dtype).reshape(c.sizes)
            if stored is not None
            else torch.empty(c.sizes, dtype=dtype)
        )
        if math_bit_view(record):  # a conj or neg view: copy_ (or the caller) sees its values
            torch._utils.set_tensor_metadata(out, record.math_bits)  # type: ignore[no-untyped-call]
        return out

    return gather(torch, entry, ((c, part(c)) for c in entry.chunks))


def chunk_region(full: Any, c: Chunk) -> Any:
    """The view of the full tensor ``full`` that chunk ``c`` fills."""
    region = full
    for dim, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True)):
        region = region.narrow(dim, o, s)
    return region
