"""Exemplar pools (SQL over earlier rounds) and bucket sampling, against hand-computed values."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from pipeline.engines.prompting import Shown
from pipeline.stages.exemplars import bucket_weights, load_pools, pick_exemplars, tau_at
from pipeline.store import Store


def test_tau_annealing():
    assert tau_at(1.0, 0.5, 0) == 1.0
    assert tau_at(2.0, 0.5, 2) == pytest.approx(0.5)


def test_bucket_weights_hand_computed():
    # scores 0, .5, 1 -> buckets S, M, F; overall mean .5; logits (-1, 0, 1) at tau .5
    w = bucket_weights([0.0, 0.5, 1.0], ["S", "M", "F"], 0.5)
    z = math.e + 1 + 1 / math.e
    assert w == pytest.approx({"F": math.e / z, "M": 1 / z, "S": (1 / math.e) / z})
    assert w["F"] == pytest.approx(0.66524, abs=1e-5)
    # bucket means: F has two members (1, .8) -> .9; S .2; mean of all .6667; tau 1
    w = bucket_weights([1.0, 0.8, 0.2], ["F", "F", "S"], 1.0)
    assert w["F"] == pytest.approx(1 / (1 + math.exp(-0.7)))
    assert bucket_weights([], [], 1.0) == {}


def test_pick_two_distinct_buckets():
    pool = [Shown("s", 0.0, "s"), Shown("m", 0.5, "m"), Shown("f", 1.0, "f")]
    rng = random.Random(0)
    firsts = Counter()
    for _ in range(4000):
        a, b = pick_exemplars(pool, 0.5, rng)
        assert a.gen_id != b.gen_id
        firsts[a.gen_id] += 1
    # the first bucket is drawn by the softmax weights (0.665, 0.245, 0.090)
    assert firsts["f"] / 4000 == pytest.approx(0.665, abs=0.03)
    assert firsts["s"] / 4000 == pytest.approx(0.090, abs=0.02)
    # a tiny tau always picks the two best buckets: F then M
    assert [s.gen_id for s in pick_exemplars(pool, 1e-3, random.Random(1))] == ["f", "m"]


def test_mostly_failing_pool_still_gives_a_contrastive_pair():
    # scores [0, 0, 0, 1] bucket S, S, S, F: two buckets, so one exemplar from each
    pool = [Shown(f"s{i}", 0.0, "s") for i in range(3)] + [Shown("f", 1.0, "f")]
    for seed in range(20):
        picked = pick_exemplars(pool, 1.0, random.Random(seed))
        assert sorted(p.score for p in picked) == [0.0, 1.0]


def test_pick_edge_cases():
    assert pick_exemplars([], 1.0, random.Random(0)) == []
    same = [Shown("a", 0.5, "a"), Shown("b", 0.5, "b")]  # all equal: one bucket (F) -> one exemplar
    assert len(pick_exemplars(same, 1.0, random.Random(0))) == 1
    # members of a bucket are drawn uniformly
    pool = [Shown("s", 0.0, "s")] + [Shown(f"f{i}", 1.0, "f") for i in range(3)]
    got = Counter(p.gen_id for _ in range(900) for p in pick_exemplars(pool, 1.0, random.Random(_)) if p.score == 1)
    assert set(got) == {"f0", "f1", "f2"} and min(got.values()) > 240


def _gen(gid, kind, qid, text, parent=None):
    return dict(gen_id=gid, kind=kind, query_id=qid, text=text, parent_id=parent, slot=0, valid=True)


def test_pools_from_earlier_rounds(tmp_path):
    st = Store(tmp_path)
    plan = "solver then verifier"
    st.write("generations", [
        _gen("a0", "agent", "q1", plan), _gen("a1", "agent", "q1", "just a solver"),
        _gen("w00", "workflow", "q1", "```python\nasync def solve(p):\n    return '0'\n```", "a0"),
        _gen("w01", "workflow", "q1", "async def solve(p): return '1'", "a0"),
        _gen("w10", "workflow", "q1", "x", "a1"),
        _gen("w2", "workflow", "q2", "flat one"),
    ], "run", 0)
    st.write("scores", [
        dict(gen_id="w00", rep=0, attempt=0, status="ok", score=1.0),
        dict(gen_id="w00", rep=1, attempt=0, status="executor_error", score=None),
        dict(gen_id="w00", rep=1, attempt=1, status="ok", score=0.5),  # latest attempt of rep 1 counts
        dict(gen_id="w01", rep=0, attempt=0, status="ok", score=0.25),
        dict(gen_id="w10", rep=0, attempt=0, status="ok", score=0.0),
        dict(gen_id="w2", rep=0, attempt=0, status="ok", score=1.0),
    ], "run", 0)
    st.write("scores", [dict(gen_id="w2", rep=0, attempt=0, status="ok", score=0.0)], "other-run", 0)

    assert load_pools(st, "run", 0).workflows == []  # round 0: empty pools
    pools = load_pools(st, "run", 1)
    assert {s.gen_id: s.score for s in pools.workflows} == {"w2": 1.0}  # flat workflows (no agent)
    # D_W[i]: workflows keyed by the agent that produced them; w00's rep means (1 + .5)/2
    d_w = {a: {s.gen_id: s.score for s in v} for a, v in pools.workflows_by_agent.items()}
    assert d_w == {"a0": {"w00": 0.75, "w01": 0.25}, "a1": {"w10": 0.0}}
    ag = {s.gen_id: s.score for s in pools.agents}
    assert ag == {"a0": pytest.approx(0.5), "a1": 0.0}  # r_i = mean of its workflows' scores (.75 + .25)/2
    assert pools.plans == {"a0": plan, "a1": "just a solver"}
    assert pools.workflows_by_agent["a0"][0].body == "async def solve(p):\n    return '0'"
    # a new plan conditioned on [a1, a0] draws from the better one's buffer (r .5 > 0), in any order shown
    assert pools.buffer_agent(["a1", "a0"]) == "a0" and pools.buffer_agent(["a0", "a1"]) == "a0"
    assert pools.buffer_agent(["a1"]) == "a1"
    assert pools.buffer_agent([]) is None and pools.buffer_agent(["unknown"]) is None
    assert {s.gen_id for s in pools.workflow_pool("q2")} == {"w2"}
    assert {s.gen_id for s in pools.workflow_pool("q9")} == {"w2"}  # no workflows for q9: the run's
    assert {s.gen_id for s in pools.agent_pool("q1")} == {"a0", "a1"}
    assert {s.gen_id for s in pools.agent_pool("q2")} == {"a0", "a1"}  # no agents for q2: the run's

    strict = load_pools(st, "run", 1, r_min_agent=0.4, r_min_workflow=0.5)
    assert {s.gen_id for s in strict.agents} == {"a0"}  # D_A: r_i >= .4
    assert {a: [s.gen_id for s in v] for a, v in strict.workflows_by_agent.items()} == {"a0": ["w00"]}
    assert {s.gen_id for s in strict.workflows} == {"w2"}
    assert strict.buffer_agent(["a1"]) is None  # a1's buffer is empty: no workflow exemplars
    later = load_pools(st, "run", 2)  # rounds < k, not only k-1: round 0's pools are still there
    assert {a: {x.gen_id: x.score for x in v} for a, v in later.workflows_by_agent.items()} == d_w
