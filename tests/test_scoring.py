"""The scoring stage: planning, reward maths, the judge, end-to-end runs on a real store (procedural and
HumanEval), executor faults recovered by --only-failed, and kill -9 / SIGINT in the middle of a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest
import yaml
from test_executors import FaultServer, free_port
from test_hostile import describe_procs, sandbox_procs

from pipeline.config import JudgeConfig
from pipeline.core.reward import code_stats, combine, complexity_term, cost_term, reward
from pipeline.engines.benchmarks.base import load_benchmark
from pipeline.engines.judge import Judge, parse_verdict
from pipeline.engines.sandbox.client import UID_COUNT
from pipeline.run import open_run
from pipeline.stages.score import Job, latest_attempts, plan, run_score
from pipeline.store import Store
from pipeline.store.schema import transient_statuses

# ---- pure parts -------------------------------------------------------------------------------------


def test_plan_runs_missing_then_only_transient_failures():
    gens = [("a", "q"), ("b", "q"), ("c", "q")]
    latest = {("a", 0): ("ok", 0), ("b", 0): ("executor_error", 2), ("b", 1): ("timeout", 0), ("c", 1): ("killed", 0)}
    t = transient_statuses(retry_timeouts=False)
    assert plan(gens, latest, 2, False, t) == [Job("a", "q", 1, 0), Job("c", "q", 0, 0)]
    assert plan(gens, latest, 2, True, t) == [Job("b", "q", 0, 3)]
    assert plan(gens, latest, 2, True, transient_statuses(True)) == [Job("b", "q", 0, 3), Job("b", "q", 1, 1)]


def test_latest_attempts_picks_the_highest_attempt(tmp_path):
    st = Store(tmp_path)
    st.write("scores", [{"gen_id": "a", "rep": 0, "attempt": 0, "status": "executor_error"},
                        {"gen_id": "b", "rep": 0, "attempt": 0, "status": "invalid"}], "r", 0)
    st.write("scores", [{"gen_id": "a", "rep": 0, "attempt": 1, "status": "ok"}], "r", 0)
    st.write("scores", [{"gen_id": "a", "rep": 0, "attempt": 5, "status": "ok"}], "r", 1)  # another round
    assert latest_attempts(st, "r", 0) == {("a", 0): ("ok", 1), ("b", 0): ("invalid", 0)}


def test_reward_maths():
    assert code_stats("x = 1") == (5, 0)  # Module, Assign, Name, Store, Constant
    code = "async def solve(p):\n    a = await llm(p)\n    return await run_tests(a[0], 'f')\n"
    # Module, AsyncFunctionDef, arguments, arg: 4; `a = await llm(p)`: Assign, Name a, Store, Await, Call,
    # Name llm, Load, Name p, Load: 9; `return await run_tests(a[0], 'f')`: Return, Await, Call, Name run_tests,
    # Load, Subscript, Name a, Load, Constant 0, Load, Constant 'f': 11 -> 24 nodes, 2 helper calls
    assert code_stats(code) == (24, 2)
    assert code_stats("def (") == (0, 0)
    assert complexity_term(1000, 5) == pytest.approx(0.5)  # 0.5 * 1000/2000 + 0.5 * 5/10
    assert complexity_term(10**6, 100) == 1.0
    assert cost_term(15_000, 5_000) == 1.0 and cost_term(1000, 1000) == pytest.approx(0.1)
    assert combine(0.8, 0.5, 0.25, 0.2, 0.4) == pytest.approx(0.6)  # 0.8 - 0.1 - 0.1
    assert combine(0.1, 1.0, 1.0, 1.0, 1.0) == 0.0 and combine(1.0, 0.0, 0.0) == 1.0
    parts = reward(1.0, code, 1000, 1000, complexity_weight=0.0, cost_weight=0.5)
    assert parts.metric == 1.0 and parts.cost == pytest.approx(0.1) and parts.score == pytest.approx(0.95)
    assert parts.helper_calls == 2 and parts.complexity == pytest.approx(0.106)  # 0.5 * 24/2000 + 0.5 * 2/10


def test_cost_term_in_the_task_budget():
    # the legacy scale (no budget) leaves an 800-token run at 800 / 20,000 = 0.04, so a 0.1 weight costs 0.004
    assert cost_term(600, 200) == pytest.approx(0.04)
    # with a budget of 1,600 tokens a run: 800 tokens is half of it, 2,400 is past it (capped at 1)
    assert cost_term(600, 200, token_budget=1600) == pytest.approx(0.5)
    assert cost_term(2000, 400, token_budget=1600) == 1.0
    assert cost_term(0, 0, token_budget=1600) == 0.0
    # weight 0.1: metric 1 -> 1 - 0.1 * 0.5 = 0.95 for the 800-token run, 0.9 for the run past the budget
    code = "async def solve(p):\n    return (await llm(p))[0]\n"
    assert reward(1.0, code, 600, 200, cost_weight=0.1, token_budget=1600).score == pytest.approx(0.95)
    assert reward(1.0, code, 2000, 400, cost_weight=0.1, token_budget=1600).score == pytest.approx(0.9)
    with pytest.raises(ValueError, match="token_budget must be positive"):
        cost_term(1, 1, token_budget=0)


def test_judge_verdicts():
    assert parse_verdict("CORRECT") == 1.0 and parse_verdict("incorrect.") == 0.0
    assert parse_verdict("The answer is INCORRECT, not CORRECT") == 0.0 and parse_verdict("maybe") is None
    srv = FaultServer()
    srv.reply = "CORRECT"
    srv.script = ["500"]  # retried like any executor call
    try:
        import asyncio

        async def go():
            j = Judge(JudgeConfig(base_url=srv.url, model="judge"), timeout_s=5, max_retries=1)
            try:
                return await j.grade("1+1?", "2", "two")
            finally:
                await j.aclose()
        res = asyncio.run(go())
    finally:
        srv.close()
    assert res.score == 1.0 and res.details["judge_parsed"] is True
    prompt = srv.requests[-1]["body"]["messages"][0]["content"]
    assert "1+1?" in prompt and "Gold answer:\n2" in prompt and "Candidate answer:\ntwo" in prompt


# ---- end to end on a store ------------------------------------------------------------------------------

SOLVER = """```python
import re
async def solve(problem):
    expr = re.search(r"problem: (.*) =", problem).group(1)
    return str(eval(expr))
```"""
# SOLVER's code: Module; Import, alias; AsyncFunctionDef, arguments, arg; the assignment: Assign, Name expr, Store,
# Call .group(1) [Call, Attribute, Load, Constant 1], re.search(...) [Call, Attribute, Load, Name re, Load,
# Constant, Name problem, Load]; the return: Return, Call str, Name, Load, Call eval, Name, Load, Name expr, Load
SOLVER_NODES = 1 + 2 + 3 + 3 + 4 + 8 + 9  # 30, no helper calls
LLM_WF = "async def solve(problem):\n    return (await llm(problem, instructions='Answer with a number.'))[0]\n"
SLEEPER = "import asyncio\nasync def solve(problem):\n    await asyncio.sleep(0.3)\n    return '0'\n"


def make_run(tmp_path: Path, workflows: list[str], benchmark: dict | None = None, n_queries: int = 2,
             executor: dict | None = None, **scoring) -> tuple[Path, str]:
    """A run whose round 0 holds `n_queries` queries and each workflow once per query."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path("configs/smoke.yaml").read_text())
    cfg["store"]["root"] = str(tmp_path / "store")
    cfg["run_id"] = "t"
    cfg["benchmark"] = benchmark or {"name": "procedural", "tasks": ["chain_sum"], "size": 10}
    cfg["executor"] = executor or {"kind": "openai", "model": "m", "base_url": f"http://127.0.0.1:{free_port()}/v1",
                                   "max_retries": 1, "timeout_s": 2}
    cfg["scoring"] = {"timeout_s": 10, "cpu_time_s": 5, "concurrency": 2, **scoring}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ctx = open_run(path, "t", 0)
    items = load_benchmark(ctx.cfg.benchmark).load()[:n_queries]
    ctx.store.write("queries", [{"split": "validate", "query_id": it.id, "benchmark": ctx.cfg.benchmark.name,
                                 "prompt": it.prompt, "reference": json.dumps(it.reference),
                                 "meta": json.dumps(it.meta)} for it in items], "t", 0)
    ctx.store.write("generations", [{"gen_id": f"{it.id}#{k}", "kind": "workflow", "query_id": it.id, "slot": k,
                                     "text": w} for it in items for k, w in enumerate(workflows)], "t", 0)
    ctx.store.write("generations", [{"gen_id": f"{it.id}#plan", "kind": "agent", "query_id": it.id, "slot": 0,
                                     "text": "a plan, not a workflow"} for it in items], "t", 0)
    return path, str(tmp_path / "store")


