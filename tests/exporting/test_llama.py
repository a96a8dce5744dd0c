"""``convert SRC OUT/ --format hf --config-from DIR`` of torchtune and torchtitan Llama checkpoints
(ckptfix/exporting/llama.py): each saved by the trainer's own writer (``tests/llama_family_runs.py``), exported to a
folder transformers loads with no missing or unexpected key, whose tensors are ``torch.equal`` to what the trainer's
own converter makes of them (torchtune's ``tune_to_hf``, torchtitan's ``Llama3StateDictAdapter.to_hf``:
``NAME.expected.safetensors``) and whose logits equal the source model's forward (``NAME.logits.safetensors``);
and the refusals: no config, a config whose heads do not fit, a mixture of layouts, a model that is no Llama."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

from ckptfix.cli import cli
from ckptfix.errors import MismatchError
from ckptfix.exporting.llama import META, TORCHTITAN, TORCHTUNE, head_spans, layout_of
from ckptfix.stream.rows import take_rows
from tests.extras import TITAN_VENV, needs

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "llama_family"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
RUNS = sorted(MANIFEST["runs"])
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason=needs("transformers"))


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def source(name: str, where: Path = FIXTURES, manifest: dict[str, Any] = MANIFEST) -> Path:
    return where / manifest["runs"][name]["source"]


def config(name: str, where: Path = FIXTURES, manifest: dict[str, Any] = MANIFEST) -> Path:
    """The folder of the run's transformers config.json (``--config-from``)."""
    return where / manifest["runs"][name]["config"]


def digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


def test_fixtures_are_the_trainers_own() -> None:
    assert set(RUNS) == {"tune_tied", "titan"}
    assert MANIFEST["runs"]["tune_tied"]["writer"].startswith("torchtune FullModelTorchTuneCheckpointer")
    assert MANIFEST["runs"]["titan"]["converter"] == "Llama3StateDictAdapter.to_hf"
    assert (source("titan") / ".metadata").is_file()
    # as tests/test_fixtures.py counts fixtures/ (folders too), so that they leave room under its 2 MB
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*")) + FIXTURES.stat().st_size < 60_000


@needs_transformers
@pytest.mark.parametrize("name", RUNS)
def test_export_equals_the_trainers_converter_and_gives_the_source_logits(name: str, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    before = digest(source(name))
    out = tmp_path / "hf"
    result = run("convert", source(name), out, "--format", "hf", "--config-from", config(name), "-v")
    assert result.exit_code == 0, result.output
    assert "path: stream" in result.output
    assert "names mapped to transformers' Llama names" in result.output
    got, want = load_file(str(out / "model.safetensors")), load_file(str(FIXTURES / f"{name}.expected.safetensors"))
    assert set(got) == set(want)
    assert f"{len(want)} tensors, {len(want)} copied as byte ranges, 0 gathered in memory" in result.output
    renamed = len(want) - (name == "titan")  # torchtitan 0.3 calls the output projection lm_head.weight too
    trainer = {"titan": "torchtitan", "tune_tied": "torchtune"}[name]
    assert f"state dict: {trainer} -> transformers keys, {len(want)} keys ({renamed} renamed)" in result.output
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32,
                                                   local_files_only=True)  # fmt: skip
    assert {k: v for k, v in info.items() if v} == {}
    ref = load_file(str(FIXTURES / f"{name}.logits.safetensors"))
    with torch.no_grad():
        logits = model.eval()(input_ids=ref["input_ids"]).logits
    # float32 kernels of two implementations (the trainer's attention and rotary tables, transformers') differ in
    # the last bits: torchtitan's equal exactly here, torchtune's within 5e-7
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    assert digest(source(name)) == before  # the input is never changed

    slow = tmp_path / "torch"
    result = run("convert", source(name), slow, "--format", "hf", "--config-from", config(name), "-v",
                 "--no-fast")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "path: torch" in result.output
    assert (slow / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@needs_transformers
def test_tied_output_is_left_out_as_transformers_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run("convert", source("tune_tied"), out, "--format", "hf", "--config-from", config("tune_tied"))
    assert result.exit_code == 0, result.output
    assert "left out 'lm_head.weight': the config ties it to 'model.embed_tokens.weight'" in result.output
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


@needs_transformers
def test_verify_loads_the_folder_and_compares_logits(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run("convert", source("titan"), out, "--format", "hf", "--config-from", config("titan"),
                 "--verify")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (
        "verified: from_pretrained loads every key, logits equal the source's (largest difference 0)" in result.output
    )


@needs_transformers
def test_reordered_rows_cast_and_shard_as_they_stream(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    cast = tmp_path / "bf16"
    result = run("convert", source("titan"), cast, "--format", "hf", "--dtype", "bf16", "-v")
    assert result.exit_code == 0, result.output
    assert "12 cast to bfloat16 a block at a time" in result.output and "path: stream" in result.output
    got, want = load_file(str(cast / "model.safetensors")), load_file(str(FIXTURES / "titan.expected.safetensors"))
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value.to(torch.bfloat16)), key
    shards = tmp_path / "shards"
    result = run("convert", source("tune_tied"), shards, "--format", "hf", "--config-from", config("tune_tied"),
                 "--shard-size", "1kB", "-v")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 shards and their index" in result.output and "path: stream" in result.output
    model, info = LlamaForCausalLM.from_pretrained(shards, output_loading_info=True, local_files_only=True)
    assert {k: v for k, v in info.items() if v} == {}
    loaded = model.state_dict()
    for key, value in load_file(str(FIXTURES / "tune_tied.expected.safetensors")).items():
        assert torch.equal(loaded[key], value), key


def refused(tmp_path: Path, src: Path, *args: Any) -> str:
    out = tmp_path / "hf"
    result = run("convert", src, out, "--format", "hf", *args)
    assert result.exit_code != 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".ckptfix" in p.name]  # no temporary folder left behind
    return lines[0]


@needs_transformers
def test_without_a_config_is_refused_saying_config_from(tmp_path: Path) -> None:
    line = refused(tmp_path, source("tune_tied"))
    assert "config.json" in line and "--config-from" in line


@needs_transformers
@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("tune_tied", "layers.0.attn.q_proj.weight"),
        ("titan", "layers.0.attention.qkv_linear.wq.weight"),
    ],
)
def test_a_config_whose_heads_do_not_fit_is_refused_by_key(name: str, key: str, tmp_path: Path) -> None:
    wrong = json.loads((config(name) / "config.json").read_text())
    wrong.update(num_attention_heads=4, head_dim=4)  # 16 query rows; the model has 2 heads of 4
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(wrong))
    line = refused(tmp_path, source(name), "--config-from", tmp_path / "cfg")
    assert f"'{key}' is [8, 8], not [16, 8] (4 query heads of 4, hidden size 8" in line
    assert "--config-from" in line


