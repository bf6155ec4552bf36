"""The stage runner: run (or skip) one stage of one round, in this process or in a child process.

`run_stage` owns the stage protocol for every stage alike:
- skip: a stage whose manifest matches the run's frozen config is done (`Stage.done`), so a re-run resumes;
- discard: what an attempt that died before its manifest left behind goes (`Store.discard_unfinished`), for
  stages that start over; rollout and scoring resume their own rows instead;
- child process: model-loading stages run in `python -m pipeline.stages ...`, so model memory is freed between
  stages, and the child dies with its parent (no orphan keeps writing to the store after the run is killed);
- shards: a shardable stage (score) can run as N calls, `shard=(i, n)`, each on its own queries, skipped and
  resumed by its own manifest; `finish_shards` writes the stage manifest once all N are complete;
- one writer: a lease per (run, round, stage[, shard]) is held from before any work until after the manifest
  (`stage_lease`, pipeline/store/lease.py); a second call of the same stage is refused naming the holder, or with
  `wait` blocks until it is gone, then skips what it finished; a shard takes its own lease and shares the stage's;
- failures: `StageError.transient` says whether a retry can help (a lost endpoint or network, a killed child,
  a stage that returned with work left) or not (a bad config, a bug); `RetryPolicy` retries the former, the
  same way on the Prefect path (task retries) and the `pipeline run` path (tenacity).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import LOG_FORMAT
from pipeline.engines.hardware import machine
from pipeline.engines.neighbours import JOB_ENV, job
from pipeline.engines.servers import released, server_log_dir, serving
from pipeline.run import RunContext, open_run
from pipeline.stages import Shard, Stage, get_stage, resolve, served_sections
from pipeline.store import LeaseHeld, LeaseLost, Store

log = logging.getLogger("pipeline.stages")
REPO = Path(__file__).resolve().parents[2]


class StageError(RuntimeError):
    """A stage that did not complete; the message names the stage, the round and the reason."""

    def __init__(self, stage: str, round: int, reason: str, transient: bool):
        super().__init__(f"round {round} {stage}: {reason}")
        self.stage, self.round, self.reason, self.transient = stage, round, reason, transient

    def __reduce__(self):  # picklable across Prefect's result handling and Dask workers
        return (StageError, (self.stage, self.round, self.reason, self.transient))


def _transient_types() -> tuple[type[BaseException], ...]:
    """Errors of the endpoint or the network, not of the code or the config. Client libraries count only if
    loaded: an exception cannot come from a module that was never imported."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    if (openai := sys.modules.get("openai")) is not None:
        types += [openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError]
    if (httpx := sys.modules.get("httpx")) is not None:
        types += [httpx.TransportError]
    if (dist := sys.modules.get("torch.distributed")) is not None and hasattr(dist, "DistError"):
        types += [dist.DistError]  # a peer rank of a launched stage died: the collective fails on the others
    return tuple(types)


# what gloo and NCCL put in the plain RuntimeError that DDP's reducer raises on a rank whose peer died mid-collective
_PEER_LOST = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
              "NCCL communicator was aborted", "ncclRemoteError")


