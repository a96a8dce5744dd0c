"""The process group's key-value store, with every operation bounded by the call's timeout.

When the process that hosts the store (rank 0 under ``init_method="env://"`` or ``tcp://``, usually the agent
under torchrun) is stopped or hung, a store operation blocks for the store's own timeout, 30 minutes by
default, and ``set_timeout`` does not bound it. So each operation runs in a daemon thread that is abandoned
after ``timeout``: this rank raises at once, and the thread ends when the store answers or the process exits.

The store also watches this rank's own clock. A gap longer than ``timeout`` between two operations means this
rank was stopped or starved while the others waited for it, and they have given up: its own verdicts can no
longer be trusted, and :attr:`Board.behind` says so.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptfix.errors import DistributedError


class Board:
    """Store operations that give up after ``timeout`` seconds with :meth:`lost` as the message."""

    def __init__(self, store: Any, *, timeout: float, call: str) -> None:
        self.store = store
        self.timeout = timeout
        self.call = call
        self.behind = False  # this rank went longer than ``timeout`` without contact, at least once
        self.gone = False  # an operation gave up: the store is unreachable, nothing more can be agreed on it
        self._last = time.monotonic()

    def lost(self) -> str:
        """The message of every rank that lost contact, whichever side of the silence it was on."""
        return (
            f"{self.call} lost contact between ranks for more than {self.timeout:g} s: a rank, or the process that "
            f"hosts the process group's store (rank 0, or torchrun's agent), hung or died; see the logs, or pass "
            f"a larger timeout="
        )

    def touch(self) -> None:
        """Note that this rank is in step with the others now (a broadcast completed, an answer arrived)."""
        now = time.monotonic()
        self.behind = self.behind or now - self._last > self.timeout
        self._last = now

    def set(self, key: str, value: bytes) -> None:
        self._run(self.store.set, key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._run(self.store.get, key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._run(self.store.check, keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._run(self.store.add, key, amount))

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if it is absent); its value after that."""
        return bytes(self._run(self.store.compare_set, key, expected, desired))

    def delete(self, key: str) -> None:
        # A store without delete_key keeps a few kilobytes per call; harmless.
        with contextlib.suppress(DistributedError, AttributeError):
            self._run(self.store.delete_key, key)

    def _run(self, method: Callable[..., Any], *args: Any) -> Any:
        if self.gone:  # a thread may still hold the store's connection: do not queue behind it
            raise DistributedError(self.lost())
        self.touch()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = method(*args)
            except BaseException as e:  # handed to the calling thread below
                box["error"] = e

        thread = threading.Thread(target=run, name="ckptfix-store", daemon=True)
        thread.start()
        thread.join(self.timeout)
        error = box.get("error")
        if thread.is_alive() or isinstance(error, (RuntimeError, OSError)):  # hung, lost, or timed out itself
            self.gone = True
            raise DistributedError(self.lost()) from error
        if error is not None:
            raise error
        self.touch()
        return box["value"]
