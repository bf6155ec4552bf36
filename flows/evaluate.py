"""The `evaluate` flow: score a round's checkpoint on the test split in a derived run (pipeline.studies.evaluate)."""

from __future__ import annotations

from prefect import flow

from flows.artifacts import publish_evaluation
from flows.tasks import submitting_call
from pipeline.stages.runner import RetryPolicy
from pipeline.studies.tracking import evaluate_tracked


@flow(name="evaluate", flow_run_name="evaluate {run_id} round {round} on {split}", log_prints=True)
def evaluate(run_id: str, round: int, split: str = "test", store: str = "data/runs", sets: list[str] | None = None,
             retries: int = 2, retry_delay_s: float = 20.0, in_process: bool = False) -> dict:
    """Roll out and score round `round`'s checkpoint (-1: the base model) on `split`; returns its summary as the
    JSON its record writes (`EvalSummary.to_dict`: Mean@L, Best@L, ..., per query).

    The run's own data is untouched: everything goes to the run `<run_id>-eval-r<round>`.
    """
    summary = evaluate_tracked(store, run_id, round, split, sets,
                             submitting_call(RetryPolicy(retries, retry_delay_s), in_process))
    print(f"evaluate {run_id} round {round} on {split}: {summary.line()}")
    publish_evaluation(summary, run_id, round, split)
    return summary.to_dict()