def is_transient(exc: BaseException) -> bool:
    """True for an error a retry can cure. In a launched stage (WORLD_SIZE > 1, as the launcher sets it) a rank whose
    peer was killed fails in the collective with a RuntimeError naming the transport, not always a `DistError`."""
    if isinstance(exc, StageError):
        return exc.transient
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_LOST):
        return True
    return isinstance(exc, _transient_types())


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a transiently failing stage: the one policy of both the Prefect and the direct path."""

    retries: int = 2
    delay_s: float = 20.0

    def prefect_options(self) -> dict[str, Any]:
        """Options for `task.with_options(...)`."""
        def condition(task, task_run, state) -> bool:
            return is_transient(state.data) if isinstance(state.data, BaseException) else True

        return {"retries": self.retries, "retry_delay_seconds": self.delay_s, "retry_condition_fn": condition}

    def call(self, function: Callable[..., Any], /, *args, **kwargs) -> Any:
        """function(*args, **kwargs), retried on transient errors; the last error is raised as is."""
        import tenacity

        def warn(rs: tenacity.RetryCallState) -> None:
            log.warning("%s; retry %d/%d in %.0fs", rs.outcome.exception(), rs.attempt_number, self.retries,
                        self.delay_s)

        retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(self.retries + 1),
                                     wait=tenacity.wait_fixed(self.delay_s),
                                     retry=tenacity.retry_if_exception(is_transient), before_sleep=warn, reraise=True)
        return retrying(function, *args, **kwargs)


def as_shard(shard: Shard | tuple[int, int] | list[int] | str | None) -> Shard | None:
    """A shard from `Shard`, `(i, n)` (lists too: task parameters may come back as lists) or `"i/n"`; one shard of
    one is the whole stage (None)."""
    if shard is None or isinstance(shard, Shard):
        sh = shard
    elif isinstance(shard, str):
        sh = Shard.parse(shard)
    else:
        sh = Shard(*shard)
    return None if sh is None or sh.count == 1 else sh


def _options(stage: Stage, only_failed: bool, shard: Shard | None = None) -> dict[str, Any]:
    if only_failed and "only_failed" not in stage.options:
        raise ValueError(f"stage {stage.name!r} has no only_failed option")
    if shard is not None and not stage.shardable:
        raise ValueError(f"stage {stage.name!r} cannot be sharded")
    return {**({"only_failed": True} if only_failed else {}), **({"shard": shard} if shard is not None else {})}


def execute(ctx: RunContext, stage: Stage, merge: bool = False, **options: Any) -> dict:
    """Run the stage function (`merge`: the stage's merge of its shards) here: discard an unfinished attempt's
    leftovers, call it, classify its failure. A stage that returns without its manifest (the shard's, for a shard)
    has work left (transient: a re-run resumes it)."""
    shard = options.get("shard")
    try:
        if stage.discard or stage.checkpoint:
            ctx.store.discard_unfinished(ctx.run_id, ctx.round, stage.discard, stage.checkpoint)
        # served sections: their servers run for this call only (a merge reads the store and calls no model)
        idle = stage.idle is not None and not merge and shard is None and resolve(stage.idle)(ctx, **options)
        served = [] if merge or idle else served_sections(stage, ctx.cfg)
        with serving(ctx.cfg, served, server_logs(ctx, stage, shard)) as cfg:
            counts = (stage.merge_function() if merge else stage.function())(dataclasses.replace(ctx, cfg=cfg),
                                                                             **options)
    except StageError:
        raise
    except Exception as e:
        raise StageError(_name(stage.name, shard), ctx.round, f"{type(e).__name__}: {e}", is_transient(e)) from e
    if not stage.done(ctx, shard):
        hint = f" ({stage.left_hint})" if stage.left_hint else ""
        raise StageError(_name(stage.name, shard), ctx.round,
                         f"work left, no manifest written: {counts}; re-running resumes it{hint}", transient=True)
    return dict(counts or {})


def server_logs(ctx: RunContext, stage: Stage, shard: Shard | None) -> Path:
    """Where the servers of a stage call log: `<run>/server-logs/round-<k>-<stage>[-shard-i-of-n]/` (a local
    temp folder for a store on object storage)."""
    name = f"round-{ctx.round}-{stage.name}" + (f"-shard-{shard.index}-of-{shard.count}" if shard else "")
    return server_log_dir(ctx.store, ctx.run_id, name)


def _name(stage: str, shard: Shard | None) -> str:
    """How errors and logs name a stage call: `score`, `score shard 1/4`."""
    return stage if shard is None else f"{stage} shard {shard}"


def _die_with_parent() -> None:
    """Child side of Popen: SIGKILL when the parent dies (Linux), so a killed run leaves no writer behind."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _custom_launcher(stage: str) -> str:
    return os.environ.get(f"PIPELINE_LAUNCHER_{stage.upper()}", "").strip()


def launcher(stage: str) -> list[str]:
    """The child's interpreter command: $PIPELINE_LAUNCHER_<STAGE> (e.g. `accelerate launch --num_processes 2`)
    or this Python. The rest of the command line is `-m pipeline.stages ...`, which both accept."""
    custom = _custom_launcher(stage)
    return shlex.split(custom) if custom else [sys.executable]


def _result_files(result: Path) -> list[Path]:
    """Rank 0's result, then any other rank's (`<result>.rank<r>`: written only when that rank failed)."""
    return [result] + sorted(result.parent.glob(result.name + ".rank*"))


def _run_child(stage: str, run_id: str, round: int, store_root: str, sets: list[str], only_failed: bool,
               shard: Shard | None = None, lease_fds: tuple[int, ...] = ()) -> dict:
    name = _name(stage, shard)
    with tempfile.TemporaryDirectory(prefix="stage-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = launcher(stage) + ["-m", "pipeline.stages", stage, "--run-id", run_id, "--round", str(round),
                                 "--store", store_root, "--result", str(result)]
        cmd += ["--only-failed"] if only_failed else []
        cmd += ["--shard", str(shard)] if shard is not None else []
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), JOB_ENV: job()}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        # the child shares the stage's lease file (pass_fds): the kernel frees the lease only when this process and
        # the child are both gone, so a child still dying after its parent's kill -9 is never beside a new writer
        proc = subprocess.run(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                              pass_fds=lease_fds)
        bodies = [json.loads(f.read_text()) for f in _result_files(result) if f.is_file()]
        if bodies and "counts" in bodies[0]:  # rank 0 finished (after every rank met at the end)
            return bodies[0]["counts"]
        if errors := [b for b in bodies if "error" in b]:
            # a rank whose peer died fails in a collective (transient); prefer a rank's own permanent error
            first = next((b for b in errors if not b["transient"]), errors[0])
            raise StageError(name, round, first["error"], first["transient"])
        if proc.returncode == -signal.SIGINT:
            # Ctrl-C reaches the whole foreground process group: the user stops the run, and a retry would undo that
            # (this process's own KeyboardInterrupt goes to its main thread, not to a thread waiting on the child)
            raise KeyboardInterrupt(f"{name}: the stage child was interrupted (SIGINT); re-running resumes it")
        if proc.returncode < 0:  # killed (OOM killer, operator): the stage resumes on retry
            raise StageError(name, round, f"child killed by signal {-proc.returncode}", transient=True)
        if _custom_launcher(stage):
            # a launcher (accelerate/torchrun) exits 1 when one of its processes was killed: every Python error
            # is written to a result file, so none means a process died (signal, OOM killer) and a retry can help
            raise StageError(name, round, f"launched stage exited with status {proc.returncode} and no result (a "
                             "process was killed?)", transient=True)
        raise StageError(name, round, f"child exited with status {proc.returncode} and no result", transient=False)


