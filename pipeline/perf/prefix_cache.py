"""`pipeline bench prefix-cache`: one rollout-like generation call through the offline vLLM engine with prefix
caching on and off: wall time, generated tokens and the cache's hit rate of each.

The prompts are a run config's workflow prompts as its rollout renders them (default configs/mixed-choice.yaml: the
system text, the contract and the menu's three designs with their code, then the query, then the assistant turn's
opening), for the first queries of its training split, sampled n times each as a rollout does. Every query's prompt
shares the long opening, and vLLM fans a prompt's n samples out into n requests that share all of it, so most prompt
tokens can come from the cache, in whole KV blocks (`--block-size`: a third engine with that block, beside vLLM's
default). Each timed call starts from an empty cache (`LLM.reset_prefix_cache`), as a
stage's new engine does; the two engines run one after the other in this process, each its best of `reps` calls
after a warm-up. Every request is seeded, so the sides draw the same samples where their arithmetic agrees: each side
after the first says how many of its samples are token for token the first side's, and the largest difference of a
sampled token's log-probability over the tokens before two samples part (the cache changes the order of floating-point
sums, not what is computed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import load_config
from pipeline.engines.benchmarks import load_benchmark
from pipeline.engines.generation import Sampling
from pipeline.engines.models import load_tokenizer
from pipeline.engines.prefix_cache import CacheCounts
from pipeline.engines.prompting import load_design, render, workflow_prompt
from pipeline.stages.sampling import opening

MODEL = "embedded:smollm2-135m-instruct"
CONFIG = Path("configs/mixed-choice.yaml")


@dataclass(frozen=True)
class Side:
    caching: bool
    block_size: int | None  # the engine's KV block (None: vLLM's default, 128 tokens on CPU)
    wall_s: float  # best of the timed calls
    generated: int  # completion tokens of a call
    counts: CacheCounts | None  # the cache's counts over one call (None: the engine keeps none)
    samples: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()  # the last call's (token ids, log-probs)


def rollout_prompts(config: Path, tokenizer, count: int) -> list[str]:
    """The first `count` training queries' workflow prompts of `config`'s rollout, rendered as the rollout renders
    them (no exemplars: round 0)."""
    cfg = load_config(config)
    bench = load_benchmark(cfg.benchmark)
    items = bench.items()[:count]  # the train split, as a round's rollout takes it
    menu = [load_design(p) for p in cfg.rollout.example_menu]
    prompt_dir = cfg.rollout.prompt_dir
    return [render(tokenizer, workflow_prompt(it.prompt, bench.family, prompt_dir=prompt_dir, menu=menu), None,
                   prompt_dir) + opening(cfg.rollout, None) for it in items]


def measure(model: str, prompts: list[str], sampling: Sampling, caching: bool, reps: int,
            max_model_len: int, block_size: int | None = None) -> Side:
    from pipeline.engines.generation.vllm_offline import VLLMGenerator

    gen = VLLMGenerator(model, enable_prefix_caching=caching, max_model_len=max_model_len, block_size=block_size)
    try:
        best, generated, counts, samples = float("inf"), 0, None, ()
        for rep in range(reps + 1):  # the first call warms up
            gen.llm.reset_prefix_cache()  # a stage's engine starts empty
            before = gen.cache_counts()
            started = time.perf_counter()
            rows = gen.generate(prompts, sampling)
            wall = time.perf_counter() - started
            after = gen.cache_counts()
            generated = sum(len(c.token_ids) for row in rows for c in row)
            counts = after - before if before is not None and after is not None else None
            samples = tuple((tuple(c.token_ids), tuple(c.token_logprobs or ())) for row in rows for c in row)
            if rep:
                best = min(best, wall)
        return Side(caching, block_size, best, generated, counts, samples)
    finally:
        gen.close()


def main(config: Path = CONFIG, model: str = MODEL, prompts: int = 8, samples: int = 4, max_new_tokens: int = 32,
         reps: int = 2, max_model_len: int = 2048, block_size: int | None = None, echo=print) -> list[Side]:
    tokenizer = load_tokenizer(model)
    texts = rollout_prompts(config, tokenizer, prompts)
    lengths = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
    shared = len(_common_prefix([tokenizer(t, add_special_tokens=False).input_ids for t in texts]))
    sampling = Sampling(n=samples, temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    echo(f"{model}: {len(texts)} prompts of {config} ({min(lengths)}-{max(lengths)} tokens, {shared} shared by all) "
         f"x n={samples}, max_new_tokens={max_new_tokens}; best of {reps} calls after a warm-up, each from an empty "
         "cache")
    plan = [(True, None)] + ([(True, block_size)] if block_size is not None else []) + [(False, None)]
    sides = [measure(model, texts, sampling, caching, reps, max_model_len, block) for caching, block in plan]
    for side in sides:
        cache = side.counts.describe() if side.counts is not None else "no counts"
        block = f", {side.block_size}-token blocks" if side.block_size is not None else ""
        echo(f"  prefix caching {'on ' if side.caching else 'off'}{block}: {side.wall_s:7.2f} s, {side.generated} "
             f"tokens generated, {cache}")
    off = sides[-1]
    for on in sides[:-1]:
        block = f" ({on.block_size}-token blocks)" if on.block_size is not None else ""
        echo(f"  off/on{block} wall time: {off.wall_s / on.wall_s:.2f}x")
    for side in sides[1:]:
        same, total, gap = agreement(sides[0].samples, side.samples)
        label = f"{side.block_size}-token blocks" if side.block_size is not None else (
            "caching " + ("on" if side.caching else "off"))
        echo(f"  {label} against the first side: {same} of {total} samples token for token the same; largest "
             f"log-probability difference before two samples part {gap:.2e}")
    return sides


def agreement(first, other) -> tuple[int, int, float]:
    """Samples of two sides (the same seeded requests in the same order): how many are the same tokens, of how many,
    and the largest |difference| of a sampled token's log-probability over the tokens the two agree on before they
    part (0.0 where no log-probabilities were kept)."""
    same, gap = 0, 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(first, other, strict=True):
        same += ids_a == ids_b
        for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)):  # up to the shorter
            if x != y:
                break
            if i < len(lp_a) and i < len(lp_b):
                gap = max(gap, abs(lp_a[i] - lp_b[i]))
    return same, len(first), gap


def _common_prefix(rows: list[list[int]]) -> list[int]:
    first = rows[0]
    end = next((i for i in range(len(first)) if any(len(r) <= i or r[i] != first[i] for r in rows)), len(first))
    return first[:end]
