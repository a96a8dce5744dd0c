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
    assert result.exit_code == 1, result.output  # told from the keys, before a model of 3 layers is built
    assert f"holds 2 layers, but {tmp_path / 'wrong' / 'config.json'} says num_hidden_layers 3" in result.output
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


# -- the config: code it names, sizes it says, the class it leaves out, ties it says (issue 39) ----------------------

_CUSTOM_CONFIG = """
import os
from pathlib import Path

from transformers import PretrainedConfig

if os.environ.get("CKPTFIX_TEST_RAN"):  # the proof that transformers ran this module
    Path(os.environ["CKPTFIX_TEST_RAN"]).touch()


class CustomConfig(PretrainedConfig):
    model_type = "ckptfix-custom"
"""


def test_a_config_of_custom_code_is_refused_and_its_code_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _trained("llama")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "configuration_custom.py").write_text(_CUSTOM_CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    from configuration_custom import CustomConfig  # type: ignore[import-not-found]

    CustomConfig.register_for_auto_class()  # save_pretrained then writes auto_map and copies the module
    CustomConfig(architectures=["CustomForCausalLM"]).save_pretrained(tmp_path / "run")
    assert "AutoConfig" in json.loads((tmp_path / "run" / "config.json").read_text())["auto_map"]
    torch.save(model.state_dict(), tmp_path / "run" / "w.pt")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    ran = tmp_path / "RAN"
    monkeypatch.setenv("CKPTFIX_TEST_RAN", str(ran))
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "run" / "w.pt"), f"{tmp_path / 'out'}/", "--format",
                                      "hf", "--verify"], input="y\n")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert not ran.exists()  # no prompt answered, no module imported
    assert "Do you wish to run the custom code" not in result.output and len(result.output.splitlines()) == 1
    assert "model_type 'ckptfix-custom' is not one transformers knows" in result.output
    assert "'CustomForCausalLM'" in result.output and "which ckptfix never runs" in result.output
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    _nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(("name", "field"), [("llama", "num_hidden_layers"), ("gpt2", "n_layer")])
def test_a_config_of_more_layers_than_the_checkpoint_is_refused_before_the_model_is_built(
    name: str, field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _trained(name)
    model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, field: 12000}))
    import ckptfix.exporting.classes

    def never(*args: Any) -> None:
        raise AssertionError("a model of the config's size was built")

    monkeypatch.setattr(ckptfix.exporting.classes, "meta_model", never)
    result = run("convert", tmp_path / "hf", f"{tmp_path / 'out'}/", "--format", "hf")
    assert result.exit_code == 1, result.output
    layers = "model.layers" if name == "llama" else "transformer.h"
    assert result.output == (
        f"ckptfix: error: {tmp_path / 'hf'}: holds 2 layers, but {tmp_path / 'hf' / 'config.json'} says {field} "
        f"12000 (layers held: 2 ('{layers}.0' to '{layers}.1')); nothing was written; pass --config-from the folder "
        f"of the config it was trained with\n"
    )
    _nothing_written(tmp_path, tmp_path / "out")


def test_a_model_sharing_one_layer_across_its_depth_is_not_refused(tmp_path: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, intermediate_size=64,
                             num_attention_heads=4, num_hidden_layers=6, max_position_embeddings=32)  # fmt: skip
    model = tf.AlbertModel(config).eval()
    model.save_pretrained(tmp_path / "hf")  # 6 layers, the weights of one: albert_layer_groups.0.albert_layers.0
    result = run("convert", tmp_path / "hf", f"{tmp_path / 'out'}/", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("name", "arch"), [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
                                            ("mixtral", "MixtralForCausalLM"), ("bert", "BertModel")])  # fmt: skip
