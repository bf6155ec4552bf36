"""The train stage computes each token once. A pass encodes each distinct prompt once and its completions
attend to it (pipeline.stages.train.completion_logprobs); a sequence in several groups of a step is computed once and
carries the sum of its groups' loss terms (pipeline.stages.train.chunk_loss_input). Both against today's path: one full
forward per row."""

import numpy as np
import pytest
import torch

from pipeline.core.objectives import get_objective
from pipeline.core.packing import pack, step_units
from pipeline.stages.train.batch import collate, collate_packed, pass_batch
from pipeline.stages.train.data import TrainSequence
from pipeline.stages.train.logprobs import completion_logprobs
from pipeline.stages.train.loss import pass_loss_input
from pipeline.stages.train.plan import row_shapes
from pipeline.stages.train.policy import frozen_linears_bf16

torch.set_num_threads(2)
ROUNDING_FACTOR = 4  # how far two fp32 orderings of the same sums may differ in error (the test's docstring)
MODEL = "embedded:smollm2-135m-instruct"
TEXTS = ["async def solve(problem):\n    return str(sum(int(x) for x in problem.split('+')))",
         "First add the two numbers, then check the answer with the executor.",
         "result = await llm('What is 12 + 30?')\n    return result.strip()",
         "Split the question into steps.", "return problem"]


def _full_logprobs(model, s: TrainSequence) -> torch.Tensor:
    """Today's path: one forward over prompt + completion, log_softmax of the full logits."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(ids).logits[0]
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    p = len(s.prompt_ids)
    return torch.stack([lp[p - 1 + j, t] for j, t in enumerate(s.completion_ids)])


def _with_random_lora(base):
    """`base` with a LoRA on q, k, v and down whose B is random (a fresh B is zero: outputs and A's grads would not
    move)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


