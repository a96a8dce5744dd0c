"""How the ranks of a collective load or save agree on an outcome before any tensor moves.

Status and check results travel through the process group's key-value store, not through collectives:
a store wait takes a timeout of its own, so a source that fails, hangs or dies releases every other rank
within seconds (or ``timeout``), instead of after the process group's 30-minute collective timeout.
Only the tensors themselves go through ``broadcast``, and only once every rank has said it is ready.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ckptfix import errors
from ckptfix.errors import CkptfixError, DistributedError, UnsafeCheckpointError

if TYPE_CHECKING:
    import torch

_PREFIX = "ckptfix"


@dataclass(frozen=True)
class Failure:
    """A failure on one rank, in a form that crosses process boundaries (class name and message)."""

    rank: int
    kind: str
    message: str
    globals_needed: tuple[str, ...] = ()

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> Failure:
        """Describe ``exc``; errors from outside ckptfix travel as :class:`DistributedError`."""
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, CkptfixError):
            # The nearest class that every rank can rebuild by name.
            kind = next(k.__name__ for k in type(exc).__mro__ if getattr(errors, k.__name__, None) is k)
        else:
            kind, message = "DistributedError", f"{type(exc).__name__}: {message}"
        needed = tuple(getattr(exc, "globals_needed", ()) or ())
        return cls(rank, kind, message, needed)

    def error(self) -> CkptfixError:
        """The error every rank raises: the failing rank's class, its message, and which rank it was."""
        kind = getattr(errors, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, CkptfixError)):
            kind = DistributedError
        message = f"rank {self.rank}: {self.message}"
        if kind is UnsafeCheckpointError:
            return UnsafeCheckpointError(message, globals_needed=list(self.globals_needed))
        return kind(message)


@dataclass
class Session:
    """One collective call: the group, the source rank, and the store keys this call uses."""

    group: Any
    src: int
    rank: int
    ranks: list[int]
    store: Any
    key: str
    timeout: float
    what: str
    device: torch.device = field(init=False)

    @property
    def is_src(self) -> bool:
        return self.rank == self.src

    def post_status(self, failure: Failure | None, payload: Any = None) -> None:
        """Source only: publish success with ``payload``, or the failure every rank will raise."""
        self.store.set(f"{self.key}/status", _dumps((failure, payload)))

    def wait_status(self, *, allowed: Iterable[str] = ()) -> Any:
        """Receivers: wait for the source's status; raise its failure, or return its payload."""
        raw = self._wait(f"{self.key}/status", f"rank {self.src} (the source) to {self.what}")
        failure, payload = _loads(raw, allowed=allowed)
        if failure is not None:
            raise failure.error()
        return payload

    def agree(self, problem: BaseException | None) -> None:
        """Every rank reports its own check; all raise the lowest failing rank's error, or all go on."""
        mine = None if problem is None else Failure.of(problem, self.rank)
        self.store.set(self._check_key(self.rank), _dumps(mine))
        keys = [self._check_key(rank) for rank in self.ranks]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except (RuntimeError, OSError) as e:
            late = [rank for rank, key in zip(self.ranks, keys, strict=True) if not self._has(key)]
            raise self._gave_up(f"rank(s) {late or '?'} to check their model", e) from e
        failures = [f for f in (_loads(bytes(self.store.get(key)), allowed=()) for key in keys) if f is not None]
        if failures:
            first = min(failures, key=lambda f: f.rank)
            raise first.error() from (problem if first.rank == self.rank else None)
        if self.is_src:
            # Every rank has read the status (it posted its check after reading it): the payload can go.
            self._forget(f"{self.key}/status")

    def _check_key(self, rank: int) -> str:
        return f"{self.key}/check/{rank}"

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except (RuntimeError, OSError):
            return False

    def _forget(self, key: str) -> None:
        # A store without delete_key keeps a few kilobytes per call; harmless.
        with contextlib.suppress(RuntimeError, OSError):
            self.store.delete_key(key)

    def _wait(self, key: str, waiting_for: str) -> bytes:
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
            return bytes(self.store.get(key))
        except (RuntimeError, OSError) as e:  # timeouts and lost connections (DistStoreError, DistNetworkError)
            raise self._gave_up(waiting_for, e) from e

    def _gave_up(self, waiting_for: str, e: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.rank}: waited up to {self.timeout:g} s for {waiting_for} and gave up "
            f"({' '.join(str(e).split())[:200]}); that rank has hung, died or not called this function: "
            f"see its log, or pass a larger timeout= for very large or slow files"
        )


def open_session(group: Any, *, src: int, timeout: float, what: str) -> Session:
    """Check the arguments every rank passed and name this call's keys in the store.

    Raises on this rank only, before anything is posted; the arguments are the same on every rank.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            "torch.distributed is not initialized; call dist.init_process_group() first "
            "(or use ckptfix.load_into / ckptfix.save in a single process)"
        )
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank()
    ranks = list(dist.get_process_group_ranks(group))
    if rank not in ranks:
        raise DistributedError(f"rank {rank} is not in the group {ranks}; call this only on the group's ranks")
    if src not in ranks:
        raise DistributedError(
            f"src={src} is not in the group {ranks}; src is a global rank, as in torch.distributed.broadcast"
        )
    if not timeout > 0:
        raise DistributedError(f"timeout={timeout}: must be a positive number of seconds")
    store = _store(dist)
    tag = f"{_PREFIX}/{'-'.join(map(str, ranks))}"
    # Every rank of the group makes the same calls in the same order, so per-rank counters agree; kept in the
    # store rather than in this process so that a re-initialized group with the same store never reads stale keys.
    seq = store.add(f"{tag}/calls/{rank}", 1)
    session = Session(group, src, rank, ranks, store, f"{tag}/{seq}", float(timeout), what)
    session.device = comm_device(dist, group)
    return session


def _store(dist: Any) -> Any:
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


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# What a status payload may contain: plain containers, the placeholders for tensors, and torch's small value types.
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("builtins", "bytearray"),
    ("ckptfix.distributed.protocol", "Failure"),
    ("ckptfix.distributed.buckets", "Entry"),
    ("ckptfix.distributed.buckets", "TensorRef"),
    ("torch", "Size"),
    ("torch", "device"),
}


class _Unpickler(pickle.Unpickler):
    # The payload is built from a weights-only load on the source, but the receivers still refuse anything
    # beyond that allowlist (plus the user's own allow_globals), so this hop never widens what can run.
    def __init__(self, data: bytes, allowed: set[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in self.allowed or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise DistributedError(
            f"status payload needs global '{module}.{name}', which the receiving rank does not allow; "
            f"pass allow_globals=['{module}.{name}'] on every rank"
        )


def _loads(data: bytes, *, allowed: Iterable[str]) -> Any:
    extra: set[tuple[str, str]] = set()
    for name in allowed:
        module, _, attr = name.rpartition(".")
        extra.add((module, attr))
    return _Unpickler(data, _ALLOWED | extra).load()
