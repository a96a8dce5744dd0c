"""The files beside a transformers model's weights: ``config.json``, ``generation_config.json`` and the tokenizer's.

An export into a folder ``from_pretrained`` loads takes them from where the training run put them (HF Trainer and
accelerate write them into the checkpoint folder, or its parent) or from a folder the user names, and writes them
beside the weights, each atomically. Stdlib only: transformers reads them, ckptfix only finds and copies them
(``config.json`` is parsed strictly, so that its dtype can be set to the weights').
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from ckptfix.errors import FormatError, UsageError
from ckptfix.formats.output.atomic import PathLike, atomic_output
from ckptfix.formats.strict_json import Said, json_object

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
    """Where a model's config was found, its parsed ``config.json``, and the side files present there."""

    folder: str
    config: dict[str, object]
    files: tuple[str, ...]  # paths of SIDE_FILES found in ``folder``

    @property
    def config_path(self) -> str:
        return os.path.join(self.folder, CONFIG)


def find_config(src: PathLike, *, config_from: PathLike | None = None) -> ConfigFolder:
    """The folder holding the config of checkpoint ``src``: ``config_from`` when given, else ``src``'s folder (the
    folder itself, or a file's folder), then its parent. Refused in one line naming where it looked and the
    option, when none holds ``config.json``."""
    source = os.fspath(src)
    if config_from is not None:
        places = [os.fspath(config_from)]
    else:
        here = (source.rstrip(os.sep) if os.path.isdir(source) else os.path.dirname(source)) or "."
        places = [os.path.normpath(here), os.path.normpath(os.path.join(here, os.pardir))]
    for place in places:
        path = os.path.join(place, CONFIG)
        if os.path.isfile(path):
            config = json_object(_read(path), source=path, said=_CONFIG_SAID)
            files = tuple(os.path.join(place, n) for n in SIDE_FILES if os.path.isfile(os.path.join(place, n)))
            return ConfigFolder(place, config, files)
    if config_from is not None:
        raise UsageError(f"{places[0]}: has no {CONFIG}; --config-from names the folder of the model's {CONFIG} "
                         f"(save_pretrained writes it)")  # fmt: skip
    where = " or ".join(dict.fromkeys(places))
    raise UsageError(
        f"{source}: no {CONFIG} (nor generation_config.json, tokenizer files) in {where}; a folder from_pretrained "
        f"loads needs them: pass --config-from DIR, the folder save_pretrained wrote them to"
    )


def _read(path: str) -> bytes:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise FormatError(f"{path}: not a regular file (a FIFO, socket or device)")
        with open(path, "rb") as f:
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
            f.write(_read(path))
        written.append(name)
    return written


__all__ = ["CONFIG", "SIDE_FILES", "ConfigFolder", "find_config", "write_side_files"]
