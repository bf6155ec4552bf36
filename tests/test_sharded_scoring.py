"""Sharded scoring: a round's score stage split by query into shards that a Dask cluster (2 worker processes) runs
through the Prefect `score` flow; the store ends the same as an unsharded run's, and a killed shard resumes alone."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import distributed
import pyarrow.parquet as pq
import pytest
from prefect_dask import DaskTaskRunner
from test_scoring import SOLVER, make_run

from flows.score import score
from pipeline.run import open_run
from pipeline.stages import STAGES, Shard
from pipeline.stages.runner import StageError, finish_shards, run_stage
from pipeline.store import Store

N_QUERIES = 6  # chain_sum-0-0..3 hash to shard 0 of 2, -4 and -5 to shard 1
SLOW = "import asyncio\nasync def solve(problem):\n    await asyncio.sleep(0.2)\n    return '0'\n"
WORKFLOWS = [SOLVER, "def solve(p): return 1", SLOW]  # ok 1.0, invalid 0, ok 0.0
REPS = 2
RUNS = N_QUERIES * len(WORKFLOWS) * REPS


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes of one thread each, on the loopback interface only."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as c, distributed.Client(c) as client:
        yield c, client


def _flow(cluster):
    return score.with_options(task_runner=DaskTaskRunner(address=cluster[0].scheduler_address))


def _queries_of(store_root: str) -> dict[int, set[str]]:
    qids = set(Store(store_root).read("queries", "t", 0)["query_id"])
    return {i: {q for q in qids if Shard(i, 2).owns(q)} for i in range(2)}


def _rows(store_root: str) -> dict[tuple[str, int], tuple[str, float, int]]:
    """(gen_id, rep) -> (status, score, attempt); fails on a duplicated key."""
    df = Store(store_root).read("scores", "t", 0)
    keys = list(zip(df["gen_id"], df["rep"], strict=True))
    assert len(keys) == len(set(keys)), "a (gen_id, rep) was scored twice"
    return {k: (s, sc, a) for k, s, sc, a in zip(keys, df["status"], df["score"], df["attempt"], strict=True)}


def _part_queries(store_root: str) -> list[set[str]]:
    return [set(pq.read_table(p, columns=["query_id"])["query_id"].to_pylist())
            for p in Store(store_root).parts("scores", "t", 0)]


class ShardWatch(threading.Thread):
    """Watches the shards' child processes (`python -m pipeline.stages score ... --store ROOT --shard i/n`): records
    each one's parent (the process that ran the shard: a Dask worker), and SIGKILLs the victim's child once it has
    written at least one row of its queries; it watches on until every shard's parent is known."""

    def __init__(self, store_root: str, victim: Shard, victim_queries: set[str], deadline_s: float = 180):
        super().__init__(daemon=True)
        self.root, self.victim, self.queries, self.deadline_s = store_root, victim, victim_queries, deadline_s
        self.parents: dict[str, int] = {}  # shard -> pid of the child's parent
        self.killed: int | None = None

    def run(self) -> None:
        read: set[Path] = set()
        rows, deadline = 0, time.monotonic() + self.deadline_s
        while (self.killed is None or len(self.parents) < self.victim.count) and time.monotonic() < deadline:
            for p in set(Store(self.root).parts("scores", "t", 0)) - read:
                read.add(p)
                rows += sum(q in self.queries for q in pq.read_table(p, columns=["query_id"])["query_id"].to_pylist())
            children = _shard_children(self.root)
            self.parents |= {shard: ppid for shard, (_, ppid) in children.items()}
            if self.killed is None and rows >= 1 and str(self.victim) in children:
                self.killed = children[str(self.victim)][0]
                os.kill(self.killed, signal.SIGKILL)
            time.sleep(0.02)


def _shard_children(store_root: str) -> dict[str, tuple[int, int]]:
    """shard -> (pid, parent pid) of the live stage children scoring a shard of the store at `store_root`."""
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        if "pipeline.stages" in args and store_root in args and "--shard" in args and stat[0] != "Z":
            out[args[args.index("--shard") + 1]] = (int(proc.name), int(stat[1]))
    return out


