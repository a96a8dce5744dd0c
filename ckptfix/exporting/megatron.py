"""A Megatron-Core GPT model in transformers' names: ``LlamaForCausalLM``, or ``MixtralForCausalLM`` for a mixture
of experts, its ``config.json`` built from the checkpoint's own model arguments (``common.pt``'s ``args``).

The names are a TP=1, PP=1 ``GPTModel``'s with Megatron's default (Transformer Engine) layer spec, as
:mod:`ckptfix.formats.megatron.reader` reads them. Three tensors are split, each by rows:

- ``linear_qkv.weight`` holds, per query group, the group's query heads, then its key head, then its value head
  (``[heads/groups + 2, head_dim]`` rows a group): ``q_proj`` takes each group's first rows, ``k_proj`` and
  ``v_proj`` the next ``head_dim`` rows each;
- ``linear_fc1.weight`` of a gated unit (SwiGLU) is ``[gate; up]``: ``gate_proj`` (Mixtral's ``w1``) the first half,
  ``up_proj`` (``w3``) the second;
- the word embeddings (and an untied output layer) are padded to a multiple of the tensor-parallel size: the rows
  past the tokenizer's size (``args.vocab_size``, where the checkpoint says it) are cut.

The norms Transformer Engine fuses into ``linear_qkv`` and ``linear_fc1`` (``layer_norm_weight``) become
``input_layernorm`` and ``post_attention_layernorm``. Megatron's rotary embedding (non-interleaved: ``rotate_half``
on the two halves of each head, ``cat(freqs, freqs)``) is transformers' own; an interleaved one is refused.

Every other argument in ``common.pt`` is read too: one that changes the forward in a way Llama and Mixtral do not
compute is refused by name (:func:`check_forward`, with :mod:`ckptfix.exporting.megatron_args`), with or without
``--config-from``; a zero-centred norm (``apply_layernorm_1p``) is written as ``weight + 1``. Keys under a wrapping
module's prefix (``module.``) are mapped without it. What the config needs and the arguments do not say is refused in
one line, naming it and ``--config-from``.
:func:`hf_config` and :func:`hf_state` are pure: the config is a dict; a tensor is sliced by rows, a tensor record
becomes a :class:`~ckptfix.stream.rows.RowsTensor` of it (the stream copies its rows as byte ranges).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import MismatchError, UsageError
from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.formats.hf.config import ConfigFolder
from ckptfix.formats.records import is_record

# Megatron-LM's argument, the HF config's key; each needed for a config (``kv_channels``, ``num_query_groups`` have
# defaults Megatron itself applies)
_NEEDED = (
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("ffn_hidden_size", "intermediate_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("padded_vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("norm_epsilon", "rms_norm_eps"),
    ("rotary_base", "rope_theta"),
)
# Megatron-LM's argument, what transformers' Llama and Mixtral compute, said as what they need
_FAMILY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "normalization": (lambda v: v == "RMSNorm", "RMSNorm"),
    "swiglu": (lambda v: v is True, "SwiGLU"),
    "position_embedding_type": (lambda v: v == "rope", "rotary position embeddings"),
    "rotary_interleaved": (lambda v: not v, "non-interleaved rotary embeddings"),
    "rotary_percent": (lambda v: v in (None, 1.0), "rotary embeddings on the whole head"),
    "add_bias_linear": (lambda v: not v, "no linear biases"),
    "add_qkv_bias": (lambda v: not v, "no QKV bias"),
    "qk_layernorm": (lambda v: not v, "no QK norm"),
    "use_rope_scaling": (lambda v: not v, "unscaled rotary embeddings"),
    "rope_scaling": (lambda v: not v, "unscaled rotary embeddings"),
    "moe_router_pre_softmax": (lambda v: not v, "softmax over the top-k experts"),
    "moe_router_score_function": (lambda v: v in (None, "softmax"), "a softmax router"),
    "moe_shared_expert_intermediate_size": (lambda v: not v, "no shared expert"),
    "moe_layer_freq": (lambda v: v in (None, 1), "experts in every layer"),
}
# megatron-core 0.16's names of what older Megatron-LM calls norm_epsilon and apply_layernorm_1p
_ALIASES = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p"}
# every argument hf_config and hf_state read (each other one is checked by ckptfix.exporting.megatron_args)
_MAPPED = frozenset(
    {m for m, _ in _NEEDED}
    | set(_FAMILY)
    | set(_ALIASES)
    | set(_ALIASES.values())
    | {
        "group_query_attention",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "untie_embeddings_and_output_weights",
        "num_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "params_dtype",
        "bf16",
        "fp16",
    }
)
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
# Megatron's name in a layer -> transformers' (a Llama layer; Mixtral's differ only in the feed-forward block)
_SAME = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "block_sparse_moe.gate.weight",
}


def hf_config(args: Mapping[str, Any], *, source: str) -> tuple[dict[str, Any], list[str]]:
    """``config.json``'s content for the model ``args`` (Megatron-LM's argument names) describe, and notes (the
    vocabulary kept padded). Refused in one line: a model that is not Llama-family (LayerNorm, no SwiGLU, learned
    positions, biases, QK norms, interleaved or partial rotary), or arguments that do not say what the config needs.
    """
    args = named(args)
    missing = [m for m, _ in _NEEDED if args.get(m) is None]
    gqa = args.get("group_query_attention")
    if gqa and args.get("num_query_groups") is None:
        missing.append("num_query_groups")
    if missing:
        raise UsageError(
            f"{source}: its model arguments do not say {', '.join(missing)}, which an HF config.json "
            f"needs; pass --config-from the folder of the model's HF config.json"
        )
    check_forward(args, source=source)
    heads, hidden = int(args["num_attention_heads"]), int(args["hidden_size"])
    groups = int(args["num_query_groups"]) if gqa else heads
    head_dim = int(args.get("kv_channels") or hidden // heads)
    padded, notes = int(args["padded_vocab_size"]), []
    vocab = args.get("vocab_size")
    if not (isinstance(vocab, int) and 0 < vocab <= padded):
        vocab = padded
        notes.append(
            f"vocabulary kept at its padded size {padded}: the checkpoint does not say the tokenizer's; "
            f"pass --config-from a config.json whose vocab_size is it to cut the padding"
        )
    experts = args.get("num_experts")
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if experts else "LlamaForCausalLM"],
        "model_type": "mixtral" if experts else "llama",
        "hidden_size": hidden,
        "intermediate_size": int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"])
        if experts
        else int(args["ffn_hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "num_hidden_layers": int(args["num_layers"]),
        "rms_norm_eps": float(args["norm_epsilon"]),
        "rope_theta": float(args["rotary_base"]),
        "vocab_size": vocab,
        "max_position_embeddings": int(args["max_position_embeddings"]),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
    if experts:
        topk = args.get("moe_router_topk")
        if topk is None:
            raise UsageError(
                f"{source}: a mixture of {experts} experts whose model arguments do not say "
                f"moe_router_topk, which config.json needs (num_experts_per_tok); pass --config-from "
                f"the folder of the model's HF config.json"
            )
        config.update(
            num_local_experts=int(experts),
            num_experts_per_tok=int(topk),
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    else:
        config["mlp_bias"] = False
    dtype = args.get("params_dtype")
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else None
    if dtype is not None:
        config["torch_dtype"] = dtype
    return config, notes


def named(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with megatron-core 0.16's names (``layernorm_epsilon``) also under the older ones hf_config reads."""
    out = dict(args)
    for new, old in _ALIASES.items():
        if out.get(old) is None and new in out:
            out[old] = out[new]
    return out