def scores(store_root: str):
    from pipeline.store import Store

    return Store(store_root).read("scores", "t", 0)


@pytest.mark.usefixtures("shared_sandbox")  # run_score runs workflows in the default sandbox
def test_stage_scores_recovers_executor_faults_with_only_failed(tmp_path):
    path, root = make_run(tmp_path, [SOLVER, "def solve(p): return 1", "async def solve(p):\n    return 1 / 0\n",
                                     LLM_WF], reps=2, batch_size=3)
    # the executor endpoint is down: the llm workflow's runs are executor_error, everything else final; the
    # call gives those 4 one more attempt (16 + 4 runs), still down
    out = run_score(open_run(path, "t", 0))
    assert out["runs"] == 16 and out["ran"] == 20 and out["left"] == 4 and out["done"] is False
    assert out["by_status"] == {"ok": 4, "invalid": 4, "exec_error": 4, "executor_error": 4}
    ctx = open_run(path, "t", 0)
    assert not ctx.done("score")
    df = scores(root)
    solver = df.filter(df["gen_id"].str.ends_with("#0"))
    assert solver["score"].to_list() == [1.0] * 4 and solver["metric"].to_list() == [1.0] * 4
    invalid = df.filter(df["status"] == "invalid")
    assert invalid["score"].to_list() == [0.0] * 4 and "async" in invalid["error"][0]  # kept, scored 0
    assert json.loads(solver["details"][0])["reward"]["ast_nodes"] == SOLVER_NODES

    # a plain re-run runs only the transient rows again; --only-failed against a healthy endpoint completes it
    assert run_score(open_run(path, "t", 0))["ran_by_status"] == {"executor_error": 4}
    srv = FaultServer()
    srv.reply = "7"
    try:
        ctx = open_run(path, "t", 0, sets=[f"executor.base_url={srv.url}"])
        out = run_score(ctx, only_failed=True)
    finally:
        srv.close()
    assert out["ran"] == 4 and out["left"] == 0 and out["done"] is True and ctx.done("score")
    df = scores(root)
    assert df.height == 28  # 16 + 3 further attempts of the 4 llm runs
    assert sorted(df.filter(df["status"] == "executor_error")["attempt"].to_list()) == [0] * 4 + [1] * 4 + [2] * 4
    retried = df.filter(df["attempt"] == 3)
    assert retried["status"].to_list() == ["ok"] * 4 and retried["llm_calls"].to_list() == [1] * 4
    assert retried["tokens_in"].to_list() == [7] * 4 and retried["answer"].to_list() == ["7"] * 4
    assert df.select(["gen_id", "rep", "attempt"]).is_duplicated().sum() == 0
    assert run_score(ctx, only_failed=True)["ran"] == 0  # nothing transient is left


