"""Per-query routers over a menu of designs, pure: the choices each makes, from scores every design got on the same
queries. The references a trained generator that chooses its own design is measured against:

- **Learned router** (`route`): per query the design with the highest predicted chance of solving it (a classifier
  over the query's text, fitted on train scores: pipeline.studies.router); ties: the design cheaper in mean
  executor tokens on train, then the earlier.
- **Per-part router** (`part_choice`): one design per part (e.g. a reasoning-gym family), the best mean score over
  the part's train queries; ties: fewer mean tokens there, then the earlier design. It reads the part label, which
  the query's text does not give a workflow.
- **Per-query oracle** (`oracle_choice`): per query the design that scored best on that very query (ties: fewer
  tokens, then the earlier design): the ceiling of any router, chosen on the scores it is judged on.

Inputs are arrays over (designs, queries): `scores` (a design's mean score on the query over its runs) and
`tokens` (its mean executor tokens). Outputs are design indices per query (or per part).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SOLVED = 0.5  # a design solves a query when its mean score there reaches this: the classifier's label


def _best(values: np.ndarray, tokens: np.ndarray) -> int:
    """The index of the highest value; ties: the fewest tokens, then the lowest index."""
    top = values.max()
    tied = np.flatnonzero(np.isclose(values, top))
    return int(tied[np.argmin(tokens[tied])])  # argmin keeps the first of equals


def oracle_choice(scores: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Per query, the design with the best score there (ties: fewer tokens there, then the earlier design)."""
    _check(scores, tokens)
    return np.array([_best(scores[:, q], tokens[:, q]) for q in range(scores.shape[1])], dtype=int)


def part_choice(scores: np.ndarray, tokens: np.ndarray, parts: Sequence[str]) -> dict[str, int]:
    """Per part, the design with the best mean score over the part's queries (ties: fewer mean tokens there, then
    the earlier design)."""
    _check(scores, tokens)
    if len(parts) != scores.shape[1]:
        raise ValueError(f"part_choice: {len(parts)} parts for {scores.shape[1]} queries")
    out = {}
    for part in sorted(set(parts)):
        cols = [i for i, p in enumerate(parts) if p == part]
        out[part] = _best(scores[:, cols].mean(axis=1), tokens[:, cols].mean(axis=1))
    return out


def route(chance: np.ndarray, design_tokens: np.ndarray) -> np.ndarray:
    """Per query (rows of `chance`: queries x designs, each design's predicted chance of solving it), the design with
    the highest chance; ties: fewer mean executor tokens (`design_tokens`, one per design), then the earlier."""
    if chance.ndim != 2 or chance.shape[1] != len(design_tokens):
        raise ValueError(f"route: chances of shape {chance.shape} for {len(design_tokens)} designs")
    return np.array([_best(row, design_tokens) for row in chance], dtype=int)


def solved(scores: np.ndarray) -> np.ndarray:
    """The classifier's labels: whether each design's mean score on each query reaches SOLVED (designs x queries)."""
    return scores >= SOLVED


def _check(scores: np.ndarray, tokens: np.ndarray) -> None:
    if scores.ndim != 2 or scores.shape != tokens.shape or 0 in scores.shape:
        raise ValueError(f"router: scores {scores.shape} and tokens {tokens.shape}: need the same (designs, queries)")
