"""The verdict of an experiment's success criterion (pipeline.studies.verdict), read from the summary's paired
differences, and the committed mixed-choice summary that holds it (docs/results/mixed-choice.md)."""

import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, CriterionConfig, config_from_dict
from pipeline.studies.choices import likeliest_labels
from pipeline.studies.summaries import ExperimentSummary, LabelCheck, ReferenceArm, RoundDiff, Selection
from pipeline.studies.verdict import verdict

ROOT = Path(__file__).resolve().parents[1]


def diff(reference, mean, lo, hi, round=1, metric="mean_at_l"):
    return RoundDiff(reference=reference, round=round, metric=metric, base=None, trained=None, n=270, mean=mean,
                     lo=lo, hi=hi, level=0.95, lo_seeds_queries=lo, hi_seeds_queries=hi)


def ref(label, mean):
    return ReferenceArm(method=label, label=label, eval_run_id=f"run-{label}", queries=90, mean_at_l=mean)


def selection(same=None, any_budget="pot"):
    return Selection(split="dev", last_round=1, budget_exec_tokens_per_query=40.0, slack=0.25, same_budget=same,
                     any_budget=any_budget, candidates=[], unfinished=[])


CRITERION = CriterionConfig(round=1, require=["a: best_fixed above", "b: router not_below"],
                            stretch=["b: router above", "a: best_fixed share:oracle:0.5"])
REFS = [ref("pot", 0.45), ref("router", 0.50), ref("oracle", 0.65)]


def test_each_rule_reads_the_interval_or_the_mean_it_names():
    diffs = [diff("pot", 0.02, 0.001, 0.04), diff("router", -0.03, -0.07, 0.0), diff("direct", 0.3, 0.2, 0.4)]
    v = verdict(CRITERION, 1, 0.95, diffs, REFS, selection(same="pot"))
    a, b = v.checks
    assert (a.against, a.met, b.against, b.met) == ("pot", True, "router", True)  # lo 0.001 > 0; hi 0.0 >= 0
    assert v.met is True
    upper, share = v.stretch
    assert upper.met is False  # lo -0.07 is not above 0
    # share: 0.5 x (oracle 0.65 - pot 0.45) = 0.100; the mean +0.02 is below it
    assert share.threshold == pytest.approx(0.100) and share.met is False
    assert v.stretch_met is False


def test_a_gain_of_half_the_oracles_meets_the_stretch():
    diffs = [diff("pot", 0.11, 0.05, 0.17), diff("router", 0.06, -0.01, 0.12)]
    v = verdict(CRITERION, 1, 0.95, diffs, REFS, selection(same="pot"))
    assert [c.met for c in v.stretch] == [False, True]  # +0.11 >= 0.5 x 0.20 = +0.10
    assert v.met is True and v.stretch_met is True


def test_best_fixed_falls_back_to_any_budget_and_says_so():
    diffs = [diff("pot", -0.043, -0.092, 0.006), diff("router", -0.102, -0.158, -0.045)]
    v = verdict(CRITERION, 1, 0.95, diffs, REFS, selection(same=None, any_budget="pot"))
    a, b = v.checks
    assert a.against == "pot" and "executor budget (50 executor tokens a query)" in a.note  # 1.25 x 40
    assert (a.met, b.met, v.met) == (False, False, False)  # lo -0.092 <= 0; hi -0.045 < 0
    assert "criterion not met (negative)" in v.lines()[0]


def test_a_reference_not_yet_paired_leaves_the_verdict_unread():
    v = verdict(CRITERION, 1, 0.95, [diff("pot", 0.02, 0.01, 0.04)], REFS, selection(same="pot"))
    assert v.checks[1].met is None and "no paired difference to router" in v.checks[1].note
    assert v.met is None
    # another round's or metric's difference is not the one the criterion reads
    assert verdict(CRITERION, 1, 0.95, [diff("pot", 0.02, 0.01, 0.04, round=0)], REFS,
                   selection(same="pot")).checks[0].met is None
    assert verdict(None, 1, 0.95, [], REFS, None) is None


