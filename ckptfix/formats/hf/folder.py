"""Checkpoints that are folders: transformers/accelerate shards with an index, and accelerate ``save_state`` folders.

A folder is recognised by what its files hold, never by their names alone: an index is a JSON object with a
``weight_map``; a shard is whatever file format its bytes say. Every rule a single file obeys holds for each
shard, and the folder adds its own: the index names only plain files inside the folder (no ``..``, no absolute
path, no symlink out), every shard it names exists, every key sits in exactly the shard the index says, and no
shard holds a key the index does not list.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptfix.errors import FormatError, OutputError, UnsafeCheckpointError
from ckptfix.formats.deepspeed.files import missing_run
from ckptfix.formats.hf.index import INDEX_SUFFIX, inside, is_index, looks_like_json, read_index, shards
from ckptfix.formats.output.atomic import PathLike, check_apart, completing, fsync_dir, set_aside
from ckptfix.formats.records import Holder, Spec, TensorRecord, identity, spec, storage_of
from ckptfix.formats.safetensors.file import stored_identity

# accelerate's save_state names (accelerate.utils.constants): model files first, then the training state.
_MODEL_FILE = re.compile(r"^(model|pytorch_model)(_\d+)?\.(safetensors|bin)$")
_STATE_FILE = re.compile(
    r"^(optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin|scaler\.pt"
    r"|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)
_FSDP_MODEL = re.compile(r"^pytorch_model_fsdp_\d+$")  # accelerate's FSDP_MODEL_NAME, SHARDED_STATE_DICT: DCP
_FD_RESERVE = 256  # files the rest of the process (a training job: loaders, sockets, logs) may hold meanwhile
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


@dataclass(frozen=True)
class Folder:
    """What a checkpoint folder holds: entry name → the files that make it up, in order.

    ``flat`` folders (transformers shards, one ``model.safetensors``) load as one state dict; the others
    (accelerate ``save_state``) load as a checkpoint whose entries are named after their files
    (``model``, ``model_1``, ``optimizer``, ``random_states_0`` …).
    """

    root: str
    kind: str  # "sharded" or "accelerate"
    index: str | None
    entries: Mapping[str, tuple[str, ...]]
    weight_map: Mapping[str, str]  # key → shard path, for sharded folders

    @property
    def flat(self) -> bool:
        return self.kind == "sharded"

    @property
    def files(self) -> list[str]:
        return [path for paths in self.entries.values() for path in paths]


def is_folder_input(path: PathLike) -> bool:
    """A folder, or a file that is an index (JSON, by content)."""
    return os.path.isdir(path) or looks_like_json(path)


def is_model_file(path: PathLike) -> bool:
    """A file named as save_pretrained and accelerate name a model's weights (``model.safetensors``,
    ``pytorch_model.bin``), whose folder holds the model's ``config.json`` when save_pretrained wrote it."""
    return not os.path.isdir(path) and bool(_MODEL_FILE.match(os.path.basename(os.fspath(path))))


def weight_files(root: str) -> list[str]:
    """The transformers weights in folder ``root``, by name: its shard indexes (by content) and model files
    (``model.safetensors``, ``pytorch_model.bin``, accelerate's ``model_1.safetensors``)."""
    names = _listing(root)
    return [n for n in names if _MODEL_FILE.match(n) or (n.endswith(INDEX_SUFFIX) and is_index(os.path.join(root, n)))]


def describe(path: PathLike) -> Folder:
    """Find and check what a folder (or an index file) holds; no tensor is read."""
    source = os.fspath(path)
    if not os.path.isdir(source):
        return _sharded(os.path.dirname(os.path.abspath(source)) or ".", source)
    names = _listing(source)
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX) and is_index(os.path.join(source, n))]
    if len(indexes) > 1:
        raise FormatError(
            f"{source}: holds {len(indexes)} index files ({', '.join(indexes)}); pass the one to read, "
            f"e.g. {os.path.join(source, indexes[0])}"
        )
    if indexes:
        return _sharded(source, os.path.join(source, indexes[0]))
    broken = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if broken and not any(_MODEL_FILE.match(n) for n in names):
        read_index(os.path.join(source, broken[0]))  # says what is wrong with it (an index that is not one)
        raise FormatError(f"{os.path.join(source, broken[0])}: has no 'weight_map' dict; the index is damaged")
    return _accelerate(source, names)


