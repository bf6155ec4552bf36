"""Every SQL view and shared query of the store, one definition each: the views `latest_scores`,
`generation_scores` and `query_usage` (`VIEWS`, created in every catalog and connection), the exemplar pools of
earlier rounds, and the per-round summary that the runner and the report read."""

from __future__ import annotations

from typing import Any

import polars as pl

from pipeline.store.schema import TRANSIENT_STATUSES

# A set of workflow runs' usage (`scores` or `checks` rows), summed: used tokens, computed tokens (a row written
# before the executor cache existed computed all it used), cache hits and truncated replies.
RUN_USAGE_SUMS = """sum(llm_calls)::BIGINT AS calls, sum(tokens_in)::BIGINT AS tin, sum(tokens_out)::BIGINT AS tout,
    sum(cost_usd) AS cost, sum(coalesce(computed_tokens_in, tokens_in))::BIGINT AS computed_in,
    sum(coalesce(computed_tokens_out, tokens_out))::BIGINT AS computed_out,
    sum(coalesce(cached_calls, 0))::BIGINT AS cached, sum(truncated_calls)::BIGINT AS truncated,
    coalesce(sum(llm_calls) FILTER (WHERE truncated_calls IS NOT NULL), 0)::BIGINT AS known"""

# The latest attempt of each (generation, rep): a re-score appends attempts, nothing is rewritten.
LATEST_SCORES_SQL = """SELECT * FROM scores
QUALIFY row_number() OVER (PARTITION BY run_id, round, gen_id, rep ORDER BY attempt DESC, created_at DESC) = 1"""

# A generation's score, the one definition: the mean over its reps' latest attempts, where an invalid workflow
# (or a run with status `invalid`) counts 0 and a missing score 0; runs whose latest status is transient
# (an executor outage) are left out of the mean and counted in `transient_runs`; runs whose user scorer failed
# (status `error`) count 0 and are counted in `error_runs`. NULL: no final run yet.
GENERATION_SCORES_SQL = f"""
WITH g AS (
    SELECT run_id, round, gen_id, any_value(kind) AS kind, any_value(parent_id) AS parent_id,
           any_value(query_id) AS query_id, min(slot) AS slot, bool_and(coalesce(valid, true)) AS valid,
           any_value(repair_of) AS repair_of, coalesce(max(attempt), 0) AS attempt
    FROM generations GROUP BY run_id, round, gen_id),
repaired AS (SELECT DISTINCT run_id, round, repair_of AS gen_id FROM generations WHERE repair_of IS NOT NULL),
s AS (
    SELECT run_id, round, gen_id, count(DISTINCT rep) AS reps_scored,
           count(*) FILTER (WHERE status IN ({", ".join(f"'{t}'" for t in TRANSIENT_STATUSES)})) AS transient_runs,
           count(*) FILTER (WHERE status = 'timeout') AS timeout_runs,
           count(*) FILTER (WHERE status = 'error') AS error_runs,
           avg(CASE WHEN status = 'invalid' THEN 0 ELSE coalesce(score, 0) END)
               FILTER (WHERE status NOT IN ({", ".join(f"'{t}'" for t in TRANSIENT_STATUSES)})) AS score,
           sum(llm_calls) AS llm_calls, sum(tokens_in) AS tokens_in, sum(tokens_out) AS tokens_out,
           sum(cost_usd) AS cost_usd
    FROM latest_scores GROUP BY run_id, round, gen_id)
SELECT g.*, r.gen_id IS NULL AS final, coalesce(s.reps_scored, 0) AS reps_scored,
       coalesce(s.transient_runs, 0) AS transient_runs, coalesce(s.timeout_runs, 0) AS timeout_runs,
       coalesce(s.error_runs, 0) AS error_runs,
       CASE WHEN NOT g.valid THEN 0.0 ELSE s.score END AS score,
       s.llm_calls, s.tokens_in, s.tokens_out, s.cost_usd
FROM g LEFT JOIN s USING (run_id, round, gen_id) LEFT JOIN repaired r USING (run_id, round, gen_id)
"""

# The share of executor calls with a reply cut at the token cap, of the runs that recorded it (parts written before
# the column read it as null, and their calls are left out of the denominator), so a store of either age reads.
TRUNCATED_SHARE_SQL = "sum(truncated_calls) / nullif(sum(llm_calls) FILTER (WHERE truncated_calls IS NOT NULL), 0)"