def test_the_likeliest_label_per_part_against_the_per_part_routers_pick_by_hand():
    odds = {"calendar": {"direct": 0.2, "pot": 0.5, "own": 0.3},
            "gsm": {"direct": 0.4, "steps": 0.4, "own": 0.2},  # a tie: the first name, direct
            "products": {"direct": 0.9, "own": 0.1}}
    scores = {"calendar": {"direct": 0.27, "pot": 0.20, "steps": 0.25, "own": 0.31},
              "gsm": {"direct": 0.30, "steps": 0.30, "pot": 0.10},
              "products": {"direct": 1.0, "own": None}}
    picks = {"calendar": "direct", "gsm": "steps", "products": "direct", "unseen": "pot"}
    rows = {r["part"]: r for r in likeliest_labels(odds, scores, picks)}
    assert (rows["calendar"]["label"], rows["calendar"]["met"]) == ("pot", False)  # 0.20 < direct's 0.27
    assert (rows["gsm"]["label"], rows["gsm"]["met"]) == ("direct", True)  # 0.30 >= steps' 0.30
    assert (rows["products"]["label"], rows["products"]["odds"], rows["products"]["met"]) == ("direct", 0.9, True)
    assert rows["unseen"]["label"] is None and rows["unseen"]["met"] is None  # no evaluation on this part yet


def check_c(mets: list[bool | None], parts: int = 2):
    crit = CriterionConfig(round=1, require=[f"c: part_router labels:{parts}"])
    labels = [LabelCheck(part=f"p{i}", label="direct", odds=0.5, score=0.5, pick="pot", pick_score=0.4, met=m)
              for i, m in enumerate(mets)]
    return verdict(crit, 1, 0.95, [], REFS, None, labels).checks[0]


def test_the_labels_rule_counts_the_parts_where_the_label_holds():
    assert check_c([True, False, True]).met is True  # 2 of 3 parts
    assert check_c([True, False, False]).met is False  # 1 of 3, and no part left open
    assert check_c([True, None, False]).met is None  # the open part decides it
    assert check_c([True, True, None], parts=3).met is None
    c = check_c([True, False, True])
    assert (c.mean, c.n, c.result()) == (2.0, 3, "2 of 3 parts")
    assert check_c([]).met is None and "select_eval" in check_c([]).note


@pytest.mark.parametrize("text", ["c: oracle labels:2", "c: part_router labels:0", "c: part_router labels:x"])
def test_the_labels_rule_names_the_part_router_and_a_count(text):
    with pytest.raises(ConfigError, match="experiment.criterion"):
        config_from_dict({"experiment": {"criterion": {"require": [text]}}})


def test_the_labels_rule_needs_the_evaluation_on_dev_and_a_router():
    with pytest.raises(ConfigError, match="select_eval"):
        config_from_dict({"experiment": {"select_split": "dev", "router": {},
                                         "criterion": {"require": ["c: part_router labels:2"]}}})
    with pytest.raises(ConfigError, match="select_split"):
        config_from_dict({"experiment": {"select_eval": True}})
    config_from_dict({"experiment": {"select_split": "dev", "select_eval": True, "router": {},
                                     "criterion": {"require": ["c: part_router labels:2"]}}})


@pytest.mark.parametrize("text", ["best_fixed above", "a: best_fixed", "a: best_fixed over", "a: x share:oracle",
                                  "a: x share:oracle:1.5", "a: x above extra"])
def test_a_criterion_written_wrong_is_refused_naming_it(text):
    with pytest.raises(ConfigError, match="experiment.criterion"):
        config_from_dict({"experiment": {"criterion": {"require": [text]}}})


def test_the_criterion_is_a_plan_the_hash_leaves_out():
    base = config_from_dict({})
    judged = config_from_dict({"experiment": {"criterion": {"require": ["a: best_fixed above"]}}})
    assert base.config_hash() == judged.config_hash()


def _committed(experiment: str, page: dict[str, float]) -> ExperimentSummary:
    """A committed summary of the mixed-choice store, its references' held-out Mean@L checked against the page's."""
    path = ROOT / f"data/stores/mixed-choice/experiments/{experiment}/experiment.json"
    summary = ExperimentSummary.from_dict(json.loads(path.read_text()))
    means = {r.label: r.mean_at_l for r in summary.references}
    assert {label: means[label] for label in page} == pytest.approx(page, abs=0.002)
    return summary