RELEASES_SERVERS = {"train"}  # stages that call no server and need the machine's memory: shared servers stop


def run_stage(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
              only_failed: bool = False, isolate: bool | None = None,
              shard: Shard | tuple[int, int] | None = None, wait: bool = False) -> StageResult:
    """Run (or skip) one stage of a round.

    The run must exist (its frozen config in the store); `sets` are this invocation's overrides. `only_failed`
    (score) re-runs transiently failed rows even when the manifest exists; `isolate` defaults to the stage's own
    process for model-loading stages. `shard=(i, n)` (shardable stages) does shard i's part only, skipped by its own
    manifest; `finish_shards` completes the stage. Another process running the same stage (or shard): a permanent
    `StageError` naming it, before any work; with `wait`, this call blocks until it is gone. Failures raise
    `StageError`.
    """
    spec = get_stage(stage)
    sets = list(sets or [])
    this_shard = as_shard(shard)
    options = _options(spec, only_failed, this_shard)
    started = time.perf_counter()
    ctx = _open(stage, run_id, round, sets, store_root)
    if (skip := _skip(ctx, spec, this_shard, only_failed)) is not None:  # a finished stage is only read: no lease
        return skip
    with stage_lease(ctx, spec, this_shard, wait) as lease:
        if (skip := _skip(ctx, spec, this_shard, only_failed)) is not None:  # finished by the holder it waited for
            return skip
        # the command's shared executor server is stopped while a train stage runs (its memory and CPU are the
        # stage's; pipeline.engines.servers.released) and started again, without waiting, once the stage ends
        with released() if spec.name in RELEASES_SERVERS else contextlib.nullcontext():
            if spec.isolated if isolate is None else isolate:
                counts = _run_child(stage, run_id, round, str(ctx.store.root), sets, only_failed, this_shard,
                                    lease.fds)
            else:
                counts = execute(ctx, spec, **options)
    return _result(stage, round, this_shard, False, time.perf_counter() - started, counts)


