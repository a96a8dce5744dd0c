"""A torchtune or torchtitan Llama checkpoint in transformers' names (``LlamaForCausalLM``), as their own converters
map it: torchtune's ``convert_weights.tune_to_hf``, torchtitan's Llama3 ``state_dict_adapter.to_hf`` (and Meta's
``consolidated.pth`` names, which torchtitan used before it moved the projections under ``qkv_linear``).

The source says which model it is by its names: ``tok_embeddings.weight`` or a layer name of one of the layouts
below claims the checkpoint; every key must then be of that one layout, or the export is refused naming the first
key that is not. A checkpoint without such names is none of ours and passes unchanged.

Both trainers keep Meta's rotary layout: a head's query and key rows pair dimension ``2i`` with ``2i + 1``, where
transformers' ``rotate_half`` pairs ``i`` with ``i + head_dim/2``. Their converters reorder the rows of ``q_proj``
and ``k_proj`` within each head (``view(heads, head_dim // 2, 2, dim).transpose(1, 2)``): row ``r`` of a head
becomes source row ``2 * (r % (head_dim // 2)) + r // (head_dim // 2)``, so the even rows come first, then the odd
ones. Those are row spans: a tensor record becomes a :class:`~ckptfix.stream.rows.RowsTensor` whose rows the
stream copies as byte ranges, a tensor is sliced (:func:`~ckptfix.stream.rows.take_rows`).

The checkpoints save no ``config.json``; heads, key-value heads and head size come from the one ``--config-from``
names. A query or key projection whose rows or columns disagree with it is refused by name. :func:`layout_of` and
:func:`hf_state` are pure.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import MismatchError, UsageError
from ckptfix.notes import always
from ckptfix.transforms.checkpoint import is_tensor

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_Q, _K = "self_attn.q_proj.weight", "self_attn.k_proj.weight"
_MLP = {"w1": "mlp.gate_proj.weight", "w2": "mlp.down_proj.weight", "w3": "mlp.up_proj.weight"}
# transformers' model types whose attention is Llama's (rotate_half rotary, these names)
LLAMA_TYPES = ("llama", "mistral")


@dataclass(frozen=True)
class Layout:
    """One trainer's names: whole-model keys and a layer's (after ``layers.N.``), each to transformers' name."""

    name: str
    top: Mapping[str, str]
    layer: Mapping[str, str]
    dropped: frozenset[str] = frozenset()  # buffers transformers computes itself (a rotary table)

    def names(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        m = _LAYER.fullmatch(key)
        return key in self.top or key in self.dropped or (m is not None and m.group(2) in self.layer)


TORCHTUNE = Layout(
    "torchtune",
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.scale": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    {
        "sa_norm.scale": "input_layernorm.weight",
        "attn.q_proj.weight": _Q,
        "attn.k_proj.weight": _K,
        "attn.v_proj.weight": "self_attn.v_proj.weight",
        "attn.output_proj.weight": "self_attn.o_proj.weight",
        "mlp_norm.scale": "post_attention_layernorm.weight",
        **{f"mlp.{w}.weight": hf for w, hf in _MLP.items()},
    },
)
_TITAN_LAYER = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"feed_forward.{w}.weight": hf for w, hf in _MLP.items()},
}
TORCHTITAN = Layout(
    "torchtitan",
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    },
    {
        "attention.qkv_linear.wq.weight": _Q,
        "attention.qkv_linear.wk.weight": _K,
        "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
        **_TITAN_LAYER,
    },
)
META = Layout(
    "Meta",
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    {
        "attention.wq.weight": _Q,
        "attention.wk.weight": _K,
        "attention.wv.weight": "self_attn.v_proj.weight",
        **_TITAN_LAYER,
    },
    frozenset({"freqs_cis"}),  # torchtitan before 0.3 kept its rotary table as a persistent buffer
)
LAYOUTS = (TORCHTUNE, TORCHTITAN, META)


def _claims(key: object) -> bool:
    """A name only these trainers write: the embedding, or a layer name of a layout (``norm.weight`` alone is
    also a bare ``LlamaModel``'s)."""
    if not isinstance(key, str):
        return False
    m = _LAYER.fullmatch(key)
    return key == "tok_embeddings.weight" or (m is not None and any(m.group(2) in lay.layer for lay in LAYOUTS))


def layout_of(keys: Iterable[object], *, source: str) -> Layout | None:
    """The layout all of ``keys`` are in; None when none of them is a torchtune or torchtitan name. Refused in one
    line, naming the first key that does not fit, when some are and the rest are not of one layout."""
    keys = list(keys)
    if not any(_claims(k) for k in keys):
        return None
    for lay in LAYOUTS:
        if all(lay.names(k) for k in keys):
            return lay
    best = max(LAYOUTS, key=lambda lay: sum(lay.names(k) for k in keys))
    odd = next(k for k in keys if not best.names(k))
    said = next(k for k in keys if best.names(k) and _claims(k))
    raise MismatchError(
        f"{source}: '{odd}' is not a {best.name} Llama name, though '{said}' is: a mixture of "
        f"layouts, or not a Llama model; nothing was written; rename the odd keys with --rename, or "
        f"convert it to a .safetensors file in its own names instead"
    )


