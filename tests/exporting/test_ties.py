"""ckptfix.exporting.ties: a transformers folder into a .pt gets back the tied copies save_pretrained leaves out, as one
storage, so that a training job's strict load (DDP's) takes it; where the tie cannot be proven, the output says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckptfix.cli import cli
from ckptfix.exporting.ties import TIES_NOT_RESTORED, TIES_RESTORED
from tests.extras import needs

IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def _gpt2(folder: Path, *, shard: str = "20KB") -> Any:
    """A tiny GPT-2 (``lm_head.weight`` is ``transformer.wte.weight``) saved by save_pretrained into ``folder``,
    in shards of ``shard``."""
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder, max_shard_size=shard)
    return model


def _convert(*args: str | Path) -> Any:
    result = CliRunner().invoke(cli, ["convert", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize("route", ["stream", "torch", "model-file"])
def test_a_tied_gpt2_folder_into_a_pt_loads_strictly_into_ddp(tmp_path: Path, gloo_world: None, route: str) -> None:
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    model = _gpt2(tmp_path / "hf", shard="20KB" if route != "model-file" else "1GB")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    src = tmp_path / "hf" / "model.safetensors" if route == "model-file" else tmp_path / "hf"
    if route != "model-file":  # what save_pretrained writes: the tied copy left out
        assert "lm_head.weight" not in json.loads(index.read_text())["weight_map"]
    out = tmp_path / "ddp.pt"
    result = _convert(src, out, "--to", "ddp", *(["--no-fast"] if route == "torch" else []))
    assert f"ckptfix: {TIES_RESTORED}: 'lm_head.weight' = 'transformer.wte.weight'" in result.output
    state = torch.load(out, weights_only=True)
    head, wte = state["module.lm_head.weight"], state["module.transformer.wte.weight"]
    assert head.untyped_storage().data_ptr() == wte.untyped_storage().data_ptr()  # one storage, as torch.save writes
    ddp = torch.nn.parallel.DistributedDataParallel(transformers.GPT2LMHeadModel(model.config).eval())
    ddp.load_state_dict(state, strict=True)
    assert set(state) == set(ddp.state_dict())
    with torch.no_grad():
        assert torch.equal(ddp(IDS).logits, model(IDS).logits)


def test_without_transformers_the_output_says_the_tied_copies_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpt2(tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    result = _convert(tmp_path / "hf", tmp_path / "out.pt")
    assert f"ckptfix: {TIES_NOT_RESTORED}: transformers, which reads which weights " in result.output
    assert "pip install 'ckptfix[hf]'" in result.output
    assert "lm_head.weight" not in torch.load(tmp_path / "out.pt", weights_only=True)


def test_a_config_that_cannot_be_built_is_said_and_nothing_guessed(tmp_path: Path) -> None:
    _gpt2(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = _convert(tmp_path / "hf", tmp_path / "out.pt")
    assert f"ckptfix: {TIES_NOT_RESTORED}: the model of {tmp_path / 'hf' / 'config.json'} cannot be built" in (
        result.output
    )
    assert "lm_head.weight" not in torch.load(tmp_path / "out.pt", weights_only=True)


def test_an_untied_config_restores_nothing(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason=needs("transformers"))
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                     tie_word_embeddings=False)  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    result = _convert(tmp_path / "hf", tmp_path / "out.pt")
    assert "tied copies" not in result.output
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert state["lm_head.weight"].untyped_storage().data_ptr() != state["transformer.wte.weight"].data_ptr()
