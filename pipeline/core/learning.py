"""Held-out metrics of a learning experiment: per-query Mean@L / Best@L / Majority@L (BayesFlow's definitions), paired
differences against the base model, and percentile-bootstrap confidence intervals. Pure functions.

For one query and its L sampled workflows with scores s_1..s_L in [0, 1] (an invalid workflow scores 0):
- Mean@L = (1/L) sum_j s_j: the expected score of one sampled workflow;
- Best@L = max_j s_j: for 0/1 scores, "at least one of the L workflows is right".
- Majority@L: the L workflows vote with their normalised answers (`benchmarks.metrics.vote_key`); the score of
  the most frequent answer (the mean score of the workflows that gave it), so for 0/1 scores "the majority
  answer is right". Workflows without an answer (invalid, crashed) do not vote; no vote at all scores 0; a tie
  between answers scores the mean of their values: the expected score of a uniformly random tie-break.
A split's Mean@L / Best@L is the mean over its queries. Workflows whose runs are still transient
(executor errors) or unscored have no score yet and are left out of L (and counted).

A paired difference is taken per (seed, query): arm minus base, both evaluated on the same query with
the same seed's sampling stream. Pooled over seeds, its mean gets three percentile-bootstrap intervals:
- seeds then queries (`hierarchical_ci`, the headline): draw S seeds with replacement, then, within each drawn
  seed, its n_s queries with replacement; the statistic is the mean over all drawn pairs. A trained model is one
  draw of training's randomness, so the seed-to-seed spread of the gain belongs in the interval;
- pairs (`bootstrap_ci`): every (seed, query) pair independent: ignores both the seed and the query structure;
- queries (`bootstrap_ci(clusters=queries)`): all seeds of a drawn query together: one query's pairs across seeds
  share its difficulty, but the seeds are held fixed.
Each seed also gets its own mean and interval over its queries (`seed_intervals`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

METRICS = ("mean_at_l", "best_at_l", "majority_at_l")


@dataclass(frozen=True)
class QueryMetrics:
    query_id: str
    workflows: int  # L actually scored
    mean_at_l: float
    best_at_l: float
    valid_share: float
    pending: int  # workflows left out: no final score yet
    majority_at_l: float | None = None  # None when the rows carry no votes


def majority_at_l(votes: Sequence[tuple[str | None, float]]) -> float:
    """`votes`: (normalised answer, None: no vote; score) per workflow; see the module doc."""
    by_answer: dict[str, list[float]] = {}
    for answer, score in votes:
        if answer is not None:
            by_answer.setdefault(answer, []).append(score)
    if not by_answer:
        return 0.0
    top = max(len(v) for v in by_answer.values())
    return float(np.mean([np.mean(v) for v in by_answer.values() if len(v) == top]))


def query_metrics(rows: Sequence[Mapping]) -> list[QueryMetrics]:
    """`rows`: one per workflow with query_id, score (None: no final score yet), valid and, for Majority@L, vote
    (its normalised answer, None: no vote). Returns one QueryMetrics per query that has at least one scored
    workflow, in first-seen order."""
    by_q: dict[str, list[Mapping]] = {}
    for row in rows:
        by_q.setdefault(row["query_id"], []).append(row)
    out = []
    for qid, query_rows in by_q.items():
        scored = [(r, 0.0 if not r["valid"] else r["score"]) for r in query_rows
                  if not r["valid"] or r["score"] is not None]
        if not scored:
            continue
        s = np.array([x for _, x in scored])
        votes = [(r.get("vote") if r["valid"] else None, x) for r, x in scored]
        maj = majority_at_l(votes) if any("vote" in r for r in query_rows) else None
        out.append(QueryMetrics(qid, int(s.size), float(s.mean()), float(s.max()),
                                float(np.mean([bool(r["valid"]) for r in query_rows])), len(query_rows) - int(s.size),
                                maj))
    return out


def split_summary(per_query: Sequence[QueryMetrics]) -> dict:
    """Means over queries of the per-query metrics (None when there is no query)."""
    if not per_query:
        return {"queries": 0, "mean_at_l": None, "best_at_l": None, "majority_at_l": None, "valid_share": None,
                "workflows": 0, "pending": 0}
    majority = [q.majority_at_l for q in per_query if q.majority_at_l is not None]
    return {"queries": len(per_query),
            "mean_at_l": float(np.mean([q.mean_at_l for q in per_query])),
            "best_at_l": float(np.mean([q.best_at_l for q in per_query])),
            "majority_at_l": float(np.mean(majority)) if len(majority) == len(per_query) else None,
            "valid_share": float(np.mean([q.valid_share for q in per_query])),
            "workflows": sum(q.workflows for q in per_query), "pending": sum(q.pending for q in per_query)}


def paired_differences(arm: Mapping[str, float], base: Mapping[str, float]) -> dict[str, float]:
    """Per query present in both: arm − base."""
    return {q: arm[q] - base[q] for q in arm if q in base}


@dataclass(frozen=True)
class Interval:
    n: int
    mean: float
    lo: float
    hi: float
    level: float

    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0


def bootstrap_ci(diffs: Sequence[float], n_boot: int = 10_000, level: float = 0.95, seed: int = 0,
                 clusters: Sequence[object] | None = None) -> Interval:
    """Mean of `diffs` with a percentile-bootstrap interval: resample len(diffs) values with replacement
    `n_boot` times; the interval is the (1−level)/2 and (1+level)/2 quantiles of the resampled means.

    `clusters` (one label per diff, e.g. the query): resample whole clusters instead of single pairs and take
    the mean over every pair of the drawn clusters. Pairs of one query across seeds share the query's
    difficulty, so they are not independent; the clustered interval accounts for it and is the wider one."""
    differences = np.asarray(diffs, dtype=float)
    if differences.size == 0:
        raise ValueError("no paired differences: the arms share no query")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    if clusters is None:
        means = differences[rng.integers(0, differences.size, size=(n_boot, differences.size))].mean(axis=1)
    else:
        if len(clusters) != differences.size:
            raise ValueError(f"{len(clusters)} cluster labels for {differences.size} differences")
        labels = list(dict.fromkeys(clusters))
        index = {c: i for i, c in enumerate(labels)}
        ids = np.array([index[c] for c in clusters])
        sums, sizes = np.bincount(ids, weights=differences), np.bincount(ids).astype(float)
        draw = rng.integers(0, len(labels), size=(n_boot, len(labels)))
        means = sums[draw].sum(axis=1) / sizes[draw].sum(axis=1)
    return _interval(differences, means, level)


def _interval(d: np.ndarray, means: np.ndarray, level: float) -> Interval:
    """The mean of `d` and the percentile interval of the resampled `means`."""
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(int(d.size), float(d.mean()), float(lo), float(hi), level)


def _by_seed(pairs: Sequence[tuple[object, object, float]]) -> dict[object, list[float]]:
    """(seed, query, difference) triples -> seed -> its differences, refusing a repeated (seed, query)."""
    seen: set[tuple[object, object]] = set()
    out: dict[object, list[float]] = {}
    for s, q, d in pairs:
        if (s, q) in seen:
            raise ValueError(f"paired differences: seed {s!r} query {q!r} appears twice")
        seen.add((s, q))
        out.setdefault(s, []).append(float(d))
    if not out:
        raise ValueError("no paired differences: the arms share no query")
    return out


def hierarchical_means(pairs: Sequence[tuple[object, object, float]], n_boot: int = 10_000,
                       seed: int = 0) -> np.ndarray:
    """`n_boot` resampled means of the (seed, query, difference) `pairs`: each draws S seeds with replacement and,
    within each drawn seed, as many of its queries as it has, with replacement; the mean is over all drawn pairs
    (so a seed weighs by its query count, as in the pooled mean)."""
    by_seed = _by_seed(pairs)
    sizes = np.array([len(v) for v in by_seed.values()])
    width = int(sizes.max())
    padded = np.zeros((len(sizes), width))  # row = seed, its differences left-aligned
    for i, v in enumerate(by_seed.values()):
        padded[i, : len(v)] = v
    rng = np.random.default_rng(seed)
    sums, counts = np.zeros(n_boot), np.zeros(n_boot)
    for drawn in rng.integers(0, len(sizes), size=(len(sizes), n_boot)):  # one drawn seed per position and resample
        n = sizes[drawn][:, None]
        cols = np.floor(rng.random((n_boot, width)) * n).astype(int)  # queries within the drawn seed
        used = np.arange(width)[None, :] < n  # a seed with fewer queries draws fewer
        sums += np.where(used, padded[drawn[:, None], cols], 0.0).sum(axis=1)
        counts += n[:, 0]
    return sums / counts


def hierarchical_ci(pairs: Sequence[tuple[object, object, float]], n_boot: int = 10_000, level: float = 0.95,
                    seed: int = 0) -> Interval:
    """Pooled mean of the (seed, query, difference) `pairs` with the seeds-then-queries percentile interval
    (`hierarchical_means`). With one seed it is the pairs bootstrap over that seed's queries."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = np.array([x for _, _, x in pairs], dtype=float)
    return _interval(d, hierarchical_means(pairs, n_boot, seed), level)


def seed_intervals(pairs: Sequence[tuple[object, object, float]], n_boot: int = 10_000, level: float = 0.95,
                   seed: int = 0) -> dict[object, Interval]:
    """Per seed (first-seen order): the mean of its differences with a bootstrap interval over its queries."""
    return {s: bootstrap_ci(v, n_boot, level, seed) for s, v in _by_seed(pairs).items()}
