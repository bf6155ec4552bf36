"""Curation: F/M/S buckets, SPOGW group-wise data, two-level advantages, and the curate stage.

Flat (SPOGW, DESIGN.md §6): per query, candidate groups are n-subsets of its m workflows, enumerated
by combination rank (colex) and unranked in vectorised chunks, so neither C(m, n) subsets nor the
round's pool are ever held in memory: a running top-N buffer keeps the best candidates.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np
import polars as pl

from pipeline.grpo import group_advantages, normalise
from pipeline.schema import transient_statuses

log = logging.getLogger(__name__)

Mode = Literal["random", "random_filter", "screen", "screen_sharpen"]
MODES = ("random", "random_filter", "screen", "screen_sharpen")
_CHUNK = 8192  # candidate groups unranked / scored per numpy call
_INT64_SAFE = 2**62  # above this, ranks and the binomial table fall back to Python ints


def assign_buckets(scores: Sequence[float]) -> list[str]:
    """Fast if >= the 2/3 quantile, Slow if <= the 1/3 quantile, else Medium (numpy's default
    linear quantiles; an item meeting both bounds, e.g. when all scores are equal, is Fast)."""
    s = np.asarray(scores, dtype=float)
    if s.size == 0:
        return []
    hi, lo = np.quantile(s, 2 / 3), np.quantile(s, 1 / 3)
    return ["F" if x >= hi else "S" if x <= lo else "M" for x in s]


# ---- combinations by rank ---------------------------------------------------------------------


@lru_cache(maxsize=64)
def _binom_table(m: int, n: int) -> np.ndarray:
    """B[c, k] = C(c, k) for c < m, k <= n; object dtype (Python ints) when C(m, n) overflows int64."""
    big = math.comb(m, n) >= _INT64_SAFE
    tab = np.array([[math.comb(c, k) for k in range(n + 1)] for c in range(m)], dtype=object if big else np.int64)
    tab.setflags(write=False)
    return tab


def unrank_combinations(ranks: np.ndarray, m: int, n: int) -> np.ndarray:
    """Ranks in [0, C(m, n)) -> [R, n] member indices (ascending) in the colexicographic order:
    rank = sum_k C(c_k, k) with c_1 < ... < c_n. Vectorised over ranks; exact for any size."""
    tab = _binom_table(m, n)
    r = np.array(ranks, dtype=tab.dtype)
    out = np.empty((r.shape[0], n), dtype=np.int32)
    for k in range(n, 0, -1):
        c = np.searchsorted(tab[:, k], r, side="right") - 1  # largest c with C(c, k) <= r
        out[:, k - 1] = c
        r = r - tab[c, k]
    return out


@lru_cache(maxsize=64)
def _all_combinations(m: int, n: int) -> np.ndarray:
    idx = unrank_combinations(np.arange(math.comb(m, n)), m, n)
    idx.setflags(write=False)
    return idx


def _sample_ranks(total: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """k distinct ranks uniformly from [0, total) without materialising the range."""
    if total < _INT64_SAFE:
        return rng.choice(total, size=k, replace=False)
    # Floyd's algorithm on Python ints: exactly k draws, no rejection loop, no size limit
    py = random.Random(int(rng.integers(2**63)))
    chosen: dict[int, None] = {}
    for j in range(total - k, total):
        x = py.randrange(j + 1)
        chosen[j if x in chosen else x] = None
    return np.array(list(chosen), dtype=object)


def candidate_groups(m: int, n: int, max_groups: int | None, rng: np.random.Generator,
                     chunk: int = _CHUNK) -> Iterator[np.ndarray]:
    """[r, n] index chunks: every n-subset of range(m) when C(m, n) <= max_groups (or no cap),
    else `max_groups` distinct subsets drawn uniformly; streamed, never all at once."""
    total = math.comb(m, n)
    if max_groups is not None and total > max_groups:
        ranks = _sample_ranks(total, max_groups, rng)
        for i in range(0, len(ranks), chunk):
            yield unrank_combinations(ranks[i:i + chunk], m, n)
    elif total <= chunk:
        yield _all_combinations(m, n)
    else:
        if total >= _INT64_SAFE:
            raise ValueError(f"C({m}, {n}) = {total} subsets cannot be enumerated; set max_groups_per_query")
        for start in range(0, total, chunk):
            yield unrank_combinations(np.arange(start, min(start + chunk, total)), m, n)


# ---- flat SPOGW -------------------------------------------------------------------------------


@dataclass
class Group:
    """A kept group. `members` index the query's score list (after sharpening: t lowest then t
    highest, by score, ties by index); `variance` is the screening key: Var (ddof=0) of the
    n-member group before sharpening."""

    query_id: str
    members: tuple[int, ...]
    scores: tuple[float, ...]
    variance: float
    advantages: tuple[float, ...]
    kl_mask: tuple[bool, ...]


@dataclass
class FlatCuration:
    groups: list[Group]
    dropped: dict[str, str] = field(default_factory=dict)  # query id -> why it made no candidates
    candidates: dict[str, int] = field(default_factory=dict)  # query id -> candidate groups considered


class _TopN:
    """Running top-N of (key desc, arrival order asc) over streamed candidates, in bounded memory."""

    def __init__(self, n: int, width: int):
        self.n, self.width = n, width
        self.key = np.empty(0)
        self.seq = np.empty(0, np.int64)
        self.query = np.empty(0, np.int64)
        self.members = np.empty((0, width), np.int32)
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._arrived = 0

    def push(self, key: np.ndarray, query: int, members: np.ndarray) -> None:
        r = len(key)
        if members.shape[1] < self.width:  # a query with m < n: pad its (smaller) groups with -1
            members = np.pad(members, ((0, 0), (0, self.width - members.shape[1])), constant_values=-1)
        self._pending.append((key, np.arange(self._arrived, self._arrived + r), np.full(r, query), members))
        self._arrived += r
        self._pending_rows += r
        if self._pending_rows >= max(4 * self.n, 65536):
            self._compact()

    def _compact(self) -> None:
        if not self._pending:
            return
        parts = list(zip(*self._pending, strict=True))
        key = np.concatenate([self.key, *parts[0]])
        seq = np.concatenate([self.seq, *parts[1]])
        query = np.concatenate([self.query, *parts[2]])
        members = np.concatenate([self.members, *parts[3]])
        keep = np.lexsort((seq, -key))[: self.n]
        self.key, self.seq, self.query, self.members = key[keep], seq[keep], query[keep], members[keep]
        self._pending, self._pending_rows = [], 0

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._compact()
        return self.key, self.query, self.members


def sharpen(members: np.ndarray, scores: np.ndarray, t: int) -> np.ndarray:
    """Sort a group by score (ties by member index) and keep the t lowest and t highest; a group of
    2t or fewer has no middle to drop and is returned sorted, whole."""
    order = np.lexsort((members, scores))
    if len(order) > 2 * t:
        order = np.concatenate([order[:t], order[-t:]])
    return members[order]


def curate_flat(
    scores_by_query: Mapping[str, Sequence[float]],
    n: int,
    t: int,
    top_n: int,
    max_groups_per_query: int | None = None,
    seed: int = 0,
    mode: Mode = "screen_sharpen",
    eps_adv: float = 1e-6,
) -> FlatCuration:
    """SPOGW group-wise data and its ablations (paper Table 4):
    - random: N groups drawn uniformly from the round's candidate pool, no filter, no sharpening;
    - random_filter: the same after dropping queries whose scores are all equal;
    - screen: filter, then the top-N groups by score variance over the whole round;
    - screen_sharpen (default): screen, then keep each group's t lowest and t highest members.
    A query with m < n workflows (some never generated) contributes its single group of all m
    (rather than being discarded: its contrast is still real); it needs m >= 2."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if n < 2 or t < 1 or 2 * t >= n:
        raise ValueError(f"needs n >= 2, t >= 1 and 2t < n; got n={n}, t={t}")
    if top_n < 1:
        raise ValueError(f"top_n must be >= 1, got {top_n}")
    rng = np.random.default_rng(seed)
    qids = list(scores_by_query)
    arrays = [np.asarray(scores_by_query[q], dtype=float) for q in qids]
    out = FlatCuration(groups=[])
    top = _TopN(top_n, n)
    for qi, (qid, s) in enumerate(zip(qids, arrays, strict=True)):
        if s.size < 2:
            out.dropped[qid] = f"fewer than 2 scored workflows ({s.size})"
            continue
        if mode != "random" and np.all(s == s[0]):
            out.dropped[qid] = f"all {s.size} scores equal ({s[0]:g})"
            continue
        count = 0
        for idx in candidate_groups(s.size, min(n, s.size), max_groups_per_query, rng):
            # random: the top-N of iid uniform keys is a uniform sample of N groups;
            # screening: variance, rounded so that equal multisets of scores tie exactly
            key = rng.random(len(idx)) if mode.startswith("random") else np.round(s[idx].var(axis=1), 12)
            top.push(key, qi, idx)
            count += len(idx)
        out.candidates[qid] = count
    _, query, members = top.result()
    for qi, row in zip(query, members, strict=True):
        s = arrays[qi]
        idx = row[row >= 0]
        var = float(s[idx].var())
        if mode == "screen_sharpen":
            idx = sharpen(idx, s[idx], t)
        adv = group_advantages(s[idx], eps_adv)
        out.groups.append(Group(qids[qi], tuple(int(i) for i in idx), tuple(float(x) for x in s[idx]), var,
                                tuple(float(a) for a in adv), tuple(bool(a > 0) for a in adv)))
    return out


