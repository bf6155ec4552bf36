"""Learning from logged rows (rollout.logged), the design as a commitment (rollout.route_or_write) and the choice's own
credit (curation.choice_credit): the pure maths against hand-computed values, and the import's refusals."""

import json
import math
from types import SimpleNamespace

import polars as pl
import pytest
import torch

from pipeline.core.grpo import choice_credit, grpo_mkl_terms, off_policy_surrogate
from pipeline.stages.logged import LoggedRowError, behaviour_logprobs, import_logged, read_logged
from pipeline.stages.train.data import row_logprobs, split_level
from pipeline.store import Store


def test_choice_credit_compares_designs_for_the_label_and_rows_of_one_design_for_the_code():
    # scores 1 0 | 1 1 | 0 0 under pot pot | steps steps | direct direct: mean 0.5, population std 0.5
    # label: R_pot 0.5 -> 0, R_steps 1 -> (1 - 0.5)/0.5 = +1, R_direct 0 -> -1
    # code within a design: pot (1 - 0.5)/0.5 = +1 and -1; steps and direct all equal -> 0
    label, code = choice_credit([1, 0, 1, 1, 0, 0], ["pot", "pot", "steps", "steps", "direct", "direct"])
    assert label.tolist() == pytest.approx([0, 0, 1, 1, -1, -1], abs=1e-5)
    assert code.tolist() == pytest.approx([1, -1, 0, 0, 0, 0], abs=1e-5)
    with pytest.raises(ValueError, match="3 scores but 2 designs"):
        choice_credit([1, 0, 1], ["a", "b"])


def _grad(rule: str, p: float, mu: float, adv: float) -> tuple[float, float]:
    logp = torch.tensor([[math.log(p)]], requires_grad=True)
    obj, _ = off_policy_surrogate(rule, logp, torch.tensor([[math.log(mu)]]), torch.tensor([[adv]]), 0.2, 0.1)
    obj.sum().backward()
    return float(obj.detach()), float(logp.grad)


def test_off_policy_rules_match_their_papers_by_hand():
    # π_θ = 0.2, μ = 1/3: ρ = 0.6
    # is_clip, A = +1: min(0.6, clip(0.6, 0.8, 1.2) = 0.8) = 0.6, d/dlogp = ρA = 0.6
    assert _grad("is_clip", 0.2, 1 / 3, 1.0) == pytest.approx((0.6, 0.6))
    # is_clip, A = -1: min(-0.6, -0.8) = -0.8, the clipped branch: no gradient
    assert _grad("is_clip", 0.2, 1 / 3, -1.0) == pytest.approx((-0.8, 0.0))
    # expected: ρA unclipped both ways
    assert _grad("expected", 0.2, 1 / 3, -1.0) == pytest.approx((-0.6, -0.6))
    # LUFFY, γ = 0.1: f = p/(p + γ) = 0.2/0.3; df/dlogp = p·γ/(p + γ)² = 0.02/0.09
    assert _grad("luffy", 0.2, 1 / 3, 1.0) == pytest.approx((2 / 3, 0.02 / 0.09))
    with pytest.raises(ValueError, match="unknown off-policy rule"):
        _grad("nope", 0.2, 0.5, 1.0)


def test_expected_rule_over_a_uniform_sweep_is_the_exact_gradient_of_the_labels_expected_advantage():
    # three designs, π = (0.5, 0.3, 0.2), each logged once with μ = 1/3, A = (1, 0, -1):
    # J = Σ π_d A_d = 0.5 - 0.2 = 0.3; dJ/dz_j = π_j (A_j - J) = (0.35, -0.09, -0.26); the loss is -J
    z = torch.log(torch.tensor([0.5, 0.3, 0.2])).requires_grad_(True)
    logp = torch.log_softmax(z, 0).reshape(3, 1)
    terms = grpo_mkl_terms(logp, logp.detach(), None, torch.tensor([1.0, 0.0, -1.0]), torch.ones(3, 1), 0.0, 0.2,
                           behaviour_logp=torch.full((3, 1), -math.log(3)), off_policy=torch.tensor([True] * 3),
                           off_rule="expected")
    terms.loss.backward()
    assert float(terms.loss) == pytest.approx(-0.3)
    assert z.grad.tolist() == pytest.approx([-0.35, 0.09, 0.26])


