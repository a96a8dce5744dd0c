"""``ckptfix convert RUN out/ --format hf`` against the usual routes and a plain copy: wall time and peak RSS, each
method in its own process, median of N, the methods taking turns.

``python bench/bench_hf_export.py [--source dcp|zero3] [--layers 16] [--repeat 3]``: a Llama of hidden size 1024 and
``--layers`` layers (16: 1.08 GB of fp32 weights, untied), saved

- ``dcp``: as a one-process DCP folder with its ``config.json`` beside it; against torch's ``dcp_to_torch_save`` +
  ``save_pretrained`` and ``cp -r`` + ``sync`` of the folder;
- ``zero3``: by DeepSpeed ZeRO-3 on 2 gloo ranks after one training step (``tests/hf_runs.py``'s ``write_zero3``,
  the CPU accelerator; its ``config.json`` in the run folder, where HF Trainer leaves it); against DeepSpeed's own
  ``get_fp32_state_dict_from_zero_checkpoint`` (what ``zero_to_fp32.py`` runs) + ``save_pretrained``, and ``cp`` +
  ``sync`` of the weights' bytes (the exported ``model.safetensors``: the run folder holds the Adam moments too).

Then exported by each method into a fresh folder; the two exports load with ``from_pretrained`` to equal logits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import measured  # bench/measure.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
import sys, transformers
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
    num_key_value_heads=16, num_hidden_layers=int(sys.argv[1]), architectures=["LlamaForCausalLM"])
"""
MAKE = (
    CONFIG
    + """
import torch
from ckptfix.torchcompat import dcp_save_local
torch.manual_seed(0)
cfg.save_pretrained("run")
dcp_save_local({"model": transformers.LlamaForCausalLM(cfg).state_dict()}, checkpoint_id="run/dcp")
"""
)
MAKE_ZERO3 = (
    CONFIG
    + """
from pathlib import Path
from tests.hf_runs import write_zero3
write_zero3(Path("run"), "LlamaForCausalLM", cfg.to_dict())
cfg.save_pretrained("run")
"""
)
REFERENCE = """
import torch, transformers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save("run/dcp", "ref.pt")
cfg = transformers.AutoConfig.from_pretrained("run")
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
model.load_state_dict(torch.load("ref.pt", weights_only=True, mmap=True)["model"], assign=True)
model.save_pretrained("out")
"""
REFERENCE_ZERO3 = """
import torch, transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
state = get_fp32_state_dict_from_zero_checkpoint("run")
cfg = transformers.AutoConfig.from_pretrained("run")
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
model.load_state_dict(state, assign=True)
model.save_pretrained("out")
"""
CHECK = """
import sys, torch, transformers
a = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1])
b = transformers.LlamaForCausalLM.from_pretrained(sys.argv[2])
ids = torch.arange(16).reshape(1, 16)
assert torch.equal(a(ids).logits, b(ids).logits), "the outputs differ"
"""


def _methods(source: str, py: str) -> dict[str, list[str]]:
    start = {"python -c 'import torch, transformers' (start-up alone)": [py, "-c", "import torch, transformers"]}
    if source == "dcp":
        export = [py, "-m", "ckptfix", "convert", "run/dcp", "out/", "--format", "hf"]
        return {"cp -r run/dcp + sync": ["sh", "-c", "cp -r run/dcp out && sync"], **start,
                "ckptfix convert run/dcp out/ --format hf": export, "… --shard-size 200MB": [*export, "--shard-size",
                "200MB"], "dcp_to_torch_save + torch.load + save_pretrained": [py, "-c", REFERENCE]}  # fmt: skip
    export = [py, "-m", "ckptfix", "convert", "run", "out/", "--format", "hf"]
    copy = "mkdir out && cp ckptfix_out/model.safetensors out/ && sync"
    return {"ckptfix convert run out/ --format hf": export,  # first: its output is what cp copies
            "cp + sync of its model.safetensors": ["sh", "-c", copy], **start,
            "get_fp32_state_dict_from_zero_checkpoint + save_pretrained": [py, "-c", REFERENCE_ZERO3]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", choices=["dcp", "zero3"], default="dcp")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    py = sys.executable
    env = dict(
        os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    methods = _methods(args.source, py)
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        work = Path(tmp)
        measured([py, "-c", MAKE if args.source == "dcp" else MAKE_ZERO3, str(args.layers)], env=env, cwd=work)
        weights = work / "run" / "dcp" if args.source == "dcp" else work / "run"
        size = sum(p.stat().st_size for p in weights.rglob("*") if p.is_file())
        print(f"{args.source} source: {size / 1e9:.2f} GB on disk; median of {args.repeat}, methods taking turns")
        times: dict[str, list[tuple[float, int]]] = {name: [] for name in methods}
        for turn in range(args.repeat):
            for name, argv in methods.items():
                shutil.rmtree(work / "out", ignore_errors=True)
                (work / "ref.pt").unlink(missing_ok=True)
                times[name].append(measured(argv, env=env, cwd=work))
                if turn == 0 and name.startswith("ckptfix convert"):
                    shutil.copytree(work / "out", work / "ckptfix_out")
                if turn == 0 and name.endswith("save_pretrained"):  # the two folders load equal
                    measured([py, "-c", CHECK, "ckptfix_out", "out"], env=env, cwd=work)
        written = (work / "ckptfix_out" / "model.safetensors").stat().st_size
        print(f"weights written: {written / 1e9:.2f} GB")
        base_name = next(n for n in methods if n.startswith("cp"))
        base = statistics.median(w for w, _ in times[base_name])
        print(f"| method | wall s | × `{base_name}` | peak RSS MB |\n|---|---:|---:|---:|")
        for name, runs in times.items():
            wall = statistics.median(w for w, _ in runs)
            rss = statistics.median(r for _, r in runs)
            print(f"| `{name}` | {wall:.2f} | {wall / base:.2f} | {rss / 1e6:.0f} |")


if __name__ == "__main__":
    main()