@needs_transformers
def test_a_tied_checkpoint_with_an_untied_config_is_refused(tmp_path: Path) -> None:
    line = refused(tmp_path, source("tune_tied"), "--config-from", config("titan"))  # titan's is untied
    assert "has no output projection ('output.weight')" in line and '"tie_word_embeddings": true' in line


@needs_transformers
def test_an_output_projection_of_its_own_under_a_tied_config_is_refused(tmp_path: Path) -> None:
    """torchtitan's own lm_head.weight, and a torchtune file with its own output.weight, under the tied config:
    from_pretrained would drop the projection and give other logits."""
    before = digest(source("titan"))
    tied = tmp_path / "tied"
    tied.mkdir()
    titan = json.loads((config("titan") / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**titan, "tie_word_embeddings": True}))
    line = refused(tmp_path, source("titan"), "--config-from", tied)
    assert f"{source('titan')}: holds 'lm_head.weight' apart from 'model.embed_tokens.weight', with other values" in (
        line
    )
    assert "ties them (from_pretrained would use 'model.embed_tokens.weight' for both)" in line
    assert '"tie_word_embeddings": false' in line and "--config-from" in line
    assert digest(source("titan")) == before
    state = torch.load(source("tune_tied"), weights_only=True)  # as FullModelTorchTuneCheckpointer saves it
    state["output.weight"] = torch.randn_like(state["tok_embeddings.weight"])  # an untied llama3 model's
    torch.save(state, tmp_path / "tune.bin")
    line = refused(tmp_path, tmp_path / "tune.bin", "--config-from", tied)
    assert "holds 'lm_head.weight' apart from 'model.embed_tokens.weight', with other values" in line


@needs_transformers
def test_an_output_projection_stored_apart_with_the_same_bits_is_left_out(tmp_path: Path) -> None:
    state = torch.load(source("tune_tied"), weights_only=True)
    state["output.weight"] = state["tok_embeddings.weight"].clone()  # tied in value, stored apart
    torch.save(state, tmp_path / "tune.bin")
    out = tmp_path / "hf"
    result = run("convert", tmp_path / "tune.bin", out, "--format", "hf", "--config-from", config("tune_tied"),
                 "--verify", "-v")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "path: stream" in result.output  # the two tensors compared, the rest copied as byte ranges
    assert f"from_pretrained ties it back (stored apart in {tmp_path / 'tune.bin'}, equal bit for bit)" in result.output
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))


