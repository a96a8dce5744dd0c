"""A bf16 Megatron-Core run exported with ``convert DIR OUT/ --format hf`` (no ``--dtype``: the run's own bf16) and
loaded in bf16 gives ``GPTModel``'s own bf16 forward (``logits_bf16`` in ``NAME.logits.safetensors``, computed by
``tests/megatron_runs.py`` with the run's weights in the run's dtype), compared in bf16.

Not bit for bit: each implementation rounds its intermediates to bf16 at other places (Megatron's TE-free CPU path:
its own RMSNorm, rotary embedding and ``DotProductAttention``; transformers' Llama: RMSNorm and rotary computed in
float32 and cast, ``sdpa`` attention). Measured on the fixtures (torch 2.13 CPU, transformers 5.23): at most 1 bf16
step of the largest logit apart (tp2_bf16: 0.0039 with logits up to 0.59, a step there 2**-8; pp2_vpp2_bf16 and
tp2_pp2_bf16: 0.0078 with logits up to 2.25 and 2.55, a step there 2**-6), about half of the 240 logits differing;
each bf16 forward is as far from the float32 one (0.002-0.008). The test allows 2 steps."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file

from ckptfix.cli import cli
from tests.extras import needs
from tests.megatron_runs import FIXTURES, fixture_runs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason=needs("transformers"))

BF16_RUNS = sorted(name for name, made in fixture_runs().items() if made["dtype"] == "bf16")


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


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
