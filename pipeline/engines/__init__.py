"""The engines a stage drives: generation backends (`generation/`), the sandbox (`sandbox/`), benchmarks and
their metrics (`benchmarks/`), executor clients (`executors.py`), managed model servers, model files
(`models.py`), prompts and their rendering (`prompting.py`, `prompts/`), the workflow contract (`workflow.py`),
generation-time workflow runs (`checks.py`) and the LLM judge (`judge.py`). Nothing here reads the store."""
