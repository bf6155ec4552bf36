"""Room to learn: the headroom maths (pipeline.core.headroom, every expected value worked out by hand from
its definition), the study end to end on a scripted executor (pipeline.studies.headroom), the menu's designs
(pipeline.core.designs, the program files) and the truncated share of executor replies (write side and readers)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from test_baselines import in_process
from test_executors import FaultServer, executor

from pipeline.config import ConfigError, load_config
from pipeline.core.designs import OTHER, nearest_design, similarity
from pipeline.core.headroom import (
    Point,
    Runs,
    best_design,
    cross_fit,
    fold_labels,
    frontier,
    gain_per_query,
    gain_within,
    greedy,
    in_sample_only,
    learnable_room,
    pareto,
    part_room,
    part_router,
    per_query,
    replays,
)
from pipeline.core.reward import program_key
from pipeline.engines.benchmarks import load_benchmark
from pipeline.engines.prompting import PromptError, design_prefix, load_design, menu_listing, workflow_prompt
from pipeline.engines.workflow import check_workflow
from pipeline.stages.sampling import draw_design
from pipeline.store import Store, round_stats
from pipeline.studies import headroom as headroom_study
from pipeline.studies.evaluate import eval_summary
from pipeline.studies.headroom import (
    analyse,
    build_runs,
    learnable,
    markdown,
    plot_frontier,
    run_headroom,
    status,
)
from pipeline.studies.summaries import HeadroomReport, HeadroomSummary


def abc() -> Runs:
    """Designs A, B, C on queries q1, q2, two runs each.
    scores  A: q1 [1, 1] q2 [0, 0]   B: q1 [0, 0] q2 [1, 0]   C: q1 [1, 0] q2 [1, 1]   (means 0.5, 0.25, 0.75)
    tokens  A: 100 everywhere        B: 50 everywhere          C: 300 everywhere"""
    s = np.array([[[1, 1], [0, 0]], [[0, 0], [1, 0]], [[1, 0], [1, 1]]], dtype=float)
    t = np.array([np.full((2, 2), 100.0), np.full((2, 2), 50.0), np.full((2, 2), 300.0)])
    return Runs(("A", "B", "C"), ("q1", "q2"), s, t)


def test_best_single_design_and_its_ties():
    assert best_design(abc()) == 2  # C: 0.75
    # equal scores: the fewer tokens wins, then the earlier design
    s = np.ones((3, 1, 2))
    t = np.array([[[20.0, 20.0]], [[10.0, 10.0]], [[10.0, 10.0]]])
    assert best_design(Runs(("x", "y", "z"), ("q",), s, t)) == 1


def test_oracle_cross_fitted_at_the_best_designs_budget_by_hand():
    # anchor C (budget 300). Pair (r=0 -> r'=1): q1 A and C tie at 1 -> the anchor C; q2 B and C tie -> C.
    # Scored on run 1: C q1 = 0, C q2 = 1 -> 0.5, 300 tokens. Pair (1 -> 0): q1 only A is 1 -> A; q2 only C -> C
    # (200 tokens <= 300). Scored on run 0: A q1 = 1, C q2 = 1 -> 1.0, 200 tokens. Mean: 0.75 at 250 tokens.
    o = cross_fit(abc(), "greedy", 2)
    assert (o.score, o.tokens, o.budget, o.pairs) == (0.75, 250.0, 300.0, 2)
    assert o.chosen == {"A": 0.25, "C": 0.75} and o.anchor == "C"


def test_greedy_trades_down_to_the_budget_by_hand():
    r = abc()
    # anchored at A (budget 100 a query). Run 1 alone: q1 -> A (only 1), q2 -> C (only 1): 400 tokens > 200.
    # Trades: q1 A -> B loses 1 for 50 (0.02/token); q2 C -> A loses 1 for 200 (0.005); q2 C -> B loses 1 for 250
    # (0.004, the cheapest): [A, B], 150 tokens <= 200.
    assert greedy(r.scores[:, :, 1], r.tokens[:, :, 1], 0).tolist() == [0, 1]
    # run 0: q1 A and C tie -> the anchor A; q2 B and C tie, anchor not among them -> the cheaper B: [A, B], fits
    assert greedy(r.scores[:, :, 0], r.tokens[:, :, 0], 0).tolist() == [0, 1]
    # cross-fitted: choice [A, B] both ways; on run 1 A q1 = 1, B q2 = 0 -> 0.5; on run 0 1 and 1 -> 1.0
    o = cross_fit(r, "greedy", 0)
    assert (o.score, o.tokens, o.budget) == (0.75, 75.0, 100.0)
    # in sample: chosen and scored on the same run: run 0 [A, B] -> 1.0, run 1 [A, B] -> 0.5
    assert cross_fit(r, "greedy", 0, in_sample=True).score == 0.75


def test_per_query_rule_by_hand():
    r = abc()
    # anchored at A: per query only designs of <= 100 tokens (A, B). Pair (0 -> 1): q1 A 1, B 0 -> A; q2 A 0, B 1
    # -> B; run 1: A q1 1, B q2 0 -> 0.5 at 75 tokens. Pair (1 -> 0): q1 -> A; q2 A 0, B 0 tie -> the anchor A;
    # run 0: 1, 0 -> 0.5 at 100 tokens. Mean 0.5 at 87.5.
    o = cross_fit(r, "per_query", 0)
    assert (o.score, o.tokens, o.budget) == (0.5, 87.5, 100.0)
    assert per_query(r.scores[:, :, 1], r.tokens[:, :, 1], 0).tolist() == [0, 0]
    with pytest.raises(ValueError, match="unknown budget rule .lagrange.; known: greedy, per_query"):
        cross_fit(r, "lagrange", 0)


def test_frontier_and_pareto():
    # anchored at B (budget 50 a query). Pair (0 -> 1): q1 A, C tie at 1, anchor not among them -> the cheaper A;
    # q2 B, C tie -> the anchor B: 150 tokens > 100 -> q1 A -> B: [B, B]; run 1: 0 + 0. Pair (1 -> 0): [A, C], 400 ->
    # q2 C -> B (0.004 a token) -> 150 -> q1 A -> B: [B, B]; run 0: 0 + 1. Mean 0.25 at 50: B's own numbers.
    fr = {o.anchor: o for o in frontier(abc(), "greedy")}
    assert fr["B"].tokens <= fr["B"].budget == 50.0 and fr["B"].score == 0.25  # B's own score: nothing cheaper
    assert fr["C"].score == 0.75 and fr["A"].score == 0.75
    # the gain over the designs within each budget: at A's (100 a run) A 0.5 and B 0.25 fit: 0.75 - 0.5; at B's
    # (50) B alone: 0.25 - 0.25; at C's (300) all three: 0.75 - 0.75
    points = [Point("A", 0.5, 100.0), Point("B", 0.25, 50.0), Point("C", 0.75, 300.0)]
    assert [gain_within(points, fr[d]) for d in "ABC"] == [0.25, 0.0, 0.0]
    # per query, anchored at A (budget 200: 100 on each query). Pair (0 -> 1): on run 0 q1 A (the anchor ties C), q2
    # B and C tie -> the cheaper B; 150 fits; on run 1 A scores q1 1, B scores q2 0; A itself 1, 0 -> [0, 0]. Pair
    # (1 -> 0): on run 1 q1 A, q2 C (400 > 200) -> the trade losing least a token saved: q2 C -> B (1/250) -> 150; on
    # run 0 A 1, B 1; A itself 1, 0 -> [0, 1]. Mean over pairs [0, 0.5], whose mean is the oracle's 0.75 minus A's 0.5
    assert gain_per_query(abc(), "greedy", 0).tolist() == [0.0, 0.5]
    assert gain_per_query(abc(), "greedy", 2).tolist() == [0.0, 0.0]  # at C's budget the oracle is C on both pairs
    with pytest.raises(ValueError, match="unknown budget rule 'best'"):
        gain_per_query(abc(), "best", 0)
    pts = [Point("A", 0.5, 100), Point("B", 0.25, 50), Point("C", 0.75, 300), Point("D", 0.25, 200),
           Point("E", 0.5, 100)]
    # D is beaten by A (more score, fewer tokens); A and E are equal, so neither dominates the other
    assert pareto(pts) == [True, True, True, False, True]


def test_part_router_by_hand():
    # parts: q1 in x, q2 in y; anchor C. Pair (0 -> 1): x: A 1, B 0, C 1 -> C (the anchor); y: A 0, B 1, C 1 -> C;
    # run 1: 0 + 1 -> 0.5 at 300. Pair (1 -> 0): x: A 1 -> A; y: C 1 -> C; run 0: 1 + 1 -> 1.0 at 200.
    o, chosen = part_router(abc(), ["x", "y"], 2)
    assert (o.score, o.tokens) == (0.75, 250.0)
    # on all runs together: x: A 1.0, B 0, C 0.5 -> A; y: A 0, B 0.5, C 1.0 -> C
    assert chosen == {"x": "A", "y": "C"}
    with pytest.raises(ValueError, match="1 parts for 2 queries"):
        part_router(abc(), ["x"], 2)


def test_runs_refuses_bad_shapes():
    with pytest.raises(ValueError, match="cross-fitting needs 2"):
        Runs(("a",), ("q",), np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))
    with pytest.raises(ValueError, match=r"shape \(2, 1, 2\), need \(1 designs, 1 queries, runs\)"):
        Runs(("a",), ("q",), np.zeros((2, 1, 2)), np.zeros((2, 1, 2)))


def test_build_runs_keeps_queries_every_design_finished():
    def frame(rows):
        return pl.DataFrame(rows, schema=["query_id", "slot", "score", "tokens", "part", "prompt"], orient="row")
    frames = {"a": frame([("q1", 0, 1.0, 10, "x", "one?"), ("q1", 1, 0.0, 12, "x", "one?"),
                          ("q2", 0, 1.0, 10, "y", "two?"), ("q2", 1, None, 0, "y", "two?")]),  # q2 run 1 not final
              "b": frame([("q1", 0, 0.0, 5, "x", "one?"), ("q1", 1, 1.0, 5, "x", "one?"),
                          ("q2", 0, 0.0, 5, "y", "two?"), ("q2", 1, 1.0, 5, "y", "two?")])}
    runs, parts, texts, dropped = build_runs(frames, 2)
    assert runs.queries == ("q1",) and parts == ["x"] and texts == ["one?"] and dropped == ["q2"]
    assert runs.scores.tolist() == [[[1.0, 0.0]], [[0.0, 1.0]]] and runs.tokens.tolist() == [[[10, 12]], [[5, 5]]]
    with pytest.raises(ConfigError, match="no query has 3 final runs of every design"):
        build_runs(frames, 3)


def test_analyse_gate_and_per_part(tmp_path):
    # The learnable room: abc's two queries in two parts make 2 folds, one query each. Means over runs: A q1 1, q2 0;
    # B q1 0, q2 0.5; C q1 0.5, q2 1. Fold q1 (fitted on q2): solved (mean >= 0.5) on q2: A no, B yes, C yes; one
    # query, so each design gets its rate: A 0, B 1, C 1 -> B and C tie, B cheaper (50 < 300) -> B: 0 on q1, 50
    # tokens; the best design on q2 alone is C (1.0): 0.5 on q1, 300 tokens. Fold q2 (fitted on q1): A 1, B 0, C 1
    # (0.5 solves) -> A (100 < 300): 0 on q2, 100 tokens; best on q1: A (1.0 > 0.5): 0 on q2, 100 tokens.
    # Router (0 + 0) / 2 = 0 at (50 + 100) / 2 = 75 tokens; best (0.5 + 0) / 2 = 0.25 at 200: room -0.25.
    out = analyse(abc(), ["x", "y"], "greedy", 0.05, ["one", "two"])
    assert out.best.name == "C" and out.oracle.score == 0.75 and out.gain == 0.0
    assert (out.learnable.score, out.learnable.tokens, out.learnable.best_score, out.learnable.best_tokens,
            out.learnable.gain) == (0.0, 75.0, 0.25, 200.0, -0.25)
    assert not out.passes and out.gate_on == "learnable"
    assert out.per_part["x"].to_dict() == {"queries": 1, "best": "A", "scores": {"A": 1.0, "B": 0.0, "C": 0.5}}
    assert not out.oracle_in_sample_only  # A's runs agree on both queries, B's and C's on one
    assert [(r.design, r.same_scores, r.same_runs) for r in out.replay] == [("A", 1.0, 1.0), ("B", 0.5, 0.5),
                                                                            ("C", 0.5, 0.5)]
    summary = HeadroomReport(run_id="h", config="h.yaml", split="dev", **out.field_values())
    lines = markdown(summary)
    assert lines[1] == "(a) best single design: C 0.750 at 300 executor tokens per run"
    assert lines[3] == ("gain (b) - (a): +0.000 [+0.000, +0.000] (95%, queries resampled): the oracle chooses on the "
                        "scores it is judged on, an upper bound; the gate reads (c)")
    assert lines[4].startswith("runs identical (share of queries, scores): A 100% (100% same tokens too), B 50%")
    assert lines[4].endswith("; replayed on every query (scores and tokens): A, whose runs cross-fitting cannot tell "
                             "apart")
    assert lines[5].startswith("(c) learnable room: learned router fitted on other queries (2 folds) 0.000 at 75 "
                               "tokens, best single design chosen on the same folds 0.250 at 200: -0.250")
    assert lines[6].startswith("    per-part router, the same folds:")
    assert lines[7] == "gate 0.05 on (c)'s point estimate: does not pass: no training run"
    assert lines[8] == ("largest gain along the frontier: +0.250 at A's budget (100 tokens) over the designs within it "
                        "((b) reads it at (a)'s budget)")
    assert lines[12] == "| A | 0.500 | 100 | yes | n/a | 0.750 | +0.250 |"
    fig = plot_frontier(summary, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0 and len(fig.axes[0].collections) == 2  # designs, oracle star
    # a summary written before the learnable room reads back and prints its gate on the oracle, as it was
    old = HeadroomSummary.from_dict({k: v for k, v in summary.to_dict().items()
                                     if k not in ("replay", "oracle_in_sample_only", "learnable", "learnable_part",
                                                  "gate_on")})
    assert markdown(old)[3] == ("gain (b) - (a): +0.000 [+0.000, +0.000] (95%, queries resampled); gate 0.05 on the "
                                "point estimate: does not pass: no training run")


# ---- replays and the learnable room ---------------------------------------------------------------------------


def test_replay_detector_by_hand():
    # A: both runs the same score and tokens on both queries (a replay): 2/2 and 2/2. B: q1 scores agree (0, 0) but
    # tokens differ (40, 41); q2 scores differ (1, 0): same scores 1/2, same scores and tokens 0/2.
    s = np.array([[[1, 1], [0, 0]], [[0, 0], [1, 0]]], dtype=float)
    t = np.array([[[30, 30], [20, 20]], [[40, 41], [50, 50]]], dtype=float)
    runs = Runs(("A", "B"), ("q1", "q2"), s, t)
    assert [(r.design, r.same_scores, r.same_runs) for r in replays(runs)] == [("A", 1.0, 1.0), ("B", 0.5, 0.0)]
    assert not in_sample_only(runs)
    s[1, 1] = [1, 1]  # B's q2 agrees too: every design scores the same on every run -> the oracle is in sample
    replayed = Runs(("A", "B"), ("q1", "q2"), s, t)
    assert in_sample_only(replayed)
    assert cross_fit(replayed, "greedy", 0).score == cross_fit(replayed, "greedy", 0, in_sample=True).score
    # three runs: identical only when all three agree
    three = Runs(("A",), ("q",), np.array([[[1.0, 1.0, 0.0]]]), np.zeros((1, 1, 3)))
    assert replays(three)[0].same_scores == 0.0 and not in_sample_only(three)


def test_fold_labels_spread_every_part_over_the_folds():
    parts = ["a"] * 5 + ["b"] * 3
    labels = fold_labels(parts, 3)
    # part a dealt to folds 0, 1, 2, 0, 1; part b carries on: 2, 0, 1 -> a: 2, 2, 1 a fold; b: 1 each; sizes 3, 3, 2
    assert [int((labels[:5] == f).sum()) for f in range(3)] == [2, 2, 1]
    assert [int((labels[5:] == f).sum()) for f in range(3)] == [1, 1, 1]
    assert (fold_labels(parts, 3) == labels).all()  # seeded
    for bad in (1, 9):
        with pytest.raises(ValueError, match=f"{bad} folds for 8 queries"):
            fold_labels(parts, bad)


def replayed_runs(scores: list[list[float]], tokens: list[float]) -> Runs:
    """Designs x queries scores, both runs the same (a temperature-0 replay); each design's tokens the same on every
    query."""
    s = np.repeat(np.array(scores, dtype=float)[:, :, None], 2, axis=2)
    t = np.array([np.full(s.shape[1:], x) for x in tokens])
    return Runs(tuple("AB"[: len(scores)]), tuple(f"q{i}" for i in range(s.shape[1])), s, t)


def test_learnable_room_chooses_its_setting_inside_the_fit_folds_by_hand():
    """A [1, 0, 1], B [0, 1, 0] on q0, q1, q2, one query a fold; setting 0 predicts each design's rate on the fit
    queries (no text), setting 1 the held-out query's own scores (a peek: a classifier that is always right).
    Fold q0 (fit q1, q2): inner q1 fitted on q2 -> rates A 1, B 0 -> A, 0 on q1; inner q2 fitted on q1 -> B, 0 on
    q2: setting 0 totals 0, setting 1 totals 2 -> setting 1: q0 -> A, 1; best on q1, q2: A and B tie at 0.5 (equal
    tokens) -> A, 1. Fold q1 (fit q0, q2): setting 0 routes inner q0 and q2 to A (rate 1 on the other): 2; setting 1
    also 2 -> the earlier, setting 0: q1 -> A (rate 1 on q0, q2), 0; best on q0, q2: A, 0. Fold q2: as fold q0,
    setting 1, 1 and 1. Router 2/3, best 2/3, room 0, every query routed to A; the oracle would be 1.0."""
    runs = replayed_runs([[1, 0, 1], [0, 1, 0]], [10, 10])
    scores = runs.scores.mean(axis=2)
    calls = []

    def predict(fit, held, setting):
        calls.append((set(fit.tolist()), set(held.tolist())))
        if setting == 0:
            return np.tile(scores[:, fit].mean(axis=1), (len(held), 1))
        return scores[:, held].T

    room = learnable_room(runs, np.array([0, 1, 2]), predict, settings=2)
    assert (room.score, room.best_score, room.gain, room.settings) == (2 / 3, 2 / 3, 0.0, (1, 0, 1))
    assert room.chosen == {"A": 1.0} and room.best_chosen == {"A": 1.0} and room.folds == 3
    assert room.differences.tolist() == [0.0, 0.0, 0.0]
    assert all(not fit & held for fit, held in calls)  # a query is never in the fit of its own prediction
    assert len(calls) == 3 * (2 * 2) + 3  # per fold: 2 settings x 2 inner folds, then the fold itself
    with pytest.raises(ValueError, match="2 fold labels for 3 queries"):
        learnable_room(runs, np.array([0, 1]), predict)


def test_part_room_by_hand():
    # A [1, 1, 0, 0], B [0, 0, 1, 1], parts x x y y, folds 0 1 0 1, equal tokens. Fold 0 (held q0, q2; fit q1, q3):
    # x -> A, y -> B: 1 and 1; best on q1, q3: A and B tie at 0.5 -> A: 1 and 0. Fold 1 the same on q1, q3.
    # Router 1.0, best 0.5, differences [0, 0, 1, 1].
    runs = replayed_runs([[1, 1, 0, 0], [0, 0, 1, 1]], [10, 10])
    folds = np.array([0, 1, 0, 1])
    room = part_room(runs, ["x", "x", "y", "y"], folds)
    assert (room.score, room.best_score, room.gain) == (1.0, 0.5, 0.5)
    assert room.differences.tolist() == [0.0, 0.0, 1.0, 1.0] and room.chosen == {"A": 0.5, "B": 0.5}
    # parts x x y z: a held-out query whose part the fit folds lack gets their best design. Fold 0 (fit q1 in x, q3
    # in z): q0 (x) -> A, 1; q2 (y: none in the fit) -> the fit's best, A and B tie at 0.5 -> A, 0. Fold 1 (fit q0
    # in x, q2 in y): q1 -> A, 1; q3 (z: none) -> A, 0. Router 0.5, the same as the best design: differences all 0.
    room = part_room(runs, ["x", "x", "y", "z"], folds)
    assert room.score == 0.5 and room.differences.tolist() == [0.0, 0.0, 0.0, 0.0]


MULTIPLY = [f"What is {a} * {b}?" for a, b in [(312, 45), (908, 77), (51, 6001), (77, 123), (611, 42)]]
STORY = [f"{name} has {a} apples and buys {b} more. How many apples does {name} have?"
         for name, a, b in [("Ann", 3, 4), ("Tom", 12, 7), ("Sara", 5, 9), ("Ben", 4, 7), ("Kim", 8, 2)]]
WORD = ((1.0, "word"),)  # the router's one setting in these tests: word n-grams, scikit-learn's default C


def test_a_router_the_text_informs_reaches_the_oracle():
    """A solves the five multiplications, B the five stories, equal tokens. Each of the 5 folds holds one of each
    kind (the parts), so every fit sees 4 of each and the router sends each held-out query to its winner: 1.0 on
    every query. The best single design on any fit: A and B tie at 0.5 -> A: 0.5. Room: 0 on the multiplications
    (A both), +1 on the stories: +0.5, its interval strictly between 0 and 1 (a resample of all five stories or none
    is rare); the per-part router (parts = kinds) the same. The oracle: 1.0, also +0.5."""
    runs = replayed_runs([[1] * 5 + [0] * 5, [0] * 5 + [1] * 5], [10, 10])
    parts = ["mul"] * 5 + ["story"] * 5
    learned, by_part = learnable(runs, parts, MULTIPLY + STORY, 5, WORD)
    assert (learned.score, learned.best_score, learned.gain) == (1.0, 0.5, 0.5)
    assert 0 < learned.gain_interval[0] < 0.5 < learned.gain_interval[1] < 1
    assert learned.chosen == {"A": 0.5, "B": 0.5} and learned.best_chosen == {"A": 1.0}
    assert learned.settings == {"word C=1": 1.0} and learned.folds == 5
    assert (by_part.score, by_part.gain) == (1.0, 0.5)
    out = analyse(runs, parts, "greedy", 0.5, MULTIPLY + STORY, 5, WORD)
    assert out.gain == 0.5 and out.learnable.gain == 0.5 and out.passes  # 0.5 >= 0.5: the gate's >= is kept


def test_the_gate_follows_the_learnable_room_not_the_oracle():
    """Every query's text is the same: A solves q0-q6, B q7-q9 (disjoint). Any fit of 8 queries has A solving at
    least 5 and B at most 3, so the router (which only sees the rates) and the fit folds' best design are A on every
    fold: router 0.7, best 0.7, room 0 (interval [0, 0]). The oracle, chosen on the scores it is judged on (both runs
    the same: in sample), reaches 1.0: +0.3 over A, far above the 0.05 gate; the gate does not pass."""
    runs = replayed_runs([[1] * 7 + [0] * 3, [0] * 7 + [1] * 3], [10, 10])
    out = analyse(runs, ["p"] * 10, "greedy", 0.05, ["Solve it."] * 10, 5, WORD)
    assert out.oracle.score == 1.0 and out.gain == pytest.approx(0.3)
    assert (out.learnable.score, out.learnable.best_score, out.learnable.gain) == (0.7, 0.7, 0.0)
    assert out.learnable.gain_interval == [0.0, 0.0] and out.learnable_part is None  # one part: no part router
    assert out.oracle_in_sample_only and not out.passes
    lines = markdown(HeadroomReport(run_id="h", config="h.yaml", split="dev", **out.field_values()))
    assert lines[4].startswith("runs identical: every design scored the same on every run of every query")
    assert lines[4].endswith("so the cross-fitted oracle is the in-sample one")
    assert lines[6] == "gate 0.05 on (c)'s point estimate: does not pass: no training run"


# ---- the study end to end, on a scripted executor ----------------------------------------------------------


@pytest.fixture
def server():
    srv = FaultServer()
    yield srv
    srv.close()


def _config(tmp_path: Path, url: str, designs: list[str]) -> Path:
    cfg = {"run_id": "h", "store": {"root": str(tmp_path / "store")},
           "benchmark": {"name": "procedural", "tasks": ["chain_sum"], "size": 20, "dev_share": 0.5},
           "executor": {"kind": "openai", "model": "m", "base_url": url, "max_retries": 0, "timeout_s": 5},
           "scoring": {"timeout_s": 20, "concurrency": 2, "max_llm_calls": 4},
           "headroom": {"designs": designs}}
    path = tmp_path / "h.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.usefixtures("shared_sandbox")
def test_headroom_study_end_to_end(tmp_path, server, monkeypatch):
    """Two designs on the 2 dev queries, 2 runs each: `io` (the executor always says q0's answer: right on q0, 10
    tokens a run, every reply cut at the cap) and a program that returns q1's answer without the executor (right on
    q1, 0 tokens). Both score 0.5; the best single design is the cheaper program (budget 0 tokens), where the oracle
    cannot afford io's 10 tokens on q0 -> 0.5, gain 0: the gate does not pass. Anchored at io's budget (10 a run),
    the oracle runs io on q0 and the program on q1: 1.0 at 5 tokens a run."""
    probe = _config(tmp_path, server.url, ["io", "cot"])
    q0, q1 = load_benchmark(load_config(probe, ["benchmark.train_split=dev"]).benchmark).items()
    prog = tmp_path / "q1_answer.py"
    prog.write_text(f"async def solve(problem):\n    return {str(q1.reference['answer'])!r}\n")
    path = _config(tmp_path, server.url, ["io", f"program:{prog}"])
    server.reply, server.finish_reason = str(q0.reference["answer"]), "length"
    assert [(r["run_id"], r["stage"], r["done"]) for r in status(path)] == [
        ("h-headroom-baseline-dev-io", "rollout", False), ("h-headroom-baseline-dev-io", "score", False),
        ("h-headroom-baseline-dev-program-q1_answer", "rollout", False),
        ("h-headroom-baseline-dev-program-q1_answer", "score", False)]
    s = run_headroom(path, in_process)
    after = status(path)  # every stage done, each round's workflows read from its rollout: 2 queries x 2 runs
    assert [(r["done"], r["workflows"]) for r in after] == [(True, 4)] * 4
    assert s.design_runs == {"io": "h-headroom-baseline-dev-io",
                             "program-q1_answer": "h-headroom-baseline-dev-program-q1_answer"}
    assert (s.queries, s.reps, s.dropped) == (2, 2, [])
    d = {r.name: r for r in s.designs}
    assert (d["io"].score, d["io"].tokens, d["io"].truncated_share) == (0.5, 10.0, 1.0)
    assert (d["program-q1_answer"].score, d["program-q1_answer"].tokens) == (0.5, 0.0)
    assert d["program-q1_answer"].truncated_share is None  # no executor call: nothing to share
    assert s.best.name == "program-q1_answer" and s.oracle.score == 0.5 and not s.passes
    at = {o.anchor: o for o in s.frontier}
    assert (at["io"].score, at["io"].tokens, at["io"].budget) == (1.0, 5.0, 10.0)
    out = Path(s.results)
    assert out == tmp_path / "store" / "headroom" / "h"
    stored = json.loads((out / "headroom.json").read_text())
    assert stored["gain"] == 0.0 and stored["designs"][0]["truncated_share"] == 1.0
    assert list(stored)[:6] == ["run_id", "config", "sets", "split", "design_runs", "dropped"]
    # the record reads back what it wrote (the file is written before the study knows where it is: no `results`)
    assert HeadroomReport.read(out / "headroom.json") == dataclasses.replace(s, results=None)
    assert stored["gate_on"] == "learnable" and stored["learnable"]["folds"] == 2  # 2 queries: one a fold
    assert pl.read_csv(out / "designs.csv").height == 2 and pl.read_csv(out / "per_query.csv").height == 8
    assert (out / "frontier.png").stat().st_size > 0
    # the readers: the design runs' summaries and round stats carry the share of calls cut at the cap
    st = Store(tmp_path / "store")
    assert eval_summary(st, "h-headroom-baseline-dev-io").truncated_share == 1.0
    assert round_stats(st, "h-headroom-baseline-dev-io")["truncated_share"].to_list() == [1.0]
    # resumes: nothing runs again, and with every design scored no executor server starts (a vLLM start is minutes)
    before = len(server.requests)
    monkeypatch.setattr(headroom_study, "sharing", lambda *a: pytest.fail("a server started for a finished study"))
    assert run_headroom(path, in_process).oracle == s.oracle and len(server.requests) == before


def test_headroom_needs_two_designs_and_two_runs(tmp_path):
    path = _config(tmp_path, "http://127.0.0.1:9/v1", ["io"])
    with pytest.raises(ConfigError, match="1 design"):
        run_headroom(path, in_process)
    with pytest.raises(ConfigError, match="--reps 1"):
        run_headroom(path, in_process, reps=1)
    with pytest.raises(ConfigError, match="unknown budget rule 'best'"):
        load_config(path, ["headroom.budget_rule=best"])


# ---- truncation: what the executor says, and stores written before it ---------------------------------------


def test_openai_executor_counts_replies_cut_at_the_cap(server):
    ex = executor(server.url)
    server.finish_reason = "length"
    assert asyncio.run(ex.complete([{"role": "user", "content": "x"}], temperature=0.7, n=3)).truncated == 3
    # greedy: asked once, the answer repeated n times, and so is its verdict
    assert asyncio.run(ex.complete([{"role": "user", "content": "x"}], temperature=0.0, n=2)).truncated == 2
    server.finish_reason = "stop"
    assert asyncio.run(ex.complete([{"role": "user", "content": "x"}])).truncated == 0


def test_truncated_share_is_null_for_a_store_written_before_the_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    st = Store(tmp_path)
    st.write("generations", [dict(gen_id="g", kind="workflow", query_id="q", slot=0, text="x", valid=True)], "old", 0)
    # a scores part without truncated_calls, as older code wrote it
    part = st.run_dir("old") / "round=0" / "scores"
    part.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["old"], "gen_id": ["g"], "query_id": ["q"], "rep": [0], "attempt": [0],
                             "status": ["ok"], "score": [1.0], "llm_calls": [2]}), part / "part-old.parquet")
    assert round_stats(st, "old")["truncated_share"].to_list() == [None]
    st.write("scores", [dict(gen_id="g", query_id="q", rep=1, attempt=0, status="ok", score=0.0, llm_calls=4,
                             truncated_calls=1)], "old", 0)
    # the known calls only: 1 of 4 (the old part's 2 calls left out of the denominator)
    assert round_stats(st, "old")["truncated_share"].to_list() == [0.25]


# ---- the menu's designs ----------------------------------------------------------------------------------------

PROGRAMS = Path(__file__).resolve().parents[1] / "configs" / "programs"
MENUS = {name: load_config(Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml").rollout.example_menu
         for name in ("gsm-menu", "humaneval-menu", "mixed-learn")}


@pytest.mark.parametrize("config", sorted(MENUS))
def test_every_menu_design_is_its_fixed_program(config, monkeypatch):
    """A menu design's example is its program file without comments: the same program (AST) run as a reference."""
    monkeypatch.chdir(PROGRAMS.parents[1])
    assert len(MENUS[config]) >= 4
    for path in MENUS[config]:
        d = load_design(path)
        text = Path(path).read_text()
        assert check_workflow(d.code) is None and check_workflow(text) is None, path
        assert program_key(d.code) == program_key(text) and "# noqa" not in d.code, path
        assert d.note and d.name == Path(path).stem
        assert f"program:{path}" in load_config(f"configs/{config}.yaml").experiment.references