@pytest.fixture(scope="module")
def lora_smol(smol_tokenizer):
    """A fresh SmolLM2 (never the shared `smol_lm`) with a LoRA whose B is random: outputs and A's grads move."""
    from pipeline.engines.models import load_causal_lm

    torch.manual_seed(0)
    model = _with_random_lora(load_causal_lm(MODEL, dtype="float32", device="cpu"))
    prompts = [smol_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]
               for q in ("Write a workflow that adds 12 and 30.", "Write a workflow for a riddle.")]
    seqs = [TrainSequence(f"s{i}", list(prompts[i // 3]), smol_tokenizer(t)["input_ids"], 1.0, None)
            for i, t in enumerate(TEXTS)]  # prompt 0 for three sequences, prompt 1 for two
    return model.train(), seqs


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def per_sequence(lora_smol):
    """Today's path on `lora_smol`, computed once for both layouts (the model's weights never change): per-token
    weights `w`, the exact (float64) per-token log-probs, today's fp32 error against them (one forward per
    sequence) and the LoRA gradients of the w-weighted log-prob sum."""
    import copy

    model, seqs = lora_smol
    w = [torch.randn(len(s.completion_ids), generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    with torch.no_grad():
        exact_model = copy.deepcopy(model).double().eval()
        exact = [_full_logprobs(exact_model, s) for s in seqs]
        del exact_model
    model.zero_grad()
    want = [_full_logprobs(model, s) for s in seqs]
    today = torch.cat([(lp.detach().double() - ex).abs() for lp, ex in zip(want, exact, strict=True)])
    sum((lp * wi).sum() for lp, wi in zip(want, w, strict=True)).backward()
    want_g = _grads(model)
    model.zero_grad()
    return w, exact, today, want_g


@pytest.mark.parametrize("layout", ["split", "packed"])
def test_shared_prompt_forward_equals_one_forward_per_sequence(lora_smol, per_sequence, layout):
    """fp32, the embedded model: per-token log-probs as close to the exact (float64) values as today's path (one
    forward per sequence) is, every LoRA gradient within 1e-4 relative, with and without gradient checkpointing.
    The bound is derived, not measured on one machine: both paths evaluate the same function in fp32 (the float64
    test below shows the maths is the same to 1e-10), so each is off from the exact value by fp32 rounding alone,
    whose size follows the CPU's kernels (today's path is off by ~1e-5 on average here, more on AVX2 than on AMX).
    Two orderings of the same fp32 sums have errors of the same order, so the shared pass may be off by at most
    ROUNDING_FACTOR times today's path's own error, mean and max, on the same machine; giving one sequence the
    other prompt's row moves log-probs by 4.3 at most and 0.18 on average, five orders of magnitude above. The
    prompt pass runs once per distinct prompt (2 rows for 5 sequences); the k/v LoRA gradients include the
    completions' pull on the prompt's keys and values (detaching them was measured at 0.3 relative error). The
    packed layout (`training.prompt_layout`: a prompt and its completions in one row) is held to the same bounds.
    Today's path (exact values, its error, its gradients) is the module's `per_sequence`, shared by both layouts."""
    model, seqs = lora_smol
    w, exact, today, want_g = per_sequence
    batch = pass_batch(seqs, 0, "cpu", layout)
    if layout == "split":
        assert batch.prompt_ids.shape[0] == 2 and batch.prompt_of.tolist() == [0, 0, 0, 1, 1]
    else:  # one row per prompt: the prompt, then every completion but its last token
        assert batch.input_ids.shape[0] == 2
        prompts = sum(len(seqs[i].prompt_ids) for i in (0, 3))
        assert batch.tokens == prompts + sum(len(x.completion_ids) - 1 for x in seqs)
    for checkpointed in (False, True):
        if checkpointed:
            model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        got = completion_logprobs(model, batch)
        sum((got[b, : len(s.completion_ids)] * w[b]).sum() for b, s in enumerate(seqs)).backward()
        err = torch.cat([(got[b, : len(s.completion_ids)].detach().double() - exact[b]).abs()
                         for b, s in enumerate(seqs)])
        assert float(err.mean()) <= ROUNDING_FACTOR * float(today.mean()), (float(err.mean()), float(today.mean()))
        assert float(err.max()) <= ROUNDING_FACTOR * float(today.max()), (float(err.max()), float(today.max()))
        assert all(torch.all(got[b, len(s.completion_ids):] == 0) for b, s in enumerate(seqs))
        got_g = _grads(model)
        assert got_g.keys() == want_g.keys() and len(got_g) == 4 * 2 * 30  # A and B of 4 modules x 30 layers
        worst = max(float((got_g[n] - want_g[n]).norm() / want_g[n].norm()) for n in want_g)
        assert worst < 1e-4, (checkpointed, worst)
    model.get_base_model().gradient_checkpointing_disable()


@pytest.fixture(scope="module")
def base_float64(lora_smol):
    """The base model in float64 and today's path's log-probs of `lora_smol`'s sequences under it (both layouts')."""
    from pipeline.engines.models import load_causal_lm

    _, seqs = lora_smol
    lm = load_causal_lm(MODEL, dtype="float32", device="cpu").double().eval()
    with torch.no_grad():
        full = [_full_logprobs(lm, s) for s in seqs]
    return lm, full


@pytest.mark.parametrize("layout", ["split", "packed"])
def test_shared_prompt_forward_is_exact_in_float64(lora_smol, base_float64, layout):
    """The same sequences in float64: log-probs agree to 1e-10 (fp32 rounding is gone), so the shared pass computes
    today's maths; a wrong position, mask or prompt row would be off by far more than 1e-3."""
    _, seqs = lora_smol
    lm, full = base_float64
    with torch.no_grad():
        got = completion_logprobs(lm, pass_batch(seqs, 0, "cpu", layout))
        worst = max(float((got[b, : len(s.completion_ids)] - full[b]).abs().max()) for b, s in enumerate(seqs))
    assert worst < 1e-10, worst


def test_packed_rows_by_hand():
    """Two sequences of one prompt [1, 2] (completions [3, 4] and [5, 6, 7]) and one of prompt [9] (completion [8]):
    row 0 is [1, 2, 3, 5, 6] at positions [0, 1, 2, 2, 3]; the second completion restarts at position 2 and does
    not see the first; each completion's first token is predicted from the prompt's last position."""
    seqs = [TrainSequence("a", [1, 2], [3, 4], 1.0, None), TrainSequence("b", [1, 2], [5, 6, 7], -1.0, None),
            TrainSequence("c", [9], [8], 0.5, None)]
    b = collate_packed(seqs, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 6], [9, 0, 0, 0, 0]]
    assert b.position_ids[0].tolist() == [0, 1, 2, 2, 3] and b.position_ids[1, 0] == 0
    m = b.attention_mask[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert b.attention_mask[1, 0].int().tolist()[2] == [1, 0, 1, 0, 0]  # padding sees the prompt and itself: no NaN
    assert b.src.tolist() == [1, 2, 1, 3, 4, 5] and b.dst.tolist() == [0, 1, 3, 4, 5, 6]
    assert b.tgt.tolist() == [3, 4, 5, 6, 7, 8]
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]] and (b.slots, b.tokens) == (10, 6)


@pytest.fixture(scope="module")
def lora_tiny_tied(lora_smol):
    """A 2-layer random llama of SmolLM2's shape family with tied embeddings and the same LoRA: bf16 matrix products
    run ~45x slower than fp32 on CPUs without native bf16, so the bf16 test uses it instead of the 135M model (what
    it asserts, bit-for-bit equality, does not depend on the size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, seqs = lora_smol
    cfg = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               tie_word_embeddings=True)
    torch.manual_seed(0)
    return _with_random_lora(AutoModelForCausalLM.from_config(cfg)).train(), seqs


def test_frozen_bf16_weights_change_nothing_under_the_autocast(lora_tiny_tied):
    """Under the bf16 autocast, the policy with its frozen linear weights stored in bf16 gives the same log-probs and
    the same LoRA gradients, bit for bit, as with them in fp32 (autocast rounds them to bf16 at each call anyway);
    the tied embeddings / LM head and the trainable LoRA weights stay fp32."""
    import copy

    model, seqs = lora_tiny_tied
    batch = collate(seqs, pad_id=0)

    def run(m):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = completion_logprobs(m, batch)
        (lp * batch.completion_mask).sum().backward()
        return lp.detach(), _grads(m)

    ref_lp, ref_g = run(model)
    low = copy.deepcopy(model)
    # the 7 linear layers of each of the 2 decoder layers (q, k, v, down through their LoRA base layer); not the
    # tied head
    assert frozen_linears_bf16(low) == 2 * 7
    layer = low.get_base_model().model.layers[0]
    assert layer.self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert layer.mlp.up_proj.weight.dtype == torch.bfloat16
    assert layer.self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    assert low.get_output_embeddings().weight.dtype == torch.float32
    got_lp, got_g = run(low)
    assert torch.equal(got_lp, ref_lp)
    assert ref_g.keys() == got_g.keys() and len(ref_g) == 2 * 4 * 2
    for n in ref_g:
        assert torch.equal(got_g[n], ref_g[n]), n


def test_one_token_prompts_need_no_prompt_pass(tiny_model):
    """A prompt of one token has nothing to cache: the pass is the completion part alone, still exact."""
    from pipeline.engines.models import load_causal_lm

    lm = load_causal_lm(tiny_model, device="cpu").eval()
    seqs = [TrainSequence("a", [5], [6, 7, 8], 1.0, None), TrainSequence("b", [9], [10], 1.0, None)]
    batch = collate(seqs, pad_id=0)
    assert batch.prompt_ids.shape == (1, 0)
    with torch.no_grad():
        got = completion_logprobs(lm, batch)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(got[b, : len(s.completion_ids)], _full_logprobs(lm, s), rtol=0, atol=1e-5)


class _Tc:
    """The training fields the objectives read."""

    beta, clip_eps, kl_mask, loss_norm = 0.1, 0.2, True, "sequence"
    off_policy, luffy_gamma = "is_clip", 0.1  # logged rows' rule (none here)


def test_a_sequence_in_two_groups_carries_both_loss_terms_by_hand():
    """x is in g1 (A = 1) and g2 (A = -0.5), y in g2 (A = 0.5); at ρ = 1 without a reference the step loss is
    -(1 - 0.5 + 0.5)/3 = -1/3, and its gradient per token of x is -(1 - 0.5)/(3·T_x) = -1/12 (T_x = 2), of y
    -0.5/(3·T_y) = -1/24 (T_y = 4): x's two rows add up on its one computed sequence."""
    seqs = [TrainSequence("x", [1, 2], [3, 4], 1.0, None, group_id="g1"),
            TrainSequence("x", [1, 2], [3, 4], -0.5, None, group_id="g2"),
            TrainSequence("y", [1, 2], [5, 6, 7, 8], 0.5, None, group_id="g2")]
    shapes = row_shapes(seqs)
    (chunk,) = pack(step_units([0, 1, 2], shapes), shapes, budget=100)
    assert chunk.rows == [2, 0, 1] and chunk.uniq == [2, 0] and chunk.take == [0, 1, 1]  # y (longer) first, then x
    batch = collate([seqs[i] for i in chunk.uniq], pad_id=0)
    logp = torch.tensor([[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.7, 0.0, 0.0]], requires_grad=True)
    old = {"y": logp[0].detach(), "x": logp[1, :2].detach()}
    terms = get_objective("iogrpo_mkl").fn(pass_loss_input(seqs, chunk, logp, batch, _Tc, old, None, None, "cpu"),
                                           _Tc)
    assert float(terms.loss) == pytest.approx(-1 / 3, abs=1e-7)
    terms.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 24] * 4, [-1 / 12, -1 / 12, 0, 0]]),
                               rtol=0, atol=1e-7)


