"""The run report: per-round numbers (checked by hand) and the HTML page."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import RunConfig
from pipeline.store import Store
from pipeline.studies.report import build_report, round_stats, stage_timings, status_counts


@pytest.fixture
def store(tmp_path):
    st = Store(tmp_path)
    st.run_dir("r").mkdir(parents=True)
    (st.run_dir("r") / "config.yaml").write_text("run_id: r\n")
    gens = [{"gen_id": g, "kind": "workflow", "valid": v} for g, v in (("a", True), ("b", True), ("c", False))]
    gens.append({"gen_id": "p", "kind": "agent", "valid": True})  # agents are not workflows
    st.write("generations", gens, "r", 0)
    st.write("scores", [
        # a: two reps; rep 0 failed first (executor_error), its retry (attempt 1) scored 1.0 -> a = (1.0 + 0.5) / 2
        {"gen_id": "a", "rep": 0, "attempt": 0, "status": "executor_error", "score": 0.0, "tokens_in": 100},
        {"gen_id": "a", "rep": 0, "attempt": 1, "status": "ok", "score": 1.0, "tokens_in": 10, "tokens_out": 2,
         "cost_usd": 0.5, "llm_calls": 1},
        {"gen_id": "a", "rep": 1, "attempt": 0, "status": "ok", "score": 0.5, "tokens_in": 20, "tokens_out": 3,
         "cost_usd": 0.25, "llm_calls": 2},
        {"gen_id": "b", "rep": 0, "attempt": 0, "status": "ok", "score": 0.0, "tokens_in": 5},
        {"gen_id": "b", "rep": 1, "attempt": 0, "status": "timeout", "score": 0.0},
        {"gen_id": "c", "rep": 0, "attempt": 0, "status": "invalid", "score": 0.0},
        {"gen_id": "c", "rep": 1, "attempt": 0, "status": "invalid", "score": 0.0},
    ], "r", 0)
    st.write("groups", [{"group_id": "g1", "kept": True}, {"group_id": "g2", "kept": False}], "r", 0)
    st.write("train_metrics", [{"step": 0, "loss": 1.0, "kl": 0.0, "clip_frac": 0.0, "tokens": 40},
                               {"step": 1, "loss": 0.5, "kl": 0.2, "clip_frac": 0.5, "tokens": 60}], "r", 0)
    st.write("generations", [{"gen_id": "d", "kind": "workflow", "valid": True}], "r", 1)
    st.write("scores", [{"gen_id": "d", "rep": 0, "attempt": 0, "status": "ok", "score": 0.25}], "r", 1)
    st.write("scores", [{"gen_id": "x", "rep": 0, "attempt": 0, "status": "ok", "score": 1.0}], "other", 0)
    lines = [{"round": 0, "stage": "rollout", "skipped": False, "wall_s": 3.0},
             {"round": 0, "stage": "score", "skipped": False, "wall_s": 7.0},  # crashed attempt
             {"round": 0, "stage": "score", "skipped": False, "wall_s": 5.0},  # the resumed one counts
             {"round": 0, "stage": "rollout", "skipped": True, "wall_s": 0.0}]
    (st.run_dir("r") / "timings.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return st


def test_round_stats_hand_computed(store):
    s = round_stats(store, "r").to_dicts()
    assert [r["round"] for r in s] == [0, 1]
    r0, r1 = s
    assert r0["workflows"] == 3 and r0["valid_share"] == pytest.approx(2 / 3)
    assert r0["scored"] == 3 and r0["mean_score"] == pytest.approx((0.75 + 0.0 + 0.0) / 3)
    assert r0["best_score"] == pytest.approx(0.75)
    # latest attempts only: the failed attempt's 100 tokens are not counted
    assert (r0["tokens_in"], r0["tokens_out"], r0["llm_calls"]) == (35, 5, 3)
    assert r0["cost_usd"] == pytest.approx(0.75)
    assert r0["groups_kept"] == 1 and r0["steps"] == 2
    assert r0["loss"] == pytest.approx(0.75) and r0["kl"] == pytest.approx(0.1) and r0["clip_frac"] == 0.25
    assert r0["train_tokens"] == 100
    assert r1["mean_score"] == 0.25 and r1["workflows"] == 1 and r1["steps"] is None and r1["groups_kept"] is None


def test_status_counts_use_latest_attempt(store):
    got = {(r["round"], r["status"]): r["n"] for r in status_counts(store, "r").to_dicts()}
    assert got == {(0, "ok"): 3, (0, "timeout"): 1, (0, "invalid"): 2, (1, "ok"): 1}


def test_stage_timings_keep_last_non_skipped(store):
    t = {(r["round"], r["stage"]): r["wall_s"] for r in stage_timings(store, "r").to_dicts()}
    assert t == {(0, "rollout"): 3.0, (0, "score"): 5.0}
    assert stage_timings(store, "r")["machine"].to_list() == [None, None]  # lines older than the machine's record
    line = {"round": 0, "stage": "score", "skipped": False, "wall_s": 6.0, "machine": "AMD EPYC (AVX2, 2 cores)"}
    with open(store.run_dir("r") / "timings.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    assert stage_timings(store, "r").rows() == [(0, "rollout", 3.0, None),
                                                (0, "score", 6.0, "AMD EPYC (AVX2, 2 cores)")]


def summary_table(page: str) -> list[dict[str, str]]:
    """The rows of the report's "Summary per round" table, as {column: cell text}."""
    table = page.split("<h2>Summary per round</h2>", 1)[1].split("</table>", 1)[0]
    head = re.findall(r"<th>(.*?)</th>", table)
    return [dict(zip(head, re.findall(r"<td>(.*?)</td>", row), strict=True))
            for row in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1])]


