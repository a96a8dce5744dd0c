"""A DeepSpeed ZeRO run opened as its consolidated state dict of :class:`~.deepspeed.run.ZeroTensor` records (its
registry row's ``open``): the rank files' pickles read, no tensor byte; each rank file opened once, in the run's one
table, when a tensor is first read."""

from __future__ import annotations

from ckptfix.formats.deepspeed.run import describe_run
from ckptfix.formats.hf.folder import room_for_files
from ckptfix.formats.opened import OpenedFolder, OpenOptions
from ckptfix.formats.output.crc import Check
from ckptfix.formats.torchzip.archive import stored_crc, verify_records


def open_run(source: str, options: OpenOptions) -> OpenedFolder:
    """The run's records (with ``optimizer``, ``{"model": state dict, "optimizer": the consolidated optimizer state
    dict, …}``); the CRC of every storage record they are read from is queued in the table (a stream checks them as
    it copies), or with ``verify`` checked now."""
    run = describe_run(source, allow_globals=options.allow_globals, optimizer=options.optimizer)
    room_for_files(len(run.files), source=source)
    tree = {"model": run.state, "optimizer": run.optimizer, **run.carried} if options.optimizer else run.state
    opened = OpenedFolder(
        source=source,
        fmt="folder",
        tree=tree,
        kind="deepspeed",
        label=f"DeepSpeed ZeRO-{run.stage} ({run.world} ranks)",
        zero=run,
        files=[f.path for f in run.files],
        checked=set(),
    )
    table, by_file = opened.table, run.records  # by_file: a walk of every record, made once
    for path, records in by_file.items():
        table.checks[path] = [Check(r.name, r.data_offset, r.size, stored_crc(r)) for r in records]
    table.notes.extend(run.notes)
    try:
        if options.verify:
            for path, records in sorted(by_file.items()):
                verify_records(table.fd(path), path, records)
                assert opened.checked is not None  # set above
                opened.checked.update((path, r.name) for r in records)
            opened.verified.update(by_file)
    except BaseException:
        opened.close(check=False)
        raise
    return opened