@pytest.mark.usefixtures("shared_sandbox")  # run_score runs workflows in the default sandbox
def test_stage_on_humaneval_with_public_tests(tmp_path):
    from pipeline.engines.benchmarks.code import canonical_humaneval_answers

    answers = canonical_humaneval_answers()
    good = ("async def solve(problem):\n    import json\n    code = json.loads(ANSWERS)[problem_id(problem)]\n"
            "    report = await run_tests(code, ENTRY[problem_id(problem)])\n"
            "    assert report == 'no error', report\n    return code\n")
    ids = ["HumanEval/0", "HumanEval/2"]
    prelude = (f"import json\nANSWERS = {json.dumps(json.dumps({i: answers[i] for i in ids}))}\n"
               "ENTRY = {'HumanEval/0': 'has_close_elements', 'HumanEval/2': 'truncate_number'}\n"
               "def problem_id(p):\n    return 'HumanEval/0' if 'has_close_elements' in p else 'HumanEval/2'\n")
    broken = "async def solve(problem):\n    return problem + '    return None\\n'\n"
    path, root = make_run(tmp_path, [prelude + good, broken], benchmark={"name": "humaneval"}, n_queries=3)
    out = run_score(open_run(path, "t", 0))
    assert out["done"] is True
    df = scores(root).sort("gen_id")
    by_gen = dict(zip(df["gen_id"], df["score"], strict=True))
    assert by_gen == {"HumanEval/0#0": 1.0, "HumanEval/0#1": 0.0, "HumanEval/1#0": 0.0, "HumanEval/1#1": 0.0,
                      "HumanEval/2#0": 1.0, "HumanEval/2#1": 0.0}
    # HumanEval/1 is not in the workflow's table: it fails (exec_error), the round still completes
    assert dict(zip(df["gen_id"], df["status"], strict=True))["HumanEval/1#0"] == "exec_error"


