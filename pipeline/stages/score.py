"""The scoring stage: run each workflow generation of a round `reps` times in the sandbox and write `scores`.

Idempotency and crash safety: a (gen_id, rep) is *finished* once its row is in a Parquet part of the
store. Rows are written in parts of `scoring.batch_size` as runs finish (and whatever is buffered on
SIGINT/exceptions); a kill -9 loses only the unwritten buffer, which the next invocation runs again.
Each invocation plans from the store: a (gen_id, rep) without a row runs as attempt 0; with
`--only-failed`, one whose latest attempt is transient (`executor_error`, and `timeout` when
`scoring.retry_timeouts`) or whose task's own scorer failed (`error`: the user fixed the function) runs as
attempt + 1. Other final rows are never re-run, so nothing is duplicated.
The `score` manifest is written only when every (gen_id, rep) has a final status.

Sharded (`shard=Shard(i, n)`): a call plans, runs and writes only the generations of its shard's queries (by a
stable hash of the query id, so shards never share a row), resumes the same way, and ends with the shard's own
manifest; `finish_score` then writes the `score` manifest from the store, with the counts of an unsharded run.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl

from pipeline.core.reward import diversity_terms, reward
from pipeline.core.tamper import flags
from pipeline.engines.benchmarks.base import Benchmark, Item, ScorerError, group_errors, load_benchmark
from pipeline.engines.meter import ProgressMeter, relay_path
from pipeline.engines.sandbox import Limits, SandboxResult, default_sandbox, run_workflow
from pipeline.engines.workflow import check_workflow, extract_code
from pipeline.run import RunContext
from pipeline.stages import Shard
from pipeline.stages.modes import get_mode
from pipeline.store import Store
from pipeline.store.schema import FINAL_STATUSES, RESCORED_STATUSES, transient_statuses

log = logging.getLogger(__name__)
MAX_ANSWER_CHARS = 20_000


@dataclass(frozen=True)
class Job:
    gen_id: str
    query_id: str
    rep: int
    attempt: int


def latest_attempts(store: Store, run_id: str, round: int) -> dict[tuple[str, int], tuple[str, int]]:
    """(gen_id, rep) -> (status, attempt) of the latest attempt (the store's `latest_scores` view)."""
    df = store.sql("SELECT gen_id, rep, status, attempt FROM latest_scores WHERE run_id = $run AND round = $round",
                   {"run": run_id, "round": round}, run=run_id)
    return {(g, r): (s, a) for g, r, s, a in df.iter_rows()}


def plan(gens: list[tuple[str, str]], latest: dict[tuple[str, int], tuple[str, int]], reps: int,
         only_failed: bool, transient: set[str]) -> list[Job]:
    """The runs to do now. gens: (gen_id, query_id). Missing rows run as attempt 0 (normal run);
    latest attempts whose status is in `transient` run again as attempt + 1 (--only-failed: the transient statuses
    and RESCORED_STATUSES); final ones never."""
    jobs = []
    for gen_id, query_id in gens:
        for rep in range(reps):
            prev = latest.get((gen_id, rep))
            if prev is None and not only_failed:
                jobs.append(Job(gen_id, query_id, rep, 0))
            elif prev is not None and only_failed and prev[0] in transient:
                jobs.append(Job(gen_id, query_id, rep, prev[1] + 1))
    return jobs


def _items(queries: pl.DataFrame) -> dict[str, Item]:
    out = {}
    for r in queries.unique("query_id", keep="first").iter_rows(named=True):
        out[r["query_id"]] = Item(r["query_id"], r["prompt"], json.loads(r["reference"] or "{}"),
                                  json.loads(r["meta"] or "{}"))
    return out


class _Scorer:
    """Per-invocation state: benchmark, executor, judge, limits; `score(job)` -> one `scores` row."""

    def __init__(self, ctx: RunContext, bench: Benchmark, texts: dict[str, str], items: dict[str, Item],
                 diversity: dict[str, float] | None = None, slots: dict[str, int] | None = None):
        """`slots`: gen_id -> its sample slot within its query (`query_slots`), where common random numbers pair
        arms."""
        cfg = ctx.cfg
        self.cfg, self.bench, self.texts, self.items = cfg, bench, texts, items
        self.diversity, self.slots = diversity or {}, slots or {}
        self.limits = Limits.from_config(cfg.scoring)
        self.cache_dir = ctx.store.cache_dir()
        self._executor = self._judge = self._verdicts = None

    @property
    def executor(self):
        if self._executor is None:
            from pipeline.engines.cache import make_cached_executor

            self._executor = make_cached_executor(self.cfg.executor, self.cache_dir)
        return self._executor

    def seeds(self, job: Job):
        """The run's executor-call seeds: common random numbers where configured and the slot is known."""
        from pipeline.engines.executors import CallSeeds, SampleSlot

        ex = self.cfg.executor
        slot = self.slots.get(job.gen_id)
        where = SampleSlot(ex.seed, job.query_id, slot, job.rep) if ex.common_random_numbers and slot is not None \
            else None
        return CallSeeds(where, ex.temperature)

    async def _grade(self, item: Item, answer: str) -> tuple[float, dict]:
        """A code benchmark's verdict (through the verdict cache when kept), else the metric (sync and pure)."""
        if not hasattr(self.bench, "ascore"):
            m = await asyncio.to_thread(self.bench.score, item, answer)
            return m.score, m.details

        async def grade() -> tuple[float, dict]:
            m = await self.bench.ascore(item, answer)
            return m.score, m.details

        if not self.cfg.scoring.cache_verdicts or self.cache_dir is None:
            return await grade()
        if self._verdicts is None:
            from pipeline.engines.cache import VerdictCache

            self._verdicts = VerdictCache(self.cfg, self.cache_dir)
        score, details, _ = await self._verdicts.verdict(item.id, item.reference, answer, grade)
        return score, details

    async def _metric(self, item: Item, answer: str) -> tuple[float, dict]:
        score, metric_details = await self._grade(item, answer)
        details = {"metric": metric_details}
        judge_cfg = self.cfg.scoring.reward.judge
        if judge_cfg is not None and self.bench.family != "code":
            if self._judge is None:
                from pipeline.engines.judge import Judge

                self._judge = Judge(judge_cfg)
            j = await self._judge.grade(item.prompt, item.gold_text(), answer)
            details.update(benchmark_metric=score, judge=j.details)
            return j.score, details
        return score, details

    async def score(self, job: Job) -> dict:
        item = self.items[job.query_id]
        code = extract_code(self.texts[job.gen_id] or "")
        row: dict[str, Any] = {"gen_id": job.gen_id, "query_id": job.query_id, "rep": job.rep,
                               "attempt": job.attempt, "metric": 0.0, **SandboxResult("invalid").usage()}
        details: dict[str, Any] = {}
        reason = check_workflow(code, self.cfg.rollout.max_workflow_chars)
        if reason is not None:
            row.update(status="invalid", error=reason)
        else:
            public = None
            if self.bench.family == "code" and item.meta.get("public_tests") is not None:
                public = {"entry_point": item.meta.get("entry_point"), "tests": item.meta["public_tests"],
                          "timeout_s": self.cfg.scoring.test_timeout_s}
            res = await run_workflow(code, item.prompt, executor=self.executor,
                                     limits=self.limits, public_tests=public,
                                     max_chars=self.cfg.rollout.max_workflow_chars, seeds=self.seeds(job))
            row.update(status=res.status, error=res.error, **res.usage(),
                       answer=None if res.answer is None else res.answer[:MAX_ANSWER_CHARS])
            details["sandbox"] = res.details
            if res.status == "ok":
                try:
                    row["metric"], more = await self._metric(item, res.answer)
                    details.update(more)
                    if more["metric"].get("status") == "reward_hack":  # a look-alike value: said in the status
                        row["status"] = "reward_hack"
                except Exception as e:  # an executor-backed judge failing is transient; a metric that could not
                    # decide in time (MetricTimeout) is a timeout; anything else is an error
                    from pipeline.engines.executors import ExecutorError

                    # a task's own scorer failing (ScorerError) is `error`, re-scored by --only-failed once fixed
                    status = "executor_error" if isinstance(e, ExecutorError) else \
                        "error" if isinstance(e, ScorerError) else \
                        "timeout" if isinstance(e, TimeoutError) else "exec_error"
                    row.update(status=status, error=f"metric failed: {type(e).__name__}: {e}"[:4000])
        weights = self.cfg.scoring.reward
        parts = reward(row["metric"], code, row["tokens_in"], row["tokens_out"], weights.complexity_weight,
                       weights.cost_weight, self.diversity.get(job.gen_id, 1.0), weights.diversity_weight,
                       weights.token_budget)
        answer_code = extract_code(row["answer"]) if self.bench.family == "code" and row.get("answer") else None
        row["flags"] = flags(code, answer_code)
        # reaching for the harness pays nothing
        zeroed = bool(row["flags"]) and weights.zero_flagged and parts.score > 0
        row.update(score=0.0 if zeroed else parts.score, complexity=parts.complexity, cost=parts.cost,
                   diversity=parts.diversity)
        details["reward"] = {"ast_nodes": parts.ast_nodes, "helper_calls": parts.helper_calls,
                             "complexity_weight": weights.complexity_weight, "cost_weight": weights.cost_weight,
                             "diversity_weight": weights.diversity_weight, "token_budget": weights.token_budget,
                             "zeroed_by_flags": zeroed}
        row["details"] = json.dumps(details, default=str)
        return row

    def needs_executor(self, job: Job) -> bool:
        return "llm" in (self.texts[job.gen_id] or "")  # a cheap guess: only to decide on warm-up

    async def aclose(self) -> None:
        if self._verdicts is not None:
            self._verdicts.close()
        self.bench.close()
        for x in (self._executor, self._judge):
            if x is not None:
                await x.aclose()


async def _run(ctx: RunContext, scorer: _Scorer, jobs: list[Job], desc: str) -> dict[str, int]:
    cfg, counts = ctx.cfg.scoring, {}
    buf: list[dict] = []
    sem = asyncio.Semaphore(cfg.concurrency)

    def flush() -> None:
        if buf:
            ctx.store.write("scores", list(buf), ctx.run_id, ctx.round)
            buf.clear()

    async def one(job: Job) -> dict:
        async with sem:
            return await scorer.score(job)

    if any(scorer.needs_executor(j) for j in jobs):
        await scorer.executor.start()
    tasks = [asyncio.ensure_future(one(j)) for j in jobs]
    scorer_errors: list[tuple[str, str]] = []  # (gen_id, error) of the runs whose task scorer failed
    try:
        with ProgressMeter(len(jobs), desc, "run", relay=relay_path(ctx.run_id, ctx.round, "score")) as bar:
            for fut in asyncio.as_completed(tasks):
                row = await fut
                counts[row["status"]] = counts.get(row["status"], 0) + 1
                if row["status"] == "error":
                    scorer_errors.append((row["gen_id"], row["error"]))
                buf.append(row)
                if len(buf) >= cfg.batch_size:
                    flush()
                bar.update()
    finally:  # SIGINT (asyncio cancels us) or an error: keep every finished row
        for t in tasks:
            t.cancel()
        flush()
    for group in group_errors(sorted(scorer_errors)):  # one line per message, not one per run
        more = f" and {group.count - len(group.rows)} more" if group.count > len(group.rows) else ""
        log.warning("%s: %d run(s) with status error: %s (%s%s); once the scorer is fixed, `pipeline score "
                    "--only-failed` scores them again", desc, group.count, group.message, ", ".join(group.rows), more)
    return counts


def group_diversity(gens: pl.DataFrame) -> dict[str, float]:
    """gen_id -> FlowReasoner's diversity term within its group: the workflows of the same (query, parent), i.e.
    the samples of one prompt, repairs included (pipeline.core.reward.diversity_terms)."""
    out: dict[str, float] = {}
    for _, grp in gens.group_by(["query_id", "parent_id"], maintain_order=True):
        codes = [extract_code(t or "") for t in grp["text"]]
        out.update(zip(grp["gen_id"], diversity_terms(codes), strict=True))
    return out


def _make_scorer(ctx: RunContext, items: dict[str, Item], texts: dict[str, str],
                 diversity: dict[str, float], slots: dict[str, int] | None = None) -> _Scorer:
    bench = load_benchmark(ctx.cfg.benchmark)
    if hasattr(bench, "test_timeout_s"):
        bench.test_timeout_s = ctx.cfg.scoring.test_timeout_s
    iso = default_sandbox().ensure_started()
    for note in iso.get("notes", []):
        log.warning("sandbox: %s", note)
    return _Scorer(ctx, bench, texts, items, diversity, slots)


async def _score_passes(ctx: RunContext, passes: list[bool], plan_jobs: Callable[[bool], list[Job]],
                        make_scorer: Callable[[], _Scorer], desc: str) -> tuple[int, dict[str, int]]:
    """Run each pass's jobs (planned when the pass starts, from the rows written so far) on one scorer, made at
    the first pass with work: the benchmark, the sandbox and the executor (a local one loads its model) are set
    up once per call, not once per pass. Returns (runs, runs by status)."""
    scorer, ran, counts = None, 0, {}
    try:
        for retry_pass in passes:
            jobs = plan_jobs(retry_pass)
            if not jobs:
                continue
            scorer = scorer or make_scorer()
            for status, n in (await _run(ctx, scorer, jobs, desc)).items():
                counts[status] = counts.get(status, 0) + n
            ran += len(jobs)
    finally:
        if scorer is not None:
            await scorer.aclose()
    return ran, counts


def query_slots(workflows: pl.DataFrame, agent_slots: dict[str, int], per_agent: int) -> dict[str, int]:
    """gen_id -> the workflow's sample slot within its query, where common random numbers pair runs: a flat
    workflow's own `slot` (a repair keeps its original's; a refinement turn's its own); a workflow under a plan
    (`parent_id` an agent's gen_id) plan slot x `per_agent` + its slot, since its own slot counts within the plan
    only and two plans' first workflows would otherwise share one seed, and so one sample of every sampled call they
    share. A query's L workflows hold L slots in either mode. A workflow without a slot has none (unpaired)."""
    return {g: agent_slots[parent] * per_agent + s if parent in agent_slots else s
            for g, s, parent in zip(workflows["gen_id"], workflows["slot"], workflows["parent_id"], strict=True)
            if s is not None}


def _round_workflows(ctx: RunContext) -> tuple[pl.DataFrame, dict[str, Item], dict[str, int]]:
    """The round's workflow generations (one row per gen_id, in a fixed order), their queries' items and their
    slots within their queries (`query_slots`)."""
    store = ctx.store
    every = store.read("generations", ctx.run_id, ctx.round)
    gens = every.filter(pl.col("kind") == "workflow")
    gens = gens.unique("gen_id", keep="first").sort(["query_id", "gen_id"])
    agents = every.filter(pl.col("kind") == "agent").unique("gen_id", keep="first")
    slots = query_slots(gens, dict(zip(agents["gen_id"], agents["slot"], strict=True)), ctx.cfg.rollout.n_workflows)
    if gens.height == 0:
        raise ValueError(f"run {ctx.run_id!r} round {ctx.round}: no workflow generations; run `pipeline rollout` first")
    items = _items(store.read("queries", ctx.run_id, ctx.round))
    missing = sorted(set(gens["query_id"]) - set(items))
    if missing:
        raise ValueError(f"run {ctx.run_id!r} round {ctx.round}: generations reference queries without a "
                         f"`queries` row: {missing[:5]}")
    return gens, items, slots


def _tally(ctx: RunContext, gen_ids: set[str], manifest: str) -> dict:
    """Counts of the latest attempts of `gen_ids`' runs; writes `manifest` once every run is final. One function for
    the whole round and for a shard, so a sharded round's manifest has the counts of an unsharded one."""
    transient = transient_statuses(ctx.cfg.scoring.retry_timeouts)
    latest = {k: v for k, v in latest_attempts(ctx.store, ctx.run_id, ctx.round).items() if k[0] in gen_ids}
    total = len(gen_ids) * ctx.cfg.scoring.reps
    final = {k: s for k, (s, _) in latest.items() if s in FINAL_STATUSES or (s == "timeout" and s not in transient)}
    by_status: dict[str, int] = {}
    for s, _ in latest.values():
        by_status[s] = by_status.get(s, 0) + 1
    out = {"runs": total, "by_status": by_status, "left": total - len(final)}
    if out["left"] == 0:
        ctx.finish(manifest, runs=total, workflows=len(gen_ids), by_status=by_status)
    else:
        log.warning("%s: %d of %d runs not final (missing or transient); re-run `pipeline score` (--only-failed for "
                    "transient failures)", manifest, out["left"], total)
    out["done"] = out["left"] == 0
    return out


def run_score(ctx: RunContext, only_failed: bool = False, shard: Shard | None = None) -> dict:
    """The score stage: the rollout mode's scoring (`pipeline.stages.modes`). With `shard`, only the generations of
    the shard's queries, ending with the shard's manifest; `finish_score` writes the stage's."""
    mode = get_mode(ctx.cfg.rollout.mode)
    if shard is not None and not mode.shardable:
        raise ValueError(f"rollout.mode {mode.name} cannot score in shards (its rollout scores its own workflows): "
                         "run the score stage without shards")
    return mode.function("score")(ctx, only_failed, shard)


def score_workflows(ctx: RunContext, only_failed: bool = False, shard: Shard | None = None) -> dict:
    """Score the round's workflow generations in the sandbox (see the module doc); returns counts."""
    gens, items, slots = _round_workflows(ctx)
    if shard is not None:
        gens = gens.filter(pl.col("query_id").map_elements(shard.owns, return_dtype=pl.Boolean))
    texts = dict(zip(gens["gen_id"], gens["text"], strict=True))
    diversity = group_diversity(gens)  # groups are (query, parent): a shard holds whole groups
    passes, plan_jobs = planned_passes(ctx, gens, only_failed)
    desc = f"score round {ctx.round}" + (f" shard {shard}" if shard is not None else "")
    ran, counts = asyncio.run(_score_passes(ctx, passes, plan_jobs,
                                            lambda: _make_scorer(ctx, items, texts, diversity, slots), desc))
    manifest = "score" if shard is None else shard.manifest("score")
    return {"ran": ran, "ran_by_status": counts, **_tally(ctx, set(texts), manifest)}


def planned_passes(ctx: RunContext, gens: pl.DataFrame, only_failed: bool
                   ) -> tuple[list[bool], Callable[[bool], list[Job]]]:
    """The stage's passes over `gens` (retry_pass flags) and the runs a pass would do, planned when it starts."""
    transient = transient_statuses(ctx.cfg.scoring.retry_timeouts)
    # --only-failed also re-scores the runs whose task scorer failed; a normal call's retry pass does not (the
    # function is as broken as it was a moment ago)
    rerun = transient | set(RESCORED_STATUSES) if only_failed else transient
    pairs = list(zip(gens["gen_id"], gens["query_id"], strict=True))

    def plan_jobs(retry_pass: bool) -> list[Job]:
        return plan(pairs, latest_attempts(ctx.store, ctx.run_id, ctx.round), ctx.cfg.scoring.reps, retry_pass, rerun)

    # a normal call runs the missing rows, then gives transient failures (executor down) one new attempt, so a
    # retried stage heals a short outage by itself; --only-failed does the second pass alone
    return ([True] if only_failed else [False, True]), plan_jobs


def nothing_to_score(ctx: RunContext, only_failed: bool = False) -> bool:
    """Whether the stage has no run to do (a round of logged rows, rollout.logged, comes scored): then no executor
    server is started for it, which costs minutes. Flat and two-level rounds; other modes always score."""
    if get_mode(ctx.cfg.rollout.mode).name not in ("flat", "two_level"):
        return False
    gens = ctx.store.read("generations", ctx.run_id, ctx.round).filter(pl.col("kind") == "workflow")
    if gens.height == 0:
        return False
    passes, plan_jobs = planned_passes(ctx, gens, only_failed)
    return not any(plan_jobs(retry_pass) for retry_pass in passes)


def finish_score(ctx: RunContext, only_failed: bool = False) -> dict:
    """The merge of a sharded score stage: the round's counts from the store, and the `score` manifest if every run
    is final. Runs nothing (the shards did); the runner calls it once every shard has its manifest."""
    gens, _, _ = _round_workflows(ctx)
    return {"ran": 0, **_tally(ctx, set(gens["gen_id"]), "score")}