# What answering one query cost, the one definition (evaluation summaries, baselines, the report): generator tokens
# of every generation of the query (any kind: plans, workflows, repairs, SMC rollouts; the prompt counted once per
# sample, as n separate requests would be billed), and executor tokens of its scoring runs (latest attempts, all
# reps) plus its generation-time runs (`checks`: self-repair's self-checks, SMC's look-ahead scoring).
# exec_tokens_* are the tokens the workflows used (what budgets compare); exec_computed_tokens_* those the executor
# computed (cache hits left out; a row written before the cache existed computed all of its tokens).
QUERY_USAGE_SQL = f"""
WITH g AS (
    SELECT run_id, round, gen_id, any_value(query_id) AS query_id, any_value(kind) AS kind,
           any_value(coalesce(len(prompt_token_ids), 0)) AS tin, any_value(coalesce(len(token_ids), 0)) AS tout,
           any_value(coalesce(cost_usd, 0)) AS cost
    FROM generations GROUP BY run_id, round, gen_id),
gq AS (
    SELECT run_id, round, query_id, count(*) FILTER (WHERE kind = 'workflow') AS workflows, count(*) AS generations,
           sum(tin)::BIGINT AS gen_tokens_in, sum(tout)::BIGINT AS gen_tokens_out, sum(cost) AS gen_cost_usd
    FROM g GROUP BY run_id, round, query_id),
sq AS (
    SELECT run_id, round, query_id, {RUN_USAGE_SUMS}
    FROM latest_scores GROUP BY run_id, round, query_id),
cq AS (
    SELECT run_id, round, query_id, count(*) AS checks, {RUN_USAGE_SUMS}
    FROM checks GROUP BY run_id, round, query_id)
SELECT gq.run_id, gq.round, gq.query_id, gq.workflows, gq.generations, coalesce(cq.checks, 0) AS checks,
       gq.gen_tokens_in, gq.gen_tokens_out, gq.gen_cost_usd,
       coalesce(sq.calls, 0) + coalesce(cq.calls, 0) AS exec_calls,
       coalesce(sq.tin, 0) + coalesce(cq.tin, 0) AS exec_tokens_in,
       coalesce(sq.tout, 0) + coalesce(cq.tout, 0) AS exec_tokens_out,
       coalesce(sq.cost, 0) + coalesce(cq.cost, 0) AS exec_cost_usd,
       coalesce(sq.computed_in, 0) + coalesce(cq.computed_in, 0) AS exec_computed_tokens_in,
       coalesce(sq.computed_out, 0) + coalesce(cq.computed_out, 0) AS exec_computed_tokens_out,
       coalesce(sq.cached, 0) + coalesce(cq.cached, 0) AS exec_cached_calls,
       -- null where no run of the query recorded it (written before the column existed); `known`: the calls of
       -- the runs that did, the truncated share's denominator
       CASE WHEN sq.truncated IS NULL AND cq.truncated IS NULL THEN NULL
            ELSE coalesce(sq.truncated, 0) + coalesce(cq.truncated, 0) END AS exec_truncated_calls,
       coalesce(sq.known, 0) + coalesce(cq.known, 0) AS exec_known_calls
FROM gq LEFT JOIN sq USING (run_id, round, query_id) LEFT JOIN cq USING (run_id, round, query_id)
"""


# Exemplar pools (pipeline.stages.exemplars): scored workflows of rounds before $round, and each agent plan with its
# workflows' mean score.
POOL_SQL = """
WITH w AS (
    SELECT s.gen_id, s.parent_id, s.query_id, g.text, s.score
    FROM generation_scores s JOIN generations g USING (run_id, round, gen_id)
    WHERE s.run_id = $run AND s.round < $round AND s.kind = 'workflow' AND s.score IS NOT NULL
)
SELECT 'workflow' AS kind, gen_id, query_id, text, score, parent_id AS agent_id FROM w
UNION ALL
SELECT 'agent', a.gen_id, a.query_id, any_value(a.text), avg(w.score), NULL
FROM generations a JOIN w ON w.parent_id = a.gen_id
WHERE a.run_id = $run AND a.round < $round AND a.kind = 'agent'
GROUP BY a.gen_id, a.query_id
ORDER BY 1, 2
"""

# Runs flagged by the static scan of their code (pipeline.core.tamper, `scores.flags`) that the metric rewarded.
FLAGGED_REWARDED_SQL = "coalesce(flags, '') <> '' AND metric > 0"


def flagged_rewarded(store, run_id: str) -> int:
    """Latest-attempt runs of `run_id`, all rounds, that were flagged and rewarded (FLAGGED_REWARDED_SQL)."""
    df = store.sql(f"SELECT count(*) AS n FROM latest_scores WHERE run_id = $run AND {FLAGGED_REWARDED_SQL}",
                   {"run": run_id}, run=run_id)
    return int(df["n"][0])


