"""FSDP1 LOCAL_STATE_DICT rank files (flat parameters) merged, given the model that was wrapped, into exactly the
FULL_STATE_DICT of the same job; a model that does not lay the flat parameters out is refused in one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.formats.fsdp import fsdp1
from ckptfix.formats.fsdp import ranks as shards
from ckptfix.formats.fsdp.ranks import RankFilesError
from ckptfix.merging.files import merge_files
from tests import sharded_writers
from tests.models import SmallNet, TiedNet

# Slow (each test marked): real FSDP1 runs on 2 or 3 gloo processes, one per case for the module

# width 5: parameters of 135 and 5 elements, so use_orig_params=True pads before most of them
RUNS: dict[str, dict[str, Any]] = {
    "orig-tied": {"orig": True, "tied": True, "width": 5},  # alignment and trailing padding; a shared weight
    "tied": {"tied": True, "width": 5},  # use_orig_params=False: no padding; the shared weight flattened once
    "orig-3-ranks": {"orig": True, "width": 5, "world": 3},
    "orig-bf16": {"orig": True, "width": 5, "mixed": True},  # MixedPrecision: 16 bytes of bfloat16 = 8 elements
}
Jobs = Callable[[str], tuple[Path, dict[str, Any]]]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """The folder of run ``name`` of :data:`RUNS` (written on first use, once for the module) and how it ran."""
    made: dict[str, Path] = {}

    def job(name: str) -> tuple[Path, dict[str, Any]]:
        if name not in made:
            made[name] = sharded_writers.write_fsdp1(tmp_path_factory.mktemp(name), **RUNS[name])
        return made[name], RUNS[name]

    return job


def _locals(folder: Path, how: dict[str, Any]) -> list[Path]:
    return [folder / f"local{r}.pt" for r in range(how.get("world", sharded_writers.WORLD))]


def _model_args(how: dict[str, Any], **kwargs: Any) -> list[str]:
    factory = "TiedNet" if how.get("tied") else "SmallNet"
    return ["--model", f"tests.models:{factory}", "--kwargs", json.dumps({"width": how["width"], **kwargs})]


def _cli(*args: Any) -> Result:
    from ckptfix.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_local_rank_files_merge_into_the_full_state_dict(jobs: Jobs, name: str, tmp_path: Path) -> None:
    folder, how = jobs(name)
    ranks = _locals(folder, how)
    before = [p.read_bytes() for p in ranks]
    full = torch.load(folder / "full.pt", weights_only=True)  # rank 0's FULL_STATE_DICT in the same job
    out = tmp_path / "full.pt"
    result = _cli("merge", *ranks, "-o", out, "--buffers", "rank0", *_model_args(how))
    assert result.exit_code == 0, result.output
    params = [k for k in full if "running" not in k and "num_batches" not in k]
    world = len(ranks)
    assert f"reassembled {len(params)} ShardedTensor tensor(s) from every rank's shards (ShardedTensor, {world} " \
           f"shard(s) over {world} rank(s), split from '_flat_param'; ShardedTensor, {world} shard(s) over {world} " \
           f"rank(s), split from 'head._flat_param'): full tensors, not averaged" in result.output  # fmt: skip
    merged = torch.load(out, weights_only=True)
    assert list(merged) == list(full)  # FULL_STATE_DICT's keys in its order (a shared weight after its module's own)
    for key, value in full.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
    assert [p.read_bytes() for p in ranks] == before
    model = TiedNet(width=how["width"]) if how.get("tied") else SmallNet(width=how["width"])
    st = tmp_path / "full.safetensors"  # the library, into the other format
    report = merge_files(ranks, st, model=model, buffers="rank0")
    assert sorted(report.reassembled) == sorted(params)
    assert report.reassembled["head.bias"].endswith("split from 'head._flat_param'")
    from_st = ckptfix.load(st)
    assert set(from_st) == set(full) and all(torch.equal(from_st[k], v) for k, v in full.items())
    assert ckptfix.load_into(model, out).loads_as_is


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_model_of_other_sizes_is_refused_with_the_numbers(jobs: Jobs, name: str, tmp_path: Path) -> None:
    folder, how = jobs(name)
    ranks = _locals(folder, how)
    out = tmp_path / "m.pt"
    wrong = TiedNet(width=6) if how.get("tied") else SmallNet(width=6)
    need = sum(p.numel() for name, p in wrong.named_parameters() if not name.startswith("head."))  # the root unit's
    result = _cli("merge", *ranks, "-o", out, *_model_args(how, width=6))
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output and not out.exists()
    assert result.output.startswith(f"ckptfix: error: {ranks[0]}: '_flat_param' holds "), result.output
    assert f" elements, but the {len(list(wrong.parameters())) - 2} parameter(s) of the model's root module need " \
           f"{need} (" in result.output  # fmt: skip
    assert "with use_orig_params=True padding); pass the model that was wrapped, built with the same arguments" \
           in result.output  # fmt: skip


class _SplitOtherwise(SmallNet):
    """SmallNet(width=5) whose first convolution is two flat tensors of 130 and 10 elements: with FSDP's alignment
    padding they fill the same 144 elements as the real 135 and 5, so only the parameters' parts on each rank (in
    a use_orig_params=True file) tell the split is wrong."""

    def __init__(self) -> None:
        super().__init__(width=5)
        conv = nn.Module()
        conv.weight = nn.Parameter(torch.zeros(130))
        conv.bias = nn.Parameter(torch.zeros(10))
        self.features[0] = conv


@pytest.mark.slow
def test_a_wrong_split_of_the_same_size_is_refused(jobs: Jobs, tmp_path: Path) -> None:
    ranks = _locals(*jobs("orig-3-ranks"))
    real = SmallNet(width=5).features[0].weight.numel()
    with pytest.raises(RankFilesError) as caught:
        merge_files(ranks, tmp_path / "m.pt", model=_SplitOtherwise())
    assert str(caught.value) == (
        f"{ranks[0]}: 'features.0.weight' holds {real} elements on rank 0, but the model's layout of '_flat_param' "
        f"puts 130 of its 130 there; pass the model that was wrapped"
    )
    assert not (tmp_path / "m.pt").exists()
    across = SmallNet(width=5)  # the head's weight also used outside its FSDP unit: not a split ckptfix can know
    across.extra = nn.Linear(5, 3)
    across.extra.weight = across.head.weight
    with pytest.raises(RankFilesError) as caught:
        merge_files(ranks, tmp_path / "m.pt", model=across)
    assert str(caught.value) == (
        f"{ranks[0]}: the model's parameter 'extra.weight' is also 'head.weight' of the nested FSDP unit 'head': a "
        f"parameter shared across units, which ckptfix does not split; save FULL_STATE_DICT or SHARDED_STATE_DICT "
        f"instead"
    )


@pytest.mark.slow
def test_a_missing_rank_or_another_model_is_refused(jobs: Jobs, tmp_path: Path) -> None:
    folder, how = jobs("orig-tied")
    ranks = _locals(folder, how)
    out = tmp_path / "m.pt"
    cases = [
        ((ranks[0], *_model_args(how)), "'_flat_param': the shards of rank(s) [1] are missing (1 file(s) for a job "
                                        "of 2 ranks); pass every rank's file exactly once"),
        ((*ranks, "--model", "tests.models:SmallNet", "--kwargs", '{"width": 5}'),
         f"{ranks[0]}: '_flat_param' holds "),  # TiedNet's files, SmallNet's parameters: fewer elements
        ((*ranks,), f"{ranks[0]}: 'head._flat_param' is an FSDP1 LOCAL_STATE_DICT flat parameter ("),  # its first
    ]  # fmt: skip
    for args, message in cases:
        result = _cli("merge", *args, "-o", out)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith(f"ckptfix: error: {message}"), (args, result.output)
        assert result.output.count("\n") == 1 and not out.exists()


# Edited placements: refused in one line before a byte is placed, in time bounded by the file, never an uninitialized
# byte in an output.


def _getattr_pickle(target: bytes) -> bytes:
    """A protocol-2 pickle of ``getattr(<target>, "__init__")``, as ShardedTensor's nested class is named."""
    name = b"__init__"
    return b"\x80\x02c__builtin__\ngetattr\n" + target + b"X" + len(name).to_bytes(4, "little") + name + b"\x86R."


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n",
         "looks up torch.distributed._shard.sharded_tensor.api.ShardedTensor.__init__ with getattr, which is not a "
         "known class"),
        (b"K\x01", "calls getattr on something other than a class"),
    ],
)  # fmt: skip
def test_the_sharded_tensor_reader_resolves_getattr_only_to_a_known_nested_class(target: bytes, message: str) -> None:
    from ckptfix.errors import UnsafeCheckpointError
    from ckptfix.formats.pickles import unpickling
    from ckptfix.formats.safety import allowlist
    from ckptfix.formats.safety.allowlist import ShardedCheckpointError

    names = allowlist.SHARDED_TENSOR_GLOBALS
    allowed = allowlist.allowed_names([], source="x") | names
    with pytest.raises(FormatError, match=f"^x: its pickle {message}; refusing it$"):
        unpickling.load(_getattr_pickle(target), source="x", allowed=allowed, as_data=names)
    with pytest.raises((UnsafeCheckpointError, ShardedCheckpointError)):  # any other reader: refused as ever
        unpickling.load(_getattr_pickle(target), source="x", allowed=allowlist.allowed_names([], source="x"))
    # os.system named beside a ShardedTensor: it is said to be dangerous, not explained away as shards
    dangerous = _getattr_pickle(b"cos\nsystem\n" + target)[:-3] + b"0\x86R."
    with pytest.raises(UnsafeCheckpointError, match=r"its pickle calls builtins\.getattr, os\.system"):
        unpickling.load(dangerous, source="x", allowed=allowlist.allowed_names([], source="x"))


