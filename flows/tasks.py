"""The one Prefect task: a stage of a round (or one shard of it), run by the library's stage runner
(pipeline.stages.runner)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.runtime import flow_run, task_run

from flows.runners import placement
from pipeline.engines.meter import Relay, relay_path
from pipeline.stages.rounds import Caller
from pipeline.stages.runner import RetryPolicy, StageResult, record_timing, run_stage
from pipeline.store import noting


@contextlib.contextmanager
def relaying(path: Path, logger, every_s: float = 5.0):
    """While the block runs, log each progress line a stage appends to `path` (pipeline.engines.meter.Relay), from a
    thread that looks every `every_s` seconds; the last lines once the block ends."""
    relay, stop = Relay(path), threading.Event()

    def forward() -> None:
        for line in relay.new_lines():
            logger.info("%s", line)

    def watch() -> None:
        while not stop.wait(every_s):
            forward()

    thread = threading.Thread(target=watch, name="progress-relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        forward()


def flow_run_note() -> str:
    """How a lease's holder names the flow run it belongs to (a second flow run on the same run id is refused
    naming it)."""
    return f"Prefect flow run {flow_run.name!r} ({flow_run.id})" if flow_run.id else ""


def _task_run_name() -> str:
    p = task_run.parameters
    shard = p.get("shard")
    return f"round {p['round']} {p['stage']}" + (f" shard {shard[0]}/{shard[1]}" if shard else "")


# NO_CACHE: a stage must always be asked (it skips itself by manifest); Prefect's input cache must not.
@task(name="stage", task_run_name=_task_run_name, cache_policy=NO_CACHE, **RetryPolicy().prefect_options())
def stage_task(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
               only_failed: bool = False, isolate: bool | None = None,
               shard: tuple[int, int] | None = None) -> StageResult:
    """One stage (or shard `(i, n)` of it) of one round; returns its `StageResult` (counts, wall time, host and pid of
    the process that ran it), never frames. While it works, its progress lines (pipeline.engines.meter: done, rate,
    time left) go to this task's log."""
    with noting(flow_run_note()), relaying(relay_path(run_id, round, stage), get_run_logger()):
        res = run_stage(stage, run_id, round, store_root, sets, only_failed, isolate, shard)
    record_timing(store_root, run_id, res)
    verb = "skipped (manifest complete)" if res.skipped else f"done in {res.wall_s:.1f}s"
    which = f"{stage} shard {res.shard}" if res.shard else stage
    get_run_logger().info("round %d %s %s on %s pid %d: %s", round, which, verb, res.host, res.pid, res.counts)
    return res


def submitting_call(policy: RetryPolicy, in_process: bool = False) -> Caller:
    """A stage caller for the library's loops that submits `stage_task` to the flow's task runner (thread, Dask,
    Ray decide where it runs) with `policy`'s retries; in_process keeps every stage in the flow's process. Several
    calls (shards) are submitted at once, so the task runner spreads them over its workers."""
    staged = stage_task.with_options(**policy.prefect_options())
    isolate = False if in_process else None

    def submit(kw: dict):
        with placement(kw["stage"]):  # Dask worker resources, when asked for (flows/runners.py)
            return staged.submit(**kw, isolate=isolate)

    def many(kws: list[dict]) -> list[dict]:
        futures = [submit(kw) for kw in kws]
        wait(futures)  # every shard ends before a failure is raised: none is left writing
        return [f.result() for f in futures]

    return Caller(lambda **kw: many([kw])[0], many)
