"""Curation maths (pure): F/M/S buckets, SPOGW group-wise data, two-level advantages, objective rows.

Flat (SPOGW, docs/design.md §6): per query, candidate groups are n-subsets of its m workflows, enumerated
by combination rank (colex) and unranked in vectorised chunks, so neither C(m, n) subsets nor the
round's pool are ever held in memory: a running top-N buffer keeps the best candidates. Off by
default, the buffer can also drop a query's groups with an already kept (sharpened) member set and cap
the groups kept per query, so that the top-N is not spent on copies from a few queries.
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

from pipeline.core.grpo import group_advantages, normalise

log = logging.getLogger(__name__)

Mode = Literal["random", "random_filter", "screen", "screen_sharpen"]
MODES = ("random", "random_filter", "screen", "screen_sharpen")
_CHUNK = 8192  # candidate groups unranked / scored per numpy call
_INT64_SAFE = 2**62  # above this, ranks and the binomial table fall back to Python ints


def assign_buckets(scores: Sequence[float]) -> list[str]:
    """F/M/S buckets (the two-level proposal, §4.3 steps 1-2): Fast if >= the 2/3 quantile, Slow if <= the
    1/3 quantile, else Medium (numpy's default linear quantiles; an item meeting both bounds is Fast).

    The extremes are pinned: whenever at least two distinct values exist, every item equal to the highest
    is F and every item equal to the lowest is S. Without it a mostly failing pool collapses: for
    [0, 0, 0, 1] the 2/3 quantile is the minimum 0, every item is >= it and all four are F, so the
    contrastive pick finds one bucket exactly on hard queries. Equal scores always share a bucket; all
    equal scores are one bucket (F)."""
    s = np.asarray(scores, dtype=float)
    if s.size == 0:
        return []
    hi, lo = np.quantile(s, 2 / 3), np.quantile(s, 1 / 3)
    top, bottom = s.max(), s.min()
    return ["F" if x == top or (x >= hi and x != bottom) else "S" if x <= lo or x == bottom else "M" for x in s]


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
    """Running top-N of (key desc, arrival order asc) over streamed candidates, in bounded memory.

    Optional filters, applied in that rank order at every compaction before the cut: `dedupe` drops a
    candidate whose (query, `dkey` row) equals a better-ranked one's, and `cap` keeps at most `cap`
    candidates per query (counted after dedupe). As candidates arrive, a candidate's rank and the number
    of admissible candidates ahead of it can only grow, so filtering each compaction's survivors gives
    exactly the result of filtering the whole stream once."""

    flush_rows = 65536  # pending rows that trigger a compaction (at least 4N)

    def __init__(self, n: int, width: int, *, dedupe: bool = False, dkey_width: int = 0, cap: int | None = None):
        self.n, self.width, self.dedupe, self.cap = n, width, dedupe, cap
        self.key = np.empty(0)
        self.seq = np.empty(0, np.int64)
        self.query = np.empty(0, np.int64)
        self.members = np.empty((0, width), np.int32)
        self.dkey = np.empty((0, dkey_width), np.int64)
        self._pending: list[tuple[np.ndarray, ...]] = []
        self._pending_rows = 0
        self._arrived = 0

    def may_enter(self, key: np.ndarray) -> np.ndarray | None:
        """Mask of the rows that can still make the top-N (None: all can). Rows ranked below N
        admissible ones stay there (with dedupe or a cap too: ranks only grow), and a new row ranks
        below every row with the same key, having arrived later."""
        if len(self.key) < self.n:
            return None
        return key > self.key[-1]

    def push(self, key: np.ndarray, query: int, members: np.ndarray, dkey: np.ndarray | None = None) -> None:
        count = len(key)
        if members.shape[1] < self.width:  # a query with m < n: pad its (smaller) groups with -1
            members = np.pad(members, ((0, 0), (0, self.width - members.shape[1])), constant_values=-1)
        if dkey is None:
            dkey = np.empty((count, self.dkey.shape[1]), np.int64)
        self._pending.append((key, np.arange(self._arrived, self._arrived + count), np.full(count, query), members,
                              dkey))
        self._arrived += count
        self._pending_rows += count
        if self._pending_rows >= max(4 * self.n, self.flush_rows):
            self._compact()

    def _admissible(self, query: np.ndarray, dkey: np.ndarray) -> np.ndarray:
        """Mask over rows already in rank order: not a duplicate of a better row, within the cap."""
        ok = np.ones(len(query), bool)
        if self.dedupe and len(query):
            # group equal (query, dkey) rows, rank order inside a group; keep each group's first row
            order = np.lexsort((np.arange(len(query)), *dkey.T[::-1], query))
            queries, d = query[order], dkey[order]
            first = np.ones(len(order), bool)
            first[1:] = (queries[1:] != queries[:-1]) | np.any(d[1:] != d[:-1], axis=1)
            ok[order] = first
        if self.cap is not None:
            live = np.flatnonzero(ok)
            order = np.argsort(query[live], kind="stable")  # per query, in rank order
            queries = query[live][order]
            pos = np.arange(len(queries))
            start = np.maximum.accumulate(np.where(np.r_[True, queries[1:] != queries[:-1]], pos, 0))
            within = np.empty(len(queries), bool)
            within[order] = pos - start < self.cap
            ok[live] = within
        return ok

    def _compact(self) -> None:
        if not self._pending:
            return
        parts = list(zip(*self._pending, strict=True))
        key = np.concatenate([self.key, *parts[0]])
        seq = np.concatenate([self.seq, *parts[1]])
        query = np.concatenate([self.query, *parts[2]])
        members = np.concatenate([self.members, *parts[3]])
        dkey = np.concatenate([self.dkey, *parts[4]])
        keep = np.lexsort((seq, -key))
        if self.dedupe or self.cap is not None:
            # a row's admissibility depends only on the rows ranked above it: filter a prefix, doubling
            # it until it holds N admissible rows (or is everything)
            k = 2 * self.n
            while True:
                head = keep[:k]
                ok = self._admissible(query[head], dkey[head])
                if ok.sum() >= self.n or k >= len(keep):
                    keep = head[ok]
                    break
                k *= 2
        keep = keep[: self.n]
        self.key, self.seq, self.query = key[keep], seq[keep], query[keep]
        self.members, self.dkey = members[keep], dkey[keep]
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


def sharpened_rows(idx: np.ndarray, scores: np.ndarray, t: int) -> np.ndarray:
    """`sharpen` of every row of `idx` ([R, k] ascending member indices of one query) at once: [R, 2t]
    (or the rows themselves when k <= 2t), t lowest then t highest by score, ties by index."""
    if idx.shape[1] <= 2 * t:
        return idx
    order = np.argsort(scores[idx], axis=1, kind="stable")  # rows ascending: stable = ties by index
    return np.take_along_axis(idx, np.concatenate([order[:, :t], order[:, -t:]], axis=1), axis=1)


def member_bits(rows: np.ndarray, words: int) -> np.ndarray:
    """[R, k] rows of distinct member indices (-1 = none) -> [R, words] int64 bitmasks (63 members a
    word): two rows get equal masks iff they hold the same member set, whatever their order."""
    rows = rows.astype(np.int64)
    valid = rows >= 0
    word = np.where(valid, rows // 63, -1)
    bit = np.where(valid, np.left_shift(np.int64(1), np.where(valid, rows % 63, 0)), 0)
    out = np.empty((len(rows), words), np.int64)
    for j in range(words):  # members are distinct: the sum of their bits is their OR
        out[:, j] = np.where(word == j, bit, 0).sum(axis=1)
    return out


def curate_flat(
    scores_by_query: Mapping[str, Sequence[float]],
    n: int,
    t: int,
    top_n: int,
    max_groups_per_query: int | None = None,
    seed: int = 0,
    mode: Mode = "screen_sharpen",
    eps_adv: float = 1e-6,
    *,
    dedupe: bool = False,
    max_kept_per_query: int | None = None,
) -> FlatCuration:
    """SPOGW group-wise data and its ablations (paper Table 4):
    - random: N groups drawn uniformly from the round's candidate pool, no filter, no sharpening;
    - random_filter: the same after dropping queries whose scores are all equal;
    - screen: filter, then the top-N groups by score variance over the whole round;
    - screen_sharpen (default): screen, then keep each group's t lowest and t highest members.
    A query with m < n workflows (some never generated) contributes its single group of all m
    (rather than being discarded: its contrast is still real); it needs m >= 2.

    Beyond the paper, both off by default, applied during selection (the top-N is filled with the next
    admissible groups, so `top_n` groups are kept whenever that many are admissible):
    - dedupe: groups of one query with the same member set as a better-ranked one (variance desc,
      arrival asc) are dropped. The member set is the kept one, i.e. after sharpening in screen_sharpen;
      in the other modes it is the n-subset itself, distinct within a query, so dedupe changes nothing;
    - max_kept_per_query: at most this many kept groups per query (after dedupe), in every mode
      (random modes: a uniform draw without replacement that skips the groups of full queries)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if n < 2 or t < 1 or 2 * t >= n:
        raise ValueError(f"needs n >= 2, t >= 1 and 2t < n; got n={n}, t={t}")
    if top_n < 1:
        raise ValueError(f"top_n must be >= 1, got {top_n}")
    if max_kept_per_query is not None and max_kept_per_query < 1:
        raise ValueError(f"max_kept_per_query must be >= 1 or None, got {max_kept_per_query}")
    rng = np.random.default_rng(seed)
    qids = list(scores_by_query)
    arrays = [np.asarray(scores_by_query[q], dtype=float) for q in qids]
    out = FlatCuration(groups=[])
    sharpening = mode == "screen_sharpen"
    dedupe = dedupe and sharpening  # elsewhere the kept member sets are distinct n-subsets already
    words = max(1, -(-max((s.size for s in arrays), default=1) // 63))
    top = _TopN(top_n, n, dedupe=dedupe, dkey_width=words if dedupe else 0, cap=max_kept_per_query)
    for query_index, (qid, scores) in enumerate(zip(qids, arrays, strict=True)):
        if scores.size < 2:
            out.dropped[qid] = f"fewer than 2 scored workflows ({scores.size})"
            continue
        if mode != "random" and np.all(scores == scores[0]):
            out.dropped[qid] = f"all {scores.size} scores equal ({scores[0]:g})"
            continue
        count = 0
        for idx in candidate_groups(scores.size, min(n, scores.size), max_groups_per_query, rng):
            # random: the top-N of iid uniform keys is a uniform sample of N groups;
            # screening: variance, rounded so that equal multisets of scores tie exactly
            key = rng.random(len(idx)) if mode.startswith("random") else np.round(scores[idx].var(axis=1), 12)
            count += len(idx)
            live = top.may_enter(key)
            if live is not None:
                key, idx = key[live], idx[live]
            if len(key):
                top.push(key, query_index, idx, member_bits(sharpened_rows(idx, scores, t), words) if dedupe else None)
        out.candidates[qid] = count
    _, query, members = top.result()
    for query_index, row in zip(query, members, strict=True):
        scores = arrays[query_index]
        idx = row[row >= 0]
        var = float(scores[idx].var())
        if sharpening:
            idx = sharpen(idx, scores[idx], t)
        adv = group_advantages(scores[idx], eps_adv)
        out.groups.append(Group(qids[query_index], tuple(int(i) for i in idx), tuple(float(x) for x in scores[idx]),
                                var, tuple(float(a) for a in adv), tuple(bool(a > 0) for a in adv)))
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
    dedupe: bool = False,
    max_kept_per_query: int | None = None,
) -> list[Group]:
    """The kept groups of `curate_flat` (ranked by variance, or in sample order for random modes).

    Public API: SPOGW's group-wise data from plain scores, without a store (notebooks, tests)."""
    return curate_flat(scores_by_query, n, t, top_n, max_groups_per_query, seed, mode, eps_adv,
                       dedupe=dedupe, max_kept_per_query=max_kept_per_query).groups


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


AgentStats = Literal["workflows", "agents"]


def _stats(x: np.ndarray) -> tuple[float, float]:
    """(mean, population std) of a sample; (0, 0) when empty."""
    return (float(x.mean()), float(x.std())) if x.size else (0.0, 0.0)


def two_level_advantages(
    scores_by_query: Mapping[str, Sequence[Sequence[float]]],
    eps_adv: float = 1e-6,
    norm: Literal["batch", "query"] = "batch",
    agent_stats: AgentStats = "workflows",
) -> list[TwoLevelQuery]:
    """The proposal's advantages (§4.3 step 5, symbols of §4.1): with r̄ and σ the mean and population std of
    all workflow scores r_ij in the batch (`norm="batch"`) or in the query (`"query"`),
    A^A_i = (r_i - r̄)/(σ + eps) with r_i the mean of agent i's workflow scores, and
    A^W_ij = (r_ij - r̄)/(σ + eps). `agent_stats="agents"` (not the proposal) normalises A^A_i by the mean
    and std of the agent rewards r_i instead (and the workflow scores alone for A^W), which spreads the
    agent advantages further: for one query [[0, 0, 1], [0, 1, 1]] A^A = ∓1/3 by the proposal, ∓1 with agent
    statistics. An agent without workflows (an invalid plan) gets r_i = 0."""
    if norm not in ("batch", "query"):
        raise ValueError(f"norm must be 'batch' or 'query', got {norm!r}")
    if agent_stats not in ("workflows", "agents"):
        raise ValueError(f"agent_stats must be 'workflows' or 'agents', got {agent_stats!r}")
    per_query = []
    for qid, agents in scores_by_query.items():
        workflow_scores = [np.asarray(w, dtype=float) for w in agents]
        rewards = np.array([w.mean() if w.size else 0.0 for w in workflow_scores])
        per_query.append((qid, rewards, workflow_scores))
    scopes = [per_query] if norm == "batch" else [[q] for q in per_query]
    out = []
    for scope in scopes:
        a_stats, w_stats = _level_stats(scope, agent_stats)
        for qid, rewards, workflow_scores in scope:
            out.append(TwoLevelQuery(
                query_id=qid,
                agent_rewards=rewards,
                agent_advantages=normalise(rewards, *a_stats, eps_adv),
                agent_buckets=assign_buckets(rewards),
                workflow_scores=workflow_scores,
                workflow_advantages=[normalise(w, *w_stats, eps_adv) for w in workflow_scores],
                workflow_buckets=[assign_buckets(w) for w in workflow_scores],
            ))
    return out


def _level_stats(scope: Sequence[tuple[str, np.ndarray, list[np.ndarray]]],
                 agent_stats: AgentStats) -> tuple[tuple[float, float], tuple[float, float]]:
    """((mean, std) for agent advantages, (mean, std) for workflow advantages) over the queries of a scope."""
    if agent_stats == "agents":
        return (_stats(np.concatenate([r for _, r, _ in scope] or [np.empty(0)])),
                _stats(np.concatenate([x for _, _, wf in scope for x in wf] or [np.empty(0)])))
    # an agent without workflows (an invalid plan, r_i = 0) enters r̄ and σ as one score 0: left out, its
    # A^A_i = -r̄/(σ + eps) would be unbounded when the other scores are all equal (σ = 0)
    pool = np.concatenate([x if x.size else np.zeros(1) for _, _, wf in scope for x in wf] or [np.empty(0)])
    return _stats(pool), _stats(pool)


# ---- data of the other objectives (pipeline.core.objectives) -------------------------------------------


def score_pairs(scores: Mapping[str, Sequence[float]], per_query: int, power: float,
                rng: np.random.Generator) -> list[tuple[str, int, int]]:
    """ScoreFlow's preference data: every (w, l) of a query with s_w > s_l, then `per_query` x (queries with a pair)
    draws with replacement over the round's pairs, P(w, l) ∝ (s_w - s_l)^power; a pair drawn twice trains twice.
    Returns (query id, index of w, index of l) per draw, in draw order."""
    pool: list[tuple[str, int, int]] = []
    gaps: list[float] = []
    for qid, s in scores.items():
        for i, si in enumerate(s):
            for j, sj in enumerate(s):
                if si > sj:
                    pool.append((qid, i, j))
                    gaps.append((si - sj) ** power)
    if not pool:
        return []
    n = per_query * len({q for q, _, _ in pool})
    p = np.asarray(gaps) / sum(gaps)
    return [pool[k] for k in rng.choice(len(pool), size=n, replace=True, p=p)]


def rwr_weights(rewards: Sequence[float], temperature: float) -> np.ndarray:
    """Reward-weighted regression's weights exp(r / τ) (W4S: τ = 0.4)."""
    return np.exp(np.asarray(rewards, dtype=float) / temperature)


def best_member(scores: Sequence[float], above: float) -> int | None:
    """Rejection sampling: the index of the highest score (the first of ties) if it is above `above`, else None."""
    if not len(scores):
        return None
    i = int(np.argmax(scores))
    return i if scores[i] > above else None


def objective_rows(scores: Mapping[str, Sequence[float]], gen_ids: Mapping[str, Sequence[str]], curation,
                   rng: np.random.Generator) -> tuple[list[dict], dict]:
    """Flat rows of the `pair` (score_dpo), `weighted` (rwr) and `best` (sft_best) kinds of a round's queries."""
    rows = []
    for j, (qid, w, lo) in enumerate(score_pairs(scores, curation.pairs_per_query, curation.pair_gap_power, rng)):
        ids, query_scores = gen_ids[qid], scores[qid]
        rows.append(group_row(qid, f"{qid}/pair{j}", "flat", [ids[w], ids[lo]], [query_scores[w], query_scores[lo]],
                              kept=True, kind="pair", weights=[1.0, 1.0]))
    n_pairs = len(rows)
    best = 0
    for qid, query_scores in scores.items():
        rows.append(group_row(qid, f"{qid}/weighted", "flat", gen_ids[qid], query_scores, kept=True, kind="weighted",
                              weights=rwr_weights(query_scores, curation.rwr_temperature)))
        b = best_member(query_scores, curation.best_above)
        best += b is not None
        rows.append(group_row(qid, f"{qid}/best", "flat", [gen_ids[qid][b]] if b is not None else list(gen_ids[qid]),
                              [query_scores[b]] if b is not None else query_scores, kept=b is not None, kind="best",
                              weights=[1.0] if b is not None else None,
                              reason=None if b is not None else f"no workflow scored above {curation.best_above:g}"))
    return rows, {"pairs": n_pairs, "best_kept": best}


# ---- rows of the `groups` table --------------------------------------------------------------

def left_out_reason(states: Sequence[str]) -> str | None:
    bad = {s: sum(1 for x in states if x == s) for s in ("unscored", "transient", "scorer_error") if s in states}
    if not bad:
        return None
    return "left out: " + ", ".join(f"{k} of {len(states)} workflows {v}" for v, k in bad.items())


def group_row(qid: str, gid: str, level: str, members: Sequence[str], scores: Sequence[float | None], *,
         kept: bool, reason: str | None = None, advantages: Sequence[float] | None = None,
         buckets: Sequence[str] | None = None, kind: str = "group", weights: Sequence[float] | None = None) -> dict:
    vals = np.array([x for x in scores if x is not None], dtype=float)
    """One `groups` row (kept or left out, with its reason)."""
    return {
        "group_id": gid, "query_id": qid, "level": level, "members": list(members),
        "member_scores": list(scores), "variance": float(vals.var()) if vals.size else None, "kept": kept,
        "reason": reason, "advantages": None if advantages is None else [float(a) for a in advantages],
        "kl_mask": None if advantages is None else [bool(a > 0) for a in advantages],
        "buckets": None if buckets is None else list(buckets), "kind": kind,
        "weights": None if weights is None else [float(w) for w in weights],
    }


def distinct_counts(rows: Sequence[dict]) -> dict:
    """distinct_workflows: distinct gen_ids among the kept groups' members (in two_level, agent plans
    included: every sequence trained on); distinct_queries: queries with at least one kept group."""
    kept = [r for r in rows if r["kept"] and r["kind"] == "group"]
    return {"distinct_workflows": len({g for r in kept for g in r["members"]}),
            "distinct_queries": len({r["query_id"] for r in kept})}
