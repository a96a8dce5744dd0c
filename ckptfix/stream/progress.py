"""A progress bar on stderr for big copies, only when a person is watching (stderr is a terminal)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

THRESHOLD = 100 << 20


@contextlib.contextmanager
def progress_bar(total: int, *, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """Yield ``advance(nbytes)`` for inputs over ~100 MB when stderr is a TTY, else ``None``."""
    if not enabled or total < THRESHOLD or not sys.stderr.isatty():
        yield None
        return
    # rich costs ~0.1 s to import: only paid when a bar is actually shown.
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        transient=True, console=None,
    ) as bar:  # fmt: skip
        task = bar.add_task("converting", total=total)
        yield lambda n: bar.advance(task, n)
