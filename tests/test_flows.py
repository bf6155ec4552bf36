"""Flow wiring: skip/resume, retries, permanent failures, re-score, evaluate (fake stages), and one real round."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.evaluate import evaluate
from flows.iterate import iterate
from flows.score import score
from pipeline import stages
from pipeline.run import open_run
from pipeline.stages import runner
from pipeline.stages.rounds import direct_call, run_rounds
from pipeline.stages.runner import RetryPolicy, StageError, run_stage
from pipeline.store import Store
from pipeline.studies.evaluate import eval_run_id

REPO = Path(__file__).resolve().parents[1]


class FakeStages:
    """Stage functions that write a row and a manifest like the real ones; knobs inject failures."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.fail: dict[str, list[BaseException]] = {}  # stage -> exceptions to raise, in order
        self.score_leaves_failures = 0  # score calls that return without a manifest

    def make(self, stage):
        def fn(ctx, only_failed=False):
            self.calls.append((stage, ctx.round) if not only_failed else ("rescore", ctx.round))
            if self.fail.get(stage):
                raise self.fail[stage].pop(0)
            if stage == "score" and self.score_leaves_failures:
                self.score_leaves_failures -= 1
                return {"failed": 1}
            if stage == "rollout":
                ctx.store.write("generations", [{"gen_id": f"g{ctx.round}", "kind": "workflow", "query_id": "q",
                                                 "valid": True}], ctx.run_id, ctx.round)
            if stage == "score":
                ctx.store.write("scores", [{"gen_id": f"g{ctx.round}", "rep": 0, "attempt": 0, "status": "ok",
                                            "score": 0.25 * (ctx.round + 1)}], ctx.run_id, ctx.round)
            if stage == "train":
                ctx.store.checkpoint_dir(ctx.run_id, ctx.round).mkdir(parents=True)
            ctx.finish(stage, rows=1)
            return {"rows": 1}
        return fn

    def install(self, monkeypatch, make=None):
        install_stages(monkeypatch, make or self.make)
        return self


def install_stages(monkeypatch, make) -> None:
    """Replace each registered stage's function by make(name), in this process (fakes exist only here)."""
    for name, st in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=make(name), isolated=False,
                                                                     checkpoint=False))


def _config(tmp_path: Path, rounds: int = 2) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(f"run_id: t\nrounds: {rounds}\nstore:\n  root: {tmp_path / 'runs'}\n")
    return p