def _sharded(root: str, index: str) -> Folder:
    paths, ordered = shards(root, index)
    return Folder(root=root, kind="sharded", index=index, entries={"": ordered}, weight_map=paths)


def _listing(root: str) -> list[str]:
    try:
        return sorted(os.listdir(root))
    except OSError as e:
        raise FormatError(f"{root}: cannot list the folder ({e.strerror})") from e


def room_for_files(count: int, *, source: str) -> None:
    """Make sure this process may open ``count`` more files, raising its soft limit (``ulimit -n``) up to the hard
    one if needed: a DCP folder from 2,048 ranks, or written one file per tensor, has thousands of data files, and
    the usual soft limit is 1,024. Refused in one line when even the hard limit is too low."""
    try:
        import resource
    except ImportError:  # Windows: no such per-process limit to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count + _FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    refusal = FormatError(
        f"{source}: needs {count} files open at once, more than this process may open "
        f"({soft if hard == resource.RLIM_INFINITY else hard}); raise the limit (ulimit -n {need}, as root or in "
        f"limits.conf) and run again"
    )
    if hard != resource.RLIM_INFINITY and hard < need:
        raise refusal
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else hard, hard))
    except (ValueError, OSError) as e:  # macOS caps the soft limit below an unlimited hard one (kern.maxfilesperproc)
        raise refusal from e


def _accelerate(root: str, names: list[str]) -> Folder:
    models = [n for n in names if _MODEL_FILE.match(n)]
    if not models:
        raise FormatError(
            missing_run(root)
            or _fsdp_state(root, names)
            or (
                f"{root}: no checkpoint here (no *.index.json, model.safetensors, pytorch_model.bin or "
                f"model_N.safetensors; no DCP .metadata; no DeepSpeed 'latest' or tag folder of rank files); pass a "
                f"checkpoint file or a folder that holds one"
            )
        )
    stems = [n.rsplit(".", 1)[0] for n in models]
    if len(set(stems)) != len(stems):
        twice = sorted({s for s in stems if stems.count(s) > 1})
        raise FormatError(f"{root}: model '{twice[0]}' is there as both .safetensors and .bin; keep one")
    states = [n for n in names if _STATE_FILE.match(n)]
    entries = {n.rsplit(".", 1)[0]: (inside(root, n, source=root),) for n in models + states}
    if len(entries) == 1:  # one model file (save_pretrained without sharding): the state dict itself
        return Folder(root=root, kind="sharded", index=None, entries={"": next(iter(entries.values()))}, weight_map={})
    return Folder(root=root, kind="accelerate", index=None, entries=entries, weight_map={})


def _fsdp_state(root: str, names: list[str]) -> str | None:
    """What to say of accelerate's ``save_state`` under FSDP with SHARDED_STATE_DICT: its model is a DCP folder
    (``pytorch_model_fsdp_0/``, beside ``optimizer_0/``); None where there is none."""
    models = [n for n in names if _FSDP_MODEL.match(n) and os.path.isdir(os.path.join(root, n))]
    if not models:
        return None
    return (
        f"{root}: accelerate's save_state of an FSDP run: its model is the DCP folder "
        f"{os.path.join(root, models[0])}/; pass that folder (the config beside it is found)"
    )


