"""``ckptfix convert SRC OUT/ --format hf``: a folder that transformers' ``from_pretrained`` loads, from what training
writes. Small Llama, Qwen2, GPT-2 (tied), BERT and Mixtral (mixture of experts) models, built offline from their
configs, trained two AdamW steps, then saved by the real writers: ``save_pretrained``, ``torch.save`` of a
``DistributedDataParallel`` or ``nn.DataParallel`` state dict in a full checkpoint, DCP of ``get_state_dict``
(model and optimizer), a ``torch.compile``'d model's state dict, accelerate's ``save_state``, a Lightning
``Trainer.fit`` checkpoint, HF Trainer's, and (slow) FSDP1, FSDP2 and DeepSpeed ZeRO-3 runs on 2 gloo ranks. Each
export loads with ``from_pretrained(output_loading_info=True)`` reporting no missing, unexpected or mismatched key,
and its logits are ``torch.equal`` to the trained model's (fp32; bf16 runs compared in bf16). Skipped, saying why,
without transformers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from tests.extras import DEEPSPEED, needs
from tests.hf_runs import IDS, train

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason=needs("transformers"),
)


def keys_of(f: Any) -> list[str]:
    return list(f.keys())


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _config(name: str, **sizes: int) -> Any:
    import transformers as tf

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 2, **sizes}  # fmt: skip
    if name == "llama":
        return tf.LlamaConfig(**small, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    if name == "qwen2":
        return tf.Qwen2Config(**small, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                             eos_token_id=0, architectures=["GPT2LMHeadModel"])  # fmt: skip
    if name == "bert":
        return tf.BertConfig(**small, max_position_embeddings=32, architectures=["BertModel"])
    return tf.MixtralConfig(**small, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                            architectures=["MixtralForCausalLM"])  # fmt: skip


MODELS = ["llama", "qwen2", "gpt2", "bert", "mixtral"]


def _trained(name: str, **sizes: int) -> Any:
    """The model of ``name``'s config after two AdamW steps (a causal LM on its own input; BERT on its mean output)."""
    import transformers as tf

    torch.manual_seed(0)
    config = _config(name, **sizes)
    model = getattr(tf, config.architectures[0])(config)
    opt = train(model)
    return model.eval(), opt


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(scope="module", params=MODELS)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gloo_world: None) -> dict[str, Any]:
    """One trained model and what each writer made of it: {"model", "logits", "hf", "ddp", "dp", "dcp", "compiled",
    "accelerate"} (``ddp``: a real ``DistributedDataParallel`` on a one-process gloo group; ``dp``: DataParallel)."""
    from ckptfix.torchcompat import dcp_save_local

    name = request.param
    root = tmp_path_factory.mktemp(name)
    model, opt = _trained(name)
    model.save_pretrained(root / "hf")  # config.json, generation_config.json, model.safetensors
    run_dir = root / "run"  # a training run's folder: the config beside the weights, as HF Trainer leaves it
    run_dir.mkdir()
    (run_dir / "config.json").write_bytes((root / "hf" / "config.json").read_bytes())
    torch.save({"model": torch.nn.parallel.DistributedDataParallel(model).state_dict(), "epoch": 1}, run_dir / "ddp.pt")
    torch.save({"model": torch.nn.DataParallel(model).state_dict(), "epoch": 1}, run_dir / "dp.pt")
    model.cpu()  # DataParallel moves the model to the first GPU where there is one
    torch.save(torch.compile(model).state_dict(), run_dir / "compiled.pt")
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp_save_local({"model": msd, "optim": osd}, checkpoint_id=str(run_dir / "dcp"))
    import accelerate

    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(model, opt)  # registered for save_state (on the CPU the same objects)
    acc.save_state(str(run_dir / "accelerate"))  # model.safetensors, optimizer.bin, random states: config in run/
    return {"name": name, "model": model, "logits": _logits(model), "root": root, "hf": root / "hf",
            "ddp": run_dir / "ddp.pt", "dp": run_dir / "dp.pt", "compiled": run_dir / "compiled.pt",
            "dcp": run_dir / "dcp", "accelerate": run_dir / "accelerate"}  # fmt: skip


def _loads_equal(out: Path, saved: dict[str, Any]) -> Any:
    import transformers as tf

    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    loaded, info = getattr(tf, arch).from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert torch.equal(_logits(loaded), saved["logits"])
    return loaded


