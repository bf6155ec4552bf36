"""Curation: combinations by rank, SPOGW groups and ablations, two-level advantages, the curate stage."""

from __future__ import annotations

import itertools
import math
import uuid

import numpy as np
import polars as pl
import pytest

from pipeline.core.curation import (
    _TopN,
    assign_buckets,
    candidate_groups,
    curate_flat,
    member_bits,
    sharpen,
    spogw_groups,
    two_level_advantages,
    unrank_combinations,
)

EPS = 1e-6


def test_assign_buckets_quantiles():
    assert assign_buckets([0.0, 0.5, 1.0]) == ["S", "M", "F"]
    assert assign_buckets([1.0, 1.0]) == ["F", "F"]
    assert assign_buckets([]) == []


def test_assign_buckets_pins_the_extremes_on_mostly_failing_pools():
    # [0, 0, 0, 1]: linear quantiles at positions 2/3*3 = 2 and 1/3*3 = 1 of the sorted scores are both 0, so
    # the quantile rule alone makes every item F; the highest value must be F and the lowest S
    assert assign_buckets([0.0, 0.0, 0.0, 1.0]) == ["S", "S", "S", "F"]
    assert assign_buckets([1.0, 0.0, 0.0, 0.0]) == ["F", "S", "S", "S"]
    # mostly passing: 1/3 quantile = 2/3 quantile = 1 = the maximum; the lone 0 stays S
    assert assign_buckets([1.0, 1.0, 1.0, 0.0]) == ["F", "F", "F", "S"]
    # interior ties stay together: quantiles (positions 4/3 and 8/3 of [0, .5, .5, .5, 1]) are both .5 -> F
    assert assign_buckets([0.0, 0.5, 0.5, 0.5, 1.0]) == ["S", "F", "F", "F", "F"]
    # [0, .2, .6, .8, 1, 1]: 1/3 quantile at position 5/3 = .2 + 2/3*.4 = .4667, 2/3 at 10/3 = .8 + 1/3*.2 = .8667
    assert assign_buckets([0.0, 0.2, 0.6, 0.8, 1.0, 1.0]) == ["S", "S", "M", "M", "F", "F"]


# ---- combinations --------------------------------------------------------------------------------


def test_unrank_colex_order_hand_listed():
    got = unrank_combinations(np.arange(10), 5, 3).tolist()
    assert got == [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3], [0, 1, 4],
                   [0, 2, 4], [1, 2, 4], [0, 3, 4], [1, 3, 4], [2, 3, 4]]


def test_unrank_beyond_int64_uses_exact_python_ints():
    m, n = 70, 35
    total = math.comb(m, n)
    assert total > 2**63
    got = unrank_combinations(np.array([0, 1, total - 1], dtype=object), m, n)
    assert got[0].tolist() == list(range(35))
    assert got[1].tolist() == [*range(34), 35]  # rank 1 = C(35, 35)
    assert got[2].tolist() == list(range(35, 70))


def test_candidates_exhaustive_streamed_in_chunks():
    chunks = list(candidate_groups(12, 6, None, np.random.default_rng(0), chunk=100))
    assert all(len(c) <= 100 for c in chunks) and len(chunks) == 10
    rows = np.concatenate(chunks)
    assert len(rows) == math.comb(12, 6) == len({tuple(r) for r in rows.tolist()})
    assert np.all(np.diff(rows, axis=1) > 0)


def test_candidates_sampled_without_replacement_when_too_many():
    rows = np.concatenate(list(candidate_groups(16, 8, 1000, np.random.default_rng(0))))
    assert rows.shape == (1000, 8) and len({tuple(r) for r in rows.tolist()}) == 1000
    assert rows.min() >= 0 and rows.max() <= 15 and np.all(np.diff(rows, axis=1) > 0)
    big = np.concatenate(list(candidate_groups(70, 35, 5, np.random.default_rng(0))))  # C(70,35) > 2^63
    assert big.shape == (5, 35) and len({tuple(r) for r in big.tolist()}) == 5


def test_exhaustive_enumeration_of_huge_sets_is_refused():
    with pytest.raises(ValueError, match="max_groups_per_query"):
        next(candidate_groups(70, 35, None, np.random.default_rng(0)))


# ---- flat SPOGW ---------------------------------------------------------------------------------------