def spogw_groups(
    scores_by_query: Mapping[str, Sequence[float]],
    n: int,
    t: int,
    top_n: int,
    max_groups_per_query: int | None = None,
    seed: int = 0,
    *,
    mode: Mode = "screen_sharpen",
    eps_adv: float = 1e-6,
) -> list[Group]:
    """The kept groups of `curate_flat` (ranked by variance, or in sample order for random modes)."""
    return curate_flat(scores_by_query, n, t, top_n, max_groups_per_query, seed, mode, eps_adv).groups


# ---- two-level ----------------------------------------------------------------------------------


@dataclass
class TwoLevelQuery:
    query_id: str
    agent_rewards: np.ndarray  # r_i = mean of agent i's workflow scores (0 for an agent with none)
    agent_advantages: np.ndarray
    agent_buckets: list[str]  # within the query
    workflow_scores: list[np.ndarray]  # per agent
    workflow_advantages: list[np.ndarray]
    workflow_buckets: list[list[str]]  # within the agent


def two_level_advantages(
    scores_by_query: Mapping[str, Sequence[Sequence[float]]],
    eps_adv: float = 1e-6,
    norm: Literal["batch", "query"] = "batch",
) -> list[TwoLevelQuery]:
    """A^A_i = (r_i - mean)/(std + eps) and A^W_ij = (r_ij - mean)/(std + eps), each level with its
    own mean and population std over the whole batch (`norm="batch"`) or over the query ("query")."""
    if norm not in ("batch", "query"):
        raise ValueError(f"norm must be 'batch' or 'query', got {norm!r}")
    per_query = []
    for qid, agents in scores_by_query.items():
        wf = [np.asarray(w, dtype=float) for w in agents]
        rewards = np.array([w.mean() if w.size else 0.0 for w in wf])
        per_query.append((qid, rewards, wf))
    if norm == "batch":
        all_r = np.concatenate([r for _, r, _ in per_query]) if per_query else np.empty(0)
        all_w = np.concatenate([x for _, _, wf in per_query for x in wf] or [np.empty(0)])
        a_stats = (all_r.mean(), all_r.std()) if all_r.size else (0.0, 0.0)
        w_stats = (all_w.mean(), all_w.std()) if all_w.size else (0.0, 0.0)
    out = []
    for qid, rewards, wf in per_query:
        if norm == "query":
            flat = np.concatenate(wf) if wf else np.empty(0)
            a_stats = (rewards.mean(), rewards.std()) if rewards.size else (0.0, 0.0)
            w_stats = (flat.mean(), flat.std()) if flat.size else (0.0, 0.0)
        out.append(TwoLevelQuery(
            query_id=qid,
            agent_rewards=rewards,
            agent_advantages=normalise(rewards, *a_stats, eps_adv),
            agent_buckets=assign_buckets(rewards),
            workflow_scores=wf,
            workflow_advantages=[normalise(w, *w_stats, eps_adv) for w in wf],
            workflow_buckets=[assign_buckets(w) for w in wf],
        ))
    return out


