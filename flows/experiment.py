"""The `experiment` flow and `pipeline experiment`: S seeds x R rounds, then the base model and each round's
checkpoint on the held-out split, then the paired summary (pipeline.experiment holds the plan and the maths).

Re-running with the same run id resumes: finished stages are skipped by their manifests, in the seed runs and
in the evaluation runs alike. The summary is rewritten after every seed, so a stopped experiment still
leaves its results so far.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from prefect import flow

from flows.iterate import StageCall, direct_call, resolve_config, run_rounds, stage_task
from pipeline.config import load_config
from pipeline.evaluate import EVAL_STAGES, open_eval_run
from pipeline.experiment import eval_rounds, eval_sets, headline, plan, summarise, write_results
from pipeline.store import Store

log = logging.getLogger("pipeline.experiment")


def run_experiment(config: str | Path, call: StageCall, seeds: int | None = None, run_id: str | None = None,
                   sets: list[str] | None = None, command: str | None = None) -> dict:
    """Train and evaluate every seed through `call` (a stage caller), then write the summary; returns it."""
    path = resolve_config(config)
    sets = list(sets or [])
    cfg = load_config(path, sets)
    if run_id:
        cfg = cfg.model_copy(update={"run_id": run_id})
    seed_list = list(range(seeds)) if seeds is not None else None
    store = Store(cfg.store.root)
    t0 = time.perf_counter()
    walls: dict[int, float] = {}
    done: list[int] = []
    summary: dict = {}
    for sp in plan(cfg, seed_list):
        t_seed = time.perf_counter()
        log.info("seed %d: training run %s (%d rounds)", sp.seed, sp.run_id, cfg.rounds)
        run_rounds(path, cfg.rounds, sp.run_id, call, sets=sets + sp.sets)
        for k in eval_rounds(cfg):
            ectx = open_eval_run(str(store.root), sp.run_id, k, cfg.experiment.eval_split, eval_sets(cfg))
            log.info("seed %d: evaluating %s on %s (%s)", sp.seed, "the base model" if k < 0 else f"round {k}",
                     cfg.experiment.eval_split, ectx.run_id)
            for stage in EVAL_STAGES:
                call(stage=stage, run_id=ectx.run_id, round=0, store_root=str(store.root), sets=eval_sets(cfg))
        walls[sp.seed] = round(time.perf_counter() - t_seed, 1)
        done.append(sp.seed)
        summary = summarise(store, cfg, done)
        out = write_results(store, summary, {"command": command, "seed_wall_s": walls,
                                             "wall_s": round(time.perf_counter() - t0, 1), "config": str(path),
                                             "sets": sets})
        for line in headline(summary):
            log.info("after seed %d: %s", sp.seed, line)
    summary["results"] = str(out)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    return summary


def run_experiment_direct(config: str | Path, seeds: int | None = None, run_id: str | None = None,
                          sets: list[str] | None = None, retries: int = 2, command: str | None = None) -> dict:
    """`pipeline experiment`: the experiment without a Prefect server."""
    return run_experiment(config, direct_call(retries), seeds, run_id, sets, command)


@flow(name="experiment", flow_run_name="experiment {config}", log_prints=True)
def experiment(config: str = "configs/learn.yaml", seeds: int | None = None, run_id: str | None = None,
               sets: list[str] | None = None, retries: int = 2, retry_delay_s: float = 20.0) -> dict:
    """S seeds x R rounds of CONFIG, the base model and every checkpoint on the held-out split, and the paired
    comparison with bootstrap intervals (written under <store>/experiments/<run_id>/)."""
    staged = stage_task.with_options(retries=retries, retry_delay_seconds=retry_delay_s)

    def call(**kw) -> dict:
        return staged.submit(**kw).result()

    summary = run_experiment(config, call, seeds, run_id, sets, command=f"prefect flow experiment {config}")
    for line in headline(summary):
        print(line)
    print(f"results: {summary['results']}")
    return {k: v for k, v in summary.items() if k != "per_query"}
