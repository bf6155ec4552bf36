"""Held-out metrics of the learning experiment, on hand-computed cases."""

import pytest

from pipeline.core.learning import bootstrap_ci, paired_differences, query_metrics, split_summary


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
