"""BayesFlow's SMC workflow sampler as an inference-time method: Algorithm 1 (STEPUPDATE) with M = 0, i.e. parallel
look-ahead rollouts without the refiner (the paper: "the removal of the refiner, M = 0, yields pure parallel
exploration akin to SMC"). It needs no training: the generator is the configured one (the base model by default).

Per query, N particles (partial workflows) advance T steps. A step is a chunk of code that starts with a
`# Step <n>:` comment (BayesFlow asks the optimizer LLM for them; the prompt here asks too, `STEP_HINT`). At step t:
1. extend: each particle i samples a continuation of prompt + s_{1:t-1}; its first step s_t is cut at the next step
   comment (`cut_step`), giving s_{1:t};
2. look-ahead: K complete rollouts of s_{1:t} (the rest of the extension's own continuation is the first: it is a
   draw from p(s_{t+1:T} | s_{1:t}) like the K - 1 others), each run once on the query (the `checks` table), and
   w_i = (1/K) sum_k exp(beta R(s_{1:t}, s~_{t+1:T}^{(i,k)}))  (`lookahead_weight`; the paper's beta is 1);
3. normalise and resample: N indices a_n with Pr(a_n = i) = w_i / sum_j w_j (multinomial resampling, `resample`).
A particle whose workflow is complete (no step comment follows) keeps it as its only rollout. After step T (or once
every particle is complete) each particle's workflow is its first rollout: the N final workflows are the derived
run's round-0 workflows, scored by the normal score stage, so Mean@L / Best@L / Majority@L (L = N) and tokens per
query come from `evaluate.eval_summary`. Every rollout is a `generations` row of kind `smc` (its generator tokens
count in the query's cost, the final copies carry none) and every run a `checks` row (its executor tokens count).

The reward R of a complete rollout must be known at inference time, without the gold answer. `consistency`
(default): the share of this step's rollouts of the same query that gave the same normalised answer
(`benchmarks.metrics.vote_key`), 0 for a rollout that failed or gave none: weighted majority voting read as
posterior sampling (BayesFlow, appendix B). `oracle` scores rollouts with the benchmark metric against the gold
answer: an upper bound for analysis, not an inference-time method. BayesFlow's R is validation accuracy of a
task-level workflow; here workflows are per query, so R is per query too.

`smc.resample: false` draws N complete workflows per query from the same prompt instead (no steps, runs or
weights): plain sampling from the same prior p, the comparison at an executor budget (N = SMC's workflow runs per
query, `executed_per_query`), in the run `<run>-smc-plain-n<N>`.

The queries go in chunks of `CHUNK`: each chunk is sampled, run and written whole (its rollouts, runs, then its final
workflows), so a run cut off resumes at the first chunk without final workflows; what a cut-off chunk had written is
removed first. Each whole chunk's wall time is a `rollout` line of the run's timings.jsonl marked as a shard
(`chunk i/n`); once every chunk is written, the stage's own line is their sum over every attempt, so a run that took
several sessions reports the sampling it kept. Not implemented: the refiner (M > 0, MCTS in the paper).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import polars as pl
from tqdm import tqdm

from pipeline.config import ConfigError, load_config, variant_sets
from pipeline.engines.checks import CheckJob, run_checks
from pipeline.engines.servers import SECTIONS, server_log_dir, serving
from pipeline.engines.workflow import check_workflow, extract_code
from pipeline.run import RunContext, derived_seed, open_run
from pipeline.stages.runner import StageResult, record_timing, round_s
from pipeline.studies.report import timing_lines
from pipeline.studies.summaries import EvalSummary

log = logging.getLogger(__name__)

CHUNK = 8  # queries sampled, run and written together: a run cut off loses at most one chunk's work
STEP = re.compile(r"^[ \t]*#[ \t]*Step[ \t]*\d+", re.MULTILINE | re.IGNORECASE)
STEP_HINT = ("\nStart each step of `solve` with a comment `# Step <n>: <what it does>`, e.g. `# Step 1: read the "
             "numbers`.")


# ---- the maths (pure) ----------------------------------------------------------------------------------------


def cut_step(text: str, t: int) -> tuple[str, bool]:
    """(s_{1:t}, complete) of a workflow text whose first t - 1 steps are a prefix already: the text up to the
    (t + 1)-th step comment, or the whole text (complete) when there is none."""
    marks = [m.start() for m in STEP.finditer(text)]
    if len(marks) > t:
        return text[: marks[t]], False
    return text, True


def lookahead_weight(rewards: Sequence[float], beta: float = 1.0) -> float:
    """w = (1/K) sum_k exp(beta R_k) over a particle's K look-ahead rollouts."""
    if not rewards:
        raise ValueError("a particle needs at least one look-ahead rollout")
    return float(np.mean(np.exp(beta * np.asarray(rewards, dtype=float))))


