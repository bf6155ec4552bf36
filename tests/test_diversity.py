"""FlowReasoner's diversity term of the multi-purpose reward, by hand and through the score stage."""

from __future__ import annotations

import pytest
from test_scoring import SOLVER, make_run

from pipeline.core.reward import combine, diversity_terms, program_key, reward
from pipeline.run import open_run
from pipeline.stages.score import run_score
from pipeline.store import Store

A = "async def solve(p):\n    return str(1 + 2)\n"
A_COMMENTED = "async def solve(p):\n    # the same program\n    return str(1+2)\n"
B = "async def solve(p):\n    return '0'\n"


def test_diversity_is_one_over_the_copies_of_the_same_program():
    d = diversity_terms([A, A_COMMENTED, B, A])
    assert d == pytest.approx([1 / 3, 1 / 3, 1.0, 1 / 3])
    # the group's mean is its distinctness ratio: 2 distinct programs / 4 workflows
    assert sum(d) / len(d) == pytest.approx(0.5)
    assert diversity_terms([A, B]) == [1.0, 1.0] and diversity_terms([]) == []
    assert program_key(A) == program_key(A_COMMENTED) != program_key(B)


def test_combine_penalises_redundancy_only_when_weighted():
    # 1 - 0.5 * 0.1 - 0.5 * 0.2 - 0.3 * (1 - 1/3) = 1 - 0.05 - 0.1 - 0.2
    assert combine(1.0, 0.1, 0.2, 0.5, 0.5, diversity=1 / 3, diversity_weight=0.3) == pytest.approx(0.65)
    assert combine(1.0, 0.1, 0.2, diversity=0.25) == 1.0  # weight 0 (the default): the metric
    assert combine(0.0, 0.0, 0.0, diversity=1.0, diversity_weight=1.0) == 0.0  # unique but wrong earns nothing
    parts = reward(1.0, A, 0, 0, diversity=0.5, diversity_weight=0.4)
    assert (parts.score, parts.diversity) == (pytest.approx(0.8), 0.5)


@pytest.mark.usefixtures("shared_sandbox")
def test_score_stage_stores_diversity_and_another_weighting_recomputes(tmp_path):
    solver_commented = SOLVER.replace("    return str(eval(expr))", "    # evaluate it\n    return str(eval(expr))")
    path, root = make_run(tmp_path, [SOLVER, solver_commented, B], n_queries=1,
                          reward={"diversity_weight": 0.5})
    ctx = open_run(path, "t", 0)
    assert run_score(ctx)["done"] is True
    rows = {r["gen_id"].split("#")[1]: r for r in Store(root).read("scores", "t", 0).to_dicts()}
    # SOLVER twice (a comment apart): diversity 1/2 each, right -> 1 - 0.5 * (1 - 1/2); B alone: 1, wrong -> 0
    assert [rows[k]["diversity"] for k in "012"] == [0.5, 0.5, 1.0]
    assert [rows[k]["metric"] for k in "012"] == [1.0, 1.0, 0.0]
    assert [rows[k]["score"] for k in "012"] == [0.75, 0.75, 0.0]
    # another weighting from the stored components alone: diversity weight 0.2 -> 1 - 0.2 * 0.5 = 0.9
    again = [combine(r["metric"], r["complexity"], r["cost"], diversity=r["diversity"], diversity_weight=0.2)
             for r in (rows["0"], rows["2"])]
    assert again == [pytest.approx(0.9), 0.0]