@pytest.mark.usefixtures("shared_sandbox")  # the one-shard reference scores in this process
def test_shards_on_two_dask_workers_resume_alone_and_match_a_one_shard_run(harness, cluster, tmp_path):
    _, ref_root = make_run(tmp_path / "one", WORKFLOWS, n_queries=N_QUERIES, reps=REPS)
    _, root = make_run(tmp_path / "two", WORKFLOWS, n_queries=N_QUERIES, reps=REPS, batch_size=1)
    run_stage("score", "t", 0, ref_root, isolate=False)  # the reference: one shard, in this process
    st, victim, other = Store(root), Shard(0, 2), Shard(1, 2)
    queries = _queries_of(root)
    assert all(queries.values()), "the test data must give both shards queries"
    victim_runs = len(queries[victim.index]) * len(WORKFLOWS) * REPS

    # 1. the victim shard's child is killed midway: the flow fails, the other shard completes, no stage manifest
    watch = ShardWatch(root, victim, queries[victim.index])
    watch.start()
    state = _flow(cluster)("t", 0, only_failed=False, store=root, retries=0, shards=2, return_state=True)
    watch.join()
    assert watch.killed is not None, "the victim shard's child was never seen writing"
    assert state.is_failed() and "round 0 score shard 0/2: child killed by signal 9" in state.message
    # the shards ran on both Dask workers: each child's parent is a different worker process
    worker_pids = set(cluster[1].run(os.getpid).values())
    assert len(worker_pids) == 2 and os.getpid() not in worker_pids
    assert sorted(watch.parents) == ["0/2", "1/2"] and set(watch.parents.values()) == worker_pids
    before = _rows(root)
    victim_done = {k for k in before if k[0].split("#")[0] in queries[victim.index]}
    assert victim_done, "the victim shard was killed before it wrote a row"
    assert len(victim_done) < victim_runs, "the victim shard finished before the kill"
    assert len(before) - len(victim_done) == RUNS - victim_runs, "the other shard finished all its rows"
    assert st.manifest("t", 0, other.manifest("score")) is not None
    assert st.manifest("t", 0, victim.manifest("score")) is None
    assert st.manifest("t", 0, "score") is None, "the stage manifest was written with a shard unfinished"
    df = st.read("scores", "t", 0)
    created = dict(zip(zip(df["gen_id"], df["rep"], strict=True), df["created_at"], strict=True))

    # 2. the same flow again: the finished shard is skipped, the victim runs only its missing rows
    out = _flow(cluster)("t", 0, only_failed=False, store=root, retries=0, shards=2)
    victim_res, other_res = out.shards
    assert [victim_res.shard, other_res.shard] == ["0/2", "1/2"]
    assert other_res.skipped is True, "the finished shard ran again"
    assert victim_res.skipped is False and victim_res.counts["ran"] == victim_runs - len(victim_done)
    assert {victim_res.pid, other_res.pid} <= worker_pids
    df = st.read("scores", "t", 0)
    kept = {k: c for k, c in zip(zip(df["gen_id"], df["rep"], strict=True), df["created_at"], strict=True)
            if k in created}
    assert kept == created, "a finished row was rewritten"

    # 3. the store equals the one-shard run's; every part holds one shard's queries only
    got, ref = _rows(root), _rows(ref_root)
    assert len(ref) == RUNS and got == ref, "the sharded store differs from the one-shard run's"
    assert {v[0] for v in got.values()} == {"ok", "invalid"} and {v[1] for v in got.values()} == {0.0, 1.0}
    assert st.manifest("t", 0, "score")["counts"] == Store(ref_root).manifest("t", 0, "score")["counts"]
    for qs in _part_queries(root):
        assert any(qs <= queries[i] for i in range(2)), f"a part mixes the shards' queries: {qs}"


def test_finish_refuses_until_every_shard_is_complete_and_shards_are_checked(tmp_path, monkeypatch):
    import dataclasses

    import yaml

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"run_id": "t", "rounds": 1, "store": {"root": str(tmp_path / "runs")}}))
    ctx = open_run(p, "t")
    root = str(ctx.store.root)
    merged = []
    monkeypatch.setitem(STAGES, "score", dataclasses.replace(
        STAGES["score"], merge=lambda ctx, **kw: merged.append(1) or ctx.finish("score", runs=0) or {}))
    ctx.finish(Shard(0, 3).manifest("score"), runs=0)
    ctx.finish(Shard(2, 3).manifest("score"), runs=0)
    with pytest.raises(StageError, match="shard.s. 1/3 not complete") as e:
        finish_shards("score", "t", 0, root, 3)
    assert e.value.transient and merged == [] and ctx.store.manifest("t", 0, "score") is None
    ctx.finish(Shard(1, 3).manifest("score"), runs=0)
    assert finish_shards("score", "t", 0, root, 3).skipped is False and merged == [1]
    assert ctx.store.manifest("t", 0, "score") is not None
    with pytest.raises(ValueError, match="shard index 3 out of range for 3 shards"):
        run_stage("score", "t", 0, root, shard=(3, 3))
    with pytest.raises(ValueError, match="stage 'curate' cannot be sharded"):
        run_stage("curate", "t", 0, root, shard=(0, 2))
    with pytest.raises(ValueError, match="bad shard"):
        Shard.parse("1-of-2")