def test_design_file_parsing_and_prompt(tmp_path):
    f = tmp_path / "vote.py"
    f.write_text("# a header comment\n# design: sample and vote\n# ruff: noqa: F821\nimport re\n\n\n"
                 "async def solve(problem):\n    r = await llm(problem, n=3)  # noqa: F821 (helper)\n"
                 "    return r[0]\n")
    d = load_design(str(f))
    assert d.name == "vote" and d.note == "sample and vote"
    assert d.code == "import re\n\n\nasync def solve(problem):\n    r = await llm(problem, n=3)\n    return r[0]"
    assert design_prefix(d, 1) == \
        "```python\nimport re\n\n\nasync def solve(problem):\n    r = await llm(problem, n=3)\n"
    assert design_prefix(d, 0).endswith("async def solve(problem):\n")
    assert menu_listing([d, d]) == "- vote: sample and vote\n- vote: sample and vote"
    prompt = workflow_prompt("What is 2+2?", "procedural", design=d, menu=[d],
                             prompt_dir=str(PROGRAMS.parent / "prompts" / "word-menu"))
    assert "Example workflow (sample and vote):" in prompt and "- vote: sample and vote" in prompt
    assert d.code in prompt and "What is 2+2?" in prompt
    bad = tmp_path / "bad.py"
    bad.write_text("async def solve(problem):\n    return ''\n")
    with pytest.raises(PromptError, match="has no `# design: <what it does>` line"):
        load_design(str(bad))
    with pytest.raises(PromptError, match="is not a file"):
        load_design(str(tmp_path / "missing.py"))


