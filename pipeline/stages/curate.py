"""The curate stage: reads a round's scored generations, builds its rows through the round's rollout mode
(`pipeline.stages.modes`) and the pure curation maths (`pipeline.core.curation`), and writes `groups`."""

from __future__ import annotations

import logging

import numpy as np
import polars as pl

from pipeline.core.curation import (
    curate_flat,
    distinct_counts,
    group_row,
    left_out_reason,
    objective_rows,
    two_level_advantages,
)
from pipeline.core.grpo import choice_credit
from pipeline.run import derived_seed
from pipeline.stages.modes import get_mode
from pipeline.store.schema import transient_statuses
from pipeline.store.views import part_signal

log = logging.getLogger(__name__)


def load_round(ctx) -> pl.DataFrame:
    """One row per generation of the round (`generation_scores`): kind, parent/query ids, `score` (mean over reps,
    0 for invalid workflows, which stay in) and `state` (ok | unscored | transient)."""
    scores = ctx.store.generation_scores(ctx.run_id, ctx.round, ctx.cfg.scoring.reps,
                                         transient_statuses(ctx.cfg.scoring.retry_timeouts))
    return scores.with_columns(pl.col("score").fill_null(0.0))


def flat_rows(ctx, generation_scores: pl.DataFrame) -> tuple[list[dict], dict]:
    curation = ctx.cfg.curation
    if curation.choice_credit:
        return choice_credit_rows(ctx, generation_scores)
    workflows = generation_scores.filter(pl.col("kind") == "workflow")
    scores, gen_ids, rows = {}, {}, []
    left_out = 0
    for (qid,), query_rows in workflows.group_by("query_id", maintain_order=True):
        reason = left_out_reason(query_rows["state"].to_list())
        if reason:
            left_out += 1
            ok = query_rows["state"] == "ok"
            rows.append(group_row(qid, f"{qid}/left-out", "flat", query_rows["gen_id"].to_list(),
                                  [s if o else None for s, o in zip(query_rows["score"], ok, strict=True)],
                             kept=False, reason=reason))
            continue
        scores[qid], gen_ids[qid] = query_rows["score"].to_list(), query_rows["gen_id"].to_list()
    res = curate_flat(scores, curation.n, curation.t, curation.top_n, curation.max_groups_per_query,
                      derived_seed(curation.seed, "curate", ctx.round), curation.mode, curation.eps_adv,
                      dedupe=curation.dedupe, max_kept_per_query=curation.max_kept_per_query)
    kept_per_query: dict[str, int] = {}
    for j, group in enumerate(res.groups):
        kept_per_query[group.query_id] = kept_per_query.get(group.query_id, 0) + 1
        ids = gen_ids[group.query_id]
        rows.append(group_row(group.query_id, f"{group.query_id}/g{j}", "flat", [ids[i] for i in group.members],
                              group.scores, kept=True, advantages=group.advantages) | {"variance": group.variance})
    cut = min((g.variance for g in res.groups), default=float("inf"))
    how = ("not sampled" if curation.mode.startswith("random")
           else f"below the top-{curation.top_n} variance cut {cut:.6g}")
    if curation.dedupe and curation.mode == "screen_sharpen":
        how += ", or duplicates of a kept group's members"
    if curation.max_kept_per_query is not None:
        how += f", or past the cap of {curation.max_kept_per_query} kept groups per query"
    # screened-out groups are summarised, one row per query (members = all its workflows)
    for qid in scores:
        if qid in res.dropped:
            rows.append(group_row(qid, f"{qid}/filtered", "flat", gen_ids[qid], scores[qid], kept=False,
                             reason=f"filtered: {res.dropped[qid]}"))
            continue
        lost = res.candidates[qid] - kept_per_query.get(qid, 0)
        if lost:
            rows.append(group_row(qid, f"{qid}/screened", "flat", gen_ids[qid], scores[qid], kept=False,
                             reason=f"screened out: {lost} of {res.candidates[qid]} candidate groups {how}"))
    counts = {"queries": len(scores) + left_out, "queries_left_out": left_out, "queries_filtered": len(res.dropped),
              "candidate_groups": sum(res.candidates.values()), "groups_kept": len(res.groups),
              "sequences": sum(len(g.members) for g in res.groups)} | distinct_counts(rows)
    more, more_counts = objective_rows(scores, gen_ids, curation, np.random.default_rng(
        derived_seed(curation.seed, "pairs", ctx.round)))
    return rows + more, counts | more_counts