def test_one_pass_per_sequence_equals_one_row_each_on_a_real_batch(lora_smol):
    """A step of 6 rows over 4 sequences (two in two groups each), ratios off 1 and a reference: the loss and the
    LoRA gradients of one pass per sequence equal those of one forward per row (today's layout) within float
    summation (measured: 1e-7 relative)."""
    model, pool = lora_smol
    rows = [(0, 1.0, "g1"), (1, -1.0, "g1"), (0, 0.5, "g2"), (2, -0.5, "g2"), (1, 0.7, "g3"), (3, -0.7, "g3")]
    seqs = [TrainSequence(pool[i].gen_id, pool[i].prompt_ids, pool[i].completion_ids, a, None, group_id=g)
            for i, a, g in rows]
    rng = torch.Generator().manual_seed(3)
    with torch.no_grad():  # π_old and the reference: the model's log-probs moved, so ρ ≠ 1 and k3 > 0
        base = {s.gen_id: _full_logprobs(model, s) for s in seqs}
    old = {g: v + 0.1 * torch.randn(v.shape, generator=rng) for g, v in base.items()}
    ref = {g: v + 0.1 * torch.randn(v.shape, generator=rng) for g, v in base.items()}
    obj = get_objective("iogrpo_mkl")
    results = []
    for dedupe in (True, False):
        shapes = row_shapes(seqs)
        units = step_units(range(6), shapes) if dedupe else [[r] for r in range(6)]
        (chunk,) = pack(units, shapes, budget=10_000)
        if not dedupe:  # one computed sequence per row, as without sharing
            chunk.uniq, chunk.take = list(chunk.rows), list(range(6))
        model.zero_grad()
        batch = collate([seqs[i] for i in chunk.uniq], pad_id=0)
        terms = obj.fn(pass_loss_input(seqs, chunk, completion_logprobs(model, batch), batch, _Tc, old, ref, None,
                                       "cpu"), _Tc)
        terms.loss.backward()
        results.append((len(chunk.uniq), float(terms.loss), float(terms.clip_frac), _grads(model)))
    (n1, l1, c1, g1), (n2, l2, c2, g2) = results
    assert (n1, n2) == (4, 6)
    assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-7) and c1 == c2
    assert max(float((g1[n] - g2[n]).norm() / g2[n].norm()) for n in g2) < 1e-5


