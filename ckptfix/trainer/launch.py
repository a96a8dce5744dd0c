"""Start DDP runs through PyTorch's elastic launcher (``torch.distributed.run``, the code behind torchrun)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckptfix.errors import CkptfixError


def launcher_args(
    nproc_per_node: str,
    *,
    nnodes: str = "1",
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "ckptfix",
) -> list[str]:
    """torchrun's own flags for a single-node (standalone) or multi-node (c10d rendezvous) run."""
    args = ["--nproc-per-node", nproc_per_node, "--nnodes", nnodes]
    if rdzv_endpoint:
        # Multi-node: the launcher's own c10d rendezvous, started the same way on every node.
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
        if node_rank is not None:
            args += ["--node-rank", str(node_rank)]
    elif nnodes != "1":
        raise CkptfixError(f"--nnodes {nnodes}: several nodes need --rdzv-endpoint HOST:PORT (same on every node)")
    else:
        args.append("--standalone")  # a local rendezvous on a free port: parallel runs never collide
    return args


def launch_trainer(trainer_argv: Sequence[str], launcher: Sequence[str]) -> None:
    """Run ``python -m ckptfix.trainer TRAINER_ARGV`` in every process the launcher starts; wait for all.

    Raises :class:`CkptfixError` (exit code of the first worker that failed by itself, when it is 1 or 2).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun sets one thread per worker anyway and warns that it did; say it here, without the warning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(parse_args([*launcher, "-m", "ckptfix.trainer", *trainer_argv]))  # type: ignore[no-untyped-call]
    except ChildFailedError as e:
        # When one worker exits with an error the launcher SIGTERMs the rest; those -15s are consequences,
        # so the first worker that exited by itself (exit code > 0) is the one to report.
        rank, failure = min(e.failures.items(), key=lambda item: (item[1].exitcode <= 0, item[0]))
        error = CkptfixError(
            f"ddp: {len(e.failures)} worker process(es) failed, first rank {rank} with exit code "
            f"{failure.exitcode}; its message is above"
        )
        # A worker's own ckptfix error already chose 1 or 2; keep it so scripts can tell them apart.
        error.exit_code = failure.exitcode if failure.exitcode in (1, 2) else 2
        raise error from None