def resample(weights: Sequence[float], uniforms: Sequence[float]) -> list[int]:
    """Multinomial resampling: index n is the first i with (w_1 + ... + w_i) / sum w > u_n, so
    Pr(a_n = i) = w_i / sum_j w_j for u_n uniform on [0, 1)."""
    w = np.asarray(weights, dtype=float)
    if w.size == 0 or (w < 0).any() or not w.sum() > 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    cdf = np.cumsum(w) / w.sum()
    return [int(min(np.searchsorted(cdf, u, side="right"), w.size - 1)) for u in uniforms]


def consistency_rewards(votes: Sequence[str | None]) -> list[float]:
    """R of each rollout of one query's step: the share of the step's rollouts with the same vote; no vote: 0."""
    n = len(votes)
    return [0.0 if v is None else sum(1 for x in votes if x == v) / n for v in votes]


# ---- one step for every query at once ----------------------------------------------------------------------------


@dataclass
class Particle:
    prefix: str  # s_{1:t}: the workflow text so far (its opening included: `sampling.opening`)
    complete: bool = False
    rollouts: list[str] = field(default_factory=list)  # full texts of its look-ahead rollouts at this step


@dataclass
class Query:
    item: object  # benchmarks.base.Item
    prompt: str  # rendered prompt, assistant turn open (workflow_prefix not included)
    particles: list[Particle]
    rng: np.random.Generator
    ran: dict[str, dict] = field(default_factory=dict)  # workflow text -> its check row (a text runs once)
    steps: list[dict] = field(default_factory=list)  # per step: weights, ancestors (for the record)


Sampler = Callable[[list[str], int, str], list[list[object]]]  # (prompts, n, key) -> per prompt n Completions


