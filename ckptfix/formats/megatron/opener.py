"""A Megatron-Core ``torch_dist`` folder opened as records (its registry row's ``open``): each unstacked tensor a
DCP tensor record of its layer's chunks (:func:`~.megatron.reader.records`), read through the folder's one table."""

from __future__ import annotations

from ckptfix.formats.dcp.opener import open_records
from ckptfix.formats.megatron.reader import records
from ckptfix.formats.opened import OpenedFolder, OpenOptions


def open_megatron(source: str, options: OpenOptions) -> OpenedFolder:
    """The folder's model as records; ``verify`` reads and CRC-checks every DCP chunk they are made of now."""
    return open_records(
        source, options, read=lambda: records(source, allow_globals=options.allow_globals), kind="megatron"
    )