# One row per round of a run: rollout, scoring, usage, curation and training figures.
ROUND_SQL = f"""
WITH g AS (
  SELECT round, count(*) AS workflows, avg(CASE WHEN valid THEN 1.0 ELSE 0.0 END) AS valid_share
  FROM generations WHERE run_id = $run AND kind = 'workflow' GROUP BY round),
s AS (
  SELECT round, count(*) AS scored, avg(score) AS mean_score, max(score) AS best_score FROM generation_scores
  WHERE run_id = $run AND kind = 'workflow' AND score IS NOT NULL GROUP BY round),
u AS (
  SELECT round, {RUN_USAGE_SUMS},
         -- runs whose code touches the harness's surface (scores.flags) and whose metric rewarded them anyway
         count(*) FILTER (WHERE {FLAGGED_REWARDED_SQL}) AS flagged_rewarded
  FROM latest_scores WHERE run_id = $run GROUP BY round),
q AS (
  SELECT round, avg(gen_tokens_in + gen_tokens_out) AS gen_tokens_per_query,
         avg(exec_tokens_in + exec_tokens_out) AS exec_tokens_per_query
  FROM query_usage WHERE run_id = $run GROUP BY round),
c AS (SELECT round, count(*) FILTER (WHERE kept AND coalesce(kind, 'group') = 'group') AS groups_kept FROM groups
      WHERE run_id = $run GROUP BY round),
t AS (
  SELECT round, count(*) AS steps, avg(loss) AS loss, avg(kl) AS kl, avg(kl_old) AS kl_old, avg(clip_frac) AS clip_frac,
         sum(tokens)::BIGINT AS train_tokens
  FROM train_metrics WHERE run_id = $run GROUP BY round),
r AS (SELECT round FROM g UNION SELECT round FROM s UNION SELECT round FROM c UNION SELECT round FROM t)
SELECT r.round, workflows, valid_share, scored, mean_score, best_score, flagged_rewarded, u.calls AS llm_calls,
       -- the share of the round's executor calls with a reply cut at the token cap (null: not recorded)
       u.truncated / nullif(u.known, 0) AS truncated_share,
       u.tin AS tokens_in, u.tout AS tokens_out, u.cost AS cost_usd, u.computed_in AS computed_tokens_in,
       u.computed_out AS computed_tokens_out, u.cached AS cached_calls,
       u.cached / nullif(u.calls, 0) AS cache_hit_rate, u.truncated AS truncated_calls, gen_tokens_per_query,
       exec_tokens_per_query, groups_kept, steps, loss, kl, kl_old, clip_frac, train_tokens
FROM r LEFT JOIN g USING (round) LEFT JOIN s USING (round) LEFT JOIN u USING (round) LEFT JOIN q USING (round)
       LEFT JOIN c USING (round) LEFT JOIN t USING (round)
ORDER BY r.round
"""


def round_stats(store: Any, run_id: str) -> pl.DataFrame:
    """One row per round: workflows, valid_share, scored, mean_score, best_score, flagged_rewarded (runs whose code
    touches the harness's surface yet passed: see docs/sandbox.md), usage (truncated_share: of the scoring runs'
    executor calls, those with a reply cut at the token cap), tokens per query, groups, training."""
    return store.sql(ROUND_SQL, {"run": run_id}, run=run_id)


# Do a round's groups span designs? Per round of a run, of its queries (a GRPO group is a query's workflows),
# the share whose workflows follow at least two designs of the menu (`generations.design`, pipeline.core.designs;
# `other` counts as one design), and the mean number of designs per query. Null designs (no menu) count as none.
DESIGN_SPAN_SQL = """
WITH q AS (SELECT round, query_id, count(DISTINCT design) AS designs FROM generations
           WHERE run_id = $run AND kind = 'workflow' GROUP BY round, query_id)
SELECT round, count(*) AS queries, avg(CASE WHEN designs >= 2 THEN 1.0 ELSE 0.0 END) AS spanning_share,
       avg(designs) AS designs_per_query
FROM q GROUP BY round ORDER BY round
"""