def test_a_config_without_architectures_gets_the_class_its_keys_fill(name: str, arch: str, tmp_path: Path) -> None:
    model, _ = _trained(name)
    model.config.architectures = None  # as a config made in code, then model.config.save_pretrained, leaves it
    model.config.save_pretrained(tmp_path)
    assert "architectures" not in json.loads((tmp_path / "config.json").read_text())
    torch.save({"model": model.state_dict(), "step": 2}, tmp_path / "run.pt")
    result = run("convert", tmp_path / "run.pt", f"{tmp_path / 'out'}/", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    said = f"architecture {arch}: {tmp_path / 'config.json'} names none, and {arch} is the one class of"
    assert said in result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [arch]
    _loads_equal(tmp_path / "out", {"logits": _logits(model), "model": model})


def test_classes_a_checkpoint_fills_alike_are_refused_and_architecture_names_one(tmp_path: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = _config("bert")
    config.architectures = None
    model = tf.BertForMaskedLM(config).eval()  # its keys are BertLMHeadModel's too
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "mlm.pt")
    out = tmp_path / "out"
    result = run("convert", tmp_path / "mlm.pt", f"{out}/", "--format", "hf")
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "names no 'architectures', and the keys of" in result.output
    assert "fill BertForMaskedLM and BertLMHeadModel alike" in result.output
    advice = result.output.rstrip().rsplit("pass ", 1)[1]  # --architecture NAME, one of BertForMaskedLM, …
    assert advice.startswith("--architecture NAME, one of BertForMaskedLM")
    _nothing_written(tmp_path, out)
    result = run("convert", tmp_path / "mlm.pt", f"{out}/", "--format", "hf", "--architecture", "BertForMaskedLM",
                 "--verify")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    _loads_equal(out, {"logits": _logits(model), "model": model})
    again = ckptfix.export_hf(tmp_path / "mlm.pt", tmp_path / "lib", architecture="BertForMaskedLM")
    assert again.method in ("stream", "torch")
    bad = run("convert", tmp_path / "mlm.pt", f"{tmp_path / 'bad'}/", "--format", "hf", "--architecture", "Nope")
    assert bad.exit_code == 2 and "--architecture: architecture 'Nope' is not a model class of transformers" in (
        bad.output
    )
    other = run("convert", tmp_path / "mlm.pt", tmp_path / "x.pt", "--architecture", "BertForMaskedLM")
    assert other.exit_code == 2 and "--architecture applies to --format hf" in other.output


def test_an_output_projection_of_its_own_under_a_tying_config_is_refused(tmp_path: Path) -> None:
    model, _ = _trained("llama")  # untied: lm_head.weight is trained apart from the embedding
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    torch.save(model.state_dict(), tmp_path / "untied.pt")
    model.config.tie_word_embeddings = True  # the config says tied: from_pretrained would drop lm_head
    model.config.save_pretrained(tmp_path)
    result = run("convert", tmp_path / "untied.pt", f"{tmp_path / 'out'}/", "--format", "hf")
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"ckptfix: error: {tmp_path / 'untied.pt'}: holds 'lm_head.weight' apart from 'model.embed_tokens.weight', "
        f"with other values, but {tmp_path / 'config.json'} ties them (from_pretrained would use "
        f"'model.embed_tokens.weight' for both); nothing was written; set \"tie_word_embeddings\": false there (or "
        f"the model's tie option), or pass --config-from the config it was trained with\n"
    )
    _nothing_written(tmp_path, tmp_path / "out")


# -- what goes beside the weights, and what is said ---------------------------------------------------------------


def _tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the models' 64 ids, written by transformers' own writer (tokenizer.json,
    tokenizer_config.json)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2").save_pretrained(folder)


def test_side_files_linked_out_of_the_folder_are_left_out_and_said(tmp_path: Path) -> None:
    """A save_pretrained folder whose tokenizer.json is a link to a file elsewhere: the export leaves it out and says
    so, copies what lies inside the folder (a link within it included), and a config.json linked out is refused."""
    model, _ = _trained("llama")
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    _tokenizer(hf)
    (tmp_path / "elsewhere.json").write_text('{"secret": "not the tokenizer"}')
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    (hf / "kept").mkdir()
    (hf / "generation_config.json").rename(hf / "kept" / "generation.json")
    (hf / "generation_config.json").symlink_to(Path("kept") / "generation.json")  # a link inside: copied
    out = tmp_path / "out"
    result = run("convert", hf, f"{out}/", "--format", "hf")
    assert result.exit_code == 0, result.output
    assert (f"left out tokenizer.json: {hf / 'tokenizer.json'} is a link to {tmp_path / 'elsewhere.json'}, outside "
            f"{hf}, and an export copies only the folder's own files; copy the file into the folder, or pass "
            f"--config-from a folder that holds it") in result.output  # fmt: skip
    assert f"copied from {hf}: config.json, generation_config.json, tokenizer_config.json" in result.output
    assert not (out / "tokenizer.json").exists() and not (out / "generation_config.json").is_symlink()
    assert (out / "generation_config.json").read_bytes() == (hf / "kept" / "generation.json").read_bytes()
    (hf / "config.json").rename(tmp_path / "config.json")
    (hf / "config.json").symlink_to(tmp_path / "config.json")
    refused = run("convert", hf, f"{tmp_path / 'out2'}/", "--format", "hf")
    assert refused.exit_code == 2 and len(refused.output.splitlines()) == 1, refused.output
    assert refused.output.startswith(f"ckptfix: error: {hf / 'config.json'} is a link to {tmp_path / 'config.json'}")
    _nothing_written(tmp_path, tmp_path / "out2")


