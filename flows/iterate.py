"""The `iterate` flow: rounds of rollout -> score -> curate -> train (-> evaluate), resumable.

Wiring only: the loop is `pipeline.stages.rounds.run_rounds`, each stage one `stage_task` (flows/tasks.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.artifacts import publish_report_link, publish_round
from flows.evaluate import evaluate
from flows.tasks import flow_run_note, submitting_call
from pipeline.stages.rounds import run_rounds
from pipeline.stages.runner import RetryPolicy
from pipeline.store import Store, noting
from pipeline.studies.formatting import num
from pipeline.studies.report import build_report
from pipeline.studies.tracking import TRACKERS

SMOKE_CONFIG = "configs/smoke.yaml"  # the whole loop in minutes (SmolLM2-135M); the learning demo is experiment/demo


def _iterate_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"iterate {p.get('run_id') or Path(p.get('config') or SMOKE_CONFIG).stem}"


@flow(name="iterate", flow_run_name=_iterate_run_name, log_prints=True)
def iterate(config: str = SMOKE_CONFIG, rounds: int | None = None, run_id: str | None = None,
            evaluate_split: str | None = None, retries: int = 2, retry_delay_s: float = 20.0,
            in_process: bool = False, sets: list[str] | None = None, shards: int = 1) -> dict:
    """Run `rounds` rounds (default: the config's) of rollout -> score -> curate -> train.

    Re-running with the same run_id skips completed stages and resumes a half-done one.
    evaluate_split: also score each round's checkpoint on this split (e.g. "test") in a derived run.
    in_process: run every stage in the flow's process (debugging; models then stay in memory).
    sets: per-invocation overrides, e.g. ["executor.base_url=http://h:8000/v1"] (frozen on a new run).
    shards: score each round as that many tasks split by query (on a Dask task runner: over its workers).
    """
    call = submitting_call(RetryPolicy(retries, retry_delay_s), in_process)

    def after_round(run_id: str, store_root: str, k: int) -> None:
        publish_round(run_id, store_root, k)
        if evaluate_split:
            evaluate(run_id, k, evaluate_split, store_root, retries=retries, retry_delay_s=retry_delay_s,
                     in_process=in_process)

    with noting(flow_run_note()):  # a second flow run on this run id fails at once, naming this one
        summary = run_rounds(config, rounds, run_id, call, after_round, sets, shards, observer=TRACKERS)
    publish_report_link(summary.run_id, build_report(Store(summary.store), summary.run_id))
    for r in summary.rounds:
        print(f"run {summary.run_id} round {r.round}: mean score {num(r.mean_score)}, "
              f"best {num(r.best_score)}, stage wall s {r.wall_s}")
    return summary.to_dict()