def _fsdp1_piece(rank: int, layout: Any, local: Any, shape: tuple[int, ...] = (4, 2)) -> shards.ShardedPiece:
    return shards.ShardedPiece("float32", shape, rank, 2, tuple(layout), tuple(local))


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ([((0, 0), (2, 2), 0), ((1, 0), (3, 2), 1)], "overlap"),  # rows 1..2 twice, 3 rows past the end
        ([((0, 0), (2, 2), 0), ((3, 0), (1, 2), 1)], "cover 6 of 8 elements"),  # row 2 in no shard
    ],
)
def test_fsdp1_shards_that_do_not_tile_are_refused_before_anything_is_placed(layout: Any, message: str) -> None:
    ranks = [{"w": _fsdp1_piece(r, layout, [(o, s, None) for o, s, placed in layout if placed == r])} for r in range(2)]
    with pytest.raises(shards.RankFilesError, match=message):
        fsdp1.check_sharded(ranks, ["rank0.pt", "rank1.pt"])


def test_fsdp1_local_shards_not_where_the_metadata_places_them_are_refused() -> None:
    layout = [((0, 0), (2, 2), 0), ((2, 0), (2, 2), 1)]
    ranks = [{"w": _fsdp1_piece(0, layout, [((0, 0), (2, 2), None)])}, {"w": _fsdp1_piece(1, layout, [])}]
    with pytest.raises(shards.RankFilesError, match=r"rank1.pt: 'w': rank 1's local shards are not those the metadata"):
        fsdp1.check_sharded(ranks, ["rank0.pt", "rank1.pt"])
    parts = [_fsdp1_piece(0, layout, [((0, 0), (2, 2), torch.zeros(2, 3))])]
    with pytest.raises(shards.RankFilesError, match=r"local shard is torch.float32 \[2, 3\] where its metadata says"):
        shards.assemble_sharded(parts, ["rank0.pt"], key="w")