def test_only_logged_rows_take_the_rule_the_others_keep_the_ratio_to_pi_old():
    # row 0 on-policy: π_θ = π_old, ρ = 1, A = 1 -> 1; row 1 logged, μ = 0.5, π_θ = 0.25: is_clip ρ = 0.5, A = 1 ->
    # min(0.5, 0.8) = 0.5. Sequence mean: loss = -(1 + 0.5)/2 = -0.75
    logp = torch.log(torch.tensor([[0.4], [0.25]]))
    terms = grpo_mkl_terms(logp, logp, None, torch.tensor([1.0, 1.0]), torch.ones(2, 1), 0.0, 0.2,
                           behaviour_logp=torch.log(torch.tensor([[0.9], [0.5]])),
                           off_policy=torch.tensor([False, True]))
    assert float(terms.loss) == pytest.approx(-0.75)


def test_choice_and_code_levels_split_a_route_or_write_completion():
    # the label token is trained alone under `choice`; under `code` it joins the prompt
    assert split_level("choice", "g", [1, 2], [7, 8, 9], [-0.1, -0.2, -0.3]) == ("g/choice", [1, 2], [7], [-0.1])
    assert split_level("code", "g", [1, 2], [7, 8, 9], [-0.1, -0.2, -0.3]) == ("g/code", [1, 2, 7], [8, 9],
                                                                             [-0.2, -0.3])
    assert split_level("flat", "g", [1], [7], None) == ("g", [1], [7], None)


def test_a_drawn_labels_pi_old_is_the_policys_own_and_a_logged_rows_stays_the_draws():
    """A design-step row stores the draw's log-prob first (here log 0.5) and the policy's own in its `sampling`
    (log 0.1): a sampled row trains with the policy's as π_old; a logged row keeps the draw's, its behaviour μ; a row
    stored without the policy's is a drawn label whose π_old is recomputed."""
    stored = json.dumps({"choice_step": {"temperature": 8.0, "logprob": math.log(0.1)}})
    draw = [math.log(0.5), -0.2, -0.3]
    assert row_logprobs(False, stored, draw) == ([math.log(0.1), -0.2, -0.3], False)
    assert row_logprobs(True, stored, draw) == (draw, False)
    assert row_logprobs(False, json.dumps({"choice_step": {"temperature": 8.0}}), draw) == (draw, True)
    assert row_logprobs(False, json.dumps({"temperature": 1.0}), draw) == (draw, False)


# ---- the import ------------------------------------------------------------------------------------------------------

MENU = {"pot": "async def solve(problem):\n    return '1'", "steps": "async def solve(problem):\n    return '2'"}


def _logged_run(store: Store, run: str, rows: list[tuple[str, str, str, float | None]], tokens=None) -> None:
    """rows: (gen_id, query_id, code, score or None = unscored)."""
    store.write("generations", [dict(gen_id=g, kind="workflow", query_id=q, text=f"```python\n{c}\n```",
                                     prompt_token_ids=[1, 2, 3], token_ids=tokens, token_logprobs=None)
                                for g, q, c, _ in rows], run, 0)
    store.write("scores", [dict(gen_id=g, query_id=q, rep=0, attempt=0, status="ok", score=s)
                           for g, q, _, s in rows if s is not None], run, 0)


