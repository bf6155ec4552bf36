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
from pipeline.run import derived_seed
from pipeline.stages.modes import get_mode
from pipeline.store.schema import transient_statuses
from pipeline.store.views import part_signal

log = logging.getLogger(__name__)


def load_round(ctx) -> pl.DataFrame:
    """One row per generation of the round (`generation_scores`): kind, parent/query ids, `score` (mean over reps,
    0 for invalid workflows, which stay in) and `state` (ok | unscored | transient)."""
    df = ctx.store.generation_scores(ctx.run_id, ctx.round, ctx.cfg.scoring.reps,
                                     transient_statuses(ctx.cfg.scoring.retry_timeouts))
    return df.with_columns(pl.col("score").fill_null(0.0))


def flat_rows(ctx, df: pl.DataFrame) -> tuple[list[dict], dict]:
    cc = ctx.cfg.curation
    wf = df.filter(pl.col("kind") == "workflow")
    scores, gen_ids, rows = {}, {}, []
    left_out = 0
    for (qid,), q in wf.group_by("query_id", maintain_order=True):
        reason = left_out_reason(q["state"].to_list())
        if reason:
            left_out += 1
            ok = q["state"] == "ok"
            rows.append(group_row(qid, f"{qid}/left-out", "flat", q["gen_id"].to_list(),
                             [s if o else None for s, o in zip(q["score"], ok, strict=True)],
                             kept=False, reason=reason))
            continue
        scores[qid], gen_ids[qid] = q["score"].to_list(), q["gen_id"].to_list()
    res = curate_flat(scores, cc.n, cc.t, cc.top_n, cc.max_groups_per_query, derived_seed(cc.seed, "curate", ctx.round),
                      cc.mode, cc.eps_adv, dedupe=cc.dedupe, max_kept_per_query=cc.max_kept_per_query)
    kept_per_query: dict[str, int] = {}
    for j, g in enumerate(res.groups):
        kept_per_query[g.query_id] = kept_per_query.get(g.query_id, 0) + 1
        ids = gen_ids[g.query_id]
        rows.append(group_row(g.query_id, f"{g.query_id}/g{j}", "flat", [ids[i] for i in g.members], g.scores,
                         kept=True, advantages=g.advantages) | {"variance": g.variance})
    cut = min((g.variance for g in res.groups), default=float("inf"))
    how = "not sampled" if cc.mode.startswith("random") else f"below the top-{cc.top_n} variance cut {cut:.6g}"
    if cc.dedupe and cc.mode == "screen_sharpen":
        how += ", or duplicates of a kept group's members"
    if cc.max_kept_per_query is not None:
        how += f", or past the cap of {cc.max_kept_per_query} kept groups per query"
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
    more, more_counts = objective_rows(scores, gen_ids, cc, np.random.default_rng(
        derived_seed(cc.seed, "pairs", ctx.round)))
    return rows + more, counts | more_counts


def two_level_rows(ctx, df: pl.DataFrame) -> tuple[list[dict], dict]:
    cc = ctx.cfg.curation
    agents = df.filter(pl.col("kind") == "agent")
    wf = df.filter(pl.col("kind") == "workflow")
    by_agent = {k[0]: g for k, g in wf.group_by("parent_id", maintain_order=True)}
    orphans = wf.filter(~pl.col("parent_id").is_in(agents["gen_id"].implode()) | pl.col("parent_id").is_null())
    if orphans.height:
        log.warning("%d workflows have no agent in this round; ignored", orphans.height)
    tree: dict[str, list[list[float]]] = {}
    ids: dict[str, tuple[list[str], list[list[str]]]] = {}
    rows, left_out = [], 0
    for (qid,), q in agents.group_by("query_id", maintain_order=True):
        kids = [by_agent.get(a) for a in q["gen_id"]]
        states = [s for k in kids if k is not None for s in k["state"]]
        # a valid plan without workflows has not been rolled out yet; an invalid one earned nothing
        states += ["unscored" for k, v in zip(kids, q["valid"], strict=True) if k is None and v]
        reason = left_out_reason(states)
        if reason:
            left_out += 1
            rows.append(group_row(qid, f"{qid}/left-out", "agent", q["gen_id"].to_list(), [None] * q.height,
                             kept=False, reason=reason))
            continue
        tree[qid] = [[] if k is None else k["score"].to_list() for k in kids]
        ids[qid] = (q["gen_id"].to_list(), [[] if k is None else k["gen_id"].to_list() for k in kids])
    for tq in two_level_advantages(tree, cc.eps_adv, cc.adv_norm, cc.agent_adv_stats):
        agent_ids, wf_ids = ids[tq.query_id]
        rows.append(group_row(tq.query_id, f"{tq.query_id}/agents", "agent", agent_ids, tq.agent_rewards.tolist(),
                         kept=True, advantages=tq.agent_advantages, buckets=tq.agent_buckets))
        for a, (w_ids, w_s, w_a, w_b) in enumerate(zip(wf_ids, tq.workflow_scores, tq.workflow_advantages,
                                                        tq.workflow_buckets, strict=True)):
            if w_ids:
                rows.append(group_row(tq.query_id, f"{agent_ids[a]}/workflows", "workflow", w_ids, w_s.tolist(),
                                 kept=True, advantages=w_a, buckets=w_b))
    counts = {"queries": len(tree) + left_out, "queries_left_out": left_out,
              "groups_kept": sum(1 for r in rows if r["kept"]),
              "sequences": sum(len(r["members"]) for r in rows if r["kept"])} | distinct_counts(rows)
    return rows, counts


def run_curate(ctx) -> dict:
    """The curate stage: the round's scores -> `groups` rows (kept and screened-out) through the rollout mode's
    curation (`pipeline.stages.modes`), one Parquet part."""
    df = load_round(ctx)
    if df.height == 0:
        raise RuntimeError(f"run {ctx.run_id!r} round {ctx.round}: no generations to curate (run rollout first)")
    mode = get_mode(ctx.cfg.rollout.mode)
    rows, counts = mode.function("curate")(ctx, df)
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