def test_design_draws_are_fixed_by_query_slot_and_menu_seed():
    draws = [draw_design(0, "q7", s, 4) for s in range(40)]
    assert draws == [draw_design(0, "q7", s, 4) for s in range(40)]  # no hidden state
    assert set(draws) == {0, 1, 2, 3}  # 40 slots reach every design of 4
    # the menu seed (not the generator's) moves them
    assert [draw_design(1, "q7", s, 4) for s in range(40)] != draws
    with pytest.raises(ValueError, match="a menu of 0 designs"):
        draw_design(0, "q", 0, 0)


def test_nearest_design():
    menu = {"io": "async def solve(problem):\n    return (await llm(problem))[0]\n",
            "vote": "async def solve(problem):\n    r = await llm(problem, temperature=0.7, n=5)\n"
                    "    return max(r, key=r.count)\n"}
    # the same program with a comment and other layout: identical tokens
    assert nearest_design("async def solve(problem):  # hi\n\n    return (await llm(problem))[0]", menu) == ("io", 1.0)
    assert nearest_design("import math\nx = math.pi\n", menu)[0] == OTHER
    # 5 tokens shared of 5 and 7: 2 * 5 / 12
    assert similarity("a b c d e", "a b c d e f g") == pytest.approx(10 / 12)
    with pytest.raises(ValueError, match="empty menu"):
        nearest_design("x", {})


