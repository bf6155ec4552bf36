"""The train stage on a synthetic store: completions sampled from the real embedded model, scores set by hand."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from pipeline.stages.train.batch import collate
from pipeline.stages.train.data import TrainSequence
from pipeline.stages.train.logprobs import completion_logprobs

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(2)

MODEL = "embedded:smollm2-135m-instruct"
QUESTIONS = ["Write a workflow that adds two numbers.", "Write a workflow that answers a riddle."]
SCORES = [1.0, 0.0, 1.0, 0.0]  # per query: with n=3, t=1 every kept group holds one 1 (A>0) and one 0 (A<0)


def test_completion_logprobs_match_full_logits():
    """The flattened-positions head equals log_softmax of the full forward at the same positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg).eval()
    seqs = [TrainSequence("a", [1, 2, 3], [4, 5], 1.0, None), TrainSequence("b", [6, 7], [8, 9, 10, 11], -1.0, None)]
    batch = collate(seqs, pad_id=0)
    assert batch.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    got = completion_logprobs(lm, batch)
    for b, s in enumerate(seqs):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        full = torch.log_softmax(lm(ids).logits[0], -1)
        p = len(s.prompt_ids)
        want = torch.stack([full[p - 1 + j, tok] for j, tok in enumerate(s.completion_ids)])
        torch.testing.assert_close(got[b, : len(s.completion_ids)], want, rtol=1e-5, atol=1e-5)
        assert torch.all(got[b, len(s.completion_ids):] == 0)
    # the chunked, checkpointed head gives the same values and the same gradients
    grads = []
    for chunk in (2048, 2):
        lm.zero_grad()
        lp = completion_logprobs(lm, batch, head_chunk=chunk)
        (lp * torch.arange(1.0, 9.0).view(2, 4)).sum().backward()
        grads.append(lm.lm_head.weight.grad.clone())
        torch.testing.assert_close(lp.detach(), got.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


# ---- synthetic round from the real model -------------------------------------------------------------


@pytest.fixture(scope="module")
def samples(smol_tokenizer, smol_lm):
    """4 sampled completions per question, with generation-time logprobs (raw distribution), from the session's
    embedded model (fp32, eval: what load_causal_lm(MODEL, dtype="float32") gives; sampling changes no weight)."""
    tok, lm = smol_tokenizer, smol_lm
    torch.manual_seed(0)
    out = []
    for q, question in enumerate(QUESTIONS):
        prompt_text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=False)
        prompt = tok(prompt_text, return_tensors="pt")
        gen = lm.generate(**prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=20,
                          num_return_sequences=len(SCORES), output_scores=True, return_dict_in_generate=True,
                          pad_token_id=tok.pad_token_id)
        lps = lm.compute_transition_scores(gen.sequences, gen.scores, normalize_logits=True)
        p = prompt["input_ids"].shape[1]
        for slot in range(len(SCORES)):
            comp = gen.sequences[slot, p:]
            keep = comp != tok.pad_token_id
            keep[: int(keep.sum())] = True  # eos may equal pad: keep the first one
            comp_ids = comp[keep].tolist()
            out.append({"gen_id": f"q{q}-w{slot}", "kind": "workflow", "query_id": f"q{q}", "slot": slot,
                        "prompt_text": prompt_text, "text": tok.decode(comp_ids),
                        "prompt_token_ids": prompt["input_ids"][0].tolist(), "token_ids": comp_ids,
                        "token_logprobs": lps[slot, : len(comp_ids)].tolist(), "valid": True, "model": MODEL})
    return out


def _open(tmp_path, sets):
    from pipeline.run import open_run

    pinned = [f"store.root={tmp_path}", "curation.n=3", "curation.t=1", "curation.top_n=8", "training.lr=1e-4"]
    return open_run("configs/smoke.yaml", f"t{uuid.uuid4().hex[:6]}", 0, [*pinned, *sets], store_root=str(tmp_path))


def _seed_round(ctx, samples) -> None:
    ctx.store.write("generations", samples, ctx.run_id, ctx.round)
    ctx.store.write("scores", [{"gen_id": s["gen_id"], "query_id": s["query_id"], "rep": 0, "attempt": 0,
                                "status": "ok", "score": SCORES[s["slot"]]} for s in samples], ctx.run_id, ctx.round)