@pytest.mark.parametrize("source", ["hf", "ddp", "dp", "compiled", "dcp", "accelerate"])
def test_every_writer_exports_a_folder_from_pretrained_loads_equal(
    saved: dict[str, Any], source: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run("convert", saved[source], f"{out}/", "--format", "hf")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1].startswith(f"wrote {out}/ (transformers folder: model.safetensors")
    _loads_equal(out, saved)
    if saved["name"] == "gpt2" and source not in ("hf", "accelerate"):  # their writers leave the tied copy out
        assert "left out 'lm_head.weight': the config ties it to 'transformer.wte.weight'" in result.output
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
        keys = set(f.keys())
    if saved["name"] == "mixtral" and source != "hf":  # transformers 5 fuses experts in the model, and loads both forms
        assert keys == set(saved["model"].state_dict()) and "model.layers.0.mlp.experts.gate_up_proj" in keys
    else:  # the keys save_pretrained writes
        assert keys == set(ckptfix.load(saved["hf"] / "model.safetensors"))


def test_shards_an_exact_index_and_verify(saved: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "shards"
    result = run("convert", saved["dcp"], f"{out}/", "--format", "hf", "--shard-size", "20kB", "--verify")
    assert result.exit_code == 0, result.output
    assert "verified: from_pretrained loads every key, logits equal the source's (largest difference 0)" in (
        result.output
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    from safetensors import safe_open

    sizes, keys = 0, set()
    for name in shards:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata()["format"] == "pt"
            keys |= set(keys_of(f))
            sizes += sum(f.get_tensor(k).nbytes for k in keys_of(f))
    assert index["metadata"]["total_size"] == sizes and set(index["weight_map"]) == keys
    _loads_equal(out, saved)


def test_dtype_casts_and_sets_the_configs(saved: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    result = run("convert", saved["ddp"], f"{out}/", "--format", "hf", "--dtype", "bf16", "--verify")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in ckptfix.load(out / "model.safetensors").values()} == {torch.bfloat16}
    import transformers as tf

    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    loaded = getattr(tf, arch).from_pretrained(out, dtype=torch.bfloat16)
    ref = getattr(tf, arch).from_pretrained(saved["hf"], dtype=torch.bfloat16)  # bf16 compared in bf16
    assert torch.equal(_logits(loaded), _logits(ref))


@pytest.mark.parametrize("name", MODELS)
def test_a_bf16_training_run_exports_in_bf16_and_computes_as_it(name: str, tmp_path: Path) -> None:
    """A run trained in bf16 (the model cast, AdamW on bf16 weights) saved as DCP and as a DataParallel ``.pt``: the
    export keeps bf16, its config says so, and loaded in bf16 it computes the logits that ``save_pretrained``'s folder
    of the trained model computes in bf16, bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptfix.torchcompat import dcp_save_local

    model, _ = _trained(name)
    model = model.to(torch.bfloat16).train()
    opt = train(model)
    model.eval()
    model.config.save_pretrained(tmp_path / "run")  # the config the run started from: fp32 in it
    # the reference: the trained model as save_pretrained writes it, loaded in bf16 (a model cast with .to() holds
    # its rotary inv_freq in bf16 too, which from_pretrained keeps in fp32: not the same computation)
    model.save_pretrained(tmp_path / "reference")
    msd, osd = get_state_dict(model, opt)
    dcp_save_local({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "run" / "dcp"))
    torch.save({"model": torch.nn.DataParallel(model).state_dict()}, tmp_path / "run" / "ddp.pt")
    model.cpu()
    import transformers as tf

    for source in ("dcp", "ddp.pt"):
        out = tmp_path / f"out_{source}"
        result = run("convert", tmp_path / "run" / source, f"{out}/", "--format", "hf")
        assert result.exit_code == 0, result.output
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        assert {t.dtype for t in ckptfix.load(out / "model.safetensors").values()} == {torch.bfloat16}
        arch = json.loads((out / "config.json").read_text())["architectures"][0]
        loaded, info = getattr(tf, arch).from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
        reference = getattr(tf, arch).from_pretrained(tmp_path / "reference", dtype=torch.bfloat16)
        assert torch.equal(_logits(loaded), _logits(reference)), source  # bf16 compared in bf16


@pytest.mark.parametrize("name", MODELS)
def test_lightning_checkpoint_exports(name: str, tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning.pytorch", reason=needs("Lightning"))
    from tests.hf_runs import loss_of

    model, _ = _trained(name)
    model.save_pretrained(tmp_path / "hf")

    class Module(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, idx: int) -> Any:
            return loss_of(self.model)  # the batch is IDS

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(IDS.repeat(2, 1)), batch_size=1)
    trainer = lightning.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Module(), data)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    out = tmp_path / "out"
    result = run("convert", tmp_path / "last.ckpt", f"{out}/", "--format", "hf", "--config-from", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    _loads_equal(out, {"logits": _logits(model), "model": model})


def test_newcomers_bert_reshards_with_its_config(tmp_path: Path) -> None:
    import transformers as tf

    model, _ = _trained("bert", vocab_size=512, hidden_size=64)  # 0.4 MB: several 100kB shards
    model.save_pretrained(tmp_path / "bert_one")
    out = tmp_path / "hf_resharded"
    result = run("convert", tmp_path / "bert_one" / "model.safetensors", f"{out}/", "--shard-size", "100kB",
                 "--format", "hf")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"copied from {tmp_path / 'bert_one'}: config.json" in result.output
    loaded, info = tf.BertModel.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert torch.equal(_logits(loaded), _logits(model)) and len(list(out.glob("model-*.safetensors"))) > 1


# -- refusals: each before a byte is written ------------------------------------------------------------------


def _nothing_written(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_no_config_is_refused_in_one_line_naming_the_option(tmp_path: Path) -> None:
    model, _ = _trained("llama")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    result = run("convert", tmp_path / "weights.pt", f"{tmp_path / 'out'}/", "--format", "hf")
    assert result.exit_code == 2
    assert "no config.json (nor generation_config.json, tokenizer files) in" in result.output
    assert "pass --config-from DIR" in result.output and len(result.output.splitlines()) == 1
    _nothing_written(tmp_path, tmp_path / "out")


def test_keys_that_do_not_fit_the_config_are_refused_by_name(tmp_path: Path) -> None:
    model, _ = _trained("llama")
    model.save_pretrained(tmp_path / "hf")
    other = _config("llama")
    other.num_hidden_layers = 3  # a config that is not the one the weights were trained with
    other.save_pretrained(tmp_path / "wrong")
    result = run("convert", tmp_path / "hf", f"{tmp_path / 'out'}/", "--format", "hf", "--config-from",
                 tmp_path / "wrong")  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "does not fit LlamaForCausalLM as" in result.output
    assert "9 missing (e.g. 'model.layers.2.self_attn.q_proj.weight')" in result.output
    assert "pass --config-from the folder of the config it was trained with" in result.output
    other.num_hidden_layers, other.hidden_size, other.head_dim = 2, 48, 12
    other.save_pretrained(tmp_path / "wrong")
    result = run("convert", tmp_path / "hf", f"{tmp_path / 'out'}/", "--format", "hf", "--config-from",
                 tmp_path / "wrong")  # fmt: skip
    assert result.exit_code == 1 and "wrong shape (e.g. 'model.embed_tokens.weight': [64, 32] vs model [64, 48])" in (
        result.output
    )
    _nothing_written(tmp_path, tmp_path / "out")


def test_without_transformers_a_one_line_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers then raises ImportError
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "w.pt")
    result = run("convert", tmp_path / "w.pt", f"{tmp_path / 'out'}/", "--format", "hf")
    assert result.exit_code == 2
    assert result.output == (
        "ckptfix: error: transformers is not installed, and --format hf builds the model its config describes with "
        "it: pip install 'ckptfix[hf]' (or pip install transformers)\n"
    )


def test_options_that_do_not_apply_are_usage_errors(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "w.pt")
    result = run("convert", tmp_path / "w.pt", tmp_path / "w2.pt", "--config-from", tmp_path)
    assert result.exit_code == 2 and "--config-from applies to --format hf" in result.output
    result = run("convert", tmp_path / "w.pt", f"{tmp_path / 'o'}/", "--format", "hf", "--to", "ddp")
    assert result.exit_code == 2 and "--to does not apply to --format hf" in result.output


def test_an_existing_folder_is_replaced_only_with_force(tmp_path: Path) -> None:
    model, _ = _trained("qwen2")
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    assert run("convert", tmp_path / "hf", f"{out}/", "--format", "hf").exit_code == 0
    again = run("convert", tmp_path / "hf", f"{out}/", "--format", "hf")
    assert again.exit_code == 2 and "exists and is not empty" in again.output
    forced = run("convert", tmp_path / "hf", f"{out}/", "--format", "hf", "--force", "--shard-size", "30kB")
    assert forced.exit_code == 0, forced.output
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").exists()
    (out / "notes.txt").write_text("mine")
    refused = run("convert", tmp_path / "hf", f"{out}/", "--format", "hf", "--force")
    assert refused.exit_code == 2 and "notes.txt: is not a file a transformers export writes" in refused.output


def test_library_call(tmp_path: Path) -> None:
    model, _ = _trained("gpt2")
    model.save_pretrained(tmp_path / "hf")
    result = ckptfix.export_hf(tmp_path / "hf", tmp_path / "out", verify=True)
    assert result.method == "stream" and any(n.startswith("verified:") for n in result.notes)
    _loads_equal(tmp_path / "out", {"logits": _logits(model), "model": model})


def test_the_torch_path_writes_what_the_stream_writes(saved: dict[str, Any], tmp_path: Path) -> None:
    streamed, loaded = tmp_path / "streamed", tmp_path / "torch"
    assert run("convert", saved["ddp"], f"{streamed}/", "--format", "hf").exit_code == 0
    result = run("convert", saved["ddp"], f"{loaded}/", "--format", "hf", "--no-fast", "-v")
    assert result.exit_code == 0, result.output
    assert "path: torch; fast path not taken: the torch path was asked for" in result.output
    a, b = ckptfix.load(streamed / "model.safetensors"), ckptfix.load(loaded / "model.safetensors")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (streamed / "config.json").read_bytes() == (loaded / "config.json").read_bytes()


# -- sharded training runs on 2 gloo ranks (slow tier) -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("writer", ["fsdp2", "fsdp1"])
def test_fsdp_dcp_run_exports_equal_to_its_full_state_dict(writer: str, name: str, tmp_path: Path) -> None:
    from tests import hf_runs
    from tests.hf_runs import build
    from tests.sharded_writers import FSDP2_ON_CPU, NO_FSDP2_REASON

    if writer == "fsdp2" and not FSDP2_ON_CPU:
        pytest.skip(NO_FSDP2_REASON)
    config = _config(name)
    arch = config.architectures[0]
    run_dir = getattr(hf_runs, f"write_{writer}")(tmp_path / "run", arch, config.to_dict())
    config.save_pretrained(tmp_path / "config")
    out = tmp_path / "out"
    result = run("convert", run_dir / "dcp", f"{out}/", "--format", "hf", "--config-from", tmp_path / "config",
                 "--verify")  # fmt: skip
    assert result.exit_code == 0, result.output
    truth = build(arch, config.to_dict())
    truth.load_state_dict(torch.load(run_dir / "full.pt", weights_only=True))
    _loads_equal(out, {"logits": _logits(truth), "model": truth})
    # the ranks' own files (DTensor or ShardedTensor shards): one alone is refused, naming the way; merged, the same
    alone = run("convert", run_dir / "rank0.pt", f"{tmp_path / 'alone'}/", "--format", "hf", "--config-from",
                tmp_path / "config")  # fmt: skip
    assert alone.exit_code == 2 and "from every rank's file with `ckptfix merge" in alone.output, alone.output
    assert not (tmp_path / "alone").exists()
    merged = tmp_path / "merged"
    result = run("merge", run_dir / "rank1.pt", run_dir / "rank0.pt", "-o", f"{merged}/", "--format", "hf",
                 "--config-from", tmp_path / "config", "--verify")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "verified: from_pretrained loads every key" in result.output
    assert f"wrote {merged}/ (transformers folder: model.safetensors, config.json" in result.output
    _loads_equal(merged, {"logits": _logits(truth), "model": truth})
    assert not list(tmp_path.glob(".ckptfix-*"))  # no temporary left beside the output
    if writer == "fsdp2":  # accelerate's save_state of the same run: its DCP folder, and its per-rank files
        saved = run_dir / "accelerate"
        whole = run("convert", saved, f"{tmp_path / 'whole'}/", "--format", "hf")
        assert whole.exit_code == 2 and f"its model is the DCP folder {saved / 'pytorch_model_fsdp_0'}/" in whole.output
        result = run("convert", saved / "pytorch_model_fsdp_0", f"{tmp_path / 'acc'}/", "--format", "hf")
        assert result.exit_code == 0 and f"copied from {saved}: config.json" in result.output, result.output
        _loads_equal(tmp_path / "acc", {"logits": _logits(truth), "model": truth})
        ranks = [saved / f"pytorch_model_fsdp_0_rank{r}.bin" for r in (0, 1)]
        result = run("merge", *ranks, "-o", f"{tmp_path / 'acc_ranks'}/", "--format", "hf")
        assert result.exit_code == 0, result.output
        _loads_equal(tmp_path / "acc_ranks", {"logits": _logits(truth), "model": truth})


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_zero3_run_exports_equal_to_deepspeeds_own_consolidation(name: str, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason=needs("deepspeed", DEEPSPEED))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from tests.hf_runs import build, write_zero3

    config = _config(name)
    arch = config.architectures[0]
    run_dir = write_zero3(tmp_path / "run", arch, config.to_dict())
    config.save_pretrained(run_dir)  # where HF Trainer puts it: the checkpoint folder
    out = tmp_path / "out"
    result = run("convert", run_dir, f"{out}/", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    truth = build(arch, config.to_dict())
    truth.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(run_dir)), strict=False)  # tied: saved once
    _loads_equal(out, {"logits": _logits(truth), "model": truth})


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_hf_trainer_with_deepspeed_zero3_exports_equal_to_deepspeeds_own_consolidation(
    name: str, tmp_path: Path
) -> None:
    pytest.importorskip("deepspeed", reason=needs("deepspeed", DEEPSPEED))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from tests.hf_runs import build, write_trainer_zero3

    config = _config(name)
    arch = config.architectures[0]
    checkpoint = write_trainer_zero3(tmp_path / "trainer", arch, config.to_dict())
    assert not (checkpoint / "model.safetensors").exists()  # ZeRO-3's weights are only in the rank files
    out = tmp_path / "out"
    result = run("convert", checkpoint, f"{out}/", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    assert f"copied from {checkpoint}: config.json" in result.output
    truth = build(arch, config.to_dict())
    truth.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint)), strict=False)  # tied: once
    _loads_equal(out, {"logits": _logits(truth), "model": truth})


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_trainer_checkpoint_folder_exports_with_its_own_config(name: str, tmp_path: Path) -> None:
    import transformers as tf

    model, _ = _trained(name)
    data = [{"input_ids": IDS[0], "labels": IDS[0]}] * 2
    args = tf.TrainingArguments(str(tmp_path / "trainer"), max_steps=2, save_steps=2, per_device_train_batch_size=1,
                                use_cpu=True, report_to=[], disable_tqdm=True)  # fmt: skip
    tf.Trainer(model=model, args=args, train_dataset=data).train()
    checkpoint = tmp_path / "trainer" / "checkpoint-2"  # model.safetensors, config.json, optimizer.pt, rng_state.pth …
    out = tmp_path / "out"
    result = run("convert", checkpoint, f"{out}/", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    assert f"copied from {checkpoint}: config.json, generation_config.json" in result.output
    _loads_equal(out, {"logits": _logits(model), "model": model})


def test_weights_tied_in_training_under_an_untied_config_are_refused(tmp_path: Path) -> None:
    model, _ = _trained("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied by hand, the config left untied
    torch.save(model.state_dict(), tmp_path / "tied.pt")
    model.config.save_pretrained(tmp_path)
    result = run("convert", tmp_path / "tied.pt", f"{tmp_path / 'out'}/", "--format", "hf")
    assert result.exit_code == 1, result.output
    assert "'lm_head.weight' and 'model.embed_tokens.weight' are one tensor (tied in training), but" in result.output
    assert 'does not tie them; set "tie_word_embeddings": true there' in result.output
    _nothing_written(tmp_path, tmp_path / "out")


def test_a_config_transformers_cannot_read_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model", "architectures": ["NoSuchModel"]}')
    torch.save({"w": torch.zeros(2)}, tmp_path / "w.pt")
    result = run("convert", tmp_path / "w.pt", f"{tmp_path / 'out'}/", "--format", "hf")
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"ckptfix: error: {tmp_path}/config.json: transformers ")
    assert "cannot read it" in result.output and len(result.output.splitlines()) == 1
    _nothing_written(tmp_path, tmp_path / "out")
