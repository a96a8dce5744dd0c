"""The files beside a transformers model's weights: ``config.json``, ``generation_config.json`` and the tokenizer's.

An export into a folder ``from_pretrained`` loads takes them from where the training run put them (HF Trainer and
accelerate write them into the checkpoint folder, or its parent) or from a folder the user names, and writes them
beside the weights, each atomically. Stdlib only: transformers reads them, ckptfix only finds and copies them
(``config.json`` is parsed strictly, so that its dtype can be set to the weights').

Only regular files inside the folder they are found in are copied: a link that resolves outside it (a
``tokenizer.json`` pointing at some other file on the machine) is left out and said, and a ``config.json`` that does
is refused (as a link out is refused for the weights); the check is made on the file actually opened, so a link
swapped in meanwhile is caught.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass

from ckptfix.errors import FormatError, UsageError
from ckptfix.formats.output.atomic import PathLike, atomic_output
from ckptfix.formats.strict_json import Said, json_object
from ckptfix.notes import always

CONFIG = "config.json"
# what save_pretrained and a tokenizer's save_pretrained write beside the weights (copied when present)
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
MAX_SIDE_FILE = 256 << 20  # a tokenizer.json of a 256k vocabulary is ~30 MB; anything far larger is not one
_CONFIG_SAID = Said(
    duplicate="{e}; the config is damaged",
    invalid="not JSON ({e}); it is not a transformers config",
    not_object="not a JSON object; it is not a transformers config",
)


@dataclass(frozen=True)
class ConfigFolder:
    """Where a model's config was found, its parsed ``config.json``, the side files to copy and those left out."""

    folder: str
    config: dict[str, object]
    files: tuple[str, ...]  # paths of SIDE_FILES to copy: in ``folder``, else where else the config was looked for
    left_out: tuple[str, ...] = ()  # what is said of each side file not copied (a link out of its folder)

    @property
    def config_path(self) -> str:
        return os.path.join(self.folder, CONFIG)


def find_config(src: PathLike, *, config_from: PathLike | None = None) -> ConfigFolder:
    """The folder holding the config of checkpoint ``src``: ``config_from`` when given, else ``src``'s folder (the
    folder itself, or a file's folder), then its parent; each side file from that folder, else the other one. Refused
    in one line naming where it looked and the option, when none holds ``config.json`` (or it links out of its
    folder)."""
    source = os.fspath(src)
    if config_from is not None:
        places = [os.fspath(config_from)]
    else:
        here = (source.rstrip(os.sep) if os.path.isdir(source) else os.path.dirname(source)) or "."
        places = [os.path.normpath(here), os.path.normpath(os.path.join(here, os.pardir))]
    for place in places:
        path = os.path.join(place, CONFIG)
        if os.path.isfile(path) or os.path.islink(path):
            config = json_object(_read(path, root=place), source=path, said=_CONFIG_SAID)
            # a side file missing beside the config is taken from the other folder looked in: a checkpoint folder
            # may hold only the config (model.config.save_pretrained), its run folder the generation config
            return ConfigFolder(place, config, *_side_files([place, *(p for p in places if p != place)]))
    if config_from is not None:
        raise UsageError(
            f"{places[0]}: has no {CONFIG}; --config-from names the folder of the model's {CONFIG} "
            f"(save_pretrained writes it)"
        )
    where = " or ".join(dict.fromkeys(places))
    raise UsageError(
        f"{source}: no {CONFIG} (nor generation_config.json, tokenizer files) in {where}; a folder from_pretrained "
        f"loads needs them: pass --config-from DIR, the folder save_pretrained wrote them to"
    )


def _side_files(places: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The side files to copy, each from the first of ``places`` that has it, and notes on those left out."""
    files: list[str] = []
    left_out: list[str] = []
    for name in SIDE_FILES:
        place = next((p for p in places if os.path.lexists(os.path.join(p, name))), None)
        if place is None:
            continue
        path = os.path.join(place, name)
        why = _refusal(path, os.path.realpath(path), root=os.path.realpath(place))
        if why is None:
            files.append(path)
        else:
            left_out.append(
                always(
                    f"left out {name}: {why}; copy the file into the folder, or pass --config-from a folder that "
                    f"holds it"
                )
            )
    return tuple(files), tuple(left_out)


def _refusal(path: str, real: str, *, root: str) -> str | None:
    """Why ``path`` (resolving to ``real``) is not copied, or None: a link out of ``root``, not a regular file."""
    if real == root or os.path.commonpath([real, root]) != root:
        return f"{path} is a link to {real}, outside {root}, and an export copies only the folder's own files"
    if not os.path.isfile(real):
        return f"{path} is not a regular file (a FIFO, socket, device or broken link)"
    return None


def _read(path: str, *, root: str) -> bytes:
    """``path``'s bytes, when the file opened is a regular file inside folder ``root``: the check is made on the
    file open (its real path as Linux names it), so a link swapped in after a check is caught."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO does not block
    except OSError as e:
        raise FormatError(f"{path}: cannot read it ({e.strerror})") from e
    with os.fdopen(fd, "rb") as f:
        real = os.path.realpath(path)
        with contextlib.suppress(OSError):
            real = os.readlink(f"/proc/self/fd/{fd}")
        why = _refusal(path, real, root=os.path.realpath(root))
        if why is not None or not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(
                f"{why or f'{path} is not a regular file'}; copy the file into the folder, or pass "
                f"--config-from a folder that holds it"
            )
        try:
            raw = f.read(MAX_SIDE_FILE + 1)
        except OSError as e:
            raise FormatError(f"{path}: cannot read it ({e.strerror})") from e
    if len(raw) > MAX_SIDE_FILE:
        raise FormatError(f"{path}: over {MAX_SIDE_FILE >> 20} MiB, too large for a config or tokenizer file")
    return raw


def write_side_files(out: str, found: ConfigFolder, *, config: dict[str, object]) -> list[str]:
    """Write ``config`` as ``out/config.json`` (as transformers writes it: indented, keys in their order) and copy
    the side files found beside it, each atomically; the names written."""
    with atomic_output(os.path.join(out, CONFIG)) as f:
        f.write((json.dumps(config, indent=2) + "\n").encode())
    written = [CONFIG]
    for path in found.files:
        name = os.path.basename(path)
        with atomic_output(os.path.join(out, name)) as f:
            f.write(_read(path, root=os.path.dirname(path)))
        written.append(name)
    return written


__all__ = ["CONFIG", "SIDE_FILES", "ConfigFolder", "find_config", "write_side_files"]
