"""`pipeline bench crn` (pipeline/perf/crn.py): the copied arms are the source's workflows on the shared queries,
copied once, and the widths and ratios are the bootstrap's, checked on hand-computed cases. The measurement itself
(a real executor, minutes to hours) is a bench, in docs/performance.md."""

import uuid

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError
from pipeline.perf.crn import (
    ArmVariance,
    CrnResult,
    ModeCost,
    PairWidth,
    arm_variance,
    common_queries,
    copy_arm,
    pair_width,
    ratio,
)
from pipeline.run import open_run
from pipeline.store import Store


def _eval_run(root, queries: list[str], per_query: int = 2) -> str:
    rid = f"ev{uuid.uuid4().hex[:6]}"
    ctx = open_run("configs/smoke.yaml", rid, 0, [f"store.root={root}"], store_root=str(root))
    ctx.store.write("queries", [{"query_id": q, "split": "test", "prompt": f"what is {q}?", "reference": "1"}
                                     for q in queries], rid, 0)
    ctx.store.write("generations", [{"gen_id": f"{q}-{i}", "query_id": q, "slot": i, "kind": "workflow", "valid": True,
                                     "text": f"async def solve(problem):\n    return '{q}{i}'"}
                                    for q in queries for i in range(per_query)], rid, 0)
    return rid


def test_arms_are_copied_on_the_shared_queries_once(tmp_path):
    src = Store(str(tmp_path / "src"))
    a, b = _eval_run(src.root, ["q1", "q2", "q3"]), _eval_run(src.root, ["q2", "q3", "q4"])
    shared = common_queries(src, {"a": a, "b": b}, limit=None)
    assert shared == ["q2", "q3"]
    assert common_queries(src, {"a": a, "b": b}, limit=1) == ["q2"]
    dst = Store(str(tmp_path / "dst"))
    copy_arm(src, dst, a, shared)
    copy_arm(src, dst, a, shared)  # a resumed bench copies nothing twice
    gens = dst.read("generations", a, 0)
    assert sorted(gens["gen_id"].to_list()) == ["q2-0", "q2-1", "q3-0", "q3-1"]
    assert sorted(dst.read("queries", a, 0)["query_id"].to_list()) == ["q2", "q3"]
    assert dst.manifest(a, 0, "rollout")["counts"]["generations"] == 4
    assert dst.manifest(a, 0, "score") is None  # the score stage is what the bench runs
    frozen = [open_run(None, a, 0, None, str(s.root)).frozen_hash for s in (src, dst)]
    assert frozen[0] == frozen[1]


def test_a_bench_asked_for_more_queries_copies_only_the_new_ones_and_reopens_scoring(tmp_path):
    src = Store(str(tmp_path / "src"))
    a = _eval_run(src.root, ["q1", "q2", "q3"])
    dst = Store(str(tmp_path / "dst"))
    copy_arm(src, dst, a, ["q1"])
    dst.write_manifest(a, 0, "score", "h", runs=2)  # as if the 1-query bench had been scored
    copy_arm(src, dst, a, ["q1", "q2"])
    assert sorted(dst.read("generations", a, 0)["gen_id"].to_list()) == ["q1-0", "q1-1", "q2-0", "q2-1"]
    assert sorted(dst.read("queries", a, 0)["query_id"].to_list()) == ["q1", "q2"]
    assert len(dst.parts("generations", a)) == 2  # q1's part kept as it was, q2's added
    assert dst.manifest(a, 0, "rollout")["counts"] == {"queries": 2, "generations": 4, "copied_from": str(src.root)}
    assert dst.manifest(a, 0, "score") is None  # scoring resumes, on q2's workflows alone
    with pytest.raises(ConfigError, match=r"already holds 2 queries.*at least 2"):
        copy_arm(src, dst, a, ["q1"])
    dst.clear_manifest(a, 0, "rollout")  # a copy cut off after its tables, before its manifest: rows not doubled
    copy_arm(src, dst, a, ["q1", "q2"])
    assert dst.read("generations", a, 0).height == 4 and dst.manifest(a, 0, "rollout") is not None


