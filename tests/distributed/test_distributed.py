"""load_for_ddp and save_for_ddp on real gloo groups of 2 and 3 processes on 127.0.0.1."""

from __future__ import annotations

import collections
import copy
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.distributed import buckets, failures, wire
from ckptfix.errors import DistributedError, FormatError, MismatchError, UnsafeCheckpointError
from ckptfix.torchcompat import dcp_save_local
from tests import ddp_workers

TWO = [
    "plain", "ddp", "compiled", "into_compiled", "into_ddp", "mixed_wrappers", "full", "small_buckets", "src1",
    "no_model_broadcast", "non_strict", "fail_missing_file", "fail_unsafe", "fail_truncated", "fail_shape",
    "fail_missing_key", "fail_other_model", "save", "fail_save", "hf_shards", "dcp",
]  # fmt: skip
THREE = ["plain", "src1", "small_buckets", "fail_other_model", "fail_missing_file", "subgroup"]


def _checkpoint() -> dict[str, Any]:
    """A full checkpoint as a DDP training script writes it, from a model no rank starts with."""
    model = ddp_workers.build(seed=1)
    optimizer = ddp_workers.optimizer_for(model)
    ddp_workers.one_step(model, optimizer)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    return {
        "epoch": 3,
        "model": state,
        "optimizer": optimizer.state_dict(),
        "ema": {k: v.clone() for k, v in model.state_dict().items()},
        "args": {"lr": 0.01, "name": "run"},
        "rng": torch.get_rng_state(),
    }


def _write(tmp: Path, name: str, obj: Any, *, srcs: tuple[int, ...] = (0,)) -> None:
    for src in srcs:
        (tmp / f"rank{src}").mkdir(exist_ok=True)
        torch.save(obj, tmp / f"rank{src}" / name)


def _fixtures(tmp: Path) -> dict[str, Any]:
    full = _checkpoint()
    plain = {k.removeprefix("module."): v for k, v in full["model"].items()}
    _write(tmp, "plain.pt", plain, srcs=(0, 1))
    _write(tmp, "ddp.pt", full["model"], srcs=(0, 1))
    _write(tmp, "compiled.pt", {f"_orig_mod.{k}": v for k, v in plain.items()})
    _write(tmp, "full.pt", full, srcs=(0, 2))
    _write(tmp, "missing_key.pt", {k: v for k, v in plain.items() if k != "head.bias"})
    _write(tmp, "wide.pt", ddp_workers.build(seed=1, width=16).state_dict())
    # a class outside the allowlist inside the model entry: nothing to rescue around it (beside the model, the
    # entry would be left out unbuilt and the weights loaded)
    _write(tmp, "unsafe.pt", {"model": {**plain, "config": ddp_workers.Config()}})
    _write(tmp, "truncated.pt", plain)
    (tmp / "rank0" / "hf_shards").mkdir()
    ckptfix.save(full["model"], tmp / "rank0" / "hf_shards" / "model.safetensors", shard_size=1000)
    dcp_save_local({"model": plain, "epoch": 3}, checkpoint_id=str(tmp / "rank0" / "dcp"))
    data = (tmp / "rank0" / "truncated.pt").read_bytes()
    (tmp / "rank0" / "truncated.pt").write_bytes(data[: len(data) // 2])
    return {"full": full, "plain": plain, "tmp": str(tmp)}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp2")
    fixtures = _fixtures(tmp)
    return ddp_workers.spawn(tmp, 2, TWO), fixtures


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp3")
    fixtures = _fixtures(tmp)
    return ddp_workers.spawn(tmp, 3, THREE), fixtures


def _ok(results: list[dict[str, Any]], name: str, ranks: range | list[int]) -> list[Any]:
    values = []
    for rank in ranks:
        record = results[rank].get(name)
        assert record is not None, f"rank {rank} has no result for {name}"
        assert record["ok"], f"rank {rank} {name}: {record['kind']}: {record['message']}"
        values.append(record["value"])
    return values


def _assert_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], prefix: str = "") -> None:
    assert set(state) == {prefix + k for k in expected}
    for key, value in expected.items():
        assert state[prefix + key].dtype == value.dtype
        assert torch.equal(state[prefix + key], value), key


