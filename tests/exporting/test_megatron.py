"""``convert MEGATRON_DIR OUT/ --format hf`` (ckptfix/exporting/megatron.py): each run saved by megatron-core itself
(``tests/megatron_runs.py``) exported to a folder transformers loads with no missing or unexpected key, whose logits
on a fixed input equal ``GPTModel``'s own forward (``NAME.logits.safetensors``, computed by the generator in
float32) within 1e-5; the config built from ``common.pt``'s args; the refusals of what a Llama config cannot say."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import UsageError
from ckptfix.exporting.megatron import hf_config
from tests.extras import needs
from tests.megatron_runs import FIXTURES, fixture_runs, prefixed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason=needs("transformers"))

RUNS = sorted(fixture_runs())
# every argument Megatron-LM's parser has, at its default (megatron-core 0.16.1's megatron/training/arguments.py:
# vars(parse_args()) with no flags; objects by their class's name)
MEGATRON_LM_ARGS: dict[str, Any] = json.loads((Path(__file__).parents[1] / "megatron_lm_args.json").read_text())


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("name", RUNS)
def test_hf_folder_loads_and_gives_gptmodels_logits(name: str, tmp_path: Path) -> None:
    import transformers

    out = tmp_path / "hf"
    result = run("convert", FIXTURES / name, out, "--format", "hf")
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    moe = "moe" in name
    assert config["architectures"] == ["MixtralForCausalLM" if moe else "LlamaForCausalLM"]
    cls = getattr(transformers, config["architectures"][0])
    model, info = cls.from_pretrained(out, output_loading_info=True, dtype=torch.float32, local_files_only=True)
    assert {k: v for k, v in info.items() if v} == {}
    ref = load_file(str(FIXTURES / f"{name}.logits.safetensors"))
    vocab = config["vocab_size"]
    assert vocab == 30 and ref["logits"].shape[-1] == 32  # the tokenizer's 30 of the 32 padded rows
    with torch.no_grad():
        got = model.eval()(input_ids=ref["input_ids"]).logits
    want = ref["logits"][..., :vocab]
    assert got.shape == want.shape
    # float32 kernels of two implementations (Megatron's attention and transformers') differ in the last bits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert config["tie_word_embeddings"] is (name == "tp2_fp32")
    assert config["dtype"] == ("bfloat16" if "bf16" in name else "float32")


def test_tied_output_is_left_out_and_said(tmp_path: Path) -> None:
    result = run("convert", FIXTURES / "tp2_fp32", tmp_path / "hf", "--format", "hf", "-v")
    assert result.exit_code == 0, result.output
    assert "left out 'lm_head.weight'" in result.output
    assert "config.json built from" in result.output
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.layers.1.self_attn.q_proj.weight" in keys


def _args(name: str) -> dict[str, Any]:
    from ckptfix.formats.megatron.reader import describe

    return dict(describe(str(FIXTURES / name)).args)


def test_config_from_the_runs_args() -> None:
    config, notes = hf_config(_args("moe_ep2_fp32"), source="common.pt")
    assert config["num_local_experts"] == 2 and config["num_experts_per_tok"] == 2
    assert (config["num_key_value_heads"], config["head_dim"], config["rms_norm_eps"]) == (2, 4, 1e-5)
    assert notes == []


def test_padded_vocabulary_kept_and_said_when_the_tokenizers_size_is_unknown() -> None:
    args = _args("tp2_fp32")
    del args["vocab_size"]
    config, notes = hf_config(args, source="common.pt")
    assert config["vocab_size"] == 32 and "padded size 32" in notes[0] and "--config-from" in notes[0]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"normalization": "LayerNorm"}, "not a Llama-family model (normalization='LayerNorm'"),
        ({"swiglu": False}, "not a Llama-family model (swiglu=False"),
        ({"rotary_interleaved": True}, "not a Llama-family model (rotary_interleaved=True"),
        ({"add_bias_linear": True}, "not a Llama-family model (add_bias_linear=True"),
        ({"norm_epsilon": None}, "do not say norm_epsilon, which an HF config.json needs; pass --config-from"),
    ],
)
def test_what_a_llama_config_cannot_say_is_refused_in_one_line(change: dict[str, Any], said: str) -> None:
    with pytest.raises(UsageError) as e:
        hf_config({**_args("tp2_fp32"), **change}, source="common.pt")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_args_without_what_the_config_needs(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2_fp32", folder)
    common = torch.load(folder / "common.pt", weights_only=False)  # the project's own fixture: safe to unpickle
    del common["args"].rotary_base
    torch.save(common, folder / "common.pt")
    result = run("convert", folder, tmp_path / "hf", "--format", "hf")
    assert result.exit_code != 0
    assert "do not say rotary_base" in result.output and "--config-from" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "hf").exists()


def test_config_from_cuts_the_vocabulary_it_says(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert run("convert", FIXTURES / "pp2_vpp2_bf16", first, "--format", "hf").exit_code == 0
    cfg = json.loads((first / "config.json").read_text())
    other = tmp_path / "cfg"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 20}))
    out = tmp_path / "hf"
    result = run("convert", FIXTURES / "pp2_vpp2_bf16", out, "--format", "hf", "--config-from", other)
    assert result.exit_code == 0, result.output
    weights = load_file(str(out / "model.safetensors"))
    full = load_file(str(first / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape[0] == 20 and weights["lm_head.weight"].shape[0] == 20
    assert torch.equal(weights["model.embed_tokens.weight"], full["model.embed_tokens.weight"][:20])


@pytest.mark.parametrize(("name", "dtype"), [("tp2_fp32", None), ("moe_ep2_fp32", None), ("tp2_fp32", "bf16")])
def test_streamed_export_equals_torchs_path(name: str, dtype: str | None, tmp_path: Path) -> None:
    """The split tensors streamed as byte ranges of the fused ones (or gathered, or cast a block at a time) are the
    bytes torch's path writes from the loaded model."""
    import ckptfix

    streamed = ckptfix.export_hf(FIXTURES / name, tmp_path / "s", dtype=dtype)
    loaded = ckptfix.export_hf(FIXTURES / name, tmp_path / "t", dtype=dtype, fast=False)
    assert streamed.method == "stream" and loaded.method == "torch"
    got, want = (
        load_file(str(tmp_path / "s" / "model.safetensors")),
        load_file(str(tmp_path / "t" / "model.safetensors")),
    )
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert (tmp_path / "s" / "config.json").read_text() == (tmp_path / "t" / "config.json").read_text()