def test_design_rows_get_the_uniform_sweeps_behaviour_probability(tmp_path):
    store = Store(str(tmp_path))
    _logged_run(store, "sweep", [("a", "q1", MENU["pot"], 1.0), ("b", "q1", MENU["steps"], 0.0),
                                 ("c", "q2", MENU["pot"], 0.0)])
    rows = read_logged(store, "sweep", 0, MENU, route_or_write=True)
    assert [r.design for r in rows] == ["pot", "steps", "pot"]
    # q1 has 2 designs logged: μ = 1/2 each; q2 one: μ = 1
    assert behaviour_logprobs(rows) == pytest.approx({"sweep/0/a": -math.log(2), "sweep/0/b": -math.log(2),
                                                      "sweep/0/c": 0.0})


def test_an_unscored_logged_row_is_refused_by_name(tmp_path):
    store = Store(str(tmp_path))
    _logged_run(store, "sweep", [("a", "q1", MENU["pot"], 1.0), ("b", "q1", MENU["steps"], None)])
    with pytest.raises(LoggedRowError, match=r"row sweep/0/b has no final score \(unscored\)"):
        read_logged(store, "sweep", 0, MENU, route_or_write=True)
    with pytest.raises(LoggedRowError, match="run 'missing' round 0 has no workflow rows"):
        read_logged(store, "missing", 0, MENU, route_or_write=True)


def _ctx_and_sampler(store: Store, logged: str, route_or_write: bool, prompt_ids=(1, 2, 3)):
    cfg = SimpleNamespace(rollout=SimpleNamespace(logged=[SimpleNamespace(run=logged, round=0)],
                                                  route_or_write=route_or_write),
                          benchmark=SimpleNamespace(train_split="train"))
    ctx = SimpleNamespace(cfg=cfg, store=store, run_id="arm-b", round=0)
    sampler = SimpleNamespace(
        items=[SimpleNamespace(id="q1")], menu_code=MENU, choice_tokens={"pot": 50, "steps": 60},
        workflow_request=lambda item: SimpleNamespace(prompt_text="P"),
        tokenizer=lambda text, add_special_tokens: SimpleNamespace(input_ids=list(prompt_ids)))
    return ctx, sampler


def test_import_writes_label_rows_with_copied_scores_once(tmp_path):
    store = Store(str(tmp_path))
    _logged_run(store, "sweep", [("a", "q1", MENU["pot"], 1.0), ("b", "q1", MENU["steps"], 0.0),
                                 ("c", "q9", MENU["pot"], 1.0)])  # q9: a training query this round does not sample
    ctx, sampler = _ctx_and_sampler(store, "sweep", True)
    assert import_logged(ctx, sampler, {"q1", "q9"}) == 2
    assert import_logged(ctx, sampler, {"q1", "q9"}) == 0  # a resumed rollout imports nothing twice
    gens = store.read("generations", "arm-b", 0).sort("choice")
    assert gens["token_ids"].to_list() == [[50], [60]]  # the label token of each design
    assert [x[0] for x in gens["token_logprobs"].to_list()] == pytest.approx([-math.log(2)] * 2)
    assert gens["source"].to_list() == ["logged", "logged"]
    assert sorted(gens["logged_from"].to_list()) == ["sweep/0/a", "sweep/0/b"]
    scores = store.read("scores", "arm-b", 0).join(gens.select("gen_id", "choice"), on="gen_id")
    assert dict(zip(scores["choice"], scores["score"], strict=True)) == {"pot": 1.0, "steps": 0.0}