def _assert_same_failure(results: list[dict[str, Any]], name: str, kind: type, needle: str) -> None:
    records = [r[name] for r in results]
    for record in records:
        assert not record["ok"], record
        assert record["kind"] == kind.__name__, record["message"]
        assert needle in record["message"]
        assert record["seconds"] < 10
    assert len({r["message"] for r in records}) == 1, [r["message"] for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "ddp", "compiled", "into_compiled", "into_ddp", "small_buckets", "src1"])
def test_every_rank_ends_bitwise_equal_to_the_checkpoint(two: Any, name: str) -> None:
    results, fixtures = two
    for value in _ok(results, name, range(2)):
        prefix = {"into_compiled": "_orig_mod.", "into_ddp": "module."}.get(name, "")
        _assert_state(value["state"], fixtures["plain"], prefix)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_shards", "dcp"])
def test_a_folder_is_read_on_the_source_and_every_rank_gets_it(two: Any, name: str) -> None:
    results, fixtures = two
    assert len(list((Path(fixtures["tmp"]) / "rank0" / "hf_shards").glob("model-*"))) > 1  # really shards
    for value in _ok(results, name, range(2)):
        _assert_state(value["state"], fixtures["plain"])
    dcp_extras = _ok(results, "dcp", range(2))
    assert [v["extras"] for v in dcp_extras] == [{"epoch": 3}, {"epoch": 3}]


@pytest.mark.slow
def test_ranks_with_differently_wrapped_models_both_load(two: Any) -> None:
    results, fixtures = two
    rank0, rank1 = _ok(results, "mixed_wrappers", range(2))
    _assert_state(rank0["state"], fixtures["plain"])
    _assert_state(rank1["state"], fixtures["plain"], "_orig_mod.")