def test_the_committed_mixed_choice_summary_holds_the_pages_numbers():
    """docs/results/mixed-choice.md reads its references, routers and verdict from this summary (`pipeline
    experiment configs/mixed-choice.yaml --report`): learned router 0.501, per-part router 0.514, oracle 0.650,
    program of thought 0.443; round 1 minus program of thought -0.043 [-0.092, +0.006], minus the learned router
    -0.102 [-0.158, -0.045]."""
    summary = _committed("mixed-choice", {"learned_router": 0.501, "part_router": 0.514, "oracle": 0.650,
                                          "program-mixed_pot": 0.443})
    learned = next(r for r in summary.references if r.label == "learned_router")
    choices = learned.extra["router"]["choices"]
    assert len(choices) == 90 and {r["query_id"]: r["design"] for r in learned.per_query} == choices
    a, b = summary.verdict.checks
    for check, page in ((a, (-0.043, -0.092, 0.006)), (b, (-0.102, -0.158, -0.045))):
        assert (check.mean, check.lo, check.hi) == pytest.approx(page, abs=0.002)
    assert (a.against, b.against, a.met, b.met, summary.verdict.met) == (
        "program-mixed_pot", "learned_router", False, False, False)
    assert set(summary.query_parts.values()) == {"calendar_arithmetic", "gsm_symbolic", "products"}
    # the page's tables and --status's lines are printed from it
    page = summary.markdown()
    assert "| (b) | learned_router | -0.102 [-0.158, -0.045] | upper end at or above 0 | **no** |" in page
    assert ("| learned_router | 0.238 (34) | 0.240 (25) | 1.000 (31) | 0.501 (90) | 354 | -0.102 [-0.158, -0.045] "
            "(270 pairs) | program-mixed_direct 23, program-mixed_pot 40, program-mixed_steps 27 |") in page
    assert "| 3 seeds (seeds, then queries) | 0.194 | 0.399 | **+0.205 [+0.143, +0.271]** | 169 -> 41 |" in page
    lines = summary.results_lines()
    assert any(line.startswith("reference oracle") and "picks program-mixed_direct 38" in line for line in lines)
    assert any(line.startswith("verdict (round 1") and "criterion not met (negative)" in line for line in lines)


def test_the_committed_mixed_route_b_summary_holds_the_pages_numbers():
    """docs/results/mixed-route.md reads arm B's references, the learned router's dev choice and B's criterion from
    this summary: learned router 0.503 (TF-IDF char_wb C=10, 0.538 on dev; the hidden-state probe's best 0.534),
    per-part router 0.550, oracle 0.612, program of thought 0.387; (a) +0.005 [-0.185, +0.163] not met, (b) -0.110
    [-0.295, +0.042] met."""
    summary = _committed("mixed-route-b", {"learned_router": 0.503, "part_router": 0.550, "oracle": 0.612,
                                           "program-mixed_pot": 0.387})
    a, b = summary.verdict.checks[:2]
    for check, page in ((a, (0.005, -0.185, 0.163)), (b, (-0.110, -0.295, 0.042))):
        assert (check.mean, check.lo, check.hi) == pytest.approx(page, abs=0.002)
    assert (a.met, b.met) == (False, True)
    fit = [line for line in summary.results_lines() if line.startswith("learned_router: chosen on")]
    assert len(fit) == 1 and "144 dev queries: char_wb C=10 (0.538)" in fit[0]
    assert "word C=0.1 0.428" in fit[0] and "hidden:24 C=1 0.534" in fit[0]


def test_the_committed_second_verdict_is_the_pages():
    """docs/results/mixed-route.md's verdict: arm C chosen on seed 0's dev Mean@2 (C 0.526, B 0.432, A 0.183), its
    three seeds 0.470 on test; (a) minus program of thought +0.083 [-0.049, +0.186] not met, (b) minus the learned
    router -0.033 [-0.157, +0.058] met, (c) 3 of 3 parts; negative. The arms' choice carries C's verdict as is."""
    from pipeline.studies.arms import ArmChoice

    summary = _committed("mixed-route-c", {"learned_router": 0.503, "part_router": 0.550, "program-mixed_pot": 0.387})
    assert summary.seeds == [0, 1, 2]
    a, b, c = summary.verdict.checks
    for check, page in ((a, (0.083, -0.049, 0.186)), (b, (-0.033, -0.157, 0.058))):
        assert (check.mean, check.lo, check.hi) == pytest.approx(page, abs=0.002)
    assert (a.met, b.met, c.met, summary.verdict.met, summary.verdict.stretch_met) == (False, True, True, False, False)
    assert "| 3 seeds (seeds, then queries) | 0.119 | 0.470 | **+0.351 [+0.222, +0.464]** | 217 -> 396 |" in (
        summary.markdown())
    choice = ArmChoice.read(ROOT / "data/stores/mixed-choice/experiments/arms/mixed-route-a+mixed-route-b+mixed-route-c"
                                   ".json")
    dev = {r.arm: r.dev_mean_at_l for r in choice.arms}
    assert dev == pytest.approx({"mixed-route-a": 0.183, "mixed-route-b": 0.432, "mixed-route-c": 0.526}, abs=0.0005)
    assert choice.chosen == "mixed-route-c" and choice.verdict.to_dict() == summary.verdict.to_dict()


