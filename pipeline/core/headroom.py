"""Headroom before training, pure: is there a per-query choice of design that beats the best single design
at the same executor budget?

Input: every design of a menu run R >= 2 times as a fixed program on every query of a split: scores s[d, q, r] and
executor tokens t[d, q, r] (`Runs`).

- **Best single design** (`best_design`): the highest mean score over queries and runs; ties: fewer mean tokens, then
  the earlier design. Chosen and scored on the same runs, so it is, if anything, flattered: the gate below is
  conservative.
- **Per-query oracle, cross-fitted** (`cross_fit`): for every ordered pair of runs (r, r'), r != r', a design is
  chosen per query from run r's scores and tokens (a budget rule) and scored with run r''s score and tokens of that
  design on that query; the result is the mean over the R(R-1) pairs. Choosing and scoring on one run would credit the
  oracle with the executor's sampling luck (a design right by chance on run r is picked because it was right); on
  another run that luck is gone.
- **Equal budget**: a rule is anchored at one design (the best single one, for the gate) and keeps the choice's mean
  tokens on the choosing run at most the anchor's there. `BUDGET_RULES`, pure functions by name:
  - `greedy`: per query the highest-scoring design (`pick`); then, while the mean tokens exceed the budget, the one
    switch (query q from its design to a cheaper one) that loses the least score per token saved (ties: the larger
    saving, then the earlier query, then the earlier design), applied one at a time. Every all-anchor choice fits, so
    it ends within the budget: a greedy multiple-choice knapsack.
  - `per_query`: per query only designs no dearer there than the anchor, the highest-scoring of them (`pick`).
    Stricter (it never spends a saving made on one query on another).
  `pick` breaks ties: the anchor when it is among the best (leaving the default needs evidence), else the fewest
  tokens, then the earlier design.
- **Frontier** (`frontier`): each design's (mean tokens, mean score), whether no other design is at least as good on
  both and better on one (`pareto`), and the cross-fitted oracle anchored at every design: the score a per-query
  choice reaches at each design's budget.
- **Parts** (`part_router`): with queries from several parts (reasoning-gym families), the router that picks one
  design per part, chosen on run r by its mean score over the part's queries and scored on run r' (cross-fitted as
  the oracle; not budget-bound: its tokens are reported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import permutations

import numpy as np

EPS = 1e-9  # float slack of the budget comparison: means of integer token counts


@dataclass(frozen=True)
class Runs:
    """R runs of D designs on Q queries: `scores` and `tokens` of shape (D, Q, R)."""

    designs: tuple[str, ...]
    queries: tuple[str, ...]
    scores: np.ndarray
    tokens: np.ndarray

    def __post_init__(self):
        d, q = len(self.designs), len(self.queries)
        for name in ("scores", "tokens"):
            a = getattr(self, name)
            if a.ndim != 3 or a.shape[:2] != (d, q):
                raise ValueError(f"Runs.{name}: shape {a.shape}, need ({d} designs, {q} queries, runs)")
        if self.scores.shape != self.tokens.shape:
            raise ValueError(f"Runs: scores {self.scores.shape} and tokens {self.tokens.shape} differ")
        if d == 0 or q == 0:
            raise ValueError("Runs: no design or no query")
        if self.scores.shape[2] < 2:
            raise ValueError(f"Runs: {self.scores.shape[2]} run(s) per design and query; cross-fitting needs 2")

    @property
    def reps(self) -> int:
        return self.scores.shape[2]


@dataclass(frozen=True)
class Point:
    """A design or a choice rule: mean score and mean executor tokens per run (per query), over queries and runs."""

    name: str
    score: float
    tokens: float


@dataclass(frozen=True)
class Oracle:
    """A cross-fitted choice: score and tokens on the scoring runs, the anchor's budget on the choosing runs (mean
    over pairs), and how often each design was chosen (share of query x pair)."""

    rule: str
    anchor: str
    score: float
    tokens: float
    budget: float
    pairs: int
    chosen: dict[str, float] = field(default_factory=dict)


def pick(scores: np.ndarray, tokens: np.ndarray, anchor: int, allowed: np.ndarray | None = None) -> int:
    """The design to run on one query from one run's `scores` and `tokens` (shape (D,)): the highest score among
    `allowed` (default all); ties: the anchor, else the fewest tokens, else the earliest design."""
    idx = np.arange(len(scores)) if allowed is None else np.flatnonzero(allowed)
    top = scores[idx].max()
    best = [int(d) for d in idx if scores[d] >= top - EPS]
    if anchor in best:
        return anchor
    return min(best, key=lambda d: (tokens[d], d))


def per_query(scores: np.ndarray, tokens: np.ndarray, anchor: int) -> np.ndarray:
    """Per query (columns of (D, Q) arrays) the best design among those no dearer there than the anchor."""
    return np.array([pick(scores[:, q], tokens[:, q], anchor, tokens[:, q] <= tokens[anchor, q] + EPS)
                     for q in range(scores.shape[1])], dtype=int)


def greedy(scores: np.ndarray, tokens: np.ndarray, anchor: int) -> np.ndarray:
    """The per-query best designs, then the cheapest trades (least score lost per token saved) until the mean
    tokens are at most the anchor's (module doc)."""
    n_designs, n_queries = scores.shape
    choice = np.array([pick(scores[:, q], tokens[:, q], anchor) for q in range(n_queries)], dtype=int)
    budget = tokens[anchor].sum()
    spent = tokens[choice, np.arange(n_queries)].sum()
    while spent > budget + EPS * n_queries:
        move = None
        for q in range(n_queries):
            c = choice[q]
            for d in range(n_designs):
                saving = tokens[c, q] - tokens[d, q]
                if saving <= EPS:
                    continue
                key = ((scores[c, q] - scores[d, q]) / saving, -saving, q, d)
                if move is None or key < move[0]:
                    move = (key, q, d)
        if move is None:  # cannot happen: the all-anchor choice fits, so a cheaper design exists somewhere
            raise AssertionError("greedy: over budget with no cheaper design")
        _, q, d = move
        spent -= tokens[choice[q], q] - tokens[d, q]
        choice[q] = d
    return choice