def test_import_refuses_held_out_queries_and_rows_it_cannot_weigh(tmp_path):
    store = Store(str(tmp_path))
    _logged_run(store, "sweep", [("a", "q1", MENU["pot"], 1.0), ("t", "test-7", MENU["pot"], 1.0)])
    ctx, sampler = _ctx_and_sampler(store, "sweep", True)
    with pytest.raises(LoggedRowError, match=r"outside the training split 'train', e.g. row sweep/0/t"):
        import_logged(ctx, sampler, {"q1"})
    # a design's run without route_or_write has no tokens of the policy's to train on
    ctx, sampler = _ctx_and_sampler(store, "sweep", False)
    with pytest.raises(LoggedRowError, match="row sweep/0/a has no behaviour log-probs"):
        import_logged(ctx, sampler, {"q1", "test-7"})
    # a sampled row logged under another prompt
    store2 = Store(str(tmp_path / "two"))
    store2.write("generations", [dict(gen_id="s", kind="workflow", query_id="q1", text="x", prompt_token_ids=[1, 2],
                                      token_ids=[5, 6], token_logprobs=[-0.1, -0.2])], "seed1", 0)
    store2.write("scores", [dict(gen_id="s", query_id="q1", rep=0, attempt=0, status="ok", score=1.0)], "seed1", 0)
    ctx, sampler = _ctx_and_sampler(store2, "seed1", False)
    with pytest.raises(LoggedRowError, match="row seed1/0/s was sampled under another prompt"):
        import_logged(ctx, sampler, {"q1"})


def test_pipeline_import_reports_every_bad_line_then_writes_rows_a_round_can_take(tmp_path):
    from pipeline.stages.logged import import_file

    good = ('{"query_id": "q1", "text": "t", "prompt_token_ids": [1, 2, 3], "token_ids": [5], '
            '"token_logprobs": [-0.5], "score": 1}')
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\n{oops\n" + good.replace('"score": 1', '"score": 2') + "\n"
                   + good.replace('"token_logprobs": [-0.5]', '"token_logprobs": []') + "\n")
    store = Store(str(tmp_path / "store"))
    with pytest.raises(ValueError, match=r"3 bad rows(.|\n)*bad.jsonl:2: invalid JSON(.|\n)*bad.jsonl:3: score 2 is "
                                         r"not(.|\n)*bad.jsonl:4: missing token_logprobs"):
        import_file(store, "elsewhere", str(bad))
    assert store.read("generations", "elsewhere", 0).height == 0  # nothing written
    # the same rows from a Parquet table (what a trainer elsewhere may log) are taken as from JSONL
    pl.DataFrame([json.loads(good)]).write_parquet(tmp_path / "ok.parquet")
    assert import_file(store, "from-parquet", str(tmp_path / "ok.parquet")) == 1
    assert store.read("generations", "from-parquet", 0)["token_logprobs"].to_list() == [[-0.5]]
    ok = tmp_path / "ok.jsonl"
    ok.write_text(good + "\n")
    assert import_file(store, "elsewhere", str(ok)) == 1
    with pytest.raises(ValueError, match="already holds rows"):
        import_file(store, "elsewhere", str(ok))
    # the imported row is a sampled row: under a prompt that renders the same, the round takes it with its log-probs
    ctx, sampler = _ctx_and_sampler(store, "elsewhere", False)
    assert import_logged(ctx, sampler, {"q1"}) == 1
    row = store.read("generations", "arm-b", 0).row(0, named=True)
    assert row["token_ids"] == [5] and row["token_logprobs"] == [-0.5] and row["source"] == "logged"


