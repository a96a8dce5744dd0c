#!/usr/bin/env bash
# What `pip install ckptfix` gets, without extras: build the wheel and the sdist, install the wheel into a fresh
# venv (the CPU torch first, as the README does), check what the wheel holds, then use the installed `ckptfix`
# for every command that writes or reads a file, and run the README's DDP example. Nothing from the dev extra (numpy,
# pytest) is there, and no command may print torch's warning that numpy is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=$(mktemp -d /tmp/ckptfix-smoke.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

.venv/bin/python -m build --wheel --sdist --outdir "$WORK/dist" . > "$WORK/build.log"
WHEEL=$(ls "$WORK"/dist/ckptfix-*.whl)
ls "$WORK"/dist/ckptfix-*.tar.gz > /dev/null
.venv/bin/python - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "ckptfix/py.typed" in names, "py.typed is not in the wheel"
entry = next(n for n in names if n.endswith("entry_points.txt"))
assert "ckptfix = ckptfix.cli:main" in zipfile.ZipFile(sys.argv[1]).read(entry).decode(), "no ckptfix entry point"
PY

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch==2.13.0
"$WORK/venv/bin/pip" install -q "$WHEEL"
cd "$WORK"
if venv/bin/python -c "import numpy" 2>/dev/null; then echo "numpy is installed: the smoke test must run without it"; exit 1; fi
venv/bin/python - <<'PY'
import torch
from ckptfix.trainer.model import build_model

import torch.distributed.checkpoint as dcp

for rank in (0, 1):
    torch.manual_seed(0)
    model = build_model()
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 1}, f"rank{rank}.pt")
dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id="dcp", no_dist=True)
PY
run_ckptfix() {  # the installed command, its stderr also kept in a log that is checked at the end
  { venv/bin/ckptfix "$@" 2>&1 1>&3 | tee -a "$WORK/stderr.log" >&2; } 3>&1
}
C=run_ckptfix
$C --help > /dev/null
$C convert rank0.pt fast.safetensors --model-only
$C convert rank0.pt slow.safetensors --model-only --no-fast
$C convert rank0.pt plain.pt
$C merge rank0.pt rank1.pt -o merged.safetensors
$C inspect rank0.pt > /dev/null
$C inspect fast.safetensors > /dev/null
$C validate plain.pt --model ckptfix.trainer.model:build_model
$C validate merged.safetensors --model ckptfix.trainer.model:build_model
# folders: a DCP folder streamed into one file each way, one file into shards and back, folders merged
$C convert dcp dcp.safetensors --model-only --entry model
$C convert dcp dcp.pt
$C convert dcp.safetensors shards/ --shard-size 1KB
$C inspect shards > /dev/null
$C merge shards shards/model.safetensors.index.json -o from_shards.pt 2> /dev/null
$C validate dcp --model ckptfix.trainer.model:build_model --entry model
# transformers is the optional `hf` extra, which this venv lacks: --format hf says how to install it, in one line
if venv/bin/python -c "import transformers" 2>/dev/null; then echo "transformers is installed: the smoke test must run without it"; exit 1; fi
mkdir -p llama && echo '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}' > llama/config.json
set +e; hf=$(venv/bin/ckptfix convert plain.pt hf_out/ --format hf --config-from llama 2>&1); code=$?; set -e
[ "$code" = 2 ] && [ "$(printf '%s\n' "$hf" | wc -l)" = 1 ] && [[ "$hf" == *"pip install 'ckptfix[hf]'"* ]] && [ ! -e hf_out ] \
  || { echo "--format hf without transformers (exit $code): $hf"; exit 1; }
venv/bin/python - <<'PY'
import torch
from safetensors.torch import load_file

a, b = load_file("fast.safetensors"), load_file("slow.safetensors")
assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "fast and torch paths differ"
import ckptfix

ref = ckptfix.load("dcp")
for got in (ckptfix.load("dcp.safetensors"), ckptfix.load("dcp.pt")["model"], ckptfix.load("shards"),
            ckptfix.load("from_shards.pt")):
    assert got.keys() == ref["model"].keys() and all(torch.equal(got[k], ref["model"][k]) for k in got), "folders"
print("smoke test of the installed wheel: OK")
PY
# The README's section 5 example as a user runs it: two gloo ranks, the wheel's ckptfix, no numpy.
mkdir -p fixtures && cp "$REPO/fixtures/ddp_wrapped.pt" fixtures/
venv/bin/python - "$REPO/README.md" > train_ddp.py <<'PY'
import re, sys

print(re.search(r"```python file=train_ddp.py\n(.*?)```", open(sys.argv[1]).read(), re.S)[1], end="")
PY
out=$(venv/bin/torchrun --standalone --nproc-per-node 2 train_ddp.py 2> "$WORK/torchrun.log") || { cat "$WORK/torchrun.log"; exit 1; }
[ "$out" = "resumed after epoch 1 on 2 ranks" ] || { echo "the README's example printed: $out"; exit 1; }
echo "the README's DDP example: $out"
if grep -n NumPy "$WORK/stderr.log"; then echo "a ckptfix command printed torch's NumPy warning (above)"; exit 1; fi

# An environment that already has an older supported torch keeps it: `pip install ckptfix` must not replace a
# cluster's pinned torch with a multi-GB download. A stand-in distribution named torch 2.6.0 (metadata only: what
# pip's resolver looks at) is installed first, then the wheel; torch must still be that 2.6.0.
mkdir -p "$WORK/oldtorch/torch"
cat > "$WORK/oldtorch/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
[project]
name = "torch"
version = "2.6.0"
TOML
touch "$WORK/oldtorch/torch/__init__.py"
python3 -m venv "$WORK/pinned"
"$WORK/pinned/bin/pip" install -q "$WORK/oldtorch"
"$WORK/pinned/bin/pip" install -q "$WHEEL"
"$WORK/pinned/bin/python" - <<'PY'
from importlib.metadata import version
assert version("torch") == "2.6.0", f"pip replaced the installed torch 2.6.0 with {version('torch')}"
print("an installed torch 2.6.0 was left alone")
PY
