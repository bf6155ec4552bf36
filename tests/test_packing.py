"""Step plans and passes of the train stage (pipeline/core/packing.py): indices in, indices out, checked by hand."""

import numpy as np
import pytest

from pipeline.core.packing import RowShape, logprob_passes, pack, pass_slots, plan_steps, step_units


def _rows(spec):
    """spec: (gen_id, group_id, prompt, completion_len) per row."""
    return [RowShape(g, grp, tuple(p), c) for g, grp, p, c in spec]


# query A (prompt of 4 tokens): groups g1 = {a1, a2}, g2 = {a1, a3} (a1 in both); query B (2 tokens): g3 = {b1, b2}
SHAPES = _rows([("a1", "g1", [1, 2, 3, 4], 5), ("a2", "g1", [1, 2, 3, 4], 2),
                ("a1", "g2", [1, 2, 3, 4], 5), ("a3", "g2", [1, 2, 3, 4], 3),
                ("b1", "g3", [7, 8], 1), ("b2", "g3", [7, 8], 6)])


def test_pass_slots_count_each_prompt_and_sequence_once():
    # rows 0, 1, 2: one prompt (4) + sequences a1, a2 at the longest completion (5): 4 + 2*5 = 14
    assert pass_slots([0, 1, 2], SHAPES) == 14
    # all rows: prompts 2 x 4 + sequences a1, a2, a3, b1, b2 x 6 = 38 (row 2 repeats a1)
    assert pass_slots(range(6), SHAPES) == 38


def test_a_sequence_in_two_groups_is_one_unit_and_computed_once():
    units = step_units([0, 1, 2, 3], SHAPES)
    assert units == [[0, 2], [1], [3]]  # a1's rows together
    (chunk,) = pack(units, SHAPES, budget=100)
    assert chunk.rows == [0, 2, 3, 1]  # by completion length: a1 (5), a3 (3), a2 (2)
    assert chunk.uniq == [0, 3, 1] and chunk.take == [0, 0, 1, 2]
    assert step_units([0, 1, 2, 3], SHAPES, paired=True) == [[0, 1], [2, 3]]  # pairs stay whole


def test_pack_respects_the_budget_and_groups_prompts():
    units = step_units(range(6), SHAPES)  # [[0, 2], [1], [3], [4], [5]]
    # budget 14: A's prompt with a1 (4 + 5 = 9), + a3 (4 + 2*5 = 14), + a2 would be 4 + 3*5 = 19: new pass;
    # a2 then b2: 2 prompts x 4 + 2 x 6 = 20 > 14, so B gets its own pass (b2 then b1: 2 + 2*6 = 14)
    chunks = pack(units, SHAPES, budget=14)
    assert [c.rows for c in chunks] == [[0, 2, 3], [1], [5, 4]]
    assert all(pass_slots(c.rows, SHAPES) <= 14 for c in chunks)
    # a unit larger than the budget still gets a pass
    assert [c.rows for c in pack([[0, 2]], SHAPES, budget=3)] == [[0, 2]]


def test_group_order_keeps_groups_whole_and_a_querys_groups_together():
    rng = np.random.default_rng(0)
    (epoch,) = plan_steps(SHAPES, 1, step_rows=4, rng=rng, order="groups")
    assert sorted(r for step in epoch for r in step) == list(range(6))
    for step in epoch:
        groups = {SHAPES[r].group_id for r in step}
        assert all(sum(SHAPES[r].group_id == g for r in step) == 2 for g in groups)  # whole groups
    # 4 rows a step: g1 and g2 (both of query A) share a step; g3 is alone
    assert sorted(sorted({SHAPES[r].group_id for r in step}) for step in epoch) == [["g1", "g2"], ["g3"]]


def test_row_order_is_a_shuffle_in_steps_of_step_rows():
    epochs = plan_steps(SHAPES, 2, step_rows=4, rng=np.random.default_rng(0), order="rows")
    for epoch in epochs:
        assert [len(s) for s in epoch] == [4, 2] and sorted(r for s in epoch for r in s) == list(range(6))
    (epoch,) = plan_steps(SHAPES, 1, step_rows=4, rng=np.random.default_rng(0), order="rows", unit=2)
    assert all(s[k] % 2 == 0 and s[k + 1] == s[k] + 1 for s in epoch for k in range(0, len(s), 2))  # pairs whole
    with pytest.raises(ValueError, match="order"):
        plan_steps(SHAPES, 1, 4, np.random.default_rng(0), order="queries")


def test_logprob_chunks_lay_out_the_first_step_as_training_does():
    first = pack(step_units([2, 3], SHAPES), SHAPES, budget=100)  # the first step trains a1 (row 2) and a3
    chunks = logprob_passes(first, SHAPES, budget=100)
    assert chunks[0] is first[0]  # as training runs it: π_old equals π_θ at step 1
    # then one row per other sequence (a2 at 1, b1 at 4, b2 at 5; row 0 is a1 again), packed by prompt
    assert sorted(r for c in chunks[1:] for r in c.uniq) == [1, 4, 5]
