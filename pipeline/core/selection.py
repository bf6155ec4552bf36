"""Inference-time selection of the two-level proposal (its inference path, `answer_query` in §5): the best agent
of a query, then that agent's best workflow. Pure functions.

Per query, as the proposal means it: `answer_query(q)` samples agents for q, keeps the top one by score, samples
workflows under it and keeps the top one. Plans and workflows are written for one query, so a per-task choice
(one workflow for the whole benchmark, as ADAS or AFlow) would not be the proposal's; its introduction sets the
method apart by a workflow per question. For query q with agents i and their scored workflows r_ij:

    r_i = mean_j r_ij (the agent reward of training, §4.1);  i* = argmax_i r_i;  j* = argmax_j r_{i*j}
    Sel@L(q) = r_{i*j*}   (ties: the first sampled)

Sel@L of a split is the mean over its queries. It lies between the best agent's mean and Best@L (the best of all
L = N_A x N_W workflows). The choice uses the same scores it reports: the proposal scores candidates at inference
with an LLM judge, while a benchmark score needs the reference answer, so Sel@L, like Best@L, is what the rule
would reach with a perfect judge (pipeline.studies.evaluate reports it next to Mean@L and Best@L for two-level runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    query_id: str
    agent_id: str
    agent_reward: float  # r_i* : mean score of the chosen agent's workflows
    workflow_id: str
    score: float  # r_i*j* : the chosen workflow's score (Sel@L of the query)


def select_query(query_id: str, agents: Mapping[str, Sequence[tuple[str, float]]]) -> Selection | None:
    """`agents`: agent id -> [(workflow id, score)], in sampling order. The agent with the highest mean score,
    then its highest-scoring workflow (ties: the first); None when no agent has a scored workflow."""
    best: tuple[str, float, Sequence[tuple[str, float]]] | None = None
    for agent_id, workflows in agents.items():
        if not workflows:
            continue  # an invalid plan, or one whose workflows have no final score yet: nothing to run
        reward = sum(s for _, s in workflows) / len(workflows)
        if best is None or reward > best[1]:
            best = (agent_id, reward, workflows)
    if best is None:
        return None
    workflow_id, score = max(best[2], key=lambda w: w[1])
    return Selection(query_id, best[0], best[1], workflow_id, score)


def select_all(rows: Iterable[Mapping]) -> list[Selection]:
    """`rows`: one per workflow with query_id, parent_id (its agent), gen_id, valid and score (None: no final
    score yet, left out; an invalid workflow scores 0, as in curation). One Selection per query with a scored
    workflow, in first-seen order."""
    tree: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for r in rows:
        score = 0.0 if not r["valid"] else r["score"]
        if score is None or r["parent_id"] is None:
            continue
        tree.setdefault(r["query_id"], {}).setdefault(r["parent_id"], []).append((r["gen_id"], float(score)))
    out = [select_query(q, agents) for q, agents in tree.items()]
    return [s for s in out if s is not None]


def select_at_l(selections: Sequence[Selection]) -> float | None:
    """Mean over queries of the chosen workflow's score (None without a query)."""
    return sum(s.score for s in selections) / len(selections) if selections else None