def test_screen_and_sharpen_hand_computed():
    # groups of [0, 1, .5, .2] (n=3): {0,1,2} var 1/6, {0,1,3} var .56/3, {0,2,3} .38/9, {1,2,3} .98/9
    res = curate_flat({"q": [0.0, 1.0, 0.5, 0.2], "flat": [0.4] * 4}, n=3, t=1, top_n=2)
    assert res.dropped == {"flat": "all 4 scores equal (0.4)"}
    assert res.candidates == {"q": 4}
    g1, g2 = res.groups
    assert g1.variance == pytest.approx(0.56 / 3) and g2.variance == pytest.approx(1 / 6)
    assert g1.members == (0, 1) and g1.scores == (0.0, 1.0)  # {0,1,3} sharpened to its min and max
    assert g2.members == (0, 1)
    assert g1.advantages == pytest.approx((-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)))
    assert g1.kl_mask == (False, True)


def test_sharpen_with_2t_equal_n_minus_1():
    # n=5, t=2: drops only the median; kept [.1,.3,.7,.9] -> mean .5, std sqrt(.1)
    (g,) = spogw_groups({"q": [0.1, 0.9, 0.5, 0.3, 0.7]}, n=5, t=2, top_n=10)
    assert g.members == (0, 3, 4, 1)
    assert g.variance == pytest.approx(0.08)  # screening variance: all five, before sharpening
    s = math.sqrt(0.1) + EPS
    assert g.advantages == pytest.approx((-0.4 / s, -0.2 / s, 0.2 / s, 0.4 / s))
    assert g.kl_mask == (False, False, True, True)


def test_sharpen_ties_broken_by_member_index():
    assert sharpen(np.array([0, 1, 2, 3, 4]), np.array([0.0, 1.0, 1.0, 0.0, 0.5]), 2).tolist() == [0, 3, 1, 2]
    assert sharpen(np.array([5, 2]), np.array([1.0, 0.0]), 1).tolist() == [2, 5]


def test_all_equal_group_in_a_varied_query_gets_zero_advantages():
    res = curate_flat({"q": [0.0, 0.0, 0.0, 1.0]}, n=3, t=1, top_n=10, mode="screen")
    assert [g.members for g in res.groups] == [(0, 1, 3), (0, 2, 3), (1, 2, 3), (0, 1, 2)]
    assert res.groups[0].variance == pytest.approx(2 / 9)
    last = res.groups[-1]
    assert last.variance == 0.0 and last.advantages == (0.0, 0.0, 0.0) and last.kl_mask == (False,) * 3
    # screening without sharpening keeps all n members: [0,0,1] -> mean 1/3, std sqrt(2)/3
    s = math.sqrt(2) / 3 + EPS
    assert res.groups[0].advantages == pytest.approx((-1 / 3 / s, -1 / 3 / s, 2 / 3 / s))


def test_fewer_workflows_than_n():
    res = curate_flat({"two": [0.0, 1.0], "one": [0.5], "three": [0.2, 0.8, 0.5]}, n=5, t=1, top_n=10)
    assert res.dropped == {"one": "fewer than 2 scored workflows (1)"}
    by_q = {g.query_id: g for g in res.groups}
    assert by_q["two"].members == (0, 1)  # 2 <= 2t: nothing to sharpen away
    assert by_q["three"].members == (0, 1)  # 3 > 2t: the median (0.5) goes
    assert by_q["three"].variance == pytest.approx(0.06)


def test_top_n_is_over_the_whole_round():
    res = curate_flat({"low": [0.4, 0.5, 0.6], "high": [0.0, 1.0, 0.0]}, n=3, t=1, top_n=1)
    assert [g.query_id for g in res.groups] == ["high"]


def test_sampled_groups_when_c_m_n_exceeds_the_cap():
    scores = {"q": np.linspace(0, 1, 16).tolist()}
    res = curate_flat(scores, n=8, t=2, top_n=5, max_groups_per_query=50, seed=1)
    assert res.candidates == {"q": 50} and len(res.groups) == 5
    assert [g.variance for g in res.groups] == sorted((g.variance for g in res.groups), reverse=True)
    again = curate_flat(scores, n=8, t=2, top_n=5, max_groups_per_query=50, seed=1)
    assert [g.members for g in again.groups] == [g.members for g in res.groups]  # deterministic per seed


def test_random_modes():
    scores = {"flat": [0.5, 0.5, 0.5], "q": [0.0, 0.3, 1.0, 0.6]}
    rnd = curate_flat(scores, n=3, t=1, top_n=3, mode="random", seed=0)
    assert rnd.dropped == {} and rnd.candidates == {"flat": 1, "q": 4}
    assert len(rnd.groups) == 3 and all(len(g.members) == 3 for g in rnd.groups)  # no sharpening
    assert len({(g.query_id, g.members) for g in rnd.groups}) == 3
    everything = curate_flat(scores, n=3, t=1, top_n=100, mode="random")
    assert len(everything.groups) == 5
    flt = curate_flat(scores, n=3, t=1, top_n=100, mode="random_filter")
    assert "flat" in flt.dropped and len(flt.groups) == 4


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="2t < n"):
        curate_flat({"q": [0, 1]}, n=4, t=2, top_n=1)
    with pytest.raises(ValueError, match="mode"):
        curate_flat({"q": [0, 1]}, n=3, t=1, top_n=1, mode="best")


