"""Prompts that differ but open alike (a template's fixed text, then the query) share their common prefix: a pass
computes it once, forward and backward (training.shared_prefix_min; pipeline.core.packing.shared_prefix). Against
today's path, one full forward per sequence, on a tiny random model with a random LoRA: the log-probs and the LoRA
gradients agree in both layouts, with and without gradient checkpointing."""

import pytest
import torch

from pipeline.core.packing import RowShape, common_prefix, pack, pass_slots, shared_prefix
from pipeline.stages.train.batch import collate, collate_packed, pass_batch
from pipeline.stages.train.data import TrainSequence
from pipeline.stages.train.logprobs import completion_logprobs

PREFIX = [5, 9, 14, 3, 22, 7, 31, 8, 17, 26, 4, 11]  # the template's fixed opening: 12 tokens
TAIL = [40, 41, 42]  # the instructions after the query


def _seqs() -> list[TrainSequence]:
    """Three queries of 2, 5 and 1 tokens after PREFIX, then TAIL; query 0 has two completions. The prompts minus
    their last token share exactly PREFIX (the queries' first tokens differ)."""
    queries = [[50, 51], [52, 53, 54, 55, 56], [57]]
    comps = [[60, 61, 62, 63], [33, 34], [35, 36, 37, 38, 39, 44], [45, 46, 47]]
    which = [0, 0, 1, 2]
    return [TrainSequence(f"s{i}", PREFIX + queries[q] + TAIL, comps[i], 1.0, None) for i, q in enumerate(which)]


def _full_logprobs(model, s: TrainSequence) -> torch.Tensor:
    """Today's path: one forward over prompt + completion, log_softmax of the full logits."""
    logits = model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0]
    lp = torch.log_softmax(logits, -1)
    p = len(s.prompt_ids)
    return torch.stack([lp[p - 1 + j, t] for j, t in enumerate(s.completion_ids)])