def test_html_report_has_every_section(store, tmp_path):
    path = build_report(store, "r", tmp_path / "out" / "rep.html")
    page = path.read_text()
    for title in ("Score distribution", "Mean and best score", "Valid workflows", "Status counts",
                  "Training: loss, KL, clip fraction", "Tokens and cost", "Wall time per stage", "Summary per round"):
        assert f"<h2>{title}</h2>" in page, title
    assert page.count("plotly.js v") >= 1 and "Plotly.newPlot" in page  # plotly.js inlined: opens offline
    r0, r1 = summary_table(page)
    assert (r0["round"], r0["mean_score"], r0["best_score"], r0["tokens_in"]) == ("0", "0.25", "0.75", "35")
    assert (r0["rollout_s"], r0["score_s"], r0["round_s"]) == ("3", "5", "8")  # the resumed score run: 3 s + 5 s
    assert (r1["round"], r1["mean_score"], r1["workflows"], r1["round_s"]) == ("1", "0.25", "1", "")


def test_report_cli_prints_numbers_and_path(store):
    res = CliRunner().invoke(app, ["report", "r", "--store", str(store.root)])
    assert res.exit_code == 0, res.output
    assert "round 0: mean score 0.250" in res.output and "round wall s 8.0" in res.output
    assert f"report: {store.run_dir('r') / 'report.html'}" in res.output


def test_report_unknown_run_is_a_clear_error(store):
    res = CliRunner().invoke(app, ["report", "nope", "--store", str(store.root)])
    assert res.exit_code == 2 and "run 'nope' not found" in res.output and "runs: r" in res.output


def _experiment(paired_extra: dict) -> dict:
    """An experiment.json body: one seed, base and round 0, one paired row (its intervals plus `paired_extra`)."""
    arm = {"seed": 0, "queries": 2, "mean_at_l": 0.25, "best_at_l": 0.5, "valid_share": 1.0, "status": {"ok": 4}}
    paired = {"round": 0, "metric": "mean_at_l", "n": 2, "base": 0.25, "trained": 0.75, "mean": 0.5, "lo": 0.0,
              "hi": 1.0, "level": 0.95, "lo_by_query": 0.0, "hi_by_query": 1.0,
              "per_seed": [{"seed": 0, "n": 2, "mean": 0.5, "lo": 0.0, "hi": 1.0}], **paired_extra}
    return {"experiment": "e", "seeds": [0], "rounds": 1, "split": "test", "eval_queries": 2, "eval_l": 2,
            "arms": [arm | {"round": -1, "eval_run_id": "e-s0-eval-base"},
                     arm | {"round": 0, "mean_at_l": 0.75, "eval_run_id": "e-s0-eval-r0"}], "paired": [paired],
            "per_query": []}


def _cells(page: str, column: str) -> list[str]:
    """The cells of `column` in the report's paired-differences table."""
    table = page.split("<h2>Paired differences</h2>", 1)[1].split("</table>", 1)[0]
    head = re.findall(r"<th>(.*?)</th>", table)
    rows = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1])]
    return [row[head.index(column)] for row in rows]


