"""Rounds of rollout -> score -> curate -> train through a stage caller.

A stage caller is `call(stage=, run_id=, round=, store_root=, sets=) -> run_stage's result`: `direct_call` runs
the stage here with the retry policy (`pipeline run`, `pipeline experiment`); the Prefect flows pass one that
submits a task (flows/). Either way the loop, the skips and the retries are the same.

Sharded stages (`shards` > 1, score): `call_stage` makes one call per shard, at once where the caller can (a
`Caller`'s `many`: Prefect futures on the flow's task runner, so Dask spreads them over its workers; a thread pool
on the direct path), then writes the stage manifest once every shard is complete (`finish_shards`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.config import RunConfig, load_config
from pipeline.core.records import Record
from pipeline.engines.servers import check_served, server_log_dir, sharing
from pipeline.run import open_run
from pipeline.stages import ROUND_STAGES, get_stage, served_sections
from pipeline.stages.runner import REPO, RetryPolicy, finish_shards, record_timing, round_s, run_stage, stage_done
from pipeline.store import Store, round_stats

log = logging.getLogger("pipeline.run")

StageCall = Callable[..., dict]


@dataclass(frozen=True)
class Caller:
    """A stage caller that can also make several calls at once (a stage's shards): `many(kwargs list)` returns
    their results in order, and raises the first failure only once every call has ended (none keeps writing)."""

    one: StageCall
    many: Callable[[list[dict]], list[dict]]

    def __call__(self, **kw) -> dict:
        return self.one(**kw)


def fan_out(call: StageCall, kws: list[dict]) -> list[dict]:
    """Several stage calls: at once through a `Caller`, one after another through a plain function."""
    return call.many(kws) if isinstance(call, Caller) else [call(**kw) for kw in kws]


def call_stage(call: StageCall, stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
               only_failed: bool = False, shards: int = 1, wait: bool = False) -> dict:
    """One stage of a round through `call`. A shardable stage with `shards` > 1 is `shards` calls, one per shard
    (each skips or resumes by its own manifest), then the stage manifest once all are complete; the result is
    run_stage's for the whole stage (wall time from the first shard to the manifest), with the shards' results.
    `wait`: the manifest's writer waits for another holder of the stage's lease (the calls wait as `call` says)."""
    stage_args = {"stage": stage, "run_id": run_id, "round": round, "store_root": store_root, "sets": sets}
    stage_args |= {"only_failed": True} if only_failed else {}
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards == 1 or not get_stage(stage).shardable:
        return call(**stage_args)
    if not only_failed and stage_done(stage, run_id, round, store_root, sets):
        return call(**stage_args)  # a finished stage is one skip, not one per shard
    t0 = time.perf_counter()
    parts = fan_out(call, [{**stage_args, "shard": (i, shards)} for i in range(shards)])
    res = finish_shards(stage, run_id, round, store_root, shards, sets, only_failed, wait)
    res = dataclasses.replace(res, wall_s=round_s(time.perf_counter() - t0), shards=tuple(parts))
    record_timing(store_root, run_id, res)
    log.info("%s round %d %s: %d shards in %.1fs %s", run_id, round, stage, shards, res.wall_s, res.counts)
    return res


def resolve_config(config: str | Path) -> Path:
    """A relative path is tried against the working directory, then the repository (served flows)."""
    p = Path(config)
    if p.is_file() or p.is_absolute():
        return p
    return REPO / p if (REPO / p).is_file() else p


def study_config(config: str | Path, sets: list[str] | None = None,
                 run_id: str | None = None) -> tuple[Path, list[str], RunConfig]:
    """A study's config: (the resolved path, the overrides as a list, the config with `run_id` in place of its own
    when given); a study names its runs after that run id."""
    path, sets = resolve_config(config), list(sets or [])
    cfg = load_config(path, sets)
    return path, sets, (cfg.model_copy(update={"run_id": run_id}) if run_id else cfg)


def direct_call(policy: RetryPolicy | None = None, isolate: bool | None = None, wait: bool = False) -> Caller:
    """A stage caller without Prefect: the runner, retried by `policy`, with the stage's wall time recorded. Shards
    run at once in threads, each in its own child process; with isolate=False (all in this process) one after
    another, as the sandbox and the executor client of this process are not shared between threads. `wait`: a
    stage another process is running is waited for (run_stage), not refused."""
    policy = policy or RetryPolicy()

    def call(stage: str, run_id: str, round: int, store_root: str, sets: list[str] | None = None,
             only_failed: bool = False, shard: tuple[int, int] | None = None) -> dict:
        res = policy.call(run_stage, stage, run_id, round, store_root, sets, only_failed, isolate, shard, wait)
        record_timing(store_root, run_id, res)
        log.info("%s round %d %s%s %s %s", run_id, round, stage, f" shard {res.shard}" if res.shard else "",
                 "skipped" if res.skipped else f"{res.wall_s:.1f}s", res.counts)
        return res

    def many(kws: list[dict]) -> list[dict]:
        if isolate is False or len(kws) < 2:
            return [call(**kw) for kw in kws]
        with ThreadPoolExecutor(len(kws), thread_name_prefix="shard") as pool:  # the with waits for every call
            futures = [pool.submit(call, **kw) for kw in kws]
        return [f.result() for f in futures]

    return Caller(call, many)


class RoundObserver(Protocol):
    """What a caller of `run_rounds` may plug in to hear of its rounds (the stages know no tracker)."""

    def check(self, cfg) -> None: ...

    def round_done(self, store: Store, run_id: str, cfg) -> None: ...


@dataclass(kw_only=True)
class RoundResult(Record):
    """One round of `run_rounds`: its mean and best score over the round's scored workflows and each stage's wall
    seconds in this call (a stage skipped as done: about 0; a round not entered: none)."""

    round: int
    mean_score: float | None = None
    best_score: float | None = None
    wall_s: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass(kw_only=True)
class RoundsSummary(Record):
    """What `run_rounds` returns: the run, its store and a `RoundResult` per round."""

    run_id: str
    store: str
    rounds: list[RoundResult] = dataclasses.field(default_factory=list)
    NESTED = {"rounds": RoundResult}


def run_rounds(config: str | Path, rounds: int | None, run_id: str | None, call: StageCall,
               after_round: Callable[[str, str, int], None] | None = None, sets: list[str] | None = None,
               shards: int = 1, observer: RoundObserver | None = None, wait: bool = False) -> RoundsSummary:
    """Open (freeze) the run once, then call each stage of each round in order; returns a summary.

    `sets` are per-invocation overrides (`key=value`, as `--set`) given to every stage; the first call
    of a new run freezes them into its config. `after_round(run_id, store_root, k)` runs after round k.
    `shards`: the score stage as that many shards (`call_stage`); not part of the config, as the store's result
    is the same for any count. `observer` (e.g. the experiment trackers, pipeline.studies.tracking.TRACKERS) checks the
    run's config before any work and hears of each finished round.
    One loop per run: the run's lease (`<run>/_leases/run`) is held throughout, so a second `pipeline run`, iterate
    flow run or experiment seed on the same run id fails at once naming the first (`LeaseHeld`), or with `wait`
    waits for it, then skips what it finished; stage commands on the run take only their stage's lease.
    A round whose checkpoint was lost after its train stage finished (a store cloned from git without its weights)
    comes back from its kept copy where the store has one (`restore_kept_checkpoints`), else trains again; the later
    rounds made from the lost weights are first moved aside (`set_aside_stale_rounds`). The rounds before the last
    finished one (`settled_round`) are not entered: nothing left to run reads their weights.
    """
    ctx = open_run(resolve_config(config), run_id, 0, sets)
    check_served(ctx.cfg)  # vLLM missing, model missing, port taken: an error now, not after round 0's rollout
    store_root, run_id = str(ctx.store.root), ctx.run_id
    rounds = rounds or ctx.cfg.rounds
    if observer is not None:
        observer.check(ctx.cfg)  # e.g. a missing tracker package fails before any work
    walls: dict[int, dict[str, float]] = {}
    with ctx.store.lease(run_id, "run", f"run {run_id!r} (its rounds)", wait=wait):
        restore_kept_checkpoints(ctx.store, run_id)
        since = settled_round(ctx.store, run_id, rounds, ctx.frozen_hash)
        set_aside_stale_rounds(ctx.store, run_id, rounds, since)  # under the lease: no other loop uses those rounds
        with shared_executor(ctx, rounds, sets, since):
            for k in range(since, rounds):
                for stage in ROUND_STAGES:
                    res = call_stage(call, stage, run_id, k, store_root, sets, shards=shards, wait=wait)
                    walls.setdefault(k, {})[stage] = res.wall_s
                if after_round is not None:
                    after_round(run_id, store_root, k)
                if observer is not None:
                    observer.round_done(ctx.store, run_id, ctx.cfg)
    stats = round_stats(Store(store_root), run_id)
    per_round = [RoundResult(round=r["round"], mean_score=r["mean_score"], best_score=r["best_score"],
                             wall_s=walls.get(r["round"], {}))
                 for r in stats.iter_rows(named=True) if r["round"] < rounds]
    return RoundsSummary(run_id=run_id, store=store_root, rounds=per_round)


def settled_round(store: Store, run_id: str, rounds: int, frozen_hash: str) -> int:
    """The last round below `rounds` whose every stage finished for the run's config (`frozen_hash`, as
    RunContext.done) with its checkpoint whole, else 0. The rounds before it are history: what is left to run reads
    only its checkpoint (round k+1 samples from checkpoint k, starts from it and is held to it), so an earlier
    round's pruned checkpoint (a clone of a finished run keeps only its last round's adapter) is no reason to train
    that round again and make the finished rounds after it stale."""
    for k in sorted((k for k in store.rounds_written(run_id) if k < rounds), reverse=True):
        made = [store.manifest(run_id, k, name) for name in ROUND_STAGES]
        if all(m is not None and m["config_hash"] == frozen_hash for m in made) \
                and store.checkpoint_complete(run_id, k):
            return k
    return 0


def lost_weights(store: Store, run_id: str, since: int = 0) -> int | None:
    """The first round from `since` on (`settled_round`) whose checkpoint-making stage (train) finished, by its
    manifest, but whose checkpoint is no longer complete (a store cloned from git, which keeps no weights; a pruned
    folder): that stage counts as unfinished and trains other weights than the ones the later rounds sampled and
    trained with. None: no such round."""
    makers = [name for name in ROUND_STAGES if get_stage(name).checkpoint]
    for k in store.rounds_written(run_id):
        made = any(store.manifest(run_id, k, m) is not None for m in makers)
        if k >= since and made and not store.checkpoint_complete(run_id, k):
            return k
    return None


def restore_kept_checkpoints(store: Store, run_id: str) -> list[int]:
    """Every round whose train stage finished but whose checkpoint is gone, restored from the copy the experiment
    keeps of it (Store.restore_checkpoint: made from the same weights, rounded to float16), so that nothing trains
    again; returns those rounds. What has no such copy stays lost (`lost_weights`)."""
    back = [k for k in store.rounds_written(run_id) if store.restore_checkpoint(run_id, k)]
    if back:
        log.warning("run %s: the checkpoints of rounds %s were gone (a fresh clone?) and are restored from their kept "
                    "copies under %s (float16-rounded weights)", run_id, back, store.adapter_dir(run_id, 0).parent)
    return back


def set_aside_stale_rounds(store: Store, run_id: str, rounds: int, since: int = 0) -> list[int]:
    """Before a lost round (`lost_weights`) below `rounds` trains again: every later round with anything in the store
    was drawn from (or trained against) the lost weights, so skipping its finished stages would train on samples the
    new policy never drew. They are moved intact to `<run>/stale/<UTC stamp>/` (Store.set_aside: no view reads them)
    and run again; returns them. An s3:// store: a StoreError naming what to move by hand."""
    lost = lost_weights(store, run_id, since)
    later = [] if lost is None or lost >= rounds else [j for j in store.rounds_written(run_id) if j > lost]
    if not later:
        return []
    why = f"run {run_id}: round {lost}'s checkpoint is gone and trains again, so rounds {later} are stale"
    where = store.set_aside(run_id, [store.round_dir(run_id, j) for j in later], why)
    log.warning("run %s: round %d's train stage finished but its checkpoint is gone, so it trains again; rounds %s "
                "were made from the lost weights: moved, intact, to %s, and run again", run_id, lost, later, where)
    return later


def shared_executor(ctx, rounds: int, sets: list[str] | None, since: int = 0) -> contextlib.AbstractContextManager:
    """One executor server for the rounds' stages that call it (pipeline.engines.servers.sharing) when more than
    one of them is left to run; a single stage starts its own as before."""
    if ctx.cfg.executor.serve is None:
        return contextlib.nullcontext()
    store_root = str(ctx.store.root)
    left = sum(not stage_done(stage, ctx.run_id, k, store_root, sets)
               for k in range(since, rounds) for stage in ROUND_STAGES
               if "executor" in served_sections(get_stage(stage), ctx.cfg))
    return sharing(ctx.cfg, server_log_dir(ctx.store, ctx.run_id, "shared")) if left > 1 else contextlib.nullcontext()
