"""Config fields that no shipped config sets, each set here and its effect checked (hand-computed where it can be):
the exemplar temperatures, the workflow size cap, the menu's draw seed, the objectives' curation knobs, the step
order, the vLLM engine and server switches, the served model name and the experiment's interval level and budget
slack. The training knobs (lr_schedule, warmup_steps, max_grad_norm) are checked in tests/test_train.py."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from pipeline.config import config_from_dict


def _cfg(**sections):
    return config_from_dict(sections)


def test_exemplar_temperatures_and_their_decay():
    """τ at round k is tau × tau_decay^k; a bucket's weight is softmax((bucket mean - pool mean) / τ). Pool scores
    F = [0], S = [1] (mean 1/2): logits ∓(1/2)/τ. Round 2 with tau_agent 2, tau_workflow 0.5, tau_decay 0.5: τ_A =
    0.5, τ_W = 0.125, so P(S) = 1 / (1 + e^-2) for agents and 1 / (1 + e^-8) for workflows."""
    from pipeline.stages.exemplars import bucket_weights, tau_at

    r = _cfg(rollout={"tau_agent": 2.0, "tau_workflow": 0.5, "tau_decay": 0.5}).rollout
    tau_a, tau_w = tau_at(r.tau_agent, r.tau_decay, 2), tau_at(r.tau_workflow, r.tau_decay, 2)
    assert (tau_a, tau_w) == (0.5, 0.125)
    for tau, logit in ((tau_a, 2.0), (tau_w, 8.0)):
        w = bucket_weights([0.0, 1.0], ["F", "S"], tau)
        assert w["S"] == pytest.approx(1 / (1 + math.exp(-logit))) and w["F"] == pytest.approx(1 - w["S"])


def test_max_workflow_chars_makes_larger_workflows_invalid():
    from pipeline.engines.workflow import check_workflow

    code = "async def solve(q):\n    return q\n"  # 33 characters
    cap = _cfg(rollout={"max_workflow_chars": 32}).rollout.max_workflow_chars
    assert check_workflow(code, cap) == "too large: 33 chars > 32"
    assert check_workflow(code, _cfg(rollout={"max_workflow_chars": 33}).rollout.max_workflow_chars) is None


def test_menu_seed_picks_the_drawn_design():
    """A slot's design is crc32("<menu_seed>:<query>:<slot>") mod the menu's size."""
    from pipeline.stages.sampling import draw_design

    for seed in (0, 7):
        s = _cfg(rollout={"menu_seed": seed}).rollout.menu_seed
        assert [draw_design(s, "q1", k, 5) for k in range(4)] == \
               [zlib.crc32(f"{seed}:q1:{k}".encode()) % 5 for k in range(4)]
    assert [draw_design(0, "q1", k, 5) for k in range(8)] != [draw_design(7, "q1", k, 5) for k in range(8)]


def test_best_above_and_pair_gap_power_shape_the_objectives_rows():
    """best_above: a query's best workflow is kept only above it. pair_gap_power p: scores [1, .5, 0] give the pairs
    (0,1), (0,2), (1,2) with gaps .5, 1, .5, drawn with P ∝ gap^p: p = 0 draws them alike, p = 60 draws (0,2) with
    P = 1 / (1 + 2 · 2^-60), so every one of the 4 draws is it."""
    from pipeline.core.curation import objective_rows

    scores, ids = {"q": [1.0, 0.5, 0.0]}, {"q": ["a", "b", "c"]}
    for above, kept in ((0.99, True), (1.0, False)):
        cc = _cfg(curation={"best_above": above}).curation
        rows, _ = objective_rows(scores, ids, cc, np.random.default_rng(0))
        (best,) = [r for r in rows if r["kind"] == "best"]
        assert best["kept"] is kept
    cc = _cfg(curation={"pair_gap_power": 60.0, "pairs_per_query": 4}).curation
    rows, _ = objective_rows(scores, ids, cc, np.random.default_rng(0))
    pairs = [r for r in rows if r["kind"] == "pair"]
    assert len(pairs) == 4 and all(r["members"] == ["a", "c"] for r in pairs)


def test_step_order_keeps_groups_whole_or_shuffles_rows():
    """Two groups of three rows, three rows a step: `groups` makes each step one whole group; `rows` shuffles rows,
    so some seeds mix the groups within a step."""
    from pipeline.core.packing import RowShape, plan_steps

    shapes = [RowShape(f"g{r}", f"G{r // 3}", (1, 2), 4) for r in range(6)]
    plans = {}
    for order in ("groups", "rows"):
        o = _cfg(training={"step_order": order}).training.step_order
        plans[order] = [plan_steps(shapes, 1, 3, np.random.default_rng(s), o)[0] for s in range(10)]
    assert all(sorted(map(sorted, p)) == [[0, 1, 2], [3, 4, 5]] for p in plans["groups"])
    assert any(sorted(map(sorted, p)) != [[0, 1, 2], [3, 4, 5]] for p in plans["rows"])
    assert all(sorted(sum(p, [])) == list(range(6)) for p in plans["rows"])


def test_vllm_engine_switches_reach_the_engine(monkeypatch):
    """generator.enforce_eager, tensor_parallel_size and block_size go to the offline vLLM engine as they are."""
    from pipeline.engines.generation import make_generator, vllm_offline

    seen = {}
    monkeypatch.setattr(vllm_offline, "VLLMGenerator", lambda model, **kw: seen.update(kw) or "engine")
    g = _cfg(generator={"backend": "vllm", "enforce_eager": False, "tensor_parallel_size": 2, "block_size": 32}
             ).generator
    assert make_generator(g) == "engine"
    assert (seen["enforce_eager"], seen["tensor_parallel_size"], seen["block_size"]) == (False, 2, 32)


def test_serve_enforce_eager_and_served_model_reach_the_server_command():
    from pipeline.engines.servers import spec_for

    serve = {"enforce_eager": False}
    cfg = _cfg(executor={"kind": "openai", "serve": serve},
               generator={"backend": "openai", "served_model": "policy", "serve": serve})
    for section in ("executor", "generator"):
        assert "--enforce-eager" not in spec_for(cfg, section).command("/m", 8000)
    assert "--enforce-eager" in spec_for(_cfg(executor={"kind": "openai", "serve": {}}), "executor").command("/m", 1)
    cmd = spec_for(cfg, "generator").command("/m", 8000)
    assert cmd[cmd.index("--served-model-name") + 1] == "policy"  # the name its requests use


def test_ngram_speculation_reaches_the_executor_server_and_is_refused_on_the_generators():
    """executor.serve.ngram_speculation: k adds vLLM's n-gram proposer with k tokens a step to the executor server's
    command (n-grams of 2-4 tokens); off by default; a served generator refuses it (its samples' log-probs under
    speculation are not checked)."""
    import json

    from pipeline.config import ConfigError
    from pipeline.engines.servers import spec_for

    cmd = spec_for(_cfg(executor={"kind": "openai", "serve": {"ngram_speculation": 3}}), "executor").command("/m", 1)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert "--speculative-config" not in spec_for(_cfg(executor={"kind": "openai", "serve": {}}), "executor").command(
        "/m", 1)
    with pytest.raises(ConfigError, match="generator.serve.ngram_speculation"):
        _cfg(generator={"backend": "openai", "served_model": "p", "serve": {"ngram_speculation": 3}})


def test_budget_slack_sets_which_reference_is_at_the_budget():
    """A reference is at the trained generator's budget B = 100 when its tokens are at most (1 + slack) B: the best
    one on the choosing split spends 120, so it is at the budget with slack 0.25 and not with 0.1 (then the runner-up
    at 90 is)."""
    from pipeline.studies.experiment import best_fixed
    from pipeline.studies.summaries import ReferenceArm

    def ref(label, mean, tokens):
        return ReferenceArm.from_dict({"method": label, "label": label, "eval_run_id": label, "queries": 4,
                                       "mean_at_l": mean,
                                       "best_at_l": mean, "pending": 0, "exec_tokens_per_query": tokens})

    refs = [ref("a", 0.8, 120.0), ref("b", 0.6, 90.0)]
    for slack, same in ((0.25, "a"), (0.1, "b")):
        s = _cfg(experiment={"budget_slack": slack}).experiment.budget_slack
        assert best_fixed(refs, refs, 100.0, s).same_budget == same


def test_ci_level_sets_the_intervals_level():
    """experiment.ci_level is the level of the held-out curve's intervals: a lower level, a narrower interval."""
    from pipeline.studies.experiment import curve

    rng = np.random.default_rng(0)
    per_query = [{"seed": s, "round": 0, "query_id": f"q{q}", "mean_at_l": float(rng.random()),
                  "best_at_l": 1.0} for s in (0, 1) for q in range(6)]
    out = {}
    for level in (0.5, 0.95):
        cfg = _cfg(experiment={"ci_level": level, "bootstrap": 500, "eval_rounds": "last"}, rounds=1)
        (row,) = [r for r in curve(cfg, [0, 1], per_query) if r.metric == "mean_at_l"]
        out[level] = row
        assert row.level == level
    assert out[0.5].hi - out[0.5].lo < out[0.95].hi - out[0.95].lo