def test_experiment_report_headline_interval_and_older_summaries(tmp_path):
    """The seeds-then-queries interval is the headline of the report and of `pipeline report`; an experiment.json
    written before it existed still reads, with n/a in its place."""
    from pipeline.studies.experiment import experiment_dir
    from pipeline.studies.report import build_experiment_report
    from pipeline.studies.summaries import ExperimentSummary

    new = build_experiment_report(ExperimentSummary.from_dict(_experiment({"lo_seeds_queries": -0.25,
                                                                           "hi_seeds_queries": 1.0})),
                                  tmp_path / "new.html").read_text()
    assert _cells(new, "ci_seeds_queries") == ["[-0.250, +1.000]"] and _cells(new, "ci_pairs") == ["[+0.000, +1.000]"]
    old = build_experiment_report(ExperimentSummary.from_dict(_experiment({})), tmp_path / "old.html").read_text()
    assert _cells(old, "ci_seeds_queries") == ["n/a"] and _cells(old, "ci_queries") == ["[+0.000, +1.000]"]
    st = Store(tmp_path / "runs")
    for name, extra in (("old", {}), ("new", {"lo_seeds_queries": -0.25, "hi_seeds_queries": 1.0})):
        experiment_dir(st, name).mkdir(parents=True)
        (experiment_dir(st, name) / "experiment.json").write_text(json.dumps(_experiment(extra)))
    res = CliRunner().invoke(app, ["report", "old", "--store", str(st.root)])
    assert res.exit_code == 0, res.output
    assert "paired difference +0.500 n/a 95% bootstrap CI resampling seeds, then queries (pairs: [+0.000, +1.000]; " \
           "queries: [+0.000, +1.000])" in res.output
    res = CliRunner().invoke(app, ["report", "new", "--store", str(st.root)])
    assert "paired difference +0.500 [-0.250, +1.000] 95% bootstrap CI resampling seeds" in res.output
    assert "  seed 0: +0.500 [+0.000, +1.000] over 2 queries" in res.output

def test_flagged_rewarded_runs_are_counted_in_sql_the_report_and_the_cli(store):
    """Round 1 gets runs with and without `scores.flags`; a part written before the column existed (the fixture's)
    reads as not flagged. Counted: flagged (non-empty) and rewarded by the metric (> 0), latest attempt only."""
    store.write("scores", [
        {"gen_id": "f1", "rep": 0, "attempt": 0, "status": "ok", "metric": 1.0, "score": 0.0,
         "flags": "answer:exit"},  # zeroed by the rule, still counted: its metric rewarded it
        {"gen_id": "f2", "rep": 0, "attempt": 0, "status": "ok", "metric": 0.0, "score": 0.0, "flags": "answer:gc"},
        {"gen_id": "f3", "rep": 0, "attempt": 0, "status": "ok", "metric": 1.0, "score": 1.0, "flags": ""},
        {"gen_id": "f4", "rep": 0, "attempt": 0, "status": "ok", "metric": 1.0, "score": 0.0,
         "flags": "workflow:frames"},
        {"gen_id": "f4", "rep": 0, "attempt": 1, "status": "ok", "metric": 1.0, "score": 1.0, "flags": ""},
    ], "r", 1)
    n = store.sql("SELECT count(*) AS n FROM latest_scores WHERE run_id = 'r' AND flags <> '' AND metric > 0")
    assert n["n"].to_list() == [1]
    assert [r["flagged_rewarded"] for r in round_stats(store, "r").to_dicts()] == [0, 1]
    res = CliRunner().invoke(app, ["report", "r", "--store", str(store.root)])
    assert "round 0: mean score 0.250, workflows 3, valid 0.6666666666666666, flagged rewarded runs 0" in res.output
    assert "flagged rewarded runs 1" in res.output
    assert summary_table(build_report(store, "r").read_text())[1]["flagged_rewarded"] == "1"


def test_the_report_shows_what_the_gradient_sees_by_part_and_the_designs(tmp_path):
    """Part A: q1's workflows score 1 and 0 (varied, one group kept; a kept `pair` row is not a group), q2's 0 and 0
    (a group not kept); part B: q3's 0.5 and 0.5. By hand: A has 2 queries, mean (0.5 + 0) / 2, 1 varied, 1 group;
    B 1 query, 0.5, none varied, no group."""
    from pipeline.store.views import part_signal

    st = _parts_store(tmp_path)
    assert part_signal(st, "m").rows() == [(0, "A", 2, 0.25, 1, 1), (0, "B", 1, 0.5, 0, 0)]
    page = build_report(st, "m", tmp_path / "rep.html").read_text()
    assert "<h2>By part: what the gradient sees</h2>" in page and "<h2>Designs</h2>" in page


def test_curation_counts_groups_by_part_and_names_a_part_the_update_cannot_see(tmp_path, caplog):
    from types import SimpleNamespace

    from pipeline.stages.curate import parts_kept

    st = _parts_store(tmp_path)
    with caplog.at_level("WARNING", "pipeline.stages.curate"):
        ctx = SimpleNamespace(store=st, run_id="m", round=0, cfg=RunConfig())
        assert parts_kept(ctx) == {"groups_by_part": {"A": 1, "B": 0}}
    assert "m round 0: no group kept from B (1 queries, 0 with varied scores)" in caplog.text
    assert parts_kept(SimpleNamespace(**{**vars(ctx), "round": 1})) == {}  # no such round: one part or none
    refine = RunConfig(rollout={"mode": "refine"})  # a refine round's groups are a task's, not a query's
    assert parts_kept(SimpleNamespace(**{**vars(ctx), "cfg": refine})) == {}


