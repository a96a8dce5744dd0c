"""A progress bar on stderr for big copies, only when a person is watching (stderr is a terminal)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

THRESHOLD = 100 << 20


def columns() -> tuple[Any, ...]:
    """What the bar shows: what it does, the bar, bytes done of the total, the speed and the time remaining."""
    # rich costs ~0.1 s to import: only paid when a bar is actually shown.
    from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn

    return (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


@contextlib.contextmanager
def progress_bar(total: int, *, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """Yield ``advance(nbytes)`` for inputs over ~100 MB when stderr is a TTY, else ``None``."""
    if not enabled or total < THRESHOLD or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    # on stderr, not rich's default console (stdout): stdout holds what the command prints (--json)
    with Progress(*columns(), transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("converting", total=total)
        yield lambda n: bar.advance(task, n)
