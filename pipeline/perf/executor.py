"""`pipeline bench executor CONFIG`: does scoring keep a served executor busy?

One server of CONFIG's `executor.serve` section is started for the whole bench. On it, side by side:
- **the server's best**: a plain concurrent client (the `openai` package, no sandbox, no workflow) sending the
  development problems as single user turns, at each concurrency of `--concurrency`; completion tokens per second
  of wall time. The best of them is the server's throughput on this machine.
- **scoring**: the real score stage (`pipeline.stages.score.score_workflows`: sandbox, grader, store writes) on a
  fixed workflow for the same problems (default: the hand-written prompt's example, generate -> run the public
  tests -> repair once, the workflow the trained generator converges to), at each `scoring.concurrency` of
  `--scoring`; executor completion tokens (`scores.tokens_out`) per second of the stage's wall time.
The ratio scoring / best plain is the figure that matters (goal >= 0.8); it picks `scoring.concurrency`.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, load_config, variant_sets
from pipeline.engines.benchmarks import load_benchmark
from pipeline.engines.servers import serving
from pipeline.run import open_run
from pipeline.stages.score import score_workflows
from pipeline.studies.baselines import write_programs, write_queries

DEFAULT_PROGRAM = Path("configs/prompts/code/example_code.txt")


async def plain_tokens_per_s(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                             temperature: float) -> dict:
    """Every prompt once, `concurrency` requests in flight; completion tokens / wall seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=900)
    sem = asyncio.Semaphore(concurrency)

    async def one(p: str) -> int:
        async with sem:
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                     max_tokens=max_tokens, temperature=temperature)
            return r.usage.completion_tokens

    t = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    wall = time.perf_counter() - t
    await client.close()
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


def scoring_tokens_per_s(config: str, sets: list[str], bench: dict[str, Any], root: str, url: str, program: str,
                         concurrency: int) -> dict:
    """The score stage on one copy of `program` per problem, with `concurrency` workflows (and requests) at once:
    CONFIG with the user's `sets`, the bench's problems (`bench`) and the served executor."""
    served = {"store.root": root, "executor.base_url": url, "executor.serve": None, "scoring.concurrency": concurrency,
              "executor.concurrency": concurrency}
    ctx = open_run(config, f"bench-executor-c{concurrency}", 0, variant_sets(bench | served, before=sets))
    queries = write_queries(ctx)
    write_programs(ctx, {q["query_id"]: [("bench", program, {})] for q in queries})
    t = time.perf_counter()
    score_workflows(ctx)
    wall = time.perf_counter() - t
    scores = ctx.store.read("scores", ctx.run_id, 0)
    tokens = int(scores["tokens_out"].sum())
    return {"concurrency": concurrency, "workflows": scores.height, "llm_calls": int(scores["llm_calls"].sum()),
            "mean_score": round(float(scores["score"].mean()), 3), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


def run(config: str, sets: list[str], problems: int, concurrency: list[int], scoring: list[int],
        program_file: Path | None, echo=print) -> dict:
    bench = {"benchmark.train_split": "dev", "benchmark.max_queries": problems}
    cfg = load_config(config, variant_sets(bench, before=sets))
    if cfg.executor.serve is None:
        raise ConfigError(f"{config}: executor.serve is not set; this bench starts the executor's server itself")
    program = (program_file or DEFAULT_PROGRAM).read_text()
    prompts = [it.prompt for it in load_benchmark(cfg.benchmark).items()]
    executor = cfg.executor
    out: dict = {"config": str(config), "problems": len(prompts), "max_tokens": executor.max_tokens,
                 "temperature": executor.temperature, "plain": [], "scoring": []}
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp, \
            serving(cfg, ["executor"], Path(tmp) / "logs") as served:
        url, model = served.executor.base_url, served.executor.model
        echo(f"server up at {url}; {len(prompts)} development problems, max_tokens {executor.max_tokens}, "
             f"temperature {executor.temperature}")
        # warm-up: the first requests pay for graph capture and caches
        asyncio.run(plain_tokens_per_s(url, model, prompts[:2], 2, 16, executor.temperature))
        for at_once in concurrency:
            result = asyncio.run(plain_tokens_per_s(url, model, prompts, at_once, executor.max_tokens,
                                                    executor.temperature))
            out["plain"].append(result)
            echo(f"plain client, {at_once:>3} at once: {result['tokens_per_s']:7.1f} tokens/s "
                 f"({result['tokens']} tokens, {result['wall_s']} s)")
        for at_once in scoring:
            result = scoring_tokens_per_s(config, sets, bench, str(Path(tmp) / "store"), url, program, at_once)
            out["scoring"].append(result)
            echo(f"score stage, {at_once:>3} at once: {result['tokens_per_s']:7.1f} tokens/s "
                 f"({result['tokens']} tokens, {result['llm_calls']} calls, {result['wall_s']} s, "
                 f"mean score {result['mean_score']})")
    best = max(out["plain"], key=lambda r: r["tokens_per_s"])
    out["best_plain"] = best
    for result in out["scoring"]:
        result["ratio_to_best_plain"] = round(result["tokens_per_s"] / best["tokens_per_s"], 3)
        echo(f"scoring at {result['concurrency']}: {result['ratio_to_best_plain']:.2f} of the server's best "
             f"({best['tokens_per_s']} tokens/s at {best['concurrency']})")
    return out


def main(config: str, sets: list[str], problems: int, concurrency: list[int], scoring: list[int],
         program_file: Path | None, json_out: Path | None) -> None:
    out = run(config, sets, problems, concurrency, scoring, program_file)
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=1))
