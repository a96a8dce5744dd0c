"""How the ranks of a collective load or save agree on an outcome, in phases, without ever waiting unbounded.

Control data travels through the process group's key-value store, never through collectives. A call goes
through phases (``start``: the arguments; ``status``: the source's read; ``check``: every rank's check of
its model; ``transfer``: the broadcasts and their end). In each phase a rank posts its value under its own
key and polls for the others' until ``timeout``. The phase's outcome is then committed with one atomic
``compare_set``: the first rank to commit decides (success once every value is in; a failure, or "rank 2 did
not arrive", on a timeout or an error) and every other rank adopts that outcome. So every rank that can still
run raises the same error class and message, whichever phase it was in and whenever it wakes up; a rank
that hangs releases the others within ``timeout``, not the process group's 30-minute collective timeout.
Only tensors go through ``broadcast``, asynchronously, watched by the same clock and the same outcome.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from ckptfix.distributed import wire
from ckptfix.distributed.failures import Failure, disagreement, who
from ckptfix.distributed.store import Board
from ckptfix.errors import CkptfixError, DistributedError

if TYPE_CHECKING:
    import torch

_PREFIX = "ckptfix"
# Bumped when the phases or their values change: ranks that run different versions are told so at once.
PROTOCOL = 2
# The longest pause between two looks at the store: how late a rank hears that another one failed.
_POLL = 0.1


def _pause(waited: float) -> float:
    """How long to sleep before the next look at the store, after ``waited`` seconds of waiting.

    A tenth of the time already waited: a short wait (the common case) ends within a millisecond or so of
    its event, and a long one costs the store a few looks per second (server-side waits would not need
    polling, but a FileStore rounds their timeout up to a second).
    """
    return min(_POLL, max(0.001, waited / 10))


@dataclass
class Session:
    """One collective call: the group, the source rank, the store keys and the clock this call uses."""

    group: Any
    src: int
    rank: int
    ranks: list[int]
    board: Board
    key: str
    timeout: float
    call: str
    source_path: str = ""  # the path as the source named it; a receiver's own path may mean nothing there
    adopted: bool = False  # this rank raised a committed failure: its error is the one every rank raises
    device: torch.device = field(init=False)

    @property
    def is_src(self) -> bool:
        return self.rank == self.src

    @property
    def failed(self) -> bool:
        """Whether this rank's error needs no more agreement: it was agreed on, or the store is gone."""
        return self.adopted or self.board.gone

    def exchange(
        self, phase: str, value: bytes | None, *, late: Callable[[list[int]], str], senders: list[int] | None = None
    ) -> list[bytes]:
        """Post this rank's ``value`` for ``phase`` (if any); every sender's value, once all are in.

        Raises the phase's failure if one was committed, or commits ``late(missing ranks)`` after ``timeout``.
        """
        senders = self.ranks if senders is None else senders
        keys = [f"{self.key}/{phase}/{rank}" for rank in senders]
        if value is not None:
            self.board.set(f"{self.key}/{phase}/{self.rank}", value)
        start = look = time.monotonic()
        while not self.board.check(keys):
            if time.monotonic() - look > _POLL:  # a failure may end the phase before every value is in
                look = time.monotonic()
                if self._settled(phase):
                    break
            if time.monotonic() - start > self.timeout:
                missing = [rank for rank, key in zip(senders, keys, strict=True) if not self.board.check([key])]
                if missing:  # settle returns only if they all arrived meanwhile
                    self.settle(phase, Failure.common(late(missing), absent=tuple(missing)))
            time.sleep(_pause(time.monotonic() - start))
        return [self.board.get(key) for key in keys]

    def settle(self, phase: str, failure: Failure | None) -> None:
        """Commit this rank's verdict on ``phase`` unless another rank did first; raise the agreed failure."""
        self.board.touch()
        if self.board.behind:
            # The others gave up on this rank meanwhile; if they could not record it (this rank hosts the
            # store), they raised the board's message, so this rank raises that one too.
            failure = Failure.common(self.board.lost(), absent=None)
        self._raise_if_failure(phase, self.board.compare_set(self._outcome(phase), "", wire.dumps(failure)))

    def fail(self, phase: str, exc: BaseException) -> NoReturn:
        """This rank failed in ``phase``: raise on every rank the error that was committed first."""
        failure = Failure.of(exc, self.rank)
        self.settle(phase, failure)
        raise failure.error() from exc  # only if the phase had already succeeded everywhere

    def announce(self, payload: bytes) -> None:
        """Source: its part succeeded; ``payload`` goes to every other rank."""
        self.exchange("status", payload, senders=[self.src], late=self._source_late)
        self.settle("status", None)

    def hear(self) -> bytes:
        """Receivers: the source's payload, or the source's failure raised."""
        (payload,) = self.exchange("status", None, senders=[self.src], late=self._source_late)
        self.settle("status", None)
        return payload

    def agree(self, problem: BaseException | None) -> None:
        """Every rank reports its own check; all raise the lowest failing rank's error, or all go on."""
        mine = None if problem is None else Failure.of(problem, self.rank)
        raws = self.exchange("check", wire.dumps(mine), late=lambda missing: self._late(missing, "check the model"))
        failures = [f for f in map(wire.loads, raws) if f is not None]
        first = min(failures, key=lambda f: -1 if f.rank is None else f.rank, default=None)
        try:
            self.settle("check", first)
        except CkptfixError as e:
            raise e from problem
        if self.is_src:
            # Every rank has read the status (it posted its check after reading it): the payload can go.
            self.board.delete(f"{self.key}/status/{self.src}")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """``dist.broadcast`` from the source that gives up on a stall, or when another rank failed."""
        import torch.distributed as dist

        self._keep_up()
        try:
            work = dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
        except (RuntimeError, OSError) as e:
            self._give_up(self._broken(), e)
        start = time.monotonic()
        while not self._finished(work):
            self._keep_up()
            if time.monotonic() - start > self.timeout:
                self._give_up(
                    f"a broadcast from rank {self.src} (the source) did not complete within {self.timeout:g} s; "
                    f"a rank has hung or died: see the logs, or pass a larger timeout=",
                    None,
                )
            self._settled("transfer")  # another rank may have given up already
        try:
            work.wait()  # raises the transfer's own error; under NCCL also orders the current stream after it
        except (RuntimeError, OSError) as e:
            self._give_up(self._broken(), e)
        self._keep_up()

    def finish(self) -> None:
        """After the last broadcast: return on every rank only if the transfer completed on every rank."""
        self.exchange("transfer", b"", late=lambda missing: self._late(missing, "finish the transfer"))
        self.settle("transfer", None)
        self.close("transfer")

    def close(self, phase: str) -> None:
        """The call succeeded: return once every rank has seen that (see :meth:`_farewell`)."""
        self._farewell(phase, ())

    def _farewell(self, phase: str, absent: tuple[int, ...] | None) -> None:
        # The process that hosts the store (rank 0 under env://) may exit as soon as its call returns or
        # raises. So each rank waits, briefly, until every rank still there has read the outcome: none of
        # them is then left with a lost store instead of the result the others got.
        if self.board.gone:
            return
        expected = len(self.ranks) - len(absent or ())
        start, grace = time.monotonic(), min(self.timeout, 0.5 if absent is None else 5.0)
        key = f"{self.key}/{phase}/seen"
        with contextlib.suppress(DistributedError):  # the outcome stands even if the store goes now
            seen = self.board.add(key, 1)
            while seen < expected and time.monotonic() - start < grace:
                time.sleep(_pause(time.monotonic() - start))
                seen = self.board.add(key, 0)

    def _keep_up(self) -> None:
        # A rank that was stopped for longer than the timeout (the others gave up on it) stops at once, with
        # the others' verdict or the board's, instead of sending into or waiting on ranks that left.
        self.board.touch()
        if self.board.behind:
            self.settle("transfer", None)

    def _finished(self, work: Any) -> bool:
        """Whether ``work`` has ended (well or not), after waiting up to about ``_POLL`` seconds for it."""
        if self.device.type == "cpu":
            # Gloo: a wait that times out leaves the work running, and a wait wakes the moment it ends.
            with contextlib.suppress(RuntimeError):
                work.wait(timeout=timedelta(seconds=_POLL))
            return bool(work.is_completed())
        # NCCL: a timed-out wait counts as the work failing (the watchdog may abort the communicator);
        # poll the GPU's progress instead.
        pause, deadline = 0.0001, time.monotonic() + _POLL
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
        return bool(work.is_completed())

    def _give_up(self, message: str, cause: BaseException | None) -> NoReturn:
        self.settle("transfer", Failure.common(message, absent=None))
        raise DistributedError(message) from cause  # settle raised unless the transfer had already ended

    def _broken(self) -> str:
        return f"a broadcast from rank {self.src} failed mid-transfer; a rank died or lost its connection: see its log"

    def _late(self, missing: list[int], doing: str) -> str:
        return (
            f"{who(missing)} did not {doing} within {self.timeout:g} s; it has hung or died: see its log, "
            f"or pass a larger timeout="
        )

    def _source_late(self, missing: list[int]) -> str:
        doing = {"load_for_ddp": "reading", "save_for_ddp": "writing"}.get(self.call, "its part of")
        return (
            f"rank {self.src} (the source) did not finish {doing} {self.source_path} within {self.timeout:g} s; "
            f"it has hung or died: see its log, or pass a larger timeout= for very large or slow files"
        )

    def _outcome(self, phase: str) -> str:
        return f"{self.key}/{phase}/outcome"

    def _settled(self, phase: str) -> bool:
        """Whether ``phase`` has an outcome; raises it if it is a failure."""
        if not self.board.check([self._outcome(phase)]):
            return False
        self._raise_if_failure(phase, self.board.get(self._outcome(phase)))
        return True

    def _raise_if_failure(self, phase: str, raw: bytes) -> None:
        failure = wire.loads(raw)
        if failure is not None:
            self.adopted = True
            self._farewell(phase, failure.absent)
            raise failure.error()


