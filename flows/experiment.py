"""The `experiment` flow: S seeds x R rounds, the base model and each checkpoint on the held-out split, and the
paired summary (pipeline.studies.experiment holds the loop, the plan and the maths)."""

from __future__ import annotations

from prefect import flow

from flows.artifacts import publish_experiment, publish_round
from flows.tasks import submitting_call
from pipeline.stages.runner import RetryPolicy
from pipeline.studies.experiment import run_experiment


@flow(name="experiment", flow_run_name="experiment {config}", log_prints=True)
def experiment(config: str = "configs/learn.yaml", seeds: int | None = None, run_id: str | None = None,
               sets: list[str] | None = None, retries: int = 2, retry_delay_s: float = 20.0,
               only_seeds: list[int] | None = None, only_references: bool = False) -> dict:
    """S seeds x R rounds of CONFIG, the base model and every checkpoint on the held-out split, and the paired
    comparison with bootstrap intervals (written under <store>/experiments/<run_id>/). `only_seeds`: run just these
    seeds and no reference, beside other runs of the same experiment; `only_references`: no seed, only the
    references."""
    # artifacts as it goes (an experiment takes hours): each round's figures, then after each seed the paired
    # differences so far and the report (flows/artifacts.py)
    summary = run_experiment(config, submitting_call(RetryPolicy(retries, retry_delay_s)), seeds, run_id, sets,
                             command=f"prefect flow experiment {config}", after_round=publish_round,
                             after_seed=lambda s, out: publish_experiment(s, f"{out}/report.html"),
                             only_seeds=only_seeds, only_references=only_references)
    for line in summary.headline():
        print(line)
    print(f"results: {summary.results}")
    return {k: v for k, v in summary.to_dict().items() if k != "per_query"}