# ---- dedupe and the per-query cap --------------------------------------------------------------------------


def _kept(res):
    return [(g.query_id, g.members) for g in res.groups]


def test_dedupe_drops_groups_with_the_same_sharpened_members_hand_listed():
    # [0,0,1,1,1], n=3, t=1: colex groups r0..r9 = {012} {013} {023} {123} {014} {024} {124} {034} {134} {234};
    # all but r9 ([1,1,1], var 0) hold two equal scores and one other: var 2/9. Sharpened to (lowest,
    # highest) by (score, index): (0,2) (0,3) (0,3) (1,3) (0,4) (0,4) (1,4) (0,4) (1,4) (2,4)
    s = {"q": [0.0, 0.0, 1.0, 1.0, 1.0]}
    default = curate_flat(s, n=3, t=1, top_n=4)
    assert [g.members for g in default.groups] == [(0, 2), (0, 3), (0, 3), (1, 3)]  # r0..r3: (0,3) twice
    assert [g.variance for g in default.groups] == pytest.approx([2 / 9] * 4)
    dd = curate_flat(s, n=3, t=1, top_n=4, dedupe=True)
    assert [g.members for g in dd.groups] == [(0, 2), (0, 3), (1, 3), (0, 4)]  # r2 dropped, r4 fills in
    assert [g.members for g in curate_flat(s, n=3, t=1, top_n=10).groups] == [
        (0, 2), (0, 3), (0, 3), (1, 3), (0, 4), (0, 4), (1, 4), (0, 4), (1, 4), (2, 4)]
    every = curate_flat(s, n=3, t=1, top_n=10, dedupe=True)  # the 6 distinct sets: r0 r1 r3 r4 r6 r9
    assert [g.members for g in every.groups] == [(0, 2), (0, 3), (1, 3), (0, 4), (1, 4), (2, 4)]
    assert every.groups[-1].variance == 0.0 and every.groups[-1].scores == (1.0, 1.0)
    assert every.candidates == {"q": 10}
    # screen (no sharpening): the kept sets are the n-subsets themselves, distinct: dedupe changes nothing
    screened = spogw_groups(s, n=3, t=1, top_n=4, mode="screen", dedupe=True)
    assert [g.members for g in screened] == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]


def test_dedupe_keeps_the_best_ranked_group_of_a_member_set():
    # [0, .5, 1, .9], n=3: r0 {012} var 1/6 -> (0,2); r1 {013} [0,.5,.9] var 1.06/3-(1.4/3)^2 -> (0,3);
    # r2 {023} [0,1,.9] var 1.81/3-(1.9/3)^2 -> (0,2); r3 {123} [.5,1,.9] var .14/3 -> (1,2). Rank: r2 r0 r1 r3
    s = {"q": [0.0, 0.5, 1.0, 0.9]}
    v_r2, v_r1 = 1.81 / 3 - (1.9 / 3) ** 2, 1.06 / 3 - (1.4 / 3) ** 2
    default = curate_flat(s, n=3, t=1, top_n=2)
    assert [g.members for g in default.groups] == [(0, 2), (0, 2)]
    assert [g.variance for g in default.groups] == pytest.approx([v_r2, 1 / 6])
    dd = curate_flat(s, n=3, t=1, top_n=2, dedupe=True)  # r0 duplicates r2, which ranks higher though later
    assert [g.members for g in dd.groups] == [(0, 2), (0, 3)]
    assert [g.variance for g in dd.groups] == pytest.approx([v_r2, v_r1])
    assert dd.groups[1].scores == (0.0, 0.9)


