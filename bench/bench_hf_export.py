"""``ckptfix convert dcp/ out/ --format hf`` against the usual route (torch's ``dcp_to_torch_save``, ``torch.load``,
``save_pretrained``) and ``cp -r`` + ``sync``: wall time and peak RSS, each method in its own process, median of N.

``python bench/bench_hf_export.py [--layers 8] [--repeat 3]``: a Llama of hidden size 1024 and ``--layers`` layers
(8: 673 MB of fp32 weights, untied), initialised, saved as a one-process DCP folder with its ``config.json``
beside it, then exported by each method into a fresh folder. The outputs load with ``from_pretrained`` equal.
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

MAKE = """
import sys, torch, transformers
from ckptfix.torchcompat import dcp_save_local
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
    num_key_value_heads=16, num_hidden_layers=int(sys.argv[1]), architectures=["LlamaForCausalLM"])
torch.manual_seed(0)
cfg.save_pretrained("run")
dcp_save_local({"model": transformers.LlamaForCausalLM(cfg).state_dict()}, checkpoint_id="run/dcp")
"""
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
CHECK = """
import sys, torch, transformers
a = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1])
b = transformers.LlamaForCausalLM.from_pretrained(sys.argv[2])
ids = torch.arange(16).reshape(1, 16)
assert torch.equal(a(ids).logits, b(ids).logits), "the outputs differ"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    py, env = sys.executable, dict(os.environ)
    export = [py, "-m", "ckptfix", "convert", "run/dcp", "out/", "--format", "hf"]
    methods = {
        "cp -r + sync": ["sh", "-c", "cp -r run/dcp out && sync"],
        "python -c 'import torch, transformers' (start-up alone)": [py, "-c", "import torch, transformers"],
        "ckptfix convert run/dcp out/ --format hf": export,
        "… --shard-size 200MB": [*export, "--shard-size", "200MB"],
        "dcp_to_torch_save + torch.load + save_pretrained": [py, "-c", REFERENCE],
    }
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        work = Path(tmp)
        measured([py, "-c", MAKE, str(args.layers)], env=env, cwd=work)
        size = sum(p.stat().st_size for p in (work / "run" / "dcp").iterdir())
        print(f"DCP folder: {size / 1e9:.2f} GB; median of {args.repeat}, methods taking turns")
        times: dict[str, list[tuple[float, int]]] = {name: [] for name in methods}
        for turn in range(args.repeat):
            for name, argv in methods.items():
                shutil.rmtree(work / "out", ignore_errors=True)
                (work / "ref.pt").unlink(missing_ok=True)
                times[name].append(measured(argv, env=env, cwd=work))
                if turn == 0 and name.startswith("ckptfix"):
                    shutil.copytree(work / "out", work / "ckptfix_out")
                if turn == 0 and name.startswith("dcp_to"):  # the two folders load equal
                    measured([py, "-c", CHECK, "ckptfix_out", "out"], env=env, cwd=work)
        base = statistics.median(w for w, _ in times["cp -r + sync"])
        print("| method | wall s | × `cp -r` + `sync` | peak RSS MB |\n|---|---:|---:|---:|")
        for name, runs in times.items():
            wall = statistics.median(w for w, _ in runs)
            rss = statistics.median(r for _, r in runs)
            print(f"| `{name}` | {wall:.2f} | {wall / base:.2f} | {rss / 1e6:.0f} |")


if __name__ == "__main__":
    main()
