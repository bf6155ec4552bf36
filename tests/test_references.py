"""References: the hand-written equal-budget programs (configs/programs/) run as baselines against a
scripted executor on HumanEval and word problems, the experiment's reference arms and shared base (fake stages, so
every number is known by hand), and the held-out curve over rounds."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml
from test_executors import FaultServer

from pipeline import stages
from pipeline.config import ConfigError, load_config
from pipeline.engines.benchmarks import load_benchmark
from pipeline.engines.benchmarks.code import canonical_humaneval_answers
from pipeline.stages.rounds import direct_call
from pipeline.stages.runner import RetryPolicy, run_stage
from pipeline.store import CATALOG, Store
from pipeline.studies.baselines import run_baseline

PROGRAMS = Path(__file__).resolve().parents[1] / "configs" / "programs"


def in_process(stage, run_id, round, store_root, sets=None, only_failed=False):
    return run_stage(stage, run_id, round, store_root, sets, only_failed, isolate=False)


class Scripted(FaultServer):
    """An OpenAI-compatible executor whose n completions of a request are `texts(body, n)`."""

    def __init__(self, texts):
        super().__init__()
        self.texts = texts

    def respond(self, h, mode, body):
        n = body.get("n") or 1
        texts = self.texts(body, n)
        assert len(texts) == n
        out = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
               "choices": [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
                           for i, t in enumerate(texts)],
               "usage": {"prompt_tokens": 7, "completion_tokens": 3 * n, "total_tokens": 7 + 3 * n}}
        payload = json.dumps(out).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)


@pytest.fixture
def scripted():
    servers = []

    def make(texts):
        servers.append(Scripted(texts))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _config(tmp_path: Path, url: str, benchmark: dict) -> Path:
    cfg = {"run_id": "h", "store": {"root": str(tmp_path / "store")}, "benchmark": benchmark,
           "executor": {"kind": "openai", "model": "m", "base_url": url, "max_retries": 0, "timeout_s": 10},
           "scoring": {"timeout_s": 60, "concurrency": 2, "max_llm_calls": 4},
           "experiment": {"eval_queries": 2, "eval_l": 1}}
    path = tmp_path / "h.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _answers(store: Store, run_id: str) -> dict[str, str]:
    df = store.sql("SELECT query_id, answer FROM latest_scores WHERE run_id = $run", {"run": run_id})
    return dict(zip(df["query_id"], df["answer"], strict=True))


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


HUMANEVAL = {"name": "humaneval", "train_split": "train"}


def _humaneval(tmp_path):
    """The two held-out HumanEval items of the tests' config, right and wrong answers per entry point."""
    items = load_benchmark(load_config(_config(tmp_path, "http://127.0.0.1:9/v1", HUMANEVAL),
                                       ["benchmark.train_split=test", "benchmark.max_queries=2"]).benchmark).items()
    assert [it.id for it in items] == ["HumanEval/0", "HumanEval/1"] and all(it.meta["public_tests"] for it in items)
    canonical = canonical_humaneval_answers()
    right = {it.meta["entry_point"]: fenced(canonical[it.id]) for it in items}
    return items, right


def _wrong(ep: str, j: int) -> str:
    return fenced(f"def {ep}(*args, **kwargs):\n    return None  # sample {j}")


def _entry_point(body: dict, items) -> str:
    asked = body["messages"][0]["content"]
    return next(it.meta["entry_point"] for it in items if it.meta["entry_point"] in asked)


@pytest.mark.usefixtures("shared_sandbox")
def test_best_of_k_returns_the_first_sample_passing_the_public_tests(tmp_path, scripted):
    """HumanEval/0: samples 0, 1 and 3 fail the public tests, sample 2 (the canonical solution) passes: it is the
    answer. HumanEval/1: no sample passes: the first is the answer. One executor call per run, n = 4 at T = 0.7."""
    items, right = _humaneval(tmp_path)
    first = items[0].meta["entry_point"]

    def texts(body, n):
        ep = _entry_point(body, items)
        return [right[ep] if (ep, j) == (first, 2) else _wrong(ep, j) for j in range(n)]

    srv = scripted(texts)
    path = _config(tmp_path, srv.url, HUMANEVAL)
    s = run_baseline(str(path), f"program:{PROGRAMS / 'code_best_of_k.py'}", in_process)
    assert s.eval_run_id == "h-baseline-program-code_best_of_k"
    assert (s.queries, s.mean_at_l, s.best_at_l, s.exec_calls_per_query) == (2, 0.5, 0.5, 1.0)
    assert [(r["body"]["n"], r["body"]["temperature"]) for r in srv.requests] == [(4, 0.7), (4, 0.7)]
    got = _answers(Store(tmp_path / "store"), s.eval_run_id)
    assert got["HumanEval/0"] == right[first] and got["HumanEval/1"].endswith("# sample 0\n```")
    # the same file with K = 2 (`?K=2`): the passing sample (index 2) is never drawn, so the first is the answer
    srv.requests.clear()
    s2 = run_baseline(str(path), f"program:{PROGRAMS / 'code_best_of_k.py'}?K=2", in_process)
    assert s2.eval_run_id == "h-baseline-program-code_best_of_k-K2" and s2.mean_at_l == 0.0
    assert [r["body"]["n"] for r in srv.requests] == [2, 2]
    for bad, why in (("?N=2", "has no module-level line `N = ...`"), ("?K", "'K' is not NAME=VALUE")):
        with pytest.raises(ConfigError, match=why):
            run_baseline(str(path), f"program:{PROGRAMS / 'code_best_of_k.py'}{bad}", in_process)


@pytest.mark.usefixtures("shared_sandbox")
def test_the_example_workflow_repairs_only_on_failing_public_tests(tmp_path, scripted):
    """The hand-written prompt's example run as it is, on fenced replies (`run_tests` reads their code block, as the
    hidden tests do). HumanEval/0's first answer is right: one call. HumanEval/1's first answer fails its public
    test: the repair request shows that failure (not a SyntaxError) and its right answer is returned."""
    items, right = _humaneval(tmp_path)

    def texts(body, n):
        ep = _entry_point(body, items)
        repair = len(body["messages"]) == 3
        return [right[ep] if ep == items[0].meta["entry_point"] or repair else _wrong(ep, 0)] * n

    srv = scripted(texts)
    s = run_baseline(str(_config(tmp_path, srv.url, HUMANEVAL)),
                     f"program:{PROGRAMS / 'code_generate_test_repair.py'}", in_process)
    assert (s.mean_at_l, s.exec_calls_per_query) == (1.0, 1.5)
    repairs = [r["body"]["messages"][-1]["content"] for r in srv.requests if len(r["body"]["messages"]) == 3]
    assert len(repairs) == 1 and "separate_paren_groups" in repairs[0] and "SyntaxError" not in repairs[0]
    example = (Path(__file__).resolve().parents[1] / "configs/prompts/code/example_code.txt").read_text()
    assert (PROGRAMS / "code_generate_test_repair.py").read_text().endswith(example)  # the example, byte for byte