@pytest.fixture(scope="module")
def tiny_lora():
    """A 2-layer random qwen2 (grouped-query attention: 4 heads, 2 key/value heads) with a LoRA on q, k, v and down
    whose B is random (a fresh B is zero: outputs and A's grads would not move)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=True, use_sliding_window=False)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                      target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.train()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _weights(seqs) -> list[torch.Tensor]:
    return [torch.randn(len(s.completion_ids), generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            for i, s in enumerate(seqs)]


@pytest.mark.parametrize("layout", ["split", "packed"])
def test_shared_prefix_equals_one_forward_per_sequence_in_float64(tiny_lora, layout):
    """In float64 the log-probs agree to 1e-10 and every LoRA gradient to 1e-6 relative, with and without gradient
    checkpointing; a wrong position, mask or prefix row moves them by far more (a prefix whose keys and values were
    detached would lose the completions' pull on it: 0.3 relative on SmolLM2, tests/test_shared_prompt.py). The
    gradient bound is not 1e-10 because HF's RMSNorm computes in fp32 whatever the model's dtype, and its backward
    rounds the incoming gradient to fp32: any two layouts of the same sums differ by ~1e-7 relative there (today's
    split and packed layouts against each other: 8e-8 measured). The prefix is embedded once: the decoder embeds
    12 (prefix) + 3 prompts x 7 (the longest rest: query 1 and TAIL minus its last token, 5 + 2) + 4 sequences x 6
    (the longest completion) = 57 positions in the split layout; 12 + (2+3) + 3 + 1 + (5+3) + 5 + (1+3) + 2 = 40
    in the packed row (the prefix, then each prompt's rest followed by its completions minus their last token),
    where whole prompts would hold the 12 prefix tokens 3 times."""
    import copy

    model = copy.deepcopy(tiny_lora).double()
    seqs, w = _seqs(), _weights(_seqs())
    model.zero_grad()
    want = [_full_logprobs(model, s) for s in seqs]
    sum((lp * wi).sum() for lp, wi in zip(want, w, strict=True)).backward()
    want_g = _grads(model)
    assert len(want_g) == 2 * 4 * 2  # A and B of 4 modules x 2 layers
    batch = pass_batch(seqs, 0, "cpu", layout, min_prefix=8)
    if layout == "split":
        assert batch.prefix_ids.tolist() == [PREFIX] and batch.prompt_ids.shape == (3, 7)
    else:
        assert batch.input_ids.shape == (1, 40)
    embedded = []
    hook = model.get_input_embeddings().register_forward_hook(lambda mod, args, out: embedded.append(args[0].numel()))
    try:
        for checkpointed in (False, True):
            if checkpointed:
                model.get_base_model().gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            model.zero_grad()
            embedded.clear()
            got = completion_logprobs(model, batch)
            assert sum(embedded) == (57 if layout == "split" else 40)
            sum((got[b, : len(s.completion_ids)] * w[b]).sum() for b, s in enumerate(seqs)).backward()
            worst = max(float((got[b, : len(s.completion_ids)] - want[b]).abs().max().detach())
                        for b, s in enumerate(seqs))
            assert worst < 1e-10, (checkpointed, worst)
            assert all(torch.all(got[b, len(s.completion_ids):] == 0) for b, s in enumerate(seqs))
            got_g = _grads(model)
            assert got_g.keys() == want_g.keys()
            rel = max(float((got_g[n] - want_g[n]).norm() / want_g[n].norm()) for n in want_g)
            assert rel < 1e-6, (checkpointed, rel)
    finally:
        hook.remove()
        model.get_base_model().gradient_checkpointing_disable()


@pytest.mark.parametrize("layout", ["split", "packed"])
def test_shared_prefix_in_float32_matches_whole_prompts(tiny_lora, layout):
    """fp32, the trainer's precision: the prefix-shared pass and the whole-prompt pass (min_prefix 0, today's
    layout) give log-probs within 1e-5 and LoRA gradients within 1e-4 relative (the float64 test above shows the
    maths is the same; what is left is fp32 rounding in another order, ~1e-7 here)."""
    seqs, w = _seqs(), _weights(_seqs())
    results = []
    for min_prefix in (0, 8):
        tiny_lora.zero_grad()
        got = completion_logprobs(tiny_lora, pass_batch(seqs, 0, "cpu", layout, min_prefix))
        sum((got[b, : len(s.completion_ids)] * w[b].float()).sum() for b, s in enumerate(seqs)).backward()
        results.append((got.detach(), _grads(tiny_lora)))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    assert max(float((g1[n] - g0[n]).norm() / g0[n].norm()) for n in g0) < 1e-4


def test_common_prefix_by_hand():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix([[1, 2], [1, 2]]) == 2 and common_prefix([[7], [8]]) == 0 and common_prefix([]) == 0
    assert common_prefix([[1, 2, 3]]) == 3
    # shared only from min_prefix tokens, with two prompts or more, and never when switched off (0)
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5]], 3) == 3
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5]], 4) == 0
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5]], 0) == 0
    assert shared_prefix([[1, 2, 3, 4]], 1) == 0


def test_split_batch_by_hand():
    """Prompts [1, 2, 3, 4, 5] (two completions) and [1, 2, 3, 6, 7, 8]: minus their last token they share [1, 2, 3];
    the prompt rows hold the rest, [4] and [6, 7] (right-padded), the completions start at each prompt's last token
    and position. Below min_prefix, or with min_prefix 0, the prompts stay whole (today's layout)."""
    seqs = [TrainSequence("a", [1, 2, 3, 4, 5], [10, 11], 1.0, None),
            TrainSequence("b", [1, 2, 3, 4, 5], [12], -1.0, None),
            TrainSequence("c", [1, 2, 3, 6, 7, 8], [13, 14, 15], 0.5, None)]
    b = collate(seqs, pad_id=0, min_prefix=3)
    assert b.prefix_ids.tolist() == [[1, 2, 3]]
    assert b.prompt_ids.tolist() == [[4, 0], [6, 7]] and b.prompt_mask.tolist() == [[1, 0], [1, 1]]
    assert b.prompt_of.tolist() == [0, 0, 1]
    assert b.input_ids.tolist() == [[5, 10, 0], [5, 0, 0], [8, 13, 14]]
    assert b.position_ids.tolist() == [[4, 5, 6], [4, 5, 6], [5, 6, 7]]
    # per sequence: the prefix (3), then its prompt's row
    assert b.context_mask().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # 3 prefix + 2 x 2 prompt rows + 3 x 3 completions = 16 slots; 3 + 3 + (2 + 1 + 3) = 12 real
    assert (b.slots, b.tokens) == (16, 12)
    for off in (collate(seqs, pad_id=0, min_prefix=4), collate(seqs, pad_id=0)):
        assert off.prefix_ids is None and off.prompt_ids.tolist() == [[1, 2, 3, 4, 0], [1, 2, 3, 6, 7]]


def test_packed_row_by_hand():
    """The same three sequences packed: one row [1, 2, 3 | 4, 5 | 10 | (12 has no input) | 6, 7, 8 | 13, 14]. The
    rest of prompt 2 restarts at position 3 and does not see prompt 1's rest or completions; each completion sees
    the prefix, its prompt's rest and its own earlier tokens; each first token is predicted from its prompt's last
    token (index 4 of the row for prompt 1, 8 for prompt 2)."""
    seqs = [TrainSequence("a", [1, 2, 3, 4, 5], [10, 11], 1.0, None),
            TrainSequence("b", [1, 2, 3, 4, 5], [12], -1.0, None),
            TrainSequence("c", [1, 2, 3, 6, 7, 8], [13, 14, 15], 0.5, None)]
    b = collate_packed(seqs, pad_id=0, min_prefix=3)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 10, 6, 7, 8, 13, 14]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
    m = b.attention_mask[0, 0].int().tolist()
    assert m[5] == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # a's completion token: prefix, rest [4, 5], itself
    assert m[6] == [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]  # prompt 2's rest starts: the prefix and itself
    assert m[10] == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]  # c's second input: prefix, rest [6, 7, 8], 13, itself
    assert b.src.tolist() == [4, 5, 4, 8, 9, 10] and b.dst.tolist() == [0, 1, 3, 6, 7, 8]
    assert b.tgt.tolist() == [10, 11, 12, 13, 14, 15] and (b.slots, b.tokens) == (11, 11)
    assert collate_packed(seqs, pad_id=0, min_prefix=4).input_ids.shape[0] == 2  # below the minimum: a row a prompt


