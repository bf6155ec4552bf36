"""The `iterate` flow: rounds of rollout -> score -> curate -> train (-> evaluate), resumable.

The flow only wires stages. Each stage is a Prefect task around `flows.stages.run_stage`, which
skips completed stages (manifests) and runs model-loading stages in a child process. Transient
failures retry with a delay; a permanent one fails the flow run with "round K STAGE: reason".
`run_rounds` is the same loop without Prefect (the `pipeline run` path needs no server).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from flows.stages import STAGES, StageError, record_timing, run_stage
from pipeline.report import round_stats
from pipeline.run import open_run
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[1]
SMOKE_CONFIG = "configs/smoke.yaml"  # the whole loop in minutes (SmolLM2-135M); the learning demo is experiment/demo

StageCall = Callable[..., dict]


def resolve_config(config: str | Path) -> Path:
    """A relative path is tried against the working directory, then the repository (served flows)."""
    p = Path(config)
    if p.is_file() or p.is_absolute():
        return p
    return REPO / p if (REPO / p).is_file() else p


def _retry_if_transient(task, task_run: TaskRun, state: State) -> bool:
    exc = state.data
    return not isinstance(exc, StageError) or exc.transient


# NO_CACHE: a stage must always be asked (it skips itself by manifest); Prefect's input cache must not.
@task(name="stage", task_run_name="round {round} {stage}", retries=2, retry_delay_seconds=20,
      retry_condition_fn=_retry_if_transient, cache_policy=NO_CACHE)
def stage_task(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
               only_failed: bool = False, isolate: bool | None = None) -> dict:
    """One stage of one round; returns a small dict (counts, wall time), never frames."""
    res = run_stage(stage, run_id, round, store_root, sets, only_failed, isolate)
    record_timing(store_root, run_id, res)
    verb = "skipped (manifest complete)" if res["skipped"] else f"done in {res['wall_s']:.1f}s"
    get_run_logger().info("round %d %s %s: %s", round, stage, verb, res["counts"])
    return res


def run_rounds(config: str | Path, rounds: int | None, run_id: str | None, call: StageCall,
               after_round: Callable[[str, str, int], None] | None = None, sets: list[str] | None = None) -> dict:
    """Open (freeze) the run once, then call each stage of each round in order; returns a summary.

    `sets` are per-invocation overrides (`key=value`, as `--set`) given to every stage; the first call
    of a new run freezes them into its config.
    """
    ctx = open_run(resolve_config(config), run_id, 0, sets)
    store_root, run_id = str(ctx.store.root), ctx.run_id
    rounds = rounds or ctx.cfg.rounds
    walls: dict[int, dict[str, float]] = {}
    for k in range(rounds):
        for stage in STAGES:
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


def direct_call(retries: int = 2, retry_delay_s: float = 20.0) -> StageCall:
    """A stage caller without Prefect, with the same skip/resume and retry rules as `stage_task`."""
    log = logging.getLogger("pipeline.run")

    def call(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None) -> dict:
        for attempt in range(retries + 1):
            try:
                res = run_stage(stage, run_id, round, store_root, sets)
                break
            except StageError as e:
                if not e.transient or attempt == retries:
                    raise
                log.warning("%s; retry %d/%d in %.0fs", e, attempt + 1, retries, retry_delay_s)
                time.sleep(retry_delay_s)
        record_timing(store_root, run_id, res)
        log.info("%s round %d %s %s %s", run_id, round, stage, "skipped" if res["skipped"] else f"{res['wall_s']:.1f}s",
                 res["counts"])
        return res

    return call


def run_direct(config: str | Path, rounds: int | None = None, run_id: str | None = None,
               retries: int = 2, retry_delay_s: float = 20.0, sets: list[str] | None = None) -> dict:
    """`pipeline run`: the same rounds without Prefect, with the same skip/resume and retry rules."""
    return run_rounds(config, rounds, run_id, direct_call(retries, retry_delay_s), sets=sets)


def _iterate_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"iterate {p.get('run_id') or Path(p.get('config') or SMOKE_CONFIG).stem}"


@flow(name="iterate", flow_run_name=_iterate_run_name, log_prints=True)
def iterate(config: str = SMOKE_CONFIG, rounds: int | None = None, run_id: str | None = None,
            evaluate_split: str | None = None, retries: int = 2, retry_delay_s: float = 20.0,
            in_process: bool = False, sets: list[str] | None = None) -> dict:
    """Run `rounds` rounds (default: the config's) of rollout -> score -> curate -> train.

    Re-running with the same run_id skips completed stages and resumes a half-done one.
    evaluate_split: also score each round's checkpoint on this split (e.g. "test") in a derived run.
    in_process: run every stage in the flow's process (debugging; models then stay in memory).
    sets: per-invocation overrides, e.g. ["executor.base_url=http://h:8000/v1"] (frozen on a new run).
    """
    staged = stage_task.with_options(retries=retries, retry_delay_seconds=retry_delay_s)

    def call(**kw) -> dict:  # submit: the flow's task runner (thread, Dask, Ray) decides where it runs
        return staged.submit(**kw, isolate=False if in_process else None).result()

    def after_round(run_id: str, store_root: str, k: int) -> None:
        if evaluate_split:
            from flows.evaluate import evaluate

            evaluate(run_id, k, evaluate_split, store_root, retries=retries, retry_delay_s=retry_delay_s,
                     in_process=in_process)

    summary = run_rounds(config, rounds, run_id, call, after_round, sets)
    for r in summary["rounds"]:
        print(f"run {summary['run_id']} round {r['round']}: mean score {_fmt(r['mean_score'])}, "
              f"best {_fmt(r['best_score'])}, stage wall s {r['wall_s']}")
    return summary


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