def check_shard(folder: Folder, path: str, keys: Iterable[str]) -> None:
    """Every key of a shard is one the index puts in that shard (the index's own keys are checked after)."""
    if not folder.index:
        return
    for key in keys:
        expected = folder.weight_map.get(key)
        if expected is None:
            raise FormatError(
                f"{path}: holds key '{key}', which the index {folder.index} does not list; the folder mixes "
                f"two checkpoints: download it again"
            )
        if expected != path:
            raise FormatError(
                f"{path}: holds key '{key}', which the index puts in {os.path.basename(expected)}; "
                f"two shards claim one key: download the folder again"
            )


def check_complete(folder: Folder, found: Iterable[str]) -> None:
    """Every key the index lists was found in its shard."""
    missing = set(folder.weight_map) - set(found)
    if missing:
        key = min(missing)
        raise FormatError(
            f"{folder.index}: key '{key}' is listed in {os.path.basename(folder.weight_map[key])} but not there "
            f"({len(missing)} such keys); the shard is from another checkpoint: download the folder again"
        )


def merge_shards(
    folder: Folder, shards: Iterable[tuple[str, Any]], *, record: Callable[[str, Any], Any] | None = None
) -> OrderedDict[str, Any]:
    """The one state dict of ``folder``'s shards, given as ``(path, state dict as read)``: each shard's keys where
    the index puts them, no key in two shards, every indexed key found, the shards' ``_metadata`` merged.
    ``record(path, value)`` is what each value becomes (the value itself by default)."""
    from ckptfix.transforms.checkpoint import is_state_dict

    merged: OrderedDict[str, Any] = OrderedDict()
    versions: OrderedDict[str, Any] = OrderedDict()
    for path, state in shards:
        if not is_state_dict(state):
            raise FormatError(f"{path}: holds a {type(state).__name__}, not a state dict; it is not a shard")
        check_shard(folder, path, state.keys())
        for key, value in state.items():
            if key in merged:  # only without an index: two model files cannot both hold a key
                raise FormatError(f"{path}: key '{key}' is in two shards; download the folder again")
            merged[key] = value if record is None else record(path, value)
        versions.update(getattr(state, "_metadata", None) or {})
    check_complete(folder, merged)
    if versions:
        merged._metadata = versions  # type: ignore[attr-defined]
    return merged


def load_folder(path: PathLike, *, read: Any, model_only: bool = False) -> Any:
    """One state dict (shards) or one checkpoint (accelerate folder), every shard read by ``read(path)``.

    ``model_only`` leaves the training-state files of an accelerate folder unopened.
    """
    folder = describe(path)
    if folder.flat:
        return merge_shards(folder, ((shard, _read_entry(read, shard, hint=False)) for shard in folder.files))
    out: OrderedDict[str, Any] = OrderedDict()
    for entry, (file,) in folder.entries.items():
        if not model_only or _MODEL_FILE.match(os.path.basename(file)):
            out[entry] = _read_entry(read, file, hint=True)
    return out


def _read_entry(read: Any, path: str, *, hint: bool) -> Any:
    try:
        return read(path)
    except UnsafeCheckpointError as e:
        if not hint or _MODEL_FILE.match(os.path.basename(path)):
            raise
        raise UnsafeCheckpointError(
            f"{e}; or model_only=True to leave the folder's training state unread", globals_needed=e.globals_needed
        ) from e


# -- writing ------------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``5GB`` (10⁹, as transformers and accelerate count), ``512MiB``, ``1000000`` → bytes."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise OutputError(f"shard_size={text!r}: not a size; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def shard_names(out: PathLike, count: int) -> tuple[list[str], str]:
    """transformers' file names for ``count`` shards of OUT (``model.safetensors`` → ``model-00001-of-00002…``)."""
    base = os.path.basename(os.fspath(out))
    stem, dot, ext = base.rpartition(".")
    if count == 1:
        return [base], base + INDEX_SUFFIX
    return [f"{stem}-{i:05d}-of-{count:05d}{dot}{ext}" for i in range(1, count + 1)], base + INDEX_SUFFIX


