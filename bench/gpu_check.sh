#!/usr/bin/env bash
# The GPU checks in one run, about 5 minutes on one H100 (16 CPUs): the GPU load benchmark first, on a quiet
# machine; then, side by side, the fast test tier (GPU visible) and the GPU runs: the demo, the trainer's three
# modes (DDP with --sync-bn on NCCL, one rank per GPU), a bitwise resume with --deterministic, their checkpoints
# converted and validated against the plain model, and save_for_ddp/load_for_ddp on NCCL.
#
#   bash bench/gpu_check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default python3)
#   GPU_CHECK_BENCH=0 bash bench/gpu_check.sh  (everything but the load benchmark: about 4 minutes, for a session
#                                              with little device time left)
#
# Works from a checkout with no install (the checkout goes on PYTHONPATH). Prints PASS/FAIL per step and the
# README's "Tested on GPU" row; each step's log is in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/ckptfix-gpu-check}}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/ckptfix-gpu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
started=$(date +%s)

ckptfix() { "$PY" -m ckptfix "$@"; }

environment() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'cpus', __import__('os').cpu_count())"
  "$PY" -X importtime -c "from ckptfix.cli import main" 2>&1 | grep -B3 -w tempfile || echo "start-up: no tempfile"
}

trainer() {
  set -e
  local gpus
  gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  ckptfix train --mode single --epochs 2 --out "$WORK/single" --deterministic
  ckptfix train --mode dp --epochs 2 --out "$WORK/dp" --save-layout wrapped
  ckptfix train --mode ddp --nproc-per-node "$gpus" --sync-bn --epochs 2 --out "$WORK/ddp" --save-layout wrapped
  # a run stopped after one epoch and resumed is the uninterrupted run, bit for bit, on the GPU
  ckptfix train --mode single --epochs 1 --out "$WORK/first" --deterministic
  ckptfix train --mode single --epochs 2 --out "$WORK/resumed" --deterministic --resume "$WORK/first/checkpoint.pt"
  "$PY" - "$WORK" <<'EOF'
import sys, torch, ckptfix
work = sys.argv[1]
a, b = ckptfix.load(f"{work}/single/checkpoint.pt"), ckptfix.load(f"{work}/resumed/checkpoint.pt")
assert list(a["model"]) == list(b["model"])
bad = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
assert not bad, f"resume is not bitwise on the GPU: {bad[:3]}"
print("resume: bitwise equal to the uninterrupted run,", len(a["model"]), "tensors")
EOF
  for mode in single dp ddp; do
    ckptfix convert "$WORK/$mode/checkpoint.pt" "$WORK/$mode.safetensors" --to single --model-only
    ckptfix convert "$WORK/$mode/checkpoint.pt" "$WORK/$mode-nofast.pt" --to single --no-fast
    ckptfix validate "$WORK/$mode.safetensors" --model ckptfix.trainer.model:build_model
    ckptfix validate "$WORK/$mode-nofast.pt" --model ckptfix.trainer.model:build_model
  done
  ckptfix inspect "$WORK/ddp/checkpoint.pt"
}

step() {  # step NAME COMMAND...: runs it, logs to OUT_DIR/NAME.log, records PASS/FAIL
  local name=$1 t0=$SECONDS
  shift
  if "$@" >"$OUT_DIR/$name.log" 2>&1; then echo "PASS $name ($((SECONDS - t0)) s)"; else echo "FAIL $name (exit $?, $((SECONDS - t0)) s)"; fi \
    >"$WORK/$name.result"
}

step environment environment
cat "$OUT_DIR/environment.log"
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  step gpu_load timeout 240 "$PY" bench/bench_gpu_load.py --gb 1.6 4.3 --rounds 2 --out "$OUT_DIR/gpu_load.md"
fi
if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n "$(($(nproc) - 2))"); else workers=(); fi
step fast_tier timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" &
fast=$!
step demo timeout 240 "$PY" -m ckptfix.demo
export -f ckptfix trainer
export PY WORK
step trainer timeout 240 bash -c trainer
step nccl_ddp timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$("$PY" -c \
  'import torch; print(torch.cuda.device_count())')" bench/gpu_ddp_check.py "$WORK"
wait "$fast"

cat "$WORK"/*.result | tee "$OUT_DIR/summary.txt"
tail -n 3 "$OUT_DIR/fast_tier.log" "$OUT_DIR/demo.log"
grep -h "gpu_ddp_check\]" "$OUT_DIR/nccl_ddp.log"
cat "$OUT_DIR/gpu_load.md" 2>/dev/null
result=$(if grep -q FAIL "$WORK"/*.result; then echo FAIL; else echo PASS; fi)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
versions=$("$PY" -c "import sys, torch; print(torch.__version__, '|', sys.version.split()[0])")
passed=$(grep -Eo '[0-9]+ passed' "$OUT_DIR/fast_tier.log" | tail -n 1)
bench=$(if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then echo ", benchmark"; fi)
echo "| $gpu | $versions | $(date +%Y-%m-%d) | $result: demo, fast tier ($passed), trainer, NCCL$bench in $(($(date +%s) - started)) s |" \
  | tee -a "$OUT_DIR/summary.txt"
[ "$result" = PASS ]