def test_an_fsdp1_tensor_of_a_huge_size_is_refused_before_memory_is_taken() -> None:
    # metadata of a crafted file: one 2**44-element shard (64 TiB), whose tensor in the file has 2 elements
    layout = [((0,), (2**44,), 0)]
    parts = [_fsdp1_piece(0, layout, [((0,), (2**44,), torch.zeros(2))], shape=(2**44,))]
    with pytest.raises(shards.RankFilesError, match=r"local shard is torch.float32 \[2\] where its metadata says"):
        shards.assemble_sharded(parts, ["rank0.pt"], key="w")


class _Kept:
    """A ShardedTensor as its pickle's reduce (rebuilt by torch only with a process group): edited, saved back."""

    def __init__(self, func: Any, cls: Any, args: Any, state: Any) -> None:
        self.func, self.cls, self.args, self.state = func, cls, list(args), state

    def __reduce_ex__(self, protocol: Any) -> Any:
        return torch._tensor._rebuild_from_type_v2, (self.func, self.cls, tuple(self.args), self.state)


def _load_kept(path: Path) -> Any:
    """An FSDP1 rank file as torch pickled it, each ShardedTensor a :class:`_Kept` (torch.save writes it back)."""
    import pickle
    import types

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
                return _Kept
            return super().find_class(module, name)

    keeping = types.ModuleType("keeping")
    keeping.__dict__.update(pickle.__dict__)
    keeping.Unpickler = Unpickler  # type: ignore[attr-defined]
    return torch.load(path, weights_only=False, pickle_module=keeping)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