def test_cap_per_query_gives_the_freed_slots_to_other_queries():
    # A [0,0,1,1]: its 4 groups have var 2/9, sharpened (0,2) (0,3) (0,3) (1,3);
    # B [0,0,0,.5]: r0 {012} var 0 -> (0,2); r1 {013}, r2 {023}, r3 {123} var 1/18 -> (0,3) (0,3) (1,3)
    s = {"A": [0.0, 0.0, 1.0, 1.0], "B": [0.0, 0.0, 0.0, 0.5]}
    assert _kept(curate_flat(s, n=3, t=1, top_n=4)) == [("A", (0, 2)), ("A", (0, 3)), ("A", (0, 3)), ("A", (1, 3))]
    capped = curate_flat(s, n=3, t=1, top_n=4, max_kept_per_query=2)
    assert _kept(capped) == [("A", (0, 2)), ("A", (0, 3)), ("B", (0, 3)), ("B", (0, 3))]
    assert [g.variance for g in capped.groups] == pytest.approx([2 / 9, 2 / 9, 1 / 18, 1 / 18])
    # dedupe before the cap counts: B's r2 is a duplicate, its r3 takes the slot
    both = spogw_groups(s, n=3, t=1, top_n=4, dedupe=True, max_kept_per_query=2)
    assert [(g.query_id, g.members) for g in both] == [("A", (0, 2)), ("A", (0, 3)), ("B", (0, 3)), ("B", (1, 3))]
    # one per query: fewer than top_n when the queries run out
    assert _kept(curate_flat(s, n=3, t=1, top_n=4, max_kept_per_query=1)) == [("A", (0, 2)), ("B", (0, 3))]
    with pytest.raises(ValueError, match="max_kept_per_query"):
        curate_flat(s, n=3, t=1, top_n=4, max_kept_per_query=0)


def test_member_bits_are_order_free_and_span_words():
    rows = np.array([[0, 64], [64, 0], [1, 64], [0, -1], [62, 63]])
    # 63 members a word: 64 is bit 1 of word 1, 63 bit 0 of word 1; -1 pads
    assert member_bits(rows, 2).tolist() == [[1, 2], [1, 2], [2, 2], [1, 0], [2**62, 1]]


def test_cap_applies_to_random_modes():
    s = {"a": [0.0, 1.0, 0.5], "b": [0.0, 0.3, 1.0, 0.6], "c": [0.5, 0.5, 0.5]}
    rnd = curate_flat(s, n=3, t=1, top_n=10, mode="random", max_kept_per_query=1, seed=3)
    assert sorted(g.query_id for g in rnd.groups) == ["a", "b", "c"]  # 1 + 4 + 1 candidates, one each
    flt = curate_flat(s, n=3, t=1, top_n=10, mode="random_filter", max_kept_per_query=2, dedupe=True, seed=3)
    assert sorted(g.query_id for g in flt.groups) == ["a", "b", "b"]
    assert all(len(g.members) == 3 for g in flt.groups)  # random modes never sharpen


def _polarised_and_rare(n_p=4, n_r=29):
    """33 queries x 16 workflows: P_i = eight 0s then eight 1s, R_j = fifteen 0s then one 1/3."""
    s = {f"P{i}": [0.0] * 8 + [1.0] * 8 for i in range(n_p)}
    return s | {f"R{j}": [0.0] * 15 + [1 / 3] for j in range(n_r)}


@pytest.mark.parametrize("flush_rows", [65536, 1])  # one compaction at the end, or one per query
def test_33_queries_x_16_dedupe_and_cap_spread_the_top_n(monkeypatch, flush_rows):
    monkeypatch.setattr(_TopN, "flush_rows", flush_rows)
    s = _polarised_and_rare()
    # Reasoning (n=4, t=1, top_n=100): in P the 784 groups of two 0s {c1<c2} and two 1s {c3<c4} have the
    # top variance 1/4 (then [0,0,0,1] and [0,1,1,1]: 3/16); in R the 455 groups holding the 1/3 have 1/48.
    # Sharpening keeps (c1, c4). Colex order sorts by c4, then c3, then (c2, c1): P's first 100 at 1/4 are
    # (c4,c3) = (9,8): 28 pairs, (10,8), (10,9): 28 each, (11,8): the 16 pairs up to (0,6) -> c1 in 0..6
    # for c4 in {9, 10} and c1 in 0..4 for c4 = 11: 19 member sets, all from P0.
    default = curate_flat(s, n=4, t=1, top_n=100)
    assert {g.query_id for g in default.groups} == {"P0"} and len(default.groups) == 100
    assert {g.members for g in default.groups} == (
        {(c1, 9) for c1 in range(7)} | {(c1, 10) for c1 in range(7)} | {(c1, 11) for c1 in range(5)})
    # dedupe: a P query has 7 x 7 distinct (c1 in 0..6, c4 in 9..15): 49 from P0, 49 from P1, then P2's
    # first two distinct: {0,1,8,9} -> (0,9), {0,2,8,9} duplicate, {1,2,8,9} -> (1,9)
    dd = curate_flat(s, n=4, t=1, top_n=100, dedupe=True)
    assert [g.query_id for g in dd.groups] == ["P0"] * 49 + ["P1"] * 49 + ["P2"] * 2
    assert {g.members for g in dd.groups[:49]} == {(lo, hi) for lo in range(7) for hi in range(9, 16)}
    assert [g.members for g in dd.groups[-2:]] == [(0, 9), (1, 9)]
    # cap 4 without dedupe: 4 per P query (its first four: (0,9) (0,9) (1,9) (0,9)), then R0..R20 at 1/48,
    # each its first four groups holding index 15 ({0,1,2} {0,1,3} {0,2,3} {1,2,3} + 15): (0,15) x3, (1,15)
    cap = curate_flat(s, n=4, t=1, top_n=100, max_kept_per_query=4)
    assert [g.query_id for g in cap.groups] == [q for q in [*[f"P{i}" for i in range(4)],
                                                            *[f"R{j}" for j in range(21)]] for _ in range(4)]
    assert [g.members for g in cap.groups[:4]] == [(0, 9), (0, 9), (1, 9), (0, 9)]
    assert [g.members for g in cap.groups[-4:]] == [(0, 15), (0, 15), (0, 15), (1, 15)]
    assert len({(g.query_id, g.members) for g in cap.groups}) == 50
    # dedupe + cap 4: the first four distinct sets of each of the same 25 queries
    both = curate_flat(s, n=4, t=1, top_n=100, dedupe=True, max_kept_per_query=4)
    assert [g.query_id for g in both.groups] == [g.query_id for g in cap.groups]
    assert [g.members for g in both.groups[:4]] == [(0, 9), (1, 9), (2, 9), (3, 9)]
    assert [g.members for g in both.groups[-4:]] == [(0, 15), (1, 15), (2, 15), (3, 15)]
    assert [g.variance for g in both.groups] == pytest.approx([1 / 4] * 16 + [1 / 48] * 84)
    assert len({(g.query_id, g.members) for g in both.groups}) == 100
    assert len({(g.query_id, i) for g in both.groups for i in g.members}) == 4 * 5 + 21 * 5  # workflows