# Per round, each design's share of the run's workflows: written (`design`) beside shown (`example`), so a generator
# that copies its example keeps the two alike and one that converges on a design moves the written shares.
DESIGN_SHARES_SQL = """
WITH w AS (SELECT round, design, example FROM generations WHERE run_id = $run AND kind = 'workflow'),
written AS (SELECT round, design AS name, count(*) AS n FROM w GROUP BY ALL),
shown AS (SELECT round, example AS name, count(*) AS n FROM w GROUP BY ALL),
total AS (SELECT round, count(*) AS n FROM w GROUP BY round)
SELECT coalesce(a.round, b.round) AS round, coalesce(a.name, b.name) AS design,
       coalesce(a.n, 0) / t.n AS written_share, coalesce(b.n, 0) / t.n AS shown_share
FROM written a FULL JOIN shown b ON a.round = b.round AND a.name IS NOT DISTINCT FROM b.name
JOIN total t ON t.round = coalesce(a.round, b.round)
ORDER BY round, written_share DESC, design
"""


def design_spread(store: Any, run_id: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(DESIGN_SPAN_SQL, DESIGN_SHARES_SQL) of one run."""
    return (store.sql(DESIGN_SPAN_SQL, {"run": run_id}, run=run_id),
            store.sql(DESIGN_SHARES_SQL, {"run": run_id}, run=run_id))


# What the gradient sees, per round and part of a task mixing generators (`queries.meta.task`; '' for a benchmark
# without parts): the queries, their workflows' mean score, how many queries' workflows do not all score the same
# (GRPO learns from those only) and the groups curation kept from them. Where a part has no varied query, training
# rounds never see it, whatever a fixed design scores there.
PART_SIGNAL_SQL = """
WITH q AS (SELECT round, query_id, coalesce(json_extract_string(meta, '$.task'), '') AS part FROM queries
           WHERE run_id = $run),
s AS (SELECT round, query_id, avg(score) AS mean, max(score) > min(score) AS varied FROM generation_scores
      WHERE run_id = $run AND kind = 'workflow' GROUP BY round, query_id),
g AS (SELECT round, query_id, count(*) AS n FROM groups
      WHERE run_id = $run AND kept AND coalesce(kind, 'group') = 'group' GROUP BY round, query_id)
SELECT q.round, q.part, count(*) AS queries, avg(s.mean) AS mean_score,
       count(*) FILTER (WHERE s.varied) AS queries_varied, coalesce(sum(g.n), 0)::BIGINT AS groups_kept
FROM q LEFT JOIN s USING (round, query_id) LEFT JOIN g USING (round, query_id)
GROUP BY ALL ORDER BY q.round, q.part
"""


def part_signal(store: Any, run_id: str) -> pl.DataFrame:
    """PART_SIGNAL_SQL of one run."""
    return store.sql(PART_SIGNAL_SQL, {"run": run_id}, run=run_id)


# Per round, the kept GRPO groups whose members declare at least two different choices: only there does a group's
# advantage compare designs, so only there can an update learn the choice.
CHOICE_SPAN_SQL = """
WITH m AS (SELECT gr.round, gr.group_id, count(DISTINCT coalesce(g.choice, '')) AS choices
           FROM (SELECT round, group_id, unnest(members) AS gen_id FROM groups
                 WHERE run_id = $run AND kept AND coalesce(kind, 'group') = 'group') gr
           JOIN generations g ON g.run_id = $run AND g.round = gr.round AND g.gen_id = gr.gen_id
           GROUP BY ALL)
SELECT round, count(*) AS groups_kept, count(*) FILTER (WHERE choices >= 2) AS spanning,
       avg(CASE WHEN choices >= 2 THEN 1.0 ELSE 0.0 END) AS spanning_share
FROM m GROUP BY round ORDER BY round
"""


VIEWS = {"latest_scores": LATEST_SCORES_SQL, "generation_scores": GENERATION_SCORES_SQL, "query_usage": QUERY_USAGE_SQL}

# The caches beside the store (pipeline.engines.cache): `<root>/cache/<kind>/*.jsonl`, one entry a line; a line torn
# by a killed writer reads as nulls and is left out. kind -> its view's columns.
CACHE_VIEWS = {
    "executor": {"key": "VARCHAR", "identity": "VARCHAR", "model": "VARCHAR", "messages": "VARCHAR",
                 "temperature": "DOUBLE", "n": "INTEGER", "max_tokens": "INTEGER", "seed": "BIGINT",
                 "texts": "VARCHAR[]", "tokens_in": "BIGINT", "tokens_out": "BIGINT", "truncated": "INTEGER",
                 "created_at": "TIMESTAMPTZ"},
    "grader": {"key": "VARCHAR", "scope": "VARCHAR", "item": "VARCHAR", "score": "DOUBLE", "details": "JSON",
               "created_at": "TIMESTAMPTZ"},
}