@pytest.fixture(scope="module")
def fsdp1_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A use_orig_params=True FSDP1 job (LOCAL_STATE_DICT files with padding) and one with AdamW files."""
    return {
        "orig": sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1-orig"), orig=True, width=5),
        "adamw": sharded_writers.write_fsdp1(tmp_path_factory.mktemp("fsdp1-adamw")),
    }


def _flat_of_shape(shape: tuple[int, ...]) -> Callable[[Any, int], None]:
    """The root flat parameter re-declared as ``shape`` (its metadata, its shards and their tensors made to agree):
    a rank file whose every ShardedTensor check passes, but whose flat parameter is not 1-D."""

    def edit(state: Any, rank: int) -> None:
        flat = state["_flat_param"]
        flat.args[2], flat.args[3] = shape, tuple(1 for _ in shape)
        local, meta = flat.state[0], flat.state[1]
        meta.size = torch.Size(shape)
        if not shape:  # one element: rank 0's shard alone
            meta.shards_metadata = [m for m in meta.shards_metadata if m.placement.rank() == 0]
            del local[1 if rank == 0 else 0 :]
        for m in [*meta.shards_metadata, *(s.metadata for s in local)]:
            m.shard_offsets, m.shard_sizes = [*m.shard_offsets, 0][: len(shape)], [*m.shard_sizes, 2][: len(shape)]
        for s in local:
            s.tensor = s.tensor.detach()[0].clone() if not shape else torch.stack([s.tensor.detach()] * 2, 1)

    return edit


def _second_root_flat(state: Any, rank: int) -> None:
    state["._flat_param"] = state["_flat_param"]  # the root module's flat parameter under a second name


def _view(value: Any) -> Callable[[Any, int], None]:
    def edit(state: Any, rank: int) -> None:
        state["features.0.weight"] = value  # with use_orig_params=True: the parameter's part on this rank

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_flat_of_shape((410, 2)), "'_flat_param' is a ShardedTensor of shape [410, 2], but an FSDP flat parameter is "
                                   "1-D; the file is damaged or crafted"),
        (_flat_of_shape(()), "'_flat_param' is a ShardedTensor of shape [], but an FSDP flat parameter is 1-D; the "
                             "file is damaged or crafted"),
        (_view(7), "'features.0.weight' is not a tensor (int), but a use_orig_params=True file holds the parameter's "
                   "part on rank 0 there; the file is damaged or crafted"),
        (_second_root_flat, "'._flat_param' and '_flat_param' are both the flat parameter of the root module, and "
                            "an FSDP unit has one; the file is damaged or crafted"),
    ],
    ids=["flat-param-2d", "flat-param-0d", "parameter-part-not-a-tensor", "two-flat-params-of-one-unit"],
)  # fmt: skip
def test_an_edited_local_state_dict_is_refused_in_one_line(
    fsdp1_runs: dict[str, Path], tmp_path: Path, edit: Callable[[Any, int], None], message: str
) -> None:
    ranks = []
    for r in range(sharded_writers.WORLD):
        state = _load_kept(fsdp1_runs["orig"] / f"local{r}.pt")
        edit(state, r)
        torch.save(state, tmp_path / f"local{r}.pt")
        ranks.append(tmp_path / f"local{r}.pt")
    before = [p.read_bytes() for p in ranks]
    out = tmp_path / "m.pt"
    model = ["--model", "tests.models:SmallNet", "--kwargs", '{"width": 5}']
    result = CliRunner().invoke(cli, ["merge", *map(str, ranks), "-o", str(out), "--buffers", "rank0", *model])
    assert result.exit_code == 2, result.output
    assert result.output == f"ckptfix: error: {ranks[0]}: {message}\n"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["local0.pt", "local1.pt"]
    assert [p.read_bytes() for p in ranks] == before


def test_optimizer_state_under_two_names_is_consolidated_once(fsdp1_runs: dict[str, Path], tmp_path: Path) -> None:
    # one parameter's state dict under a second name: the pickle stores it once, and torch.load gives one dict
    ranks = []
    for r in range(sharded_writers.WORLD):
        state = _load_kept(fsdp1_runs["adamw"] / f"adamw_optim{r}.pt")
        state["state"]["features.0.bias"] = state["state"]["features.0.weight"]
        torch.save(state, tmp_path / f"optim{r}.pt")
        ranks.append(tmp_path / f"optim{r}.pt")
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(cli, ["merge", *map(str, ranks), "-o", str(out), "--optimizer"])
    assert result.exit_code == 0, result.output
    merged = torch.load(out, weights_only=True)["state"]
    truth = torch.load(fsdp1_runs["adamw"] / "full_optim.pt", weights_only=True)["adamw"]["state"]
    assert set(merged) == set(truth)
    for name in ("features.0.weight", "features.0.bias"):
        assert list(merged[name]) == list(truth["features.0.weight"])
        for key, value in truth["features.0.weight"].items():
            assert torch.equal(merged[name][key], value), (name, key)
    assert merged["features.0.bias"]["exp_avg"].data_ptr() == merged["features.0.weight"]["exp_avg"].data_ptr()


def test_a_sharded_tensor_in_a_list_is_refused_not_copied_as_one_rank_s_shards(
    fsdp1_runs: dict[str, Path], tmp_path: Path
) -> None:
    # FSDP1 saves ShardedTensors in dicts; one in a list was written as rank 0's shards into a "merged" file
    ranks = []
    for r in range(sharded_writers.WORLD):
        state = _load_kept(fsdp1_runs["adamw"] / f"sharded{r}.pt")
        torch.save({"model": state, "extra": [state["features.0.weight"]]}, tmp_path / f"rank{r}.pt")
        ranks.append(tmp_path / f"rank{r}.pt")
    out = tmp_path / "m.pt"
    for flags in ([], ["--model-only"]):
        result = CliRunner().invoke(cli, ["merge", *map(str, ranks), "-o", str(out), *flags])
        assert result.exit_code == 2, result.output
        assert result.output == (
            f"ckptfix: error: {ranks[0]}: 'extra' holds a ShardedTensor inside a list, tuple or object, where FSDP1 "
            f"saves them in dicts only (ckptfix reassembles those); the file is damaged or crafted: save "
            f"FULL_STATE_DICT instead\n"
        )
        assert not out.exists()


def _merged_rank0(files: list[Path], out: Path, *extra: str) -> Any:
    result = CliRunner().invoke(cli, ["merge", *map(str, files), "-o", str(out), "--buffers", "rank0", *extra])
    assert result.exit_code == 0, result.output
    return result.output, torch.load(out, weights_only=True)


@pytest.mark.parametrize("kind", ["local", "sharded", "train", "fsdp2"])
def test_rank_files_given_out_of_order_are_taken_as_the_ranks_they_record(
    run: Path, fsdp1_runs: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """``--buffers rank0`` keeps the statistics of the file saved by rank 0, and the other entries come from it,
    whatever order the files are given in: the files record their rank (FSDP1) or mesh coordinate (FSDP2)."""
    folder = {"local": fsdp1_runs["orig"], "fsdp2": run}.get(kind, fsdp1_runs["adamw"])
    name = {"fsdp2": "rank"}.get(kind, kind)
    files = [folder / f"{name}{r}.pt" for r in range(sharded_writers.WORLD)]
    extra = ["--model", "tests.models:SmallNet", "--kwargs", '{"width": 5}'] if kind == "local" else []
    if kind == "train":  # rank 1's file says so in its other entries too: they must come from rank 0's
        state = _load_kept(files[1])
        state["epoch"] = 2
        files[1] = tmp_path / "train1.pt"
        torch.save(state, files[1])
    text, in_order = _merged_rank0(files, tmp_path / "in_order.pt", *extra)
    assert "not in the order given" not in text
    text, reversed_ = _merged_rank0(files[::-1], tmp_path / "reversed.pt", *extra)
    assert f"took the rank files as the ranks they record (rank 0: {files[0]}), not in the order given" in text
    assert list(reversed_) == list(in_order)
    for got, want in [(reversed_, in_order), (reversed_.get("model", {}), in_order.get("model", {}))]:
        for key, value in want.items():
            assert torch.equal(got[key], value) if torch.is_tensor(value) else isinstance(value, dict) or \
                got[key] == value, key  # fmt: skip
    full = torch.load(folder / "full.pt", weights_only=True)  # rank 0's FULL_STATE_DICT: rank 0's statistics
    model = full["model"] if kind == "fsdp2" else full
    merged = in_order["model"] if kind == "train" else in_order
    stats = [k for k in model if "running" in k]
    assert stats and all(torch.equal(merged[k], model[k]) for k in stats)
    if kind == "train":
        assert in_order["epoch"] == 1 and f"taken from {files[0]}: epoch" in text