def _brute_force(scores, n, t, top_n, dedupe, cap):
    """The definition, written out naively: every n-subset in colex order per query, ranked by
    (variance desc, arrival asc), sharpened, then duplicates and over-cap groups skipped in rank order.
    Scores are thirds: variance is proportional to n * sum(k^2) - sum(k)^2, an exact integer."""
    cands = []
    for q, s in scores.items():
        k = [round(3 * x) for x in s]
        if len(set(k)) == 1:
            continue
        for c in sorted(itertools.combinations(range(len(k)), n), key=lambda c: c[::-1]):  # colex
            v = n * sum(k[i] ** 2 for i in c) - sum(k[i] for i in c) ** 2
            by_score = sorted(c, key=lambda i: (k[i], i))
            cands.append((-v, len(cands), q, tuple(by_score[:t] + by_score[-t:])))
    out, seen, per = [], set(), {}
    for _, _, q, members in sorted(cands):
        if dedupe and (q, frozenset(members)) in seen:
            continue
        if cap is not None and per.get(q, 0) >= cap:
            continue
        seen.add((q, frozenset(members)))
        per[q] = per.get(q, 0) + 1
        out.append((q, members))
        if len(out) == top_n:
            break
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_33_queries_x_16_random_thirds_match_the_brute_force(seed):
    rng = np.random.default_rng(seed)
    s = {f"q{i}": (rng.integers(0, 4, 16) / 3).tolist() for i in range(33)}
    seen_queries = {}
    for dedupe, cap in [(False, None), (True, None), (False, 4), (True, 4)]:
        got = _kept(curate_flat(s, n=4, t=1, top_n=100, dedupe=dedupe, max_kept_per_query=cap))
        assert got == _brute_force(s, 4, 1, 100, dedupe, cap)
        assert len(got) == 100
        if dedupe:
            assert len(set(got)) == 100
        if cap is not None:
            assert max(sum(1 for q, _ in got if q == x) for x in s) <= cap
        seen_queries[dedupe, cap] = len({q for q, _ in got})
    assert seen_queries[True, 4] >= 25 > seen_queries[False, None]


# ---- two-level ---------------------------------------------------------------------------------------


def test_two_level_agent_advantages_use_all_workflow_scores():
    """The proposal (§4.1 symbols, §4.3 step 5): A^A_i = (r_i - r̄)/σ with r̄, σ over all r_ij, not the r_i."""
    (q,) = two_level_advantages({"q": [[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]]}, eps_adv=0.0)
    # r_ij [0,0,1,0,1,1]: r̄ = .5, σ = .5; r_i = [1/3, 2/3] -> (1/3 - 1/2)/(1/2) = -1/3 and +1/3
    np.testing.assert_allclose(q.agent_advantages, [-1 / 3, 1 / 3])
    np.testing.assert_allclose(np.concatenate(q.workflow_advantages), [-1, -1, 1, -1, 1, 1])
    # the option that keeps the former statistics: r_i [1/3, 2/3] have mean .5, std 1/6 -> ∓1
    (old,) = two_level_advantages({"q": [[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]]}, eps_adv=0.0, agent_stats="agents")
    np.testing.assert_allclose(old.agent_advantages, [-1.0, 1.0])
    np.testing.assert_allclose(np.concatenate(old.workflow_advantages), [-1, -1, 1, -1, 1, 1])