@pytest.mark.usefixtures("shared_sandbox")  # `pipeline score` scores in this process
def test_cli_scores_shards_one_after_another_and_an_empty_shard_completes(tmp_path):
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.studies.report import stage_timings

    _, root = make_run(tmp_path, [SOLVER, "def solve(p): return 1"], n_queries=2)
    owners = sorted(i for q in _queries_of(root)[0] | _queries_of(root)[1] for i in range(3) if Shard(i, 3).owns(q))
    assert owners == [0, 2], "the test data must leave shard 1 of 3 empty"
    res = CliRunner().invoke(app, ["score", "--run-id", "t", "--store", root, "--shards", "3"])
    assert res.exit_code == 0, res.output
    st = Store(root)
    assert [st.manifest("t", 0, Shard(i, 3).manifest("score"))["counts"]["runs"] for i in range(3)] == [2, 0, 2]
    assert st.manifest("t", 0, "score")["counts"] == {"runs": 4, "workflows": 4, "by_status": {"ok": 2, "invalid": 2}}
    lines = [json.loads(x) for x in (st.run_dir("t") / "timings.jsonl").read_text().splitlines()]
    assert [x.get("shard") for x in lines] == ["0/3", "1/3", "2/3", None]
    assert stage_timings(st, "t")["wall_s"].to_list() == [lines[-1]["wall_s"]], "the report shows the stage's total"
    res = CliRunner().invoke(app, ["score", "--run-id", "t", "--store", root, "--shards", "3"])
    assert res.exit_code == 0 and "'skipped': True" in res.output
    assert len((st.run_dir("t") / "timings.jsonl").read_text().splitlines()) == 5, "a finished stage is one skip"
    res = CliRunner().invoke(app, ["score", "--run-id", "t", "--store", root, "--shards", "0"])
    assert res.exit_code == 2


def test_pipeline_run_path_scores_shards_in_threads_then_merges(tmp_path, monkeypatch):
    """`pipeline run --shards N`: direct_call makes the N shard calls at once (threads), then one merge."""
    import dataclasses

    from test_flows import FakeStages, _config, install_stages

    from pipeline.stages.rounds import direct_call, run_rounds
    from pipeline.stages.runner import RetryPolicy

    fake, calls, barrier = FakeStages(), [], threading.Barrier(2, timeout=30)
    make = fake.make

    def shard_score(ctx, only_failed=False, shard=None):
        barrier.wait()  # both shards are in flight at once, or this times out
        calls.append((str(shard), threading.current_thread().name))
        ctx.finish(shard.manifest("score"), runs=1)
        return {"runs": 1}

    def merge(ctx, only_failed=False):
        calls.append(("merge", threading.current_thread().name))
        return make("score")(ctx)

    install_stages(monkeypatch, make)
    monkeypatch.setitem(STAGES, "score", dataclasses.replace(STAGES["score"], fn=shard_score, merge=merge))
    out = run_rounds(_config(tmp_path, rounds=1), None, "d", direct_call(RetryPolicy(0, 0)), shards=2)
    assert sorted(c[0] for c in calls[:2]) == ["0/2", "1/2"] and calls[2] == ("merge", "MainThread")
    assert len({c[1] for c in calls[:2]}) == 2 and out.rounds[0].mean_score == 0.25
    assert Store(tmp_path / "runs").manifest("d", 0, "score")["counts"] == {"rows": 1}


def test_dask_resources_keep_a_stage_on_the_workers_that_have_them(harness, cluster, tmp_path, monkeypatch):
    """PIPELINE_DASK_RESOURCES_SCORE=GPU=1 (flows/runners.py `placement`): all 4 shards of a round, submitted at once,
    run on the one worker started with `--resources GPU=1`, none on the two plain ones (which idle 1-thread workers
    otherwise share them with). The shards run in the worker's own process (`in_process`: placement is applied to
    the task either way, and a shard's result names the process that ran `run_stage`, the worker), so the test
    starts no stage child per shard; isolation and kills of shard children are the test above's."""
    import subprocess
    import sys

    from prefect import flow

    from flows.tasks import submitting_call
    from pipeline.stages.runner import RetryPolicy

    c, client = cluster
    gpu_worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", c.scheduler_address,
                                   "--nthreads", "1", "--resources", "GPU=1", "--no-dashboard", "--host", "127.0.0.1",
                                   "--name", "gpu"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client.wait_for_workers(3, timeout=120)
        gpu = next(a for a, w in client.scheduler_info()["workers"].items() if w.get("resources", {}).get("GPU"))
        gpu_pid = client.run(os.getpid, workers=[gpu])[gpu]
        _, root = make_run(tmp_path, WORKFLOWS, n_queries=N_QUERIES)
        monkeypatch.setenv("PIPELINE_DASK_RESOURCES_SCORE", "GPU=1")

        @flow(task_runner=DaskTaskRunner(address=c.scheduler_address))
        def fan_out(store_root: str) -> list[dict]:
            return submitting_call(RetryPolicy(0, 0.0), in_process=True).many(
                [{"stage": "score", "run_id": "t", "round": 0, "store_root": store_root, "shard": (i, 4)}
                 for i in range(4)])

        results = fan_out(root)
        assert [r.pid for r in results] == [gpu_pid] * 4
        assert Store(root).manifest("t", 0, "score.shard-3-of-4") is not None
    finally:
        gpu_worker.terminate()
        gpu_worker.wait(timeout=60)