def _parts_store(tmp_path) -> Store:
    """Run m, round 0: part A's q1 (workflows 1 and 0), q2 (0 and 0); part B's q3 (0.5 and 0.5); groups: q1 kept (a
    kept `pair` row besides), q2 not kept."""
    st = Store(tmp_path)
    st.run_dir("m").mkdir(parents=True)
    (st.run_dir("m") / "config.yaml").write_text("run_id: m\n")
    st.write("queries", [{"query_id": q, "meta": json.dumps({"task": t})} for q, t in
                         (("q1", "A"), ("q2", "A"), ("q3", "B"))], "m", 0)
    wf = [("q1", 1.0), ("q1", 0.0), ("q2", 0.0), ("q2", 0.0), ("q3", 0.5), ("q3", 0.5)]
    st.write("generations", [{"gen_id": f"g{i}", "kind": "workflow", "query_id": q, "valid": True,
                              "design": "pot" if i % 2 else "steps", "example": "pot"} for i, (q, _) in enumerate(wf)],
             "m", 0)
    st.write("scores", [{"gen_id": f"g{i}", "query_id": q, "rep": 0, "attempt": 0, "status": "ok", "score": s}
                        for i, (q, s) in enumerate(wf)], "m", 0)
    st.write("groups", [{"group_id": "a", "query_id": "q1", "kept": True, "kind": "group"},
                        {"group_id": "b", "query_id": "q1", "kept": True, "kind": "pair"},
                        {"group_id": "c", "query_id": "q2", "kept": False, "kind": "group"}], "m", 0)
    return st


def test_a_run_of_one_part_without_a_menu_has_neither_table(store, tmp_path):
    page = build_report(store, "r", tmp_path / "rep.html").read_text()
    assert "By part" not in page and "<h2>Designs</h2>" not in page


def test_copies_of_the_menus_designs_are_counted_with_their_scores_by_part(tmp_path):
    """Design a's three workflows in part A: one copy inside a fenced block with a comment of its own (score 1), one
    copy laid out differently (0.5), one variant that returns something else (0); design b's one workflow in part B,
    a variant (0.25); an `other` workflow is no design's. By hand: A/a 3 workflows, 2 copies at (1 + 0.5) / 2, the
    rest 0; B/b 1 workflow, no copy, the rest 0.25."""
    from pipeline.studies.report import design_copies

    a = "async def solve(problem):\n    return (await llm(problem))[0]\n"
    b = "async def solve(problem):\n    r = await llm(problem, n=2)\n    return r[0]\n"
    menu = []
    for name, code in (("a", a), ("b", b)):
        (path := tmp_path / f"{name}.py").write_text(f"# design: {name}\n{code}")
        menu.append(str(path))
    st = Store(tmp_path / "store")
    st.run_dir("m").mkdir(parents=True)
    (st.run_dir("m") / "config.yaml").write_text(yaml.safe_dump({"run_id": "m", "rollout": {"example_menu": menu}}))
    wf = [("q1", "A", "a", f"```python\n# mine\n{a}```", 1.0),
          ("q1", "A", "a", "async def solve(problem):\n\n    return (await llm(problem)) [0]\n", 0.5),
          ("q2", "A", "a", "async def solve(problem):\n    return (await llm(problem))[1]\n", 0.0),
          ("q3", "B", "b", b.replace("n=2", "n=3"), 0.25),
          ("q3", "B", "other", "async def solve(problem):\n    return '4'\n", 1.0)]
    st.write("queries", [{"query_id": q, "meta": json.dumps({"task": t})} for q, t in
                         (("q1", "A"), ("q2", "A"), ("q3", "B"))], "m", 0)
    st.write("generations", [{"gen_id": f"g{i}", "kind": "workflow", "query_id": q, "valid": True, "design": d,
                              "text": text} for i, (q, _, d, text, _) in enumerate(wf)], "m", 0)
    st.write("scores", [{"gen_id": f"g{i}", "query_id": q, "rep": 0, "attempt": 0, "status": "ok", "score": s}
                        for i, (q, _, _, _, s) in enumerate(wf)], "m", 0)
    assert design_copies(st, "m").rows() == [(0, "A", "a", 3, 2, 0.75, 0.0), (0, "B", "b", 1, 0, None, 0.25)]
    assert "<h2>Copies of the menu's designs</h2>" in build_report(st, "m", tmp_path / "rep.html").read_text()
    # the menu's files not here (a store read elsewhere): no table, no error
    gone = {"run_id": "m", "rollout": {"example_menu": [str(tmp_path / "gone.py")]}}
    (st.run_dir("m") / "config.yaml").write_text(yaml.safe_dump(gone))
    assert design_copies(st, "m").height == 0
