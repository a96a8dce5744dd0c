"""Real torchtune and torchtitan Llama checkpoints for the tests: tiny models built by the trainers' own builders,
trained two steps, saved by their own writers, with what their own converters make of them.

- ``tune_tied.bin``: torchtune's ``llama3_2`` (output tied to the embedding: no ``output.weight``; Llama 3 scaled
  rotary), saved by ``FullModelTorchTuneCheckpointer`` (its ``epoch_0/model-00001-of-00001.bin``, a ``torch.save``
  of the state dict in torchtune's names), its config in ``config_tune_tied/``;
- ``titan/``: torchtitan's Llama 3 model (``Llama3Model``), saved by its ``CheckpointManager`` at the run's last
  step as its default config saves it (``last_save_model_only``: the DCP folder ``step-2/`` of the model's
  tensors, at the top), its ``config.json`` put beside them.

Made on demand (``--only NAME``), not kept in fixtures/, whose files and folders stay under 60 kB: ``meta``,
torchtune's ``llama3`` (untied) saved by ``FullModelMetaCheckpointer`` in Meta's names (``attention.wq``,
``feed_forward.w1``, ``output``: those of torchtitan before 0.3 and Meta's releases); ``tune``, the same in
torchtune's names; ``titan_full``, a torchtitan save at an interval, the optimizer, ``lr_scheduler`` and
``train_state`` beside the model (about 550 kB).

Beside each, ``NAME.expected.safetensors`` is the trainer's own converter's output (torchtune's
``convert_weights.tune_to_hf``, torchtitan's ``Llama3StateDictAdapter.to_hf``): what ``convert --format hf`` must
write; ``NAME.logits.safetensors`` the source model's forward on a fixed input (``input_ids``) in float32; the
transformers ``config.json`` of the model in the folder the manifest's ``config`` names (neither trainer writes
one). ``MANIFEST.json`` says how they were made.

It needs torchtune and torchtitan, which ckptfix's own environment does not hold::

    python3 -m venv tune-venv && tune-venv/bin/pip install torch==2.13.0 torchtune torchao==0.11.0 torchtitan \\
        triton transformers safetensors
    tune-venv/bin/python -m tests.llama_family_runs fixtures/llama_family
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, SEQ, MAX_SEQ = 16, 8, 1, 2, 1, 8, 8, 32
ROPE_THETA, EPS, STEPS = 10000.0, 1e-5, 2


def fixed_ids() -> Any:
    """The input every model is run on, here and in the tests."""
    import torch

    return (torch.arange(SEQ) * 7 % VOCAB).reshape(1, SEQ)


def _hf_config(folder: Path, *, tied: bool, rope_scaling: dict[str, Any] | None = None) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=DIM // HEADS,
                         max_position_embeddings=MAX_SEQ, rms_norm_eps=EPS, tie_word_embeddings=tied,
                         rope_theta=ROPE_THETA, rope_scaling=rope_scaling, attention_bias=False, mlp_bias=False,
                         architectures=["LlamaForCausalLM"], dtype="float32")  # fmt: skip
    config.save_pretrained(folder)


def _train(model: Any, forward: Any) -> None:
    import torch

    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        logits = forward(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _save(path: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def tune_run(out: Path, name: str, *, tied: bool, meta: bool = False) -> dict[str, Any]:
    """``meta``: saved by ``FullModelMetaCheckpointer`` (Meta's names, as torchtitan before 0.3 and Meta's own
    releases name them), converted as torchtune converts it to transformers' (``meta_to_tune``, ``tune_to_hf``)."""
    import torch
    from torchtune.models.convert_weights import meta_to_tune, tune_to_hf, tune_to_meta
    from torchtune.models.llama3 import llama3
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.training import MODEL_KEY
    from torchtune.training.checkpointing import FullModelMetaCheckpointer, FullModelTorchTuneCheckpointer

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=DIM,
                 max_seq_len=MAX_SEQ, intermediate_dim=FFN, norm_eps=EPS, rope_base=int(ROPE_THETA))  # fmt: skip
    model = llama3_2(**shape, tie_word_embeddings=True) if tied else llama3(**shape)
    with tempfile.TemporaryDirectory() as tmp:  # the run starts from a checkpoint, as a recipe does
        base, run = os.path.join(tmp, "base"), os.path.join(tmp, "run")
        os.mkdir(base)
        torch.save(model.state_dict(), os.path.join(base, "base.pt"))
        writer = FullModelMetaCheckpointer if meta else FullModelTorchTuneCheckpointer
        if meta:  # the Meta checkpointer starts from a checkpoint in Meta's names
            torch.save(tune_to_meta(model.state_dict()), os.path.join(base, "base.pt"))
        ckpt = writer(checkpoint_dir=base, checkpoint_files=["base.pt"], model_type="LLAMA3_2" if tied else "LLAMA3",
                      output_dir=run)  # fmt: skip
        model.load_state_dict(ckpt.load_checkpoint()[MODEL_KEY])
        _train(model, model)
        ckpt.save_checkpoint({MODEL_KEY: model.state_dict()}, epoch=0)
        # the weights file alone, as NAME.bin (a folder costs fixtures/ a block)
        shutil.move(os.path.join(run, "epoch_0", "model-00001-of-00001.bin"), out / f"{name}.bin")
    saved = torch.load(out / f"{name}.bin", weights_only=True)
    if meta:
        saved = meta_to_tune(saved)
    _save(out / f"{name}.expected.safetensors", tune_to_hf(saved, num_heads=HEADS, num_kv_heads=KV_HEADS, dim=DIM))
    model.eval()
    with torch.no_grad():
        _save(out / f"{name}.logits.safetensors", {"logits": model(fixed_ids()).float(), "input_ids": fixed_ids()})
    scaling = (
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if tied
        else None
    )  # llama3_2's Llama3ScaledRoPE
    _hf_config(out / f"config_{name}", tied=tied, rope_scaling=scaling)
    return {"writer": f"torchtune {writer.__name__} (epoch_0/model-00001-of-00001.bin)", "tied": tied,
            "builder": "llama3_2" if tied else "llama3", "converter": "meta_to_tune, tune_to_hf" if meta else
            "tune_to_hf", "source": f"{name}.bin", "config": f"config_{name}"}  # fmt: skip