def choice_credit_rows(ctx, generation_scores: pl.DataFrame) -> tuple[list[dict], dict]:
    """curation.choice_credit (rollout.route_or_write): one group per query of all its rows, sampled and logged; two
    `groups` rows of it: level `choice` (every member, the label token's between-design advantage) and level `code`
    (the rows that wrote their own workflow, the within-design advantage of their code), pipeline.core.grpo.
    choice_credit. No C(m, n) subsets and no screening: the comparison between designs needs the whole group."""
    curation = ctx.cfg.curation
    choices = (ctx.store.read("generations", ctx.run_id, ctx.round).unique("gen_id", keep="first")
               .select("gen_id", "choice", "source"))
    workflows = generation_scores.filter(pl.col("kind") == "workflow").join(choices, on="gen_id", how="left")
    rows, counts = [], {"queries": 0, "queries_left_out": 0, "queries_filtered": 0, "groups_kept": 0, "sequences": 0}
    for (qid,), query_rows in workflows.group_by("query_id", maintain_order=True):
        counts["queries"] += 1
        ids, scores = query_rows["gen_id"].to_list(), query_rows["score"].to_list()
        reason = left_out_reason(query_rows["state"].to_list())
        if reason:
            counts["queries_left_out"] += 1
            rows.append(group_row(qid, f"{qid}/left-out", "choice", ids, [None] * len(ids), kept=False, reason=reason))
            continue
        if len(ids) < 2 or len(set(scores)) == 1:
            counts["queries_filtered"] += 1
            rows.append(group_row(qid, f"{qid}/filtered", "choice", ids, scores, kept=False,
                                  reason=f"filtered: {len(ids)} rows, all scores equal ({scores[0]:g})"))
            continue
        designs = [c or "own" for c in query_rows["choice"].to_list()]
        label, code = choice_credit(scores, designs, curation.eps_adv)
        rows.append(group_row(qid, f"{qid}/choice", "choice", ids, scores, kept=True, advantages=label))
        counts["groups_kept"] += 1
        counts["sequences"] += len(ids)
        own = [i for i, src in enumerate(query_rows["source"].to_list()) if src == "write"]
        if len(own) >= 2 and len({scores[i] for i in own}) > 1:
            rows.append(group_row(qid, f"{qid}/code", "code", [ids[i] for i in own], [scores[i] for i in own],
                                  kept=True, advantages=[code[i] for i in own]))
            counts["groups_kept"] += 1
            counts["sequences"] += len(own)
    return rows, counts | distinct_counts(rows) | {"level": "choice_credit"}