def _mean_logp(lm, samples) -> dict[str, float]:
    """Mean per-token logprob of each sample under `lm` (in eval mode)."""
    seqs = [TrainSequence(s["gen_id"], s["prompt_token_ids"], s["token_ids"], 0.0, None) for s in samples]
    with torch.no_grad():
        lp = completion_logprobs(lm, collate(seqs, pad_id=0))
    return {s.gen_id: float(lp[b, : len(s.completion_ids)].mean()) for b, s in enumerate(seqs)}


@pytest.mark.slow
def test_mechanism_curate_then_train_moves_logprobs(tmp_path, samples, smol_lm):
    """One epoch of the curated round (8 kept groups of 2, 16 sequences): 4 steps of 4 sequences at lr 3e-3."""
    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm
    from pipeline.stages.curate import run_curate
    from pipeline.stages.train import run_train

    ctx = _open(tmp_path, ["training.lr=3e-3", "training.epochs=1", "training.lora_dropout=0.0",
                           "training.micro_batch_size=4"])
    _seed_round(ctx, samples)
    cur = run_curate(ctx)
    assert cur["groups_kept"] == 8 and cur["queries_left_out"] == 0
    counts = run_train(ctx)
    assert counts["sequences"] == 16 and counts["steps"] == 4
    # the trainer's fp32 old logprobs agree with the sampler's raw logprobs
    assert counts["logp_mismatch"] < 1e-3
    tuned = PeftModel.from_pretrained(load_causal_lm(MODEL, dtype="float32", device="cpu"),
                                      str(ctx.store.checkpoint_dir(ctx.run_id, 0))).eval()
    before, after = _mean_logp(smol_lm, samples), _mean_logp(tuned, samples)
    pos = [s["gen_id"] for s in samples if SCORES[s["slot"]] == 1.0]
    neg = [s["gen_id"] for s in samples if SCORES[s["slot"]] == 0.0]
    mean = lambda d, ids: float(np.mean([d[i] for i in ids]))  # noqa: E731
    print(f"\nmechanism: A>0 mean logp {mean(before, pos):.4f} -> {mean(after, pos):.4f}; "
          f"A<0 {mean(before, neg):.4f} -> {mean(after, neg):.4f}")
    assert mean(after, pos) > mean(before, pos)
    assert mean(after, neg) < mean(before, neg)
    # the store holds one metrics row per step and the checkpoint row
    m = ctx.store.read("train_metrics", ctx.run_id, 0)
    assert sorted(m["step"].to_list()) == list(range(4))
    # KL(π_old‖π_θ) on π_old's samples: none before the first update, some after it (π_old is the round's start)
    kl_old = m.sort("step")["kl_old"].to_list()
    assert kl_old[0] == 0.0 and min(kl_old[1:]) > 0.0
    assert m["tokens"].sum() == counts["tokens"] > 0
    ck = ctx.store.read("checkpoints", ctx.run_id, 0)
    assert ck.height == 1 and ck["rows_used"][0] == 16


@pytest.mark.slow
def test_bf16_first_step_has_ratio_one(tmp_path, samples, tiny_model):
    """Under bf16 autocast, π_old is computed under the same autocast as π_θ (and without dropout): before any
    update the two agree exactly, so the first step has KL (k3) 0 and no clipped token. With π_old in fp32
    against a bf16 π_θ, the first step's log-ratio is bf16 rounding noise, and k3 > 0. On the tiny llama (the
    embedded model's tokenizer, so the same samples): bf16 products are ~45x slower than fp32 on CPUs without
    native bf16, and the property does not depend on the model's size."""
    from pipeline.stages.curate import run_curate
    from pipeline.stages.train import run_train

    ctx = _open(tmp_path, ["training.bf16=true", "training.lora_dropout=0.0", "training.micro_batch_size=8",
                           "training.grad_accum=2", f"generator.model={tiny_model}"])
    _seed_round(ctx, samples)
    run_curate(ctx)
    run_train(ctx)
    m = ctx.store.read("train_metrics", ctx.run_id, 0).sort("step")
    assert m["kl"][0] == 0.0 and m["clip_frac"][0] == 0.0