def test_train_metrics_report_the_padding_share(tmp_path, tiny_model):
    """Three workflows under one prompt [1, 2, 3], completions of 2, 4 and 3 tokens, scores 0, 1, 0: curation keeps
    one group {w0, w1}. Its step is one pass of 2 prompt positions (the last prompt token goes with the
    completions) + 2 x 4 completion positions = 10, of which 2 + 2 + 4 = 8 real: padding share 1/5. Before, each
    member computed its own prompt: 2 x 7 positions, 12 real. The step's tokens are the rows' completion tokens, 6."""
    from test_curate import _ctx, _score

    from pipeline.stages.curate import run_curate
    from pipeline.stages.train import run_train

    ctx = _ctx(tmp_path, [f"generator.model={tiny_model}"])
    gens = [{"gen_id": f"w{i}", "query_id": "q", "slot": i, "kind": "workflow", "parent_id": None, "valid": True,
             "prompt_token_ids": [1, 2, 3], "token_ids": list(range(10, 10 + n))} for i, n in enumerate((2, 4, 3))]
    ctx.store.write("generations", gens, ctx.run_id, 0)
    ctx.store.write("scores", [_score(f"w{i}", score=float(i % 2)) for i in range(3)], ctx.run_id, 0)
    run_curate(ctx)
    assert ctx.store.read("groups", ctx.run_id, 0).filter(kind="group")["members"].to_list() == [["w0", "w1"]]
    run_train(ctx)
    m = ctx.store.read("train_metrics", ctx.run_id, 0)
    assert m.height == 1 and m["tokens"][0] == 6
    assert m["padding_share"][0] == pytest.approx(1 / 5, abs=1e-12)
    assert np.isfinite(m["loss"][0])