def test_two_level_batch_normalisation_hand_computed():
    out = two_level_advantages({"q1": [[1.0, 0.0], [1.0, 1.0]], "q2": [[0.0, 0.0], [0.5]]}, eps_adv=0.0)
    q1, q2 = out
    assert q1.agent_rewards.tolist() == [0.5, 1.0] and q2.agent_rewards.tolist() == [0.0, 0.5]
    # workflow scores of the batch [1,0,1,1,0,0,.5]: r̄ = .5, σ = sqrt(1.5/7); both levels use them
    sw = math.sqrt(1.5 / 7)
    np.testing.assert_allclose(np.concatenate([q1.agent_advantages, q2.agent_advantages]), [0, 0.5 / sw, -0.5 / sw, 0])
    np.testing.assert_allclose(q1.workflow_advantages[0], [0.5 / sw, -0.5 / sw])
    np.testing.assert_allclose(q2.workflow_advantages[1], [0.0])
    assert q1.agent_buckets == ["S", "F"] and q1.workflow_buckets == [["F", "S"], ["F", "F"]]
    # agent statistics: rewards [.5, 1 | 0, .5] have mean .5, std sqrt(.125)
    a1, a2 = two_level_advantages({"q1": [[1.0, 0.0], [1.0, 1.0]], "q2": [[0.0, 0.0], [0.5]]}, eps_adv=0.0,
                                  agent_stats="agents")
    sa = math.sqrt(0.125)
    np.testing.assert_allclose(np.concatenate([a1.agent_advantages, a2.agent_advantages]), [0, 0.5 / sa, -0.5 / sa, 0])
    np.testing.assert_allclose(a1.workflow_advantages[0], [0.5 / sw, -0.5 / sw])


def test_two_level_per_query_normalisation():
    (q1,) = two_level_advantages({"q1": [[1.0, 0.0], [1.0, 1.0]]}, eps_adv=0.0, norm="query")
    s = math.sqrt(3) / 4  # the query's workflow scores [1, 0, 1, 1]: r̄ = .75, σ = sqrt(3)/4
    np.testing.assert_allclose(q1.agent_advantages, [-0.25 / s, 0.25 / s])  # r_i [.5, 1]
    np.testing.assert_allclose(np.concatenate(q1.workflow_advantages), [0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s])
    (a,) = two_level_advantages({"q1": [[1.0, 0.0], [1.0, 1.0]]}, eps_adv=0.0, norm="query", agent_stats="agents")
    np.testing.assert_allclose(a.agent_advantages, [-1.0, 1.0])  # [.5, 1]: mean .75, std .25


def test_two_level_agent_without_workflows_earns_zero():
    # the plan without workflows gets r_i = 0 and enters r̄, σ as one score 0: pool [0, 1], r̄ = σ = .5
    (q,) = two_level_advantages({"q": [[], [1.0]]}, norm="query")
    assert q.agent_rewards.tolist() == [0.0, 1.0]
    assert q.agent_advantages == pytest.approx([-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)])
    assert q.workflow_advantages[1] == pytest.approx([0.5 / (0.5 + EPS)])
    # all other scores equal: σ = 0 would make -r̄/eps = -1e6 without the zero; with it, pool [0, 1, 1]
    (z,) = two_level_advantages({"q": [[], [1.0, 1.0]]}, eps_adv=0.0, norm="query")
    s = math.sqrt(2) / 3
    np.testing.assert_allclose(z.agent_advantages, [-(2 / 3) / s, (1 / 3) / s])
    # the former statistics: agents [0, 1] (mean .5, std .5), workflows [1] alone (no spread)
    (o,) = two_level_advantages({"q": [[], [1.0]]}, norm="query", agent_stats="agents")
    assert o.agent_advantages == pytest.approx([-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)])
    assert o.workflow_advantages[1].tolist() == [0.0]


def test_two_level_rejects_unknown_agent_stats():
    with pytest.raises(ValueError, match="agent_stats"):
        two_level_advantages({"q": [[1.0]]}, agent_stats="queries")


# ---- the stage on a store --------------------------------------------------------------------------------


def _ctx(tmp_path, sets=()):
    from pipeline.run import open_run

    pinned = [f"store.root={tmp_path}", "curation.n=3", "curation.t=1", "curation.top_n=8"]  # not the demo's tuning
    return open_run("configs/smoke.yaml", f"c{uuid.uuid4().hex[:6]}", 0, [*pinned, *sets], store_root=str(tmp_path))


