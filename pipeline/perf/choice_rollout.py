"""`pipeline bench choice-rollout`: a round's rollout under rollout.choice_step, run twice on the same queries in
scratch stores: first with the workflows after the drawn labels written one call a batch (as the rollout wrote them
before `Sampler.write_after` took several batches' in one call), then across batches. Each side prints its wall time,
the process's CPU seconds (the vLLM engine runs in this process: the steadier figure where other jobs share the
cores), the rows and workflows written and the tokens generated, and the second side how many of its rows are token
for token the first's (each prompt keeps its seed; the engine's batch changes the order of floating-point sums only).

Where a batch draws few `own` labels, a call that writes only its workflows decodes them at a small batch and its
longest alone; across batches a call decodes up to `generator.call_samples` of them, as a call without the design step
does.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError, load_config
from pipeline.perf.prefix_cache import agreement

CONFIG = Path("configs/mixed-route.yaml")
# arm A's round on the base model: six label draws a query at choice temperature 8, `own` written after its label
DEFAULT_SETS = ("rollout.m=6", "rollout.logged=[]")


@dataclass(frozen=True)
class Side:
    across: bool  # the workflows of several batches in one call
    wall_s: float
    cpu_s: float  # the process's user + system seconds
    rows: int
    written: int  # rows whose workflow was written after the label (not routed)
    generated: int  # completion tokens, labels included
    gen_ids: tuple[str, ...]  # sorted
    tokens: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]  # (token ids, their log-probs), as gen_ids


def run_side(config: Path, sets: list[str], across: bool, root: Path) -> Side:
    """One rollout stage of `config` (round 0, a fresh store under `root`), the writing across batches or not."""
    from pipeline.engines.generation.vllm_offline import VLLMGenerator
    from pipeline.run import RunContext
    from pipeline.stages.rollout import run_rollout
    from pipeline.store import Store

    cfg = load_config(config, sets)
    ctx = RunContext(cfg, Store(root), "bench", 0, cfg.config_hash())
    before = VLLMGenerator.per_prompt_seeds
    VLLMGenerator.per_prompt_seeds = across  # one call a batch where the engine is not said to seed by prompt
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        run_rollout(ctx)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        VLLMGenerator.per_prompt_seeds = before
    df = ctx.store.read("generations", "bench", 0).sort("gen_id")
    return Side(across, wall, cpu, df.height, int((df["source"] == "write").sum()),
                int(df["token_ids"].list.len().sum()), tuple(df["gen_id"].to_list()),
                tuple((tuple(ids), tuple(lps or ())) for ids, lps in
                      zip(df["token_ids"].to_list(), df["token_logprobs"].to_list(), strict=True)))


def main(config: Path = CONFIG, queries: int = 36, batch_size: int | None = None, sets: list[str] | None = None,
         echo=print) -> list[Side]:
    sets = [*DEFAULT_SETS, *(sets or []), f"benchmark.max_queries={queries}",
            *([f"generator.batch_size={batch_size}"] if batch_size is not None else [])]
    cfg = load_config(config, sets)
    if not cfg.rollout.choice_step or cfg.generator.backend != "vllm":
        raise ConfigError(f"{config}: the bench needs rollout.choice_step and generator.backend vllm (got "
                          f"choice_step {cfg.rollout.choice_step}, backend {cfg.generator.backend})")
    echo(f"{config} with {' '.join('--set ' + s for s in sets)}: {queries} queries, {cfg.generator.batch_size} a "
         f"batch, m = {cfg.rollout.m}, labels at choice temperature {cfg.rollout.choice_temperature}")
    sides = []
    with tempfile.TemporaryDirectory(prefix="bench-choice-") as tmp:
        for across in (False, True):  # each side said as it ends: a long bench stopped halfway keeps the first
            side = run_side(config, sets, across, Path(tmp) / ("across" if across else "apart"))
            sides.append(side)
            echo(f"  workflows written {'across batches' if side.across else 'one call a batch'}: {side.wall_s:8.1f} "
                 f"s wall, {side.cpu_s:8.1f} s CPU; {side.rows} rows, {side.written} written after their label, "
                 f"{side.generated} tokens generated")
    apart, across = sides
    # a row counts as the same only under the same gen_id (the same query, sample and draw)
    paired = [(a, b) for ga, a, gb, b in zip(apart.gen_ids, apart.tokens, across.gen_ids, across.tokens, strict=True)
              if ga == gb]
    same, _, gap = agreement([a for a, _ in paired], [b for _, b in paired])
    echo(f"  across / apart: wall {across.wall_s / apart.wall_s:.2f}x, CPU {across.cpu_s / apart.cpu_s:.2f}x; "
         f"{same} of {across.rows} rows token for token the same, sampled log-probs within {gap:.1e} before rows part")
    return sides
