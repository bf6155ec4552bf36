"""Baselines: the fixed programs, task-level selection and the derived runs, end to end on a store with a
scripted OpenAI-compatible executor, so every number is known by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_executors import FaultServer
from test_scoring import SOLVER

from pipeline.config import ConfigError, load_config
from pipeline.core.reward import program_key
from pipeline.engines.benchmarks import load_benchmark
from pipeline.engines.workflow import check_workflow
from pipeline.stages.runner import run_stage
from pipeline.store import Store
from pipeline.studies.baselines import (
    FIXED,
    PROGRAMS,
    baseline_run_id,
    candidate_programs,
    compare,
    markdown_table,
    open_baseline_run,
    run_baseline,
    select_per_task,
    selection_split,
)


def in_process(stage, run_id, round, store_root, sets=None, only_failed=False):
    return run_stage(stage, run_id, round, store_root, sets, only_failed, isolate=False)


def test_every_fixed_program_is_a_valid_workflow():
    assert FIXED == ("io", "cot", "cot_sc", "self_review", "ensemble_select", "pot")
    assert {m: check_workflow(PROGRAMS[m]) for m in FIXED} == dict.fromkeys(FIXED)


def test_program_key_ignores_comments_and_layout_only():
    a = "async def solve(p):\n    # add them\n    return str(1 + 2)\n"
    b = "async def solve(p):\n\n    return str(1+2)  # same program\n"
    c = "async def solve(p):\n    return str(1 + 3)\n"
    assert program_key(a) == program_key(b) and program_key(a) != program_key(c)
    assert program_key("def (") == "def ("  # unparsable: the text, whitespace collapsed


def test_select_per_task_hand_computed():
    rows = [  # task x: "io" scores 1, 0 (mean 0.5); "gen" 1, 0 (0.5) with fewer tokens; "pot" 0, 0
        {"task": "x", "label": "io", "order": 0, "score": 1.0, "exec_tokens": 30},
        {"task": "x", "label": "io", "order": 0, "score": 0.0, "exec_tokens": 10},
        {"task": "x", "label": "gen", "order": 2, "score": 0.0, "exec_tokens": 0},
        {"task": "x", "label": "gen", "order": 2, "score": 1.0, "exec_tokens": 0},
        {"task": "x", "label": "pot", "order": 1, "score": 0.0, "exec_tokens": 0},
        {"task": "x", "label": "pot", "order": 1, "score": 0.0, "exec_tokens": 0},
        # task y: a tie in score and tokens: the earlier candidate wins
        {"task": "y", "label": "b", "order": 3, "score": 1.0, "exec_tokens": 5},
        {"task": "y", "label": "a", "order": 1, "score": 1.0, "exec_tokens": 5},
    ]
    best = select_per_task(rows)
    assert best["x"] == {"label": "gen", "order": 2, "mean_score": 0.5, "exec_tokens": 0.0, "queries": 2}
    assert best["y"]["label"] == "a"


def test_candidate_programs_distinct_positive_best_first(tmp_path):
    st = Store(tmp_path)
    st.run_dir("src").mkdir(parents=True)
    (st.run_dir("src") / "config.yaml").write_text("run_id: src\n")
    same = "```python\nasync def solve(p):\n    return '1'\n```"
    st.write("generations", [
        {"gen_id": g, "kind": "workflow", "query_id": "q", "slot": i, "valid": v, "text": t}
        for i, (g, v, t) in enumerate([("a", True, same), ("b", True, same.replace("'1'", "'1'  # again")),
                                       ("c", True, "async def solve(p):\n    return '2'"),
                                       ("d", True, "async def solve(p):\n    return '3'"),
                                       ("e", False, "not code"), ("f", True, PROGRAMS["io"])])], "src", 0)
    st.write("scores", [{"gen_id": g, "query_id": "q", "rep": 0, "attempt": 0, "status": "ok", "score": s}
                        for g, s in (("a", 0.5), ("b", 1.0), ("c", 0.0), ("d", 0.75), ("f", 1.0))], "src", 0)
    labels = [label for label, _, _ in candidate_programs(st, ["src"], limit=5)]
    # b (1.0) and a share a program: b first; f is `io` again: already a fixed candidate; c scored 0; e invalid
    assert labels == [*FIXED, "src:b", "src:d"]
    assert [label for label, _, _ in candidate_programs(st, ["src"], limit=1)] == [*FIXED, "src:b"]
    with pytest.raises(ConfigError, match="run 'nope' not found"):
        candidate_programs(st, ["nope"], 4)


@pytest.fixture
def executor():
    srv = FaultServer()
    yield srv
    srv.close()


def _config(tmp_path: Path, url: str) -> Path:
    cfg = {"run_id": "b", "store": {"root": str(tmp_path / "store")},
           "benchmark": {"name": "procedural", "tasks": ["chain_sum"], "size": 20, "max_queries": 2},
           "executor": {"kind": "openai", "model": "m", "base_url": url, "max_retries": 0, "timeout_s": 5},
           "scoring": {"timeout_s": 20, "concurrency": 2, "max_llm_calls": 4},
           "experiment": {"eval_queries": 2, "eval_l": 2}}
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_derived_runs_on_the_dev_split(tmp_path):
    """A baseline on `dev` holds the dev queries (disjoint from `train`, where rounds optimise), under its own run
    id; task_best chooses on dev once the config holds one out; unknown split names are refused."""
    from pipeline.studies.evaluate import check_split, derived_run_changes

    path, dev = _config(tmp_path, "http://127.0.0.1:9/v1"), ["benchmark.dev_share=0.5"]
    ctx = open_baseline_run(str(path), "io", split="dev", sets=dev)
    assert ctx.run_id == "b-baseline-dev-io" and ctx.cfg.benchmark.train_split == "dev"
    bench = load_benchmark(ctx.cfg.benchmark.model_copy(update={"max_queries": None}))
    dev_ids, train_ids = {it.id for it in bench.items("dev")}, {it.id for it in bench.items("train")}
    # 20 items: 4 validate, 2 of them dev; the run's 2 held-out queries are those
    assert len(dev_ids) == 2 and not dev_ids & train_ids and {it.id for it in bench.items()} == dev_ids
    assert selection_split(load_config(path, dev)) == "dev" and selection_split(load_config(path)) == "validate"
    assert derived_run_changes("train") == {"benchmark.train_split": "train", "rounds": 1, "rollout.exemplars": False}
    with pytest.raises(ConfigError, match="split must be one of validate, train, dev, test, got 'holdout'"):
        check_split("holdout")


@pytest.mark.usefixtures("shared_sandbox")
def test_io_baseline_run_hand_computed(tmp_path, executor):
    path = _config(tmp_path, executor.url)
    cfg = load_config(path, ["benchmark.train_split=test"])
    q0, q1 = load_benchmark(cfg.benchmark).items()
    executor.reply = str(q0.reference["answer"])  # the executor knows query 0's answer, and says it for query 1 too
    assert str(q1.reference["answer"]) != executor.reply
    s = run_baseline(str(path), "io", in_process)
    assert s.eval_run_id == baseline_run_id("b", "io") == "b-baseline-io"
    # L = 2 copies per query: query 0 right twice, query 1 wrong twice
    assert (s.queries, s.workflows, s.mean_at_l, s.best_at_l, s.majority_at_l) == (2, 4, 0.5, 0.5, 0.5)
    # each run: one call of 7 prompt + 3 completion tokens (the scripted usage); no generator
    assert (s.exec_tokens_per_query, s.exec_calls_per_query, s.gen_tokens_per_query) == (20.0, 2.0, 0.0)
    asked = sorted(r["body"]["messages"][-1]["content"] for r in executor.requests)
    assert asked == sorted([q0.prompt] * 2 + [q1.prompt] * 2)  # the query itself, nothing added (IO)
    # a second call resumes: nothing is written or run again
    before = len(executor.requests)
    again = run_baseline(str(path), "io", in_process)
    st = Store(tmp_path / "store")
    assert len(executor.requests) == before and st.read("generations", "b-baseline-io").height == 4
    assert again.mean_at_l == 0.5
    table = compare(st, ["b-baseline-io"])
    assert table.same_queries and table.rows[0].method == "io" and table.rows[0].L == 2
    assert table.markdown() == markdown_table(table.rows)
    assert markdown_table(table.rows).splitlines()[2] == \
        "| b-baseline-io | io | 2 | 2 | 0.500 | 0.500 | 0.500 | 1.00 | 0 | 20 | 2.00 |"


@pytest.mark.usefixtures("shared_sandbox")
def test_task_best_picks_the_generic_program_on_the_training_queries(tmp_path, executor):
    path = _config(tmp_path, executor.url)
    executor.reply = "no idea"  # every fixed program is wrong
    st = Store(tmp_path / "store")
    st.run_dir("src").mkdir(parents=True)
    (st.run_dir("src") / "config.yaml").write_text("run_id: src\n")
    hard = "async def solve(problem):\n    return '5'\n"  # right on its own query only
    st.write("generations", [{"gen_id": "g1", "kind": "workflow", "query_id": "x", "slot": 0, "valid": True,
                              "text": hard},
                             {"gen_id": "g2", "kind": "workflow", "query_id": "x", "slot": 1, "valid": True,
                              "text": SOLVER}], "src", 0)
    st.write("scores", [{"gen_id": g, "query_id": "x", "rep": 0, "attempt": 0, "status": "ok", "score": 1.0}
                        for g in ("g1", "g2")], "src", 0)
    s = run_baseline(str(path), "task_best", in_process, candidates=["src"])
    # selection: 6 fixed programs + 2 workflows on the 2 validate queries; SOLVER (eval of the expression) scores 1
    sel = st.generation_scores(baseline_run_id("b", "select", "validate"), 0, 1, set())
    assert sel.height == 2 * 8
    assert s.selected == {"chain_sum": {"label": "src:g2", "order": 7, "mean_score": 1.0, "exec_tokens": 0.0,
                                           "queries": 2}}
    assert type(s.selected["chain_sum"]["exec_tokens"]) is float  # not DuckDB's decimal: JSON writes it a string
    assert (s.eval_run_id, s.mean_at_l, s.best_at_l, s.majority_at_l) == ("b-baseline-task_best", 1.0,
                                                                                        1.0, 1.0)
    texts = set(st.read("generations", "b-baseline-task_best")["text"].to_list())
    assert texts == {SOLVER.split("```python\n")[1].split("```")[0].strip("\n")}


def test_unknown_method_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown baseline method 'nope'; methods: io, cot"):
        run_baseline(str(tmp_path / "x.yaml"), "nope", in_process)


@pytest.mark.usefixtures("shared_sandbox")
def test_task_best_leaves_out_a_candidates_own_query(tmp_path, executor):
    """A query-level workflow (its query's answer copied into the code) is right on its own query only: its
    selection mean is taken over the other queries (0 on 1 query), not 0.5 on 2."""
    path = _config(tmp_path, executor.url)
    executor.reply = "no idea"
    v0, _ = load_benchmark(load_config(path).benchmark).items()  # the selection (validate) queries
    st = Store(tmp_path / "store")
    st.run_dir("src").mkdir(parents=True)
    (st.run_dir("src") / "config.yaml").write_text("run_id: src\n")
    hard = f"async def solve(problem):\n    return {str(v0.reference['answer'])!r}\n"
    st.write("generations", [{"gen_id": "g1", "kind": "workflow", "query_id": v0.id, "slot": 0, "valid": True,
                              "text": hard}], "src", 0)
    st.write("scores", [{"gen_id": "g1", "query_id": v0.id, "rep": 0, "attempt": 0, "status": "ok", "score": 1.0}],
             "src", 0)
    s = run_baseline(str(path), "task_best", in_process, candidates=["src"])
    sel = st.generation_scores(baseline_run_id("b", "select", "validate"), 0, 1, set())
    copied = sel.filter(sel["slot"] == 6)
    assert dict(zip(copied["query_id"], copied["score"], strict=True))[v0.id] == 1.0  # right on its own query
    assert sorted(copied["score"].to_list()) == [0.0, 1.0]  # and only there
    # all candidates score 0 off their own query; the tie goes to the fewest executor tokens: the copied workflow
    assert s.selected == {"chain_sum": {"label": "src:g1", "order": 6, "mean_score": 0.0, "exec_tokens": 0.0,
                                           "queries": 1}}
    assert s.mean_at_l == 0.0


@pytest.mark.usefixtures("shared_sandbox")
def test_a_hand_written_program_runs_as_a_baseline(tmp_path, executor):
    path = _config(tmp_path, executor.url)
    s = run_baseline(str(path), "program:configs/programs/expression_eval.py", in_process)
    # it evaluates each query's expression in Python: right on both queries, L = 2 each, no executor call
    assert s.eval_run_id == "b-baseline-program-expression_eval"
    assert (s.mean_at_l, s.best_at_l, s.majority_at_l, s.exec_tokens_per_query) == (1.0, 1.0, 1.0, 0.0)
    assert executor.requests == []
    with pytest.raises(ConfigError, match="--program nope.py: file not found"):
        run_baseline(str(path), "program:nope.py", in_process)