class SMC:
    """The sampler over all queries of a run; `sample` and `run` are injected (engine and sandbox), `rows` collects
    what the store gets."""

    def __init__(self, ctx: RunContext, sample: Sampler, run: Callable[[list[CheckJob]], list[dict]],
                 reward: Callable[[object, list[dict]], list[float]]):
        self.ctx, self.cfg, self.sample, self.run, self.reward = ctx, ctx.cfg.smc, sample, run, reward
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.gen_of: dict[tuple[str, str], str] = {}  # (query, workflow text) -> the first rollout row with it

    def _record(self, query: Query, prompt: str, comps: list, t: int, i: int, k0: int, prefix: str) -> list[str]:
        gen_cfg = self.ctx.cfg.generator
        texts = []
        for k, completion in enumerate(comps, start=k0):
            text = prefix + completion.text
            reason = check_workflow(extract_code(text), self.ctx.cfg.rollout.max_workflow_chars)
            gid = f"smc-{query.item.id}-t{t}-p{i}-k{k}"
            self.gen_of.setdefault((query.item.id, text), gid)
            self.rows.append(dict(
                gen_id=gid, kind="smc", query_id=query.item.id, slot=i, prompt_text=prompt,
                text=text, prompt_token_ids=completion.prompt_token_ids, token_ids=completion.token_ids,
                token_logprobs=completion.token_logprobs, model=gen_cfg.model, backend=gen_cfg.backend,
                finish_reason=completion.finish_reason, valid=reason is None, invalid_reason=reason,
                retokenized=completion.retokenized, attempt=0,
                sampling=json.dumps({"method": "smc", "t": t, "particle": i, "k": k, "prefix_chars": len(prefix)})))
            texts.append(text)
        return texts

    def extend(self, queries: list[Query], t: int) -> None:
        """Step 1 (extend) and the rest of step 2's sampling (K - 1 more rollouts per unfinished particle)."""
        todo = [(q, i, p) for q in queries for i, p in enumerate(q.particles) if not p.complete]
        outs = self.sample([q.prompt + p.prefix for q, _, p in todo], 1, f"extend:{t}")
        for (query, i, particle), comps in zip(todo, outs, strict=True):
            (full,) = self._record(query, query.prompt + particle.prefix, comps, t, i, 0, particle.prefix)
            s, done = cut_step(full, t)
            query.particles[i] = Particle(s, done, [full])
        more = [(q, i, q.particles[i]) for q, i, _ in todo if not q.particles[i].complete]
        if self.cfg.K > 1 and more:
            outs = self.sample([q.prompt + p.prefix for q, _, p in more], self.cfg.K - 1, f"lookahead:{t}")
            for (query, i, particle), comps in zip(more, outs, strict=True):
                particle.rollouts += self._record(query, query.prompt + particle.prefix, comps, t, i, 1,
                                                  particle.prefix)
        for query in queries:
            for particle in query.particles:
                if particle.complete:
                    particle.rollouts = [particle.prefix]

    def score(self, queries: list[Query], t: int) -> None:
        """Run every rollout not run yet, then weight (step 2) and resample (step 3) each query's particles."""
        jobs, seen = [], set()
        for query in queries:
            for p in query.particles:
                for text in p.rollouts:
                    if text not in query.ran and (query.item.id, text) not in seen:
                        seen.add((query.item.id, text))
                        jobs.append((query, text))
        rows = self.run([CheckJob(self.gen_of.get((q.item.id, text), f"smc-{q.item.id}-t{t}-run{j}"),
                                  extract_code(text), q.item) for j, (q, text) in enumerate(jobs)])
        for (query, text), row in zip(jobs, rows, strict=True):
            query.ran[text] = row
            self.checks.append(row)
        for query in queries:
            self._resample(query, t)

    def _resample(self, query: Query, t: int) -> None:
        flat = [(i, query.ran[text]) for i, p in enumerate(query.particles) for text in p.rollouts]
        rewards = self.reward(query.item, [row for _, row in flat])
        for (_, row), r in zip(flat, rewards, strict=True):
            row["reward"] = r  # the latest R of a run (a complete workflow's R is re-read every step)
        w = [lookahead_weight([r for (j, _), r in zip(flat, rewards, strict=True) if j == i], self.cfg.beta)
             for i in range(len(query.particles))]
        a = resample(w, query.rng.random(len(query.particles)))
        query.steps.append({"t": t, "weights": w, "ancestors": a})
        query.particles = [Particle(query.particles[i].prefix, query.particles[i].complete,
                                    list(query.particles[i].rollouts)) for i in a]

    def draw(self, queries: list[Query]) -> None:
        """Plain sampling from the same prompt (and workflow_prefix): N complete workflows per query, no steps, no
        runs, no weights: the comparison for SMC at an executor budget (`smc.resample: false`)."""
        todo = [(q, i, p) for q in queries for i, p in enumerate(q.particles)]
        outs = self.sample([q.prompt + p.prefix for q, _, p in todo], 1, "plain")
        for (q, i, p), comps in zip(todo, outs, strict=True):
            (full,) = self._record(q, q.prompt + p.prefix, comps, 1, i, 0, p.prefix)
            q.particles[i] = Particle(full, True, [full])

    def sweep(self, queries: list[Query]) -> None:
        for t in range(1, self.cfg.T + 1):
            if all(p.complete for q in queries for p in q.particles):
                break
            self.extend(queries, t)
            self.score(queries, t)