@pytest.mark.slow
def test_crash_restart_then_skip_then_next_round(tmp_path, samples, monkeypatch, tiny_model):
    """On the tiny llama (the embedded model's tokenizer, so the same samples): round 1 runs the GPU code paths,
    bf16 autocast among them, which are ~45x slower than fp32 on CPUs without native bf16."""
    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm
    from pipeline.stages.curate import run_curate
    from pipeline.stages.runner import StageError, run_stage
    from pipeline.stages.train import run_train
    from pipeline.store import Store

    ctx = _open(tmp_path, ["training.epochs=1", "training.micro_batch_size=8", "training.reference=base",
                           f"generator.model={tiny_model}"])
    _seed_round(ctx, samples)
    run_curate(ctx)
    # crash after the adapter and the metrics are written, before the checkpoints row and the manifest
    real_write = Store.write

    def crashing_write(self, table, rows, run_id, round):
        if table == "checkpoints":
            raise RuntimeError("simulated crash")
        return real_write(self, table, rows, run_id, round)

    def train_stage():  # through the stage runner: it skips a finished stage and discards an unfinished attempt
        return run_stage("train", ctx.run_id, 0, str(ctx.store.root), isolate=False)

    monkeypatch.setattr(Store, "write", crashing_write)
    with pytest.raises(StageError, match="simulated crash") as e:
        train_stage()
    assert not e.value.transient
    monkeypatch.setattr(Store, "write", real_write)
    assert ctx.store.manifest(ctx.run_id, 0, "train") is None
    assert ctx.store.read("train_metrics", ctx.run_id, 0).height == 2  # the crashed attempt's rows, until...
    res = train_stage()  # ...the restart discards them: no duplicated metrics
    assert res.counts["steps"] == 2 and not res.skipped
    assert sorted(ctx.store.read("train_metrics", ctx.run_id, 0)["step"].to_list()) == [0, 1]
    assert ctx.store.read("checkpoints", ctx.run_id, 0).height == 1
    assert train_stage().skipped is True
    assert ctx.store.read("train_metrics", ctx.run_id, 0).height == 2
    ckpt0 = ctx.store.checkpoint_dir(ctx.run_id, 0)
    assert not [p for p in ckpt0.parent.iterdir() if p.name.endswith(".tmp")]

    # round 1 refuses to start without round 0's adapter, then trains on top of it (reference = base)
    ctx1 = ctx.at_round(1)
    _seed_round(ctx1, samples)
    run_curate(ctx1)
    moved = ckpt0.with_name("moved")
    ckpt0.rename(moved)
    with pytest.raises(RuntimeError, match="round 0"):
        run_train(ctx1)
    moved.rename(ckpt0)
    ctx1.cfg.training.bf16 = True  # the GPU code paths also run on CPU: bf16 autocast, gradient checkpointing
    ctx1.cfg.training.gradient_checkpointing = True
    c1 = run_train(ctx1)
    assert c1["steps"] == 2 and c1["sequences"] == 16
    row = ctx1.store.read("checkpoints", ctx.run_id, 1)
    assert row["parent_round"][0] == 0
    lm = PeftModel.from_pretrained(load_causal_lm(tiny_model, device="cpu"),
                                   str(ctx1.store.checkpoint_dir(ctx.run_id, 1)))
    w0 = PeftModel.from_pretrained(load_causal_lm(tiny_model, device="cpu"), str(ckpt0))
    a1 = dict(lm.named_parameters())
    changed = [k for k, v in w0.named_parameters() if "lora_B" in k and not torch.equal(v, a1[k])]
    every_b = sorted(k for k, _ in w0.named_parameters() if "lora_B" in k)
    assert every_b and sorted(changed) == every_b  # round 1 continued from round 0's weights and moved them all


@pytest.mark.slow
def test_empty_round_writes_unchanged_adapter(tmp_path, samples):
    from pipeline.stages.curate import run_curate
    from pipeline.stages.train import run_train

    ctx = _open(tmp_path, [])
    ctx.store.write("generations", samples, ctx.run_id, 0)
    ctx.store.write("scores", [{"gen_id": s["gen_id"], "rep": 0, "attempt": 0, "status": "ok", "score": 0.5}
                               for s in samples], ctx.run_id, 0)
    assert run_curate(ctx)["groups_kept"] == 0  # every query is all-equal: filtered
    counts = run_train(ctx)
    assert counts["sequences"] == 0 and counts["steps"] == 0
    assert (ctx.store.checkpoint_dir(ctx.run_id, 0) / "adapter_model.safetensors").is_file()