# ---- the curate stage ---------------------------------------------------------------------------

_GEN_SQL = """
WITH g AS (
    SELECT gen_id, any_value(kind) AS kind, any_value(parent_id) AS parent_id, any_value(query_id) AS query_id,
           min(slot) AS slot, bool_and(coalesce(valid, true)) AS valid
    FROM generations WHERE run_id = $run AND round = $round GROUP BY gen_id),
s AS (
    SELECT gen_id, count(DISTINCT rep) FILTER (WHERE rep < $reps) AS reps_done,
           avg(CASE WHEN status = 'invalid' THEN 0 ELSE coalesce(score, 0) END) AS score,
           count(*) FILTER (WHERE list_contains($transient, status)) AS transient
    FROM latest_scores WHERE run_id = $run AND round = $round GROUP BY gen_id)
SELECT g.*, coalesce(s.reps_done, 0) AS reps_done, s.score, coalesce(s.transient, 0) AS transient
FROM g LEFT JOIN s USING (gen_id)
ORDER BY query_id, parent_id NULLS FIRST, slot, gen_id
"""


def load_round(ctx) -> pl.DataFrame:
    """One row per generation of the round: kind, parent/query ids, and `state` (ok | unscored |
    transient) with `score` = mean over reps (0 for invalid workflows, which stay in)."""
    transient = sorted(transient_statuses(ctx.cfg.scoring.retry_timeouts))
    df = ctx.store.sql(_GEN_SQL.replace("$run", "$1").replace("$round", "$2").replace("$reps", "$3")
                       .replace("$transient", "$4"), [ctx.run_id, ctx.round, ctx.cfg.scoring.reps, transient])
    state = (pl.when(~pl.col("valid")).then(pl.lit("ok"))
             .when(pl.col("transient") > 0).then(pl.lit("transient"))
             .when(pl.col("reps_done") < ctx.cfg.scoring.reps).then(pl.lit("unscored"))
             .otherwise(pl.lit("ok")))
    score = pl.when(~pl.col("valid")).then(0.0).otherwise(pl.col("score").fill_null(0.0))
    return df.with_columns(state.alias("state"), score.alias("score"))


