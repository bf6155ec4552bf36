"""Multi-purpose reward (pure): benchmark metric minus weighted complexity and cost penalties.

    score = clip(metric - w_complexity * complexity - w_cost * cost, 0, 1)

- complexity in [0, 1]: half AST size, half helper call sites (`llm(...)` / `run_tests(...)` in the
  source), each saturating at a scale: 0.5 * min(1, nodes / AST_SCALE) + 0.5 * min(1, calls / CALL_SCALE).
- cost in [0, 1]: executor tokens (in + out) of the run, saturating at TOKEN_SCALE.
Weights come from `scoring.reward` (default 0: the score is the metric, as in the paper). All components
are stored, so another weighting can be recomputed from the store without re-running anything.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

AST_SCALE = 2000
CALL_SCALE = 10
TOKEN_SCALE = 20_000
HELPERS = ("llm", "run_tests")


@dataclass(frozen=True)
class RewardParts:
    score: float  # the reward stored as `scores.score`
    metric: float
    complexity: float  # before weighting
    cost: float  # before weighting
    ast_nodes: int
    helper_calls: int


def code_stats(code: str) -> tuple[int, int]:
    """(AST nodes, helper call sites) of a workflow's source; (0, 0) when it does not parse."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return 0, 0
    nodes = calls = 0
    for node in ast.walk(tree):
        nodes += 1
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in HELPERS:
            calls += 1
    return nodes, calls


def complexity_term(ast_nodes: int, helper_calls: int, ast_scale: int = AST_SCALE,
                    call_scale: int = CALL_SCALE) -> float:
    return 0.5 * min(1.0, ast_nodes / ast_scale) + 0.5 * min(1.0, helper_calls / call_scale)


def cost_term(tokens_in: int, tokens_out: int, token_scale: int = TOKEN_SCALE) -> float:
    return min(1.0, (tokens_in + tokens_out) / token_scale)


def combine(metric: float, complexity: float, cost: float, complexity_weight: float = 0.0,
            cost_weight: float = 0.0) -> float:
    return min(1.0, max(0.0, metric - complexity_weight * complexity - cost_weight * cost))


def reward(metric: float, code: str, tokens_in: int, tokens_out: int, complexity_weight: float = 0.0,
           cost_weight: float = 0.0) -> RewardParts:
    nodes, calls = code_stats(code)
    cx, co = complexity_term(nodes, calls), cost_term(tokens_in, tokens_out)
    return RewardParts(combine(metric, cx, co, complexity_weight, cost_weight), metric, cx, co, nodes, calls)