def test_two_level_sequences_carry_their_level_advantage(tmp_path):
    from test_curate import _ctx, _gen, _score

    from pipeline.stages.curate import run_curate
    from pipeline.stages.train.data import load_sequences

    ctx = _ctx(tmp_path, ["rollout.mode=two_level", "training.max_seq_len=3"])
    gens = [_gen("A0", "q", 0, "agent"), _gen("A1", "q", 1, "agent"),
            _gen("w00", "q", 0, parent="A0"), _gen("w01", "q", 1, parent="A0"), _gen("w10", "q", 0, parent="A1")]
    gens[4]["prompt_token_ids"] = [1, 2, 3]  # prompt as long as max_seq_len: nothing left to train on
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", [_score("w00", score=1.0), _score("w01", score=0.0), _score("w10", score=1.0)],
                    ctx.run_id, 0)
    run_curate(ctx)
    seqs, info = load_sequences(ctx)
    adv = {s.gen_id: s.advantage for s in seqs}
    # workflow scores [1, 0, 1] (batch): r̄ = 2/3, σ = sqrt(2/9); agent rewards [.5, 1] use the same r̄, σ
    sw = np.sqrt(2 / 9)
    assert adv["A0"] == pytest.approx(-(1 / 6) / sw, abs=1e-5) and adv["A1"] == pytest.approx((1 / 3) / sw, abs=1e-5)
    assert adv["w00"] == pytest.approx((1 / 3) / sw, abs=1e-5) and adv["w01"] == pytest.approx(-(2 / 3) / sw, abs=1e-5)
    assert "w10" not in adv and info == {"sequences_truncated": 4, "sequences_dropped": 1,
                                        "distinct_workflows": 4, "distinct_queries": 1}
    assert all(s.prompt_ids == [1, 2] and s.completion_ids == [3] for s in seqs)  # completion tail cut to the cap


# ---- a tiny random model: the train stage's wiring in seconds -------------------------------------------------


def _two_level_round(tmp_path, tiny_model, sets=()):
    """Plans A0 (workflows scoring 1, 0) and A1 (one workflow scoring 1), curated."""
    from test_curate import _ctx, _gen, _score

    from pipeline.stages.curate import run_curate

    ctx = _ctx(tmp_path, ["rollout.mode=two_level", f"generator.model={tiny_model}", *sets])
    gens = [_gen("A0", "q", 0, "agent"), _gen("A1", "q", 1, "agent"),
            _gen("w00", "q", 0, parent="A0"), _gen("w01", "q", 1, parent="A0"), _gen("w10", "q", 0, parent="A1")]
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", [_score("w00", score=1.0), _score("w01", score=0.0), _score("w10", score=1.0)],
                    ctx.run_id, 0)
    run_curate(ctx)
    return ctx


@pytest.mark.parametrize("mbs, accum", [(5, 1), (2, 3)])
def test_two_level_first_step_loss_is_the_proposals(tmp_path, tiny_model, mbs, accum):
    """At step 1 ρ = 1 and k3 = 0, so L = -(w_A mean_i A^A_i + w_W mean_ij A^W_ij) over the step's sequences,
    however they are cut into micro-batches. Workflow scores [1, 0, 1]: r̄ = 2/3, σ = sqrt(2/9); A^A of the
    rewards [.5, 1] = [-1/6, 1/3]/σ (mean 1/12/σ), A^W = [1/3, -2/3, 1/3]/σ (mean 0): L = -(1/12)/σ = -0.1768.
    Pooling the five sequences as equals gave -(1/6)/σ/5 = -0.0707."""
    from pipeline.stages.train import run_train

    ctx = _two_level_round(tmp_path, tiny_model, [f"training.micro_batch_size={mbs}", f"training.grad_accum={accum}"])
    run_train(ctx)
    m = ctx.store.read("train_metrics", ctx.run_id, 0).sort("step")
    sigma = np.sqrt(2 / 9)
    assert m.height == 1 and m["loss"][0] == pytest.approx(-(1 / 12) / sigma, abs=1e-5)
    assert m["pg_loss"][0] == pytest.approx(-(1 / 12) / sigma, abs=1e-5)
    # the weights of both terms come from the config: the agent term counts twice
    ctx2 = _two_level_round(tmp_path, tiny_model, [f"training.micro_batch_size={mbs}", "training.grad_accum=3",
                                                   "training.two_level.agent_weight=2"])
    run_train(ctx2)
    assert ctx2.store.read("train_metrics", ctx2.run_id, 0)["loss"][0] == pytest.approx(-(2 / 12) / sigma, abs=1e-5)


