"""The `compare-methods` flow: every method trained S seeds x R rounds from the same base model and evaluated on the
same held-out queries with its own inference procedure (pipeline.studies.methods holds the loop and the maths)."""

from __future__ import annotations

from prefect import flow

from flows.artifacts import publish_methods
from flows.tasks import submitting_call
from pipeline.stages.runner import RetryPolicy
from pipeline.studies.methods import parse_arm_sets, run_methods


@flow(name="compare-methods", flow_run_name="compare-methods {config}", log_prints=True)
def compare_methods(config: str = "configs/learn.yaml", methods: list[str] | None = None, seeds: int | None = None,
                    run_id: str | None = None, sets: list[str] | None = None, arm_sets: list[str] | None = None,
                    lr_sweep: list[float] | None = None, retries: int = 2, retry_delay_s: float = 20.0) -> dict:
    """Runs `<run>-<method>-s<seed>` and the references; the table compares their held-out Mean@L / Best@L /
    Majority@L (Sel@L) with the base model and SPOGW (written under <store>/experiments/<run>-methods/)."""
    summary = run_methods(config, submitting_call(RetryPolicy(retries, retry_delay_s)), methods, seeds, run_id, sets,
                          parse_arm_sets(arm_sets), lr_sweep, command=f"prefect flow compare-methods {config}",
                          after_seed=lambda s, out: publish_methods(s))
    print(summary.table())
    print(f"results: {summary.results}")
    return {k: v for k, v in summary.to_dict().items() if k != "per_query"}
