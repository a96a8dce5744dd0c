"""load_for_ddp when a rank hangs, the ranks disagree, or the checkpoint holds entries that cannot travel.

Each case runs on a real 2-process gloo group on 127.0.0.1 with ``timeout=3``, over either store a job meets:
a FileStore under ``tmp_path`` (it outlives every rank, as torchrun's agent store does) or a TCPStore inside
rank 0 (as ``env://`` makes it). The TCPStore and gloo bind ports the OS picks, so parallel runs never collide.
What a user notices is asserted on every rank: the error class, the exact message, how long the call took.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import HashStore  # type: ignore[attr-defined]  # public, not in the stubs

import ckptfix
from ckptfix.distributed import buckets, wire
from ckptfix.distributed.failures import disagreement
from ckptfix.distributed.store import Board
from ckptfix.errors import DistributedError
from tests import ddp_workers
from tests.ddp_workers import FREEZE_SECONDS, HANG_TIMEOUT

# A bound on how long a rank takes holds with a 3x margin: process scheduling and polling on a busy 2-core machine
# (a receiver released after 4.54 s against a 3 s timeout failed a bound of 4.5 s once). A hang is minutes.
SLACK = 3.0
# In order on one group; the last leaves rank 0 one call ahead of rank 1.
PROMPT = [
    "extras_meta", "extras_quantized", "extras_sparse", "extras_storage", "extras_inert", "src_differs",
    "rank1_never_calls",
]  # fmt: skip
NOT_SENT = wire.NOT_SENT


def _write_inputs(tmp: Path) -> dict[str, torch.Tensor]:
    """Small checkpoints under ``tmp/rank<r>/``; ``plain.pt`` exists on both ranks, the others on rank 0."""
    plain = ddp_workers.build(seed=1).state_dict()
    for rank in (0, 1):
        (tmp / f"rank{rank}").mkdir()
        torch.save(plain, tmp / f"rank{rank}" / "plain.pt")
    ema = {k: v.clone() for k, v in plain.items()}
    torch.save({"model": plain, "epoch": 3, "ema": ema}, tmp / "rank0" / "full.pt")
    for kind, value in ddp_workers.extras_values().items():
        torch.save({"model": plain, "epoch": 3, "extra": value}, tmp / "rank0" / f"extras_{kind}.pt")
    return plain


# Each group: its scenarios and its store. Freezing the source (rank 0) freezes a TCPStore with it.
GROUPS = {
    "prompt": (PROMPT, "tcp"),
    "frozen_reading-file": (["src_frozen_reading"], "file"),
    "frozen_reading-tcp": (["src_frozen_reading"], "tcp"),
    "frozen_mid_broadcast-file": (["src_frozen_mid_broadcast"], "file"),
    "frozen_mid_broadcast-tcp": (["src_frozen_mid_broadcast"], "tcp"),
}
LOST = (
    "load_for_ddp lost contact between ranks for more than 3 s: a rank, or the process that hosts the process "
    "group's store (rank 0, or torchrun's agent), hung or died; see the logs, or pass a larger timeout="
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every group at once (a frozen source breaks its group); each group's records and folder."""
    started = {}
    plain: dict[str, torch.Tensor] = {}
    for name, (scenarios, store) in GROUPS.items():
        tmp = tmp_path_factory.mktemp(name)
        plain = _write_inputs(tmp)
        started[name] = (tmp, ddp_workers.start(tmp, 2, scenarios, store=store))
    results: dict[str, Any] = {"plain": plain}
    for name, (tmp, procs) in started.items():
        results[name] = ddp_workers.collect(tmp, procs, limit=90)
        results[f"{name}_tmp"] = tmp
    return results


def _failures(results: list[dict[str, Any]], scenario: str) -> list[dict[str, Any]]:
    records = [r.get(scenario) for r in results]
    for rank, record in enumerate(records):
        assert record is not None, f"rank {rank} has no result for {scenario}: it hung and was killed"
        assert not record["ok"], f"rank {rank} {scenario}: loaded although it should fail"
        assert record["kind"] == "DistributedError", f"rank {rank}: {record['kind']}: {record['message']}"
    return [r for r in records if r is not None]


@pytest.mark.slow
def test_ranks_given_different_src_raise_the_same_error_at_once(runs: dict[str, Any]) -> None:
    records = _failures(runs["prompt"], "src_differs")
    expected = (
        "load_for_ddp was called with different arguments on different ranks: src=0 on ranks [0], "
        "src=1 on ranks [1]; pass the same src on every rank"
    )
    assert [r["message"] for r in records] == [expected, expected]
    assert all(r["seconds"] < HANG_TIMEOUT for r in records), [r["seconds"] for r in records]


