"""Exemplars for generator prompts (docs/design.md §6): pools are SQL over earlier rounds of the store, the pick is
bucket sampling.

Pick: bucket the pool F/M/S (`pipeline.stages.curate.assign_buckets`), weight the buckets present by
softmax((bucket mean − pool mean) / τ) with τ = tau × tau_decay^round, draw two distinct buckets by those
weights, one member uniformly from each (one exemplar when the pool has a single bucket; none when empty).

Pools (same run, rounds < k, score = mean over reps of `latest_scores`), the proposal's buffers (§4.4):
- D_A, agents: plans with r_i = mean of their workflows' scores ≥ r_min_agent; the same query's, else all
  (plans are written for one query; the proposal keeps one buffer).
- D_W[i], workflows per stored agent i: r_ij ≥ r_min_workflow, keyed by the agent's gen_id. A freshly sampled
  plan has no stored workflows of its own, so its workflows draw from D_W of the stored agent it was conditioned
  on: of the agents its prompt showed, the one with the highest r_i whose D_W is not empty
  (`Pools.buffer_agent`); the prompt shows that agent's plan with them. No such agent: no workflow exemplars.
- flat (SPOGW prompts, when exemplars are on): workflows ≥ r_min_workflow of the same query, else the run's.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.core.curation import assign_buckets
from pipeline.engines.prompting import Shown
from pipeline.engines.workflow import extract_code
from pipeline.store import Store
from pipeline.store.views import POOL_SQL


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
    agents_by_query: dict[str, list[Shown]] = field(default_factory=dict)  # D_A by the query of the plan
    agents: list[Shown] = field(default_factory=list)  # D_A
    agent_scores: dict[str, float] = field(default_factory=dict)  # r_i of every stored agent
    plans: dict[str, str] = field(default_factory=dict)  # stored agent -> its plan text
    workflows_by_agent: dict[str, list[Shown]] = field(default_factory=dict)  # D_W[i]
    workflows_by_query: dict[str, list[Shown]] = field(default_factory=dict)  # flat
    workflows: list[Shown] = field(default_factory=list)  # flat

    def agent_pool(self, query_id: str) -> list[Shown]:
        return self.agents_by_query.get(query_id) or self.agents

    def workflow_pool(self, query_id: str) -> list[Shown]:
        """Flat prompts: the query's workflows, else the run's."""
        return self.workflows_by_query.get(query_id) or self.workflows

    def buffer_agent(self, conditioned_on: Sequence[str]) -> str | None:
        """The stored agent whose D_W supplies a new plan's workflow exemplars: of the agents shown in the plan's
        prompt, the one with the highest r_i (ties: the first shown) that has workflows in D_W; else None."""
        stored = [a for a in conditioned_on if self.workflows_by_agent.get(a)]
        return max(stored, key=lambda a: self.agent_scores[a], default=None)


# Scored workflows (their `generation_scores` score) and agents (the mean of their workflows') of rounds < $round.
def pool_rows(store: Store, run_id: str, round: int) -> list[tuple]:
    """(kind, gen_id, query_id, text, score, agent_id) of the scored generations of rounds < round: workflows with
    their score and agent (null when flat), agents with r_i = the mean of their workflows' scores."""
    return list(store.sql(POOL_SQL, {"run": run_id, "round": round}, run=run_id).iter_rows())


def load_pools(store: Store, run_id: str, round: int, r_min_agent: float = 0.0, r_min_workflow: float = 0.0) -> Pools:
    """Exemplar pools of round `round` from rounds < round of the same run (empty at round 0)."""
    pools = Pools()
    if round == 0:
        return pools
    for kind, gen_id, query_id, text, score, agent_id in pool_rows(store, run_id, round):
        if kind == "agent":
            pools.agent_scores[gen_id], pools.plans[gen_id] = float(score), (text or "").strip()
            if score >= r_min_agent:
                shown = Shown(gen_id, float(score), (text or "").strip())
                pools.agents.append(shown)
                pools.agents_by_query.setdefault(query_id, []).append(shown)
        elif score >= r_min_workflow:
            shown = Shown(gen_id, float(score), extract_code(text or ""))
            if agent_id:
                pools.workflows_by_agent.setdefault(agent_id, []).append(shown)
            else:
                pools.workflows.append(shown)
                pools.workflows_by_query.setdefault(query_id, []).append(shown)
    return pools