def plan_shards(sizes: Iterable[tuple[str, int, Any]], *, limit: int) -> list[list[str]]:
    """Keys grouped into shards of at most ``limit`` bytes, in order, as huggingface_hub splits them.

    ``sizes`` gives (key, bytes, storage identity): keys that share a storage (tied weights) go in the shard
    of the first and count once; a tensor larger than ``limit`` gets a shard of its own.
    """
    shards: list[list[str]] = []
    used = 0
    home: dict[Any, list[str]] = {}
    for key, nbytes, storage in sizes:
        if storage is not None and storage in home:
            home[storage].append(key)
            continue
        if not shards or (used + nbytes > limit and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
        if storage is not None:
            home[storage] = shards[-1]
    return shards


def shard_set(out: PathLike) -> list[str]:
    """The files of OUT's shard set that exist, index first: OUT itself, its index and every
    ``{stem}-NNNNN-of-MMMMM{ext}`` beside it, whatever their count (a set of 3 shards is replaced by a set of 2)."""
    folder = os.path.dirname(os.path.abspath(os.fspath(out)))
    base = os.path.basename(os.fspath(out))
    stem, dot, ext = base.rpartition(".")
    numbered = re.compile(re.escape(stem) + r"-\d{5,}-of-\d{5,}" + re.escape(dot + ext))
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [n for n in names if n in (base, base + INDEX_SUFFIX) or numbered.fullmatch(n)]
    return [os.path.join(folder, n) for n in sorted(found, key=lambda n: (not n.endswith(INDEX_SUFFIX), n))]


def check_shards_output(out: PathLike, *, inputs: tuple[PathLike, ...] = (), overwrite: bool = False) -> list[str]:
    """Refuse, before any work is done, shards of OUT that cannot be written: OUT's folder is or holds an input;
    unless ``overwrite``, a shard set of OUT's name is there already (mixing two checkpoints' shards in one folder
    breaks both); with it, that set holds an input or something other than plain files. Returns the set's files,
    which the new set replaces; nothing else in the folder (config.json, a tokenizer) is touched."""
    check_apart(out, inputs=inputs)
    old = shard_set(out)
    if old and not overwrite:
        raise OutputError(
            f"{old[0]}: already exists; write the shards to a new or empty folder, or pass overwrite=True to "
            f"replace this checkpoint's shards (mixing two checkpoints' shards in one folder breaks both)"
        )
    for path in old:
        check_apart(path, inputs=inputs)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OutputError(f"{path}: is not a plain file, and overwrite=True replaces only shard files; remove it")
    return old


@contextlib.contextmanager
def staged(out: PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """A temporary folder beside OUT's folder whose files move into OUT's folder when the block succeeds.

    Shards appear in OUT's folder only once all of them are written and synced, the index last, so a reader
    never sees an index naming a shard that is not there yet. With ``overwrite``, the shard set already there
    is set aside first (its index first) and removed once the new set is in; a failure puts it back.
    """
    folder = os.path.dirname(os.path.abspath(os.fspath(out)))
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".ckptfix-shards.", suffix=".ckptfix-tmp", dir=folder)
    moved: list[str] = []
    done = False
    try:
        yield tmp
        old = check_shards_output(out, overwrite=overwrite)  # as it was when the command began
        names = sorted(os.listdir(tmp), key=lambda n: n.endswith(INDEX_SUFFIX))  # the index last
        try:
            with completing(os.fspath(out)), set_aside(old, folder):
                try:
                    for name in names:
                        os.rename(os.path.join(tmp, name), os.path.join(folder, name))
                        moved.append(os.path.join(folder, name))
                except BaseException:
                    for path in moved:  # before the old set comes back
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                    raise
        except OSError as e:
            raise OutputError(
                f"{os.fspath(out)}: cannot put the new shards in place ({e.strerror or e}); nothing changed"
            ) from e
        fsync_dir(folder)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not done:  # a refusal leaves no trace: not even the folder made for the shards
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def index_json(weight_map: Mapping[str, str], *, total_size: int) -> bytes:
    """The index as transformers writes it: metadata, then the weight map sorted by key."""
    body = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(body, indent=2) + "\n").encode()


