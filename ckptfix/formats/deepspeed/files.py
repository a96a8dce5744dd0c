"""DeepSpeed's files by name: a run folder and its ``latest`` tag, the rank files of a tag folder, and what to say
of one rank's file passed on its own (which folder to pass instead).

Which file is which rank comes from its name (what a ZeRO-1/2 file records of its partition is checked against it
in :mod:`.pickles`). Nothing here reads a pickle: a lone file's rules look at the tree the caller already
read.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from ckptfix.errors import FormatError

LATEST = "latest"
MAX_LATEST = 4096  # a tag name; anything larger is not DeepSpeed's ``latest`` file
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Files of expert- or pipeline-parallel runs: other layouts, which zero_to_fp32 does not consolidate either.
_OTHER_STATES = re.compile(r"^(?:.*expp_rank_\d+.*|layer_\d+-model_\d+-model_states)\.pt$")


# -- detection -------------------------------------------------------------------------------------------


def is_deepspeed(path: str) -> bool:
    """A DeepSpeed run folder (a ``latest`` file naming a tag folder) or one tag folder (its rank files)."""
    if not os.path.isdir(path):
        return False
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        if read_latest(latest, strict=False) is not None:
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


def read_latest(path: str, *, strict: bool) -> str | None:
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
    tag = read_latest(latest, strict=True)
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


def _step_order(name: str) -> tuple[Any, ...]:
    """global_step9 before global_step10: the numbers in a tag compared as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def missing_run(root: str) -> str | None:
    """What to say of a folder holding no checkpoint ckptfix reads where a DeepSpeed run's parts are: a ``latest``
    that cannot be read, or tag folders of rank files and no ``latest`` to say which one; None where neither."""
    try:
        tags = sorted((n for n in _tags(root) if _holds_rank_files(os.path.join(root, n))), key=_step_order)
    except OSError:
        return None
    latest = os.path.join(root, LATEST)
    example = f"pass the tag folder, e.g. {os.path.join(root, tags[-1])}" if tags else ""
    if os.path.lexists(latest):
        why = _unreadable(latest)
        if why is None:
            return None
        if tags:
            return f"{latest}: DeepSpeed's 'latest' file cannot be read ({why}): {example}"
        if os.path.islink(latest):
            return (
                f"{latest}: cannot be read ({why}), and no tag folder of DeepSpeed rank files is here; pass a "
                f"checkpoint file or a folder that holds one"
            )
        return None
    if not tags:
        return None
    count = {1: "a DeepSpeed tag", 2: "two DeepSpeed tags"}.get(len(tags), f"{len(tags)} DeepSpeed tags")
    shown = ", ".join(tags[:5]) + (", …" if len(tags) > 5 else "")
    return f"{root}: {count} {shown} and no 'latest': {example}"


def _unreadable(path: str) -> str | None:
    """Why ``path`` (a ``latest`` that is there) cannot be read as a file; None where it can."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if e.errno == errno.ENOENT and os.path.islink(path):
            return f"a link to {os.readlink(path)}, which is not there"
        return e.strerror or str(e)
    if stat.S_ISDIR(mode):
        return "a folder, not a regular file"
    if not stat.S_ISREG(mode):
        return "not a regular file (a FIFO, socket or device)"
    return None


def rank_files(tag_dir: str) -> tuple[dict[int | None, str], dict[int, str]]:
    """The module files (by rank; None: ZeRO-1/2's one file) and optimizer files (by rank) of a tag folder, each a
    regular file inside it, of model-parallel rank 0; a layout ckptfix does not consolidate, or no optimizer file
    at all, is refused."""
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
                raise FormatError(
                    f"{full}: rank {rank} has two optimizer files here ({os.path.basename(optims[rank])}"
                    f" too: fp32 and bf16 runs mixed); keep one run's files"
                )
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
    return models, optims


def _rank_file(path: str, tag_dir: str) -> None:
    """A rank file checked before it is opened: opening a FIFO blocks, a device never ends, a link may lead out."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise FormatError(f"{path}: cannot read it ({e.strerror}); copy the whole tag folder again") from e
    if not stat.S_ISREG(mode):
        raise FormatError(
            f"{path}: not a regular file (a FIFO, socket, device or folder); copy the whole tag folder again"
        )
    real = os.path.realpath(tag_dir)
    if os.path.commonpath([real, os.path.realpath(path)]) != real:
        raise FormatError(f"{path}: a link to outside the folder; refusing it: copy the file itself into the folder")


def _mp_rank(text: str, path: str) -> None:
    if int(text) != 0:
        raise FormatError(
            f"{path}: model-parallel rank {int(text)} (tensor- or pipeline-parallel run), which ckptfix does not "
            f"consolidate; convert the run with DeepSpeed's ds_to_universal.py"
        )


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
    if os.path.isfile(latest) and read_latest(latest, strict=False) == os.path.basename(folder):
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