def _left_out_reason(states: Sequence[str]) -> str | None:
    bad = {s: sum(1 for x in states if x == s) for s in ("unscored", "transient") if s in states}
    if not bad:
        return None
    return "left out: " + ", ".join(f"{k} of {len(states)} workflows {v}" for v, k in bad.items())


def _row(qid: str, gid: str, level: str, members: Sequence[str], scores: Sequence[float | None], *,
         kept: bool, reason: str | None = None, advantages: Sequence[float] | None = None,
         buckets: Sequence[str] | None = None) -> dict:
    vals = np.array([x for x in scores if x is not None], dtype=float)
    return {
        "group_id": gid, "query_id": qid, "level": level, "members": list(members),
        "member_scores": list(scores), "variance": float(vals.var()) if vals.size else None, "kept": kept,
        "reason": reason, "advantages": None if advantages is None else [float(a) for a in advantages],
        "kl_mask": None if advantages is None else [bool(a > 0) for a in advantages],
        "buckets": None if buckets is None else list(buckets),
    }


def _flat_rows(ctx, df: pl.DataFrame) -> tuple[list[dict], dict]:
    cc = ctx.cfg.curation
    wf = df.filter(pl.col("kind") == "workflow")
    scores, gen_ids, rows = {}, {}, []
    left_out = 0
    for (qid,), q in wf.group_by("query_id", maintain_order=True):
        reason = _left_out_reason(q["state"].to_list())
        if reason:
            left_out += 1
            ok = q["state"] == "ok"
            rows.append(_row(qid, f"{qid}/left-out", "flat", q["gen_id"].to_list(),
                             [s if o else None for s, o in zip(q["score"], ok, strict=True)],
                             kept=False, reason=reason))
            continue
        scores[qid], gen_ids[qid] = q["score"].to_list(), q["gen_id"].to_list()
    res = curate_flat(scores, cc.n, cc.t, cc.top_n, cc.max_groups_per_query, cc.seed + ctx.round, cc.mode, cc.eps_adv)
    kept_per_query: dict[str, int] = {}
    for j, g in enumerate(res.groups):
        kept_per_query[g.query_id] = kept_per_query.get(g.query_id, 0) + 1
        ids = gen_ids[g.query_id]
        rows.append(_row(g.query_id, f"{g.query_id}/g{j}", "flat", [ids[i] for i in g.members], g.scores,
                         kept=True, advantages=g.advantages) | {"variance": g.variance})
    cut = min((g.variance for g in res.groups), default=float("inf"))
    how = "not sampled" if cc.mode.startswith("random") else f"below the top-{cc.top_n} variance cut {cut:.6g}"
    # screened-out groups are summarised, one row per query (members = all its workflows)
    for qid in scores:
        if qid in res.dropped:
            rows.append(_row(qid, f"{qid}/filtered", "flat", gen_ids[qid], scores[qid], kept=False,
                             reason=f"filtered: {res.dropped[qid]}"))
            continue
        lost = res.candidates[qid] - kept_per_query.get(qid, 0)
        if lost:
            rows.append(_row(qid, f"{qid}/screened", "flat", gen_ids[qid], scores[qid], kept=False,
                             reason=f"screened out: {lost} of {res.candidates[qid]} candidate groups {how}"))
    counts = {"queries": len(scores) + left_out, "queries_left_out": left_out, "queries_filtered": len(res.dropped),
              "candidate_groups": sum(res.candidates.values()), "groups_kept": len(res.groups),
              "sequences": sum(len(g.members) for g in res.groups)}
    return rows, counts


