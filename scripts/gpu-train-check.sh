#!/usr/bin/env bash
# The train stage's GPU checks (docs/scale-out.md, GPU numbers), for a session lent a GPU machine by the device
# tool: carry .whl (the wheels docs/scale-out.md lists) and run `bash scripts/gpu-train-check.sh`; results land in
# $OUT (default ./gpu-out). 1) the train step on CUDA fp32 and bf16 against the CPU's fp32 on a random-weight
# Qwen2.5-0.5B-shaped model; 2) our step against TRL's on Qwen2.5-1.5B's shape, without and with checkpointing.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c \
  "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"; } \
  2>&1 | tee "$OUT/machine.txt"
run() { local name=$1; shift; timeout "${STEP_TIMEOUT_S:-240}" python3 -m pipeline.cli bench "$@" --json "$OUT/$name.json" 2>&1 \
  | grep -v Warning | tee "$OUT/$name.log"; }
run parity train-parity --arch qwen2-0.5b --sides cpu:fp32,cuda:fp32,cuda:bf16
run bench train --arch qwen2-1.5b --batch 8 --completion-len 512 --reps 5
run bench-gc train --arch qwen2-1.5b --batch 8 --completion-len 512 --reps 5 --gradient-checkpointing