def test_an_output_layer_of_its_own_under_a_config_that_ties_it_is_refused(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert run("convert", FIXTURES / "moe_ep2_fp32", first, "--format", "hf").exit_code == 0
    other = tmp_path / "cfg"
    other.mkdir()
    cfg = json.loads((first / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    result = run("convert", FIXTURES / "moe_ep2_fp32", tmp_path / "hf", "--format", "hf", "--config-from", other, "-v")
    assert result.exit_code == 1, result.output  # from_pretrained would drop the trained output layer
    assert "holds 'lm_head.weight' apart from 'model.embed_tokens.weight', with other values" in result.output
    assert '"tie_word_embeddings": false' in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_verify_loads_the_folder_and_compares_with_the_mapped_source(tmp_path: Path) -> None:
    result = run("convert", FIXTURES / "tp2_bf16", tmp_path / "hf", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    said = ("verified: from_pretrained loads every key; its logits equal those of the Megatron weights as ckptfix "
            "maps them, in a LlamaForCausalLM built from the written config (largest difference 0); Megatron's own "
            "forward was not run")  # fmt: skip
    assert said in result.output and "equal the source's" not in result.output


def test_a_config_whose_heads_do_not_fit_the_fused_qkv_is_refused(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert run("convert", FIXTURES / "tp2_fp32", first, "--format", "hf").exit_code == 0
    other = tmp_path / "cfg"
    other.mkdir()
    cfg = json.loads((first / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    result = run("convert", FIXTURES / "tp2_fp32", tmp_path / "hf", "--format", "hf", "--config-from", other)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "'decoder.layers.0.self_attention.linear_qkv.weight' has 32 rows, not 48" in result.output
    assert not (tmp_path / "hf").exists()


def with_args(tmp_path: Path, name: str, *, base: dict[str, Any] | None = None, **change: Any) -> Path:
    """A copy of run ``name`` whose common.pt's args (a Namespace Megatron's writer saved) say ``change``, over
    ``base`` (arguments the run's own values win over); rewritten by torch.save, as Megatron-LM writes it."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    common = torch.load(folder / "common.pt", weights_only=False)  # the project's own fixture: safe to unpickle
    args = vars(common["args"])
    args.update({**(base or {}), **args, **change})
    torch.save(common, folder / "common.pt")
    return folder


def test_every_megatron_lm_argument_at_its_default_exports_as_without_them(tmp_path: Path) -> None:
    folder = with_args(tmp_path, "tp2_fp32", base=MEGATRON_LM_ARGS)
    assert run("convert", folder, tmp_path / "hf", "--format", "hf").exit_code == 0
    assert run("convert", FIXTURES / "tp2_fp32", tmp_path / "plain", "--format", "hf").exit_code == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


@pytest.mark.parametrize(
    "change",
    [
        {"apply_residual_connection_post_layernorm": True},
        {"window_size": (4, 0)},
        {"rotary_seq_len_interpolation_factor": 2.0},
        {"softmax_type": "off-by-one"},
        {"moe_expert_capacity_factor": 1.0},
        {"an_argument_of_a_later_megatron_lm": 3},
    ],
)
@pytest.mark.parametrize("config_from", [False, True])
def test_an_argument_that_changes_the_forward_is_refused_by_name(
    change: dict[str, Any], config_from: bool, tmp_path: Path
) -> None:
    folder = with_args(tmp_path, "tp2_fp32", base=MEGATRON_LM_ARGS, **change)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    extra: list[Any] = []
    if config_from:
        assert run("convert", FIXTURES / "tp2_fp32", tmp_path / "cfg", "--format", "hf").exit_code == 0
        extra = ["--config-from", tmp_path / "cfg"]
    result = run("convert", folder, tmp_path / "hf", "--format", "hf", *extra)
    ((name, value),) = change.items()
    said = f"{name}={list(value) if isinstance(value, tuple) else value!r}"
    assert result.exit_code == 2, result.output
    assert f"common.pt: its args say {said}, which changes the model's forward" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists() and {p.name: p.read_bytes() for p in folder.iterdir()} == before


def _norms(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in state if k.endswith("norm.weight")]


@pytest.mark.parametrize("flag", ["apply_layernorm_1p", "layernorm_zero_centered_gamma"])
def test_a_zero_centred_norm_is_written_as_weight_plus_one(flag: str, tmp_path: Path) -> None:
    """Megatron's norm multiplies by ``weight + 1`` (Transformer Engine adds it in float32): transformers' norm by its
    weight, which the export makes so; everything else as without the argument."""
    folder = with_args(tmp_path, "tp2_fp32", **{flag: True})
    done = ckptfix.export_hf(folder, tmp_path / "hf")
    assert done.method == "torch" and any("weight + 1" in n for n in done.notes)
    assert run("convert", FIXTURES / "tp2_fp32", tmp_path / "plain", "--format", "hf").exit_code == 0
    got, plain = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "plain" / "model.safetensors")),
    )
    assert set(got) == set(plain) and len(_norms(got)) == 5  # two per layer and the final one
    for key, value in plain.items():
        want = value + 1 if key in _norms(plain) else value
        assert got[key].dtype == torch.float32 and torch.equal(got[key], want), key


def test_a_zero_centred_bf16_norm_is_refused_unless_the_export_is_float32(tmp_path: Path) -> None:
    folder = with_args(tmp_path, "tp2_bf16", apply_layernorm_1p=True)
    result = run("convert", folder, tmp_path / "hf", "--format", "hf")
    assert result.exit_code == 2 and "Traceback" not in result.output and not (tmp_path / "hf").exists()
    assert "apply_layernorm_1p=True" in result.output and "export with --dtype float32" in result.output
    result = run("convert", folder, tmp_path / "hf", "--format", "hf", "--dtype", "float32", "--verify")
    assert result.exit_code == 0, result.output
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    stored = ckptfix.load(FIXTURES / "tp2_bf16")
    assert torch.equal(got["model.norm.weight"], stored["decoder.final_layernorm.weight"].float() + 1)


def test_a_wrapped_models_prefixed_run_exports_as_the_plain_one(tmp_path: Path) -> None:
    folder = prefixed(FIXTURES / "moe_ep2_fp32", tmp_path / "run", "module.")
    result = run("convert", folder, tmp_path / "hf", "--format", "hf", "--verify")
    assert result.exit_code == 0, result.output
    assert run("convert", FIXTURES / "moe_ep2_fp32", tmp_path / "plain", "--format", "hf").exit_code == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


# ----------------------------------------------------------------------------------------------------------------------
# A bf16 Megatron-Core run exported with ``convert DIR OUT/ --format hf`` (no ``--dtype``: the run's own bf16) and
# loaded in bf16 gives ``GPTModel``'s own bf16 forward (``logits_bf16`` in ``NAME.logits.safetensors``, computed by
# ``tests/megatron_runs.py`` with the run's weights in the run's dtype), compared in bf16.
#
# Not bit for bit: each implementation rounds its intermediates to bf16 at other places (Megatron's TE-free CPU path:
# its own RMSNorm, rotary embedding and ``DotProductAttention``; transformers' Llama: RMSNorm and rotary computed in
# float32 and cast, ``sdpa`` attention). Measured on the fixtures (torch 2.13 CPU, transformers 5.23): at most 1 bf16
# step of the largest logit apart (tp2_bf16: 0.0039 with logits up to 0.59, a step there 2**-8; pp2_vpp2_bf16 and
# tp2_pp2_bf16: 0.0078 with logits up to 2.25 and 2.55, a step there 2**-6), about half of the 240 logits differing;
# each bf16 forward is as far from the float32 one (0.002-0.008). The test allows 2 steps.


BF16_RUNS = sorted(name for name, made in fixture_runs().items() if made["dtype"] == "bf16")


def bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers at ``value`` (8 significant bits): 2**-8 in [0.5, 1), 2**-6 in [2, 4)."""
    return 2.0 ** (math.floor(math.log2(value)) - 7)


def test_every_bf16_run_has_megatrons_bf16_forward() -> None:
    assert len(BF16_RUNS) >= 3  # TP 2 (Adam), PP 2 x VPP 2, TP 2 x PP 2
    for name in BF16_RUNS:
        ref = load_file(str(FIXTURES / f"{name}.logits.safetensors"))
        assert ref["logits_bf16"].dtype == torch.bfloat16 and ref["logits"].dtype == torch.float32
        assert ref["logits_bf16"].shape == ref["logits"].shape


@pytest.mark.parametrize("name", BF16_RUNS)
def test_bf16_export_loaded_in_bf16_gives_gptmodels_bf16_logits(name: str, tmp_path: Path) -> None:
    import transformers

    out = tmp_path / "hf"
    result = run("convert", FIXTURES / name, out, "--format", "hf")
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in list(f.keys())} == {"BF16"}  # the run's own bytes, not cast
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=torch.bfloat16, local_files_only=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    ref = load_file(str(FIXTURES / f"{name}.logits.safetensors"))
    with torch.no_grad():
        got = model.eval()(input_ids=ref["input_ids"]).logits
    want = ref["logits_bf16"][..., : config["vocab_size"]]
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    # two bf16 steps at the largest logit: the rounding of two implementations' bf16 intermediates (see above)
    tolerance = 2 * bf16_step(want.float().abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