BudgetRule = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
BUDGET_RULES: dict[str, BudgetRule] = {"greedy": greedy, "per_query": per_query}


def design_points(runs: Runs) -> list[Point]:
    """Each design's mean score and mean tokens over queries and runs."""
    return [Point(d, float(runs.scores[i].mean()), float(runs.tokens[i].mean())) for i, d in enumerate(runs.designs)]


def best_design(runs: Runs) -> int:
    """The index of the best single design (module doc)."""
    pts = design_points(runs)
    return min(range(len(pts)), key=lambda i: (-pts[i].score, pts[i].tokens, i))


def choices(runs: Runs, rule: str, anchor: int, in_sample: bool = False) -> list[tuple[int, int, np.ndarray]]:
    """(r, r', the design per query chosen on run r under `rule` anchored at `anchor`) for every ordered pair of runs
    r != r' (in_sample: r' = r): what `cross_fit` and `gain_per_query` score on run r'."""
    if rule not in BUDGET_RULES:
        raise ValueError(f"unknown budget rule {rule!r}; known: {', '.join(BUDGET_RULES)}")
    choose = BUDGET_RULES[rule]
    pairs = [(r, r) for r in range(runs.reps)] if in_sample else list(permutations(range(runs.reps), 2))
    return [(r, r2, choose(runs.scores[:, :, r], runs.tokens[:, :, r], anchor)) for r, r2 in pairs]


def cross_fit(runs: Runs, rule: str, anchor: int, in_sample: bool = False) -> Oracle:
    """The per-query oracle under budget rule `rule` anchored at design `anchor`, chosen on run r and scored on run
    r' for every ordered pair r != r' (in_sample: r' = r, the optimistic upper bound, for comparison only)."""
    made = choices(runs, rule, anchor, in_sample)
    cols = np.arange(len(runs.queries))
    scores, tokens, budgets = [], [], []
    counts = np.zeros(len(runs.designs))
    for r, r2, choice in made:
        scores.append(runs.scores[choice, cols, r2].mean())
        tokens.append(runs.tokens[choice, cols, r2].mean())
        budgets.append(runs.tokens[anchor, :, r].mean())
        counts += np.bincount(choice, minlength=len(runs.designs))
    total = counts.sum()
    return Oracle(rule + (" (in sample)" if in_sample else ""), runs.designs[anchor], float(np.mean(scores)),
                  float(np.mean(tokens)), float(np.mean(budgets)), len(made),
                  {d: float(counts[i] / total) for i, d in enumerate(runs.designs) if counts[i]})


