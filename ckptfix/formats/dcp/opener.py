"""A DCP folder opened as :class:`~.dcp.reader.DcpTensor` records (its registry row's ``open``): the metadata and
the small values read, every tensor read on demand through the folder's one table of data files. A format whose
records are DCP chunks too (Megatron-Core, a row's ``records``) is opened by :func:`open_records`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ckptfix.formats.dcp.chunks import dcp_tree
from ckptfix.formats.dcp.reader import METADATA, DcpTensor, Span
from ckptfix.formats.files import DataFiles
from ckptfix.formats.hf.folder import room_for_files
from ckptfix.formats.opened import OpenedFolder, OpenOptions, Undescribed
from ckptfix.formats.pickles import inert_trees
from ckptfix.formats.records import FolderRecords
from ckptfix.formats.safety import allowlist
from ckptfix.formats.torchzip.reader import read_torch_zip


def open_dcp(source: str, options: OpenOptions) -> OpenedFolder:
    """The folder as records; :class:`~.opened.Undescribed` where a value holds tensors or objects (torch's DCP
    reader rebuilds them). ``verify`` reads and CRC-checks every chunk now."""
    allowed = allowlist.allowed_names(options.allow_globals, source=source)
    table = DataFiles()
    try:
        tree, why = dcp_tree(source, table.fd, allowed=allowed)
        if why is not None:
            raise Undescribed(why, note=f"a DCP folder whose {why}")
    except BaseException:
        table.close()
        raise
    spans = chunk_spans(tree)
    data = sorted({span.path for span in spans} | set(table.open))
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=tree,
        kind="dcp",
        label="dcp",
        table=table,
        allowed=allowed,
        files=[os.path.join(source, METADATA), *data],
    )
    return verify_chunks(opened, spans, data, verify=options.verify)


def open_records(source: str, options: OpenOptions, *, read: Callable[[], FolderRecords], kind: str) -> OpenedFolder:
    """A folder a format reads as records of DCP chunks (``read()``: Megatron-Core's, or a registry row's
    ``records``), read through the folder's one table; ``verify`` reads and CRC-checks every chunk they use now."""
    allowed = allowlist.allowed_names(options.allow_globals, source=source)
    got = read()
    room_for_files(len(got.files), source=source)  # each data file stays open until the end
    table = DataFiles()
    table.notes.extend(got.notes)
    spans = chunk_spans(got.tree)
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=got.tree,
        kind=kind,
        label=got.kind,
        table=table,
        allowed=allowed,
        files=got.files,
        records=got,
    )
    return verify_chunks(opened, spans, sorted({span.path for span in spans}), verify=options.verify)


def chunk_spans(tree: Any) -> set[Span]:
    """The data-file spans (chunk archives) of the DCP tensor records in ``tree``."""
    return {c.span for v in inert_trees.walk(tree) if isinstance(v, DcpTensor) for c in v.entry.chunks}


def verify_chunks(opened: OpenedFolder, spans: set[Span], data: list[str], *, verify: bool) -> OpenedFolder:
    """``opened``, with ``verify`` every chunk's records read and CRC-checked now (the values were, when they were
    read); closed if that fails."""
    try:
        if verify:
            for span in sorted(spans, key=lambda s: (s.path, s.offset)):
                read_torch_zip(
                    opened.table.fd(span.path),
                    span.path,
                    allowed=opened.allowed,
                    verify=True,
                    start=span.offset,
                    end=span.offset + span.length,
                )
            opened.verified.update(data)
    except BaseException:
        opened.close(check=False)
        raise
    return opened
