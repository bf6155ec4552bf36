"""The stages of a round as data, and the one runner that runs any of them (`pipeline.stages.runner`).

A stage's work is a function `fn(ctx, **options) -> counts` in its own module (`pipeline/rollout.py`,
`scoring.py`, `curate.py`, `train.py`) that reads the store, calls the pure cores and writes the store, ending
with `ctx.finish(name, **counts)` once the round's work for it is complete. Everything around that (skipping a
finished stage, discarding what an unfinished attempt left, the child process, transient vs permanent failures,
retries, timings) is the runner's, the same for every stage and for the Prefect and the `pipeline run` paths.

Importing this package is cheap: a stage's module (torch, vLLM) is imported only where the stage runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

StageFn = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Stage:
    name: str
    fn: str | StageFn  # "module:function", imported in the process that runs the stage
    isolated: bool = False  # loads a model: runs in a child process, so its memory is freed when it ends
    discard: tuple[str, ...] = ()  # tables an attempt that died before its manifest leaves: removed before the
    # next attempt (a stage that resumes its own rows, like rollout per slot and scoring per run, lists none)
    checkpoint: bool = False  # writes the round's adapter: complete only with it; an unfinished one is removed
    options: tuple[str, ...] = ()  # keyword options the stage function takes (e.g. score's only_failed)
    left_hint: str = ""  # how to finish a stage that returned with work left

    def function(self) -> StageFn:
        if callable(self.fn):
            return self.fn
        module, _, name = self.fn.partition(":")
        return getattr(importlib.import_module(module), name)

    def done(self, ctx) -> bool:
        """The manifest is written for the run's frozen config (and the checkpoint is whole, if it makes one)."""
        return ctx.done(self.name) and (not self.checkpoint or ctx.store.checkpoint_complete(ctx.run_id, ctx.round))


# In round order. `pipeline.evaluate.EVAL_STAGES` is the evaluation run's subset.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("rollout", "pipeline.rollout:run_rollout", isolated=True),
    # scoring with the local executor loads a model too
    Stage("score", "pipeline.scoring:run_scoring", isolated=True, options=("only_failed",),
          left_hint="executor errors: once it is back, score/rescore (or `pipeline score --only-failed`) re-runs them"),
    Stage("curate", "pipeline.curate:run_curate", discard=("groups",)),
    Stage("train", "pipeline.train:run_train", isolated=True, discard=("train_metrics", "checkpoints"),
          checkpoint=True),
)}
ROUND_STAGES = tuple(STAGES)


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name]