def test_the_run_folders_generation_config_and_tokenizer_go_beside_a_checkpoints_config(tmp_path: Path) -> None:
    """accelerate's save_state in ``run/checkpoint-2/`` with the model's config beside it (as HF Trainer puts it),
    the generation config and tokenizer saved once in ``run/``: the export carries all three, and transformers loads
    the generation config and tokenizer from it."""
    import accelerate
    import transformers as tf

    model, opt = _trained("llama")
    model.generation_config.max_new_tokens, model.generation_config.eos_token_id = 7, [2, 3]
    run_dir = tmp_path / "run"
    model.generation_config.save_pretrained(run_dir)
    _tokenizer(run_dir)
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(model, opt)
    acc.save_state(str(run_dir / "checkpoint-2"))
    model.config.save_pretrained(run_dir / "checkpoint-2")
    out = tmp_path / "out"
    result = run("convert", run_dir / "checkpoint-2", f"{out}/", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    assert (f"copied from {run_dir / 'checkpoint-2'}: config.json, generation_config.json, tokenizer.json, "
            f"tokenizer_config.json") in result.output  # fmt: skip
    loaded = tf.GenerationConfig.from_pretrained(out)
    assert loaded.max_new_tokens == 7 and loaded.eos_token_id == [2, 3]
    assert tf.AutoTokenizer.from_pretrained(out)("w1 w5").input_ids == [1, 5]
    _loads_equal(out, {"logits": _logits(model), "model": model})


def test_the_checkpoints_other_entries_are_said_left_out(tmp_path: Path) -> None:
    """A full DataParallel checkpoint, a DCP folder of get_state_dict and accelerate's save_state: what the export
    leaves out (the optimizer, the step, …) is said in a line, and in --json's "dropped"."""
    import accelerate
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptfix.torchcompat import dcp_save_local

    model, opt = _trained("qwen2")
    model.config.save_pretrained(tmp_path)
    torch.save({"model": torch.nn.DataParallel(model).state_dict(), "optimizer": opt.state_dict(), "epoch": 1,
                "step": 2}, tmp_path / "dp.pt")  # fmt: skip
    model.cpu()
    msd, osd = get_state_dict(model, opt)
    dcp_save_local({"model": msd, "optim": osd, "step": 2}, checkpoint_id=str(tmp_path / "dcp"))
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(model, opt)
    acc.save_state(str(tmp_path / "accelerate"))
    said = "left out the training state beside the model: "
    for source, left in [("dp.pt", ["optimizer", "epoch", "step"]), ("dcp", ["optim", "step"]),
                         ("accelerate", ["optimizer", "random_states_0"])]:  # fmt: skip
        result = run("convert", tmp_path / source, f"{tmp_path / source}_hf/", "--format", "hf")
        assert result.exit_code == 0 and said + ", ".join(left) + "\n" in result.output, result.output
        as_json = run("convert", tmp_path / source, f"{tmp_path / source}_json/", "--format", "hf", "--json")
        assert json.loads(as_json.output)["dropped"] == left, as_json.output
    bare = run("convert", tmp_path / "dp.pt_hf", f"{tmp_path / 'again'}/", "--format", "hf")  # nothing to leave out
    assert bare.exit_code == 0 and said not in bare.output, bare.output


def test_a_progress_bar_on_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed weights move a bar on stderr when it is a terminal (rich's, as every copy shows one), up to the
    bytes written; none with --json."""
    import types

    from ckptfix.stream import progress

    model, _ = _trained("llama")
    model.save_pretrained(tmp_path / "hf")
    bars: list[list[int]] = []

    class Recorded:
        def __init__(self, *columns: Any, **kwargs: Any) -> None:
            bars.append([])

        def __enter__(self) -> Recorded:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def add_task(self, what: str, *, total: int) -> int:
            bars[-1].append(total)
            return 0

        def advance(self, task: int, n: int) -> None:
            bars[-1].append(n)

    monkeypatch.setattr("rich.progress.Progress", Recorded)
    monkeypatch.setattr(progress, "THRESHOLD", 0)
    monkeypatch.setattr(progress, "sys", types.SimpleNamespace(stderr=types.SimpleNamespace(isatty=lambda: True)))
    assert run("convert", tmp_path / "hf", f"{tmp_path / 'quiet'}/", "--format", "hf", "--json").exit_code == 0
    assert bars == []
    result = run("convert", tmp_path / "hf", f"{tmp_path / 'out'}/", "--format", "hf", "--shard-size", "30kB")
    assert result.exit_code == 0, result.output
    weights = sum(t.nbytes for t in ckptfix.load(tmp_path / "hf").values())
    assert len(bars) == 1 and bars[0][0] == weights == sum(bars[0][1:])
