"""The one decision of a conversion, or of a read: the route it takes (a stream, or torch) and, for torch, why.

The streams copy tensor bytes and rewrite only the pickle or header (``stream-file``), read each tensor from its
byte range to cast or shard it (``stream-tensors``: a folder, or one file with ``--dtype`` or ``--shard-size``),
write one ``.pt`` from them (``tensors-to-torch``) or write a DCP folder (``to-dcp``). ``torch`` loads the
checkpoint and saves it. A stream route can still step aside when it meets what only torch rebuilds (a view, a
tensor with hooks, a big-endian file): it raises :class:`~ckptfix.formats.copyable.Fallback` with the reason,
before anything is written, and the torch route runs. Either reason is a note, shown under ``convert -v``.
Reading (``inspect``, ``diff``, ``merge``) decides the same way between describing a file and loading it; a merge
streams key by key (``stream-merge``) until what it reads asks for torch. :mod:`ckptfix.conversion.run` carries a
plan out.

It imports nothing of ckptfix: the rules are about the formats' names and the options only.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM_FILE, STREAM_TENSORS, TENSORS_TO_TORCH, TO_DCP, TORCH = (
    "stream-file",
    "stream-tensors",
    "tensors-to-torch",
    "to-dcp",
    "torch",
)
STREAM_MERGE = "stream-merge"  # merging: key by key from every input into the output (else loaded, in memory)
DESCRIBE = "describe"  # reading: the records as the file describes them, no tensor built
# inputs whose tensors are byte ranges, cast or sharded as they stream (a .pt into .safetensors only)
_RANGES = ("folder", "safetensors")


@dataclass(frozen=True)
class Plan:
    """The route of one conversion or read; ``reason`` says why it is ``torch`` (None for the others)."""

    route: str
    reason: str | None = None

    @property
    def streams(self) -> bool:
        return self.route != TORCH


def plan_conversion(
    *,
    in_fmt: str,
    out_fmt: str,
    fast: bool = True,
    dtype: str | None = None,
    unsafe: bool = False,
    sharded: bool = False,
) -> Plan:
    """The route from an input of format ``in_fmt`` (:func:`~ckptfix.formats.registry.detect_format`) to an
    output of ``out_fmt`` (``torch``, ``safetensors``, ``dcp``), with a cast to ``dtype`` and ``sharded`` output
    (transformers shards) as asked; ``fast=False`` and ``unsafe`` ask for torch."""
    if reason := _torch_reason(fast=fast, dtype=dtype, unsafe=unsafe, in_fmt=in_fmt, out_fmt=out_fmt, sharded=sharded):
        return Plan(TORCH, reason)
    if out_fmt == "dcp":
        return Plan(TO_DCP)
    if in_fmt == "folder" or (in_fmt in ("safetensors", "torch-zip") and (dtype is not None or sharded)):
        return Plan(TENSORS_TO_TORCH if out_fmt == "torch" else STREAM_TENSORS)  # into one .pt: a cast, optimizer
    return Plan(STREAM_FILE)


def plan_reading(fmt: str, *, unsafe: bool = False) -> Plan:
    """How :func:`ckptfix.reading.open_checkpoint` reads a file of format ``fmt``: its records described, no
    tensor built (``describe``: safetensors and torch zip files; a folder is opened file by file), or loaded by
    torch, and why. A description can still step aside for torch when its content asks (a big-endian file, a
    tensor with hooks): the reader says so in the note it gives."""
    if unsafe:
        return Plan(TORCH, "--unsafe-pickle runs the full unpickler")
    if fmt == "torch-legacy":
        return Plan(TORCH, "a legacy (pre-1.6) torch file, whose storages only torch reads")
    if fmt not in ("torch-zip", "safetensors"):
        return Plan(TORCH, f"a {fmt}")
    return Plan(DESCRIBE)


def _torch_reason(
    *, fast: bool, dtype: str | None, unsafe: bool, in_fmt: str, out_fmt: str, sharded: bool
) -> str | None:
    streams = in_fmt in _RANGES or (in_fmt == "torch-zip" and out_fmt == "safetensors")
    if sharded and (not streams or out_fmt != "safetensors"):
        return "shards are written one by one from the loaded checkpoint"
    if not fast:
        return "the torch path was asked for"
    if dtype is not None and not streams and out_fmt != "dcp":  # into DCP each tensor is read, then cast
        return f"casting to {dtype} needs torch"
    if unsafe:
        return "the unsafe option runs the file's pickle, which only torch.load does"
    if in_fmt == "torch-legacy":
        return "the input is a legacy (pre-1.6, not zip) torch file"
    return None


__all__ = [
    "DESCRIBE",
    "STREAM_FILE",
    "STREAM_MERGE",
    "STREAM_TENSORS",
    "TENSORS_TO_TORCH",
    "TORCH",
    "TO_DCP",
    "Plan",
    "plan_conversion",
    "plan_reading",
]
