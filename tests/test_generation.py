"""Generation backends: the transformers backend against raw `model.generate`, logprobs, adapters, bad input."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from pipeline.config import GeneratorConfig
from pipeline.engines.generation import GenerationError, Sampling, adapter_id, make_generator
from pipeline.engines.models import load_causal_lm, save_adapter

MODEL = "embedded:smollm2-135m-instruct"
QUESTIONS = ["Say hi.", "Write a Python function that adds two numbers and explain it briefly."]


def make_adapter(path, seed: int = 0, scale: float = 0.05) -> str:
    """A fresh LoRA adapter on the embedded model with random B weights (so it changes outputs), saved as the train
    stage saves one (its base named `embedded:...`): what the vLLM tests load through `--lora-modules` too."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_causal_lm(MODEL, device="cpu"),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, scale)
    save_adapter(model, path, MODEL)
    return str(path)


def chat_prompts(tok, questions=QUESTIONS) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def teacher_forced(model, prompt_ids, token_ids, temperature=1.0) -> list[float]:
    """log_softmax(logits / T) of `token_ids` given the prompt, by one forward pass."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids)[:, None]).squeeze(1).tolist()


@pytest.fixture
def hf(hf_generator):
    return hf_generator  # the session's one transformers generator (conftest)


@pytest.mark.slow
def test_same_tokens_as_raw_generate(hf):
    prompts = chat_prompts(hf.tokenizer)  # different lengths: left padding is exercised
    sampling = Sampling(n=2, temperature=0.7, top_p=0.9, max_new_tokens=24, seed=11)
    got = hf.generate(prompts, sampling)
    enc = hf.encode(prompts)
    torch.manual_seed(11)
    raw = hf.model.generate(**enc, do_sample=True, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=24,
                            num_return_sequences=2, pad_token_id=hf.tokenizer.pad_token_id)
    width = enc["input_ids"].shape[1]
    eos, pad = hf.tokenizer.eos_token_id, hf.tokenizer.pad_token_id
    for i, row in enumerate(got):
        assert len(row) == 2
        for j, c in enumerate(row):
            k = len(c.token_ids)
            # the whole raw continuation: these tokens, then only padding (nothing cut off, nothing added)
            assert c.token_ids == raw[2 * i + j, width : width + k].tolist()
            assert set(raw[2 * i + j, width + k :].tolist()) <= {pad}
            assert c.prompt_token_ids == hf.tokenizer(prompts[i], add_special_tokens=False).input_ids
            assert len(c.token_logprobs) == k
            # "stop" ends on eos; "length" is max_new_tokens without one
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos
            else:
                assert c.finish_reason == "length" and k == 24 and eos not in c.token_ids
            assert c.text == hf.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert got[0][0].token_ids != got[0][1].token_ids  # n samples are distinct draws


def test_prompts_prefilled_once_for_n_samples_keep_logprobs(hf):
    """n > 1 prefills each prompt once and repeats its KV cache (left padding included): the recorded logprobs
    are still those of a full forward pass over prompt + completion."""
    prompts = chat_prompts(hf.tokenizer)
    rows = hf.generate(prompts, Sampling(n=3, temperature=1.0, max_new_tokens=12, seed=4))
    for row in (rows[0], rows[-1]):
        for c in row:
            assert c.token_logprobs == pytest.approx(teacher_forced(hf.model, c.prompt_token_ids, c.token_ids),
                                                     abs=1e-4)


@pytest.mark.slow
def test_logprobs_are_the_sampling_distribution(hf):
    prompts = chat_prompts(hf.tokenizer, QUESTIONS[1:])
    for temperature in (0.8, 1.0):
        c = hf.generate(prompts, Sampling(n=1, temperature=temperature, max_new_tokens=16, seed=3))[0][0]
        ref = teacher_forced(hf.model, c.prompt_token_ids, c.token_ids, temperature)
        assert c.token_logprobs == pytest.approx(ref, abs=1e-4)
    greedy = hf.generate(prompts, Sampling(n=2, temperature=0.0, max_new_tokens=16))[0]
    assert greedy[0].token_ids == greedy[1].token_ids
    assert greedy[0].token_logprobs == pytest.approx(
        teacher_forced(hf.model, greedy[0].prompt_token_ids, greedy[0].token_ids), abs=1e-4)
    # top-p renormalises over the nucleus: each logprob is >= the plain tempered one
    c = hf.generate(prompts, Sampling(n=1, temperature=1.0, top_p=0.5, max_new_tokens=16, seed=5))[0][0]
    plain = teacher_forced(hf.model, c.prompt_token_ids, c.token_ids)
    assert all(a >= b - 1e-5 for a, b in zip(c.token_logprobs, plain, strict=True))
    assert any(a > b + 1e-3 for a, b in zip(c.token_logprobs, plain, strict=True))


@pytest.mark.slow
def test_adapter_changes_outputs_and_matches_peft(hf, tmp_path):
    from peft import PeftModel

    adapter = make_adapter(tmp_path / "lora")
    prompts = chat_prompts(hf.tokenizer, QUESTIONS[1:])
    greedy = Sampling(n=1, temperature=0.0, max_new_tokens=20)
    base = hf.generate(prompts, greedy)[0][0]
    tuned = hf.generate(prompts, greedy, adapter=adapter)[0][0]
    assert tuned.token_ids != base.token_ids
    peft = PeftModel.from_pretrained(load_causal_lm(MODEL, device="cpu"), adapter).eval()
    assert tuned.token_logprobs == pytest.approx(teacher_forced(peft, tuned.prompt_token_ids, tuned.token_ids),
                                                 abs=1e-4)
    assert hf.generate(prompts, greedy)[0][0].token_ids == base.token_ids  # back to the base weights


def test_a_saved_adapter_names_its_base_as_the_config_does(tmp_path, tiny_model):
    """Not the cache folder the embedded id resolved to on this machine (which exists nowhere else); a local model
    folder is named as resolved, as peft names it."""
    import json

    from peft import LoraConfig, get_peft_model

    for ref, want in ((MODEL, MODEL), (tiny_model, str(Path(tiny_model).resolve()))):
        model = get_peft_model(load_causal_lm(ref, device="cpu"), LoraConfig(r=2, target_modules=["q_proj"]))
        save_adapter(model, tmp_path / "a", ref)
        assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base_model_name_or_path"] == want


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(GenerationError, match="unknown generation backend 'tgi'"):
        make_generator(GeneratorConfig().model_copy(update={"backend": "tgi"}))
    with pytest.raises(GenerationError, match="not a LoRA adapter folder"):
        adapter_id(str(tmp_path / "missing"))
    with pytest.raises(GenerationError, match="n and max_new_tokens"):
        Sampling(n=0)
    with pytest.raises(GenerationError, match="top_p"):
        Sampling(top_p=0)


def test_server_down_is_a_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = GeneratorConfig(backend="openai", base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(GenerationError, match="not reachable"):
        make_generator(cfg)


def test_openai_backend_retokenizes_for_other_servers(smol_tokenizer):
    """Against a non-vLLM server the completion is re-tokenized and flagged (a fake server, logic only)."""
    from types import SimpleNamespace

    from pipeline.engines.generation.openai_server import OpenAIGenerator

    gen = OpenAIGenerator.__new__(OpenAIGenerator)
    gen.tokenizer, gen.is_vllm = smol_tokenizer, False
    choice = SimpleNamespace(text="Hello there", finish_reason="stop", model_extra={},
                             logprobs=SimpleNamespace(token_logprobs=[-0.5, -0.25]))
    c = gen._completion([1, 2], choice)
    assert c.retokenized and c.token_ids == gen.tokenizer("Hello there").input_ids + [gen.tokenizer.eos_token_id]
    assert c.token_logprobs is None  # 2 server logprobs for 3 tokens: not aligned, not kept
    vllm_choice = SimpleNamespace(text="Hi", finish_reason="length", token_ids=[5, 6],
                                  logprobs=SimpleNamespace(token_logprobs=[-0.5, -0.25]))
    gen.is_vllm = True
    c = gen._completion([1, 2], vllm_choice)
    assert not c.retokenized and c.token_ids == [5, 6] and c.token_logprobs == [-0.5, -0.25]
    assert c.finish_reason == "length"


def test_stop_length_keeps_the_shortest_prefix_holding_a_stop():
    from pipeline.engines.generation.base import stop_length, stop_text

    pieces = {1: "x = 1", 2: "\n", 3: "``", 4: "`\n", 5: "Explanation", 6: "```\n"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    # the text "x = 1\n```\nExplanation```\n" first holds "\n```\n" after token 4 (of 6)
    assert stop_length([1, 2, 3, 4, 5, 6], decode, ("\n```\n",)) == 4
    assert stop_length([1, 2, 3, 4, 5, 6], decode, ("Expl", "\n``")) == 3  # the earliest of several
    assert stop_length([1, 5, 6], decode, ("\n```\n",)) is None  # "```\n" without the newline before it
    assert stop_length([1, 2, 3, 4], decode, ()) is None
    assert stop_text("x = 1\n```\nExplanation", ("\n```\n",)) == "x = 1\n```\n"
    assert stop_text("add two", ("d t", "dd")) == "add"  # the stop that ends first, as vLLM checks as it decodes
    assert stop_text("no stop here", ("```",)) == "no stop here"


def test_a_workflow_cut_at_its_block_end_extracts_the_same_code():
    """The stop ends a sample after its block; every shape extract_code reads gives the same workflow from the cut."""
    from pipeline.engines.generation.base import BLOCK_END
    from pipeline.engines.workflow import extract_code

    code = "async def solve(problem):\n    return problem\n"
    texts = [f"Sure!\n```python\n{code}```\n\nThis workflow returns the problem.\n```python\nprint(1)\n```\n",
             f"{code}```\nIt returns the problem.",  # written into an assistant turn opened with ```python
             f"```python\n{code}```\n"]
    for text in texts:
        cut = text[: text.index(BLOCK_END) + len(BLOCK_END)]
        assert extract_code(cut) == extract_code(text) == code.strip("\n")


@pytest.mark.slow
def test_transformers_backend_ends_a_sample_at_its_stop(hf):
    """Greedy with a stop string = greedy without it, cut after the first token that completes the stop."""
    prompts = chat_prompts(hf.tokenizer, QUESTIONS[1:])
    free = hf.generate(prompts, Sampling(n=1, temperature=0.0, max_new_tokens=40))[0][0]
    assert free.finish_reason == "length"
    stop = free.text[12:16]  # written mid-way: the sample must end there
    cut = hf.generate(prompts, Sampling(n=1, temperature=0.0, max_new_tokens=40, stop=(stop,)))[0][0]
    k = next(k for k in range(1, len(free.token_ids) + 1) if stop in hf.tokenizer.decode(free.token_ids[:k]))
    assert k < len(free.token_ids)
    assert cut.token_ids == free.token_ids[:k] and cut.finish_reason == "stop"
    # the text ends with the stop, as vLLM's does, even where the token that completed it runs on
    assert cut.text.endswith(stop) and stop not in cut.text[:-1]
    assert hf.tokenizer.decode(free.token_ids[:k]).startswith(cut.text)
    assert cut.token_logprobs == pytest.approx(free.token_logprobs[:k], abs=1e-6)


def test_openai_backend_sends_a_stop_only_to_vllm(smol_tokenizer):
    """vLLM keeps the stop string in the text and gives the token ids; another server would not (logic only)."""
    from pipeline.engines.generation.openai_server import OpenAIGenerator

    gen = OpenAIGenerator.__new__(OpenAIGenerator)
    gen.tokenizer = smol_tokenizer
    s = Sampling(n=2, temperature=1.0, max_new_tokens=8, seed=3, stop=("\n```\n",))
    gen.is_vllm = True
    _, kw = gen.request("m", "Hi", s, 1)
    assert kw["stop"] == ["\n```\n"] and kw["extra_body"]["include_stop_str_in_output"] is True
    assert kw["seed"] == 5
    gen.is_vllm = False
    _, kw = gen.request("m", "Hi", s, 1)
    assert "stop" not in kw
