"""The one Prefect task: a stage of a round, run by the library's stage runner (pipeline.stages.runner)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipeline.stages.rounds import StageCall
from pipeline.stages.runner import RetryPolicy, record_timing, run_stage


# NO_CACHE: a stage must always be asked (it skips itself by manifest); Prefect's input cache must not.
@task(name="stage", task_run_name="round {round} {stage}", cache_policy=NO_CACHE, **RetryPolicy().prefect_options())
def stage_task(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
               only_failed: bool = False, isolate: bool | None = None) -> dict:
    """One stage of one round; returns a small dict (counts, wall time), never frames."""
    res = run_stage(stage, run_id, round, store_root, sets, only_failed, isolate)
    record_timing(store_root, run_id, res)
    verb = "skipped (manifest complete)" if res["skipped"] else f"done in {res['wall_s']:.1f}s"
    get_run_logger().info("round %d %s %s: %s", round, stage, verb, res["counts"])
    return res


def submitting_call(policy: RetryPolicy, in_process: bool = False) -> StageCall:
    """A stage caller for the library's loops that submits `stage_task` to the flow's task runner (thread, Dask,
    Ray decide where it runs) with `policy`'s retries; in_process keeps every stage in the flow's process."""
    staged = stage_task.with_options(**policy.prefect_options())

    def call(**kw) -> dict:
        return staged.submit(**kw, isolate=False if in_process else None).result()

    return call
