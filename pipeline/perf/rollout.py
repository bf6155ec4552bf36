"""`pipeline bench rollout`: generated tokens/s of each available backend against its raw engine on the same
rendered prompts, in the same process (goal: <= 5% overhead).

- transformers: `TransformersGenerator.generate` vs raw `model.generate` (same seed, so the same tokens).
- vllm: `VLLMGenerator.generate` vs raw `vllm.LLM.generate` on the same engine, with the same SamplingParams
  (logprobs=0) and without logprobs (what the sampled-token logprobs themselves cost).
- openai: with `--openai-url` (a running vLLM server): the backend vs raw `completions.create` calls, one per
  prompt and concurrent like the backend, with the backend's exact request and with a plain text request.
Each side runs `reps` times alternating, after a warm-up; the best wall and CPU times of each are compared.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from pipeline.engines.generation import GenerationError, Sampling
from pipeline.engines.models import load_causal_lm, load_tokenizer
from pipeline.engines.prompting import render, workflow_prompt

MODEL = "embedded:smollm2-135m-instruct"


def bench_prompts(tokenizer, count: int) -> list[str]:
    problems = [f"What is {3 * i + 4} + {7 * i + 2} - {i + 1}?" for i in range(count)]
    return [render(tokenizer, workflow_prompt(p, "procedural")) for p in problems]


def best_of(fns: dict[str, Callable[[], int]], reps: int) -> dict[str, tuple[float, float, int]]:
    """Best wall time, best process CPU time and the token count of each callable, run alternately `reps`
    times after one warm-up. CPU time is less disturbed by other processes on a shared machine."""
    for call in fns.values():
        call()
    best: dict[str, tuple[float, float, int]] = {}
    for _ in range(reps):
        for name, call in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = call()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            old = best.get(name, (dt, dc, tokens))
            best[name] = (min(dt, old[0]), min(dc, old[1]), tokens)
    return best


def report(backend: str, results: dict[str, tuple[float, float, int]], baseline: str) -> None:
    base_wall, base_cpu, base_tokens = results[baseline]
    for name, (dt, dc, tokens) in results.items():
        wall = 100 * ((base_tokens / base_wall) / (tokens / dt) - 1)
        cpu = 100 * ((base_tokens / base_cpu) / (tokens / dc) - 1)
        print(f"{backend:12s} {name:28s} {tokens:6d} tok {dt:7.2f} s {tokens / dt:8.1f} tok/s "
              f"{tokens / dc:8.1f} tok/cpu-s | overhead vs {baseline}: wall {wall:+6.1f}% cpu {cpu:+6.1f}%")


def bench_transformers(prompts: list[str], sampling: Sampling, reps: int) -> None:
    import torch

    from pipeline.engines.generation.hf import TransformersGenerator

    gen = TransformersGenerator(MODEL)
    enc = gen.encode(prompts)
    width = enc["input_ids"].shape[1]
    eos = gen.tokenizer.eos_token_id

    def raw() -> int:
        torch.manual_seed(sampling.seed)
        out = gen.model.generate(**enc, do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=0, max_new_tokens=sampling.max_new_tokens, num_return_sequences=sampling.n,
                                 pad_token_id=gen.tokenizer.pad_token_id)
        completion = out[:, width:]
        # count like the backend: up to and including the first EOS
        stops = (completion == eos).int().argmax(1)
        has = (completion == eos).any(1)
        return int(torch.where(has, stops + 1, completion.shape[1]).sum())

    def backend() -> int:
        return sum(len(c.token_ids) for row in gen.generate(prompts, sampling) for c in row)

    # a round >= 1 samples with the previous round's LoRA adapter: merged once into a copy of the base weights,
    # so it must cost no more per token than the base model (an unmerged adapter adds its matmuls to every step)
    import tempfile

    from peft import LoraConfig, get_peft_model

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        lora = get_peft_model(load_causal_lm(MODEL, device="cpu"), LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        lora.save_pretrained(tmp)  # B = 0: the same tokens as the base model, so the token counts match
        with_adapter = TransformersGenerator(MODEL)

        def adapted() -> int:
            return sum(len(c.token_ids) for row in with_adapter.generate(prompts, sampling, tmp) for c in row)

        report("transformers", best_of({"raw model.generate": raw, "TransformersGenerator": backend,
                                        "TransformersGenerator+LoRA": adapted}, reps), "raw model.generate")


def bench_vllm(prompts: list[str], sampling: Sampling, reps: int) -> None:
    from pipeline.engines.generation.vllm_offline import VLLMGenerator, cpu_defaults, engine_kwargs, import_vllm

    vllm = import_vllm()
    cpu_defaults()
    llm = vllm.LLM(**engine_kwargs(MODEL, max_model_len=2048))
    gen = VLLMGenerator(MODEL, llm=llm)
    inputs = gen.inputs(prompts)

    def raw(logprobs: bool) -> Callable[[], int]:
        params = gen.params(sampling, len(prompts))  # the backend's SamplingParams, optionally without logprobs
        for p in params:
            p.logprobs = 0 if logprobs else None
        return lambda: sum(len(c.token_ids) for o in llm.generate(inputs, params, use_tqdm=False) for c in o.outputs)

    def backend() -> int:
        return sum(len(c.token_ids) for row in gen.generate(prompts, sampling) for c in row)

    report("vllm", best_of({"raw LLM.generate logprobs=0": raw(True), "raw LLM.generate no logprobs": raw(False),
                            "VLLMGenerator": backend}, reps), "raw LLM.generate logprobs=0")


def bench_openai(url: str, prompts: list[str], sampling: Sampling, reps: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from pipeline.config import GeneratorConfig
    from pipeline.engines.generation import make_generator

    gen = make_generator(GeneratorConfig(model=MODEL, backend="openai", base_url=url, batch_size=len(prompts)))
    client = openai.OpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY")

    def raw(same: bool) -> Callable[[], int]:
        """`same`: the exact request the backend sends (token ids, logprobs); else a plain text request."""
        def one(i_prompt: tuple[int, str]) -> int:
            kw = gen.request(gen.model, i_prompt[1], sampling, i_prompt[0])[1] if same else dict(
                model=gen.model, prompt=i_prompt[1], n=sampling.n, temperature=sampling.temperature,
                top_p=sampling.top_p, max_tokens=sampling.max_new_tokens, seed=sampling.seed + i_prompt[0])
            return client.completions.create(**kw).usage.completion_tokens

        def run() -> int:
            with ThreadPoolExecutor(len(prompts)) as pool:
                return sum(pool.map(one, enumerate(prompts)))
        return run

    def backend() -> int:
        return sum(len(c.token_ids) for row in gen.generate(prompts, sampling) for c in row)

    report("openai", best_of({"raw same request": raw(True), "raw text, no logprobs": raw(False),
                              "OpenAIGenerator": backend}, reps), "raw same request")


def main(backends: str = "transformers,vllm,openai", prompts: int = 8, n: int = 2, max_new_tokens: int = 64,
         reps: int = 2, openai_url: str | None = None) -> None:
    tokenizer = load_tokenizer(MODEL)
    texts = bench_prompts(tokenizer, prompts)
    sampling = Sampling(n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    print(f"{prompts} prompts (~{len(tokenizer(texts[0]).input_ids)} tokens) x n={n}, max_new_tokens={max_new_tokens}, "
          f"temperature 1, best of {reps}")
    wanted = {b.strip() for b in backends.split(",")}
    if "transformers" in wanted:  # first: an in-process vLLM engine lowers torch's thread count afterwards
        bench_transformers(texts, sampling, reps)
    if "vllm" in wanted:
        try:
            bench_vllm(texts, sampling, reps)
        except GenerationError as e:  # the optional tier is not installed: say so, keep the other numbers
            print(f"vllm         skipped: {e}")
    if "openai" in wanted:
        if openai_url:
            bench_openai(openai_url, texts, sampling, reps)
        else:
            print("openai       skipped: pass --openai-url of a running server (e.g. a local vLLM server)")