def test_one_update_moves_the_label_by_the_designs_credit_and_the_code_within_own(tmp_path, tiny_model):
    """A route-or-write round, trained end to end (curate -> train, a tiny random model): scores 1 (routed to direct),
    0 (logged steps run, μ = 1/2), 1 and 0 (two workflows of its own). Label credit: direct +1, steps -1, own 0;
    code credit within own: +1, -1. One step up-weights the direct label against the steps label (its logged row
    under `expected`), and the winning own code against the losing one."""
    from test_curate import _ctx

    from pipeline.stages.curate import run_curate
    from pipeline.stages.train import run_train
    from pipeline.stages.train.batch import collate
    from pipeline.stages.train.data import TrainSequence
    from pipeline.stages.train.logprobs import completion_logprobs

    menu = "[configs/programs/mixed_direct.py,configs/programs/mixed_steps.py,configs/programs/mixed_pot.py]"
    ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", f"rollout.example_menu={menu}", "rollout.menu_choice=policy",
                          "rollout.choice_step=true", "rollout.route_or_write=true", "curation.choice_credit=true",
                          "training.old_logprobs=recompute", "training.off_policy=expected", "training.lr=0.05",
                          "training.micro_batch_size=8", "training.beta=0"])
    rows = [("direct", [10], None, "route", "mixed_direct", 1.0), ("steps", [20], [math.log(0.5)], "logged",
                                                                    "mixed_steps", 0.0),
            ("win", [30, 40, 41], None, "write", "own", 1.0), ("lose", [30, 42, 43], None, "write", "own", 0.0)]
    ctx.store.write("generations", [dict(gen_id=g, query_id="q", slot=i, kind="workflow", valid=True,
                                         prompt_token_ids=[1, 2], token_ids=t, token_logprobs=lp, source=src,
                                         choice=c) for i, (g, t, lp, src, c, _) in enumerate(rows)], ctx.run_id, 0)
    ctx.store.write("scores", [dict(gen_id=g, query_id="q", rep=0, attempt=0, status="ok", score=s)
                               for g, *_, s in rows], ctx.run_id, 0)
    run_curate(ctx)
    groups = ctx.store.read("groups", ctx.run_id, 0).filter(pl.col("kept"))
    label = groups.filter(pl.col("level") == "choice").row(0, named=True)
    assert dict(zip(label["members"], label["advantages"], strict=True)) == pytest.approx(
        {"direct": 1, "steps": -1, "win": 0, "lose": 0}, abs=1e-5)
    code = groups.filter(pl.col("level") == "code").row(0, named=True)
    assert dict(zip(code["members"], code["advantages"], strict=True)) == pytest.approx({"win": 1, "lose": -1},
                                                                                          abs=1e-5)
    probe = [TrainSequence("d", [1, 2], [10], 0, None), TrainSequence("s", [1, 2], [20], 0, None),
             TrainSequence("w", [1, 2, 30], [40, 41], 0, None), TrainSequence("l", [1, 2, 30], [42, 43], 0, None)]

    def logps(model) -> list[float]:
        with torch.no_grad():
            lp = completion_logprobs(model, collate(probe, pad_id=0))
        return [float(lp[b, : len(s.completion_ids)].sum()) for b, s in enumerate(probe)]

    from pipeline.engines.models import load_causal_lm

    before = logps(load_causal_lm(tiny_model, dtype="float32").eval())
    run_train(ctx)
    from peft import PeftModel

    after = logps(PeftModel.from_pretrained(load_causal_lm(tiny_model, dtype="float32"),
                                            str(ctx.store.checkpoint_dir(ctx.run_id, 0))).eval())
    moved = [a - b for a, b in zip(after, before, strict=True)]
    assert moved[0] - moved[1] > 0  # direct's label against steps'
    assert moved[2] - moved[3] > 0  # the winning own code against the losing one


def test_a_round_that_comes_scored_starts_no_executor_server(tmp_path):
    from test_curate import _ctx, _gen, _score

    from pipeline.stages.score import nothing_to_score

    ctx = _ctx(tmp_path, ["scoring.reps=2"])
    ctx.store.write("generations", [_gen("a", "q", 0), _gen("b", "q", 1)], ctx.run_id, 0)
    ctx.store.write("scores", [_score("a"), _score("a", rep=1), _score("b")], ctx.run_id, 0)
    assert not nothing_to_score(ctx)  # b's second rep is missing
    ctx.store.write("scores", [_score("b", "executor_error", None, rep=1)], ctx.run_id, 0)
    assert not nothing_to_score(ctx)  # a transient failure is retried
    ctx.store.write("scores", [_score("b", rep=1, attempt=1)], ctx.run_id, 0)
    assert nothing_to_score(ctx)
