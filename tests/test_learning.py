"""Held-out metrics of the learning experiment, on hand-computed cases."""

import numpy as np
import pytest

from pipeline.core.learning import (
    bootstrap_ci,
    hierarchical_ci,
    hierarchical_means,
    paired_differences,
    query_metrics,
    seed_intervals,
    split_summary,
)


def _rows(qid, items):
    return [{"query_id": qid, "score": s, "valid": v} for s, v in items]


def test_mean_and_best_at_l_per_query():
    rows = (_rows("a", [(1.0, True), (0.0, True), (0.5, True), (None, False)])  # invalid counts as 0
            + _rows("b", [(None, True), (0.0, True), (0.25, True)])  # one still transient: left out of L
            + _rows("c", [(None, True)]))  # nothing final yet: no metrics
    a, b = query_metrics(rows)
    assert (a.query_id, a.workflows, a.mean_at_l, a.best_at_l, a.valid_share, a.pending) == ("a", 4, 0.375, 1.0,
                                                                                              0.75, 0)
    assert (b.query_id, b.workflows, b.mean_at_l, b.best_at_l, b.valid_share, b.pending) == ("b", 2, 0.125, 0.25,
                                                                                              1.0, 1)
    s = split_summary([a, b])
    assert s["queries"] == 2 and s["mean_at_l"] == 0.25 and s["best_at_l"] == 0.625 and s["valid_share"] == 0.875
    assert s["workflows"] == 6 and s["pending"] == 1


def test_best_at_l_is_per_query_not_a_max_over_the_split():
    # one query solved by one of its workflows, one never solved: Best@L = 0.5 (a split max would say 1.0)
    rows = _rows("a", [(0.0, True), (1.0, True)]) + _rows("b", [(0.0, True), (0.0, True)])
    assert split_summary(query_metrics(rows))["best_at_l"] == 0.5


def test_paired_differences_only_on_shared_queries():
    assert paired_differences({"a": 0.75, "b": 0.5, "x": 1.0}, {"a": 0.25, "b": 0.5, "y": 0.0}) == {"a": 0.5, "b": 0.0}


def test_bootstrap_interval_hand_computed():
    # two values 0 and 1: resampled means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles are 0 and 1 and the interval contains 0
    ci = bootstrap_ci([0.0, 1.0], n_boot=4000, seed=1)
    assert (ci.n, ci.mean, ci.lo, ci.hi) == (2, 0.5, 0.0, 1.0) and not ci.excludes_zero()
    # constant differences: every resample has the same mean
    ci = bootstrap_ci([0.25] * 5)
    assert (ci.lo, ci.hi) == (0.25, 0.25) and ci.excludes_zero()
    # 9 of 10 pairs improved by 0.5, one by 0: a resampled mean is at least 0.5 * (k/10) with k ~ Bin(10, 0.9);
    # P(k <= 6) = 0.013 < 2.5%, so the lower bound is >= 0.35
    ci = bootstrap_ci([0.5] * 9 + [0.0], seed=0)
    assert ci.mean == 0.45 and ci.lo >= 0.35 and ci.hi == 0.5


def test_bootstrap_refuses_empty():
    with pytest.raises(ValueError, match="share no query"):
        bootstrap_ci([])


def test_clustered_bootstrap_resamples_whole_queries():
    # two queries, five pairs each: query a never improved, query b always did (+1)
    diffs, queries = [0.0] * 5 + [1.0] * 5, ["a"] * 5 + ["b"] * 5
    # by query: each resample draws a or b twice, means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4 -> [0, 1]
    ci = bootstrap_ci(diffs, n_boot=4000, seed=3, clusters=queries)
    assert (ci.mean, ci.lo, ci.hi) == (0.5, 0.0, 1.0)
    # by pair: a resampled mean is k/10 with k ~ Bin(10, 1/2); P(k <= 1) = 11/1024 < 2.5% < P(k <= 2) = 56/1024,
    # so the interval is [0.2, 0.8]: treating the ten pairs as independent understates the uncertainty
    ci = bootstrap_ci(diffs, n_boot=20000, seed=3)
    assert (ci.lo, ci.hi) == (0.2, 0.8)
    with pytest.raises(ValueError, match="3 cluster labels for 10"):
        bootstrap_ci(diffs, clusters=["a", "b", "c"])


def _pairs(by_seed):
    """{seed: [differences]} -> (seed, query, difference) triples, query q<i> the i-th of its seed."""
    return [(s, f"q{i}", d) for s, ds in by_seed.items() for i, d in enumerate(ds)]


def _shares(means, values):
    return [float(np.mean(np.isclose(means, v))) for v in values]