# ---- the derived run -------------------------------------------------------------------------------------------


def smc_run_id(run_id: str, split: str = "test", plain_n: int | None = None) -> str:
    """`<run>-smc`, or `<run>-smc-plain-n<N>` for plain sampling from the SMC prompt (`smc.resample: false`)."""
    tag = "smc" if plain_n is None else f"smc-plain-n{plain_n}"
    return f"{run_id}-{tag}" if split == "test" else f"{run_id}-{tag}-{split}"


def open_smc_run(config: str, run_id: str | None = None, split: str = "test",
                 sets: list[str] | None = None) -> RunContext:
    """The derived run: CONFIG on `split` with the experiment's held-out query count, exemplars off."""
    from pipeline.studies.evaluate import derived_run_changes, held_out_queries

    sets = list(sets or [])
    cfg = load_config(config, sets)
    frozen = derived_run_changes(split, cfg) | held_out_queries(cfg)
    rid = smc_run_id(run_id or cfg.run_id, split, None if cfg.smc.resample else cfg.smc.N)
    return open_run(config, rid, 0, variant_sets(frozen, after=sets))


def _reward_fn(ctx: RunContext, bench) -> Callable[[object, list[dict]], list[float]]:
    from pipeline.engines.benchmarks.metrics import vote_key

    if ctx.cfg.smc.reward == "oracle":
        return lambda item, rows: [bench.score(item, r["answer"]).score if r["status"] == "ok" and r["answer"]
                                   else 0.0 for r in rows]
    return lambda item, rows: consistency_rewards(
        [vote_key(r["answer"], bench.family) if r["status"] == "ok" else None for r in rows])


def _sampler(ctx: RunContext, gen, chunk: str) -> Sampler:
    """Sampling for the chunk whose first query is `chunk`: its seeds depend on the chunk, not on what ran before it,
    so a resumed run draws what an uninterrupted one would."""
    from pipeline.engines.generation import Sampling
    from pipeline.stages.sampling import stops

    gen_cfg = ctx.cfg.generator

    def sample(prompts: list[str], n: int, key: str) -> list[list[object]]:
        out: list[list[object]] = []
        for i in range(0, len(prompts), gen_cfg.batch_size):
            s = Sampling(n=n, temperature=gen_cfg.temperature, top_p=gen_cfg.top_p,
                         max_new_tokens=gen_cfg.max_new_tokens, seed=derived_seed(gen_cfg.seed, "smc", chunk, key, i),
                         stop=stops(gen_cfg, "workflow"))
            out += gen.generate(prompts[i:i + gen_cfg.batch_size], s, None)
        return out

    return sample


def final_rows(ctx: RunContext, queries: list[Query]) -> list[dict]:
    """The N workflows of each query after the last step: each particle's first rollout (generator tokens are in
    the `smc` rows already), with its written design as the rollout stage names it (the nearest of the menu)."""
    from pipeline.core.designs import nearest_design
    from pipeline.engines.prompting import menu_code
    from pipeline.stages.sampling import gen_id

    gen_cfg, rows = ctx.cfg.generator, []
    menu = menu_code(ctx.cfg.rollout.example_menu)
    for query in queries:
        for slot, p in enumerate(query.particles):
            text = p.rollouts[0]
            reason = check_workflow(extract_code(text), ctx.cfg.rollout.max_workflow_chars)
            prov = {"method": "smc" if ctx.cfg.smc.resample else "smc prompt, plain sampling", "N": ctx.cfg.smc.N,
                    "K": ctx.cfg.smc.K, "T": ctx.cfg.smc.T,
                    "beta": ctx.cfg.smc.beta, "reward": ctx.cfg.smc.reward, "steps": query.steps}
            rows.append(dict(gen_id=gen_id(0, query.item.id, "workflow", slot), kind="workflow",
                             query_id=query.item.id, slot=slot, text=text, model=gen_cfg.model,
                             backend=gen_cfg.backend, sampling=json.dumps(prov), prompt_token_ids=[], token_ids=[],
                             valid=reason is None, invalid_reason=reason, attempt=0, cost_usd=0.0,
                             design=nearest_design(extract_code(text), menu)[0] if menu else None))
    return rows