def _arm_summary(name, dev, held_out, met, rounds=2):
    """An experiment summary with seed -> dev Mean@L of its last round (experiment.select_eval), its last round's
    held-out Mean@L over seeds 0-2, and its verdict."""
    from pipeline.studies.summaries import CurvePoint, ExperimentArm, Verdict

    last = rounds - 1
    return ExperimentSummary(
        experiment=name, seeds=[0, 1, 2], rounds=rounds, split="test", eval_queries=90, eval_l=2,
        select_arms=[ExperimentArm(seed=s, round=last, eval_run_id=f"{name}-s{s}-eval-dev-r{last}", queries=144,
                                   mean_at_l=v) for s, v in dev.items()],
        curve=[CurvePoint(round=-1, metric="mean_at_l", n=270, mean=0.1, lo=0.0, hi=0.2, level=0.95),
               CurvePoint(round=last, metric="mean_at_l", n=270, mean=held_out, lo=0.0, hi=1.0, level=0.95)],
        verdict=Verdict(round=last, metric="mean_at_l", level=0.95, met=met))


def test_the_arm_is_chosen_by_one_seeds_dev_score_and_its_verdict_is_its_summarys(tmp_path):
    from pipeline import api
    from pipeline.store import Store
    from pipeline.studies.arms import choose_arm
    from pipeline.studies.experiment import experiment_dir

    a = _arm_summary("a", {0: 0.40, 1: 0.60}, 0.41, False, rounds=1)
    b = _arm_summary("b", {0: 0.45, 1: 0.30, 2: 0.30}, 0.44, True)
    c = _arm_summary("c", {0: 0.45}, 0.50, False)
    choice = choose_arm([a, b, c])
    # seed 0's dev: a 0.40, b 0.45, c 0.45: b and c tie, b is named first; a's better seed 1 is not the rule
    assert choice.chosen == "b" and choice.verdict.met is True and choice.waiting_for == []
    rows = {r.arm: r for r in choice.arms}
    assert (rows["a"].last_round, rows["a"].dev_mean_at_l, rows["a"].held_out_mean_at_l) == (0, 0.40, 0.41)
    assert rows["b"].dev_mean_all_seeds == pytest.approx((0.45 + 0.30 + 0.30) / 3) and rows["b"].dev_seeds == [0, 1, 2]
    assert choose_arm([c, b]).chosen == "c"  # the tie goes to the arm named first
    assert "| **b** | 0.450 | 0.350 (0, 1, 2) | 0.440 (0, 1, 2) | met |" in choice.markdown()
    # an arm without seed 0's dev evaluation: no arm is chosen, no verdict read
    late = choose_arm([a, _arm_summary("d", {1: 0.9}, 0.6, True)])
    assert late.chosen is None and late.verdict is None and late.waiting_for == ["d"]
    assert late.lines()[-1] == "no arm chosen: waiting for seed 0's dev evaluation of d"
    with pytest.raises(ValueError, match="name each experiment once"):
        choose_arm([a, a])

    # through the API: read from the store's summaries, written beside them
    store = Store(tmp_path)
    for s in (a, b):
        experiment_dir(store, s.experiment).mkdir(parents=True)
        (experiment_dir(store, s.experiment) / "experiment.json").write_text(json.dumps(s.to_dict()))
    stored = api.choose_arm(["a", "b"], tmp_path)
    assert stored.chosen == "b" and stored.written == str(tmp_path / "experiments" / "arms" / "a+b.json")
    assert json.loads(Path(stored.written).read_text())["chosen"] == "b"
    with pytest.raises(ValueError, match="no summary of experiment 'c'"):
        api.choose_arm(["a", "c"], tmp_path)