def head_spans(heads: int, head_dim: int) -> list[tuple[int, int]]:
    """The source rows, in transformers' order, of a query or key projection of ``heads`` heads of ``head_dim``
    rows in Meta's rotary layout: each head's even rows, then its odd ones; runs of rows joined."""
    half, spans = head_dim // 2, list[tuple[int, int]]()
    for h in range(heads):
        spans.extend((h * head_dim + 2 * j + i, h * head_dim + 2 * j + i + 1) for i in (0, 1) for j in range(half))
    joined: list[tuple[int, int]] = []
    for a, b in spans:
        if joined and joined[-1][1] == a:
            joined[-1] = (joined[-1][0], b)
        else:
            joined.append((a, b))
    return joined


def hf_state(
    state: Mapping[str, Any],
    shape: Mapping[str, Any],
    *,
    layout: Layout,
    source: str,
    take: Callable[[Any, list[tuple[int, int]]], Any] | None = None,
) -> OrderedDict[str, Any]:
    """``state`` (every key of ``layout``) in transformers' names for the model ``shape`` describes
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``, ``tie_word_embeddings``);
    ``take(tensor, [(start, stop), …])`` makes a tensor of those rows (default: a record of them, or a slice)."""
    if take is None:
        from ckptfix.stream.rows import take_rows

        take = take_rows
    heads, kv, d = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"]), int(shape["head_dim"])
    hidden = int(shape["hidden_size"])
    if d % 2:
        raise UsageError(
            f"{source}: config.json's head_dim {d} is odd, and rotary embeddings pair a head's "
            f"dimensions; pass --config-from the folder of the config it was trained with"
        )
    out: OrderedDict[str, Any] = OrderedDict()
    for name, t in state.items():
        if name in layout.dropped:
            continue
        if name in layout.top:
            out[layout.top[name]] = t
            continue
        m = _LAYER.fullmatch(name)
        assert m is not None  # layout_of checked every name
        hf = layout.layer[m.group(2)]
        if hf in (_Q, _K):
            n = heads if hf == _Q else kv
            _check_projection(
                name,
                t,
                rows=n * d,
                cols=hidden,
                what=f"{n} {'query' if hf == _Q else 'key-value'} heads of {d}",
                source=source,
            )
            t = take(t, head_spans(n, d))
        out[f"model.layers.{m.group(1)}.{hf}"] = t
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        if not shape.get("tie_word_embeddings"):
            raise MismatchError(
                f"{source}: has no output projection ('{_output(layout)}'), so the model ties it to "
                f"the embedding, but config.json does not tie them; nothing was written; set "
                f'"tie_word_embeddings": true there, or pass --config-from the config it was '
                f"trained with"
            )
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # one tensor, two names: the export leaves it out
    return out


def _output(layout: Layout) -> str:
    return next(k for k, v in layout.top.items() if v == "lm_head.weight")


def _check_projection(name: str, t: Any, *, rows: int, cols: int, what: str, source: str) -> None:
    shape = tuple(int(s) for s in t.shape)
    if shape != (rows, cols):
        raise MismatchError(
            f"{source}: '{name}' is {list(shape)}, not [{rows}, {cols}] ({what}, hidden size {cols}, "
            f"as config.json says); nothing was written; pass --config-from the folder of the "
            f"config it was trained with"
        )


@dataclass
class Mapped:
    """A Llama-family checkpoint's model state in transformers' names, and what was done to it."""

    state: OrderedDict[str, Any]
    layout: Layout
    renamed: frozenset[str]  # transformers' names that are not the source's
    notes: list[str] = field(default_factory=list)


def model_state(tree: Any, config: Any, *, source: str, entry: str | None = None) -> Mapped | None:
    """The model state of checkpoint ``tree`` in transformers' names when it is a torchtune or torchtitan Llama;
    None when its names are none of theirs. torchtitan's DCP folders keep the model's tensors at the top, beside
    ``optimizer``, ``train_state``, ``lr_scheduler`` and ``dataloader``: those are left out. ``config`` (a
    transformers config) gives heads and head size; one that is no Llama is refused."""
    from ckptfix.loading.model import model_state_of

    if entry is None and isinstance(tree, Mapping) and is_tensor(tree.get("tok_embeddings.weight")):
        state: Mapping[str, Any] = {k: v for k, v in tree.items() if isinstance(k, str) and is_tensor(v)}
        beside = sorted(str(k) for k in tree if k not in state)
    else:
        state, beside = model_state_of(tree, source=source, entry=entry), []
    layout = layout_of(state, source=source)
    if layout is None:
        return None
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_TYPES:
        raise UsageError(
            f"{source}: holds {layout.name} Llama names, but config.json describes model_type "
            f"{kind!r}; pass --config-from the folder of the Llama config.json it was trained "
            f"with"
        )
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    shape = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or hidden // heads),
        "hidden_size": hidden,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
    }
    notes = [
        f"{layout.name} names mapped to transformers' Llama names; q_proj and k_proj rows reordered per head "
        f"from Meta's rotary layout to rotate_half's"
    ]
    if beside:
        notes.append(always(f"left out the training state beside the model: {', '.join(beside)}"))
    mapped = hf_state(state, shape, layout=layout, source=source)
    return Mapped(mapped, layout, frozenset(k for k in mapped if k not in state), notes)


__all__ = ["LAYOUTS", "Layout", "Mapped", "head_spans", "hf_state", "layout_of", "model_state"]