def test_iterate_runs_rounds_in_order_and_resumes(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    out = iterate(str(_config(tmp_path)), run_id="r", in_process=True, retry_delay_s=0)
    assert fake.calls == [(s, k) for k in (0, 1) for s in ("rollout", "score", "curate", "train")]
    assert [r["mean_score"] for r in out["rounds"]] == [0.25, 0.5]
    assert Store(tmp_path / "runs").manifest("r", 1, "train")["counts"] == {"rows": 1}
    # a second run with the same id does nothing: every manifest is complete
    fake.calls.clear()
    iterate(str(_config(tmp_path)), run_id="r", in_process=True, retry_delay_s=0)
    assert fake.calls == []
    timings = [json.loads(x) for x in (tmp_path / "runs" / "r" / "timings.jsonl").read_text().splitlines()]
    assert len(timings) == 16 and sum(t["skipped"] for t in timings) == 8


def test_half_done_round_resumes_at_the_missing_stage(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    ctx = open_run(_config(tmp_path, rounds=1), "r")
    ctx.finish("rollout", rows=4)  # rollout finished before a crash
    iterate(str(_config(tmp_path, rounds=1)), run_id="r", in_process=True, retry_delay_s=0)
    assert fake.calls == [("score", 0), ("curate", 0), ("train", 0)]


def test_transient_failure_retries_then_succeeds(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    fake.fail["curate"] = [ConnectionError("executor went away")]
    fake.score_leaves_failures = 1  # the stage returns with work left: Prefect retries it
    iterate(str(_config(tmp_path, rounds=1)), run_id="r", in_process=True, retry_delay_s=0)
    assert fake.calls == [("rollout", 0), ("score", 0), ("score", 0), ("curate", 0), ("curate", 0), ("train", 0)]


def test_permanent_failure_stops_the_run_naming_stage_round_reason(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    fake.fail["train"] = [ValueError("no curated rows")]
    state = iterate(str(_config(tmp_path, rounds=2)), run_id="r", in_process=True, retry_delay_s=0,
                    return_state=True)
    assert state.is_failed()
    assert "round 0 train: ValueError: no curated rows" in state.message
    assert fake.calls.count(("train", 0)) == 1, "a permanent failure is not retried"
    assert ("rollout", 1) not in fake.calls


def test_outage_then_rescore_then_iterate_continues_from_curation(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    fake.score_leaves_failures = 3  # executor down: the first attempt and both retries leave work
    state = iterate(str(_config(tmp_path, rounds=1)), run_id="r", in_process=True, retry_delay_s=0,
                    return_state=True)
    assert state.is_failed() and "round 0 score" in state.message and "work left" in state.message
    fake.calls.clear()
    res = score("r", 0, only_failed=True, store=str(tmp_path / "runs"), retry_delay_s=0)
    assert res.counts == {"rows": 1} and fake.calls == [("rescore", 0)], "re-score trains nothing"
    fake.calls.clear()
    iterate(str(_config(tmp_path, rounds=1)), run_id="r", in_process=True, retry_delay_s=0)
    assert fake.calls == [("curate", 0), ("train", 0)]


def test_evaluate_writes_only_a_derived_run(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    iterate(str(_config(tmp_path, rounds=1)), run_id="r", in_process=True, retry_delay_s=0)
    st = Store(tmp_path / "runs")
    before = sorted(p.relative_to(st.root) for p in (st.root / "r").rglob("*.parquet"))
    fake.calls.clear()
    out = evaluate("r", 0, store=str(st.root), in_process=True, retry_delay_s=0)
    assert out["eval_run_id"] == "r-eval-r0" and out["mean_at_l"] == 0.25 and out["best_at_l"] == 0.25
    assert fake.calls == [("rollout", 0), ("score", 0)]
    assert sorted(p.relative_to(st.root) for p in (st.root / "r").rglob("*.parquet")) == before
    ev = open_run(None, "r-eval-r0", 0, store_root=str(st.root)).cfg
    assert ev.benchmark.train_split == "test" and ev.generator.adapter == str(st.checkpoint_dir("r", 0))


def test_iterate_evaluates_each_round_when_asked(harness, tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    iterate(str(_config(tmp_path, rounds=2)), run_id="r", in_process=True, retry_delay_s=0, evaluate_split="test")
    per_round = ["rollout", "score", "curate", "train", "rollout", "score"]  # the eval run's two stages after train
    assert [c[0] for c in fake.calls] == per_round * 2
    assert {p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()} == {"r", "r-eval-r0", "r-eval-r1"}


def test_evaluate_refuses_a_round_without_checkpoint(tmp_path, monkeypatch):
    FakeStages().install(monkeypatch)
    open_run(_config(tmp_path, rounds=1), "r")
    from pipeline.config import ConfigError
    from pipeline.studies.evaluate import open_eval_run

    with pytest.raises(ConfigError, match="no checkpoint for round 3"):
        open_eval_run(str(tmp_path / "runs"), "r", 3)
    assert eval_run_id("r", -1) == "r-eval-base" and eval_run_id("r", 2, "validate") == "r-eval-validate-r2"


def test_direct_path_needs_no_prefect(tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    fake.fail["rollout"] = [TimeoutError("slow server")]
    out = run_rounds(_config(tmp_path, rounds=1), None, "d", direct_call(RetryPolicy(retries=2, delay_s=0)))
    assert fake.calls[:2] == [("rollout", 0), ("rollout", 0)] and out.rounds[0].mean_score == 0.25


def test_task_runner_specs():
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.runners import RunnerSpecError, task_runner_from_spec

    r = task_runner_from_spec("thread:3")
    assert isinstance(r, ThreadPoolTaskRunner) and r._max_workers == 3
    with pytest.raises(RunnerSpecError, match="unknown task runner"):
        task_runner_from_spec("slurm")


def test_dask_placement_from_the_environment(monkeypatch):
    import dask

    from flows.runners import RunnerSpecError, placement

    monkeypatch.setenv("PIPELINE_DASK_RESOURCES_TRAIN", "GPU=1, MEM=2.5")
    with placement("train"):
        assert dask.get_annotations() == {"resources": {"GPU": 1.0, "MEM": 2.5}}
    with placement("score"):  # not set for this stage: no annotation
        assert dask.get_annotations() == {}
    for bad in ("GPU", "GPU=one", "=1"):
        monkeypatch.setenv("PIPELINE_DASK_RESOURCES_TRAIN", bad)
        with pytest.raises(RunnerSpecError, match="NAME=AMOUNT|has no name"):
            placement("train")


def test_stages_run_on_dask_workers(harness, tmp_path, monkeypatch):
    """Scale-out switch: the same flow with a Dask task runner (optional extra: skipped without prefect-dask)."""
    prefect_dask = pytest.importorskip("prefect_dask")
    distributed = pytest.importorskip("distributed")
    fake = FakeStages().install(monkeypatch)
    workers = []
    make = fake.make

    def on_worker(stage):
        fn = make(stage)

        def wrapped(ctx, only_failed=False):
            workers.append(distributed.get_worker().address)  # raises outside a Dask worker
            return fn(ctx, only_failed)
        return wrapped

    install_stages(monkeypatch, on_worker)
    # threads, not processes: the fakes above exist only in this process
    runner = prefect_dask.DaskTaskRunner(cluster_kwargs={"n_workers": 1, "processes": False, "dashboard_address": None})
    out = iterate.with_options(task_runner=runner)(str(_config(tmp_path, rounds=1)), run_id="dk", in_process=True,
                                                    retry_delay_s=0)
    assert len(workers) == 4 and out["rounds"][0]["mean_score"] == 0.25


def test_cli_run_and_evaluate(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app

    FakeStages().install(monkeypatch)
    res = CliRunner().invoke(app, ["run", str(_config(tmp_path)), "--run-id", "c", "--retries", "0"])
    assert res.exit_code == 0, res.output
    assert "round 0: mean score 0.250" in res.output and "round 1: mean score 0.500" in res.output
    assert (tmp_path / "runs" / "c" / "report.html").is_file()
    res = CliRunner().invoke(app, ["evaluate", "c", "--round", "2", "--store", str(tmp_path / "runs")])
    assert res.exit_code == 2 and "no checkpoint for round 2" in res.output
    res = CliRunner().invoke(app, ["evaluate", "c", "--round", "1", "--store", str(tmp_path / "runs")])
    assert res.exit_code == 0 and "c-eval-r1: 1 queries, Mean@L 0.250, Best@L 0.250" in res.output


def test_child_process_reports_permanent_error(tmp_path):
    open_run(_config(tmp_path, rounds=1), "r")  # no generations: a real curate in a child would need data
    bad = tmp_path / "runs" / "r" / "config.yaml"
    bad.write_text(bad.read_text().replace("rounds: 1", "rounds: -1"))  # the child cannot open the run
    with pytest.raises(StageError) as e:
        runner._run_child("curate", "r", 0, str(tmp_path / "runs"), [], False)
    assert not e.value.transient and "rounds" in e.value.reason


def test_child_killed_by_signal_is_transient(tmp_path, monkeypatch):
    # A stage child killed by SIGKILL (OOM killer, operator) must be retried, not fail the run.
    script = tmp_path / "killme.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    real_run = runner.subprocess.run
    monkeypatch.setattr(runner.subprocess, "run", lambda cmd, **kw: real_run([sys.executable, str(script)], **kw))
    with pytest.raises(StageError) as e:
        runner._run_child("score", "r", 0, str(tmp_path), [], False)
    assert e.value.transient and "signal 9" in e.value.reason


def test_child_interrupted_by_sigint_stops_instead_of_retrying(tmp_path, monkeypatch):
    # Ctrl-C signals the whole process group; a parent whose waiting thread is not the main one saw only the child's
    # exit and retried the stage (a headroom study did, 2026-11-26)
    script = tmp_path / "interrupted.py"
    script.write_text("import os, signal\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                      "os.kill(os.getpid(), signal.SIGINT)\n")
    real_run = runner.subprocess.run
    monkeypatch.setattr(runner.subprocess, "run", lambda cmd, **kw: real_run([sys.executable, str(script)], **kw))
    with pytest.raises(KeyboardInterrupt, match="score: the stage child was interrupted"):
        runner._run_child("score", "r", 0, str(tmp_path), [], False)


def test_run_stage_skips_completed_stage_without_calling_it(tmp_path, monkeypatch):
    fake = FakeStages().install(monkeypatch)
    ctx = open_run(_config(tmp_path, rounds=1), "r")
    ctx.finish("curate", groups=7)
    res = run_stage("curate", "r", 0, str(ctx.store.root))
    assert res.skipped and res.counts == {"groups": 7} and fake.calls == []


# ---- real stages (embedded model, sandbox, local executor) ----------------------------------------------

# Hand-written workflows with different scores on basic_arithmetic ("Calculate 478 / 1 + -682."), so the
# round has score variance (real groups, real training) and executor calls that an outage can break.
SCRIPTED = [
    "async def solve(problem):\n"
    "    expr = problem.split('Calculate', 1)[1].strip().rstrip('.')\n"
    "    v = eval(expr)\n"
    "    return str(int(v)) if float(v).is_integer() else str(v)\n",
    "async def solve(problem):\n"
    "    out = await llm([{'role': 'user', 'content': problem}])\n"
    "    return out[0]\n",
    "import time\n\nasync def solve(problem):\n    time.sleep(1.5)\n    return '0'\n",
]


def scripted_rollout(ctx) -> None:
    """Stand-in for the sampling step only: queries and generations rows as rollout writes them (real
    benchmark items, real token ids), then the rollout manifest. Everything after it is real."""
    from pipeline.engines.benchmarks.base import load_benchmark
    from pipeline.engines.models import load_tokenizer

    tok = load_tokenizer(ctx.cfg.generator.model)
    items = load_benchmark(ctx.cfg.benchmark).items()
    ctx.store.write("queries", [{"split": "validate", "query_id": it.id, "benchmark": "procedural", "prompt": it.prompt,
                                 "reference": json.dumps(it.reference), "meta": json.dumps(it.meta)} for it in items],
                    ctx.run_id, ctx.round)
    rows = []
    for it in items:
        prompt = f"Write a workflow for: {it.prompt}"
        for slot, code in enumerate(SCRIPTED):
            text = f"```python\n{code}```"
            rows.append({"gen_id": f"r{ctx.round}-{it.id}-w{slot}", "kind": "workflow", "query_id": it.id,
                         "slot": slot, "prompt_text": prompt, "text": text, "valid": True,
                         "prompt_token_ids": tok(prompt)["input_ids"], "token_ids": tok(text)["input_ids"],
                         "model": ctx.cfg.generator.model, "backend": "scripted", "finish_reason": "stop"})
    ctx.store.write("generations", rows, ctx.run_id, ctx.round)
    ctx.finish("rollout", workflows=len(rows))


def _tiny_flow(tmp_path: Path, model: str) -> dict:
    """tests/data/tiny_flow.yaml in a store under `tmp_path`, with `model` (the tests' 2-layer `tiny_model`) as the
    generator and the local executor's model."""
    import yaml

    data = yaml.safe_load((REPO / "tests" / "data" / "tiny_flow.yaml").read_text())
    data["store"] = {"root": str(tmp_path / "runs")}
    data["generator"]["model"] = data["executor"]["model"] = model
    return data


def _scripted_config(tmp_path: Path, model: str, **scoring) -> Path:
    """_tiny_flow on 2 queries: the generator's tokenizer is what the scripted rows use and its checkpoint what train
    writes; what these tests check is the flow's resume and re-score protocol, which does not depend on the model's
    size or replies."""
    import yaml

    data = _tiny_flow(tmp_path, model)
    data["run_id"] = "scripted"
    data["benchmark"]["max_queries"] = 2
    data["scoring"].update(scoring)
    cfg = tmp_path / "scripted.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _group_gone(pgid: int, timeout_s: float) -> bool:
    """Poll /proc until no live (non-zombie) process of process group `pgid` is left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited while we looked
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(stat.parent.name)
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _score_keys(st: Store, run_id: str) -> list[tuple[str, int, int]]:
    df = st.read("scores", run_id, 0)
    return list(zip(df["gen_id"], df["rep"], df["attempt"], strict=True))


@pytest.mark.slow
def test_kill_9_during_scoring_then_resume_loses_and_duplicates_nothing(tmp_path, tiny_model):
    """`pipeline run` killed with SIGKILL (whole process group) mid-scoring, then run again with the same id."""
    cfg = _scripted_config(tmp_path, tiny_model, batch_size=1, concurrency=1, reps=2)  # one part per row, in order
    st = Store(tmp_path / "runs")
    scripted_rollout(open_run(cfg, "k"))
    gen_parts = sorted(st.parts("generations", "k", 0))
    cmd = [str(Path(sys.executable).parent / "pipeline"), "run", str(cfg), "--run-id", "k", "--rounds", "1"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while len(st.parts("scores", "k", 0)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole run: `pipeline run` and its stage child
    proc.wait()
    assert st.manifest("k", 0, "score") is None, "the kill must land during scoring"
    before = _score_keys(st, "k")
    assert 2 <= len(before) < 12
    assert _group_gone(proc.pid, timeout_s=30), "a process of the killed run is still alive"
    assert _score_keys(st, "k") == before  # nothing wrote after the kill
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    after = _score_keys(st, "k")
    assert set(before) <= set(after), "a finished row was lost"
    assert len(after) == len(set(after)) == 12, "a row was duplicated or is missing (2 queries x 3 workflows x 2)"
    assert {a for _, _, a in after} == {0}
    assert sorted(st.parts("generations", "k", 0)) == gen_parts, "rollout was repeated"
    timings = [json.loads(x) for x in (st.run_dir("k") / "timings.jsonl").read_text().splitlines()]
    assert timings[0] == {**timings[0], "stage": "rollout", "skipped": True}
    for stage in ("score", "curate", "train"):
        assert st.manifest("k", 0, stage) is not None
    best = st.sql("select max(score) s from latest_scores where run_id = 'k'")["s"][0]
    assert best == 1.0, "the exact workflow scores (no complexity or cost penalty configured)"
    # per query the exact workflow scores 1 and the sleeping one 0: one C(3,3) group each, sharpened to 2 members
    assert st.manifest("k", 0, "curate")["counts"]["groups_kept"] == 2
    assert st.manifest("k", 0, "train")["counts"]["sequences"] == 4, "score variance gives real training data"


@pytest.mark.slow
def test_executor_outage_then_rescore_then_iterate_continues_from_curation(harness, tmp_path, tiny_model):
    cfg = _scripted_config(tmp_path, tiny_model)
    st = Store(tmp_path / "runs")
    scripted_rollout(open_run(cfg, "o"))
    down = ["executor.kind=openai", "executor.base_url=http://127.0.0.1:9/v1", "executor.max_retries=0"]
    state = iterate(str(cfg), run_id="o", sets=down, retries=0, return_state=True)
    assert state.is_failed() and "round 0 score" in state.message and "work left" in state.message
    statuses = st.sql("select status, count(*) n from latest_scores where run_id='o' group by 1")
    assert dict(statuses.iter_rows()) == {"ok": 4, "executor_error": 2}
    assert st.manifest("o", 0, "curate") is None
    res = score("o", 0, only_failed=True, store=str(st.root), retry_delay_s=0)
    assert res.counts["ran"] == 2 and res.counts["left"] == 0
    assert st.manifest("o", 0, "train") is None and not st.checkpoint_dir("o", 0).exists(), "re-score trains nothing"
    keys = _score_keys(st, "o")
    final = [(g, r, a) for g, r, a in keys if not g.endswith("w1")]
    assert len(final) == 4 and {a for _, _, a in final} == {0}, "rows with a final status were never run again"
    # the llm workflow (w1) of both queries: attempt 0, the stage's own retry pass 1, the re-score 2
    assert sorted(a for g, _, a in keys if g.endswith("w1")) == [0, 0, 1, 1, 2, 2]
    assert "executor_error" not in set(st.sql("select status from latest_scores where run_id='o'")["status"])
    n_lines = len((st.run_dir("o") / "timings.jsonl").read_text().splitlines())
    iterate(str(cfg), run_id="o", retry_delay_s=0)
    new = [json.loads(x) for x in (st.run_dir("o") / "timings.jsonl").read_text().splitlines()[n_lines:]]
    assert [(t["stage"], t["skipped"]) for t in new] == [("rollout", True), ("score", True), ("curate", False),
                                                         ("train", False)]
    assert (st.checkpoint_dir("o", 0) / "adapter_config.json").is_file()


@pytest.mark.slow
def test_one_real_round_end_to_end(harness, tmp_path, tiny_model):
    """Real stages, child processes: one tiny round through the Prefect flow. The model is the tests' 2-layer
    `tiny_model` (its samples are never valid workflows, as the embedded model's 64-token ones were not either); the
    embedded model's real rollout is tests/test_rollout.py's."""
    import yaml

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(_tiny_flow(tmp_path, tiny_model)))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = iterate(str(cfg), rounds=1, run_id="e2e", retry_delay_s=1)
    st = Store(tmp_path / "runs")
    for stage in ("rollout", "score", "curate", "train"):
        assert st.manifest("e2e", 0, stage) is not None, stage
    n_gen = st.sql("select count(*) n from generations where run_id='e2e' and kind='workflow'")["n"][0]
    n_scored = st.sql("select count(distinct gen_id) n from latest_scores where run_id='e2e'")["n"][0]
    assert n_gen == 3 and n_scored == n_gen  # tiny_flow: 1 query x m=3
    mean = st.sql("select avg(s) m from (select gen_id, avg(case when g.valid then coalesce(score, 0) else 0 end) s "
                  "from latest_scores join generations g using (run_id, round, gen_id) where run_id = 'e2e' "
                  "group by gen_id)")["m"][0]
    assert out["rounds"][0]["mean_score"] == pytest.approx(mean)  # the summary is the store's own numbers


def test_launcher_switch_runs_the_child_under_accelerate(tmp_path, monkeypatch):
    # `accelerate launch` as the train/curate launcher: the child's result still comes back to the flow.
    open_run(_config(tmp_path, rounds=1), "r")
    bad = tmp_path / "runs" / "r" / "config.yaml"
    bad.write_text(bad.read_text().replace("rounds: 1", "rounds: -1"))
    monkeypatch.setenv("PIPELINE_LAUNCHER_CURATE", "accelerate launch --num_processes 1 --cpu")
    assert runner.launcher("curate")[:2] == ["accelerate", "launch"] and runner.launcher("train") == [sys.executable]
    with pytest.raises(StageError) as e:
        runner._run_child("curate", "r", 0, str(tmp_path / "runs"), [], False)
    assert not e.value.transient and "rounds" in e.value.reason


def test_experiment_trains_each_seed_then_evaluates_base_and_every_round(harness, tmp_path, monkeypatch):
    """Two seeds x two rounds; a fake scorer gives the base model 0 on q0 and 0.5 on q1 and any checkpoint 1.0:
    per seed the paired differences are [1.0, 0.5], so the pooled mean is 0.75 over 4 pairs."""
    from flows.experiment import experiment
    from pipeline.studies.experiment import experiment_dir, run_experiment

    calls = []

    def make(stage):
        def fn(ctx, only_failed=False):
            calls.append((ctx.run_id, stage, ctx.round))
            if stage == "rollout":
                ctx.store.write("generations", [{"gen_id": f"g{q}{j}", "kind": "workflow", "query_id": f"q{q}",
                                                 "valid": True} for q in range(2) for j in range(2)],
                                ctx.run_id, ctx.round)
            if stage == "score":
                trained = ctx.cfg.generator.adapter is not None
                ctx.store.write("scores", [{"gen_id": f"g{q}{j}", "rep": 0, "attempt": 0, "status": "ok",
                                            "score": 1.0 if trained else 0.5 * q, "metric": 1.0,
                                            "flags": "answer:gc" if (q, j) == (1, 1) else ""}
                                           for q in range(2) for j in range(2)], ctx.run_id, ctx.round)
            if stage == "train":
                ctx.store.checkpoint_dir(ctx.run_id, ctx.round).mkdir(parents=True)
            ctx.finish(stage, rows=1)
            return {"rows": 1}
        return fn

    install_stages(monkeypatch, make)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: x\nrounds: 2\nstore:\n  root: {tmp_path / 'runs'}\n"
                   "experiment:\n  seeds: [3, 4]\n  eval_queries: 5\n  eval_l: 2\n  eval_rounds: all\n")
    out = run_experiment(cfg, direct_call(RetryPolicy(delay_s=0)))
    train = ["rollout", "score", "curate", "train"] * 2
    ev = ["rollout", "score"] * 3  # base, round 0, round 1
    for s in (3, 4):
        assert [c[1] for c in calls if c[0] == f"x-s{s}"] == train
        assert [c[1] for c in calls if c[0].startswith(f"x-s{s}-eval")] == ev
        run = open_run(None, f"x-s{s}", 0, store_root=str(tmp_path / "runs")).cfg
        assert (run.generator.seed, run.training.seed, run.curation.seed) == (s, s, s)
    e1 = open_run(None, "x-s3-eval-r1", 0, store_root=str(tmp_path / "runs")).cfg
    assert (e1.benchmark.max_queries, e1.rollout.m, e1.benchmark.train_split) == (5, 2, "test")
    assert (e1.rollout.exemplar_run, e1.rollout.exemplar_round, e1.generator.seed) == ("x-s3", 2, 3)
    mean = [p for p in out.paired if p.metric == "mean_at_l"]
    assert [(p.round, p.n, p.mean, p.base, p.trained) for p in mean] == [(0, 4, 0.75, 0.25, 1.0),
                                                                         (1, 4, 0.75, 0.25, 1.0)]
    assert [(x.seed, x.mean) for x in mean[0].per_seed] == [(3, 0.75), (4, 0.75)]
    assert (mean[0].lo_by_query, mean[0].hi_by_query) == (0.5, 1.0)  # queries drawn: means 1, .75 or .5
    # seeds, then queries: both seeds hold differences (1, .5), so a resample is 4 draws from {1, .5}: .5 + k/8 with
    # k ~ Bin(4, 1/2); P(k = 0) = 1/16 > 2.5%, so [0.5, 1.0]
    assert (mean[0].lo_seeds_queries, mean[0].hi_seeds_queries) == (0.5, 1.0)
    body = json.loads((experiment_dir(Store(tmp_path / "runs"), "x") / "experiment.json").read_text())
    assert body["seeds"] == [3, 4] and len(body["arms"]) == 6 and len(body["per_query"]) == 12
    assert body["flagged_rewarded"] == {"x-s3": 2, "x-s4": 2}  # one flagged rewarded row per training round
    assert (experiment_dir(Store(tmp_path / "runs"), "x") / "report.html").is_file()
    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(app, ["report", "x", "--store", str(tmp_path / "runs")])
    assert res.exit_code == 0 and "seed 3 base model: held-out Mean@L 0.250" in res.output
    assert "round 1 vs base, held-out Mean@L (L=2, 4 seed x query pairs): base 0.250 -> trained 1.000, " \
           "paired difference +0.750 [+0.500, +1.000] 95% bootstrap CI resampling seeds, then queries" in res.output
    assert "  seed 4: +0.750 [+0.500, +1.000] over 2 queries" in res.output
    assert "flagged rewarded training runs (scores.flags): {'x-s3': 2, 'x-s4': 2}" in res.output
    calls.clear()
    again = experiment(str(cfg))  # the Prefect flow over the same runs: every stage is skipped by its manifest
    assert calls == [] and [p["mean"] for p in again["paired"] if p["metric"] != "majority_at_l"] == [0.75] * 4
    # the fake scorer stores no answers: no workflow votes, so Majority@L is 0 in both arms and the difference 0
    assert [(p["round"], p["base"], p["trained"], p["mean"]) for p in again["paired"]
            if p["metric"] == "majority_at_l"] == [(0, 0.0, 0.0, 0.0), (1, 0.0, 0.0, 0.0)]