def check_forward(args: Mapping[str, Any], *, source: str) -> None:
    """Refuse, naming it, an argument that makes a forward transformers' Llama and Mixtral do not compute: one of
    :data:`_FAMILY` they cannot say, or any other one not at Megatron-LM's default that ckptfix neither maps nor knows
    to leave the forward alone (:mod:`ckptfix.exporting.megatron_args`)."""
    from ckptfix.exporting.megatron_args import changed

    for name, (ok, wants) in _FAMILY.items():
        if not ok(args.get(name)):
            raise UsageError(
                f"{source}: not a Llama-family model ({name}={args.get(name)!r}; LlamaForCausalLM and "
                f"MixtralForCausalLM need {wants}); --format hf exports those only: convert it to a "
                f".safetensors file in Megatron's names instead"
            )
    if bad := changed(args, mapped=_MAPPED):
        raise UsageError(
            f"{source}: its args say {', '.join(bad)}, which change{'s' * (len(bad) == 1)} the model's "
            f"forward in a way LlamaForCausalLM and MixtralForCausalLM do not compute; --format hf "
            f"exports those only: convert it to a .safetensors file in Megatron's names "
            f"instead"
        )


def hf_state(
    state: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    source: str,
    take: Callable[[Any, list[tuple[int, int]]], Any] | None = None,
) -> OrderedDict[str, Any]:
    """``state`` (a TP=1, PP=1 ``GPTModel``'s tensors by Megatron's names) in transformers' names for the model
    ``config`` describes; ``take(tensor, [(start, stop), …])`` makes a tensor of those rows (default: torch's
    ``cat`` of the slices, cloned). A name with no place in the model is refused by name."""
    from ckptfix.stream.rows import take_rows

    take = take or take_rows
    heads, groups, d = int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_dim"])
    vocab, tied = int(config["vocab_size"]), bool(config.get("tie_word_embeddings"))
    moe = "num_local_experts" in config
    per = heads // groups
    q = [(g * (per + 2) * d, (g * (per + 2) + per) * d) for g in range(groups)]
    k = [((g * (per + 2) + per) * d, (g * (per + 2) + per + 1) * d) for g in range(groups)]
    v = [((g * (per + 2) + per + 1) * d, (g * (per + 2) + per + 2) * d) for g in range(groups)]
    out: OrderedDict[str, Any] = OrderedDict()
    for name, t in state.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = embed = take(t, [(0, vocab)])
            if tied:  # one tensor under both names: the export leaves the copy out
                out.setdefault("lm_head.weight", embed)
            continue
        if name == "output_layer.weight":  # tied in the config but stored apart: the export says so
            out["lm_head.weight"] = take(t, [(0, vocab)])
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = _norm(t, config, name=name, source=source)
            continue
        m = _LAYER.fullmatch(name)
        if m is None:
            raise MismatchError(
                f"{source}: '{name}' has no place in a Llama-family model; nothing was written; "
                f"convert it to a .safetensors file in Megatron's names instead"
            )
        layer, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest == "self_attention.linear_qkv.weight":
            rows = (heads + 2 * groups) * d
            if _rows_of(t) != rows:
                raise MismatchError(
                    f"{source}: '{name}' has {_rows_of(t)} rows, not {rows} ({heads} query heads and "
                    f"{groups} groups of {d}); the model arguments do not describe it: pass "
                    f"--config-from the model's HF config"
                )
            for proj, spans in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{layer}self_attn.{proj}.weight"] = take(t, spans)
        elif rest == "mlp.linear_fc1.weight" and not moe:
            half = _rows_of(t) // 2
            out[f"{layer}mlp.gate_proj.weight"], out[f"{layer}mlp.up_proj.weight"] = _gated(t, take, half)
        elif (e := _EXPERT.fullmatch(rest)) is not None and moe:
            at = f"{layer}block_sparse_moe.experts.{e.group(1)}."
            if e.group(2) == "linear_fc2":
                out[at + "w2.weight"] = t
            else:
                out[at + "w1.weight"], out[at + "w3.weight"] = _gated(t, take, _rows_of(t) // 2)
        elif rest in _SAME and (moe or not rest.startswith("mlp.router")):
            out[layer + _SAME[rest]] = (
                _norm(t, config, name=name, source=source) if _SAME[rest].endswith("layernorm.weight") else t
            )
        else:
            raise MismatchError(
                f"{source}: '{name}' has no place in a {'Mixtral' if moe else 'Llama'} layer; "
                f"nothing was written; convert it to a .safetensors file in Megatron's names "
                f"instead"
            )
    return out


def _norm(t: Any, config: Mapping[str, Any], *, name: str, source: str) -> Any:
    """A norm's weight as transformers' norm multiplies by it: as stored, or, zero-centred (``apply_layernorm_1p``),
    ``weight + 1`` in float32, as Transformer Engine's kernels add it (``gamma + 1`` in float32, the only
    arithmetic there is for a zero-centred RMSNorm: megatron-core's other norms refuse one). A bfloat16 or float16
    result would round it: refused, unless the export is float32 (``config["dtype"]``, else the stored dtype)."""
    if not config.get("norm_plus_one"):
        return t
    dtype = str(config.get("dtype") or t.dtype).removeprefix("torch.")
    if dtype != "float32":
        raise UsageError(
            f"{source}: apply_layernorm_1p=True: '{name}' holds its norm's scale - 1, and the scale "
            f"(weight + 1) in {dtype} is rounded where Megatron adds the 1 in float32; export with "
            f"--dtype float32"
        )
    if is_record(t):
        raise Fallback(Reason.LAYERNORM_1P)
    return t.float() + 1


def _gated(t: Any, take: Callable[[Any, list[tuple[int, int]]], Any], half: int) -> tuple[Any, Any]:
    """A gated unit's ``[gate; up]`` rows, apart."""
    return take(t, [(0, half)]), take(t, [(half, 2 * half)])


def _rows_of(t: Any) -> int:
    return int(t.shape[0])


@dataclass
class MegatronExport:
    """What ``convert --format hf`` of a Megatron folder uses: where its config comes from (``found``, its
    ``config`` written as ``config.json``), the transformers config, and the map of its tensors."""

    found: ConfigFolder
    config: Any  # transformers' PretrainedConfig
    shape: dict[str, Any]  # what hf_state needs: heads, groups, head_dim, vocab_size, ties, experts, norms, dtype
    source: str
    notes: list[str] = field(default_factory=list)
    prefix: str = ""  # a wrapped model's (``module.``), before every name: left out

    def premap(self, state: Mapping[str, Any]) -> OrderedDict[str, Any]:
        return hf_state({k.removeprefix(self.prefix): v for k, v in state.items()}, self.shape, source=self.source)


def for_export(src: str, *, config_from: Any = None, dtype: str | None = None) -> MegatronExport:
    """Megatron folder ``src`` (as the registry detects it) for an export: its config built from ``common.pt``'s
    model arguments, or read from ``config_from`` (a folder of an HF ``config.json``, which also says the tokenizer's
    vocabulary); either way, the arguments that change the forward are checked (:func:`check_forward`). ``dtype``:
    the export's."""
    from ckptfix.exporting.model import load_config, require_transformers
    from ckptfix.formats.hf.config import find_config
    from ckptfix.formats.megatron.reader import COMMON, describe

    run = describe(src)
    args, common = named(run.args), os.path.join(run.root, COMMON)
    notes: list[str] = []
    if config_from is not None:
        check_forward(args, source=common)
        found = find_config(src, config_from=config_from)
        config = load_config(found.folder)
    else:
        built, notes = hf_config(args, source=common)
        transformers = require_transformers()
        # for_model takes the class from transformers' own table (no auto_map, no code run); a trust_remote_code
        # argument would only become a field of the config, and be written into config.json
        config = transformers.AutoConfig.for_model(**built)
        written = {"architectures": built["architectures"], **config.to_diff_dict()}
        found = ConfigFolder(run.root, written, ())
        notes.append(
            f"config.json built from {os.path.join(run.root, COMMON)}'s model arguments ({built['architectures'][0]})"
        )
    heads = int(config.num_attention_heads)
    groups = int(getattr(config, "num_key_value_heads", None) or heads)
    shape: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        "vocab_size": int(config.vocab_size),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
    }
    if getattr(config, "num_local_experts", None):
        shape["num_local_experts"] = int(config.num_local_experts)
    shape.update(norm_plus_one=bool(args.get("apply_layernorm_1p")), dtype=dtype)
    prefix = run.under[0] if len(run.under) == 1 and all(k.startswith(run.under[0]) for k in run.state) else ""
    return MegatronExport(found, config, shape, source=run.root, notes=notes, prefix=prefix)


__all__ = ["MegatronExport", "check_forward", "for_export", "hf_config", "hf_state", "named"]