REFUSED = [
    ("meta", "a meta tensor (a shape without data)", "save real values or drop the entry"),
    ("quantized", "a quantized tensor (torch.qint8)", "save t.dequantize() or drop the entry"),
    ("sparse", "a torch.sparse_coo tensor", "save t.to_dense() or drop the entry"),
    ("storage", "a raw torch storage", "save the tensor it belongs to, or drop the entry"),
]


@pytest.mark.slow
def test_a_rank_that_never_calls_is_named_within_the_timeout(runs: dict[str, Any]) -> None:
    record = runs["prompt"][0]["rank1_never_calls"]
    assert record["kind"] == "DistributedError", record
    assert record["message"] == (
        "rank 1 did not call load_for_ddp within 3 s; call it on every rank of the group, in the same order as "
        "other collectives, or pass a larger timeout="
    )
    assert HANG_TIMEOUT <= record["seconds"] < HANG_TIMEOUT * SLACK


@pytest.mark.slow
def test_a_meta_tensor_beside_the_model_is_left_out_unbuilt_on_every_rank(runs: dict[str, Any]) -> None:
    # the reader rebuilds no meta tensor (outside the allowlist): the entry stays unbuilt, as load_into leaves it
    for record in [r["extras_meta"] for r in runs["prompt"]]:
        assert record["ok"], record
        assert "extra" not in record["value"]["extras"]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "what", "fix"), REFUSED[1:])  # meta: left out unbuilt, above
def test_entries_that_cannot_travel_are_refused_on_every_rank_before_any_transfer(
    runs: dict[str, Any], kind: str, what: str, fix: str
) -> None:
    source = runs["prompt_tmp"] / "rank0" / f"extras_{kind}.pt"
    records = [r[f"extras_{kind}"] for r in runs["prompt"]]
    assert all(r["seconds"] < HANG_TIMEOUT for r in records), [r["seconds"] for r in records]
    expected = f"rank 0: {source}: entry ['extra'] is {what}, {NOT_SENT}; {fix}"
    assert [r["message"] for r in _failures(runs["prompt"], f"extras_{kind}")] == [expected, expected]


@pytest.mark.parametrize(("kind", "what", "fix"), REFUSED)
def test_the_source_names_the_entry_that_cannot_travel_and_the_fix(kind: str, what: str, fix: str) -> None:
    with pytest.raises(DistributedError) as caught:
        _check_sendable({"epoch": 1, "extra": ddp_workers.extras_values()[kind]})
    assert str(caught.value) == f"c.pt: entry ['extra'] is {what}, {NOT_SENT}; {fix}"


def test_only_an_objects_own_class_is_ever_suggested_for_allow_globals() -> None:
    with pytest.raises(DistributedError) as caught:
        _check_sendable({"args": {"config": ddp_workers.Config()}})
    assert str(caught.value) == (
        f"c.pt: entry ['args']['config'] is a tests.ddp_workers.Config object, {NOT_SENT}; "
        f"pass allow_globals=['tests.ddp_workers.Config'] on every rank"
    )
    _check_sendable({"args": {"config": ddp_workers.Config()}}, allowed=["tests.ddp_workers.Config"])
    with pytest.raises(DistributedError, match=r"^c\.pt: a key or container .* is not plain data"):
        _check_sendable({Key(): 1})


def test_inert_values_pass_the_sources_check() -> None:
    _check_sendable({"epoch": 1, "extra": ddp_workers.extras_values()["inert"], "rng": torch.get_rng_state()})


class Key:
    """A user object used as a dict key: hashable, but not plain data."""


def _check_sendable(extras: dict[Any, Any], allowed: list[str] | None = None) -> None:
    entries: list[buckets.Entry] = []
    tensors: list[torch.Tensor] = []
    skeleton = buckets.strip_tensors(extras, entries, tensors)
    wire.check_sendable(skeleton, entries, tensors, source="c.pt", allowed=allowed or [])


@pytest.mark.slow
def test_a_raw_storage_is_never_answered_with_advice_to_allow_a_code_execution_gadget(runs: dict[str, Any]) -> None:
    for record in _failures(runs["prompt"], "extras_storage"):
        assert "_load_from_bytes" not in record["message"]
        assert "allow_globals" not in record["message"]


@pytest.mark.slow
def test_inert_values_and_unusual_tensors_reach_every_rank_and_the_group_still_works(runs: dict[str, Any]) -> None:
    # Runs after four refused loads on the same group: each refusal left every rank ready for the next call.
    inert = ddp_workers.extras_values()["inert"]
    for rank, result in enumerate(runs["prompt"]):
        record = result["extras_inert"]
        assert record["ok"], f"rank {rank}: {record['kind']}: {record['message']}"
        for key, value in runs["plain"].items():
            assert torch.equal(record["value"]["state"][key], value), key
        extra = record["value"]["extras"]["extra"]
        assert extra["layout"] is torch.strided and extra["dtype"] is torch.bfloat16
        assert extra["size"] == torch.Size([2, 3])
        assert torch.equal(extra["conj"], inert["conj"]) and torch.equal(extra["expanded"], inert["expanded"])