def sample_smc(ctx: RunContext) -> dict:
    """Run the sampler on the run's queries and write queries, `smc` rollouts, checks and the final workflows."""
    from pipeline.engines.benchmarks import load_benchmark
    from pipeline.engines.generation import make_generator
    from pipeline.engines.models import load_tokenizer
    from pipeline.engines.prompting import load_design, render, workflow_prompt
    from pipeline.stages.sampling import drawn_design, opening
    from pipeline.studies.baselines import write_queries

    if ctx.done("rollout"):
        return {"skipped": True}
    if ctx.cfg.generator.adapter:
        raise ConfigError("smc samples with the base model here; generator.adapter is not supported")
    done = finished_queries(ctx)
    bench = load_benchmark(ctx.cfg.benchmark)
    write_queries(ctx)
    tok = load_tokenizer(ctx.cfg.generator.model)
    smc_cfg, rollout = ctx.cfg.smc, ctx.cfg.rollout
    prompt_dir, menu = rollout.prompt_dir, [load_design(p) for p in rollout.example_menu]
    queries = []
    for item in bench.items():
        # with an example menu, a query's particles share one prompt: the menu, and as its example the design the
        # rollout's first slot of the query draws (the same for the base model and every round)
        d = drawn_design(rollout, menu, item.id, 0)
        prompt = workflow_prompt(item.prompt, bench.family, prompt_dir=prompt_dir, design=d, menu=menu) + STEP_HINT
        queries.append(Query(item, render(tok, prompt, prompt_dir=prompt_dir),
                             [Particle(opening(rollout, d)) for _ in range(smc_cfg.N)],
                             np.random.default_rng(derived_seed(smc_cfg.seed, "resample", item.id))))
    chunks = [queries[i:i + CHUNK] for i in range(0, len(queries), CHUNK)]
    todo = [(i, c) for i, c in enumerate(chunks) if c[0].item.id not in done]
    if len(todo) < len(chunks):
        log.info("smc run %s: %d of %d chunks of queries written by an earlier attempt, resumed after them",
                 ctx.run_id, len(chunks) - len(todo), len(chunks))
    # served sections: SMC samples and runs workflows here, outside a stage, so it runs their servers itself
    with serving(ctx.cfg, SECTIONS, server_log_dir(ctx.store, ctx.run_id, "smc")) as cfg:
        gen = make_generator(cfg.generator)
        try:
            run = partial(run_checks, cfg, purpose="smc", cache_dir=ctx.store.cache_dir())
            reward = _reward_fn(ctx, bench)
            for number, chunk in tqdm(todo, desc="smc", unit="chunk", postfix={"queries": CHUNK}):
                started = time.perf_counter()
                smc = SMC(ctx, _sampler(ctx, gen, chunk[0].item.id), run, reward)
                smc.sweep(chunk) if smc_cfg.resample else smc.draw(chunk)
                ctx.store.write("generations", smc.rows, ctx.run_id, 0)
                ctx.store.write("checks", smc.checks, ctx.run_id, 0)
                ctx.store.write("generations", final_rows(ctx, chunk), ctx.run_id, 0)  # last: the chunk is whole
                record_timing(ctx.store.root, ctx.run_id, StageResult(
                    "rollout", 0, False, round_s(time.perf_counter() - started), {},
                    shard=f"chunk {number + 1}/{len(chunks)}"))
        finally:
            gen.close()
    gens = ctx.store.read("generations", ctx.run_id, 0)
    rollouts = gens.filter(pl.col("kind") == "smc")["text"].to_list()
    runs = ctx.store.read("checks", ctx.run_id, 0).height
    counts = {"queries": len(queries), "rollouts": len(rollouts), "runs": runs,
              "workflows": gens.filter(pl.col("kind") == "workflow").height,
              "steps_with_comments": sum(1 for t in rollouts if len(STEP.findall(t)) > 1)}
    ctx.finish("rollout", method="smc", **counts)
    record_timing(ctx.store.root, ctx.run_id, StageResult("rollout", 0, False, sampled_s(ctx), counts))
    return counts


