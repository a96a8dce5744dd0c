"""Folder checkpoints: transformers shards with an index, accelerate save_state folders, and their refusals."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError, OutputError
from ckptfix.formats.hf.folder import parse_size, plan_shards
from tests.assertions import assert_same
from tests.extras import needs
from tests.models import SmallNet, make_net


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return SmallNet().state_dict()


def _sharded(tmp_path: Path, name: str = "model.safetensors", *, limit: int = 200) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    ckptfix.save(_state(), folder / name, shard_size=limit)
    return folder


def _index(folder: Path) -> tuple[Path, dict[str, Any]]:
    (path,) = folder.glob("*.index.json")
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_shards_read_back_as_the_state_dict_they_were_written_from(tmp_path: Path, name: str) -> None:
    folder = _sharded(tmp_path, name)
    stem, ext = name.split(".")
    index_path, index = _index(folder)
    shards = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".json"))
    assert index_path.name == f"{name}.index.json"
    assert len(shards) > 2 and shards[0] == f"{stem}-00001-of-{len(shards):05d}.{ext}"
    assert set(index["weight_map"].values()) == set(shards)
    state = _state()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for path in (folder, index_path):
        back = ckptfix.load(path)
        assert list(back) == list(state)  # the original key order, shard after shard
        assert_same(back, state)
        assert back._metadata == state._metadata  # type: ignore[attr-defined]


def test_every_shard_is_at_most_the_limit_unless_one_tensor_is_larger() -> None:
    sizes = [("a", 600, None), ("b", 600, None), ("big", 5000, None), ("c", 100, None), ("tied", 600, "s"),
             ("d", 500, None), ("tied2", 600, "s")]  # fmt: skip
    assert plan_shards(sizes, limit=1000) == [["a"], ["b"], ["big"], ["c", "tied", "tied2"], ["d"]]


def test_tied_weights_share_one_shard_and_come_back_tied(tmp_path: Path) -> None:
    state = _state()
    state["tied.weight"] = state["features.0.weight"]
    ckptfix.save(state, tmp_path / "model.safetensors", shard_size=200)
    back = ckptfix.load(tmp_path)
    assert back["tied.weight"].data_ptr() == back["features.0.weight"].data_ptr()
    assert set(back) == set(state)  # a tied key comes back in its shard, beside the tensor it shares
    assert all(torch.equal(back[k], t) for k, t in state.items())


def test_one_shard_is_written_as_the_plain_file_without_an_index(tmp_path: Path) -> None:
    ckptfix.save(_state(), tmp_path / "model.safetensors", shard_size=10**9)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert_same(ckptfix.load(tmp_path), _state())


@pytest.mark.parametrize(
    ("text", "size"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 << 30), ("1000", 1000), ("1.5kb", 1500)]
)
def test_shard_sizes_are_read_as_transformers_writes_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "5 GBs", "-1GB", "0", "lots"])
def test_a_shard_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(OutputError, match="not a size; write it like 5GB"):
        parse_size(text)


def test_shards_are_not_written_over_another_checkpoints_shards(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(OutputError, match="already exists; write the shards to a new or empty folder"):
        ckptfix.save(_state(), folder / "model.safetensors", shard_size=200)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_failed_write_leaves_no_shard_and_no_temp_folder(tmp_path: Path) -> None:
    state = _state()
    state["bad"] = torch.zeros(2, dtype=torch.complex32)  # safetensors cannot store it: the last shard fails
    with pytest.raises(OutputError, match="'bad'"):
        ckptfix.save(state, tmp_path / "model.safetensors", shard_size=200)
    assert os.listdir(tmp_path) == []


# -- hostile folders -----------------------------------------------------------------------------------------


def _rewrite(folder: Path, edit: Any) -> Path:
    path, index = _index(folder)
    edit(index["weight_map"])
    path.write_text(json.dumps(index))
    return path


def _first_shard(folder: Path) -> str:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".json"))[0]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("../outside.safetensors", "a path outside the folder"),
        ("/etc/passwd", "a path outside the folder"),
        ("sub/../model-00001-of-00004.safetensors", "a path outside the folder"),
        ("model-00009-of-00009.safetensors", "which is missing; download the whole folder again"),
    ],
)
def test_an_index_naming_a_file_it_must_not_is_refused(tmp_path: Path, target: str, message: str) -> None:
    folder = _sharded(tmp_path)
    _rewrite(folder, lambda wm: wm.update({"head.bias": target}))
    with pytest.raises(FormatError, match=f"key 'head.bias' names shard '{target}', {message}"):
        ckptfix.load(folder)


def test_a_shard_linked_to_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    shard = _first_shard(folder)
    (tmp_path / "elsewhere.safetensors").write_bytes((folder / shard).read_bytes())
    (folder / shard).unlink()
    (folder / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(FormatError, match=f"names shard '{shard}', a link to outside the folder"):
        ckptfix.load(folder)


def test_two_shards_claiming_one_key_are_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    _rewrite(folder, lambda wm: wm.update({"features.1.bias": "model-00004-of-00004.safetensors"}))
    with pytest.raises(FormatError, match=r"holds key 'features.1.bias', which the index puts in model-00004"):
        ckptfix.load(folder)


def test_a_shard_key_the_index_does_not_list_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    _rewrite(folder, lambda wm: wm.pop("features.1.bias"))
    with pytest.raises(FormatError, match=r"holds key 'features.1.bias', which the index .* does not list"):
        ckptfix.load(folder)


def test_an_index_key_missing_from_its_shard_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    _rewrite(folder, lambda wm: wm.update({"ghost.weight": _first_shard(folder)}))
    with pytest.raises(FormatError, match=r"key 'ghost.weight' is listed in model-00001-of-00004.safetensors but not"):
        ckptfix.load(folder)


def test_an_index_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    path, _ = _index(folder)
    text = path.read_text().replace('"weight_map": {', '"weight_map": {"a": "x.safetensors", "a": "y.safetensors", ')
    path.write_text(text)
    with pytest.raises(FormatError, match="key 'a' appears twice in the index"):
        ckptfix.load(path)


def test_two_index_files_are_ambiguous(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    ckptfix.save(_state(), folder / "pytorch_model.bin", shard_size=200)
    with pytest.raises(FormatError, match=r"holds 2 index files .*; pass the one to read"):
        ckptfix.load(folder)
    assert_same(ckptfix.load(folder / "pytorch_model.bin.index.json"), _state())


def test_a_folder_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FormatError, match="no checkpoint here"):
        ckptfix.load(tmp_path)


def test_a_json_file_that_is_not_an_index_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(FormatError, match="has no 'weight_map'"):
        ckptfix.load(tmp_path / "config.json")


def test_a_damaged_shard_is_named(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    shard = folder / _first_shard(folder)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FormatError, match=str(shard)):
        ckptfix.load(folder)


# -- accelerate folders ----------------------------------------------------------------------------------------


def test_an_accelerate_save_state_folder_loads_as_a_checkpoint(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate", reason=needs("accelerate"))
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = accelerate.Accelerator(cpu=True)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    optimizer.step()
    acc.save_state(str(tmp_path / "state"))
    ckpt = ckptfix.load(tmp_path / "state", model_only=True)
    assert list(ckpt) == ["model"]
    expected = model.state_dict()
    assert set(ckpt["model"]) == set(expected)  # safetensors' own writer orders tensors by dtype, then name
    assert all(torch.equal(ckpt["model"][k], t) for k, t in expected.items())


# -- transformers ----------------------------------------------------------------------------------------------


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("safe", [True, False])
def test_transformers_shards_load_as_the_model_saved_them(tmp_path: Path, safe: bool) -> None:
    model = _gpt2()
    model.save_pretrained(tmp_path, max_shard_size="20KB", safe_serialization=safe)
    back = ckptfix.load(tmp_path)
    expected = model.state_dict()
    # transformers leaves out the tied lm_head.weight (it is transformer.wte.weight) on purpose
    assert set(back) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(back[k], expected[k]) for k in back)


def test_our_shards_load_in_transformers_and_accelerate(tmp_path: Path) -> None:
    model = _gpt2()
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    accelerate = pytest.importorskip("accelerate", reason=needs("accelerate"))
    model.config.save_pretrained(tmp_path)
    ckptfix.save(model.state_dict(), tmp_path / "model.safetensors", shard_size=20_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    fresh = transformers.GPT2LMHeadModel(model.config)
    accelerate.load_checkpoint_in_model(fresh, str(tmp_path / "model.safetensors.index.json"))
    assert all(torch.equal(fresh.state_dict()[k], t) for k, t in model.state_dict().items())


# -- streaming shards into one file ------------------------------------------------------------------------------


def _stream(folder: Path, out: Path) -> Any:
    from ckptfix.conversion.files import ConvertOptions
    from ckptfix.stream.folders import convert_folder

    options = ConvertOptions()
    return convert_folder(str(folder), str(out), transform=lambda tree: options.apply(tree, source=str(folder)))


def test_shards_stream_into_one_file_byte_range_by_byte_range(tmp_path: Path) -> None:
    state = _state()
    state["tied.weight"] = state["features.0.weight"]
    (tmp_path / "ckpt").mkdir()
    ckptfix.save(state, tmp_path / "ckpt" / "model.safetensors", shard_size=200)
    result = _stream(tmp_path / "ckpt", tmp_path / "one.safetensors")
    assert result.notes[-1] == "shards -> safetensors: 16 tensors, 16 copied as byte ranges, 0 gathered in memory"
    back = ckptfix.load(tmp_path / "one.safetensors")
    assert back["tied.weight"].data_ptr() == back["features.0.weight"].data_ptr()  # still stored once
    assert back._metadata == state._metadata  # type: ignore[attr-defined]
    assert all(torch.equal(back[k], t) for k, t in state.items()) and set(back) == set(state)


def test_torch_shards_take_the_torch_path(tmp_path: Path) -> None:
    from ckptfix.stream.fallback import Fallback

    folder = _sharded(tmp_path, "pytorch_model.bin")
    with pytest.raises(Fallback, match="is a torch file"):
        _stream(folder, tmp_path / "one.safetensors")


# -- the CLI ---------------------------------------------------------------------------------------------------


def _cli(*args: str) -> Any:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    return CliRunner().invoke(cli, list(args))


def test_convert_writes_shards_into_a_new_folder_and_reads_them_back(tmp_path: Path) -> None:
    ckptfix.save({"model": _state(), "epoch": 3}, tmp_path / "run.pt")
    made = _cli("convert", str(tmp_path / "run.pt"), f"{tmp_path / 'hf'}/", "--shard-size", "0.2kB", "--model-only")
    assert made.exit_code == 0, made.output
    assert len(list((tmp_path / "hf").glob("model-*-of-00004.safetensors"))) == 4
    back = _cli("convert", str(tmp_path / "hf"), str(tmp_path / "one.safetensors"), "-v")
    assert back.exit_code == 0, back.output
    assert "path: stream; shards -> safetensors: 16 tensors, 16 copied as byte ranges" in back.output
    assert_same(ckptfix.load(tmp_path / "one.safetensors"), _state())


def test_convert_refuses_a_damaged_folder_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    folder = _sharded(tmp_path)
    _rewrite(folder, lambda wm: wm.update({"head.bias": "../evil.safetensors"}))
    result = _cli("convert", str(folder), str(tmp_path / "out.safetensors"))
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "a path outside the folder" in result.output
    assert not (tmp_path / "out.safetensors").exists()


def test_an_accelerate_folder_converts_with_model_only(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate", reason=needs("accelerate"))
    model = SmallNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = accelerate.Accelerator(cpu=True)
    model, optimizer = acc.prepare(model, optimizer)
    acc.save_state(str(tmp_path / "state"))
    refused = _cli("convert", str(tmp_path / "state"), str(tmp_path / "m.pt"))
    assert refused.exit_code == 2 and "--model-only to leave the folder's training state unread" in refused.output
    done = _cli("convert", str(tmp_path / "state"), str(tmp_path / "m.pt"), "--model-only")
    assert done.exit_code == 0, done.output
    back = ckptfix.load(tmp_path / "m.pt")  # --model-only: the model's state dict itself
    assert set(back) == set(model.state_dict())
    assert all(torch.equal(back[k], t) for k, t in model.state_dict().items())


# Folders used carelessly or crafted: files that are not regular files are never opened, names that cannot be paths
# are refused by name, in one line with exit 2 and within seconds.


def _sharded_net(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    ckptfix.save(make_net().state_dict(), folder / "model.safetensors", shard_size=600)
    return folder


def _convert(*args: object) -> tuple[int, str, float]:
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["convert", *map(str, args)])
    return result.exit_code, result.output.strip(), time.perf_counter() - started


def test_a_fifo_named_like_an_index_is_never_opened(tmp_path: Path) -> None:
    folder = _sharded_net(tmp_path)
    os.mkfifo(folder / "stray.index.json")  # opening it for reading would wait for a writer forever
    code, output, seconds = _convert(folder, tmp_path / "out.pt")
    assert code == 0, output
    assert seconds < 30
    code, output, _ = _convert(folder / "stray.index.json", tmp_path / "out2.pt")
    assert code == 2 and "\n" not in output and "stray.index.json" in output, output


def test_a_shard_that_is_a_fifo_is_refused_by_name(tmp_path: Path) -> None:
    folder = _sharded_net(tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    code, output, seconds = _convert(folder, tmp_path / "out.pt")
    assert code == 2 and "\n" not in output and "not a regular file" in output and shard.name in output, output
    assert seconds < 30 and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("name", ["model\u0000.safetensors", "model-\ud800.safetensors"], ids=["nul", "surrogate"])
def test_a_shard_name_that_cannot_be_a_path_is_refused_by_name(tmp_path: Path, name: str) -> None:
    folder = _sharded_net(tmp_path)
    (index,) = folder.glob("*.index.json")
    data = json.loads(index.read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = name
    index.write_text(json.dumps(data))  # json escapes both: \u0000, \ud800
    for command in (["convert", str(folder), str(tmp_path / "out.pt")], ["inspect", str(folder)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2, result.output
        assert "a name no file can have" in result.output and key in result.output
        assert result.output.count("\n") == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, "not a JSON index"), ('{"weight_map": [1, 2]}', "has no 'weight_map' dict; the index is damaged")],
    ids=["truncated", "weight-map-not-a-dict"],
)
def test_a_damaged_index_is_named_not_called_missing(tmp_path: Path, text: str | None, message: str) -> None:
    folder = _sharded_net(tmp_path)
    (index,) = folder.glob("*.index.json")
    index.write_text(index.read_text()[:-5] if text is None else text)
    result = CliRunner().invoke(cli, ["inspect", str(folder)])
    assert result.exit_code == 2 and message in result.output and index.name in result.output, result.output


def test_an_accelerate_fsdp_folder_names_its_model_folder(tmp_path: Path) -> None:
    """accelerate's save_state under FSDP (SHARDED_STATE_DICT) keeps the model as a DCP folder beside the optimizer's:
    the folder itself is refused naming it, and that one converts (tests/exporting/test_folder.py: from a real 2-rank
    run)."""
    from ckptfix.torchcompat import dcp_save_local

    run = tmp_path / "checkpoint"
    state = make_net().state_dict()
    dcp_save_local({"model": state}, checkpoint_id=str(run / "pytorch_model_fsdp_0"))  # as save_fsdp_model saves
    dcp_save_local({"optimizer": {"state": {}, "param_groups": []}}, checkpoint_id=str(run / "optimizer_0"))
    for args in (["inspect", str(run)], ["convert", str(run), str(tmp_path / "out.pt")]):
        done = CliRunner().invoke(cli, args)
        assert done.exit_code == 2, done.output
        assert (
            f"accelerate's save_state of an FSDP run: its model is the DCP folder {run / 'pytorch_model_fsdp_0'}/"
            in (done.output)
        )
    assert not (tmp_path / "out.pt").exists()
    done = CliRunner().invoke(cli, ["convert", str(run / "pytorch_model_fsdp_0"), str(tmp_path / "out.pt")])
    assert done.exit_code == 0, done.output
    back = torch.load(tmp_path / "out.pt", weights_only=True)["model"]  # DCP keeps no OrderedDict
    assert list(back) == list(state) and all(torch.equal(back[k], v) for k, v in state.items())
