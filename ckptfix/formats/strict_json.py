"""Strict JSON: one object, no key given twice, each refusal said in the words of the file it came from.

A safetensors header and a transformers index are both JSON objects read from untrusted files; both are parsed
here, so the rule (a duplicate key is refused, not silently the last one kept) is written once.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from ckptfix.errors import FormatError


class Said(NamedTuple):
    """What a refusal says after ``{source}: ``; ``{e}`` stands for the parser's own reason."""

    duplicate: str  # a key given twice
    invalid: str  # not JSON (or not UTF-8)
    not_object: str  # JSON, but not an object
    too_deep: str | None = None  # nested past the parser's recursion limit (None: said as ``invalid``)


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` that refuses a key given twice (JSON itself keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"key '{key}' appears twice")
        out[key] = value
    return out


def json_object(raw: bytes, *, source: str, said: Said, utf8: bool = False) -> dict[str, Any]:
    """``raw`` parsed as one JSON object with no duplicate key; ``utf8``: decoded as UTF-8 only (else as
    ``json.loads`` detects it). Raises FormatError naming ``source`` and the first problem."""
    try:
        parsed = json.loads(raw.decode("utf-8") if utf8 else raw, object_pairs_hook=no_duplicates)
    except FormatError as e:
        raise FormatError(f"{source}: " + said.duplicate.format(e=e)) from e
    except RecursionError as e:
        raise FormatError(f"{source}: " + (said.too_deep or said.invalid).format(e=e)) from e
    except ValueError as e:  # UnicodeDecodeError too
        raise FormatError(f"{source}: " + said.invalid.format(e=e)) from e
    if not isinstance(parsed, dict):
        raise FormatError(f"{source}: " + said.not_object)
    return parsed