@pytest.mark.usefixtures("shared_sandbox")  # run_score runs workflows in the default sandbox
def test_stage_with_judge_and_reward_weights(tmp_path):
    srv = FaultServer()
    srv.reply = "INCORRECT"
    try:
        path, root = make_run(tmp_path, [SOLVER], n_queries=1)
        sets = [f"scoring.reward.judge.base_url={srv.url}", "scoring.reward.judge.model=judge"]
        out = run_score(open_run(path, "t", 0, sets=sets))
    finally:
        srv.close()
    assert out["done"] is True
    row = scores(root).row(0, named=True)
    details = json.loads(row["details"])
    assert row["status"] == "ok" and row["metric"] == 0.0 and details["benchmark_metric"] == 1.0
    assert details["judge"]["judge_reply"] == "INCORRECT"
    # the penalties: stored as components, weighted into the score
    path2, root2 = make_run(tmp_path / "w", [SOLVER], n_queries=1)
    out = run_score(open_run(path2, "t", 0, sets=["scoring.reward.complexity_weight=1.0"]))
    row = scores(root2).row(0, named=True)
    # complexity 0.5 * 30/2000 + 0.5 * 0/10 = 0.0075, weighted 1.0: score 1 - 0.0075
    assert row["metric"] == 1.0 and row["complexity"] == pytest.approx(0.0075) and row["cost"] == 0.0
    assert row["score"] == pytest.approx(0.9925)