def _skip(ctx: RunContext, st: Stage, sh: Shard | None, only_failed: bool) -> StageResult | None:
    """The skipped result of a stage (or shard) whose manifest is complete; None: it has work to do."""
    if only_failed or not (st.done(ctx) or (sh is not None and st.done(ctx, sh))):
        return None
    which = st.name if st.done(ctx) else sh.manifest(st.name)
    return _result(st.name, ctx.round, sh, True, 0.0, ctx.store.manifest(ctx.run_id, ctx.round, which)["counts"])


@contextlib.contextmanager
def stage_lease(ctx: RunContext, spec: Stage, shard: Shard | None, wait: bool):
    """Hold the lease of one stage call of a round (pipeline/store/lease.py), from before its work until after its
    manifest; yields the lease whose `fds` a child process must keep open.

    A shard holds its own lease and, on a local store, the stage's shared, so shards run at once but none beside a
    whole-stage call of the same stage (which writes the same rows); an s3:// store has no shared lease, so there a
    whole-stage call and a sharded one of the same round are not kept apart (shards from each other are).
    Held elsewhere: a permanent StageError naming the holder (a retry cannot help while it runs; `wait` waits)."""
    name, what = f"round-{ctx.round}.{spec.name}", f"run {ctx.run_id!r} round {ctx.round} {_name(spec.name, shard)}"
    try:
        with contextlib.ExitStack() as held:
            if shard is not None and not ctx.store.remote:
                held.enter_context(ctx.store.lease(ctx.run_id, name, what, shared=True, wait=wait))
            own = name if shard is None else f"round-{ctx.round}.{shard.manifest(spec.name)}"
            lease = held.enter_context(ctx.store.lease(ctx.run_id, own, what, wait=wait))
            yield lease
            lease.check()  # an S3 lease taken over mid-stage: say so rather than report a clean success
    except (LeaseHeld, LeaseLost) as e:
        raise StageError(_name(spec.name, shard), ctx.round, str(e), transient=False) from e


def finish_shards(stage: str, run_id: str, round: int, store_root: str, shards: int, sets: list[str] | None = None,
                  only_failed: bool = False, wait: bool = False) -> StageResult:
    """Write a sharded stage's manifest once all `shards` shards have theirs (the stage's merge function, here: it
    only reads the store, under the stage's lease); a missing shard is work left (transient: re-running resumes
    it)."""
    spec = get_stage(stage)
    started = time.perf_counter()
    ctx = _open(stage, run_id, round, list(sets or []), store_root)
    if (skip := _skip(ctx, spec, None, only_failed)) is not None:
        return skip
    missing = [str(sh) for i in range(shards) if not spec.done(ctx, sh := Shard(i, shards))]
    if missing:
        raise StageError(stage, round, f"work left, no manifest written: shard(s) {', '.join(missing)} not complete; "
                                       "re-running resumes them", transient=True)
    with stage_lease(ctx, spec, None, wait):
        if (skip := _skip(ctx, spec, None, only_failed)) is not None:
            return skip
        counts = execute(ctx, spec, merge=True, **_options(spec, only_failed))
    return _result(stage, round, None, False, time.perf_counter() - started, counts)


