"""Task runner switch: where a flow's stage tasks execute (`--task-runner SPEC` of flows.serve).

    thread[:N]        threads in the flow-run process (default; stages still fork their own child)
    dask[:ADDRESS]    a Dask cluster: tcp://host:8786, or a temporary local cluster without ADDRESS
                      (needs `pip install -e ".[dask]"`, which scripts/setup.sh does)
    ray[:ADDRESS]     a Ray cluster: ray://host:10001, or a local one (needs `pip install prefect-ray`)

Workers on other machines need the repository installed and the same store root (a shared
filesystem); see docs/orchestration.md.
"""

from __future__ import annotations

import contextlib
import os

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner


class RunnerSpecError(ValueError):
    pass


def task_runner_from_spec(spec: str) -> TaskRunner:
    kind, _, arg = spec.partition(":")
    if kind == "thread":
        return ThreadPoolTaskRunner(max_workers=int(arg) if arg else None)
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise RunnerSpecError("task runner 'dask' needs prefect-dask: pip install -e \".[dask]\"") from None
        return DaskTaskRunner(address=arg) if arg else DaskTaskRunner()
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise RunnerSpecError("task runner 'ray' needs prefect-ray: pip install prefect-ray") from None
        return RayTaskRunner(address=arg) if arg else RayTaskRunner()
    raise RunnerSpecError(f"unknown task runner {spec!r}: use thread[:N], dask[:ADDRESS] or ray[:ADDRESS]")


def placement(stage: str) -> contextlib.AbstractContextManager:
    """Where a stage's tasks may run on a Dask cluster: `PIPELINE_DASK_RESOURCES_<STAGE>="GPU=1"` (comma-separated
    NAME=AMOUNT) submits them under `dask.annotate(resources=...)`, so only workers started with those resources
    (`dask worker ADDRESS --resources GPU=1`) take them, e.g. rollout and train on the GPU machines while scoring
    shards go anywhere. Unset: no annotation (and other task runners ignore annotations)."""
    spec = os.environ.get(f"PIPELINE_DASK_RESOURCES_{stage.upper()}", "").strip()
    if not spec:
        return contextlib.nullcontext()
    resources = {}
    for part in spec.split(","):
        name, _, amount = part.partition("=")
        try:
            resources[name.strip()] = float(amount)
        except ValueError:
            raise RunnerSpecError(f"PIPELINE_DASK_RESOURCES_{stage.upper()}={spec!r}: use NAME=AMOUNT[,NAME=AMOUNT], "
                                  "e.g. GPU=1") from None
        if not name.strip():
            raise RunnerSpecError(f"PIPELINE_DASK_RESOURCES_{stage.upper()}={spec!r}: a resource has no name")
    import dask

    return dask.annotate(resources=resources)