@pytest.mark.usefixtures("shared_sandbox")
def test_word_problem_references_under_the_exact_number_rule(tmp_path, scripted):
    """gsm_symbolic (scored by the exact final number): cot_sc's majority and pot's evaluated expression are right
    on the first query; on the second every answer is a near miss (gold + 1), which scores 0, not reasoning-gym's
    0.01. word_pot_sc: 3 of 5 expressions evaluate to the gold number on the first query, the majority on the
    second is a wrong number."""
    bench = {"name": "procedural", "tasks": ["gsm_symbolic"], "size": 20, "train_split": "train"}
    held_out = load_config(_config(tmp_path, "http://127.0.0.1:9/v1", bench),
                           ["benchmark.train_split=test", "benchmark.max_queries=2"]).benchmark
    items = load_benchmark(held_out).items()
    gold = [int(it.reference["answer"]) for it in items]
    assert len(items) == 2 and gold[0] >= 1000

    def texts(body, n):
        asked = body["messages"][-1]["content"]
        q = next(i for i, it in enumerate(items) if asked.startswith(it.prompt))
        g = gold[q]
        if "Python expression" in asked and n == 1:  # pot
            return [f"{g - 3} + 3" if q == 0 else f"{g} + 1"]
        if "Python expression" in asked:  # word_pot_sc, n = 5
            return ([f"{g - 1} + 1", "7", f"{g} * 1", "oops(", f"{g} / 1"] if q == 0
                    else ["1 + 1", "2", "x = 5", "3", "(1"])
        # cot_sc, n = 5: three of five end in the gold number (one written "28,080."), two wrong
        return ([f"So the total is ${g:,}.", "It is 7", f"{g}", "maybe 12", f"The answer is {g}"] if q == 0
                else [f"The answer is {g + 1}"] * n)

    srv = scripted(texts)
    path = str(_config(tmp_path, srv.url, bench))
    st = Store(tmp_path / "store")
    sc = run_baseline(path, "cot_sc", in_process)
    assert (sc.mean_at_l, sc.majority_at_l) == (0.5, 0.5)
    assert st.sql("SELECT max(metric) AS m FROM latest_scores WHERE run_id = 'h-baseline-cot_sc' AND query_id = "
                  f"'{items[1].id}'")["m"].to_list() == [0.0]  # a near miss: no partial credit
    assert run_baseline(path, "pot", in_process).mean_at_l == 0.5
    assert _answers(st, "h-baseline-pot")[items[0].id] == str(gold[0])
    s = run_baseline(path, f"program:{PROGRAMS / 'word_pot_sc.py'}", in_process)
    assert (s.mean_at_l, s.exec_calls_per_query) == (0.5, 1.0)
    assert _answers(st, s.eval_run_id) == {items[0].id: str(gold[0]), items[1].id: "2"}
    assert [r["body"]["n"] for r in srv.requests if r["body"]["messages"][-1]["content"].endswith("only.")
            and r["body"].get("temperature") == 0.7] == [5, 5]
    example = (Path(__file__).resolve().parents[1] / "configs/prompts/word/example_procedural.txt").read_text()
    assert (PROGRAMS / "word_example_vote.py").read_text().endswith(example)  # the example, byte for byte


# ---- the experiment's references and shared base (fake stages) ----------------------------------------------------


def _fake(calls: list):
    """Stage functions: rollout writes L workflows per query of the run's split; score gives the base model
    0.5 - 0.25 * seed, a checkpoint 1.0, the io reference 0.25 and the hand-written program 0.75 (on dev: 0.9 and
    0.5)."""
    def make(stage):
        def fn(ctx, only_failed=False):
            calls.append((ctx.run_id, stage))
            if stage == "rollout":
                items = load_benchmark(ctx.cfg.benchmark).items()
                ctx.store.write("generations", [
                    {"gen_id": f"g{i}-{j}", "kind": "workflow", "query_id": it.id, "slot": j, "valid": True,
                     "text": "x"} for i, it in enumerate(items) for j in range(ctx.cfg.rollout.m)], ctx.run_id,
                    ctx.round)
            if stage == "score":
                gens = ctx.store.read("generations", ctx.run_id, ctx.round)
                score = ((0.9 if ctx.run_id.endswith("-io") else 0.5) if "-baseline-dev-" in ctx.run_id
                         else 0.25 if ctx.run_id.endswith("-baseline-io") else 0.75 if "-baseline-" in ctx.run_id
                         else 1.0 if ctx.cfg.generator.adapter else 0.5 - 0.25 * ctx.cfg.generator.seed)
                ctx.store.write("scores", [{"gen_id": g, "query_id": q, "rep": 0, "attempt": 0, "status": "ok",
                                            "score": score, "answer": "1"}
                                           for g, q in zip(gens["gen_id"], gens["query_id"], strict=True)],
                                ctx.run_id, ctx.round)
            if stage == "train":
                ctx.store.checkpoint_dir(ctx.run_id, ctx.round).mkdir(parents=True)
            ctx.finish(stage, rows=1)
            return {"rows": 1}
        return fn
    return make


def _experiment_config(tmp_path: Path, run_id: str, experiment: dict, rounds: int = 2) -> Path:
    cfg = {"run_id": run_id, "rounds": rounds, "store": {"root": str(tmp_path / "runs")}, "tracking": [],
           "benchmark": {"name": "procedural", "tasks": ["chain_sum"], "size": 20},
           "experiment": {"seeds": [0, 1], "eval_queries": 2, "eval_l": 2, "bootstrap": 200, "eval_rounds": "all",
                          **experiment}}
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def fake_stages(monkeypatch) -> list:
    """Every stage replaced by `_fake`'s, in process; returns the list of (run id, stage) calls. The `duckdb` CLI's
    catalog file, which `finish` rebuilds after every stage (a full DuckDB database written per call, tested in
    tests/test_store.py and tests/test_cli.py), is not rebuilt: nothing here reads it (`Store.sql` makes its own
    views)."""
    monkeypatch.setattr(Store, "refresh_catalog", lambda self: self.root / CATALOG)
    calls: list = []
    make = _fake(calls)
    for name, st in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=make(name), isolated=False,
                                                                     checkpoint=False))
    return calls


def test_an_experiment_evaluates_the_base_model_and_the_last_round_unless_the_curve_is_asked_for(tmp_path,
                                                                                                  fake_stages):
    from pipeline.studies.experiment import run_experiment

    calls = fake_stages
    path = _experiment_config(tmp_path, "z", {"seeds": [0]}, rounds=3)
    path.write_text(path.read_text().replace("eval_rounds: all", "eval_rounds: last"))
    default = _experiment_config(tmp_path, "d", {"seeds": [0]}, rounds=3)
    default.write_text(default.read_text().replace("  eval_rounds: all\n", ""))
    for config, run in ((path, "z"), (default, "d")):
        out = run_experiment(config, direct_call(RetryPolicy(delay_s=0)))
        assert {r for r, _ in calls if r.startswith(run)} == {f"{run}-s0", f"{run}-s0-eval-base", f"{run}-s0-eval-r2"}
        assert [p.round for p in out.paired if p.metric == "mean_at_l"] == [2]