def sampled_s(ctx: RunContext) -> float:
    """Wall seconds of the run's whole chunks, over every attempt (each chunk is written, and timed, once)."""
    return round_s(sum(r["wall_s"] for r in timing_lines(ctx.store, ctx.run_id)
                       if r["stage"] == "rollout" and str(r.get("shard", "")).startswith("chunk ")))


def finished_queries(ctx: RunContext) -> set[str]:
    """The queries an earlier, cut-off attempt finished (their final workflows are in the store); the parts of a
    chunk it had not finished (rollouts or runs without final workflows: written before them) are removed."""
    finals = ctx.store.read("generations", ctx.run_id, 0).filter(pl.col("kind") == "workflow")
    done = set(finals["query_id"].to_list())
    cut = [p for table in ("generations", "checks") for p in ctx.store.parts(table, ctx.run_id, 0)
           if not ctx.store.part_values(p, "query_id") <= done]
    if cut:
        log.warning("smc run %s: removing %d part(s) of a chunk an earlier attempt did not finish", ctx.run_id,
                    len(cut))
        ctx.store.discard_parts(cut)
    return done


def run_smc(config: str, call=None, run_id: str | None = None, split: str = "test",
            sets: list[str] | None = None) -> EvalSummary:
    """Sample (`sample_smc`), score the final workflows through `call`, return the run's `eval_summary` with the
    sampler's counts (`smc`) and `workflow_runs_per_query` (`executed_per_query`)."""
    from pipeline.stages.rounds import direct_call
    from pipeline.studies.evaluate import eval_summary

    call = call or direct_call()
    ctx = open_smc_run(config, run_id, split, sets)
    counts = sample_smc(ctx)
    call(stage="score", run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=sets)
    summary = eval_summary(ctx.store, ctx.run_id)
    summary.extra["smc"] = counts
    summary.extra["workflow_runs_per_query"] = executed_per_query(ctx.store, ctx.run_id)
    return summary


def executed_per_query(store, run_id: str) -> float:
    """Workflow runs per query of an SMC run (look-ahead runs plus the final scoring runs): the L at which plain
    sampling spends about the same executor budget."""
    df = store.sql("SELECT avg(n) AS n FROM (SELECT query_id, count(*) AS n FROM (SELECT query_id FROM checks "
                "WHERE run_id = $run UNION ALL SELECT query_id FROM latest_scores WHERE run_id = $run) GROUP BY 1)",
                {"run": run_id}, run=run_id)
    return float(df["n"][0] or math.nan)


def plain_run_id(run_id: str, L: int, split: str = "test") -> str:
    return f"{run_id}-plain-l{L}" if split == "test" else f"{run_id}-plain-{split}-l{L}"


def run_plain(config: str, L: int, call=None, run_id: str | None = None, split: str = "test",
              sets: list[str] | None = None) -> EvalSummary:
    """Plain sampling for comparison with SMC at a chosen executor budget: the configured generator samples L
    workflows per held-out query (the rollout stage, flat), scored by the score stage; returns `eval_summary`."""
    from pipeline.stages.rounds import direct_call
    from pipeline.studies.evaluate import derived_run_changes, eval_summary, held_out_queries

    call = call or direct_call()
    sets = list(sets or [])
    cfg = load_config(config, sets)
    frozen = derived_run_changes(split) | {"rollout.mode": "flat"} | held_out_queries(cfg) | {"rollout.m": L}
    ctx = open_run(config, plain_run_id(run_id or cfg.run_id, L, split), 0, variant_sets(frozen, after=sets))
    for stage in ("rollout", "score"):
        call(stage=stage, run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=sets)
    return eval_summary(ctx.store, ctx.run_id)