@pytest.mark.usefixtures("shared_sandbox")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_stage_loses_and_duplicates_nothing(tmp_path, sig):
    path, root = make_run(tmp_path, [SLEEPER] * 6, n_queries=2, batch_size=2, concurrency=2)
    boot = "import sys; from pipeline.cli import app; sys.argv[0] = 'pipeline'; app()"
    # a uid range of its own, so that other sandboxes on the machine cannot be mistaken for survivors
    uids = range(1_000_000 + (os.getpid() % 10_000) * UID_COUNT, 1_000_000 + (os.getpid() % 10_000 + 1) * UID_COUNT)
    proc = subprocess.Popen([sys.executable, "-c", boot, "score", str(path), "--run-id", "t"],
                            env={**os.environ, "PIPELINE_SANDBOX_UID_BASE": str(uids.start)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=os.getcwd())
    parts_dir = Path(root) / "t" / "round=0" / "scores"
    deadline = time.monotonic() + 120
    while not list(parts_dir.glob("*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(60)
    before = scores(root)
    assert 2 <= before.height < 12  # interrupted mid-way, with at least one batch written
    if sig == signal.SIGKILL:
        assert before.height % 2 == 0  # only whole batches: the buffer died with the process
    # the orphaned zygote notices and kills its runs. Within a second here; the bound is generous because a CI
    # machine under load once needed over 30 s (the loop ends as soon as they are gone)
    deadline = time.monotonic() + 90
    assert (Path(tempfile.gettempdir()) / "pipeline-sandbox-uids" / str(uids.start)).exists()  # the range was used
    while sandbox_procs(uids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sandbox_procs(uids)
    assert left == [], describe_procs(left)

    out = run_score(open_run(path, "t", 0))
    after = scores(root)
    assert out["done"] is True and out["ran"] == 12 - before.height
    assert after.height == 12 and after.select(["gen_id", "rep"]).is_duplicated().sum() == 0
    kept = after.filter(after["gen_id"].is_in(before["gen_id"].to_list()))
    assert sorted(kept["created_at"].to_list()) == sorted(before["created_at"].to_list())  # untouched


LOOK_ALIKE = ("class Yes:\n    __eq__ = lambda self, other: True\n"
              "def has_close_elements(numbers, threshold):\n    return Yes()\n")


@pytest.mark.usefixtures("shared_sandbox")  # run_score runs workflows in the default sandbox
@pytest.mark.parametrize("zero_flagged", [True, False])
def test_flags_and_reward_hack_in_the_scores(tmp_path, zero_flagged):
    """A correct answer whose code (or whose workflow) touches the harness's surface keeps its metric, gets
    its reasons in `flags` and, by default, reward 0; an answer returning a look-alike is `reward_hack`."""
    from pipeline.engines.benchmarks.code import canonical_humaneval_answers

    good = canonical_humaneval_answers()["HumanEval/0"]
    answer = "async def solve(problem):\n    return {!r}\n".format
    workflows = [answer(good), answer(good + "\nimport gc\n"), answer(LOOK_ALIKE),
                 "import signal\n" + answer(good)]
    path, root = make_run(tmp_path, workflows, benchmark={"name": "humaneval"}, n_queries=1,
                          reward={"zero_flagged": zero_flagged})
    assert run_score(open_run(path, "t", 0))["done"] is True
    rows = {r["gen_id"][-1]: r for r in scores(root).iter_rows(named=True)}
    got = {k: (r["status"], r["metric"], r["score"], r["flags"]) for k, r in rows.items()}
    paid = 0.0 if zero_flagged else 1.0
    assert got == {"0": ("ok", 1.0, 1.0, ""), "1": ("ok", 1.0, paid, "answer:gc"),
                   "2": ("reward_hack", 0.0, 0.0, ""), "3": ("ok", 1.0, paid, "workflow:signals")}
    assert json.loads(rows["1"]["details"])["reward"]["zeroed_by_flags"] is zero_flagged
    assert json.loads(rows["2"]["details"])["metric"]["first_failure"]["error_type"] == "RewardHack"


@pytest.mark.usefixtures("shared_sandbox")
def test_a_metric_that_times_out_is_a_timeout_not_a_wrong_answer(tmp_path, monkeypatch):
    """A metric raising MetricTimeout (math_verify undecided in its budgets) gives status `timeout` with the reason,
    not `ok` at 0: final by default; under scoring.retry_timeouts run again (--only-failed), where a metric that
    decides now gives the row its score."""
    from pipeline.engines.benchmarks.metrics import MetricTimeout
    from pipeline.engines.benchmarks.procedural import Procedural

    real = Procedural.score

    def undecided(self, item, answer):
        raise MetricTimeout("math_verify timed out at 5 s, then at 30 s")

    monkeypatch.setattr(Procedural, "score", undecided)
    path, root = make_run(tmp_path, [SOLVER], reps=1, retry_timeouts=True)
    out = run_score(open_run(path, "t", 0))
    assert out["by_status"] == {"timeout": 2} and out["done"] is False
    df = scores(root)  # transient under retry_timeouts: the call gave each run one more attempt, still undecided
    assert df.height == 4 and set(df["status"]) == {"timeout"} and set(df["metric"]) == {0.0}
    assert "metric failed: MetricTimeout: math_verify timed out" in df["error"][0]
    monkeypatch.setattr(Procedural, "score", real)
    out = run_score(open_run(path, "t", 0), only_failed=True)
    assert out["ran"] == 2 and out["done"] is True
    retried = scores(root).filter(pl.col("attempt") == 2)
    assert retried["status"].to_list() == ["ok", "ok"] and retried["metric"].to_list() == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.usefixtures("shared_sandbox")
@pytest.mark.parametrize("benchmark", [None, {"name": "humaneval"}], ids=["procedural", "humaneval"])
def test_stage_with_the_local_executor(tmp_path, benchmark, smol_tokenizer):
    wf = "async def solve(problem):\n    return (await llm(problem, instructions='Write the code.'))[0]\n"
    path, root = make_run(tmp_path, [wf], benchmark=benchmark, n_queries=1, timeout_s=120,
                          executor={"kind": "local", "model": "embedded:smollm2-135m-instruct", "max_tokens": 8})
    out = run_score(open_run(path, "t", 0))
    assert out["done"] is True and out["by_status"] == {"ok": 1}
    row = scores(root).row(0, named=True)
    # the executor saw the system instruction and the query's prompt, through the model's chat template
    prompt = open_run(path, "t", 0).store.read("queries", "t", 0)["prompt"][0]
    chat = smol_tokenizer.apply_chat_template([{"role": "system", "content": "Write the code."},
                                               {"role": "user", "content": prompt}],
                                              add_generation_prompt=True, tokenize=False)
    assert row["llm_calls"] == 1 and row["tokens_in"] == len(smol_tokenizer(chat, add_special_tokens=False).input_ids)
    assert row["tokens_out"] == 8 and row["answer"]  # greedy: the answer runs past the 8-token cap
    # 8 tokens hold no sum (-14282) and no function body: the benchmark's verdict is 0, and so is the reward
    assert row["metric"] == 0.0 and row["score"] == 0.0