def save_sharded(
    state: Mapping[str, Any],
    out: PathLike,
    *,
    limit: int,
    write: Any,
    overwrite: bool = False,
    size: Callable[[Any], tuple[int, Any]] | None = None,
    before_commit: Callable[[], Any] | None = None,
) -> list[str]:
    """Write a state dict as shards of at most ``limit`` bytes next to OUT, plus the index; the written paths.

    ``write(sub_state, path)`` writes one shard file. One shard is written as OUT itself, with no index, as
    transformers does. An existing shard set of OUT's name is refused, or with ``overwrite`` replaced (see
    :func:`staged`). ``size(value)`` gives a value's bytes and what makes two values one stored tensor (a torch
    tensor's by default; the streaming path passes its records'); ``before_commit()`` runs once every file is
    written, before the set is put in place (an exception there leaves nothing behind).
    """
    from ckptfix.transforms.checkpoint import is_state_dict

    if not is_state_dict(state):
        raise OutputError(
            f"{os.fspath(out)}: shards hold one state dict; this checkpoint has other entries: add model_only=True"
        )
    size = size or _tensor_size
    sizes = [(key, *size(t)) for key, t in state.items()]
    groups = plan_shards(sizes, limit=limit)
    names, index_name = shard_names(out, len(groups))
    check_shards_output(out, overwrite=overwrite)
    versions = getattr(state, "_metadata", None)
    weight_map: dict[str, str] = {}
    with staged(out, overwrite=overwrite) as tmp:
        for i, (name, keys) in enumerate(zip(names, groups, strict=True)):
            sub: OrderedDict[str, Any] = OrderedDict((k, state[k]) for k in keys)
            if versions is not None and i == 0:  # module versions once, with the first shard
                sub._metadata = versions  # type: ignore[attr-defined]
            write(sub, os.path.join(tmp, name))
            weight_map.update(dict.fromkeys(keys, name))
        if len(names) > 1:
            total = sum(nbytes for key, nbytes, storage in _unique(sizes))
            with open(os.path.join(tmp, index_name), "wb") as f:
                f.write(index_json(weight_map, total_size=total))
                os.fsync(f.fileno())
        if before_commit is not None:
            before_commit()
    folder = os.path.dirname(os.path.abspath(os.fspath(out)))
    return [os.path.join(folder, n) for n in names] + ([os.path.join(folder, index_name)] if len(names) > 1 else [])


def _tensor_size(t: Any) -> tuple[int, Any]:
    return t.numel() * t.element_size(), _storage(t)


def _storage(t: Any) -> Any:
    if t.numel() == 0:
        return None
    return stored_identity(t)  # one stored tensor, as save_safetensors stores it once


def _unique(sizes: list[tuple[str, int, Any]]) -> Iterator[tuple[str, int, Any]]:
    seen: set[Any] = set()
    for item in sizes:
        if item[2] is None or item[2] not in seen:
            seen.add(item[2])
            yield item


@dataclass(eq=False)
class FolderTensor(TensorRecord):
    """A tensor (record) of file ``part`` of a folder: two files' records (storage ``0`` of two ``.bin`` shards, two
    safetensors shards' first tensors) never pass for one tensor."""

    on_demand: ClassVar[bool] = True

    part: int
    inner: Any

    @property
    def dtype(self) -> str:
        return spec(self.inner).dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return spec(self.inner).shape

    def spec(self) -> Spec:
        return spec(self.inner)

    @property
    def requires_grad(self) -> bool:
        return bool(getattr(self.inner, "requires_grad", False))

    def identity(self) -> Hashable:
        return (self.part, identity(self.inner))

    def _storage(self) -> Hashable:
        return (self.part, storage_of(self.inner))

    def read(self, holder: Holder) -> Any:
        return holder.part(self.part).tensor(self.inner)

    def read_raw(self, holder: Holder) -> Any:
        return holder.part(self.part).raw(self.inner)