def stage_done(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None) -> bool:
    """Whether the stage's manifest is complete (a skip), read here without running anything."""
    return get_stage(stage).done(_open(stage, run_id, round, list(sets or []), store_root))


def _open(stage: str, run_id: str, round: int, sets: list[str], store_root: str) -> RunContext:
    try:
        return open_run(None, run_id, round, sets, store_root)
    except Exception as e:  # a run that cannot be opened (missing, bad config) will not open on a retry either
        raise StageError(stage, round, f"{type(e).__name__}: {e}", transient=False) from e


@dataclass(frozen=True)
class StageResult:
    """What one stage call did: skipped by its manifest, or ran for `wall_s` seconds; `counts` are the manifest's.
    `host` and `pid` say which machine and process ran it (a Dask worker, for shards); a sharded stage's result
    carries its shards' results in `shards`."""

    stage: str
    round: int
    skipped: bool
    wall_s: float
    counts: dict[str, Any]
    shard: str | None = None  # "i/n" for one shard's call
    host: str = ""
    pid: int = 0
    shards: tuple[StageResult, ...] = ()


def _result(stage: str, round: int, shard: Shard | None, skipped: bool, wall_s: float, counts: dict) -> StageResult:
    return StageResult(stage, round, skipped, round_s(wall_s), counts, None if shard is None else str(shard),
                       socket.gethostname(), os.getpid())


def round_s(x: float) -> float:
    return float(f"{x:.2f}")


def record_timing(store_root: str | Path, run_id: str, result: StageResult) -> None:
    """Append a stage's wall time to <store>/<run_id>/timings.jsonl (append-only: a crash loses nothing)."""
    store = Store(store_root)
    line = {"round": result.round, "stage": result.stage, "skipped": result.skipped, "wall_s": result.wall_s}
    if result.shard is not None:  # the stage's own line (finish_shards: the whole fan-out's wall time) is the total
        line["shard"] = result.shard
    line["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line["machine"] = machine()  # the CPU kind that gave the figure: timings of two kinds do not compare
    store.append_line(store.run_dir(run_id) / "timings.jsonl", json.dumps(line))


def child_main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.stages STAGE --run-id R --round K --store ROOT --result FILE`: the child side."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.stages", description="Run one stage in this process.")
    parser.add_argument("stage")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--result", required=True, help="Where to write the JSON result.")
    parser.add_argument("--only-failed", action="store_true")
    parser.add_argument("--shard", help="INDEX/COUNT: this shard of the stage's queries only (shardable stages).")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        # the stage's own INFO lines (the dtype chosen and why, an adapter merged) reach the parent's log; only
        # pipeline's loggers, so libraries' per-request INFO lines stay out
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root = logging.getLogger("pipeline")
        root.setLevel(logging.INFO)
        root.addHandler(handler)
    rank, n = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))  # as a launcher sets them
    try:
        spec = get_stage(args.stage)
        if n > 1 and spec.name != "train":
            raise ValueError(f"stage {spec.name!r} runs as one process; only train runs data-parallel "
                             f"(unset PIPELINE_LAUNCHER_{spec.name.upper()} or launch 1 process)")
        ctx = open_run(None, args.run_id, args.round, args.sets, args.store)
        if rank > 0:  # one writer: rank 0 discards what an unfinished attempt left; the others train
            spec = dataclasses.replace(spec, discard=(), checkpoint=False)
        body: dict[str, Any] = {"counts": execute(ctx, spec, **_options(spec, args.only_failed, as_shard(args.shard)))}
    except StageError as e:
        body = {"error": e.reason, "transient": e.transient}
    except Exception as e:  # config errors and the like: permanent, reported to the parent
        body = {"error": f"{type(e).__name__}: {e}", "transient": is_transient(e)}
    if rank == 0 or "error" in body:  # rank 0 reports; another rank only its own failure
        Path(args.result if rank == 0 else f"{args.result}.rank{rank}").write_text(json.dumps(body, default=str))
    return 0 if "counts" in body else 1
