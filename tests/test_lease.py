"""One writer per stage: the lease of a (run, round, stage[, shard]) and of a run's rounds, on a local store
(an OS file lock; the S3 lease is tested in tests/test_store_s3.py against moto).

Two processes start the same stage through the real CLI (and two Prefect flow runs the same run id); the stage
functions are fakes that write rows like the real ones and block at a known point (they print `inside STAGE`, then
read a FIFO the test writes to), so "at once" is decided by that point, never by sleeps."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import wait_until

from pipeline.run import open_run
from pipeline.store import LeaseHeld, Store

REPO = Path(__file__).resolve().parents[1]

# The `pipeline` CLI (or the iterate flow) with fake stage functions. Each call appends its pid to CALLS; with
# HOLD=1 it writes part of its rows, prints `inside STAGE` and blocks until the test writes to the GATE fifo.
FAKE = textwrap.dedent("""
    import dataclasses, os, sys
    from pipeline import stages

    def make(name):
        def fn(ctx, only_failed=False):
            with open(os.environ["CALLS"], "a") as f:
                f.write(f"{name} {os.getpid()}\\n")
            st, run, k = ctx.store, ctx.run_id, ctx.round
            if name == "score":  # resumes per (gen, rep) like the real stage: rows already written are kept
                have = set(st.read("scores", run, k)["gen_id"].to_list())
                rows = [{"gen_id": f"g{i}", "rep": 0, "attempt": 0, "status": "ok", "score": i / 4}
                        for i in range(4) if f"g{i}" not in have]
                st.write("scores", rows[:2], run, k)
            elif name == "train":  # starts over (the runner discards an unfinished attempt's rows)
                rows = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(4)]
                st.write("train_metrics", rows[:2], run, k)
            if os.environ.get("HOLD") in ("1", name):
                os.write(1, f"inside {name}\\n".encode())  # not print: a flow's log_prints takes those
                with open(os.environ["GATE"]) as gate:  # blocks until the test opens the fifo for writing
                    gate.read()
            if name == "score":
                st.write("scores", rows[2:], run, k)
            elif name == "train":
                st.write("train_metrics", rows[2:], run, k)
            ctx.finish(name, rows=4)
            return {"rows": 4}
        return fn

    for name, st in list(stages.STAGES.items()):
        stages.STAGES[name] = dataclasses.replace(st, fn=make(name), isolated=False, checkpoint=False)

    if sys.argv[1] == "flow":  # iterate flow run: flow CONFIG RUN_ID
        from flows.iterate import iterate
        iterate(sys.argv[2], run_id=sys.argv[3], in_process=True, retry_delay_s=0, rounds=1)
    else:
        from pipeline.cli import app
        app(sys.argv[1:])
""")

TABLE = {"score": "scores", "train": "train_metrics"}


def _new_run(tmp_path: Path, run_id: str):
    """A one-round run under tmp_path/runs, its config frozen (tmp_path/c.yaml); its RunContext."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: {run_id}\nrounds: 1\nstore:\n  root: {tmp_path / 'runs'}\n")
    return open_run(cfg, run_id)


@pytest.fixture
def setup(tmp_path):
    """A run `conc` (frozen config), the fake CLI script, a calls log and a gate fifo."""
    _new_run(tmp_path, "conc")
    script = tmp_path / "fake_cli.py"
    script.write_text(FAKE)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CALLS": str(tmp_path / "calls.txt"), "GATE": str(gate),
           "OMP_WAIT_POLICY": "PASSIVE"}
    return tmp_path, script, env


def _cmd(script: Path, stage: str, *extra: str) -> list[str]:
    return [sys.executable, str(script), stage, str(script.parent / "c.yaml"), "--run-id", "conc", "--round", "0",
            *extra]