@needs_transformers
def test_a_mixture_of_layouts_is_refused_naming_the_key(tmp_path: Path) -> None:
    state = torch.load(source("tune_tied"), weights_only=True)  # torchtune's file, one key in torchtitan's name
    state["layers.0.attention.wo.weight"] = state.pop("layers.0.attn.output_proj.weight")
    mixed = tmp_path / "mixed.pt"
    torch.save(state, mixed)
    line = refused(tmp_path, mixed, "--config-from", config("tune_tied"))
    assert "'layers.0.attention.wo.weight' is not a torchtune Llama name, though 'tok_embeddings.weight' is" in line


@needs_transformers
def test_a_config_of_another_model_is_refused(tmp_path: Path) -> None:
    other = json.loads((config("tune_tied") / "config.json").read_text())
    other.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(other))
    line = refused(tmp_path, source("tune_tied"), "--config-from", tmp_path / "cfg")
    assert "holds torchtune Llama names, but config.json describes model_type 'qwen2'" in line


@pytest.mark.parametrize(("heads", "head_dim", "dim"), [(2, 4, 8), (1, 8, 8), (4, 2, 8), (3, 6, 5), (8, 16, 4)])
def test_head_spans_are_the_converters_permute(heads: int, head_dim: int, dim: int) -> None:
    w = torch.randn(heads * head_dim, dim)
    # torchtune's tune_to_hf _permute and torchtitan's to_hf _permute, both
    permuted = w.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)
    assert torch.equal(take_rows(w, head_spans(heads, head_dim)), permuted)


def test_layouts_are_told_by_their_names() -> None:
    hf = load_file(str(FIXTURES / "titan.expected.safetensors"))  # transformers' names: none of ours
    assert layout_of(hf, source="x") is None
    assert layout_of([k.removeprefix("model.") for k in hf if k.startswith("model.")], source="x") is None
    meta = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight", "output.weight", "freqs_cis"]
    assert layout_of(meta, source="x") is META
    state = torch.load(source("tune_tied"), weights_only=True)
    assert layout_of(state, source="x") is TORCHTUNE
    titan = ["tok_embeddings.weight", "norm.weight", "lm_head.weight", "layers.3.attention.qkv_linear.wk.weight"]
    assert layout_of(titan, source="x") is TORCHTITAN
    with pytest.raises(MismatchError, match=r"'layers\.0\.feed_forward\.w1\.weight' is not a torchtune Llama name"):
        layout_of([*state, "layers.0.feed_forward.w1.weight"], source="x")


@needs_transformers
def test_a_config_in_the_source_folder_is_found(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run("convert", source("titan"), out, "--format", "hf")
    assert result.exit_code == 0, result.output
    assert f"copied from {source('titan')}: config.json" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("name", ["meta", "tune", "titan_full"])
def test_runs_made_fresh(name: str, tmp_path: Path) -> None:
    """The runs too large for fixtures/: Meta's names (torchtune's FullModelMetaCheckpointer: those of torchtitan
    before 0.3), torchtune's untied model, and a torchtitan save at an interval (the optimizer, lr_scheduler,
    train_state and dataloader beside the model's tensors, as torchtitan flattens them); made here where torchtune
    and torchtitan import (``PYTHONPATH=. tune-venv/bin/python -m pytest -m slow tests/exporting/test_llama.py``)."""
    pytest.importorskip("torchtitan", reason=needs("torchtune and torchtitan", TITAN_VENV))
    pytest.importorskip("transformers", reason=needs("transformers"))
    from transformers import LlamaForCausalLM

    from tests.llama_family_runs import main

    main([str(tmp_path), "--only", name])
    made = json.loads((tmp_path / "MANIFEST.json").read_text())
    out = tmp_path / "hf"
    src, cfg = source(name, tmp_path, made), config(name, tmp_path, made)
    result = run("convert", src, out, "--format", "hf", "--config-from", cfg, "-v")
    assert result.exit_code == 0, result.output
    assert "path: stream" in result.output
    layout = {"meta": "Meta", "tune": "torchtune", "titan_full": "torchtitan"}[name]
    assert f"state dict: {layout} -> transformers keys" in result.output
    if name == "titan_full":
        assert "left out the training state beside the model: dataloader, lr_scheduler, optimizer, train_state" in (
            result.output
        )
    got, want = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / f"{name}.expected.safetensors"))
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    ref = load_file(str(tmp_path / f"{name}.logits.safetensors"))
    with torch.no_grad():
        logits = model.eval()(input_ids=ref["input_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)  # as above: two implementations
