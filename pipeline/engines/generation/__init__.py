"""Generation backends behind one interface: `make_generator(cfg.generator, ...)` -> a `Generator`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.engines.generation.base import Completion, GenerationError, Generator, Sampling, adapter_id

if TYPE_CHECKING:
    from pipeline.config import GeneratorConfig

BACKENDS = ("transformers", "vllm", "openai")


def make_generator(cfg: GeneratorConfig, *, enable_lora: bool = False, max_model_len: int | None = None) -> Generator:
    """Load the configured backend. `enable_lora`: the vLLM engine must accept adapters (decided at start)."""
    from pipeline.engines.hardware import resolve_dtype

    if cfg.backend == "transformers":
        from pipeline.engines.generation.hf import TransformersGenerator

        return TransformersGenerator(cfg.model, dtype=resolve_dtype(cfg.dtype, what="generator"))
    if cfg.backend == "vllm":
        from pipeline.engines.generation.vllm_offline import VLLMGenerator

        return VLLMGenerator(
            cfg.model, dtype=resolve_dtype(cfg.dtype, what="generator"), enable_lora=enable_lora,
            max_lora_rank=cfg.max_lora_rank,
            max_model_len=max_model_len or cfg.max_model_len, enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
            seed=cfg.seed, enable_prefix_caching=cfg.enable_prefix_caching, block_size=cfg.block_size,
        )
    if cfg.backend == "openai":
        from pipeline.config import server_urls
        from pipeline.engines.generation.openai_server import OpenAIGenerator

        # a call of batch_size prompts is in flight at once, spread over the servers
        return OpenAIGenerator(cfg.model, server_urls(cfg.base_url, cfg.endpoints), cfg.served_model,
                               cfg.api_key_env, concurrency=cfg.batch_size)
    raise GenerationError(f"unknown generation backend {cfg.backend!r}; use one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Completion", "GenerationError", "Generator", "Sampling", "adapter_id", "make_generator"]
