"""Rounds of rollout -> score -> curate -> train through a stage caller.

A stage caller is `call(stage=, run_id=, round=, store_root=, sets=) -> run_stage's result`: `direct_call` runs
the stage here with the retry policy (`pipeline run`, `pipeline experiment`); the Prefect flows pass one that
submits a task (flows/). Either way the loop, the skips and the retries are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from pipeline.report import round_stats
from pipeline.run import open_run
from pipeline.stages import ROUND_STAGES
from pipeline.stages.runner import REPO, RetryPolicy, record_timing, run_stage
from pipeline.store import Store

log = logging.getLogger("pipeline.run")

StageCall = Callable[..., dict]


def resolve_config(config: str | Path) -> Path:
    """A relative path is tried against the working directory, then the repository (served flows)."""
    p = Path(config)
    if p.is_file() or p.is_absolute():
        return p
    return REPO / p if (REPO / p).is_file() else p


def direct_call(policy: RetryPolicy | None = None) -> StageCall:
    """A stage caller without Prefect: the runner, retried by `policy`, with the stage's wall time recorded."""
    policy = policy or RetryPolicy()

    def call(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
             only_failed: bool = False) -> dict:
        res = policy.call(run_stage, stage, run_id, round, store_root, sets, only_failed)
        record_timing(store_root, run_id, res)
        log.info("%s round %d %s %s %s", run_id, round, stage, "skipped" if res["skipped"] else f"{res['wall_s']:.1f}s",
                 res["counts"])
        return res

    return call


def run_rounds(config: str | Path, rounds: int | None, run_id: str | None, call: StageCall,
               after_round: Callable[[str, str, int], None] | None = None, sets: list[str] | None = None) -> dict:
    """Open (freeze) the run once, then call each stage of each round in order; returns a summary.

    `sets` are per-invocation overrides (`key=value`, as `--set`) given to every stage; the first call
    of a new run freezes them into its config. `after_round(run_id, store_root, k)` runs after round k.
    """
    ctx = open_run(resolve_config(config), run_id, 0, sets)
    store_root, run_id = str(ctx.store.root), ctx.run_id
    rounds = rounds or ctx.cfg.rounds
    walls: dict[int, dict[str, float]] = {}
    for k in range(rounds):
        for stage in ROUND_STAGES:
            res = call(stage=stage, run_id=run_id, round=k, store_root=store_root, sets=sets)
            walls.setdefault(k, {})[stage] = res["wall_s"]
        if after_round is not None:
            after_round(run_id, store_root, k)
    stats = round_stats(Store(store_root), run_id)
    per_round = [
        {"round": r["round"], "mean_score": r["mean_score"], "best_score": r["best_score"],
         "wall_s": walls.get(r["round"], {})}
        for r in stats.iter_rows(named=True) if r["round"] < rounds
    ]
    return {"run_id": run_id, "store": store_root, "rounds": per_round}
