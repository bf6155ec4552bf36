"""The two-level proposal's inference-time selection (best agent, then its best workflow), by hand."""

from __future__ import annotations

import pytest

from pipeline.core.selection import Selection, select_all, select_at_l, select_query


def test_best_agent_then_its_best_workflow():
    # r_a0 = (1 + 0)/2 = .5, r_a1 = (.6 + .6)/2 = .6: a1 wins although a0 holds the single best workflow (1.0);
    # a1's workflows tie at .6: the first sampled. a2 has no workflow (an invalid plan).
    agents = {"a0": [("w00", 1.0), ("w01", 0.0)], "a1": [("w10", 0.6), ("w11", 0.6)], "a2": []}
    assert select_query("q", agents) == Selection("q", "a1", pytest.approx(0.6), "w10", 0.6)
    # agents tie at .5: the first sampled agent
    tie = select_query("q", {"a0": [("w00", 0.0), ("w01", 1.0)], "a1": [("w10", 0.5)]})
    assert (tie.agent_id, tie.workflow_id, tie.score) == ("a0", "w01", 1.0)
    assert select_query("q", {"a0": []}) is None


def test_select_all_rows_invalid_zero_pending_left_out():
    rows = [
        # q1: a0 [1, invalid -> 0] r .5; a1 [.75, pending] -> [.75] r .75: a1, w10
        dict(query_id="q1", parent_id="a0", gen_id="w00", valid=True, score=1.0),
        dict(query_id="q1", parent_id="a0", gen_id="w01", valid=False, score=None),
        dict(query_id="q1", parent_id="a1", gen_id="w10", valid=True, score=0.75),
        dict(query_id="q1", parent_id="a1", gen_id="w11", valid=True, score=None),
        # q2: one agent [0, .25]: w21; q3: nothing scored yet: no selection
        dict(query_id="q2", parent_id="b0", gen_id="w20", valid=True, score=0.0),
        dict(query_id="q2", parent_id="b0", gen_id="w21", valid=True, score=0.25),
        dict(query_id="q3", parent_id="c0", gen_id="w30", valid=True, score=None),
    ]
    got = select_all(rows)
    assert [(s.query_id, s.agent_id, s.workflow_id, s.score) for s in got] == [("q1", "a1", "w10", 0.75),
                                                                               ("q2", "b0", "w21", 0.25)]
    assert got[0].agent_reward == 0.75 and got[1].agent_reward == 0.125
    assert select_at_l(got) == pytest.approx(0.5)  # (.75 + .25)/2
    assert select_at_l([]) is None


def test_eval_summary_of_a_two_level_run_reports_sel_at_l(tmp_path):
    """An evaluation (or any two-level run's round 0) scored by hand: Mean@L, Best@L and Sel@L side by side."""
    import yaml

    from pipeline.run import open_run
    from pipeline.studies.evaluate import eval_summary

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run_id": "ev", "store": {"root": str(tmp_path)},
                                   "rollout": {"mode": "two_level", "n_agents": 2, "n_workflows": 2}}))
    ctx = open_run(cfg, "ev", 0)
    gens, scores = [], []
    for a, wf in {"a0": {"w00": 1.0, "w01": 0.0}, "a1": {"w10": 0.5, "w11": 0.75}}.items():
        gens.append(dict(gen_id=a, kind="agent", query_id="q", slot=0, valid=True))
        for g, x in wf.items():
            gens.append(dict(gen_id=g, kind="workflow", query_id="q", parent_id=a, slot=0, valid=True))
            scores.append(dict(gen_id=g, rep=0, attempt=0, status="ok", score=x))
    ctx.store.write("generations", gens, "ev", 0)
    ctx.store.write("scores", scores, "ev", 0)
    ctx.store.refresh_catalog()
    out = eval_summary(ctx.store, "ev")
    # scores [1, 0 | .5, .75]: Mean@L .5625, Best@L 1; r_a0 = .5 < r_a1 = .625 -> a1's best, w11 = .75
    assert (out.mean_at_l, out.best_at_l, out.select_at_l) == (0.5625, 1.0, 0.75)
    (q,) = out.per_query
    assert (q["selected_agent"], q["selected_workflow"], q["select_at_l"]) == ("a1", "w11", 0.75)


def test_experiments_compare_sel_at_l_for_two_level_runs():
    from pipeline.config import RunConfig
    from pipeline.studies.experiment import compared_metrics

    assert compared_metrics(RunConfig()) == ("mean_at_l", "best_at_l", "majority_at_l")
    two = RunConfig.model_validate({"rollout": {"mode": "two_level"}})
    assert compared_metrics(two) == ("mean_at_l", "best_at_l", "majority_at_l", "select_at_l")
