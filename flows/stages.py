"""Running one pipeline stage for a run and round: in this process or in a child process.

Flows never call stage code directly: they call `run_stage`, which
- skips a stage whose manifest is complete (`ctx.done`), so a re-run resumes where it stopped;
- runs GPU stages (rollout, train; scoring with a local executor loads a model too) in a child
  process so model memory is freed between stages, and a child dies with its parent (no orphan
  keeps writing to the store after the run is killed);
- sorts failures into transient (retry: a lost executor, a killed child, a stage that returned
  with work left) and permanent (a bad config, a bug): `StageError.transient`.

`python -m flows.stages STAGE --run-id R --round K --store ROOT --result FILE` is the child side.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.run import RunContext, open_run

# Stage name -> (module, function). Resolved at call time so `--help` stays light.
STAGE_FUNCS = {
    "rollout": ("pipeline.rollout", "run_rollout"),
    "score": ("pipeline.scoring", "run_scoring"),
    "curate": ("pipeline.curate", "run_curate"),
    "train": ("pipeline.train", "run_train"),
}
STAGES = tuple(STAGE_FUNCS)  # in round order
ISOLATED_STAGES = frozenset({"rollout", "score", "train"})  # load models: own process

# Exceptions worth a retry: the endpoint or network, not the code or the config.
_TRANSIENT_NAMES = {
    "ConnectionError", "TimeoutError", "APIConnectionError", "APITimeoutError", "RateLimitError",
    "InternalServerError", "ServiceUnavailableError", "ConnectError", "ReadTimeout", "RemoteProtocolError",
}


class StageError(RuntimeError):
    """A stage that did not complete; the message names the stage, the round and the reason."""

    def __init__(self, stage: str, round: int, reason: str, transient: bool):
        super().__init__(f"round {round} {stage}: {reason}")
        self.stage, self.round, self.reason, self.transient = stage, round, reason, transient

    def __reduce__(self):  # picklable across Prefect's result handling
        return (StageError, (self.stage, self.round, self.reason, self.transient))


def is_transient(exc: BaseException) -> bool:
    return any(t.__name__ in _TRANSIENT_NAMES for t in type(exc).__mro__)


def stage_function(stage: str) -> Callable[..., dict]:
    if stage not in STAGE_FUNCS:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGE_FUNCS)}")
    module, name = STAGE_FUNCS[stage]
    return getattr(importlib.import_module(module), name)


def call_stage(ctx: RunContext, stage: str, only_failed: bool = False) -> dict:
    """Run the stage function on an open run; a stage that returns without its manifest has work left."""
    fn = stage_function(stage)
    try:
        counts = fn(ctx, only_failed=only_failed) if stage == "score" else fn(ctx)
        if stage == "score" and not only_failed and not ctx.done(stage):
            # rows that failed transiently (executor down) get one new attempt per call; Prefect
            # retries of this stage therefore heal a short outage without a separate re-score
            counts = fn(ctx, only_failed=True)
    except Exception as e:
        raise StageError(stage, ctx.round, f"{type(e).__name__}: {e}", is_transient(e)) from e
    if not ctx.done(stage):
        hint = " (executor errors: once it is back, score/rescore re-runs them)" if stage == "score" else ""
        raise StageError(stage, ctx.round, f"work left, no manifest written: {counts}; re-running resumes it{hint}",
                         transient=True)
    return dict(counts or {})


def _die_with_parent() -> None:
    """Child side of Popen: SIGKILL when the parent dies (Linux), so a killed run leaves no writer behind."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def launcher(stage: str) -> list[str]:
    """The child's interpreter command: $PIPELINE_LAUNCHER_<STAGE> (e.g. `accelerate launch --num_processes 1`)
    or this Python. The rest of the command line is `-m flows.stages ...`, which both accept."""
    custom = os.environ.get(f"PIPELINE_LAUNCHER_{stage.upper()}", "").strip()
    return shlex.split(custom) if custom else [sys.executable]


def _run_child(stage: str, run_id: str, round: int, store_root: str, sets: list[str], only_failed: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="stage-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = launcher(stage) + ["-m", "flows.stages", stage, "--run-id", run_id, "--round", str(round),
                                 "--store", store_root, "--result", str(result)]
        cmd += ["--only-failed"] if only_failed else []
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        if result.is_file():
            body = json.loads(result.read_text())
            if "error" in body:
                raise StageError(stage, round, body["error"], body["transient"])
            return body["counts"]
        if proc.returncode < 0:  # killed (OOM killer, operator): the stage resumes on retry
            raise StageError(stage, round, f"child killed by signal {-proc.returncode}", transient=True)
        raise StageError(stage, round, f"child exited with status {proc.returncode} and no result", transient=False)


def run_stage(
    stage: str,
    run_id: str,
    round: int,
    store_root: str,
    sets: list[str] | None = None,
    only_failed: bool = False,
    isolate: bool | None = None,
) -> dict:
    """Run (or skip) one stage of a round; returns {stage, round, skipped, wall_s, counts}.

    The run must exist (its frozen config in the store). `only_failed` re-scores failed rows even
    when the score manifest exists; `isolate` defaults to a child process for model-loading stages.
    """
    sets = list(sets or [])
    ctx = open_run(None, run_id, round, sets, store_root)
    t0 = time.perf_counter()
    if ctx.done(stage) and not only_failed:
        return {"stage": stage, "round": round, "skipped": True, "wall_s": 0.0,
                "counts": ctx.store.manifest(run_id, round, stage)["counts"]}
    if isolate is None:
        isolate = stage in ISOLATED_STAGES
    if isolate:
        counts = _run_child(stage, run_id, round, str(ctx.store.root), sets, only_failed)
    else:
        counts = call_stage(ctx, stage, only_failed)
    return {"stage": stage, "round": round, "skipped": False, "wall_s": round_s(time.perf_counter() - t0),
            "counts": counts}


def round_s(x: float) -> float:
    return float(f"{x:.2f}")


def record_timing(store_root: str | Path, run_id: str, result: dict[str, Any]) -> None:
    """Append a stage's wall time to <store>/<run_id>/timings.jsonl (append-only: a crash loses nothing)."""
    path = Path(store_root) / run_id / "timings.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {k: result[k] for k in ("round", "stage", "skipped", "wall_s")}
    line["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.stages", description="Run one stage in this process.")
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--result", required=True, help="Where to write the JSON result.")
    ap.add_argument("--only-failed", action="store_true")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args(argv)
    try:
        ctx = open_run(None, a.run_id, a.round, a.sets, a.store)
        body: dict[str, Any] = {"counts": call_stage(ctx, a.stage, a.only_failed)}
    except StageError as e:
        body = {"error": e.reason, "transient": e.transient}
    except Exception as e:  # config errors and the like: permanent, reported to the parent
        body = {"error": f"{type(e).__name__}: {e}", "transient": False}
    Path(a.result).write_text(json.dumps(body, default=str))
    return 0 if "counts" in body else 1


if __name__ == "__main__":
    sys.exit(_main())
