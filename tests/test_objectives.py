"""The objective registry (pipeline.core.objectives), the curated data of each objective, and the train stage with each.

Losses are checked against values computed by hand from each method's definition (SPOGW eq. 3.6, DeepSeekMath's
GRPO, W4S's reward-weighted regression, ScoreFlow's Score-DPO, plain NLL)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from pipeline.config import TrainingConfig
from pipeline.core.objectives import KINDS, OBJECTIVES, LossInput, get_objective, register_objective

LN2 = math.log(2)


def _tc(**kw) -> TrainingConfig:
    return TrainingConfig(**kw)


def test_the_registry_holds_the_five_objectives():
    assert {o.name: o.kind for o in OBJECTIVES.values()} == {
        "iogrpo_mkl": "group", "grpo": "group", "rwr": "weighted", "score_dpo": "pair", "sft_best": "best"}
    assert [o.name for o in OBJECTIVES.values() if o.needs_old] == ["iogrpo_mkl", "grpo"]
    assert [o.name for o in OBJECTIVES.values() if o.needs_ref] == ["score_dpo"]
    assert [o.name for o in OBJECTIVES.values() if o.paired] == ["score_dpo"]
    assert set(KINDS) == {o.kind for o in OBJECTIVES.values()}
    with pytest.raises(ValueError, match="unknown objective 'ppo'; registered: iogrpo_mkl, grpo"):
        get_objective("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_objective("rwr", "weighted")(lambda inp, tc: None)
    with pytest.raises(ValueError, match="kind must be one of"):
        register_objective("x", "triples")


def _grpo_batch() -> LossInput:
    """Two sequences of 2 tokens, π_θ = π_old (ρ = 1), log-probs 0; the reference is ln 2 above on one token of
    each, so k3 = e^{ln2} - ln2 - 1 = 1 - ln 2 there and 0 elsewhere. A = +1, -1."""
    logp = torch.zeros(2, 2, requires_grad=True)
    ref = torch.tensor([[LN2, 0.0], [0.0, LN2]])
    return LossInput(logp=logp, mask=torch.ones(2, 2), coef=torch.tensor([1.0, -1.0]), old_logp=torch.zeros(2, 2),
                     ref_logp=ref, kl_mask=True)


def test_iogrpo_masks_the_kl_where_the_advantage_is_not_positive_and_grpo_does_not():
    k3, beta = 1 - LN2, 0.1
    tc = _tc(beta=beta)
    # iogrpo: seq0 token mean (1 - β·k3 + 1)/2, seq1 (-1 - 1)/2 (KL masked): loss = -(mean) = β·k3/4
    io = get_objective("iogrpo_mkl").fn(_grpo_batch(), tc)
    assert float(io.loss.detach()) == pytest.approx(beta * k3 / 4, abs=1e-7)
    # grpo: seq1 also pays its KL: -((1 - β·k3/2) + (-1 - β·k3/2))/2 = β·k3/2
    g = get_objective("grpo").fn(_grpo_batch(), tc)
    assert float(g.loss.detach()) == pytest.approx(beta * k3 / 2, abs=1e-7)
    assert float(g.pg_loss) == pytest.approx(0.0, abs=1e-7) and float(g.ratio_dev) == 0.0
    assert float(g.kl) == pytest.approx(k3 / 2, abs=1e-7)  # mean over sequences of the token mean


def _nll_batch(weights) -> LossInput:
    """log-probs ln ½, ln ¼ (seq 0) and ln ½, padding (seq 1)."""
    logp = torch.tensor([[-LN2, -2 * LN2], [-LN2, -5.0]], requires_grad=True)
    return LossInput(logp=logp, mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]), coef=torch.tensor(weights))


@pytest.mark.parametrize("name", ["rwr", "sft_best"])
def test_weighted_nll_by_hand(name):
    fn = get_objective(name).fn
    # sequence norm: (2·(ln2 + 2 ln2)/2 + 1·ln2) / 2 = 2 ln 2
    t = fn(_nll_batch([2.0, 1.0]), _tc())
    assert float(t.loss.detach()) == pytest.approx(2 * LN2, abs=1e-6) and t.kl is None and t.ratio_dev is None
    # token norm: (2·3 ln2 + 1·ln2) / 3 tokens
    tok = fn(_nll_batch([2.0, 1.0]), _tc(loss_norm="token")).loss.detach()
    assert float(tok) == pytest.approx(7 * LN2 / 3, abs=1e-6)
    # the gradient of a token's log-prob is -w/(B·T_b): heavier rows are pulled harder
    inp = _nll_batch([2.0, 1.0])
    fn(inp, _tc()).loss.backward()
    assert inp.logp.grad.flatten().tolist() == pytest.approx([-0.5, -0.5, -0.5, 0.0])


def _pair(chosen_delta: float, rejected_delta: float):
    """Sequence log-probs minus the reference's: chosen (-1 - 2) - (-2 - 2) = +1 over 2 tokens, the rejected one's
    one token (-3 + δ) - (-3) = δ."""
    logp = torch.tensor([[-1.0, -2.0], [-3.0 + rejected_delta, -9.0]])
    ref = torch.tensor([[-2.0 + (1 - chosen_delta), -2.0], [-3.0, 7.0]])
    return logp, ref, torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_score_dpo_by_hand():
    fn = get_objective("score_dpo").fn
    logp, ref, mask = _pair(1.0, -0.5)
    # z = β·(s_w·Δ_w - (1 - s_l)·Δ_l) = 0.1·(0.8·1 - 0.8·(-0.5)) = 0.12; loss = log(1 + e^{-0.12})
    inp = LossInput(logp=logp, mask=mask, coef=torch.tensor([1.0, 1.0]), ref_logp=ref, scores=torch.tensor([0.8, 0.2]))
    want = math.log1p(math.exp(-0.12))
    assert float(fn(inp, _tc()).loss.detach()) == pytest.approx(want, abs=1e-6)
    # scores 1 and 0: DPO's margin β·(Δ_w - Δ_l) = 0.15
    inp = LossInput(logp=logp, mask=mask, coef=torch.tensor([1.0, 1.0]), ref_logp=ref, scores=torch.tensor([1.0, 0.0]))
    assert float(fn(inp, _tc()).loss.detach()) == pytest.approx(math.log1p(math.exp(-0.15)), abs=1e-6)
    # two pairs, weights 1 and 3 (per pair, read at the chosen row): the mean of w_p·loss_p = 2·loss
    two = LossInput(logp=torch.cat([logp, logp]), mask=torch.cat([mask, mask]), coef=torch.tensor([1.0, 1, 3, 3]),
                    ref_logp=torch.cat([ref, ref]), scores=torch.tensor([0.8, 0.2, 0.8, 0.2]))
    assert float(fn(two, _tc(dpo_beta=0.1)).loss.detach()) == pytest.approx(2 * want, abs=1e-6)
    with pytest.raises(ValueError, match="pairs: got 3 sequences"):
        fn(LossInput(logp=logp[:1].repeat(3, 1), mask=mask[:1].repeat(3, 1), coef=torch.ones(3),
                     ref_logp=ref[:1].repeat(3, 1), scores=torch.ones(3)), _tc())


# ---- the curated rows of each kind ---------------------------------------------------------------------------------


def test_score_pairs_draw_by_the_cubed_gap():
    from pipeline.core.curation import score_pairs

    # q: gaps (0,1) .5 -> .125, (0,2) 1 -> 1, (1,2) .5 -> .125: P = .1, .8, .1; r: all equal, no pair
    draws = score_pairs({"q": [1.0, 0.5, 0.0], "r": [0.3, 0.3]}, per_query=20000, power=3.0,
                        rng=np.random.default_rng(0))
    assert len(draws) == 20000 and {q for q, _, _ in draws} == {"q"}  # one query has pairs: 1 x per_query draws
    freq = {k: sum(1 for d in draws if d[1:] == k) / len(draws) for k in [(0, 1), (0, 2), (1, 2)]}
    sd = math.sqrt(0.8 * 0.2 / 20000)  # the binomial spread of the .8 share
    assert abs(freq[(0, 2)] - 0.8) < 5 * sd and abs(freq[(0, 1)] - 0.1) < 0.01 and sum(freq.values()) == 1.0
    assert score_pairs({"r": [0.3, 0.3]}, 4, 3.0, np.random.default_rng(0)) == []


def test_rwr_weights_and_best_member_by_hand():
    from pipeline.core.curation import best_member, rwr_weights

    assert rwr_weights([1.0, 0.0, 0.5], 0.4).tolist() == pytest.approx([math.exp(2.5), 1.0, math.exp(1.25)])
    assert best_member([0.5, 1.0, 1.0], 0.0) == 1  # the first of ties
    assert best_member([0.0, 0.0], 0.0) is None and best_member([0.4, 0.2], 0.5) is None


def test_run_curate_writes_every_kind(tmp_path):
    from test_curate import _ctx, _gen, _score

    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["curation.pairs_per_query=3"])
    gens = [_gen(f"w{i}", "q", i) for i in range(3)] + [_gen(f"z{i}", "z", i) for i in range(2)]
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", [_score("w0", score=1.0), _score("w1", score=0.0), _score("w2", score=0.5),
                               _score("z0", score=0.0), _score("z1", score=0.0)], ctx.run_id, 0)
    counts = run_curate(ctx)
    g = ctx.store.read("groups", ctx.run_id, 0)
    by = {k: g.filter(g["kind"] == k) for k in KINDS}
    assert counts["pairs"] == 3 and by["pair"].height == 3  # 3 draws for q, the one query with a pair
    for r in by["pair"].iter_rows(named=True):
        assert r["kept"] and r["member_scores"][0] > r["member_scores"][1] and r["weights"] == [1.0, 1.0]
        assert r["query_id"] == "q" and set(r["members"]) <= {"w0", "w1", "w2"}
    w = {r["query_id"]: r for r in by["weighted"].iter_rows(named=True)}
    assert w["q"]["members"] == ["w0", "w1", "w2"]
    assert w["q"]["weights"] == pytest.approx([math.exp(2.5), 1.0, math.exp(1.25)])
    assert w["z"]["weights"] == [1.0, 1.0]
    best = {r["query_id"]: r for r in by["best"].iter_rows(named=True)}
    assert best["q"]["members"] == ["w0"] and best["q"]["kept"] and best["q"]["weights"] == [1.0]
    assert not best["z"]["kept"] and best["z"]["reason"] == "no workflow scored above 0"
    assert counts["best_kept"] == 1 and counts["groups_kept"] == by["group"].filter(by["group"]["kept"]).height


# ---- the train stage with each objective ---------------------------------------------------------------------------


def _round(ctx, scores: list[float]) -> None:
    """One query, one workflow per score, each with its own completion tokens (so a loss can tell them apart)."""
    from test_curate import _gen, _score

    from pipeline.stages.curate import run_curate

    gens = [_gen(f"w{i}", "q", i) | {"token_ids": [100 + i, 200 + i, 300 + i]} for i in range(len(scores))]
    ctx.store.write("generations", gens, ctx.run_id, ctx.round)
    ctx.store.write("scores", [_score(f"w{i}", score=s) for i, s in enumerate(scores)], ctx.run_id, ctx.round)
    run_curate(ctx)


def _logps(ctx, adapter) -> dict[str, float]:
    """Sequence log-prob of each workflow under base + `adapter` (None: the base model)."""
    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm
    from pipeline.stages.train.batch import collate
    from pipeline.stages.train.data import TrainSequence
    from pipeline.stages.train.logprobs import completion_logprobs

    gens = ctx.store.read("generations", ctx.run_id, ctx.round).sort("gen_id")
    model = load_causal_lm(ctx.cfg.generator.model, dtype="float32", device="cpu")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    seqs = [TrainSequence(r["gen_id"], r["prompt_token_ids"], r["token_ids"], 0.0, None)
            for r in gens.iter_rows(named=True)]
    with torch.no_grad():
        lp = completion_logprobs(model, collate(seqs, 0)).sum(-1)
    return {s.gen_id: float(v) for s, v in zip(seqs, lp, strict=True)}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_each_objective_trains_a_checkpoint_the_next_round_loads(tmp_path, tiny_model, objective):
    """`training.objective=X`: the train stage trains on X's rows and writes a whole adapter; round 1 then starts
    from it (the policy round 1's rollout samples with). The direction of each update is checked: the workflow
    each objective favours (the best one: A > 0, heaviest weight, chosen, kept) gains log-prob."""
    from test_curate import _ctx

    from pipeline.stages.runner import run_stage
    from pipeline.stages.train.policy import load_policy, start_adapter
    from pipeline.store import adapter_complete

    sets = [f"generator.model={tiny_model}", f"training.objective={objective}", "training.lr=1e-2", "training.epochs=3",
            "training.micro_batch_size=2", "curation.pairs_per_query=2", "training.beta=0.0",
            "curation.rwr_temperature=0.1"]  # rwr: weights e^10 : 1 : 1
    ctx = _ctx(tmp_path, sets)
    _round(ctx, [1.0, 0.0, 0.0])
    before = _logps(ctx, None)
    # in this process: the train stage's own child process (isolate, the default) is test_parallel_train.py's
    # one-process run; here it would only import torch and load the model again for each objective
    res = run_stage("train", ctx.run_id, 0, str(ctx.store.root), isolate=False)
    assert res.counts["objective"] == objective and res.counts["sequences"] > 0
    ckpt = ctx.store.checkpoint_dir(ctx.run_id, 0)
    assert adapter_complete(ckpt)
    metrics = ctx.store.read("train_metrics", ctx.run_id, 0)
    assert metrics.height == res.counts["steps"] > 0
    assert (metrics["ratio_dev"].is_null().all()) == (not get_objective(objective).needs_old)
    after = _logps(ctx, ckpt)
    gain = {k: after[k] - before[k] for k in before}
    assert gain["w0"] > 0 and gain["w0"] > max(gain["w1"], gain["w2"])
    nxt = ctx.at_round(1)
    assert start_adapter(nxt) == ckpt
    load_policy(nxt, "cpu")  # round 1's policy loads the checkpoint this objective wrote


def test_score_dpo_refuses_no_reference(tmp_path, tiny_model):
    from test_curate import _ctx

    from pipeline.stages.train import run_train

    ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", "training.objective=score_dpo", "training.reference=none"])
    _round(ctx, [1.0, 0.0])
    with pytest.raises(ValueError, match="score_dpo needs a reference model"):
        run_train(ctx)


def test_data_run_trains_another_runs_round(tmp_path, tiny_model):
    """training.data_run: the arm's train stage reads the source run's curated round and writes its own
    checkpoint; the source run is left as it was."""
    from test_curate import _ctx

    from pipeline.run import open_run
    from pipeline.stages.train import run_train

    src = _ctx(tmp_path, [f"generator.model={tiny_model}"])
    _round(src, [1.0, 0.0, 0.5])
    arm = open_run("configs/smoke.yaml", "arm", 0, [f"store.root={tmp_path}", f"generator.model={tiny_model}",
                                                    f"training.data_run={src.run_id}", "training.objective=rwr"],
                   store_root=str(tmp_path))
    counts = run_train(arm)
    assert counts["sequences"] == 3 and counts["distinct_workflows"] == 3  # q's weighted row: all three
    assert arm.store.checkpoint_dir("arm", 0).is_dir() and not src.store.checkpoint_dir(src.run_id, 0).exists()
    assert arm.store.read("groups", "arm", 0).height == 0


# ---- the ablation command ------------------------------------------------------------------------------------------


def test_ablation_plans_arms_and_pairs_them_by_hand(tmp_path, monkeypatch):
    """`run_ablation` with a recording stage caller and evaluations stubbed with known per-query Mean@L: the
    source run does every stage of round 0 (its checkpoint is CONFIG's objective's arm), each other objective
    trains in its own arm run on the source's data, and the table pairs arms with the base model and the
    reference arm per (seed, query)."""
    import pipeline.studies.ablation as ab
    from pipeline.run import open_run
    from pipeline.studies.summaries import EvalSummary

    calls, evals = [], []
    means = {"base": [0.0, 0.5], "iogrpo_mkl": [1.0, 0.5], "sft_best": [0.5, 1.0]}  # queries q0, q1

    def call(stage, run_id, round, store_root, sets=None, only_failed=False):
        calls.append((stage, run_id, round))
        return {"skipped": False, "wall_s": 0.0, "counts": {}}

    def evaluate_tracked(store_root, run_id, round, split, sets=None, call=None, changes=None):
        evals.append((run_id, round))
        eid = ab.eval_run_id(run_id, round, split)
        (ab.Store(store_root).run_dir(eid)).mkdir(parents=True, exist_ok=True)
        (ab.Store(store_root).run_dir(eid) / "config.yaml").write_text("run_id: x\n")

    def eval_summary(store, eid):
        arm = "base" if eid.endswith("-base") else "sft_best" if "-sft_best-" in eid else "iogrpo_mkl"
        rows = [{"query_id": f"q{i}", "mean_at_l": m, "best_at_l": m, "valid_share": 1.0}
                for i, m in enumerate(means[arm])]
        return EvalSummary(eval_run_id=eid, queries=2, per_query=rows)

    monkeypatch.setattr(ab, "evaluate_tracked", evaluate_tracked)
    monkeypatch.setattr(ab, "eval_summary", eval_summary)
    sets = [f"store.root={tmp_path}", "experiment.bootstrap=200"]
    summary = ab.run_ablation("configs/smoke.yaml", call, ["sft_best"], seeds=1, run_id="ab", sets=sets)
    assert calls == [("rollout", "ab-s0", 0), ("score", "ab-s0", 0), ("curate", "ab-s0", 0), ("train", "ab-s0", 0),
                     ("train", "ab-s0-sft_best", 0)]
    assert evals == [("ab-s0", -1), ("ab-s0", 0), ("ab-s0-sft_best", 0)]
    arm = open_run(None, "ab-s0-sft_best", 0, None, str(tmp_path)).cfg.training
    assert arm.objective == "sft_best" and arm.data_run == "ab-s0"
    assert summary.objectives == ["iogrpo_mkl", "sft_best"]
    got = {(p.arm, p.against): p.mean for p in summary.paired if p.metric == "mean_at_l"}
    # iogrpo - base: (1 + 0)/2; sft_best - base: (0.5 + 0.5)/2; sft_best - iogrpo: (-0.5 + 0.5)/2
    assert got == {("iogrpo_mkl", "base"): 0.5, ("sft_best", "base"): 0.5, ("sft_best", "iogrpo_mkl"): 0.0}
    md = (tmp_path / "experiments" / "ab-ablation" / "ablation.md").read_text()
    assert "| sft_best (best rows) | 0.750 | 0.750 | +0.500 [" in md
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        ab.run_ablation("configs/smoke.yaml", call, ["ppo"], seeds=1, run_id="ab", sets=sets)


def test_cli_train_with_another_objective_then_sql(tmp_path, tiny_model):
    """The user's path: `pipeline train CONFIG --run-id R --round 0 --set training.objective=sft_best` trains the
    curated round with that loss, and SQL over the store shows what each kind holds."""
    from test_curate import _ctx
    from typer.testing import CliRunner

    from pipeline.cli import app

    ctx = _ctx(tmp_path, [f"generator.model={tiny_model}"])
    _round(ctx, [1.0, 0.0, 0.5])
    saved = ctx.store.run_dir(ctx.run_id) / "config.yaml"
    r = CliRunner().invoke(app, ["train", str(saved), "--run-id", ctx.run_id, "--round", "0",
                                 "--set", "training.objective=sft_best"])
    assert r.exit_code == 0, r.output
    counts = ctx.store.manifest(ctx.run_id, 0, "train")["counts"]
    assert counts["objective"] == "sft_best"
    # the manifest names the weights that finished (a kept copy restores only these: Store.restore_checkpoint)
    weights = (ctx.store.checkpoint_dir(ctx.run_id, 0) / "adapter_model.safetensors").read_bytes()
    assert counts["weights_sha256"] == hashlib.sha256(weights).hexdigest()
    assert ctx.store.read("train_metrics", ctx.run_id, 0)["tokens"].sum() == 3  # w0's 3 completion tokens, once
    got = ctx.store.sql("select kind, count(*) as n, sum(len(members)) as seqs from groups where kept "
                        "group by kind order by kind")
    # one C(3,3) group sharpened to 2; 4 pair draws (pairs_per_query x 1 query); 1 weighted row of 3; 1 best
    assert got.rows() == [("best", 1, 1), ("group", 1, 2), ("pair", 4, 8), ("weighted", 1, 3)]