def titan_run(out: Path, name: str, *, full: bool = False) -> dict[str, Any]:
    import torch
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, Llama3StateDictAdapter, _build_llama3_layers

    torch.manual_seed(0)
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=EPS), lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ, theta=ROPE_THETA),
                                    attn_backend="flex", fuse_qkv=False),
    )  # fmt: skip
    for layer in config.layers:  # the norms' eps as the HF config says it (torchtitan's default is 1e-6)
        layer.attention_norm.eps = layer.ffn_norm.eps = EPS
        # torchtitan's SDPA attention (causal): its FlexAttention has no backward on the CPU; the weights, their
        # names and the rotary layout are the same whichever kernel attends
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = config.build()
    model.init_states()

    def forward(tokens: Any) -> Any:
        return model(tokens)

    optimizer = default_adamw(lr=1e-2)
    optimizer.implementation = "for-loop"  # fused is CUDA's
    optimizers = optimizer.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=STEPS)

    class TrainState:  # the trainer's own train_state entry: {"step", "ntokens_seen"}
        step, ntokens_seen = 0, 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]

    train = TrainState()
    # a run's last save, as torchtitan's default config writes it: the model's tensors alone, at the DCP folder's
    # top; ``full``: a save at an interval, the optimizer, lr_scheduler and train_state beside them (20 times the
    # bytes, over what fixtures/ can hold: made by --only titan_full, not kept)
    checkpointer = CheckpointManager.Config(enable=True, folder=name, interval=STEPS, last_save_model_only=True,
                                            keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train}, sd_adapter=None, base_folder=str(out / f".{name}-run"))  # fmt: skip
    torch.manual_seed(1)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        logits = forward(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        train.step, train.ntokens_seen = step, train.ntokens_seen + tokens.numel()
        checkpointer.save(step, last_step=step == STEPS and not full)
    checkpointer.close()
    shutil.move(out / f".{name}-run" / name / f"step-{STEPS}", out / name)  # step-2/ kept as NAME/
    shutil.rmtree(out / f".{name}-run")
    adapter = Llama3StateDictAdapter(config, None)
    _save(out / f"{name}.expected.safetensors", adapter.to_hf(dict(model.state_dict())))
    model.eval()
    with torch.no_grad():
        _save(out / f"{name}.logits.safetensors", {"logits": forward(fixed_ids()).float(), "input_ids": fixed_ids()})
    _hf_config(out / name, tied=False)  # in the folder: found there, as where a user puts it (no folder more)
    what = "interval save: model, optimizer, lr_scheduler, train_state" if full else "last step, last_save_model_only"
    return {
        "writer": f"torchtitan CheckpointManager ({what})",
        "converter": "Llama3StateDictAdapter.to_hf",
        "tied": False,
        "source": name,
        "config": name,
    }


RUNS = {
    "tune": lambda out: tune_run(out, "tune", tied=False),
    "tune_tied": lambda out: tune_run(out, "tune_tied", tied=True),
    "meta": lambda out: tune_run(out, "meta", tied=False, meta=True),
    "titan": lambda out: titan_run(out, "titan"),
    "titan_full": lambda out: titan_run(out, "titan_full", full=True),
}
# what fixtures/llama_family holds (under 60 kB, its folders' blocks counted: the rest are made on demand)
FIXTURES = ("tune_tied", "titan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", nargs="*", default=list(FIXTURES), choices=list(RUNS))
    args = parser.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"runs": {}}
    for name in args.only:
        for old in (args.out / name, args.out / f"config_{name}"):
            shutil.rmtree(old, ignore_errors=True)
        (args.out / f"{name}.bin").unlink(missing_ok=True)
        manifest["runs"][name] = RUNS[name](args.out)
    import torchtune

    manifest["command"] = "tune-venv/bin/python -m tests.llama_family_runs fixtures/llama_family"
    manifest["platform"] = {"torch": torch.__version__, "torchtune": torchtune.__version__,
                            "python": sys.version.split()[0], "shape": {"vocab": VOCAB, "dim": DIM, "layers": LAYERS,
                            "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN}, "steps": STEPS}  # fmt: skip
    try:
        import torchtitan

        manifest["platform"]["torchtitan"] = getattr(torchtitan, "__version__", "0.3.0")
    except ImportError:
        pass
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