@pytest.mark.slow
@pytest.mark.parametrize("store", ["file", "tcp"])
def test_a_source_frozen_mid_broadcast_releases_every_rank_within_the_timeout(runs: dict[str, Any], store: str) -> None:
    stalled = (
        "a broadcast from rank 0 (the source) did not complete within 3 s; a rank has hung or died: "
        "see the logs, or pass a larger timeout="
    )
    # With the store inside the frozen source, the receiver cannot even read the store: it loses contact.
    expected = {"file": stalled, "tcp": LOST}[store]
    source, receiver = _failures(runs[f"frozen_mid_broadcast-{store}"], "src_frozen_mid_broadcast")
    assert receiver["message"] == expected and source["message"] == expected
    assert HANG_TIMEOUT <= receiver["seconds"] < HANG_TIMEOUT * SLACK
    # The source cannot run while stopped; once resumed it raises the same error at once.
    assert source["seconds"] < FREEZE_SECONDS * SLACK


@pytest.mark.slow
@pytest.mark.parametrize("store", ["file", "tcp"])
def test_a_source_frozen_while_reading_releases_every_rank_within_the_timeout(runs: dict[str, Any], store: str) -> None:
    path = runs[f"frozen_reading-{store}_tmp"] / "rank0" / "full.pt"
    late = (
        f"rank 0 (the source) did not finish reading {path} within 3 s; it has hung or died: see its log, "
        f"or pass a larger timeout= for very large or slow files"
    )
    expected = {"file": late, "tcp": LOST}[store]
    source, receiver = _failures(runs[f"frozen_reading-{store}"], "src_frozen_reading")
    assert receiver["message"] == expected and source["message"] == expected
    assert HANG_TIMEOUT <= receiver["seconds"] < HANG_TIMEOUT * SLACK
    assert source["seconds"] < FREEZE_SECONDS * SLACK


def test_timeout_may_be_a_timedelta(gloo_world: None, tmp_path: Path) -> None:
    model = ddp_workers.build(seed=2)
    torch.save({"model": ddp_workers.build(seed=1).state_dict(), "epoch": 3}, tmp_path / "c.pt")
    extras = ckptfix.load_for_ddp(model, tmp_path / "c.pt", timeout=datetime.timedelta(seconds=5))
    assert extras == {"epoch": 3}
    with pytest.raises(DistributedError, match=r"^timeout=0:00:00: must be a positive number of seconds"):
        ckptfix.load_for_ddp(model, tmp_path / "c.pt", timeout=datetime.timedelta(0))


class _HungStore:
    """A store whose host stopped answering: every call blocks."""

    def check(self, keys: list[str]) -> bool:
        time.sleep(30)
        return True


def test_a_store_that_stops_answering_is_given_up_on_within_the_timeout() -> None:
    board = Board(_HungStore(), timeout=0.3, call="load_for_ddp")
    start = time.monotonic()
    with pytest.raises(DistributedError) as caught:
        board.check(["k"])
    assert time.monotonic() - start < 0.3 + 0.5
    assert str(caught.value) == LOST.replace("3 s", "0.3 s")
    assert board.gone
    with pytest.raises(DistributedError):  # and it is not asked again
        board.check(["k"])


def test_a_rank_that_was_stopped_longer_than_the_timeout_knows_it_fell_behind() -> None:
    board = Board(HashStore(), timeout=0.2, call="load_for_ddp")
    board.touch()
    assert not board.behind
    time.sleep(0.3)
    board.set("k", b"v")
    assert board.behind and board.get("k") == b"v"


def test_disagreement_names_every_differing_argument_and_its_ranks() -> None:
    same = {"protocol": 2, "call": "load_for_ddp", "src": 0, "bucket_mb": 64.0}
    failure = disagreement([same, same, {**same, "src": 1, "bucket_mb": 1.0}], [0, 1, 2])
    assert failure is not None and str(failure.error()) == (
        "load_for_ddp was called with different arguments on different ranks: src=0 on ranks [0, 1], "
        "src=1 on ranks [2]; bucket_mb=64.0 on ranks [0, 1], bucket_mb=1.0 on ranks [2]; "
        "pass the same src, bucket_mb on every rank"
    )
    assert disagreement([same, same], [0, 1]) is None
    other = disagreement([same, {**same, "call": "save_for_ddp"}], [0, 1])
    assert other is not None and str(other.error()).startswith("ckptfix collectives were called with different")
    assert str(other.error()).endswith("make the same ckptfix calls on every rank, in the same order")