def _gen(gen_id, qid, slot, kind="workflow", parent=None, valid=True):
    return {"gen_id": gen_id, "query_id": qid, "slot": slot, "kind": kind, "parent_id": parent, "valid": valid,
            "prompt_token_ids": [1, 2], "token_ids": [3, 4]}


def _score(gen_id, status="ok", score=1.0, rep=0, attempt=0):
    return {"gen_id": gen_id, "rep": rep, "attempt": attempt, "status": status, "score": score}


def test_run_curate_flat_left_out_invalid_and_reps(tmp_path):
    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["scoring.reps=2", "scoring.retry_timeouts=true", "curation.top_n=100"])
    gens, scores = [], []
    for q in ("a", "b", "c", "d", "e"):
        gens += [_gen(f"{q}{i}", q, i) for i in range(4)]
    # a: rep means [0.5, 1, 0, 0(invalid)]; the first attempt of a0/rep1 was a transient error, re-scored
    scores += [_score("a0", score=1.0), _score("a0", "executor_error", None, rep=1),
               _score("a0", score=0.0, rep=1, attempt=1), _score("a1", rep=0), _score("a1", rep=1),
               _score("a2", score=0.0), _score("a2", score=0.0, rep=1),
               _score("a3", "invalid", None), _score("a3", "invalid", None, rep=1)]
    # b: one workflow has only one of two reps -> left out; c: latest is executor_error -> left out
    scores += [_score(f"b{i}", rep=r) for i in range(4) for r in range(2) if (i, r) != (3, 1)]
    scores += [_score(f"c{i}", rep=r) for i in range(4) for r in range(2)]
    scores += [_score("c2", "executor_error", None, rep=1, attempt=1)]
    # d: a timeout is transient when retry_timeouts; e: all equal -> filtered
    scores += [_score(f"d{i}", "timeout" if i == 0 else "ok", 0.0, rep=r) for i in range(4) for r in range(2)]
    scores += [_score(f"e{i}", score=0.5, rep=r) for i in range(4) for r in range(2)]
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", scores, ctx.run_id, 0)
    counts = run_curate(ctx)
    assert counts["queries"] == 5 and counts["queries_left_out"] == 3 and counts["queries_filtered"] == 1
    assert counts["candidate_groups"] == 4 and counts["groups_kept"] == 4  # C(4,3) groups of query a
    # a's groups sharpen to (a2,a1) (a3,a1) (a2,a0) (a2,a1): all four workflows, one query
    assert counts["distinct_workflows"] == 4 and counts["distinct_queries"] == 1
    full = ctx.store.read("groups", ctx.run_id, 0)
    g = full.filter(full["kind"] == "group")
    kept = g.filter(g["kept"])
    assert set(kept["query_id"]) == {"a"} and kept["level"].unique().to_list() == ["flat"]
    best = kept.sort("variance", descending=True).row(0, named=True)
    # a's scores [.5, 1, 0, 0]: {1,2,3} = [1, 0, 0] has the top variance 2/9, sharpened to a2 (0) and a1 (1)
    assert best["members"] == ["a2", "a1"] and best["member_scores"] == [0.0, 1.0]
    assert best["variance"] == pytest.approx(2 / 9) and best["kl_mask"] == [False, True]
    reasons = {r["query_id"]: r["reason"] for r in g.filter(~g["kept"]).iter_rows(named=True)}
    assert reasons["b"] == "left out: 1 of 4 workflows unscored"
    assert reasons["c"] == "left out: 1 of 4 workflows transient"
    assert reasons["d"] == "left out: 1 of 4 workflows transient"
    assert reasons["e"].startswith("filtered: all 4 scores equal")
    assert "a" not in reasons  # all 4 candidate groups kept
    from pipeline.stages.runner import run_stage

    assert run_stage("curate", ctx.run_id, 0, str(ctx.store.root)).skipped is True
    assert ctx.store.read("groups", ctx.run_id, 0).height == full.height


def test_run_curate_flat_records_screened_out_summary(tmp_path):
    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["curation.top_n=1"])
    ctx.store.write("generations", [_gen(f"q{i}", "q", i) for i in range(4)], ctx.run_id, 0)
    ctx.store.write("scores", [_score(f"q{i}", score=s) for i, s in enumerate([0.0, 0.3, 1.0, 0.6])], ctx.run_id, 0)
    run_curate(ctx)
    g = ctx.store.read("groups", ctx.run_id, 0).filter(pl.col("kind") == "group")
    assert g.filter(g["kept"]).height == 1
    (row,) = g.filter(~g["kept"]).iter_rows(named=True)
    assert row["reason"].startswith("screened out: 3 of 4 candidate groups below the top-1 variance cut")
    assert row["members"] == ["q0", "q1", "q2", "q3"]