def test_design_span_and_shares_sql_by_hand(tmp_path):
    """Round 0: q1's workflows follow designs a and b (spans), q2's only a; round 1: q1 only a, q2 a and other.
    Span shares 1/2 and 1/2; written shares in round 0: a 3/4, b 1/4; shown (example) b 2/4, a 2/4."""
    from pipeline.store.views import design_spread

    st = Store(tmp_path)
    rows = {0: [("q1", "a", "a"), ("q1", "b", "b"), ("q2", "a", "b"), ("q2", "a", "a")],
            1: [("q1", "a", "a"), ("q1", "a", "b"), ("q2", "a", "a"), ("q2", "other", "b")]}
    for rnd, rs in rows.items():
        st.write("generations", [dict(gen_id=f"g{rnd}{i}", kind="workflow", query_id=q, slot=i, text="x", valid=True,
                                      design=d, example=e) for i, (q, d, e) in enumerate(rs)], "m", rnd)
    span, shares = design_spread(st, "m")
    assert span.select("round", "queries", "spanning_share", "designs_per_query").rows() == \
        [(0, 2, 0.5, 1.5), (1, 2, 0.5, 1.5)]
    r0 = {d: (w, s) for _, d, w, s in shares.filter(pl.col("round") == 0).rows()}
    assert r0 == {"a": (0.75, 0.5), "b": (0.25, 0.5)}
    r1 = {d: (w, s) for _, d, w, s in shares.filter(pl.col("round") == 1).rows()}
    assert r1 == {"a": (0.75, 0.5), "other": (0.25, 0.0), "b": (0.0, 0.5)}
