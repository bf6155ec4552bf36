"""The stages of a round as data, and the one runner that runs any of them (`pipeline.stages.runner`).

A stage's work is a function `fn(ctx, **options) -> counts` in its own module (`pipeline/stages/rollout.py`,
`scoring.py`, `curate.py`, `train/`) that reads the store, calls the pure cores and writes the store, ending
with `ctx.finish(name, **counts)` once the round's work for it is complete. Everything around that (skipping a
finished stage, discarding what an unfinished attempt left, the child process, transient vs permanent failures,
retries, timings) is the runner's, the same for every stage and for the Prefect and the `pipeline run` paths.

A stage that lists a `merge` function can be split into shards by query (`Shard`): each shard's call works on its
own queries only and ends with the shard's manifest (`ctx.finish(shard.manifest(name))`); once every shard has one,
the merge writes the stage's own manifest from the store (`pipeline.stages.runner.finish_shards`).

Importing this package is cheap: a stage's module (torch, vLLM) is imported only where the stage runs.
"""

from __future__ import annotations

import importlib
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

StageFn = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` of a round's work, split by a stable hash of the query id, so that every process and
    every re-run (with the same count) agrees on which queries are whose."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and isinstance(self.index, int)) or self.count < 1:
            raise ValueError(f"shard count must be an integer >= 1, got {self.count!r}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} out of range for {self.count} shards (0..{self.count - 1})")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`INDEX/COUNT`, e.g. `1/4`."""
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if m is None:
            raise ValueError(f"bad shard {text!r}: expected INDEX/COUNT, e.g. 0/4")
        return cls(int(m[1]), int(m[2]))

    def owns(self, query_id: str) -> bool:
        # crc32, not hash(): Python salts str hashes per process
        return zlib.crc32(query_id.encode("utf-8")) % self.count == self.index

    def manifest(self, stage: str) -> str:
        """The shard's manifest name (`round=<k>/_done/<stage>.shard-<i>-of-<n>.json`)."""
        return f"{stage}.shard-{self.index}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


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
    merge: str | StageFn | None = None  # shardable: fn(ctx, **options) writes the stage manifest once all shards
    # are complete (the fn takes `shard=`); None: the stage runs whole
    serves: tuple[str, ...] = ()  # config sections whose model it calls: with `serve:` set, the stage runs the
    # server itself (pipeline.engines.servers; `served_sections` says which are needed for a config)
    idle: str | None = None  # "module:function" (ctx, **options) -> True when the stage has nothing for its models
    # to do now (e.g. a round that comes scored): its servers are not started

    @property
    def shardable(self) -> bool:
        return self.merge is not None

    def function(self) -> StageFn:
        return resolve(self.fn)

    def merge_function(self) -> StageFn:
        if self.merge is None:
            raise ValueError(f"stage {self.name!r} cannot be sharded")
        return resolve(self.merge)

    def done(self, ctx, shard: Shard | None = None) -> bool:
        """The manifest (the shard's, given one) is written for the run's frozen config (and the checkpoint is
        whole, if the stage makes one)."""
        if shard is not None:
            return ctx.done(shard.manifest(self.name))
        return ctx.done(self.name) and (not self.checkpoint or ctx.store.checkpoint_complete(ctx.run_id, ctx.round))


def resolve(fn: str | StageFn) -> StageFn:
    """A registry's "module:function" reference (or the callable itself), imported where it is called."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


# In round order. `pipeline.studies.evaluate.EVAL_STAGES` is the evaluation run's subset.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("rollout", "pipeline.stages.rollout:run_rollout", isolated=True, serves=("generator", "executor")),
    # scoring with the local executor loads a model too
    Stage("score", "pipeline.stages.score:run_score", isolated=True, options=("only_failed",), serves=("executor",),
          merge="pipeline.stages.score:finish_score", idle="pipeline.stages.score:nothing_to_score",
          left_hint="executor errors: once it is back, score/rescore (or `pipeline score --only-failed`) re-runs them"),
    Stage("curate", "pipeline.stages.curate:run_curate", discard=("groups",)),
    Stage("train", "pipeline.stages.train:run_train", isolated=True, discard=("train_metrics", "checkpoints"),
          checkpoint=True),
)}
ROUND_STAGES = tuple(STAGES)


def served_sections(stage: Stage, cfg) -> list[str]:
    """The sections of `stage.serves` whose server this config has the stage run: those with `serve:` set, and the
    executor in rollout only when workflows run there (self-repair checks, refine); a server costs minutes to
    start."""
    checks = cfg.rollout.mode == "refine" or (cfg.rollout.repair_attempts > 0 and cfg.rollout.repair_check == "run")
    return [s for s in stage.serves if getattr(cfg, s).serve is not None
            and not (stage.name == "rollout" and s == "executor" and not checks)]


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name]