def test_run_curate_two_level(tmp_path):
    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["rollout.mode=two_level"])
    gens = [_gen("A0", "q", 0, "agent"), _gen("A1", "q", 1, "agent"), _gen("A2", "q", 2, "agent", valid=False),
            _gen("w00", "q", 0, parent="A0"), _gen("w01", "q", 1, parent="A0"), _gen("w10", "q", 0, parent="A1"),
            _gen("B0", "r", 0, "agent"), _gen("v00", "r", 0, parent="B0")]  # r: v00 unscored -> left out
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", [_score("w00", score=1.0), _score("w01", score=0.0), _score("w10", score=1.0)],
                    ctx.run_id, 0)
    counts = run_curate(ctx)
    assert counts["queries"] == 2 and counts["queries_left_out"] == 1
    # kept: q's agents [A0, A1, A2] and workflows [w00, w01], [w10] (every sequence trained on); r left out
    assert counts["distinct_workflows"] == 6 and counts["distinct_queries"] == 1
    g = ctx.store.read("groups", ctx.run_id, 0).sort("group_id")
    agents = g.filter((g["level"] == "agent") & g["kept"]).row(0, named=True)
    assert agents["members"] == ["A0", "A1", "A2"] and agents["member_scores"] == [0.5, 1.0, 0.0]
    # r̄, σ over the workflow scores [1, 0, 1] and the invalid plan's 0: .5 and .5; rewards [.5, 1, 0]
    assert agents["advantages"] == pytest.approx([0.0, 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])
    assert agents["kl_mask"] == [False, True, False] and agents["buckets"] == ["M", "F", "S"]
    wf = {r["members"][0]: r for r in g.filter(g["level"] == "workflow").iter_rows(named=True)}
    assert wf["w00"]["advantages"] == pytest.approx([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])
    assert wf["w00"]["buckets"] == ["F", "S"]
    left = g.filter(~g["kept"]).row(0, named=True)
    assert left["query_id"] == "r" and left["reason"] == "left out: 1 of 1 workflows unscored"


def _two_queries(ctx):
    # a [0,0,1,1,1] and b [0,0,0,.5] as in the hand-listed dedupe and cap tests above
    gens = [_gen(f"a{i}", "a", i) for i in range(5)] + [_gen(f"b{i}", "b", i) for i in range(4)]
    scores = [_score(f"a{i}", score=x) for i, x in enumerate([0.0, 0.0, 1.0, 1.0, 1.0])]
    scores += [_score(f"b{i}", score=x) for i, x in enumerate([0.0, 0.0, 0.0, 0.5])]
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", scores, ctx.run_id, 0)


def test_run_curate_counts_distinct_workflows_and_queries(tmp_path):
    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["curation.top_n=4"])
    _two_queries(ctx)
    counts = run_curate(ctx)  # paper screening: a's r0..r3 -> [a0,a2] [a0,a3] [a0,a3] [a1,a3]
    assert counts["groups_kept"] == 4 and counts["sequences"] == 8
    assert counts["distinct_workflows"] == 4 and counts["distinct_queries"] == 1
    assert ctx.store.manifest(ctx.run_id, 0, "curate")["counts"]["distinct_workflows"] == 4


def test_run_curate_dedupe_and_cap_from_the_config(tmp_path):
    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["curation.top_n=4", "curation.dedupe=true", "curation.max_kept_per_query=3"])
    _two_queries(ctx)
    counts = run_curate(ctx)  # a: [a0,a2] [a0,a3] [a1,a3] (cap 3, r2 a duplicate); then b's r1 [b0,b3]
    assert counts["groups_kept"] == 4 and counts["candidate_groups"] == 14
    assert counts["distinct_workflows"] == 6 and counts["distinct_queries"] == 2
    g = ctx.store.read("groups", ctx.run_id, 0).filter(pl.col("kind") == "group")
    kept = g.filter(g["kept"]).sort("group_id")
    assert kept["members"].to_list() == [["a0", "a2"], ["a0", "a3"], ["a1", "a3"], ["b0", "b3"]]
    reasons = {r["query_id"]: r["reason"] for r in g.filter(~g["kept"]).iter_rows(named=True)}
    tail = "candidate groups below the top-4 variance cut 0.0555556, or duplicates of a kept group's members, " \
           "or past the cap of 3 kept groups per query"
    assert reasons == {"a": f"screened out: 7 of 10 {tail}", "b": f"screened out: 3 of 4 {tail}"}
