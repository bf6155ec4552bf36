"""Rollout modes, registered by name (as objectives are in `pipeline.core.objectives`): what each stage does for
`rollout.mode`. A mode names its rollout, score and curate functions as "module:function", imported only in the
process that runs them, so a stage module never imports a mode's module (no import circles, no `if mode ==`
branches in the stages) and a new mode is one `register_mode` call.

Contracts (ctx: `pipeline.run.RunContext`):
    rollout(ctx, sampler, bench) -> counts    sampler: `pipeline.stages.rollout.Sampler`, bench: the `Benchmark`
    score(ctx, only_failed, shard) -> counts  shard: a `pipeline.stages.Shard` or None (only when `shardable`)
    curate(ctx, generation_scores) -> (groups rows, counts)  generation_scores: `pipeline.stages.curate.load_round(ctx)`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.stages import resolve


@dataclass(frozen=True)
class RolloutMode:
    name: str
    rollout: str  # "module:function": the mode's sampling loop over the round's queries
    score: str  # "module:function": how the round's workflows get their `scores` rows
    curate: str  # "module:function": the round's `groups` rows
    evaluated_as: str  # the mode held-out evaluation samples in (refine: flat, its feedback reads gold answers)
    shardable: bool = True  # the score stage may be split into shards by query
    objective_kinds: tuple[str, ...] | None = None  # the `groups` kinds curation writes (what objectives can train);
    # None: every kind (pipeline.core.objectives.KINDS)
    selection: bool = False  # evaluation adds the two-level inference rule's Sel@L (pipeline.core.selection)

    def function(self, step: str) -> Callable:
        return resolve(getattr(self, step))


MODES: dict[str, RolloutMode] = {}


def register_mode(mode: RolloutMode) -> RolloutMode:
    if mode.name in MODES:
        raise ValueError(f"rollout mode {mode.name!r} is already registered")
    MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> RolloutMode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown rollout mode {name!r}; registered: {', '.join(MODES)}") from None


# SPOGW: m workflows per query, C(m,n) groups, screening and sharpening.
register_mode(RolloutMode("flat", rollout="pipeline.stages.rollout:sample_round",
                          score="pipeline.stages.score:score_workflows", curate="pipeline.stages.curate:flat_rows",
                          evaluated_as="flat"))
# The two-level proposal: agent plans, then workflows under each plan; agent and workflow groups only.
register_mode(RolloutMode("two_level", rollout="pipeline.stages.rollout:sample_round",
                          score="pipeline.stages.score:score_workflows", curate="pipeline.stages.curate:two_level_rows",
                          evaluated_as="two_level", objective_kinds=("group",), selection=True))
# W4S: T refinement turns of K candidates per task, scored by the rollout's own validation runs, RLAO rewards.
register_mode(RolloutMode("refine", rollout="pipeline.stages.refine:run_refine",
                          score="pipeline.stages.refine:score_refine", curate="pipeline.stages.refine:curate_refine",
                          evaluated_as="flat", shardable=False))