def test_step_weights_and_kl_masks_follow_the_levels():
    from pipeline.config import RunConfig
    from pipeline.stages.train.loss import kl_masks, step_weights

    tc = RunConfig.model_validate({"training": {"two_level": {"workflow_kl_mask": True}}}).training
    seqs = [TrainSequence("a", [1], [2, 3], 0.5, None, "agent"), TrainSequence("w0", [1], [2], 1.0, None, "workflow"),
            TrainSequence("w1", [1], [2, 3, 4, 5], -1.0, None, "workflow")]
    # c = w_l / (n_l T_b): agent 1/(1*2); workflows 1/(2*1), 1/(2*4)
    assert step_weights(seqs, [2, 0, 1], tc) == pytest.approx({2: 1 / 8, 0: 1 / 2, 1: 1 / 2})
    assert kl_masks(seqs, tc).tolist() == [False, True, True]  # agent KL unmasked, workflow KL masked
    flat = [TrainSequence("f", [1], [2], 1.0, None)]
    assert step_weights(flat, [0], tc) is None and kl_masks(flat, tc) is True


def test_logp_mismatch_leaves_out_a_drawn_label_and_logged_rows():
    """The sampler-trainer mismatch (mean |logged - π_old| a token) counts sampled tokens only: a drawn design label's
    logged log-prob is the draw's (rollout.choice_step), a logged row's is μ's."""
    from pipeline.stages.train.metrics import StepSums

    seqs = [TrainSequence("d", [1], [7, 8, 9], 1.0, [-2.0, -0.5, -1.0], drawn_label=True),
            TrainSequence("s", [1], [7, 8], 1.0, [-0.2, -0.3]),
            TrainSequence("m", [1], [7], 1.0, [-5.0], off_policy=True)]
    old = {"d": torch.tensor([-0.1, -0.4, -1.3]), "s": torch.tensor([-0.2, -0.1]), "m": torch.tensor([-0.1])}
    sums = StepSums()
    sums.add_mismatch(seqs, old)
    # d: its label (|-2.0 + 0.1|) left out, then 0.1 + 0.3; s: 0 + 0.2; m: none. 0.6 over 4 tokens
    assert sums.mismatch_tokens == 4 and sums.logp_mismatch == pytest.approx(0.6 / 4, abs=1e-6)


def test_pi_old_from_the_rollout_recomputes_drawn_labels_and_logged_rows():
    """training.old_logprobs: rollout takes a sequence's logged log-probs as π_old only where they are the policy's:
    a drawn label stored without the policy's own log-prob (drawn_label) and a logged row (μ's) are recomputed, in
    the passes that hold them."""
    from types import SimpleNamespace

    from pipeline.core.packing import Pass
    from pipeline.stages.train.reference import old_logprobs

    seqs = [TrainSequence("own", [1], [7, 8], 1.0, [-0.3, -0.4]),
            TrainSequence("drawn", [1], [7], 1.0, [-1.1], drawn_label=True),
            TrainSequence("mu", [1], [9], 1.0, [-1.0986], off_policy=True)]
    setup = SimpleNamespace(train_cfg=SimpleNamespace(old_logprobs="rollout"), seqs=seqs)
    passes = [Pass([0], [0], [0]), Pass([1, 2], [1, 2], [0, 1])]
    computed = []

    def compute(todo):
        computed.append([seqs[i].gen_id for p in todo for i in p.uniq])
        return {seqs[i].gen_id: torch.full((len(seqs[i].completion_ids),), -9.0) for p in todo for i in p.uniq}

    old = old_logprobs(setup, passes, compute)
    assert computed == [["drawn", "mu"]]  # the first pass's one sequence is the rollout's own
    assert old["own"].tolist() == pytest.approx([-0.3, -0.4])
    assert old["drawn"].tolist() == [-9.0] and old["mu"].tolist() == [-9.0]