def test_experiment_references_shared_base_and_borrowed_references(tmp_path, fake_stages):
    from pipeline.store import ADAPTER_FILES
    from pipeline.studies.experiment import experiment_dir, run_experiment

    calls = fake_stages
    program, tag = f"program:{PROGRAMS / 'expression_eval.py'}", "program-expression_eval"
    path = _experiment_config(tmp_path, "x", {"references": ["io", program], "shared_base": True})
    # seed 0 alone first (`only_seeds`, as a separate process would): no reference runs beside other seeds
    alone = run_experiment(path, direct_call(RetryPolicy(delay_s=0)), only_seeds=[0])
    assert {r for r, _ in calls} == {"x-s0", "x-s0-eval-base", "x-s0-eval-r0", "x-s0-eval-r1"}
    assert alone.seeds == [0] and alone.references == []
    out = run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    runs = {r for r, _ in calls}
    # the base model is evaluated in seed 0's run only; each reference once, in its derived run
    assert "x-s0-eval-base" in runs and "x-s1-eval-base" not in runs
    assert {"x-baseline-io", "x-baseline-program-expression_eval"} <= runs
    assert [(a.seed, a.round) for a in out.arms] == [(0, -1), (0, 0), (0, 1), (1, 0), (1, 1)]
    mean = [p for p in out.paired if p.metric == "mean_at_l"]
    # seed 1's pairs use seed 0's base (0.5), not its own (0.25, never evaluated): 1.0 - 0.5 everywhere
    assert [(p.round, p.n, p.base, p.trained, p.mean) for p in mean] == [(0, 4, 0.5, 1.0, 0.5), (1, 4, 0.5, 1.0, 0.5)]
    assert [(x.seed, x.mean) for x in mean[0].per_seed] == [(0, 0.5), (1, 0.5)]
    refs = {r.method: r for r in out.references}
    assert (refs["io"].mean_at_l, refs["io"].best_at_l, refs["io"].majority_at_l) == (0.25, 0.25, 0.25)
    assert refs[program].mean_at_l == 0.75 and refs[program].label == tag
    assert refs["io"].eval_run_id == "x-baseline-io"
    assert refs["io"].gen_tokens_per_query == 0 and refs["io"].queries == 2
    against = {(p.reference, p.round): p for p in out.paired_references if p.metric == "mean_at_l"}
    # the base model (seed 0's only) and each round against each reference, the reference the base of every seed
    assert {k: (p.n, p.base, p.trained, p.mean) for k, p in against.items()} == {
        ("io", -1): (2, 0.25, 0.5, 0.25), ("io", 0): (4, 0.25, 1.0, 0.75), ("io", 1): (4, 0.25, 1.0, 0.75),
        (tag, -1): (2, 0.75, 0.5, -0.25), (tag, 0): (4, 0.75, 1.0, 0.25), (tag, 1): (4, 0.75, 1.0, 0.25)}
    assert against[("io", 0)].lo_seeds_queries == against[("io", 0)].hi_seeds_queries == 0.75
    curve = [(c.round, c.n, c.mean, [x.seed for x in c.per_seed]) for c in out.curve if c.metric == "mean_at_l"]
    assert curve == [(-1, 2, 0.5, [0]), (0, 4, 1.0, [0, 1]), (1, 4, 1.0, [0, 1])]
    lines = out.headline()
    assert "reference io (x-baseline-io): held-out Mean@L 0.250, Best@L 0.250, Majority@L 0.250, tokens/query " \
           "generator 0 executor 0, executor calls cut at the token cap n/a" in lines
    assert "round 1 vs io, held-out Mean@L: 1.000 vs 0.250, paired difference +0.750 [+0.750, +0.750] (seeds, then " \
           "queries; 4 pairs)" in lines
    folder = experiment_dir(Store(tmp_path / "runs"), "x")
    body = json.loads((folder / "experiment.json").read_text())
    assert body["shared_base"] and len(body["paired_references"]) == 2 * 3 * 3 and "references_wall_s" in body
    page = (folder / "report.html").read_text()
    assert "<img src='curve.png'" in page and "<h2>References</h2>" in page and "x-baseline-io" in page
    assert (folder / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # resumed: every stage of the seeds, evaluations and references is skipped by its manifest
    calls.clear()
    again = run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    assert calls == [] and again.paired_references == out.paired_references

    # shared_base off (the default) and no references: each seed pairs with its own base, as before. The seeds run
    # in separate calls, seed 1 first: the second call's summary covers both, seed 1's evaluations read from the store.
    # In a store of its own (nothing below reads y's runs): every query's views glob the whole store, so x's parts
    # would only slow y's calls, and y's the later ones
    calls.clear()
    (tmp_path / "y").mkdir()
    ypath = _experiment_config(tmp_path / "y", "y", {})
    with pytest.raises(ValueError, match=r"--only-seed \[2\]: not among the experiment's seeds \[0, 1\]"):
        run_experiment(ypath, direct_call(RetryPolicy(delay_s=0)), only_seeds=[1, 2])
    assert calls == []
    first = run_experiment(ypath, direct_call(RetryPolicy(delay_s=0)), only_seeds=[1])
    assert {r for r, _ in calls} == {"y-s1", "y-s1-eval-base", "y-s1-eval-r0", "y-s1-eval-r1"}
    assert first.seeds == [1]
    own = run_experiment(ypath, direct_call(RetryPolicy(delay_s=0)), only_seeds=[0])
    assert {"y-s0-eval-base", "y-s1-eval-base"} <= {r for r, _ in calls} and own.seeds == [0, 1]
    mean = [p for p in own.paired if p.metric == "mean_at_l"]
    assert [(p.round, p.n, p.base, p.mean) for p in mean] == [(0, 4, 0.375, 0.625), (1, 4, 0.375, 0.625)]
    assert [(x.seed, x.mean) for x in mean[0].per_seed] == [(0, 0.5), (1, 0.75)]
    assert own.references == [] and own.paired_references == [] and not own.shared_base

    # another experiment ("w": another learning rate) borrows x's reference runs: it makes none, pairs with them;
    # its seed starts from x's same seed (experiment.start_from): the last round's checkpoint of x-s0; and it pairs
    # with x-s0's base evaluation instead of making its own (experiment.base_from)
    calls.clear()
    borrow = {"references": ["io", program], "references_from": "x", "seeds": [0]}
    w = _experiment_config(tmp_path, "w", borrow | {"start_from": "x", "base_from": "x"}, rounds=1)
    w.write_text(w.read_text() + "training:\n  lr: 1.0e-05\n")
    with pytest.raises(ConfigError, match="run x-s0 has no checkpoint of its last round 1"):
        run_experiment(w, direct_call(RetryPolicy(delay_s=0)))  # the fake train stage leaves an empty folder
    st = Store(tmp_path / "runs")
    for name in ADAPTER_FILES:
        (st.checkpoint_dir("x-s0", 1) / name).write_text("{}")
    theirs = run_experiment(w, direct_call(RetryPolicy(delay_s=0)))
    assert load_config(st.run_dir("w-s0") / "config.yaml").generator.adapter == str(st.checkpoint_dir("x-s0", 1))
    assert not any("-baseline-" in r or r == "w-s0-eval-base" for r, _ in calls)
    assert [(a.seed, a.round, a.eval_run_id) for a in theirs.arms] == [(0, -1, "x-s0-eval-base"),
                                                                        (0, 0, "w-s0-eval-r0")]
    assert [(p.base, p.trained) for p in theirs.paired if p.metric == "mean_at_l"] == [(0.5, 1.0)]
    assert (theirs.base_from, theirs.start_from) == ("x", "x")
    other_seed = _experiment_config(tmp_path, "t", {"seeds": [1], "base_from": "x"})
    with pytest.raises(ConfigError, match="its base-model evaluation x-s1-eval-base is not finished"):
        run_experiment(other_seed, direct_call(RetryPolicy(delay_s=0)))  # x shares seed 0's base: none of seed 1
    other_cap = _experiment_config(tmp_path, "t", {"seeds": [0], "base_from": "x"})
    other_cap.write_text(other_cap.read_text() + "executor:\n  max_tokens: 7\n")
    with pytest.raises(ConfigError, match="x-s0-eval-base was made with other settings .*\\(executor.max_tokens\\)"):
        run_experiment(other_cap, direct_call(RetryPolicy(delay_s=0)))
    assert not (tmp_path / "runs" / "t-s0").exists() and not (tmp_path / "runs" / "t-s1").exists()
    borrowed = {r.eval_run_id for r in theirs.references}
    assert borrowed == {"x-baseline-io", "x-baseline-program-expression_eval"}
    against = {(p.reference, p.round): p.mean for p in theirs.paired_references if p.metric == "mean_at_l"}
    assert against[("io", 0)] == 0.75 and against[(tag, 0)] == 0.25
    # an arm that samples more in training (`--set rollout.m=3`) still pairs: a reference samples L, as the arm's own
    # evaluations do, whatever its training rollout's m
    more = run_experiment(_experiment_config(tmp_path, "s", borrow), direct_call(RetryPolicy(delay_s=0)),
                          sets=["rollout.m=3"])
    assert {r.eval_run_id for r in more.references} == {"x-baseline-io", "x-baseline-program-expression_eval"}
    other = _experiment_config(tmp_path, "v", borrow)
    other.write_text(other.read_text() + "executor:\n  max_tokens: 7\n")
    with pytest.raises(ConfigError, match="x-baseline-io has another executor section .*max_tokens"):
        run_experiment(other, direct_call(RetryPolicy(delay_s=0)))
    with pytest.raises(ConfigError, match="reference run nobody-baseline-io not found.*--run-id nobody --method io"):
        run_experiment(_experiment_config(tmp_path, "u", {"references": ["io"], "references_from": "nobody"}),
                       direct_call(RetryPolicy(delay_s=0)))
    assert not (tmp_path / "runs" / "v-s0").exists()  # refused before any work
    for start, match in (("nobody", "no run nobody-s0 in .*; train seed 0 of experiment nobody first"),
                         ("u", "an experiment cannot start from its own seeds")):
        with pytest.raises(ConfigError, match=match):
            run_experiment(_experiment_config(tmp_path, "u", {"seeds": [0], "start_from": start}),
                           direct_call(RetryPolicy(delay_s=0)))
    assert not (tmp_path / "runs" / "u-s0").exists()

    # x's own reference reopened with another learning rate (a fixed program trains nothing): reused, not redone
    calls.clear()
    x = tmp_path / "x.yaml"
    x.write_text(x.read_text() + "training:\n  lr: 1.0e-05\n")
    assert run_baseline(str(x), "io", direct_call(RetryPolicy(delay_s=0))).mean_at_l == 0.25 and calls == []
    x.write_text(x.read_text() + "executor:\n  max_tokens: 7\n")
    with pytest.raises(ConfigError, match="baseline run 'x-baseline-io' was made with other settings "
                                          "\\(executor.max_tokens\\)"):
        run_baseline(str(x), "io", direct_call(RetryPolicy(delay_s=0)))


def test_a_finished_seed_is_not_re_entered_when_its_checkpoints_are_gone(tmp_path, fake_stages, monkeypatch):
    """A seed with every evaluation in the store is done: the store kept in git without its checkpoints (on another
    machine) neither trains it again nor loses it from the summary. The train stage here checks its checkpoint, as
    the real one does, so without that rule the missing adapter would re-run round 0's training."""
    from pipeline.store import ADAPTER_FILES
    from pipeline.studies.experiment import run_experiment

    fake = stages.STAGES["train"].fn

    def train(ctx, only_failed=False):
        out = fake(ctx)
        for f in ADAPTER_FILES:
            (ctx.store.checkpoint_dir(ctx.run_id, ctx.round) / f).write_text("{}")
        return out
    monkeypatch.setitem(stages.STAGES, "train", dataclasses.replace(stages.STAGES["train"], fn=train,
                                                                    checkpoint=True))
    path = _experiment_config(tmp_path, "p", {"seeds": [0]}, rounds=1)
    first = run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    assert ("p-s0", "train") in fake_stages
    store = Store(tmp_path / "runs")
    shutil.rmtree(store.checkpoint_dir("p-s0", 0))
    fake_stages.clear()
    again = run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    assert fake_stages == []
    assert [(a.seed, a.round, a.mean_at_l) for a in again.arms] == [(0, -1, 0.5), (0, 0, 1.0)]
    assert again.paired == first.paired


def test_only_references_runs_the_references_and_no_seed(tmp_path, fake_stages):
    """`--only-references` (references while the seeds wait for another session): the derived runs only; the summary
    pairs them with the seeds already in the store."""
    from pipeline.studies.experiment import run_experiment

    path = _experiment_config(tmp_path, "r", {"references": ["io"]}, rounds=1)
    run_experiment(path, direct_call(RetryPolicy(delay_s=0)), only_seeds=[0])
    fake_stages.clear()
    out = run_experiment(path, direct_call(RetryPolicy(delay_s=0)), only_references=True)
    assert {r for r, _ in fake_stages} == {"r-baseline-io"}
    assert out.seeds == [0] and [(r.label, r.mean_at_l) for r in out.references] == [("io", 0.25)]
    assert [(p.round, p.trained, p.mean) for p in out.paired_references
            if p.metric == "mean_at_l"] == [(-1, 0.5, 0.25), (0, 1.0, 0.75)]
    with pytest.raises(ValueError, match="--only-references: not with --only-seed"):
        run_experiment(path, direct_call(RetryPolicy(delay_s=0)), only_seeds=[1], only_references=True)
    bare = _experiment_config(tmp_path, "b", {}, rounds=1)
    with pytest.raises(ValueError, match="--only-references: the config's experiment.references is empty"):
        run_experiment(bare, direct_call(RetryPolicy(delay_s=0)), only_references=True)


def test_references_an_experiment_makes_sample_l_under_its_own_set_of_rollout_m(tmp_path, fake_stages):
    """An arm that samples more in training (`--set rollout.m=3`) and makes its own references: each reference samples
    L (experiment.eval_l 2), as the arm's evaluations do and as a borrowed reference is checked to; the run reopens
    under the same --set without a refusal. Before, the experiment's --set came after the reference's changes and the
    reference sampled 3."""
    from pipeline.studies.experiment import run_experiment

    path = _experiment_config(tmp_path, "q", {"references": ["io"]}, rounds=1)
    for _ in range(2):  # made, then reopened (the stage is then skipped by its manifest)
        out = run_experiment(path, direct_call(RetryPolicy(delay_s=0)), only_references=True, sets=["rollout.m=3"])
        assert [(r.label, r.queries) for r in out.references] == [("io", 2)]
    store = Store(tmp_path / "runs")
    assert load_config(store.run_dir("q-baseline-io") / "config.yaml").rollout.m == 2
    rows = store.sql("SELECT query_id, count(*) AS n FROM generations WHERE run_id = $run GROUP BY query_id",
                     {"run": "q-baseline-io"}, run="q-baseline-io")
    assert sorted(rows["n"].to_list()) == [2, 2]
    assert [r for r, _ in fake_stages] == ["q-baseline-io"]


def test_the_routers_designs_run_on_every_split_before_the_other_references(tmp_path):
    """The order the experiment runs its references in: the router's designs on test, dev and train first (the
    routers and the dev choice need only those), then the other references (cot_sc: dear) on test and dev; `--status`
    lists them so."""
    from pipeline.studies.experiment import plan as plan_seeds
    from pipeline.studies.experiment import reference_plan, reference_rows, selection

    path = _experiment_config(tmp_path, "p", {"references": ["io", "cot_sc", "cot"], "select_split": "dev",
                                              "select_queries": 5, "router": {"designs": ["io", "cot"],
                                                                              "fit_queries": 7}})
    plan = [(m, split, changes) for m, split, changes, _ in reference_plan(load_config(path))]
    dev, train = {"experiment.eval_queries": 5}, {"experiment.eval_queries": 7}
    assert plan == [("io", "test", {}), ("cot", "test", {}), ("io", "dev", dev), ("cot", "dev", dev),
                    ("io", "train", train), ("cot", "train", train), ("cot_sc", "test", {}), ("cot_sc", "dev", dev)]
    without = load_config(path, ["experiment.router=null", "experiment.select_split=null"])
    assert [(m, split) for m, split, _, _ in reference_plan(without)] == \
        [("io", "test"), ("cot_sc", "test"), ("cot", "test")]
    # `--status` lists the same runs in the same order, the fit runs on train among them, each with its planned
    # workflows (queries x L = 2; test's 2 queries by the config)
    rows = [(part, rid, planned) for part, rid, _, _, planned in reference_rows(load_config(path))]
    assert rows == [("reference", "p-baseline-io", 4), ("reference", "p-baseline-cot", 4),
                    ("reference on dev", "p-baseline-dev-io", 10), ("reference on dev", "p-baseline-dev-cot", 10),
                    ("reference on train", "p-baseline-train-io", 14),
                    ("reference on train", "p-baseline-train-cot", 14),
                    ("reference", "p-baseline-cot_sc", 4), ("reference on dev", "p-baseline-dev-cot_sc", 10)]
    # experiment.select_references: the candidates chosen among on dev; cot_sc runs on test only, and the best fixed
    # workflow's missing candidates are only those
    designs_only = load_config(path, ["experiment.select_references=[io, cot]"])
    assert [(m, split) for m, split, _, _ in reference_plan(designs_only)][-1:] == [("cot_sc", "test")]
    assert [rid for _, rid, _, _, _ in reference_rows(designs_only)][-1] == "p-baseline-cot_sc"
    assert selection(Store(tmp_path / "runs"), designs_only, [], []).missing == ["io", "cot"]
    with pytest.raises(ConfigError, match="the router's designs cot must run on dev too"):
        plan_seeds(load_config(path, ["experiment.select_references=[io]", "benchmark.train_split=train"]))
    with pytest.raises(ConfigError, match="select_references: pot not among experiment.references"):
        load_config(path, ["experiment.select_references=[io, pot]"])


def test_experiment_fits_the_routers_on_train_sets_them_on_dev_and_pairs_the_trained_arms_with_them(tmp_path,
                                                                                                     fake_stages,
                                                                                                     monkeypatch):
    """`experiment.router` end to end on fake stages: io solves every chain sum and no product, cot the other way
    round, on every split. The designs run on test, dev and train (the fit split); the learned router (query text
    only), the per-part router and the oracle each send every query to the design that solves it (1.0 on test, where
    io and cot score their parts' shares), and every evaluated round is paired with each router."""
    from pipeline.stages.rollout import write_queries
    from pipeline.studies.experiment import experiment_dir, run_experiment

    rollout, score = stages.STAGES["rollout"].fn, stages.STAGES["score"].fn

    def with_queries(ctx, only_failed=False):  # the real rollout's `queries` rows: the routers read text and part
        write_queries(ctx, load_benchmark(ctx.cfg.benchmark).items())
        return rollout(ctx)

    def by_part(ctx, only_failed=False):
        out = score(ctx)
        if ctx.run_id.endswith(("-io", "-cot")):  # the designs: rewrite the fake's constant score per query
            solves = "chain_sum" if ctx.run_id.endswith("-io") else "products"
            rows = ctx.store.read("scores", ctx.run_id, ctx.round).to_dicts()
            ctx.store.write("scores", [{"gen_id": r["gen_id"], "query_id": r["query_id"], "rep": 0, "attempt": 1,
                                        "status": "ok", "score": float(r["query_id"].startswith(solves)),
                                        "answer": "1"} for r in rows], ctx.run_id, ctx.round)
        return out

    for name, fn in (("rollout", with_queries), ("score", by_part)):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(stages.STAGES[name], fn=fn))
    path = _experiment_config(tmp_path, "q", {"seeds": [0], "references": ["io", "cot"], "select_split": "dev",
                                              "eval_queries": 6, "router": {"designs": ["io", "cot"]},
                                              "select_eval": True}, rounds=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["benchmark"] |= {"tasks": ["chain_sum", "products"], "size": 40, "train_split": "train", "test_share": 0.3,
                         "dev_share": 0.4}
    path.write_text(yaml.safe_dump(cfg))
    out = run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    assert {"q-baseline-train-io", "q-baseline-train-cot", "q-baseline-dev-io", "q-baseline-io"} <= \
        {r for r, _ in fake_stages}
    refs = {r.label: r for r in out.references}
    assert {k: refs[k].mean_at_l for k in ("learned_router", "part_router", "oracle")} == \
        {"learned_router": 1.0, "part_router": 1.0, "oracle": 1.0}
    chain = sum(q["query_id"].startswith("chain_sum") for q in refs["io"].per_query) / refs["io"].queries
    assert 0 < chain < 1 and (refs["io"].mean_at_l, refs["cot"].mean_at_l) == pytest.approx((chain, 1 - chain))
    assert all(q["design"] == ("io" if q["query_id"].startswith("chain_sum") else "cot")
               for q in refs["learned_router"].per_query)
    assert refs["oracle"].eval_run_id == "oracle: composed from q-baseline-io, q-baseline-cot"
    against = {(p.reference, p.round): p.mean for p in out.paired_references if p.metric == "mean_at_l"}
    assert against[("learned_router", 0)] == pytest.approx(0.0)  # the trained arm's fake 1.0 against the router's
    assert against[("io", 0)] == pytest.approx(1 - chain)
    body = json.loads((experiment_dir(Store(tmp_path / "runs"), "q") / "experiment.json").read_text())
    assert "learned_router" in {r["label"] for r in body["references"]}
    # experiment.select_eval: the last round evaluated on dev too; the labels' check has the per-part router's picks
    # fitted on train, each scored on dev (1.0: the design that solves the part), and no label of the policy (the
    # fake samples no design step), so it cannot be read yet
    assert "q-s0-eval-dev-r0" in {r for r, _ in fake_stages}
    assert [(a.seed, a.round, a.eval_run_id) for a in out.select_arms] == [(0, 0, "q-s0-eval-dev-r0")]
    assert [(c.part, c.pick, c.pick_score, c.label, c.met) for c in out.labels] == [
        ("chain_sum", "io", 1.0, None, None), ("products", "cot", 1.0, None, None)]
    assert {(p.split, p.round) for p in out.parts} == {("test", -1), ("test", 0), ("dev", 0)}


def test_an_unknown_reference_fails_before_any_training(tmp_path):
    from pipeline.studies.experiment import plan

    for ref, why in (("nope", "unknown baseline method 'nope'"), ("program:none.py", "--program none.py: file not")):
        with pytest.raises(ConfigError, match=why):
            plan(load_config(_experiment_config(tmp_path, "z", {"references": [ref]})))


def test_curve_plot_has_a_line_per_seed_the_mean_and_each_reference(tmp_path):
    """A hand-made summary: 3 seeds (the base shared, so seed 0 only at round -1), rounds 0-2, two references."""
    from pipeline.studies.report import plot_curve
    from pipeline.studies.summaries import ExperimentSummary

    def point(k, means):
        m = sum(means) / len(means)
        return {"round": k, "metric": "mean_at_l", "n": 10 * len(means), "mean": m, "lo": m - 0.05, "hi": m + 0.05,
                "level": 0.95, "per_seed": [{"seed": s, "mean": v} for s, v in enumerate(means)]}

    def ref(method, mean, **label):
        return {"method": method, **label, "eval_run_id": f"he-baseline-{method}", "queries": 10, "mean_at_l": mean}

    summary = {"experiment": "he", "seeds": [0, 1, 2], "rounds": 3, "split": "test", "eval_queries": 10, "eval_l": 2,
               "curve": [point(-1, [0.55]), point(0, [0.6, 0.62, 0.58]), point(1, [0.63, 0.6, 0.61]),
                         point(2, [0.65, 0.6, 0.7]), {**point(0, [1.0]), "metric": "best_at_l"}],
               "references": [ref("io", 0.561),
                              ref("program:configs/programs/code_best_of_k.py", 0.6, label="program-code_best_of_k"),
                              ref("cot", None)]}  # not evaluated yet: no line
    fig = plot_curve(ExperimentSummary.from_dict(summary), tmp_path / "out" / "curve.png")
    assert (tmp_path / "out" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(labels) == sorted(["seed 0", "seed 1", "seed 2", "mean over seeds, 95% CI (seeds, then queries)",
                                     "io (0.561)", "program-code_best_of_k (0.600)"])
    assert len(ax.lines) == 3 + 1 + 2  # seeds, the mean (its error bars are a collection), references
    seed0 = next(line for line in ax.lines if line.get_label() == "seed 0")
    assert list(seed0.get_xdata()) == [0, 1, 2, 3] and list(seed0.get_ydata()) == [0.55, 0.6, 0.63, 0.65]
    assert list(next(line for line in ax.lines if line.get_label() == "seed 1").get_xdata()) == [1, 2, 3]
    io = next(line for line in ax.lines if line.get_label() == "io (0.561)")
    assert list(io.get_ydata()) == [0.561, 0.561]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["base", "1", "2", "3"]



def test_frontier_has_each_reference_each_round_mean_over_seeds_and_each_seed(tmp_path):
    """A hand-made summary: two seeds' base and round-0 evaluations, three references (one not evaluated). By hand:
    base (0.2 + 0.3) / 2 = 0.25 at (100 + 120) / 2 = 110 tokens; round 0 (0.5 + 0.6) / 2 = 0.55 at (200 + 300) / 2 =
    250, generator tokens 50 (seed 0 has none recorded). Pareto: pot (0.45 at 110) beats the base (0.25 at 110) and
    vote (0.40 at 600); round 0 is the only point above 0.45."""
    from pipeline.studies.report import build_experiment_report
    from pipeline.studies.summaries import ExperimentSummary

    def arm(seed, k, mean, tokens, gen=None):
        return {"seed": seed, "round": k, "eval_run_id": f"m-s{seed}-eval-{k}", "queries": 4, "mean_at_l": mean,
                "best_at_l": mean, "exec_tokens_per_query": tokens, "gen_tokens_per_query": gen}

    def ref(label, mean, tokens):
        return {"method": "program", "label": label, "eval_run_id": f"m-baseline-{label}", "queries": 4,
                "mean_at_l": mean, "exec_tokens_per_query": tokens, "gen_tokens_per_query": 0.0}

    summary = ExperimentSummary.from_dict({
        "experiment": "m", "seeds": [0, 1], "rounds": 1, "split": "test", "eval_queries": 4, "eval_l": 2,
        "arms": [arm(0, -1, 0.2, 100), arm(1, -1, 0.3, 120), arm(0, 0, 0.5, 200), arm(1, 0, 0.6, 300, gen=50.0)],
        "references": [ref("program-pot", 0.45, 110), ref("program-vote", 0.40, 600),
                       ref("program-steps", None, None)]})
    got = [(p.kind, p.name, p.seed, round(p.mean_at_l, 6), p.exec_tokens_per_query, p.gen_tokens_per_query, p.pareto)
           for p in summary.frontier()]
    assert got == [("reference", "program-pot", None, 0.45, 110, 0.0, True),
                   ("reference", "program-vote", None, 0.4, 600, 0.0, False),
                   ("round", "base model", None, 0.25, 110.0, None, False),
                   ("round", "round 0", None, 0.55, 250.0, 50.0, True),
                   ("round", "base model, seed 0", 0, 0.2, 100, None, None),
                   ("round", "base model, seed 1", 1, 0.3, 120, None, None),
                   ("round", "round 0, seed 0", 0, 0.5, 200, None, None),
                   ("round", "round 0, seed 1", 1, 0.6, 300, 50.0, None)]
    page = build_experiment_report(summary, tmp_path / "report.html").read_text()
    assert "<img src='frontier.png'" in page and (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    from pipeline.studies.report import plot_frontier

    (ax,) = plot_frontier(summary, tmp_path / "f.png").axes
    line = next(x for x in ax.lines if x.get_label().startswith("generator"))
    assert list(line.get_xdata()) == [110.0, 250.0] and [round(y, 6) for y in line.get_ydata()] == [0.25, 0.55]
    front = next(x for x in ax.lines if x.get_label() == "Pareto frontier")
    assert list(front.get_xdata()) == [110, 250.0]
    empty = ExperimentSummary.from_dict({"experiment": "m", "seeds": [0], "rounds": 1, "split": "test",
                                         "eval_queries": 4, "eval_l": 2})
    assert plot_frontier(empty, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


# ---- the best fixed workflow, chosen on dev ------------------------------------------------------------------------


def _ref(label: str, mean: float, tokens: float, pending: int = 0):
    from pipeline.studies.summaries import ReferenceArm

    return ReferenceArm(method=label, label=label, eval_run_id=f"r-{label}", queries=49, mean_at_l=mean,
                        best_at_l=mean, pending=pending, exec_tokens_per_query=tokens)


def test_best_fixed_ranks_by_the_choosing_split_and_keeps_to_the_trained_budget():
    """HumanEval's numbers (docs/learning.md): dev Mean@2 of IO, the example, best of 2 and best of 4 (0.58 made up:
    its dev run was never finished), their test executor tokens, and the trained generator's 1,074 a query."""
    from pipeline.studies.experiment import best_fixed

    dev = [_ref("io", 0.367, 0), _ref("example", 0.531, 0), _ref("bo2", 0.541, 0), _ref("bo4", 0.58, 0)]
    test = [_ref("io", 0.561, 1004), _ref("example", 0.606, 1075), _ref("bo2", 0.598, 1229), _ref("bo4", 0.636, 2107)]
    sel = best_fixed(dev, test, 1074, 0.25)  # at most 1,342.5 tokens: bo4 (2,107) is over
    assert (sel.same_budget, sel.any_budget) == ("bo2", "bo4")
    assert [(c.label, c.within_budget) for c in sel.candidates] == [
        ("bo4", False), ("bo2", True), ("example", True), ("io", True)]
    assert sel.candidates[1].exec_tokens_per_query == 1229  # the held-out split's tokens, not dev's
    # a slack of 0.1 (1,181.4 tokens) leaves best of 2 out too
    assert best_fixed(dev, test, 1074, 0.1).same_budget == "example"
    # an unfinished run on dev is not chosen, and is listed last
    dev[3] = _ref("bo4", 0.58, 0, pending=40)
    sel = best_fixed(dev, test, 1074, 0.25)
    assert (sel.same_budget, sel.any_budget) == ("bo2", "bo2") and sel.candidates[-1].label == "bo4"
    assert sel.unfinished == ["bo4"]
    # a tie on dev goes to the cheaper workflow; no trained arm yet: nothing is at its budget
    dev[1] = _ref("example", 0.541, 0)
    sel = best_fixed(dev, test, None, 0.25)
    assert (sel.same_budget, sel.any_budget) == (None, "example")


def test_experiment_runs_references_on_dev_and_names_the_best_fixed_workflow(tmp_path, fake_stages):
    """Fake stages: on test IO scores 0.25 and the program 0.75, on dev the other way round (0.9 and 0.5): the
    choice follows dev. A split that holds reported or trained-on queries is refused before any work."""
    from pipeline.studies.experiment import run_experiment

    calls = fake_stages
    program, tag = f"program:{PROGRAMS / 'expression_eval.py'}", "program-expression_eval"
    split = {"select_split": "dev", "select_queries": 1, "references": ["io", program], "seeds": [0]}
    path = _experiment_config(tmp_path, "d", split, rounds=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["benchmark"] |= {"train_split": "train", "dev_share": 0.5}
    path.write_text(yaml.safe_dump(cfg))
    out = run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    assert {"d-baseline-dev-io", f"d-baseline-dev-{tag}"} <= {r for r, _ in calls}
    sel = out.selection
    assert (sel.split, sel.same_budget, sel.any_budget, sel.missing, sel.unfinished) == ("dev", "io", "io", [], [])
    assert [(c.label, c.mean_at_l, c.queries) for c in sel.candidates] == [("io", 0.9, 1), (tag, 0.5, 1)]
    assert {r.label: r.mean_at_l for r in out.references} == {"io": 0.25, tag: 0.75}  # test unchanged
    assert "best fixed workflow on dev at any budget: io (dev Mean@L 0.900)" in out.headline()
    page = (tmp_path / "runs" / "experiments" / "d" / "report.html").read_text()
    assert "<h2>The best fixed workflow, chosen on dev</h2>" in page and "d-baseline-dev-io" in page

    # another experiment borrowing d's references borrows its dev runs too, checked like the others: dev runs of
    # another query count would not be the same choice
    fake_stages.clear()
    borrow = dict(cfg, run_id="b", experiment=dict(cfg["experiment"], references_from="d"))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(borrow))
    theirs = run_experiment(tmp_path / "b.yaml", direct_call(RetryPolicy(delay_s=0)))
    assert not any("-baseline-" in r for r, _ in fake_stages)
    assert [c.run_id for c in theirs.selection.candidates] == ["d-baseline-dev-io", f"d-baseline-dev-{tag}"]
    other = dict(borrow, run_id="c", experiment=dict(borrow["experiment"], select_queries=2))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(other))
    with pytest.raises(ConfigError, match="run d-baseline-dev-io has another benchmark section .*max_queries"):
        run_experiment(tmp_path / "c.yaml", direct_call(RetryPolicy(delay_s=0)))

    bad = dict(cfg, run_id="e", experiment=dict(cfg["experiment"], eval_split="dev"))
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="select_split dev shares queries with experiment.eval_split dev"):
        run_experiment(tmp_path / "e.yaml", direct_call(RetryPolicy(delay_s=0)))
    bad = dict(cfg, run_id="f", benchmark=dict(cfg["benchmark"], train_split="validate"))
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="select_split dev shares queries with benchmark.train_split validate"):
        run_experiment(tmp_path / "f.yaml", direct_call(RetryPolicy(delay_s=0)))
    assert not (tmp_path / "runs" / "e-s0").exists() and not (tmp_path / "runs" / "f-s0").exists()


def test_status_reads_where_an_experiment_stands_and_estimates_the_rest(tmp_path, fake_stages):
    """Seed 0 of two run (as `--only-seed 0` would): its runs are done, seed 1's and the references' are not; the
    CLI prints the same without running anything."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.studies.experiment import run_experiment, status, status_table

    path = _experiment_config(tmp_path, "t", {"references": ["io"]}, rounds=1)
    run_experiment(path, direct_call(RetryPolicy(delay_s=0)), only_seeds=[0])
    cfg = load_config(path)
    rows = status(Store(tmp_path / "runs"), cfg, [0, 1])
    table = status_table(rows)
    assert table.select("part", "run_id", "stages_done").rows() == [
        ("train", "t-s0", "4/4"), ("evaluate", "t-s0-eval-base", "2/2"), ("evaluate", "t-s0-eval-r0", "2/2"),
        ("train", "t-s1", "0/4"), ("evaluate", "t-s1-eval-base", "0/2"), ("evaluate", "t-s1-eval-r0", "0/2"),
        ("reference", "t-baseline-io", "0/2")]
    assert all(r["wall_s"] is not None for r in rows if r["done"])  # the runner timed every stage it ran
    # an evaluation or reference not run yet holds its planned workflows: 2 held-out queries x L = 2
    assert {r["workflows"] for r in rows if not r["done"] and r["part"] != "train"} == {4}
    calls = list(fake_stages)
    out = CliRunner().invoke(app, ["experiment", str(path), "--status"])
    assert out.exit_code == 0 and "10 of 18 stages left" in out.output and "t-baseline-io" in out.output
    from pipeline.engines.hardware import machine  # every timed stage says which machine took it

    assert f"timed on: {machine()}: {sum(1 for r in rows if r['done'] and r['wall_s'])} stages" in out.output
    assert fake_stages == calls  # nothing ran


def test_time_left_is_the_mean_of_the_stages_of_a_kind_already_done():
    from pipeline.studies.experiment import time_left

    def row(part, stage, done, wall):
        return {"part": part, "run_id": "r", "round": 0, "stage": stage, "done": done, "wall_s": wall}

    rows = [row("evaluate", "score", True, 600.0), row("evaluate", "score", True, 300.0),
            row("evaluate", "rollout", True, None),  # done without a timing (a fixed program's rollout): 0 s
            row("evaluate", "score", False, None), row("evaluate", "rollout", False, None),
            row("train", "train", False, None)]  # no train stage done yet: no estimate
    assert time_left(rows) == (450.0, 1, 0)
    # no reference done: its score stage by the mean of every done score stage (450 s), its rollout by theirs (0 s)
    assert time_left([*rows, row("reference", "score", False, None), row("reference", "rollout", False, None)]) \
        == (900.0, 1, 0)


def test_a_train_stage_with_saved_progress_shows_its_step_and_counts_the_steps_left(tmp_path):
    """The train stage saves its progress with its step beside it (pipeline.stages.progress); `--status` shows the
    step and estimates the rest by the share of steps left: a done train stage took 400 s, one saved at step 30 of
    120 has 3/4 of its steps left (300 s). Cleared with the progress."""
    from pipeline.stages.progress import clear_progress, save_progress, saved_steps
    from pipeline.studies.experiment import status_table, time_left

    path = tmp_path / "round=0" / "_train_progress.pt"
    assert saved_steps(path) is None
    save_progress(path, {"next_step": 30, "n_steps": 120, "weights": {}})
    assert saved_steps(path) == (30, 120)

    def row(run, done, wall, saved=None):
        return {"part": "train", "run_id": run, "round": 0, "stage": "train", "done": done, "wall_s": wall,
                "saved_step": saved}

    rows = [row("a-s0", True, 400.0), row("a-s1", False, None, saved_steps(path)), row("a-s2", False, None)]
    assert time_left(rows) == (400.0 * 0.75 + 400.0, 0, 0)
    assert status_table(rows).select("run_id", "saved").rows() == [
        ("a-s0", None), ("a-s1", "round 0: step 30 of 120"), ("a-s2", None)]
    assert "saved" not in status_table([rows[0], rows[2]]).columns  # no progress saved: no column
    clear_progress(path)
    assert saved_steps(path) is None and list(path.parent.iterdir()) == []


def test_time_left_scales_by_the_workflows_of_a_stage():
    """Done: two evaluation score stages, 600 s for 128 workflows and 300 s for 64: 900 / 192 = 4.6875 s a
    workflow. Left: an evaluation of 32 workflows (150 s), a reference on dev of 64 (by the score stages of any
    part: 300 s), and one whose count is unknown (the mean, 450 s)."""
    from pipeline.studies.experiment import time_left

    def row(part, done, wall, workflows):
        return {"part": part, "run_id": "r", "round": 0, "stage": "score", "done": done, "wall_s": wall,
                "workflows": workflows}

    done = [row("evaluate", True, 600.0, 128), row("evaluate", True, 300.0, 64)]
    assert time_left([*done, row("evaluate", False, None, 32)]) == (150.0, 0, 0)
    assert time_left([*done, row("reference on dev", False, None, 64)]) == (300.0, 0, 0)
    assert time_left([*done, row("evaluate", False, None, None)]) == (450.0, 0, 0)
    # a done stage without a count adds to the mean only: 900 + 0 s over 3 stages, 4.6875 s a workflow as before
    assert time_left([*done, row("evaluate", True, 0.0, None), row("evaluate", False, None, 32),
                      row("evaluate", False, None, None)]) == (150.0 + 300.0, 0, 0)


def test_time_left_prefers_the_stages_this_machine_timed():
    """Done: a score stage on a fast machine (100 s for 100 workflows: 1 s each) and one here (300 s for 100: 3 s
    each); a rollout on the fast machine only (50 s for 100). Left, 100 workflows each: the score stage by this
    machine's rate alone (300 s, not the pooled 2 s a workflow), the rollout by the fast machine's (50 s, counted as
    estimated elsewhere). Without a machine: both pooled (200 + 50 s)."""
    from pipeline.studies.experiment import time_left

    def row(stage, done, wall, machine):
        return {"part": "evaluate", "run_id": "r", "round": 0, "stage": stage, "done": done, "wall_s": wall,
                "workflows": 100, "machine": machine}

    rows = [row("score", True, 100.0, "fast"), row("score", True, 300.0, "here"), row("rollout", True, 50.0, "fast"),
            row("score", False, None, None), row("rollout", False, None, None)]
    assert time_left(rows, "here") == (350.0, 0, 1)
    assert time_left(rows) == (250.0, 0, 0)
    assert time_left(rows, "fast") == (150.0, 0, 0)  # both kinds timed there: 1 s and 0.5 s a workflow


def test_planned_workflows_of_a_training_round_an_evaluation_and_a_selection():
    from pipeline.studies.experiment import planned_workflows

    cfg = load_config("configs/mixed-learn.yaml")  # 18 queries x m = 6; 64 held-out queries x L = 2; 32 on dev
    assert [planned_workflows(cfg, k) for k in ("train", "evaluate", "select")] == [108, 128, 64]
    two = load_config("configs/mixed-learn.yaml", ["rollout.mode=two_level", "rollout.n_agents=2",
                                                   "rollout.n_workflows=3", "benchmark.max_queries=10"])
    assert planned_workflows(two, "train") == 60
    assert planned_workflows(load_config("configs/mixed-learn.yaml", ["rollout.mode=refine"]), "train") is None
    assert planned_workflows(load_config("configs/mixed-learn.yaml", ["experiment.eval_queries=null"]),
                             "evaluate") is None
    with pytest.raises(ValueError, match="kind 'smc'"):
        planned_workflows(cfg, "smc")


@pytest.mark.usefixtures("shared_sandbox")
def test_resample_on_failure_samples_fresh_answers_not_a_repair(tmp_path, scripted):
    """The HumanEval menu's resampling design. HumanEval/0: the greedy answer fails the public tests, then 2 fresh
    samples at 0.7: the second (the canonical solution) passes and is the answer. HumanEval/1: the greedy answer
    passes: one call. No request ever shows a failure to the executor (every request is the plain ask)."""
    items, right = _humaneval(tmp_path)
    first = items[0].meta["entry_point"]

    def texts(body, n):
        ep = _entry_point(body, items)
        if ep != first:
            return [right[ep]] * n
        return [_wrong(ep, 0)] * n if not body.get("temperature") else [_wrong(ep, 1), right[ep]]

    srv = scripted(texts)
    s = run_baseline(str(_config(tmp_path, srv.url, HUMANEVAL)), f"program:{PROGRAMS / 'code_resample.py'}",
                     in_process)
    assert (s.mean_at_l, s.exec_calls_per_query) == (1.0, 1.5)
    assert sorted((r["body"].get("n") or 1, r["body"].get("temperature")) for r in srv.requests) == \
        [(1, 0.0), (1, 0.0), (2, 0.7)]
    assert all(len(r["body"]["messages"]) == 1 for r in srv.requests)
    assert _answers(Store(tmp_path / "store"), s.eval_run_id)["HumanEval/0"] == right[first]


@pytest.mark.usefixtures("shared_sandbox")
def test_word_steps_check_resamples_only_on_disagreement(tmp_path, scripted):
    """word_steps_check on gsm_symbolic: on the first query the reasoned answer and the expression agree (2 calls);
    on the second they differ (gold + 1 against gold), 3 samples at 0.7 say gold, gold, 5: the vote of all five is
    gold. Both right: Mean@1 1.0 at 2.5 calls a query."""
    bench = {"name": "procedural", "tasks": ["gsm_symbolic"], "size": 20, "train_split": "train"}
    held_out = load_config(_config(tmp_path, "http://127.0.0.1:9/v1", bench),
                           ["benchmark.train_split=test", "benchmark.max_queries=2"]).benchmark
    items = load_benchmark(held_out).items()
    gold = [int(it.reference["answer"]) for it in items]

    def texts(body, n):
        asked = body["messages"][-1]["content"]
        q = next(i for i, it in enumerate(items) if asked.startswith(it.prompt))
        g = gold[q]
        if "Python expression" in asked:
            return [f"{g - 3} + 3"]
        if n == 3:
            return [f"Step.\nAnswer: {g:,}", f"Answer: {g}.", "Answer: 5"]
        return [f"Some steps.\nAnswer: {g if q == 0 else g + 1}"]

    srv = scripted(texts)
    s = run_baseline(str(_config(tmp_path, srv.url, bench)), f"program:{PROGRAMS / 'word_steps_check.py'}",
                     in_process)
    assert (s.mean_at_l, s.exec_calls_per_query) == (1.0, 2.5)
    assert _answers(Store(tmp_path / "store"), s.eval_run_id) == {items[0].id: str(gold[0]),
                                                                      items[1].id: str(gold[1])}


def _program(name: str, replies):
    """The program file's `solve` with `llm` answering `replies(prompt, temperature, n)`; returns (solve, calls)."""
    calls = []

    async def llm(messages, temperature=0.0, n=1, **_):
        prompt = messages if isinstance(messages, str) else messages[-1]["content"]
        calls.append((prompt, temperature, n))
        return replies(prompt, temperature, n)

    scope = {"llm": llm}
    exec(compile((PROGRAMS / name).read_text(), name, "exec"), scope)
    return scope["solve"], calls


def test_the_hand_written_router_routes_by_the_querys_wording():
    """mixed_router: a multiplication is computed in Python (no executor call), a calendar question about one date
    gets one greedy step-by-step answer, a word problem or a count of weekdays 5 samples and a vote on the final
    number."""
    import asyncio

    def replies(prompt, temperature, n):
        if "day of the week" in prompt:
            return ["October 28, 2022 was a...\nAnswer: Friday."]
        return ["Answer: 1,200", "so Answer: 1200.", "Answer: 7", "no answer here", "Answer: 1200"][:n]

    solve, calls = _program("mixed_router.py", replies)
    assert asyncio.run(solve("Solve the following multiplication: 361 * 220. Give only the result.")) == "79420"
    assert calls == []
    date = "What day of the week was October 28, 2022? Reply with just the weekday name."
    assert asyncio.run(solve(date)) == "Friday" and calls[-1][1:] == (0.0, 1)
    count = "Between Monday, January 17, 2022 and Saturday, March 12, 2022 (counting both dates), how many times " \
            "does Thursday occur? Answer with a number."
    assert asyncio.run(solve(count)) == "1200" and calls[-1][1:] == (0.7, 5)
    assert asyncio.run(solve("Tom has 3 boxes of 400 pens. How many pens?")) == "1200" and calls[-1][1:] == (0.7, 5)