def _start_holder(script: Path, env: dict, args: list[str], hold: str = "1") -> subprocess.Popen:
    """Start the fake CLI with HOLD (1: any stage) and return once it is inside that stage (holding its lease)."""
    proc = subprocess.Popen(args, env={**env, "HOLD": hold}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # EOF (the process died) fails below instead of hanging
    if not line.strip().startswith("inside"):  # it ended before its stage: show why
        proc.wait(timeout=60)
        pytest.fail(f"the holder ended with {proc.returncode} before its stage: {proc.stderr.read()[-3000:]}")
    return proc


def _open_gate(tmp_path: Path) -> None:
    with open(tmp_path / "gate", "w") as g:
        g.write("go")


def _calls(tmp_path: Path) -> list[str]:
    p = tmp_path / "calls.txt"
    return p.read_text().splitlines() if p.is_file() else []


@pytest.mark.parametrize("stage", ["score", "train"])
def test_a_second_invocation_of_a_running_stage_is_refused_naming_the_holder_and_changes_nothing(setup, stage):
    tmp_path, script, env = setup
    first = _start_holder(script, env, _cmd(script, stage))
    st = Store(tmp_path / "runs")
    parts_before = sorted(st.parts(TABLE[stage], "conc", 0))
    second = subprocess.run(_cmd(script, stage), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr
    err = " ".join(second.stderr.split())  # the message is wrapped by nothing but may be long
    assert f"run 'conc' round 0 {stage} is being written by another process: pid {first.pid} on host" in err
    assert f"{script.name} {stage} {script.parent / 'c.yaml'} --run-id conc --round 0" in err
    assert "since 20" in err and "--wait" in err
    assert sorted(st.parts(TABLE[stage], "conc", 0)) == parts_before, "the refused command wrote something"
    assert _calls(tmp_path) == [f"{stage} {first.pid}"], "the refused command ran the stage"
    _open_gate(tmp_path)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert st.read(TABLE[stage], "conc", 0).height == 4, "exactly one set of rows"
    assert st.manifest("conc", 0, stage)["counts"] == {"rows": 4}
    # once the holder has finished, the same command skips the stage (a reader needs no lease)
    again = subprocess.run(_cmd(script, stage), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "'skipped': True" in again.stdout and len(_calls(tmp_path)) == 1


def test_wait_blocks_on_the_lock_then_skips_what_the_holder_finished(setup):
    tmp_path, script, env = setup
    first = _start_holder(script, env, _cmd(script, "score"))
    waiter = subprocess.Popen(_cmd(script, "score", "--wait"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    seen = []
    for line in waiter.stderr:  # blocks on the lock: says so once, naming the holder
        seen.append(line)
        if "waiting for run 'conc' round 0 score" in line:
            break
    assert seen and f"pid {first.pid}" in seen[-1], seen
    assert waiter.poll() is None and _calls(tmp_path) == [f"score {first.pid}"]
    _open_gate(tmp_path)
    assert first.wait(timeout=300) == 0
    out, err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, err
    assert "'skipped': True" in out and "lease taken after" in err
    assert len(_calls(tmp_path)) == 1 and Store(tmp_path / "runs").read("scores", "conc", 0).height == 4


@pytest.mark.parametrize("stage", ["score", "train"])
def test_kill_9_of_the_holder_frees_the_stage_at_once_and_the_next_run_loses_and_duplicates_nothing(setup, stage):
    tmp_path, script, env = setup
    first = _start_holder(script, env, _cmd(script, stage))
    st = Store(tmp_path / "runs")
    assert st.read(TABLE[stage], "conc", 0).height == 2  # the holder's unfinished rows
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    nxt = subprocess.run(_cmd(script, stage), env=env, capture_output=True, text=True, timeout=300)  # no --wait
    assert nxt.returncode == 0, nxt.stderr
    pids = [c.split()[1] for c in _calls(tmp_path)]
    assert len(pids) == 2 and pids[0] == str(first.pid) != pids[1], "the next invocation ran the stage itself"
    df = st.read(TABLE[stage], "conc", 0)
    key = "gen_id" if stage == "score" else "step"
    assert sorted(df[key].to_list()) == sorted(set(df[key].to_list())) and df.height == 4, df
    assert st.manifest("conc", 0, stage)["counts"] == {"rows": 4}


def test_stages_and_runs_a_command_would_not_touch_run_at_once(tmp_path):
    """Another stage of the same round, the same stage of another round or another run: not held by the holder."""
    st = Store(tmp_path)
    with st.lease("conc", "round-0.score", "conc 0 score"):
        for run, name in (("conc", "round-0.curate"), ("conc", "round-1.score"), ("b", "round-0.score")):
            with st.lease(run, name, f"{run} {name}"):
                pass
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"), st.lease("conc", "round-0.score", "x"):
            pass


def test_shards_share_the_stage_and_exclude_a_whole_stage_call(tmp_path):
    from pipeline import stages
    from pipeline.stages import Shard
    from pipeline.stages.runner import StageError, stage_lease

    ctx, score = _new_run(tmp_path, "s"), stages.STAGES["score"]
    with stage_lease(ctx, score, Shard(0, 2), wait=False), stage_lease(ctx, score, Shard(1, 2), wait=False):
        e = _refused(stage_lease(ctx, score, Shard(0, 2), wait=False), "round 0 score shard 0/2: run 's' round 0 "
                     f"score shard 0/2 is being written by another process: pid {os.getpid()}", StageError)
        assert not e.transient, "a retry cannot help while the holder runs"
        _refused(stage_lease(ctx, score, None, wait=False), "round 0 score: run 's' round 0 score is being written",
                 StageError)
    with stage_lease(ctx, score, None, wait=False):  # all released: the whole stage
        _refused(stage_lease(ctx, score, Shard(1, 2), wait=False), "shard 1/2", StageError)


def _refused(lease, match: str, error: type[Exception] = LeaseHeld) -> Exception:
    """Taking `lease` (a lease's context manager) is refused with `error` matching `match`; returns the error."""
    with pytest.raises(error, match=match) as e, lease:
        pass
    return e.value


def test_a_waiter_in_this_process_blocks_until_the_holder_releases(tmp_path, caplog):
    """flock belongs to the open file, not the process: two leases in one process (threads, in-process flow runs)
    exclude each other, and a waiter blocks in the kernel until the holder releases."""
    st = Store(tmp_path)
    waiting, got = threading.Event(), threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "waiting for" in record.getMessage():
                waiting.set()

    handler = Seen()
    logging.getLogger("pipeline.store.lease").addHandler(handler)
    try:
        with st.lease("r", "round-0.train", "r train") as first:
            def take():
                with st.lease("r", "round-0.train", "r train", wait=True):
                    got.set()
            t = threading.Thread(target=take)
            t.start()
            assert waiting.wait(60), "the waiter did not report waiting"
            assert not got.is_set() and first.fd >= 0
        t.join(60)
        assert got.is_set()
    finally:
        logging.getLogger("pipeline.store.lease").removeHandler(handler)
    rec = json.loads((tmp_path / "r" / "_leases" / "round-0.train.holder.json").read_text())
    assert rec["pid"] == os.getpid() and rec["command"]


# ---- the stage's child process holds the lease with its parent ----------------------------------------------

CHILD_LAUNCHER = textwrap.dedent("""
    # PIPELINE_LAUNCHER_TRAIN: `python THIS -m pipeline.stages train ...`, with a fake train that reports which of
    # its open files is the lease and blocks
    import dataclasses, os, sys
    from pipeline import stages
    from pipeline.stages.runner import child_main

    def train(ctx):
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        print("child", os.getpid(), [f for f in fds if f.endswith(".lock")], flush=True)
        sys.stdin.read()  # until killed

    stages.STAGES["train"] = dataclasses.replace(stages.STAGES["train"], fn=train)
    sys.exit(child_main(sys.argv[3:]))
""")


def test_the_stage_child_shares_the_lease_and_the_kernel_frees_it_when_both_are_killed(tmp_path):
    _new_run(tmp_path, "k")
    launcher = tmp_path / "launcher.py"
    launcher.write_text(CHILD_LAUNCHER)
    parent_code = ("from pipeline.stages.runner import run_stage; "
                   f"run_stage('train', 'k', 0, {str(tmp_path / 'runs')!r}, isolate=True)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIPELINE_LAUNCHER_TRAIN": f"{sys.executable} {launcher}"}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=env, stdout=subprocess.PIPE, text=True,
                              stdin=subprocess.PIPE, start_new_session=True)
    line = parent.stdout.readline().split(maxsplit=2)
    assert line[0] == "child", line
    lock = tmp_path / "runs" / "k" / "_leases" / "round-0.train.lock"
    assert eval(line[2]) == [str(lock)], "the child does not hold the lease file open"  # noqa: S307 (its own list)
    st = Store(tmp_path / "runs")
    _refused(st.lease("k", "round-0.train", "k train"), f"pid {parent.pid}")  # the record names the runner
    child = int(line[1])
    os.kill(parent.pid, signal.SIGKILL)  # the runner only: its child gets SIGKILL from the kernel (PDEATHSIG)
    parent.wait(timeout=60)
    wait_until(lambda: not _alive(child), 60, "the stage child outlived its killed parent")
    # both gone: free without --wait. Not always on the instant: the kernel may release the last reference to a
    # killed process's files from a work queue after the process is reaped (seen: the flock stayed a few ms)
    wait_until(lambda: _free(st), 10, "the lease outlived both of its holders")


def _free(st: Store) -> bool:
    try:
        with st.lease("k", "round-0.train", "k train"):
            return True
    except LeaseHeld:
        return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---- Prefect: a second flow run on the same run id ------------------------------------------------------------


def test_a_second_iterate_flow_run_on_the_same_run_id_fails_naming_the_first(harness, setup, monkeypatch):
    """Flow run A (another process, on the same Prefect server) is inside its score stage; flow run B for the same run
    id ends Failed at once, its message naming A's flow run and process; A then completes alone."""
    from prefect.settings import PREFECT_API_URL

    from flows.iterate import iterate
    from pipeline import stages

    tmp_path, script, env = setup
    first = _start_holder(script, {**env, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          [sys.executable, str(script), "flow", str(tmp_path / "c.yaml"), "conc"], hold="score")
    calls = []  # this process's stage calls: there must be none
    for name, st in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=lambda ctx, n=name: calls.append(n),
                                                                     isolated=False))
    state = iterate(str(tmp_path / "c.yaml"), run_id="conc", in_process=True, retry_delay_s=0, rounds=1,
                    return_state=True)
    assert state.is_failed() and calls == []
    msg = " ".join(state.message.split())
    assert f"run 'conc' (its rounds) is being written by another process: pid {first.pid} on host" in msg, msg
    assert "Prefect flow run 'iterate conc' (" in msg and "--wait" in msg
    _open_gate(tmp_path)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    st = Store(tmp_path / "runs")
    assert [c.split()[0] for c in _calls(tmp_path)] == ["rollout", "score", "curate", "train"], "one run, once"
    assert st.read("scores", "conc", 0).height == 4 and st.manifest("conc", 0, "train")["counts"] == {"rows": 4}