def _random_adapter(model_ref: str, path, dropout: float = 0.05, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A rank-4 LoRA adapter with random B (it changes outputs), saved with `dropout`; returns its B weights."""
    from peft import LoraConfig, get_peft_model

    from pipeline.engines.models import load_causal_lm

    torch.manual_seed(1)
    model = get_peft_model(load_causal_lm(model_ref, device="cpu"),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, scale)
    model.save_pretrained(str(path))
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}


def _flat_round(ctx, logprobs: list[float] | None = None) -> None:
    from test_curate import _gen, _score

    from pipeline.stages.curate import run_curate

    ctx.store.write("generations", [{**_gen(f"w{i}", "q", i), "token_logprobs": logprobs} for i in range(3)],
                    ctx.run_id, ctx.round)
    ctx.store.write("scores", [_score(f"w{i}", score=float(i % 2)) for i in range(3)], ctx.run_id, ctx.round)
    run_curate(ctx)


def test_first_step_ratio_is_one_from_a_trained_adapter(tmp_path, tiny_model):
    """Round 1 starts from round 0's adapter (random B, saved with the former default dropout 0.05). π_old is
    computed in eval mode, π_θ in train mode: with the default dropout 0 (which replaces the adapter's) they agree,
    ρ = 1 within 1e-5 at step 1. With dropout 0.1 the same step is off by far more."""
    from test_curate import _ctx

    from pipeline.stages.train import run_train

    for dropout, off in ((None, False), (0.1, True)):
        sets = [f"generator.model={tiny_model}", "training.micro_batch_size=2", "training.grad_accum=2"]
        ctx = _ctx(tmp_path, sets + ([f"training.lora_dropout={dropout}"] if dropout else [])).at_round(1)
        _random_adapter(tiny_model, ctx.store.checkpoint_dir(ctx.run_id, 0))
        _flat_round(ctx)
        run_train(ctx)
        first = ctx.store.read("train_metrics", ctx.run_id, 1).sort("step").row(0, named=True)
        if off:
            assert first["ratio_dev"] > 1e-3
        else:
            assert first["ratio_dev"] <= 1e-5 and first["clip_frac"] == 0.0 and abs(first["kl"]) <= 1e-9
            assert abs(first["kl_old"]) <= 1e-9  # KL(π_old‖π_θ): π_θ is π_old before the first update


def test_old_logprobs_from_the_rollout(tmp_path, tiny_model):
    """training.old_logprobs: rollout takes π_old from the stored sampled-token log-probs: fabricated ones (log p = 0
    on every token) are exactly what the logged mismatch compares against (0), and they make ρ = p_θ ≠ 1 at step 1.
    Stored without log-probs, the sequences are recomputed exactly as under `recompute`: the same adapter."""
    from safetensors.torch import load_file
    from test_curate import _ctx

    from pipeline.stages.train import run_train

    def trained(mode: str, logprobs: list[float] | None):
        ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", "generator.temperature=1.0", "generator.top_p=1.0",
                              "training.micro_batch_size=2", f"training.old_logprobs={mode}"])
        _flat_round(ctx, logprobs)
        run_train(ctx)
        m = ctx.store.read("train_metrics", ctx.run_id, 0).sort("step").row(0, named=True)
        return m, load_file(str(ctx.store.checkpoint_dir(ctx.run_id, 0) / "adapter_model.safetensors"))

    first, _ = trained("rollout", [0.0, 0.0])
    assert first["logp_mismatch"] == 0.0 and first["ratio_dev"] > 1e-3
    (_, w_rollout), (recomputed, w_recompute) = trained("rollout", None), trained("recompute", None)
    assert recomputed["ratio_dev"] == 0.0  # recomputed: ρ = 1 at step 1, as the fabricated π_old above is not
    assert w_rollout.keys() == w_recompute.keys() and all(torch.equal(w_rollout[k], w_recompute[k]) for k in w_rollout)


def test_old_logprobs_auto_reuses_the_rollout_only_where_both_sides_are_fp32():
    """auto: the rollout's log-probs where a local generator sampled the model's own distribution in fp32 and the
    trainer runs without bf16 autocast; a recomputing pass wherever either side differs (logic only)."""
    from types import SimpleNamespace

    from pipeline.config import GeneratorConfig, ServeConfig, TrainingConfig
    from pipeline.stages.train.reference import old_source

    def source(mode="auto", bf16=False, **g):
        gen = GeneratorConfig(**{"backend": "vllm", "dtype": "float32", "temperature": 1.0, "top_p": 1.0, **g})
        setup = SimpleNamespace(train_cfg=TrainingConfig(old_logprobs=mode), bf16=bf16,
                                ctx=SimpleNamespace(cfg=SimpleNamespace(generator=gen)))
        return old_source(setup)

    assert source() == "rollout"
    assert source(backend="transformers") == "rollout"
    assert source(backend="openai", serve=ServeConfig(dtype="float32")) == "rollout"  # a server the run starts
    assert source(backend="openai", serve=ServeConfig(dtype="bfloat16")) == "recompute"  # ...in its serve.dtype
    assert source(backend="openai", base_url="http://127.0.0.1:1/v1") == "recompute"  # a server of unknown dtype
    assert source(bf16=True) == "recompute"  # the trainer's bf16 autocast
    assert source(dtype="bfloat16") == "recompute"
    assert source(temperature=0.7) == "recompute" and source(top_p=0.9) == "recompute"  # tempered: not π_θ's
    assert source("recompute") == "recompute" and source("rollout", bf16=True) == "rollout"


def test_round_0_trains_from_generator_adapter(tmp_path, tiny_model):
    """generator.adapter samples round 0, so round 0 trains from it (π_old = it): its B weights, its rank (4, not
    the config's 8), this run's dropout, and ρ = 1 at step 1."""
    import json

    from test_curate import _ctx

    from pipeline.stages.train import run_train
    from pipeline.stages.train.policy import load_policy

    start = tmp_path / "sft-adapter"
    want = _random_adapter(tiny_model, start)
    ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", f"generator.adapter={start}"])
    model = load_policy(ctx, "cpu")
    got = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert model.peft_config["default"].lora_dropout == 0.0 and model.peft_config["default"].r == 4
    _flat_round(ctx)
    run_train(ctx)
    assert ctx.store.read("train_metrics", ctx.run_id, 0).sort("step")["ratio_dev"][0] <= 1e-5
    assert json.loads((ctx.store.checkpoint_dir(ctx.run_id, 0) / "adapter_config.json").read_text())["r"] == 4
    # a missing generator.adapter is refused with its path
    bad = _ctx(tmp_path, [f"generator.model={tiny_model}", f"generator.adapter={tmp_path / 'nope'}"])
    with pytest.raises(RuntimeError, match="trains from the adapter .*nope.*generator.adapter must name"):
        load_policy(bad, "cpu")


@pytest.mark.parametrize("dies_in, saved_at", [(3, 2), (1, 0)])
def test_a_killed_train_stage_resumes_at_its_last_saved_step(tmp_path, tiny_model, monkeypatch, dies_in, saved_at):
    """training.save_steps = 2 on a 5-step round: the loop dies in step 3 (0-based), after its progress was saved
    at the end of step 1, or in step 1, before any save_steps boundary, where only the progress written once the
    reference passes were done (next step 0) is on disk. The re-run loads it (π_old is not recomputed: that pass
    would fail here), trains from the saved step (a step done but not saved runs again) and ends with the adapter and
    the per-step losses of an uninterrupted run, exactly; the progress file is gone once the checkpoint is written."""
    from safetensors.torch import load_file
    from test_curate import _ctx

    from pipeline.stages.progress import progress_path, saved_steps
    from pipeline.stages.train import stage as train

    def round_ctx():
        ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", "training.micro_batch_size=2", "training.epochs=5",
                              "training.save_steps=2", "training.lr=1e-2"])
        _flat_round(ctx)
        return ctx

    def outputs(ctx):
        m = ctx.store.read("train_metrics", ctx.run_id, 0).sort("step")
        ckpt = ctx.store.checkpoint_dir(ctx.run_id, 0)
        return m["loss"].to_list(), load_file(str(ckpt / "adapter_model.safetensors"))

    whole = round_ctx()
    train.run_train(whole)
    want_loss, want_w = outputs(whole)
    assert len(want_loss) == 5 and not progress_path(whole.store, whole.run_id, 0).exists()

    killed = round_ctx()
    real_metrics = train.StepMetrics

    def dying(**fields):  # a step's metrics are made once its update is done
        if fields["step"] == dies_in:
            raise MemoryError(f"killed in step {dies_in}")
        return real_metrics(**fields)

    monkeypatch.setattr(train, "StepMetrics", dying)
    with pytest.raises(MemoryError):
        train.run_train(killed)
    saved = progress_path(killed.store, killed.run_id, 0)
    assert torch.load(saved, weights_only=False)["next_step"] == saved_at
    assert saved_steps(saved) == (saved_at, 5)  # what `--status` reads, without torch
    monkeypatch.setattr(train, "StepMetrics", real_metrics)
    monkeypatch.setattr(train, "reference_passes", lambda s: pytest.fail("π_old recomputed on resume"))
    counts = train.run_train(killed)
    got_loss, got_w = outputs(killed)
    assert counts["steps"] == 5 and got_loss == want_loss and len(set(want_loss)) > 1
    assert got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in want_w)
    assert not saved.exists() and saved_steps(saved) is None


@pytest.mark.parametrize("schedule, warmup", [("linear", 2), ("cosine", 0), ("constant", 3)])
def test_lr_schedule_and_warmup_set_each_steps_learning_rate(tmp_path, tiny_model, schedule, warmup):
    """training.lr_schedule and warmup_steps, as each step's logged lr (the rate its update used) over N steps of
    peak 1e-3: linear, s/w during the warm-up, then (N - s) / (N - w); cosine (no warm-up) (1 + cos(π s / N)) / 2;
    constant after a linear warm-up of w steps."""
    import math

    from test_curate import _ctx

    from pipeline.stages.train import run_train

    ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", "training.micro_batch_size=1", "training.epochs=6",
                          "training.lr=1e-3", f"training.lr_schedule={schedule}", f"training.warmup_steps={warmup}"])
    _flat_round(ctx)
    run_train(ctx)
    lrs = ctx.store.read("train_metrics", ctx.run_id, 0).sort("step")["lr"].to_list()
    n = len(lrs)
    assert n == 6  # a step takes a whole group (the one query's), one step an epoch

    def expected(s: int) -> float:
        if s < warmup:
            return s / warmup
        return {"linear": (n - s) / (n - warmup), "cosine": (1 + math.cos(math.pi * s / n)) / 2,
                "constant": 1.0}[schedule]

    assert lrs == pytest.approx([1e-3 * expected(s) for s in range(n)], abs=1e-12)


def test_max_grad_norm_clips_the_update(tmp_path, tiny_model):
    """training.max_grad_norm: a fresh adapter's B starts at 0, so after one AdamW step B is the update,
    lr · g / (|g| + 1e-8) per element. Unclipped (norm 1) the largest moves by a good part of lr; clipped to a norm
    of 1e-12, every |g| <= 1e-12 and the update is at most lr · 1e-12 / 1e-8 = lr · 1e-4."""
    from safetensors.torch import load_file
    from test_curate import _ctx

    from pipeline.stages.train import run_train

    moved = {}
    for norm in (1.0, 1e-12):
        ctx = _ctx(tmp_path, [f"generator.model={tiny_model}", "training.micro_batch_size=2", "training.lr=1e-3",
                              f"training.max_grad_norm={norm}"])
        _flat_round(ctx)
        run_train(ctx)
        assert ctx.store.read("train_metrics", ctx.run_id, 0).height == 1
        weights = load_file(str(ctx.store.checkpoint_dir(ctx.run_id, 0) / "adapter_model.safetensors"))
        moved[norm] = max(float(w.abs().max()) for n, w in weights.items() if "lora_B" in n)
    assert moved[1.0] > 0.1e-3
    assert moved[1e-12] <= 1e-3 * 1e-4 * 1.01