def two_level_rows(ctx, generation_scores: pl.DataFrame) -> tuple[list[dict], dict]:
    curation = ctx.cfg.curation
    agents = generation_scores.filter(pl.col("kind") == "agent")
    workflows = generation_scores.filter(pl.col("kind") == "workflow")
    by_agent = {k[0]: g for k, g in workflows.group_by("parent_id", maintain_order=True)}
    orphans = workflows.filter(~pl.col("parent_id").is_in(agents["gen_id"].implode()) | pl.col("parent_id").is_null())
    if orphans.height:
        log.warning("%d workflows have no agent in this round; ignored", orphans.height)
    tree: dict[str, list[list[float]]] = {}
    ids: dict[str, tuple[list[str], list[list[str]]]] = {}
    rows, left_out = [], 0
    for (qid,), query_agents in agents.group_by("query_id", maintain_order=True):
        kids = [by_agent.get(a) for a in query_agents["gen_id"]]
        states = [s for k in kids if k is not None for s in k["state"]]
        # a valid plan without workflows has not been rolled out yet; an invalid one earned nothing
        states += ["unscored" for k, v in zip(kids, query_agents["valid"], strict=True) if k is None and v]
        reason = left_out_reason(states)
        if reason:
            left_out += 1
            rows.append(group_row(qid, f"{qid}/left-out", "agent", query_agents["gen_id"].to_list(),
                                  [None] * query_agents.height, kept=False, reason=reason))
            continue
        tree[qid] = [[] if k is None else k["score"].to_list() for k in kids]
        ids[qid] = (query_agents["gen_id"].to_list(), [[] if k is None else k["gen_id"].to_list() for k in kids])
    for query in two_level_advantages(tree, curation.eps_adv, curation.adv_norm, curation.agent_adv_stats):
        agent_ids, wf_ids = ids[query.query_id]
        rows.append(group_row(query.query_id, f"{query.query_id}/agents", "agent", agent_ids,
                              query.agent_rewards.tolist(), kept=True, advantages=query.agent_advantages,
                              buckets=query.agent_buckets))
        for a, (w_ids, w_s, w_a, w_b) in enumerate(zip(wf_ids, query.workflow_scores, query.workflow_advantages,
                                                       query.workflow_buckets, strict=True)):
            if w_ids:
                rows.append(group_row(query.query_id, f"{agent_ids[a]}/workflows", "workflow", w_ids, w_s.tolist(),
                                 kept=True, advantages=w_a, buckets=w_b))
    counts = {"queries": len(tree) + left_out, "queries_left_out": left_out,
              "groups_kept": sum(1 for r in rows if r["kept"]),
              "sequences": sum(len(r["members"]) for r in rows if r["kept"])} | distinct_counts(rows)
    return rows, counts


def run_curate(ctx) -> dict:
    """The curate stage: the round's scores -> `groups` rows (kept and screened-out) through the rollout mode's
    curation (`pipeline.stages.modes`), one Parquet part."""
    generation_scores = load_round(ctx)
    if generation_scores.height == 0:
        raise RuntimeError(f"run {ctx.run_id!r} round {ctx.round}: no generations to curate (run rollout first)")
    mode = get_mode(ctx.cfg.rollout.mode)
    rows, counts = mode.function("curate")(ctx, generation_scores)
    ctx.store.write("groups", rows, ctx.run_id, ctx.round)
    counts.setdefault("level", "two_level" if mode.name == "two_level" else ctx.cfg.curation.mode)
    counts |= parts_kept(ctx)
    ctx.finish("curate", **counts)
    return counts


def parts_kept(ctx) -> dict:
    """On a task of several parts (`queries.meta.task`): the groups kept per part, and a warning naming each part
    with none. GRPO learns only from queries whose workflows' scores differ, so such a part is invisible to this
    round's update whatever a fixed design scores there (docs/learning.md, where the gradient comes from)."""
    if ctx.cfg.rollout.mode == "refine":  # its groups are a task's candidates, not a query's workflows
        return {}
    sig = part_signal(ctx.store, ctx.run_id).filter(pl.col("round") == ctx.round)
    if sig.height < 2:
        return {}
    if dead := [f"{r['part']} ({r['queries']} queries, {r['queries_varied']} with varied scores)"
                for r in sig.iter_rows(named=True) if not r["groups_kept"]]:
        log.warning("%s round %d: no group kept from %s: this round's update sees nothing of it",
                    ctx.run_id, ctx.round, "; ".join(dead))
    return {"groups_by_part": dict(zip(sig["part"], sig["groups_kept"], strict=True))}
