"""The studies' typed summaries (pipeline.studies.summaries): every committed study JSON reads and writes back byte
for byte, a record built here writes today's keys in today's order, and each summary's lines and tables, written
out by hand for small known summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.studies.formatting import num, signed, span
from pipeline.studies.summaries import (
    AblationSummary,
    ArmDiff,
    EvalSummary,
    ExperimentArm,
    ExperimentSummary,
    MethodArm,
    MethodSeedRow,
    MethodsSummary,
    RoundDiff,
    SeedDiff,
)

REPO = Path(__file__).resolve().parents[1]
KINDS = {"experiment": ExperimentSummary, "ablation": AblationSummary, "methods": MethodsSummary}
# what a study stores beside its summary: the run's facts (run_experiment, run_ablation, run_methods)
RUN_FACTS = {"command", "config", "sets", "arm_sets", "seed_wall_s", "references_wall_s", "resummarised"}


def _committed() -> list[Path]:
    """The studies' summaries; the arms' choices (<store>/experiments/arms/) are a kind of their own, below."""
    return sorted([*REPO.glob("docs/*.json"), *(p for p in REPO.glob("data/stores/*/experiments/*/*.json")
                                                if p.parent.name != "arms")])


def _arm_choices() -> list[Path]:
    return sorted(REPO.glob("data/stores/*/experiments/arms/*.json"))


def _kind(path: Path) -> type:
    """docs/<name>-<kind>.json or <store>/experiments/<id>/<kind>.json."""
    return KINDS[path.stem.rsplit("-", 1)[-1]]


def test_every_committed_study_json_is_one_the_test_reads():
    paths = _committed()
    assert len(paths) >= 6 and REPO / "docs" / "objectives-ablation.json" in paths
    # every kind a study writes is committed somewhere (the methods comparison's in data/stores/mixed3), so each
    # kind's reader meets a real file below
    assert {_kind(p) for p in paths} == {ExperimentSummary, AblationSummary, MethodsSummary}
    assert REPO / "data" / "stores" / "mixed3" / "experiments" / "mixed3-methods" / "methods.json" in paths


@pytest.mark.parametrize("path", _committed(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_committed_study_json_round_trips_byte_for_byte(path):
    text = path.read_text()
    stored = json.loads(text)
    summary = _kind(path).read(path)
    assert summary.to_dict() == stored
    assert json.dumps(summary.to_dict(), indent=1) == text  # the same keys in the same order, nested ones too
    # read into its fields and nested records, not kept aside: only the run's facts are left over
    assert set(summary.extra) <= RUN_FACTS and summary.experiment == stored["experiment"]
    assert [a.to_dict() for a in summary.arms] == stored["arms"]
    assert all(isinstance(p, RoundDiff | ArmDiff) and p.n == s["n"] for p, s in zip(summary.paired, stored["paired"],
                                                                                     strict=True))


@pytest.mark.parametrize("path", _arm_choices(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_committed_arms_choice_round_trips_byte_for_byte(path):
    from pipeline.studies.arms import ArmChoice, ArmRow
    from pipeline.studies.summaries import Verdict

    text = path.read_text()
    choice = ArmChoice.read(path)
    assert json.dumps(choice.to_dict(), indent=1) + "\n" == text and not choice.extra
    assert all(isinstance(r, ArmRow) and not r.extra for r in choice.arms)
    assert choice.chosen in {r.arm for r in choice.arms} and isinstance(choice.verdict, Verdict)


# ---- the learning experiment -----------------------------------------------------------------------------------------


def _experiment() -> dict:
    """experiment.json of one seed: the base model (a two-level run: Sel@L) and round 0, one paired row, one
    reference with the base model against it, the best fixed workflow chosen on dev."""
    arm = {"eval_run_id": "e-s0-eval-base", "queries": 4, "mean_at_l": 0.25, "best_at_l": 0.5, "majority_at_l": 0.25,
           "valid_share": 0.875, "workflows": 16, "pending": 0, "gen_tokens_per_query": 1200.4,
           "exec_tokens_per_query": 799.6, "truncated_share": 0.1, "status": {"ok": 15, "timeout": 1},
           "select_at_l": 0.5}
    interval = {"n": 4, "mean": 0.125, "lo": -0.25, "hi": 0.5, "level": 0.95, "lo_seeds_queries": -0.3125,
                "hi_seeds_queries": 0.5, "lo_by_query": -0.25, "hi_by_query": 0.4375,
                "per_seed": [{"seed": 0, "n": 4, "mean": 0.125, "lo": -0.25, "hi": 0.5}]}
    return {"experiment": "e", "seeds": [0], "rounds": 1, "split": "test", "eval_queries": 4, "eval_l": 4,
            "shared_base": False,
            "arms": [{"seed": 0, "round": -1, **arm},
                     {"seed": 0, "round": 0, **arm, "eval_run_id": "e-s0-eval-r0", "mean_at_l": 0.375,
                      "truncated_share": 0.2}],
            "paired": [{"round": 0, "metric": "select_at_l", "base": 0.5, "trained": 0.625, **interval}],
            "references": [{"method": "cot", "label": "cot", "eval_run_id": "e-baseline-cot", "queries": 4,
                            "mean_at_l": 0.5, "best_at_l": 0.75, "majority_at_l": None, "valid_share": 1.0,
                            "gen_tokens_per_query": 0.0, "exec_tokens_per_query": 1500.0, "status": {"ok": 16},
                            "per_query": []}],
            "paired_references": [{"reference": "cot", "round": -1, "metric": "mean_at_l", "base": 0.5,
                                   "trained": 0.25, **interval, "mean": -0.25}],
            "selection": {"split": "dev", "last_round": 0, "budget_exec_tokens_per_query": 800.0, "slack": 0.25,
                          "same_budget": None, "any_budget": "cot",
                          "candidates": [{"label": "cot", "run_id": "e-baseline-dev-cot", "queries": 2,
                                          "mean_at_l": 0.75, "best_at_l": 1.0, "pending": 0,
                                          "exec_tokens_per_query": 1500.0, "within_budget": False}],
                          "unfinished": [], "missing": ["io"]},
            "per_query": [], "flagged_rewarded": {"e-s0": 1}, "command": "pipeline experiment e.yaml",
            "seed_wall_s": {"0": 12.5}, "wall_s": 30.1}


def test_the_experiment_prints_its_evaluations_and_headline_as_written_here():
    s = ExperimentSummary.from_dict(_experiment())
    assert s.to_dict() == _experiment() and s.wall_s == 30.1 and s.extra["command"] == "pipeline experiment e.yaml"
    # each evaluation as every command prints one (EvalSummary's phrase), Sel@L where the run selects
    assert [a.line() for a in s.arms] == [
        "seed 0 base model: held-out Mean@L 0.250, Best@L 0.500, Sel@L 0.500, Majority@L 0.250, valid 0.88, "
        "tokens/query generator 1200 executor 800, status {'ok': 15, 'timeout': 1}",
        "seed 0 round 0: held-out Mean@L 0.375, Best@L 0.500, Sel@L 0.500, Majority@L 0.250, valid 0.88, "
        "tokens/query generator 1200 executor 800, status {'ok': 15, 'timeout': 1}"]
    assert s.headline() == [
        "round 0 vs base, held-out Sel@L (L=4, 4 seed x query pairs): base 0.500 -> trained 0.625, paired difference "
        "+0.125 [-0.312, +0.500] 95% bootstrap CI resampling seeds, then queries (pairs: [-0.250, +0.500]; queries: "
        "[-0.250, +0.438])",
        "  seed 0: +0.125 [-0.250, +0.500] over 4 queries",
        "executor calls cut at the token cap, held out (mean over seeds): base 0.100, round 0 0.200",
        "reference cot (e-baseline-cot): held-out Mean@L 0.500, Best@L 0.750, Majority@L n/a, tokens/query "
        "generator 0 executor 1500, executor calls cut at the token cap n/a",
        "base model vs cot, held-out Mean@L: 0.250 vs 0.500, paired difference -0.250 [-0.312, +0.500] (seeds, then "
        "queries; 4 pairs)",
        "best fixed workflow on dev at the trained generator's executor budget (<= 1000 tokens/query): none",
        "best fixed workflow on dev at any budget: cot (dev Mean@L 0.750)",
        "not chosen from (not run or not finished on dev): io",
        "flagged rewarded training runs (scores.flags): {'e-s0': 1}"]


def test_the_page_prints_the_parts_the_labels_and_the_stages_wall_from_the_summary():
    s = ExperimentSummary.from_dict(_experiment() | {
        "parts": [{"split": "dev", "round": 0, "part": "calendar", "seeds": [0, 1], "workflows": 40, "mean_score": 0.3,
                   "exec_tokens": 120.4, "gen_tokens": 700.6,
                   "labels": {"direct": {"share": 0.25, "mean_score": 0.2, "odds": 0.3},
                              "own": {"share": 0.75, "mean_score": 0.333, "odds": 0.7}}}],
        "labels": [{"part": "calendar", "label": "own", "odds": 0.7, "score": 0.333, "pick": "direct",
                    "pick_score": 0.27, "met": True}],
        "stage_walls": [{"part": "train", "run_id": "e-s0", "round": 0, "stage": "rollout", "wall_s": 49.2,
                         "machine": "AMD EPYC (AVX2, 2 cores)"},
                        {"part": "train", "run_id": "e-s0", "round": 0, "stage": "train", "wall_s": 3800.0,
                         "machine": "AMD EPYC (AVX2, 2 cores)"},
                        {"part": "evaluate", "run_id": "e-s0-eval-r0", "round": 0, "stage": "score", "wall_s": 612.0,
                         "machine": None}]})
    page = s.markdown()
    assert ("| dev | round 0 | calendar | 2 | 40 | 0.300 | 120 | 701 | direct 0.300 / 0.250 / 0.200; own 0.700 / "
            "0.750 / 0.333 |") in page
    assert "| calendar | own (0.700) | 0.333 | direct | 0.270 | yes |" in page
    assert "| run | round | rollout (s) | train (s) | score (s) | machine |" in page
    assert "| e-s0 | 0 | 49 | 3800 |  | AMD EPYC (AVX2, 2 cores) |" in page
    assert "| e-s0-eval-r0 | 0 |  |  | 612 | unrecorded |" in page
    assert "calendar: likeliest label own (odds 0.700) scores 0.333; per-part router's pick direct 0.270: at least " \
           "the pick" in s.headline()


def test_an_experiment_written_before_the_headline_interval_and_the_references_reads_with_n_a():
    old = _experiment()
    for key in ("shared_base", "references", "paired_references", "selection", "flagged_rewarded"):
        del old[key]
    for p in old["paired"]:
        del p["lo_seeds_queries"], p["hi_seeds_queries"]
    for a in old["arms"]:
        del a["truncated_share"], a["select_at_l"], a["majority_at_l"]
    s = ExperimentSummary.from_dict(old)
    assert s.to_dict() == old and list(s.to_dict()) == list(old)
    assert s.paired[0].ci_seeds_queries == "n/a" and s.references == [] and s.selection is None
    assert s.arms[0].line().startswith("seed 0 base model: held-out Mean@L 0.250, Best@L 0.500, Majority@L n/a, ")
    assert s.headline() == [
        "round 0 vs base, held-out Sel@L (L=4, 4 seed x query pairs): base 0.500 -> trained 0.625, paired difference "
        "+0.125 n/a 95% bootstrap CI resampling seeds, then queries (pairs: [-0.250, +0.500]; queries: "
        "[-0.250, +0.438])",
        "  seed 0: +0.125 [-0.250, +0.500] over 4 queries"]


def test_records_built_here_write_todays_keys_in_todays_order():
    interval = {"n": 2, "mean": 0.5, "lo": 0.0, "hi": 1.0, "level": 0.95, "lo_seeds_queries": 0.0,
                "hi_seeds_queries": 1.0, "lo_by_query": 0.0, "hi_by_query": 1.0,
                "per_seed": [SeedDiff(seed=0, n=2, mean=0.5, lo=0.0, hi=1.0)]}
    tail = ["n", "mean", "lo", "hi", "level", "lo_seeds_queries", "hi_seeds_queries", "lo_by_query", "hi_by_query",
            "per_seed"]
    vs_base = RoundDiff(round=0, metric="mean_at_l", base=0.25, trained=0.75, **interval)
    assert list(vs_base.to_dict()) == ["round", "metric", "base", "trained", *tail]
    vs_ref = RoundDiff(reference="io", round=-1, metric="mean_at_l", base=0.25, trained=0.75, **interval)
    assert list(vs_ref.to_dict()) == ["reference", "round", "metric", "base", "trained", *tail]
    assert vs_ref.to_dict()["per_seed"] == [{"seed": 0, "n": 2, "mean": 0.5, "lo": 0.0, "hi": 1.0}]
    assert list(ArmDiff(arm="grpo", against="base", metric="mean_at_l", **interval).to_dict()) == [
        "arm", "against", "metric", *tail]
    assert list(ArmDiff(arm="w4s", against="spogw", metric="mean_at_l", against_metric="mean_at_l",
                        **interval).to_dict())[:4] == ["arm", "against", "metric", "against_metric"]
    # the methods comparison writes Sel@L and the validation wall time only where an arm has them
    plain = MethodArm(arm="spogw", method="spogw", evaluation="sample", seeds=[0], n=2, mean_at_l=1.0, best_at_l=1.0,
                      majority_at_l=None, select_at_l=None, valid_share=1.0, train_wall_s=3.0, select_wall_s=None)
    assert list(plain.to_dict()) == ["arm", "method", "evaluation", "seeds", "n", "mean_at_l", "best_at_l",
                                     "majority_at_l", "valid_share", "gen_tokens_per_query", "exec_tokens_per_query",
                                     "train_wall_s"]
    refined = MethodSeedRow(arm="w4s/refined", method="w4s", evaluation="refined", seed=0, train_run_id="m-w4s-s0",
                            eval_run_id="m-w4s-s0-baseline-refined", validation_run_id="v", validation_split="dev",
                            selected={"turn": 1}, queries=2, mean_at_l=0.5, select_wall_s=4.0)
    assert list(refined.to_dict()) == ["arm", "method", "evaluation", "seed", "train_run_id", "eval_run_id",
                                       "validation_run_id", "validation_split", "selected", "queries", "mean_at_l",
                                       "best_at_l", "majority_at_l", "valid_share", "gen_tokens_per_query",
                                       "exec_tokens_per_query", "train_wall_s", "select_wall_s"]
    # the run's wall seconds and results folder, set when the study returns, are not part of what it stores first
    s = ExperimentSummary(experiment="e", seeds=[0], rounds=1, split="test", eval_queries=2, eval_l=2)
    assert "wall_s" not in s.to_dict() and "results" not in s.to_dict()
    s.results, s.wall_s = "runs/experiments/e", 1.5
    assert list(s.to_dict())[-2:] == ["results", "wall_s"]


def test_an_experiment_arm_keeps_its_evaluations_keys_in_order_without_the_per_query_rows():
    summ = {"eval_run_id": "e-s0-eval-r0", "queries": 1, "mean_at_l": 0.5, "select_at_l": 1.0, "best_at_l": 1.0,
            "per_query": [{"query_id": "q0"}], "status": {}}
    arm = ExperimentArm.of(0, 0, EvalSummary.from_dict(summ))
    assert list(arm.to_dict()) == ["seed", "round", "eval_run_id", "queries", "mean_at_l", "select_at_l", "best_at_l",
                                   "status"]
    assert arm.select_at_l == 1.0 and arm.per_query == []


# ---- the ablation and the methods comparison ------------------------------------------------------------------------


def _diff(mean: float, lo: float, hi: float, **who) -> dict:
    return {**who, "n": 8, "mean": mean, "lo": lo, "hi": hi, "level": 0.95, "lo_seeds_queries": lo - 0.1,
            "hi_seeds_queries": hi + 0.1, "lo_by_query": lo, "hi_by_query": hi, "per_seed": []}


ABLATION_TABLE = [
    "| arm | Mean@L | Best@L | Mean@L vs base | Mean@L vs iogrpo_mkl | Best@L vs base | Best@L vs iogrpo_mkl | valid |",
    "|---|---|---|---|---|---|---|---|",
    "| base | 0.250 | 0.500 |  |  |  |  | 0.75 |",
    "| sft_best (best rows) | 0.500 | n/a | +0.250 [+0.000, +0.500] | -0.125 [-0.250, +0.000] |  |  | 1.00 |"]


def _ablation() -> AblationSummary:
    return AblationSummary.from_dict({
        "experiment": "ab", "round": 0, "objectives": ["iogrpo_mkl", "sft_best"], "seeds": [0], "split": "test",
        "eval_queries": 8, "eval_l": 2,
        "arms": [{"arm": "base", "n": 8, "valid_share": 0.75, "mean_at_l": 0.25, "best_at_l": 0.5,
                  "majority_at_l": None},
                 {"arm": "sft_best", "n": 8, "valid_share": 1.0, "mean_at_l": 0.5, "best_at_l": None,
                  "majority_at_l": None}],
        "paired": [_diff(0.25, 0.0, 0.5, arm="sft_best", against="base", metric="mean_at_l"),
                   _diff(-0.125, -0.25, 0.0, arm="sft_best", against="iogrpo_mkl", metric="mean_at_l")]})


def test_the_ablation_table_as_written_here():
    assert _ablation().table().splitlines() == ABLATION_TABLE


def _methods() -> MethodsSummary:
    def arm(name, method, evaluation, mean, **more):
        return {"arm": name, "method": method, "evaluation": evaluation, "seeds": [0, 1], "n": 4, "mean_at_l": mean,
                "best_at_l": mean, "majority_at_l": None, "valid_share": 1.0, "gen_tokens_per_query": 900.0,
                "exec_tokens_per_query": 1500.5, "train_wall_s": 61.0, **more}

    return MethodsSummary.from_dict({
        "experiment": "m", "methods": ["spogw", "two_level"], "seeds": [0, 1], "rounds": 1, "split": "test",
        "eval_queries": 2, "eval_l": 4,
        "arms": [arm("base", "base", "sample", 0.25, train_wall_s=None),
                 arm("spogw", "spogw", "sample", 0.5, eval_wall_s=30.4, designs={"pot": 8}),
                 arm("two_level", "two_level", "sample", 0.375, select_at_l=0.75,
                     designs={"direct": 2, "other": 1, "pot": 5})],
        "paired": [_diff(0.25, 0.125, 0.375, arm="spogw", against="base", metric="mean_at_l",
                         against_metric="mean_at_l"),
                   _diff(0.5, 0.25, 0.75, arm="two_level", against="base", metric="select_at_l",
                         against_metric="mean_at_l")],
        "per_seed": [{"arm": "spogw", "method": "spogw", "evaluation": "sample", "seed": 0, "train_run_id": "m-s0",
                      "eval_run_id": "m-s0-eval-r0", "queries": 2, "mean_at_l": 0.5, "best_at_l": 0.5,
                      "majority_at_l": None, "valid_share": 1.0, "gen_tokens_per_query": 900.0,
                      "exec_tokens_per_query": 1500.5, "train_wall_s": 61.0, "eval_wall_s": 30.4}],
        "per_query": [],
        "lr_sweep": {"spogw": {"split": "dev", "seed": 0, "chosen": 0.0002, "runs": [
            {"lr": 0.0001, "run_id": "m-spogw-lr0.0001-s0", "eval_run_id": "e1", "queries": 2, "mean_at_l": 0.5,
             "best_at_l": 0.5, "train_wall_s": 9.0},
            {"lr": 0.0002, "run_id": "m-spogw-lr0.0002-s0", "eval_run_id": "e2", "queries": 2, "mean_at_l": 1.0,
             "best_at_l": None, "train_wall_s": 9.0}]}},
        "lr": {"spogw": 0.0002}})


METHODS_TABLE = [
    "Held-out test, 2 queries, L = 4, seeds [0, 1], 1 round(s); differences: mean [95% interval resampling seeds, "
    "then queries].",
    "",
    "| arm | evaluation | seeds | Mean@L | Best@L | Majority@L | Sel@L | Mean@L vs base | Mean@L vs spogw | "
    "Mean@L vs task_best | generator tokens/query | executor tokens/query | training s/seed | evaluation s/seed | "
    "valid |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    "| base | sample | 2 | 0.250 | 0.250 | n/a | n/a |  |  |  | 900 | 1500 | n/a | n/a | 1.00 |",
    "| spogw | sample | 2 | 0.500 | 0.500 | n/a | n/a | +0.250 [+0.025, +0.475] |  |  | 900 | 1500 | 61 | 30 | 1.00 |",
    "| two_level | sample | 2 | 0.375 | 0.375 | n/a | 0.750 |  |  |  | 900 | 1500 | 61 | n/a | 1.00 |",
    "",
    "Held-out workflows per design (the nearest design of the menu by code similarity; other: none near enough): "
    "count (share).",
    "",
    "| arm | direct | pot | other |",
    "|---|---|---|---|",
    "| spogw | 0 (0%) | 8 (100%) | 0 (0%) |",
    "| two_level | 2 (25%) | 5 (62%) | 1 (12%) |",  # 5/8 = 62.5% and 1/8 = 12.5% round half to even
    "",
    "| arm | against | metric | difference | interval: seeds, queries | interval: pairs | pairs |",
    "|---|---|---|---|---|---|---|",
    "| spogw | base | Mean@L | +0.250 | [+0.025, +0.475] | [+0.125, +0.375] | 8 |",
    "| two_level | base | Sel@L vs Mean@L | +0.500 | [+0.150, +0.850] | [+0.250, +0.750] | 8 |",
    "",
    "| arm | seed | Mean@L | Best@L | Majority@L | Sel@L | generator tokens/query | executor tokens/query | "
    "training s | evaluation s | evaluation run |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
    "| spogw | 0 | 0.500 | 0.500 | n/a | n/a | 900 | 1500 | 61 | 30 | m-s0-eval-r0 |",
    "",
    "| method | lr | dev Mean@L | dev Best@L | run | chosen |",
    "|---|---|---|---|---|---|",
    "| spogw | 0.0001 | 0.500 | 0.500 | m-spogw-lr0.0001-s0 |  |",
    "| spogw | 0.0002 | 1.000 | n/a | m-spogw-lr0.0002-s0 | yes |"]


def test_the_methods_tables_as_written_here():
    s = _methods()
    assert s.lr_sweep["spogw"].runs[1].mean_at_l == 1.0 and s.per_seed[0].eval_run_id == "m-s0-eval-r0"
    assert s.table().splitlines() == METHODS_TABLE


def test_the_study_commands_print_their_summary(monkeypatch):
    """`pipeline experiment`, `ablate` and `compare-methods` print what the study returns: each evaluation and the
    headline, or the table; then the wall time and where the results are."""
    from typer.testing import CliRunner

    from pipeline import api
    from pipeline.cli import app

    done = {"experiment": ExperimentSummary.from_dict(_experiment()), "ablation": _ablation(), "methods": _methods()}
    for name, s in done.items():
        s.results, s.wall_s = f"runs/experiments/{name}", 61.4
    monkeypatch.setattr(api, "run_study", lambda study, config, retries, **options: done[study])
    out = {cmd: CliRunner().invoke(app, [cmd, "configs/smoke.yaml"]) for cmd in ("experiment", "ablate",
                                                                                 "compare-methods")}
    assert all(r.exit_code == 0 for r in out.values()), {c: r.output for c, r in out.items()}
    lines = out["experiment"].output.splitlines()
    assert lines[0].startswith("seed 0 base model: held-out Mean@L 0.250, Best@L 0.500, Sel@L 0.500, ")
    assert lines[2].startswith("round 0 vs base, held-out Sel@L (L=4, 4 seed x query pairs)")
    assert lines[-2:] == ["flagged rewarded training runs (scores.flags): {'e-s0': 1}",
                          "wall time 61 s; results: runs/experiments/experiment"]
    assert out["ablate"].output.splitlines() == [*ABLATION_TABLE, "wall time 61 s; results: runs/experiments/ablation"]
    assert out["compare-methods"].output.splitlines() == [*METHODS_TABLE,
                                                          "wall time 61 s; results: runs/experiments/methods"]


def test_numbers_read_as_text_in_one_way():
    assert (num(None), num(0.12345), num(1499.5, 0), num(0.875, 2)) == ("n/a", "0.123", "1500", "0.88")
    assert (signed(None), signed(0.125), signed(-0.0)) == ("n/a", "+0.125", "-0.000")
    assert (span(-0.25, 0.5), span(None, 0.5), span(0.1, None)) == ("[-0.250, +0.500]", "n/a", "n/a")
