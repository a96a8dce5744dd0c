"""One rank's file of a sharded run (DeepSpeed ZeRO, FSDP), read where a whole checkpoint is wanted: what is refused
and what is said of it. Its content says so, not its container; a torch zip's opener decides which kind of ``.pt``
it is from its one read (``Opened.rank_kind``), and these rules are the ones applied to its tree after."""

from __future__ import annotations

from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.safety.allowlist import sharded_error


def refuse_rank_file(
    obj: Any, *, source: str, model: bool = True, flat: bool = False, instead: str | None = None
) -> None:
    """One rank's share of a sharded run, read where a whole checkpoint is wanted: refused, naming what to pass.

    Its content says so, not its container (any torch file, even a .safetensors file's keys, may be one), so every
    input read whole is asked, here: with ``flat``, FSDP1 flat parameters in a model entry; a lone DeepSpeed ZeRO-3
    module file (``[0]`` placeholders); with ``model`` (a model is wanted, no entry named), a lone ZeRO optimizer
    file. ``instead`` is what DeepSpeed's refusal advises, ``{folder}`` standing for the run's folder."""
    from ckptfix.formats.deepspeed.files import refuse_optimizer_partition, refuse_placeholders

    if flat:
        from ckptfix.formats.fsdp.ranks import refuse_flat_params

        refuse_flat_params(obj, source=source)
    if instead is None:
        refuse_placeholders(obj, source=source)
    else:
        refuse_placeholders(obj, source=source, instead=instead)
    if model:
        refuse_optimizer_partition(obj, source=source)


def rank_file_refusal(kind: str, *, source: str) -> FormatError:
    """The refusal of a file :func:`rank_kind` calls ``kind``, read where full tensors are wanted (what the plain
    read raises for it), naming how to reassemble the run."""
    return sharded_error(kind, source=source)


def rank_file_note(obj: Any, *, source: str) -> str | None:
    """What to say of a rank's file converted on its own (a ZeRO-1/2 module file: the training dtype's weights)."""
    from ckptfix.formats.deepspeed.files import lone_module_note

    return lone_module_note(obj, source=source)


__all__ = ["rank_file_note", "rank_file_refusal", "refuse_rank_file"]
