"""The `ablate` flow: one round's curated data trained with several objectives, each evaluated on the held-out
split (pipeline.studies.ablation holds the loop and the maths)."""

from __future__ import annotations

from prefect import flow

from flows.artifacts import publish_ablation
from flows.tasks import submitting_call
from pipeline.stages.runner import RetryPolicy
from pipeline.studies.ablation import run_ablation


@flow(name="ablate", flow_run_name="ablate {config}", log_prints=True)
def ablate(config: str = "configs/learn.yaml", objectives: list[str] | None = None, seeds: int | None = None,
           round: int = 0, run_id: str | None = None, sets: list[str] | None = None, retries: int = 2,
           retry_delay_s: float = 20.0) -> dict:
    """Arms `<run>-s<seed>-<objective>` train the source run's round `round`; the table compares their held-out
    Mean@L / Best@L with the base model and the first objective (written under <store>/experiments/)."""
    summary = run_ablation(config, submitting_call(RetryPolicy(retries, retry_delay_s)), objectives, seeds, round,
                           run_id, sets, command=f"prefect flow ablate {config}")
    print(summary.table())
    print(f"results: {summary.results}")
    publish_ablation(summary)
    return summary.to_dict()