def open_session(
    group: Any, *, src: int, timeout: float | timedelta, call: str, path: str, options: Mapping[str, Any]
) -> Session:
    """Check what can be checked alone, then agree with every rank of ``group`` on the arguments.

    Raises on this rank only when it cannot take part (no process group, not in ``group``, a bad timeout);
    every later error is raised by every rank alike.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            "torch.distributed is not initialized; call dist.init_process_group() first "
            "(or use ckptfix.load_into / ckptfix.save in a single process)"
        )
    seconds = _seconds(timeout)
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank()
    ranks = list(dist.get_process_group_ranks(group))
    if rank not in ranks:
        raise DistributedError(f"rank {rank} is not in the group {ranks}; call this only on the group's ranks")
    board = Board(_store(), timeout=seconds, call=call)
    tag = f"{_PREFIX}/{'-'.join(map(str, ranks))}"
    # Every rank of the group makes the same calls in the same order, so per-rank counters agree; kept in the
    # store rather than in this process so that a re-initialized group with the same store never reads stale keys.
    seq = board.add(f"{tag}/calls/{rank}", 1)
    session = Session(group, src, rank, ranks, board, f"{tag}/{seq}", seconds, call)
    session.device = comm_device(dist, group)
    _agree_on_arguments(session, path=path, options=options)
    if src not in ranks:
        raise DistributedError(
            f"src={src} is not in the group {ranks}; src is a global rank, as in torch.distributed.broadcast"
        )
    return session


def _seconds(timeout: float | timedelta) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise DistributedError(f"timeout={timeout}: must be a positive number of seconds (or a timedelta)")
    return seconds


def _agree_on_arguments(session: Session, *, path: str, options: Mapping[str, Any]) -> None:
    # The first exchange of every call: a rank given another src, bucket size or protocol would otherwise
    # broadcast from a different rank or in different pieces, and every rank would hang in that collective.
    mine = {"protocol": PROTOCOL, "call": session.call, "src": session.src, **options}
    raws = session.exchange(
        "start",
        wire.dumps((mine, path)),
        late=lambda missing: (
            f"{who(missing)} did not call {session.call} within {session.timeout:g} s; call it on every rank of the "
            f"group, in the same order as other collectives, or pass a larger timeout="
        ),
    )
    hellos = [wire.loads(raw) for raw in raws]
    session.source_path = hellos[session.ranks.index(session.src)][1] if session.src in session.ranks else path
    session.settle("start", disagreement([args for args, _ in hellos], session.ranks))


def _store() -> Any:
    # The default store is private API, but stable since torch 1.x and the only store every rank shares.
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as e:
        raise DistributedError(
            f"cannot reach the process group's store ({e}); initialize with init_process_group"
        ) from e


def comm_device(dist: Any, group: Any) -> torch.device:
    """Where broadcast buffers live: this rank's current CUDA device under NCCL, else the CPU."""
    import torch

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
