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
- **Replay** (`replays`, `in_sample_only`): an executor at temperature 0 whose second run replays the first from the
  reply cache gives every design the same scores on every run, and then choosing on run r and scoring on r' is
  choosing and scoring on the same numbers: the "cross-fitted" oracle is the in-sample one. Per design, the share of
  queries whose runs all scored the same (and whose runs also spent the same executor tokens: with 0/1 scores a design
  that fails a query twice scores the same by chance, the same tokens as well rarely).
- **Learnable room** (`learnable_room`, `part_room`): what a router fitted on OTHER queries reaches over the best
  single design. The queries are dealt into k folds (`fold_labels`, each part spread over the folds); for every fold
  the router is fitted on the other folds and routes the fold's queries, and the best single design is chosen on the
  same other folds (`best_design` there) and scored on the same held-out queries: neither sees the held-out fold, so
  their per-query differences (scores are each query's mean over its runs) are a fair paired comparison and a
  bootstrap over queries gives them an interval. The oracle chooses on the scores it is judged on (in sample, or
  cross-fitted over runs only): an upper bound no router reaches; the learnable room is what one did reach.
  The learned router is a `Predict` (a classifier over the query's text: pipeline.studies.router), with one of
  `settings` (its regularisation, its features) chosen inside the fit folds: each setting routes each inner fold (one
  of the other folds) fitted on the rest of them, and the best mean routed score wins (ties: the earlier setting);
  with fewer than two inner folds, the first setting. Not budget-bound: both sides' tokens are reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import permutations

import numpy as np

from pipeline.core.router import part_choice, route

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


# ---- replays and the learnable room (module doc) -----------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """One design's runs: the share of queries on which all its runs scored the same (`same_scores`), and on which
    they also spent the same executor tokens (`same_runs`)."""

    design: str
    same_scores: float
    same_runs: float


def replays(runs: Runs) -> list[Replay]:
    """Per design, how often its runs on a query are identical (module doc)."""
    same_scores = (runs.scores == runs.scores[:, :, :1]).all(axis=2)  # (D, Q)
    same_tokens = (runs.tokens == runs.tokens[:, :, :1]).all(axis=2)
    return [Replay(d, float(same_scores[i].mean()), float((same_scores[i] & same_tokens[i]).mean()))
            for i, d in enumerate(runs.designs)]


def in_sample_only(runs: Runs) -> bool:
    """Every design's runs scored the same on every query: the cross-fitted oracle is then the in-sample one."""
    return all(r.same_scores == 1.0 for r in replays(runs))


def fold_labels(parts: Sequence[str], folds: int, seed: int = 0) -> np.ndarray:
    """Each query's fold, 0 .. folds-1: part by part (sorted by name), the part's queries in a seeded random order
    dealt round robin, carrying on from where the previous part stopped, so every fold holds about its share of
    every part and the folds' sizes differ by at most one."""
    if not 2 <= folds <= len(parts):
        raise ValueError(f"fold_labels: {folds} folds for {len(parts)} queries; need 2 <= folds <= queries")
    rng = np.random.default_rng(seed)
    labels = np.empty(len(parts), dtype=int)
    dealt = 0
    for part in sorted(set(parts)):
        for q in rng.permutation([i for i, p in enumerate(parts) if p == part]):
            labels[q] = dealt % folds
            dealt += 1
    return labels


Predict = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
"""(fit queries, target queries, setting) -> (targets, designs): each design's predicted chance of solving each target
query, from a classifier fitted on the fit queries alone (indices into the runs' queries) with setting number
`setting`."""


@dataclass(frozen=True)
class Room:
    """A router scored only on queries it was not fitted on (module doc): its mean score and executor tokens per run
    over all queries (each held out once), the same for the best single design chosen on the same fit folds,
    `differences` per query (router - that design; their mean is `gain`), the share of queries routed to each design,
    the share held out under each fold-best design, and each fold's setting (index into the settings)."""

    name: str
    score: float
    tokens: float
    best_score: float
    best_tokens: float
    differences: np.ndarray
    folds: int
    chosen: dict[str, float]
    best_chosen: dict[str, float]
    settings: tuple[int, ...] = ()

    @property
    def gain(self) -> float:
        return float(self.differences.mean())


def _subset(runs: Runs, queries: np.ndarray) -> Runs:
    return Runs(runs.designs, tuple(runs.queries[i] for i in queries), runs.scores[:, queries], runs.tokens[:, queries])


def _room(name: str, runs: Runs, folds: np.ndarray, choose: Callable[[np.ndarray, np.ndarray], np.ndarray],
          settings: tuple[int, ...] = ()) -> Room:
    """Route every fold's queries with `choose(fit, held)` (design per held-out query) and compare with the design
    best on the fit folds, both scored on the held-out queries (means over runs)."""
    scores, tokens = runs.scores.mean(axis=2), runs.tokens.mean(axis=2)
    choice = np.zeros(len(runs.queries), dtype=int)
    best = np.zeros_like(choice)
    for fold in np.unique(folds):
        held, fit = np.flatnonzero(folds == fold), np.flatnonzero(folds != fold)
        choice[held] = choose(fit, held)
        best[held] = best_design(_subset(runs, fit))
    cols = np.arange(len(runs.queries))

    def shares(picks: np.ndarray) -> dict[str, float]:
        counts = np.bincount(picks, minlength=len(runs.designs))
        return {d: float(counts[i] / len(picks)) for i, d in enumerate(runs.designs) if counts[i]}

    return Room(name, float(scores[choice, cols].mean()), float(tokens[choice, cols].mean()),
                float(scores[best, cols].mean()), float(tokens[best, cols].mean()),
                scores[choice, cols] - scores[best, cols], len(np.unique(folds)), shares(choice), shares(best),
                settings)


def learnable_room(runs: Runs, folds: np.ndarray, predict: Predict, settings: int = 1) -> Room:
    """The learned router cross-fitted over query folds against the best single design chosen on the same fit folds;
    the router's setting chosen inside the fit folds (module doc). `folds`: each query's fold (`fold_labels`)."""
    if len(folds) != len(runs.queries):
        raise ValueError(f"learnable_room: {len(folds)} fold labels for {len(runs.queries)} queries")
    if settings < 1:
        raise ValueError(f"learnable_room: {settings} settings; need at least one")
    scores, tokens = runs.scores.mean(axis=2), runs.tokens.mean(axis=2)
    chosen: list[int] = []

    def routed(fit: np.ndarray, held: np.ndarray, setting: int) -> np.ndarray:
        return route(predict(fit, held, setting), tokens[:, fit].mean(axis=1))

    def setting_for(fit: np.ndarray) -> int:
        inner = np.unique(folds[fit])
        if settings == 1 or len(inner) < 2:
            return 0
        totals = []
        for setting in range(settings):
            total = 0.0
            for fold in inner:
                held, rest = fit[folds[fit] == fold], fit[folds[fit] != fold]
                total += scores[routed(rest, held, setting), held].sum()
            totals.append(total)
        return int(np.argmax(totals))  # argmax keeps the first of equals

    def choose(fit: np.ndarray, held: np.ndarray) -> np.ndarray:
        chosen.append(setting_for(fit))
        return routed(fit, held, chosen[-1])

    return replace(_room("learned_router", runs, folds, choose), settings=tuple(chosen))


def part_room(runs: Runs, parts: Sequence[str], folds: np.ndarray) -> Room:
    """The per-part router (one design per part, reading the part label: pipeline.core.router.part_choice) fitted
    on the other folds, against the best single design chosen on them; a held-out query whose part has no query in
    the fit folds gets that best design."""
    if not len(parts) == len(folds) == len(runs.queries):
        raise ValueError(f"part_room: {len(parts)} parts and {len(folds)} fold labels for {len(runs.queries)} queries")
    scores, tokens = runs.scores.mean(axis=2), runs.tokens.mean(axis=2)
    labels = np.array(parts, dtype=object)

    def choose(fit: np.ndarray, held: np.ndarray) -> np.ndarray:
        by_part = part_choice(scores[:, fit], tokens[:, fit], list(labels[fit]))
        fallback = best_design(_subset(runs, fit))
        return np.array([by_part.get(p, fallback) for p in labels[held]], dtype=int)

    return _room("part_router", runs, folds, choose)