def test_missing_or_disjoint_arms_are_refused(tmp_path):
    src = Store(str(tmp_path / "src"))
    a, b = _eval_run(src.root, ["q1"]), _eval_run(src.root, ["q2"])
    with pytest.raises(ConfigError, match="share no query"):
        common_queries(src, {"a": a, "b": b}, None)
    with pytest.raises(ConfigError, match="nope.*not found"):
        common_queries(src, {"a": a, "b": "nope"}, None)


def test_widths_and_ratio_by_hand():
    # differences a - b per query: [1, 0]: mean 0.5; a resample's mean is 0, 0.5 or 1 (each end with p = 1/4), so
    # the 2.5% and 97.5% quantiles of 10,000 resamples are 0 and 1: half-width 0.5
    w = pair_width({"a": {"q1": 1.0, "q2": 0.0, "q3": 0.5}, "b": {"q1": 0.0, "q2": 0.0}}, "a", "b", "without")
    assert (w.pair, w.mean, w.lo, w.hi, w.half_width) == ("a - b", 0.5, 0.0, 1.0, 0.5)  # q3 is in one arm only
    widths = [w, PairWidth("a - b", "with", 0.5, 0.25, 0.75)]
    assert ratio(widths, "a - b") == 0.5
    assert ratio([PairWidth("x - y", "without", 0, 0, 0), PairWidth("x - y", "with", 0, 0, 0)], "x - y") is None
    r = CrnResult("s", {"a": "ra", "b": "rb"}, 2, [], widths, [ModeCost("with", 1.5, 300, 900)],
                  [ArmVariance("a", "with", 4, 1)])
    assert r.to_dict()["ratios"] == {"a - b": 0.5} and r.to_dict()["widths"][1]["half_width"] == 0.25
    assert r.to_dict()["variance"] == [{"arm": "a", "mode": "with", "queries": 4, "varied": 1, "varied_share": 0.25}]
    assert r.lines() == ["without CRN  a - b: 0.500 [0.000, 1.000], half-width 0.500",
                         "   with CRN  a - b: 0.500 [0.250, 0.750], half-width 0.250",
                         "a - b: half-width with / without CRN 0.50",
                         "   with CRN  executor tokens computed 300 of 900 used, wall 1.5 s in this invocation "
                         "(a resumed mode: only what it scored now)",
                         "   with CRN  arm a: 1 of 4 queries with score variance (0.250)"]


def test_score_variance_counts_a_query_whose_workflow_scores_differ(tmp_path):
    """Three queries of two workflows each: q1 scored 1 and 0 (varied), q2 1 and 1 (not), q3 0 and an invalid
    workflow, which curation reads as 0 (not varied): 1 of 3. A second rep is averaged in: q2's second workflow at 1
    then 0 is 0.5, so q2 varies too: 2 of 3."""
    src = Store(str(tmp_path / "src"))
    rid = _eval_run(src.root, ["q1", "q2", "q3"])
    gens = src.read("generations", rid, 0).with_columns(
        valid=src.read("generations", rid, 0)["gen_id"] != "q3-1").drop("round")
    src.write("generations", gens, rid, 0)
    scores = {"q1-0": [1.0, 1.0], "q1-1": [0.0, 0.0], "q2-0": [1.0, 1.0], "q2-1": [1.0, 0.0], "q3-0": [0.0, 0.0]}
    for r in range(2):
        src.write("scores", [{"gen_id": g, "rep": r, "attempt": 0, "status": "ok", "score": v[r]}
                             for g, v in scores.items()], rid, 0)
        assert arm_variance(src, "a", rid, "with", reps=r + 1) == ArmVariance("a", "with", 3, 1 + r)


def test_the_command_refuses_bad_arms_and_pairs(tmp_path):
    r = CliRunner().invoke(app, ["bench", "crn", "--store", str(tmp_path), "--arm", "base", "--pair", "a-b",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "NAME=VALUE" in r.output
    r = CliRunner().invoke(app, ["bench", "crn", "--store", str(tmp_path), "--arm", "my-base=x", "--pair", "a-b",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "may not hold" in r.output
    r = CliRunner().invoke(app, ["bench", "crn", "--store", str(tmp_path), "--arm", "a=x", "--arm", "b=y",
                                 "--pair", "a-c", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "pair a - c: arms are a, b" in r.output