def gain_per_query(runs: Runs, rule: str, anchor: int) -> np.ndarray:
    """Per query, the cross-fitted oracle's score (anchored at `anchor`) minus the anchor design's on the same scoring
    run, averaged over the ordered pairs of runs: the paired differences whose mean is `cross_fit`'s score minus the
    anchor's mean, so that a bootstrap over queries gives the gate's gain an interval."""
    cols = np.arange(len(runs.queries))
    return np.mean([runs.scores[choice, cols, r2] - runs.scores[anchor, :, r2]
                    for _, r2, choice in choices(runs, rule, anchor)], axis=0)


def pareto(points: Sequence[Point]) -> list[bool]:
    """Per point: no other point has at least its score at most its tokens and is better in one of the two."""
    def dominated(p: Point) -> bool:
        return any(o.score >= p.score and o.tokens <= p.tokens and (o.score > p.score or o.tokens < p.tokens)
                   for o in points)
    return [not dominated(p) for p in points]


def frontier(runs: Runs, rule: str) -> list[Oracle]:
    """The cross-fitted oracle anchored at every design: what a per-query choice scores at each design's budget."""
    return [cross_fit(runs, rule, i) for i in range(len(runs.designs))]


def gain_within(points: Sequence[Point], oracle: Oracle) -> float:
    """The oracle's score minus the best design's among those that fit its budget (mean tokens at most the anchor's,
    the anchor itself included): what choosing per query adds over one design for all at that budget. The gate reads
    it at the best design's budget only; along the frontier it shows where the room is when it is in cost."""
    fits = [p.score for p in points if p.tokens <= oracle.budget * (1 + 1e-9)]  # the anchor's mean, up to rounding
    return oracle.score - max(fits)


def part_router(runs: Runs, parts: Sequence[str], anchor: int) -> tuple[Oracle, dict[str, str]]:
    """One design per part, chosen on run r by its mean over the part's queries (ties as `pick`), scored on r'; and
    the choice made on all runs together (part -> design) for the report."""
    if len(parts) != len(runs.queries):
        raise ValueError(f"part_router: {len(parts)} parts for {len(runs.queries)} queries")
    names = sorted(set(parts))
    members = {p: np.array([i for i, x in enumerate(parts) if x == p]) for p in names}

    def choose(scores: np.ndarray, tokens: np.ndarray) -> dict[str, int]:  # (D, Q) of one run, or means over runs
        return {p: pick(scores[:, m].mean(axis=1), tokens[:, m].mean(axis=1), anchor) for p, m in members.items()}

    cols = np.arange(len(runs.queries))
    pairs = list(permutations(range(runs.reps), 2))
    scores, tokens = [], []
    counts = np.zeros(len(runs.designs))
    for r, r2 in pairs:
        by_part = choose(runs.scores[:, :, r], runs.tokens[:, :, r])
        choice = np.array([by_part[p] for p in parts], dtype=int)
        scores.append(runs.scores[choice, cols, r2].mean())
        tokens.append(runs.tokens[choice, cols, r2].mean())
        counts += np.bincount(choice, minlength=len(runs.designs))
    overall = choose(runs.scores.mean(axis=2), runs.tokens.mean(axis=2))
    total = counts.sum()
    oracle = Oracle("part_router", runs.designs[anchor], float(np.mean(scores)), float(np.mean(tokens)),
                    float(runs.tokens[anchor].mean()), len(pairs),
                    {d: float(counts[i] / total) for i, d in enumerate(runs.designs) if counts[i]})
    return oracle, {p: runs.designs[d] for p, d in overall.items()}
