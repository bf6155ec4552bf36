"""Multi-purpose reward (pure, FlowReasoner): benchmark metric minus weighted complexity, cost and redundancy penalties.

    score = clip(metric - w_complexity * complexity - w_cost * cost - w_diversity * (1 - diversity), 0, 1)

- complexity in [0, 1]: half AST size, half helper call sites (`llm(...)` / `run_tests(...)` in the
  source), each saturating at a scale: 0.5 * min(1, nodes / AST_SCALE) + 0.5 * min(1, calls / CALL_SCALE).
- cost in [0, 1]: executor tokens (in + out) of the run relative to a budget, min(1, tokens / budget). The budget is
  `scoring.reward.token_budget`, the executor tokens a run of the task is expected to spend (word problems
  and HumanEval runs spend 300-2,500 tokens, so at the legacy TOKEN_SCALE of 20,000, the default when no budget is
  set, a 0.1 weight cost an 800-token run 0.004: nothing a group's advantages could see). With the budget at the
  dearest design's spend, the term ranks every design of the menu: a run at half the budget pays half the weight.
- diversity in (0, 1]: FlowReasoner's diversity, the distinctness ratio (Chen et al. 2024: distinct solutions over
  all solutions) of the workflows sampled for the same prompt, spread over them: a workflow scores 1 / (number of
  the group's workflows that are the same program, itself included), so the group's mean is its distinctness ratio
  and a program no other sample repeats scores 1. It enters as a penalty on redundancy, 1 - diversity, so a
  workflow never scores above its metric (a bonus would pay a wrong but unusual workflow).
Weights come from `scoring.reward` (default 0: the score is the metric, as in the paper). All components
are stored, so another weighting can be recomputed from the store without re-running anything.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Sequence
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
    diversity: float = 1.0  # before weighting


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


def cost_term(tokens_in: int, tokens_out: int, token_budget: int | None = None) -> float:
    """min(1, executor tokens / token_budget); no budget: the legacy scale TOKEN_SCALE (old configs score as before)."""
    budget = TOKEN_SCALE if token_budget is None else token_budget
    if budget <= 0:
        raise ValueError(f"token_budget must be positive, got {budget}")
    return min(1.0, (tokens_in + tokens_out) / budget)


def program_key(code: str) -> str:
    """Two workflows are the same program when their ASTs are (comments and layout aside); unparsable: the text
    with whitespace collapsed."""
    try:
        return ast.dump(ast.parse(code))
    except (SyntaxError, ValueError):
        return " ".join(code.split())


def diversity_terms(codes: Sequence[str]) -> list[float]:
    """Per workflow of one group (the samples of one prompt): 1 / (group members that are the same program)."""
    keys = [program_key(c) for c in codes]
    counts = Counter(keys)
    return [1.0 / counts[k] for k in keys]


def combine(metric: float, complexity: float, cost: float, complexity_weight: float = 0.0,
            cost_weight: float = 0.0, diversity: float = 1.0, diversity_weight: float = 0.0) -> float:
    penalty = complexity_weight * complexity + cost_weight * cost + diversity_weight * (1.0 - diversity)
    return min(1.0, max(0.0, metric - penalty))


def reward(metric: float, code: str, tokens_in: int, tokens_out: int, complexity_weight: float = 0.0,
           cost_weight: float = 0.0, diversity: float = 1.0, diversity_weight: float = 0.0,
           token_budget: int | None = None) -> RewardParts:
    nodes, calls = code_stats(code)
    cx, co = complexity_term(nodes, calls), cost_term(tokens_in, tokens_out, token_budget)
    score = combine(metric, cx, co, complexity_weight, cost_weight, diversity, diversity_weight)
    return RewardParts(score, metric, cx, co, nodes, calls, diversity)