def test_pass_slots_count_the_shared_prefix_once():
    """Prompts (minus their last token) [1..10] and [1..8, 20, 21, 22] share 8 tokens: a pass over one sequence of
    each, completions 3 and 5, computes 8 + 2 x (11 - 8) + 2 x 5 = 24 positions, against 2 x 11 + 2 x 5 = 32 with
    each prompt whole; a budget of 24 then takes both units in one pass, and only with the prefix shared."""
    shapes = [RowShape("a", "g1", tuple(range(1, 11)), 3), RowShape("b", "g2", (*range(1, 9), 20, 21, 22), 5)]
    assert pass_slots([0, 1], shapes, min_prefix=8) == 24
    assert pass_slots([0, 1], shapes, min_prefix=9) == 32 and pass_slots([0, 1], shapes) == 32
    assert [p.rows for p in pack([[0], [1]], shapes, budget=24, min_prefix=8)] == [[1, 0]]
    assert [p.rows for p in pack([[0], [1]], shapes, budget=24)] == [[1], [0]]


def test_validate_measures_the_sharing_a_template_allows(tmp_path, smol_tokenizer):
    """The shipped workflow template puts the query last: two queries' prompts share everything up to the query
    (the system turn, the contract, the example, "Task:\\n"). A prompt folder whose template opens with the query
    shares only the system turn and "Task:\\n", and `query_first` says so. Expected prefixes are counted by tokenizing
    the rendered text up to the query (the queries differ from their first token on)."""
    from pipeline.config import RunConfig
    from pipeline.engines.benchmarks.base import Item
    from pipeline.engines.prompting import render, workflow_prompt
    from pipeline.stages.sampling import prompt_sharing

    items = [Item("a", "Alpha plus two?", {}), Item("b", "Beta times three, then four?", {})]
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "workflow.txt").write_text("Task:\n$problem\n\n$contract\n\nExample workflow:\n$example\nWrite it.\n")
    for prompt_dir in (None, str(folder)):
        cfg = RunConfig.model_validate({"rollout": {"prompt_dir": prompt_dir}})
        sharing = prompt_sharing(cfg, items, "math", smol_tokenizer)
        full = [smol_tokenizer(render(smol_tokenizer, workflow_prompt(it.prompt, "math", prompt_dir=prompt_dir),
                                      None, prompt_dir) + cfg.rollout.workflow_prefix,
                               add_special_tokens=False)["input_ids"] for it in items]
        text = render(smol_tokenizer, workflow_prompt("Alpha plus two?", "math", prompt_dir=prompt_dir), None,
                      prompt_dir)
        before_query = smol_tokenizer(text[: text.index("Alpha")], add_special_tokens=False)["input_ids"]
        assert sharing.prompts == 2 and sharing.common == len(before_query)
        assert sharing.mean == (len(full[0]) + len(full[1])) / 2
        if prompt_dir is None:
            assert sharing.share > 0.8 and not sharing.query_first(32)
        else:
            assert sharing.share < 0.3 and sharing.query_first(32)
