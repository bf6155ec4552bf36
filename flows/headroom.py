"""The `headroom` flow: every design of a config's menu as a fixed program on dev, the best single design against the
cross-fitted per-query oracle at its budget, and the gate before training (pipeline.studies.headroom holds the study
and pipeline.core.headroom the maths)."""

from __future__ import annotations

from prefect import flow

from flows.tasks import submitting_call
from pipeline.stages.runner import RetryPolicy
from pipeline.studies.headroom import markdown, run_headroom


@flow(name="headroom", flow_run_name="headroom {config}", log_prints=True)
def headroom(config: str = "configs/mixed-learn.yaml", split: str = "dev", reps: int | None = None,
             run_id: str | None = None, sets: list[str] | None = None, retries: int = 2,
             retry_delay_s: float = 20.0) -> dict:
    """The headroom study of CONFIG (written under <store>/headroom/<run_id>/); returns its summary as headroom.json
    holds it."""
    summary = run_headroom(config, submitting_call(RetryPolicy(retries, retry_delay_s)), run_id, split, reps, sets)
    for line in markdown(summary):
        print(line)
    print(f"results: {summary.results}")
    return summary.to_dict()