@pytest.mark.slow
def test_full_checkpoint_returns_other_entries_and_optimizer_steps_identically(two: Any) -> None:
    results, fixtures = two
    values = _ok(results, "full", range(2))
    full = fixtures["full"]
    reference = ddp_workers.build(seed=5)
    ckptfix.load_into(reference, full)
    optimizer = ddp_workers.optimizer_for(reference)
    optimizer.load_state_dict(copy.deepcopy(full["optimizer"]))  # Adam steps its loaded state in place
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: Adam turns rounding noise in tiny gradients into lr-sized steps
    try:
        expected_step = ddp_workers.one_step(reference, optimizer)
    finally:
        torch.set_num_threads(threads)
    for value in values:
        _assert_state(value["state"], fixtures["plain"])
        extras = value["extras"]
        assert set(extras) == {"epoch", "optimizer", "ema", "args", "rng"}
        assert extras["epoch"] == 3 and extras["args"] == {"lr": 0.01, "name": "run"}
        assert torch.equal(extras["rng"], full["rng"])
        _assert_state(extras["ema"], full["ema"])
        assert extras["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]
        for index, slots in full["optimizer"]["state"].items():
            for slot, tensor in slots.items():
                assert torch.equal(extras["optimizer"]["state"][index][slot], tensor)
        for key, tensor in expected_step.items():
            assert torch.equal(value["stepped"][key], tensor), key
    for key in values[0]["stepped"]:
        assert torch.equal(values[0]["stepped"][key], values[1]["stepped"][key]), key


@pytest.mark.slow
def test_small_buckets_carry_the_other_entries(two: Any) -> None:
    results, fixtures = two
    for value in _ok(results, "small_buckets", range(2)):
        _assert_state(value["extras"]["ema"], fixtures["full"]["ema"])


@pytest.mark.slow
def test_without_model_broadcast_receivers_keep_their_weights_but_get_the_rest(two: Any) -> None:
    results, fixtures = two
    src, receiver = _ok(results, "no_model_broadcast", range(2))
    _assert_state(src["state"], fixtures["plain"])
    assert not torch.equal(receiver["state"]["head.weight"], fixtures["plain"]["head.weight"])
    assert receiver["extras"]["epoch"] == 3
    _assert_state(receiver["extras"]["ema"], fixtures["full"]["ema"])


@pytest.mark.slow
def test_non_strict_loads_what_fits_on_every_rank(two: Any) -> None:
    results, fixtures = two
    for rank, value in enumerate(_ok(results, "non_strict", range(2))):
        for key, tensor in fixtures["plain"].items():
            if key != "head.bias":
                assert torch.equal(value["state"][key], tensor), key
        # The key the checkpoint lacks keeps this rank's own value; nothing is broadcast over it.
        own = ddp_workers.build(seed=100 + rank).state_dict()["head.bias"]
        assert torch.equal(value["state"]["head.bias"], own)


@pytest.mark.parametrize(
    ("name", "kind", "needle"),
    [
        ("fail_missing_file", FormatError, "rank 0: "),
        ("fail_unsafe", UnsafeCheckpointError, "ddp_workers.Config"),
        ("fail_truncated", FormatError, "truncated.pt"),
        ("fail_shape", MismatchError, "wrong shape"),
        ("fail_missing_key", MismatchError, "head.bias"),
        ("fail_other_model", MismatchError, "does not fit the model on rank 1"),
        ("fail_save", ckptfix.OutputError, "no-such-folder"),
    ],
)
@pytest.mark.slow
def test_a_failure_anywhere_raises_the_same_error_on_every_rank(two: Any, name: str, kind: type, needle: str) -> None:
    results, _ = two
    _assert_same_failure(results, name, kind, needle)


@pytest.mark.slow
def test_save_for_ddp_writes_once_in_the_single_layout(two: Any) -> None:
    results, _ = two
    values = _ok(results, "save", range(2))
    saved = values[1]["saved"]
    assert saved["epoch"] == 7
    _assert_state(saved["model"], values[0]["state"])


@pytest.mark.slow
def test_three_ranks(three: Any) -> None:
    results, fixtures = three
    for name in ("plain", "src1", "small_buckets"):
        for value in _ok(results, name, range(3)):
            _assert_state(value["state"], fixtures["plain"])
    _assert_same_failure(results, "fail_other_model", MismatchError, "does not fit the model on rank 2")
    _assert_same_failure(results, "fail_missing_file", FormatError, "no such file")


@pytest.mark.slow
def test_sub_group_with_a_source_other_than_zero(three: Any) -> None:
    results, fixtures = three
    for value in _ok(results, "subgroup", [0, 2]):
        _assert_state(value["state"], fixtures["plain"])
        assert value["extras"]["epoch"] == 3
    assert _ok(results, "subgroup", [1]) == ["not in group"]


@pytest.mark.slow
def test_receivers_give_up_within_seconds_when_the_source_dies(tmp_path: Path) -> None:
    _fixtures(tmp_path)
    (tmp_path / "rank2").mkdir(exist_ok=True)
    (tmp_path / "rank2" / "plain.pt").write_bytes((tmp_path / "rank0" / "plain.pt").read_bytes())
    results = ddp_workers.spawn(tmp_path, 3, ["src_dies_mid_broadcast", "src_dies_before_status"], limit=90)
    for rank in (0, 1):
        record = results[rank]["src_dies_mid_broadcast"]
        assert record["kind"] == "DistributedError", record
        assert record["message"] == (
            "a broadcast from rank 2 failed mid-transfer; a rank died or lost its connection: see its log"
        )
        assert record["seconds"] < 10
    record = results[0]["src_dies_before_status"]
    assert record["kind"] == "DistributedError", record
    assert "rank 1 (the source)" in record["message"]
    assert record["seconds"] < 10
    assert "src_dies_before_status" not in results[1]
    assert results[2] == {}


# Single-process checks of the pieces: the bucket plan and the error transport.


def test_plan_packs_small_tensors_and_sends_large_ones_alone() -> None:
    entries = [buckets.Entry("a", (10,), "float32"), buckets.Entry("b", (3,), "bfloat16"),
               buckets.Entry("c", (100,), "float64"), buckets.Entry("d", (0,), "float32")]  # fmt: skip
    transfers = buckets.plan(entries, bucket_bytes=128)
    assert sorted((t.direct, [s[0] for s in t.slots]) for t in transfers) == [(False, [0, 1]), (True, [2])]
    packed = next(t for t in transfers if not t.direct)
    assert packed.slots[1][1] % 64 == 0


def test_strip_and_fill_tensors_round_trip() -> None:
    obj = collections.OrderedDict(a=[torch.ones(2), (3, torch.zeros(()))], b={"c": torch.arange(3)})
    entries: list[buckets.Entry] = []
    tensors: list[torch.Tensor] = []
    skeleton = buckets.strip_tensors(obj, entries, tensors)
    assert [e.shape for e in entries] == [(2,), (), (3,)]
    back = buckets.fill_tensors(skeleton, tensors)
    assert type(back) is collections.OrderedDict and back["a"][1][0] == 3
    assert torch.equal(back["b"]["c"], torch.arange(3))


def test_failure_rebuilds_the_same_class_with_the_rank() -> None:
    error = failures.Failure.of(UnsafeCheckpointError("x.pt: needs os.system", globals_needed=["os.system"]), 3).error()
    assert isinstance(error, UnsafeCheckpointError) and error.globals_needed == ["os.system"]
    assert str(error) == "rank 3: x.pt: needs os.system"
    other = failures.Failure.of(KeyError("boom"), 1).error()
    assert type(other) is DistributedError and "KeyError" in str(other)


def test_payload_refuses_globals_outside_the_allowlist() -> None:
    data = pickle.dumps(collections.Counter(a=1))
    with pytest.raises(DistributedError, match=r"collections\.Counter"):
        wire.loads(data, allowed=())
    assert wire.loads(data, allowed=["collections.Counter"]) == collections.Counter(a=1)


def test_not_initialized_is_a_clear_error(tmp_path: Path) -> None:
    # A fresh interpreter: this test process may already hold a process group.
    code = (
        "import ckptfix, torch\n"
        "try:\n"
        f"    ckptfix.load_for_ddp(torch.nn.Linear(2, 2), {str(tmp_path / 'x.pt')!r})\n"
        "except ckptfix.DistributedError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.startswith("DistributedError") and "init_process_group" in out.stdout


# The options load_for_ddp shares with load_into, on a one-process group.


def test_load_for_ddp_takes_the_entry_prefix_and_tied_keys_load_into_does(tmp_path: Path, gloo_world: None) -> None:
    from tests.models import SmallNet, TiedLM, make_net

    trained, ema = make_net(), make_net(seed=9)
    path = tmp_path / "lightning.ckpt"
    lightning = {name: {f"model.{k}": v for k, v in net.state_dict().items()} for name, net in
                 (("state_dict", trained), ("state_dict_ema", ema))}  # fmt: skip
    torch.save({**lightning, "epoch": 2}, path)
    for entry, expected in ((None, trained), ("state_dict_ema", ema)):
        net = SmallNet(seed=5)
        extras = ckptfix.load_for_ddp(net, path, entry=entry, timeout=30)  # the 'model.' prefix found as load_into
        _assert_state(net.state_dict(), expected.state_dict())
        assert extras["epoch"] == 2 and ("state_dict" in extras) == (entry is not None)
    net = SmallNet(seed=5)
    ckptfix.load_for_ddp(net, path, strip_prefixes=["model."], timeout=30)
    _assert_state(net.state_dict(), trained.state_dict())
    with pytest.raises(ckptfix.LayoutError, match=r"strip_prefixes='student\.' does not match"):
        ckptfix.load_for_ddp(SmallNet(), path, strip_prefixes=["student."], timeout=30)
    state = TiedLM().state_dict()
    del state["head.weight"]
    torch.save(state, tmp_path / "lm.pt")
    model = TiedLM(seed=4)
    ckptfix.load_for_ddp(model, tmp_path / "lm.pt", timeout=30)
    assert torch.equal(model.emb.weight, TiedLM().emb.weight) and model.head.weight is model.emb.weight


def test_an_entry_left_unbuilt_is_named_in_a_warning_where_load_for_ddp_was_called(
    tmp_path: Path, gloo_world: None
) -> None:
    import argparse

    from tests.models import SmallNet

    trained = SmallNet(seed=1).state_dict()
    torch.save({"model": trained, "args": argparse.Namespace(lr=0.1), "epoch": 2}, tmp_path / "c.pt")
    net = SmallNet(seed=5)
    with pytest.warns(UserWarning) as caught:
        extras = ckptfix.load_for_ddp(net, tmp_path / "c.pt", timeout=30)
    assert extras == {"epoch": 2}
    _assert_state(net.state_dict(), trained)
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'c.pt'}: left out of the returned entries, not built: 'args' (argparse.Namespace ×1, not "
        f"loaded). Pass allow_globals= for its classes if you trust the file"
    ]
    assert caught[0].filename == __file__
    extras = ckptfix.load_for_ddp(SmallNet(seed=5), tmp_path / "c.pt", allow_globals=["argparse.Namespace"], timeout=30)
    assert extras["args"] == argparse.Namespace(lr=0.1)