def _two_level_rows(ctx, df: pl.DataFrame) -> tuple[list[dict], dict]:
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
        reason = _left_out_reason(states)
        if reason:
            left_out += 1
            rows.append(_row(qid, f"{qid}/left-out", "agent", q["gen_id"].to_list(), [None] * q.height,
                             kept=False, reason=reason))
            continue
        tree[qid] = [[] if k is None else k["score"].to_list() for k in kids]
        ids[qid] = (q["gen_id"].to_list(), [[] if k is None else k["gen_id"].to_list() for k in kids])
    for tq in two_level_advantages(tree, cc.eps_adv, cc.adv_norm):
        agent_ids, wf_ids = ids[tq.query_id]
        rows.append(_row(tq.query_id, f"{tq.query_id}/agents", "agent", agent_ids, tq.agent_rewards.tolist(),
                         kept=True, advantages=tq.agent_advantages, buckets=tq.agent_buckets))
        for a, (w_ids, w_s, w_a, w_b) in enumerate(zip(wf_ids, tq.workflow_scores, tq.workflow_advantages,
                                                        tq.workflow_buckets, strict=True)):
            if w_ids:
                rows.append(_row(tq.query_id, f"{agent_ids[a]}/workflows", "workflow", w_ids, w_s.tolist(),
                                 kept=True, advantages=w_a, buckets=w_b))
    counts = {"queries": len(tree) + left_out, "queries_left_out": left_out,
              "groups_kept": sum(1 for r in rows if r["kept"]),
              "sequences": sum(len(r["members"]) for r in rows if r["kept"])}
    return rows, counts


def run_curate(ctx) -> dict:
    """The curate stage: the round's scores -> `groups` rows (kept and screened-out), one Parquet part."""
    if ctx.done("curate"):
        return {"skipped": True, **ctx.store.manifest(ctx.run_id, ctx.round, "curate")["counts"]}
    stale = ctx.store.parts("groups", ctx.run_id, ctx.round)
    if stale:  # rows of an attempt that crashed before its manifest: start over, never duplicate
        log.warning("removing %d groups part(s) of an unfinished curate attempt", len(stale))
        for p in stale:
            p.unlink()
    df = load_round(ctx)
    if df.height == 0:
        raise RuntimeError(f"run {ctx.run_id!r} round {ctx.round}: no generations to curate (run rollout first)")
    two_level = ctx.cfg.rollout.mode == "two_level"
    rows, counts = (_two_level_rows if two_level else _flat_rows)(ctx, df)
    ctx.store.write("groups", rows, ctx.run_id, ctx.round)
    counts["level"] = "two_level" if two_level else ctx.cfg.curation.mode
    ctx.finish("curate", **counts)
    return counts