def test_hierarchical_bootstrap_exact_distribution_of_a_tiny_case():
    # seed A: differences 0 and 1; seed B: 1 and 1. Seeds drawn AA, AB, BA, BB (1/4 each); within A the sum of
    # two draws is 0, 1, 2 w.p. 1/4, 1/2, 1/4, within B always 2. The sum over 4 drawn pairs:
    # 0: 1/4 * 1/16 = 1/64; 1: 1/4 * 4/16 = 4/64; 2: 1/4 * 6/16 + 1/2 * 1/4 = 14/64;
    # 3: 1/4 * 4/16 + 1/2 * 1/2 = 20/64; 4: 1/4 * 1/16 + 1/2 * 1/4 + 1/4 = 25/64
    pairs = _pairs({"A": [0.0, 1.0], "B": [1.0, 1.0]})
    means = hierarchical_means(pairs, n_boot=64_000, seed=5)
    assert np.allclose(_shares(means, [0, 0.25, 0.5, 0.75, 1.0]), np.array([1, 4, 14, 20, 25]) / 64, atol=0.01)
    # (a pairs bootstrap gives Bin(4, 3/4) / 4: 1, 12, 54, 108, 81 / 256; resampling seeds only: .5, .75, 1)
    # quantiles: P(mean = 0) = 1.6% < 2.5% < P(mean <= 0.25) = 7.8%, and P(mean = 1) = 39% > 2.5%
    ci = hierarchical_ci(pairs, n_boot=64_000, seed=5)
    assert (ci.n, ci.mean, ci.lo, ci.hi) == (4, 0.75, 0.25, 1.0)


def test_a_seeds_gain_outside_the_pooled_pairs_interval_lies_inside_the_hierarchical_one():
    # seed A never gains, seed B always gains +1, five queries each (the same five queries)
    pairs = _pairs({"A": [0.0] * 5, "B": [1.0] * 5})
    diffs, queries = [d for _, _, d in pairs], [q for _, q, _ in pairs]
    # pairs: the mean is k/10, k ~ Bin(10, 1/2): P(k <= 1) = 11/1024 < 2.5% < P(k <= 2) = 56/1024 -> [0.2, 0.8]
    pooled = bootstrap_ci(diffs, n_boot=20_000, seed=3)
    assert (pooled.lo, pooled.hi) == (0.2, 0.8)
    # queries: every query brings one 0 and one 1, so every resample's mean is 0.5: seeds are invisible
    by_query = bootstrap_ci(diffs, n_boot=20_000, seed=3, clusters=queries)
    assert (by_query.lo, by_query.hi) == (0.5, 0.5)
    # seeds then queries: AA -> 0, AB -> 0.5, BB -> 1 w.p. 1/4, 1/2, 1/4 -> [0, 1]
    hier = hierarchical_ci(pairs, n_boot=20_000, seed=3)
    assert (hier.mean, hier.lo, hier.hi) == (0.5, 0.0, 1.0)
    per_seed = seed_intervals(pairs, n_boot=2000)
    assert [(s, c.n, c.mean, c.lo, c.hi) for s, c in per_seed.items()] == [("A", 5, 0.0, 0.0, 0.0),
                                                                           ("B", 5, 1.0, 1.0, 1.0)]
    assert per_seed["A"].mean < pooled.lo and hier.lo <= per_seed["A"].mean


def test_hierarchical_bootstrap_with_one_seed_is_the_pairs_bootstrap():
    # one seed: no seed to resample, so 0 and 1 give means 0, 0.5, 1 w.p. 1/4, 1/2, 1/4 (as bootstrap_ci([0, 1]))
    pairs = _pairs({0: [0.0, 1.0]})
    means = hierarchical_means(pairs, n_boot=40_000, seed=2)
    assert np.allclose(_shares(means, [0, 0.5, 1]), [0.25, 0.5, 0.25], atol=0.01)
    ci = hierarchical_ci(pairs, n_boot=4000, seed=1)
    assert (ci.n, ci.mean, ci.lo, ci.hi) == (2, 0.5, 0.0, 1.0)
    # 9 of 10 improved by 0.5: P(k <= 6 of 10 improved) = 0.013 < 2.5%, so lo >= 0.35 (as in the pairs test)
    ci = hierarchical_ci(_pairs({0: [0.5] * 9 + [0.0]}))
    assert ci.mean == 0.45 and ci.lo >= 0.35 and ci.hi == 0.5
    ci = hierarchical_ci(_pairs({7: [0.25] * 3}))
    assert (ci.lo, ci.hi) == (0.25, 0.25)


def test_hierarchical_bootstrap_weighs_seeds_by_their_query_count():
    # seed A has one pair (0), seed B three (+1 each); pooled mean 3/4. Drawing A and B gives (0 + 3) / 4 = 0.75
    # (a mean of seed means would give 0.5); AA -> 0, BB -> 1
    pairs = _pairs({"A": [0.0], "B": [1.0, 1.0, 1.0]})
    means = hierarchical_means(pairs, n_boot=40_000, seed=4)
    assert np.allclose(_shares(means, [0, 0.75, 1]), [0.25, 0.5, 0.25], atol=0.01)
    assert hierarchical_ci(pairs).mean == 0.75


def test_hierarchical_bootstrap_refuses_bad_input():
    with pytest.raises(ValueError, match="share no query"):
        hierarchical_ci([])
    with pytest.raises(ValueError, match="seed 0 query 'q1' appears twice"):
        hierarchical_ci([(0, "q1", 0.5), (0, "q1", 0.25)])
    with pytest.raises(ValueError, match="level must be in"):
        hierarchical_ci(_pairs({0: [0.0]}), level=1.0)
