"""Exemplars for generator prompts (DESIGN.md §6): pools are SQL over earlier rounds of the store, the pick is
bucket sampling.

Pick: bucket the pool F/M/S (`pipeline.curate.assign_buckets`), weight the buckets present by
softmax((bucket mean − pool mean) / τ) with τ = tau × tau_decay^round, draw two distinct buckets by those
weights, one member uniformly from each (one exemplar when the pool has a single bucket; none when empty).

Pools (same run, rounds < k, score = mean over reps of `latest_scores`):
- agents: plans with r_i = mean of their workflows' scores ≥ r_min_agent; the same query's, else all.
- workflows: r_ij ≥ r_min_workflow, keyed by their agent's plan text (a plan sampled again in a later round
  finds the workflows written under it), falling back to the same query's workflows, then the run's, then none.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.curate import assign_buckets
from pipeline.prompting import Shown
from pipeline.store import Store
from pipeline.workflow import extract_code


def tau_at(tau: float, decay: float, round: int) -> float:
    """Annealed softmax temperature of round `round`."""
    return tau * decay**round


def bucket_weights(scores: Sequence[float], buckets: Sequence[str], tau: float) -> dict[str, float]:
    """Softmax over the buckets present of (bucket mean − overall mean) / τ."""
    if not scores:
        return {}
    mean = sum(scores) / len(scores)
    members: dict[str, list[float]] = defaultdict(list)
    for s, b in zip(scores, buckets, strict=True):
        members[b].append(s)
    logits = {b: (sum(v) / len(v) - mean) / tau for b, v in members.items()}
    top = max(logits.values())
    exp = {b: math.exp(x - top) for b, x in logits.items()}
    total = sum(exp.values())
    return {b: e / total for b, e in sorted(exp.items())}


def _draw(weights: dict[str, float], rng: random.Random) -> str:
    u, acc = rng.random() * sum(weights.values()), 0.0
    for b, w in weights.items():
        acc += w
        if u < acc:
            return b
    return next(reversed(weights))


def pick_exemplars(pool: Sequence[Shown], tau: float, rng: random.Random) -> list[Shown]:
    """Two exemplars from two distinct buckets drawn by `bucket_weights`, one member uniformly from each."""
    if not pool:
        return []
    buckets = assign_buckets([s.score for s in pool])
    weights = bucket_weights([s.score for s in pool], buckets, tau)
    picked: list[Shown] = []
    for _ in range(min(2, len(weights))):
        b = _draw(weights, rng)
        del weights[b]
        picked.append(rng.choice([s for s, bb in zip(pool, buckets, strict=True) if bb == b]))
    return picked


@dataclass
class Pools:
    agents_by_query: dict[str, list[Shown]] = field(default_factory=dict)
    workflows_by_plan: dict[str, list[Shown]] = field(default_factory=dict)
    workflows_by_query: dict[str, list[Shown]] = field(default_factory=dict)
    agents: list[Shown] = field(default_factory=list)
    workflows: list[Shown] = field(default_factory=list)

    def agent_pool(self, query_id: str) -> list[Shown]:
        return self.agents_by_query.get(query_id) or self.agents

    def workflow_pool(self, query_id: str, plan: str | None = None) -> list[Shown]:
        by_plan = self.workflows_by_plan.get(plan.strip()) if plan else None
        return by_plan or self.workflows_by_query.get(query_id) or self.workflows


# Scored workflows (their `generation_scores` score) and agents (the mean of their workflows') of rounds < $round.
_POOL_SQL = """
WITH w AS (
    SELECT s.gen_id, s.parent_id, s.query_id, g.text, s.score
    FROM generation_scores s JOIN generations g USING (run_id, round, gen_id)
    WHERE s.run_id = $run AND s.round < $round AND s.kind = 'workflow' AND s.score IS NOT NULL
)
SELECT 'workflow' AS kind, w.gen_id, w.query_id, w.text, w.score, a.text AS plan FROM w
LEFT JOIN (SELECT gen_id, text FROM generations WHERE run_id = $run AND round < $round AND kind = 'agent') a
    ON a.gen_id = w.parent_id
UNION ALL
SELECT 'agent', a.gen_id, a.query_id, any_value(a.text), avg(w.score), NULL
FROM generations a JOIN w ON w.parent_id = a.gen_id
WHERE a.run_id = $run AND a.round < $round AND a.kind = 'agent'
GROUP BY a.gen_id, a.query_id
ORDER BY 1, 2
"""


def load_pools(store: Store, run_id: str, round: int, r_min_agent: float = 0.0, r_min_workflow: float = 0.0) -> Pools:
    """Exemplar pools of round `round` from rounds < round of the same run (empty at round 0)."""
    pools = Pools()
    if round == 0:
        return pools
    df = store.sql(_POOL_SQL, {"run": run_id, "round": round})
    for kind, gen_id, query_id, text, score, plan in df.iter_rows():
        if kind == "agent" and score >= r_min_agent:
            shown = Shown(gen_id, float(score), (text or "").strip())
            pools.agents.append(shown)
            pools.agents_by_query.setdefault(query_id, []).append(shown)
        elif kind == "workflow" and score >= r_min_workflow:
            shown = Shown(gen_id, float(score), extract_code(text or ""))
            pools.workflows.append(shown)
            pools.workflows_by_query.setdefault(query_id, []).append(shown)
            if plan:
                pools.workflows_by_plan.setdefault(plan.strip(), []).append(shown)
    return pools
