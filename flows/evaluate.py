"""The `evaluate` flow: score a round's checkpoint on the test split in a derived run (see pipeline.evaluate)."""

from __future__ import annotations

from prefect import flow

from flows.iterate import stage_task
from pipeline.evaluate import EVAL_STAGES, eval_summary, open_eval_run
from pipeline.store import Store


@flow(name="evaluate", flow_run_name="evaluate {run_id} round {round} on {split}", log_prints=True)
def evaluate(run_id: str, round: int, split: str = "test", store: str = "data/runs", sets: list[str] | None = None,
             retries: int = 2, retry_delay_s: float = 20.0, in_process: bool = False) -> dict:
    """Roll out and score round `round`'s checkpoint (-1: the base model) on `split`; returns mean/best score.

    The run's own data is untouched: everything goes to the run `<run_id>-eval-r<round>`.
    """
    ctx = open_eval_run(store, run_id, round, split, sets)
    staged = stage_task.with_options(retries=retries, retry_delay_seconds=retry_delay_s)
    for stage in EVAL_STAGES:
        staged.submit(stage=stage, run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=sets,
                      isolate=False if in_process else None).result()
    summary = eval_summary(Store(ctx.store.root), ctx.run_id)
    print(f"evaluate {run_id} round {round} on {split}: {summary}")
    return summary
