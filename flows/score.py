"""The `score` flow: (re-)score one round, e.g. the rows that failed while the executor was down.

`score/rescore` runs it with only_failed=True: only failed rows get a new attempt (appended; the
`latest_scores` view picks it), nothing is trained. A later `iterate` with the same run id then
finds the score manifest complete and continues from curation.
"""

from __future__ import annotations

from prefect import flow

from flows.artifacts import publish_round
from flows.tasks import submitting_call
from pipeline.stages.rounds import call_stage
from pipeline.stages.runner import RetryPolicy, StageResult
from pipeline.store import Store


@flow(name="score", flow_run_name="score {run_id} round {round}", log_prints=True)
def score(run_id: str, round: int = 0, only_failed: bool = True, store: str = "data/runs",
          sets: list[str] | None = None, retries: int = 2, retry_delay_s: float = 20.0, shards: int = 1) -> StageResult:
    """Score round `round` of `run_id`; `sets` are per-invocation overrides (e.g. a new executor endpoint);
    `shards` > 1 splits it into that many tasks by query (on Dask: spread over the workers)."""
    call = submitting_call(RetryPolicy(retries, retry_delay_s))
    res = call_stage(call, "score", run_id, round, str(Store(store).root), sets, only_failed, shards)
    print(f"score {run_id} round {round}: {res.counts}")
    publish_round(run_id, str(Store(store).root), round)
    return res
