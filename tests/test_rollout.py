"""The rollout stage: rows, idempotent resume, two-level order, exemplars from earlier rounds, bad input."""

from __future__ import annotations

import copy
import json
import math
import socket
import zlib
from pathlib import Path

import polars as pl
import pytest
import torch

import pipeline.stages.rollout as rollout
from pipeline.config import config_from_dict
from pipeline.engines.benchmarks.base import Benchmark, Item, MetricResult
from pipeline.engines.generation import Completion, GenerationError, Generator, Sampling
from pipeline.engines.prompting import PromptError
from pipeline.run import RunContext
from pipeline.stages import STAGES
from pipeline.stages.rollout import RolloutError, run_rollout
from pipeline.stages.sampling import gen_id
from pipeline.stages.train.data import label_logprob
from pipeline.store import Store

WORKFLOW = ("```python\nasync def solve(problem):\n    return (await llm([{'role': 'user', 'content': problem}]))[0]\n"
            "```\n")


class TinyBench(Benchmark):
    name, family = "tiny", "math"

    def load(self) -> list[Item]:
        return [Item(f"q{i}", f"What is {i} + {i}?", {"answer": str(2 * i)}, {"level": i}) for i in range(3)]

    def items(self, split=None) -> list[Item]:
        return self.load()[: self.cfg.max_queries or 3]

    def score(self, item, answer) -> MetricResult:
        return MetricResult(float(answer == item.reference["answer"]))


class FakeGen(Generator):
    """Deterministic completions; `fail_after` calls raise to simulate a crash mid-rollout."""

    backend = "fake"

    def __init__(self, fail_after: int | None = None):
        self.calls: list[tuple[list[str], Sampling, str | None]] = []
        self.fail_after = fail_after

    def _generate(self, prompts, sampling, adapter):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("crash")
        self.calls.append((prompts, sampling, adapter))
        out = []
        for p in prompts:
            plan = "Plan to follow" not in p and "short plan" in p
            text = "ask a solver, then a verifier" if plan else ("not code" if "1 + 1" in p else WORKFLOW)
            out.append([Completion(text, [1, 2], [7, 8, 2], [-0.5, -0.25, -0.125], "stop") for _ in range(sampling.n)])
        return out


def make_ctx(tmp_path, round=0, **sections) -> RunContext:
    data = {"run_id": "t", "store": {"root": str(tmp_path)}, "benchmark": {"max_queries": 2},
            "generator": {"batch_size": 2}, "rollout": {"m": 3}}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    cfg = config_from_dict(data)
    return RunContext(cfg, Store(tmp_path), "t", round, cfg.config_hash())


@pytest.fixture
def fake(monkeypatch):
    gens: list[FakeGen] = []

    def factory(fail_after=None):
        def make(cfg, enable_lora=False, **_):
            g = FakeGen(fail_after)
            g.enable_lora = enable_lora
            gens.append(g)
            return g
        monkeypatch.setattr(rollout, "make_generator", make)
        return gens

    monkeypatch.setattr(rollout, "load_benchmark", lambda cfg: TinyBench(cfg))
    return factory


def test_flat_rows_and_queries(tmp_path, fake):
    gens = fake()
    ctx = make_ctx(tmp_path)
    counts = run_rollout(ctx)
    assert counts == dict(queries=2, generations=6, agents=0, workflows=6, valid=3, sampled_now=6)
    df = ctx.store.read("generations", "t", 0).sort("gen_id")
    assert df["gen_id"].to_list() == [f"r0-q{q}-w{s}" for q in range(2) for s in range(3)]
    assert df["valid"].to_list() == [True] * 3 + [False] * 3  # q1's text is not code: kept, flagged
    assert df["invalid_reason"][3] == "no top-level `async def solve(problem)`"
    row = df.row(0, named=True)
    assert row["kind"] == "workflow" and row["parent_id"] is None and row["slot"] == 0 and row["round"] == 0
    assert row["token_ids"] == [7, 8, 2] and row["token_logprobs"] == [-0.5, -0.25, -0.125]
    assert row["prompt_token_ids"] == [1, 2] and row["valid"] and row["invalid_reason"] is None
    assert row["adapter_round"] is None and row["exemplar_ids"] == [] and row["finish_reason"] == "stop"
    assert "What is 0 + 0?" in row["prompt_text"] and row["prompt_text"].startswith("<|im_start|>system")
    # the batch seed hashes (generator.seed, "sampling", round, the batch's first gen_id): see derived_seed
    seed = zlib.crc32(b"0:sampling:0:r0-q0-w0") % 2**31
    assert json.loads(row["sampling"]) == {"adapter": None, "logprobs": "processed", "max_new_tokens": 512,
                                           "n": 3, "seed": seed, "temperature": 1.0, "top_p": 1.0,
                                           "stop": ["\n```\n"]}  # a workflow ends where its code block closes
    assert gens[0].calls[0][1].seed == seed  # the seed stored is the seed sampled with
    assert gens[0].calls[0][1].stop == ("\n```\n",)
    assert row["model"] == "embedded:smollm2-135m-instruct" and row["backend"] == "transformers"
    q = ctx.store.read("queries", "t", 0).sort("query_id")
    assert q["query_id"].to_list() == ["q0", "q1"] and q["split"].to_list() == ["validate"] * 2
    assert json.loads(q["reference"][1]) == {"answer": "2"} and json.loads(q["meta"][1]) == {"level": 1}
    assert q["benchmark"].to_list() == ["procedural"] * 2
    assert len(gens[0].calls) == 1 and gens[0].calls[0][1].n == 3  # 2 prompts per call, 3 samples each
    assert STAGES["rollout"].done(ctx)  # the runner skips it from now on (tests/test_flows.py)


def test_invalid_workflows_are_kept_and_flagged(tmp_path, fake, monkeypatch):
    fake()
    monkeypatch.setattr(FakeGen, "_generate", lambda self, prompts, s, a: [
        [Completion(t, [1], [3], [-1.0], "length") for t in ("def solve(p): pass", "")][: s.n] for _ in prompts])
    ctx = make_ctx(tmp_path, rollout={"m": 2})
    run_rollout(ctx)
    df = ctx.store.read("generations", "t", 0).sort("gen_id")
    assert df["valid"].to_list() == [False] * 4
    reasons = df["invalid_reason"].to_list()[:2]
    assert reasons == ["solve must be `async def`", "no top-level `async def solve(problem)`"]


def test_resume_after_crash_samples_only_missing(tmp_path, fake):
    gens = fake(fail_after=1)
    ctx = make_ctx(tmp_path, benchmark={"max_queries": 3}, generator={"batch_size": 1})
    with pytest.raises(RuntimeError, match="crash"):
        run_rollout(ctx)
    assert ctx.store.read("generations", "t", 0).height == 3  # the first call's part survived
    assert not ctx.done("rollout")
    fake()
    counts = run_rollout(ctx)
    assert counts["generations"] == 9 and counts["sampled_now"] == 6
    # one prompt per call (batch_size 1): q1's, then q2's; q0's finished part is not sampled again
    asked = [[f"What is {q} + {q}?" in p for q in range(3)] for prompts, _, _ in gens[1].calls for p in prompts]
    assert asked == [[False, True, False], [False, False, True]]
    df = ctx.store.read("generations", "t", 0)
    assert df["gen_id"].n_unique() == 9 and ctx.store.read("queries", "t", 0).height == 3


def test_two_level_agents_then_workflows_and_resume(tmp_path, fake):
    gens = fake(fail_after=2)
    ctx = make_ctx(tmp_path, rollout={"mode": "two_level", "n_agents": 2, "n_workflows": 2, "max_plan_tokens": 7},
                   benchmark={"max_queries": 2}, generator={"batch_size": 2})
    with pytest.raises(RuntimeError, match="crash"):
        run_rollout(ctx)  # call 1: the 2 queries' agents; call 2: workflows of q0's agents; then crash
    done = set(ctx.store.read("generations", "t", 0)["gen_id"].to_list())
    assert {"r0-q0-a0", "r0-q0-a1", "r0-q1-a0", "r0-q1-a1"} <= done and len(done) == 8
    assert gens[0].calls[0][1].max_new_tokens == 7  # plans use max_plan_tokens
    fake()
    counts = run_rollout(ctx)
    assert counts == dict(queries=2, generations=12, agents=4, workflows=8, valid=8, sampled_now=4)
    df = ctx.store.read("generations", "t", 0)
    wf = df.filter(df["kind"] == "workflow").sort("gen_id")
    assert wf["gen_id"].to_list()[:2] == ["r0-q0-a0-w0", "r0-q0-a0-w1"]
    assert wf["parent_id"].to_list()[:2] == ["r0-q0-a0"] * 2
    assert all("Plan to follow:\nask a solver, then a verifier" in p for p in wf["prompt_text"])
    assert gen_id(0, "q1", "workflow", 1, "r0-q1-a0") in set(wf["gen_id"])


def kind_is(kind: str):
    return pl.col("kind") == kind


def _round0_scores(ctx: RunContext) -> list[str]:
    """Scores spread over [0, 1] so the pool has F, M and S buckets; q1's workflows are invalid (not code), so
    they count 0 whatever their rows say (`generation_scores`) and q1's own pool has one bucket."""
    gids = sorted(ctx.store.read("generations", "t", 0).filter(kind_is("workflow"))["gen_id"].to_list())
    ctx.store.write("scores", [dict(gen_id=g, rep=0, attempt=0, status="ok", score=i / (len(gids) - 1))
                               for i, g in enumerate(gids)], "t", 0)
    return gids


def n_exemplars(query_id: str) -> int:
    return 1 if query_id == "q1" else 2  # q1's pool: all invalid, all 0, one bucket


def test_round1_exemplars_come_from_round0_scores(tmp_path, fake):
    gens = fake()
    ctx = make_ctx(tmp_path, rollout={"mode": "two_level", "n_agents": 2, "n_workflows": 2})
    run_rollout(ctx)
    gids = _round0_scores(ctx)
    ckpt = ctx.store.checkpoint_dir("t", 0)
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")  # the fake generator only needs the folder to exist
    ctx1 = ctx.at_round(1)
    run_rollout(ctx1)
    assert gens[-1].enable_lora and all(c[2] == str(ckpt.resolve()) for c in gens[-1].calls)
    df = ctx1.store.read("generations", "t", 1)
    assert set(df["adapter_round"].to_list()) == {0}
    agents, wfs = df.filter(kind_is("agent")), df.filter(kind_is("workflow"))
    r0_agents = set(ctx.store.read("generations", "t", 0).filter(kind_is("agent"))["gen_id"])
    for q, ids, prompt in zip(agents["query_id"], agents["exemplar_ids"], agents["prompt_text"], strict=True):
        assert len(ids) == n_exemplars(q) and set(ids) <= r0_agents and "Score " in prompt
    for q, ids in zip(wfs["query_id"], wfs["exemplar_ids"], strict=True):  # D_W of the agent shown to the plan
        assert len(ids) == n_exemplars(q) and set(ids) <= set(gids)


class NumberedPlans(FakeGen):
    """Every plan text is new ("plan 0", "plan 1", ...): a fresh plan never equals a stored one."""

    plans = 0

    def _generate(self, prompts, sampling, adapter):
        out = super()._generate(prompts, sampling, adapter)
        for comps in out:
            for c in comps:
                if c.text.startswith("ask a solver"):
                    c.text, NumberedPlans.plans = f"plan {NumberedPlans.plans}", NumberedPlans.plans + 1
        return out


def _two_level_rounds(tmp_path, fake, monkeypatch, **rollout_cfg) -> RunContext:
    """One query, 2 plans x 2 workflows with new plan texts each round; round 0 scored a0: [1, .5], a1: [0, .25];
    then round 1 rolled out from a stand-in checkpoint."""
    fake()
    monkeypatch.setattr(rollout, "make_generator", lambda cfg, enable_lora=False, **_: NumberedPlans())
    ctx = make_ctx(tmp_path, rollout={"mode": "two_level", "n_agents": 2, "n_workflows": 2, **rollout_cfg},
                   benchmark={"max_queries": 1})
    run_rollout(ctx)
    scores = {"r0-q0-a0-w0": 1.0, "r0-q0-a0-w1": 0.5, "r0-q0-a1-w0": 0.0, "r0-q0-a1-w1": 0.25}
    ctx.store.write("scores", [dict(gen_id=g, rep=0, attempt=0, status="ok", score=x) for g, x in scores.items()],
                    "t", 0)
    ckpt = ctx.store.checkpoint_dir("t", 0)
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")
    run_rollout(ctx.at_round(1))
    return ctx


def test_workflow_exemplars_come_from_the_buffer_of_the_conditioning_agent(tmp_path, fake, monkeypatch):
    """The proposal's D_W[i]: a round-1 plan was prompted with stored agents a0 (r = .75) and a1 (r = .125); its
    workflows see exemplars written under a0 only, shown with a0's plan. The query's pool would mix in a1's."""
    ctx = _two_level_rounds(tmp_path, fake, monkeypatch)
    r0, df = ctx.store.read("generations", "t", 0), ctx.store.read("generations", "t", 1)
    plans = {r["gen_id"]: r for r in df.filter(kind_is("agent")).iter_rows(named=True)}
    r0_plans = set(r0.filter(kind_is("agent"))["text"])
    assert len({p["text"] for p in plans.values()} | r0_plans) == 4  # round 1's plans are new texts
    a0_plan = r0.filter(pl.col("gen_id") == "r0-q0-a0")["text"][0]
    for p in plans.values():
        assert sorted(p["exemplar_ids"]) == ["r0-q0-a0", "r0-q0-a1"]  # r_i .75 (F) and .125 (S)
    for w in df.filter(kind_is("workflow")).iter_rows(named=True):
        # a0's buffer [1.0, .5] has two buckets (F, S): one exemplar from each, both a0's
        assert sorted(w["exemplar_ids"]) == ["r0-q0-a0-w0", "r0-q0-a0-w1"]
        assert f"Earlier workflows written under this plan:\n{a0_plan}\n" in w["prompt_text"]
        assert f"Plan to follow:\n{plans[w['parent_id']]['text']}" in w["prompt_text"]


def test_workflow_exemplars_respect_r_min_workflow(tmp_path, fake, monkeypatch):
    """D_W[i] holds r_ij >= r_min_workflow: with .6 a0 keeps only its 1.0 workflow and a1 none."""
    ctx = _two_level_rounds(tmp_path, fake, monkeypatch, r_min_workflow=0.6)
    wfs = ctx.store.read("generations", "t", 1).filter(kind_is("workflow"))
    assert [sorted(ids) for ids in wfs["exemplar_ids"]] == [["r0-q0-a0-w0"]] * 4


@pytest.mark.parametrize("case", ["adapter", "backend", "template", "server"])
def test_bad_input_writes_nothing(tmp_path, fake, monkeypatch, case, request):
    fake()
    if case == "adapter":
        ctx = make_ctx(tmp_path, round=1)
        err, match = RolloutError, r"adapter folder .*round=0/checkpoint is missing.*train round 0 first"
    elif case == "backend":
        ctx = make_ctx(tmp_path)
        ctx.cfg.generator.__dict__["backend"] = "tgi"  # past config validation, as a stale object could be
        err, match = RolloutError, "unknown generation backend 'tgi'"
    elif case == "template":
        tok = copy.deepcopy(request.getfixturevalue("smol_tokenizer"))  # the session's, copied: changed below
        tok.chat_template = None
        monkeypatch.setattr(rollout, "load_tokenizer", lambda ref: tok)
        ctx = make_ctx(tmp_path)
        err, match = PromptError, "no chat template"
    else:
        from pipeline.engines.generation import make_generator

        monkeypatch.setattr(rollout, "make_generator", make_generator)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = make_ctx(tmp_path, generator={"backend": "openai", "base_url": f"http://127.0.0.1:{port}/v1"})
        err, match = GenerationError, "not reachable"
    with pytest.raises(err, match=match):
        run_rollout(ctx)
    assert list(tmp_path.rglob("*.parquet")) == [] and not ctx.done("rollout")


@pytest.mark.slow
def test_real_transformers_rollout_round0_and_adapter_round1(tmp_path, monkeypatch, smol_tokenizer, smol_lm):
    """The embedded model end to end: flat round 0 with the base model, round 1 with round 0's adapter."""
    from test_generation import make_adapter, teacher_forced

    torch.set_num_threads(2)
    monkeypatch.setattr(rollout, "load_benchmark", lambda cfg: TinyBench(cfg))
    # no exemplars: round 1's prompts equal round 0's, so only the adapter can change the output
    ctx = make_ctx(tmp_path, benchmark={"max_queries": 1}, rollout={"m": 2, "exemplars": False},
                   generator={"max_new_tokens": 12, "temperature": 0.0})
    assert run_rollout(ctx)["generations"] == 2
    make_adapter(ctx.store.checkpoint_dir("t", 0))
    ctx1 = ctx.at_round(1)
    run_rollout(ctx1)
    r0 = ctx.store.read("generations", "t", 0).sort("gen_id")
    r1 = ctx1.store.read("generations", "t", 1).sort("gen_id")
    for df in (r0, r1):
        for row in df.iter_rows(named=True):
            assert row["prompt_token_ids"] == smol_tokenizer(row["prompt_text"], add_special_tokens=False).input_ids
            assert row["text"] == smol_tokenizer.decode(row["token_ids"], skip_special_tokens=True)
            assert len(row["token_ids"]) == 12 or row["finish_reason"] == "stop"  # max_new_tokens or eos
            assert row["backend"] == "transformers" and not row["retokenized"] and row["latency_s"] > 0
    for row in r0.iter_rows(named=True):  # round 0 samples the base model: its greedy logprobs, stored per token
        assert row["token_logprobs"] == pytest.approx(
            teacher_forced(smol_lm, row["prompt_token_ids"], row["token_ids"]), abs=1e-4)
    t0, t1 = r0["token_ids"].to_list(), r1["token_ids"].to_list()
    assert t0[0] == t0[1]  # greedy: both slots agree
    assert r1["adapter_round"].to_list() == [0, 0]
    assert r1["prompt_text"].to_list() == r0["prompt_text"].to_list()
    assert t1[0] != t0[0]  # the adapter changed the policy


def test_generator_adapter_samples_round_0_only(tmp_path, fake):
    """generator.adapter is the starting policy: round 0 samples with it (and trains from it), round 1 with round
    0's checkpoint, which training made from it. Sampling every round with it would leave π_old behind."""
    gens = fake()
    start = tmp_path / "sft"
    start.mkdir()
    (start / "adapter_config.json").write_text("{}")
    ctx = make_ctx(tmp_path, generator={"adapter": str(start)})
    run_rollout(ctx)
    assert {c[2] for c in gens[-1].calls} == {str(start.resolve())}
    assert set(ctx.store.read("generations", "t", 0)["adapter_round"].to_list()) == {None}
    ckpt = ctx.store.checkpoint_dir("t", 0)
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")
    run_rollout(ctx.at_round(1))
    assert {c[2] for c in gens[-1].calls} == {str(ckpt.resolve())}
    assert set(ctx.store.read("generations", "t", 1)["adapter_round"].to_list()) == {0}


def _two_rounds(ctx: RunContext) -> None:
    """Round 0 rolled out and scored, a stand-in checkpoint, then round 1 rolled out."""
    run_rollout(ctx)
    _round0_scores(ctx)
    ckpt = ctx.store.checkpoint_dir("t", 0)
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text("{}")  # the fake generator only needs the folder to exist
    run_rollout(ctx.at_round(1))


@pytest.mark.parametrize("exemplars", ["buckets", "none"])
def test_evaluation_prompts_are_built_as_training_prompts(tmp_path, fake, exemplars):
    """Checkpoint 0 samples round 1 in training; its evaluation (same queries here) must see the same prompts,
    exemplars included (buckets) or none in any round (none, SPOGW); the base model's evaluation sees round 0's
    prompts (no exemplars)."""
    import yaml

    from pipeline.run import open_run
    from pipeline.studies.evaluate import open_eval_run

    fake()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run_id": "t", "store": {"root": str(tmp_path)}, "benchmark": {"max_queries": 2},
                                   "generator": {"batch_size": 2}, "rollout": {"m": 3, "exemplars": exemplars}}))
    ctx = open_run(cfg, "t", 0)
    _two_rounds(ctx)
    train = ctx.store.read("generations", "t", 1).group_by("query_id").agg(pl.col("prompt_text").first(),
                                                                          pl.col("exemplar_ids").first())
    # round 1's training prompts carry exemplars with buckets (q1's pool: all invalid, one bucket), none without
    assert [len(ids) for ids in train.sort("query_id")["exemplar_ids"]] == ([2, 1] if exemplars == "buckets"
                                                                            else [0, 0])
    assert all(("Score " in p) == (exemplars == "buckets") for p in train["prompt_text"])

    ev = open_eval_run(str(tmp_path), "t", 0, split="validate")
    run_rollout(ev)
    got = ev.store.read("generations", ev.run_id, 0).group_by("query_id").agg(pl.col("prompt_text").first(),
                                                                              pl.col("exemplar_ids").first())
    assert got.sort("query_id").to_dicts() == train.sort("query_id").to_dicts()

    base = open_eval_run(str(tmp_path), "t", -1, split="validate")
    run_rollout(base)
    r0 = ctx.store.read("generations", "t", 0).group_by("query_id").agg(pl.col("prompt_text").first())
    b = base.store.read("generations", base.run_id, 0).group_by("query_id").agg(pl.col("prompt_text").first())
    assert b.sort("query_id").to_dicts() == r0.sort("query_id").to_dicts()
    assert set(base.store.read("generations", base.run_id, 0)["exemplar_ids"].list.len().to_list()) == {0}


def test_exemplars_switch_off_gives_round0_prompts_in_every_round(tmp_path, fake):
    fake()
    ctx = make_ctx(tmp_path, rollout={"exemplars": "none"})
    _two_rounds(ctx)
    p0 = sorted(set(ctx.store.read("generations", "t", 0)["prompt_text"]))
    p1 = sorted(set(ctx.store.read("generations", "t", 1)["prompt_text"]))
    assert p0 == p1 and "Score " not in p1[0]


@pytest.mark.slow
def test_vllm_on_cpu_samples_the_adapter_merged(tmp_path, fake, monkeypatch, smol_lm):
    """vLLM's LoRA kernels are ~8x slower than the base model on CPU: the rollout merges the round's adapter into
    a temporary copy of the base weights, starts the engine on it without LoRA, and removes it afterwards. The
    merged model computes what base + adapter computes: checked on the very folder the rollout handed the engine
    (one merge, the stage's own, instead of a second merge_adapter call made by the test)."""
    from peft import PeftModel
    from test_generation import make_adapter

    from pipeline.engines.models import load_causal_lm

    adapter = make_adapter(tmp_path / "lora", seed=2, scale=0.05)
    ids = torch.tensor([[1, 450, 3290, 310, 2]])
    gens = fake()
    seen = {}

    def make(cfg, enable_lora=False, **_):
        seen.update(model=cfg.model, lora=enable_lora, exists=Path(cfg.model, "config.json").is_file())
        if not enable_lora:  # the merged folder exists only while the stage runs: its logits now
            with torch.no_grad():
                seen["logits"] = load_causal_lm(cfg.model, device="cpu")(ids).logits
        gens.append(FakeGen())
        return gens[-1]

    monkeypatch.setattr(rollout, "make_generator", make)
    import pipeline.engines.models

    # the merged copies go to a cache of this test's own; its embedded model is the real cache's, already converted
    # (smol_lm), linked in: an empty cache would convert the GGUF again (~30 s of CPU) for the base weights
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(pipeline.engines.models.cache_dir() / "models", target_is_directory=True)
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline.engines.models, "cache_dir", lambda: tmp_path / "cache")
    ctx = make_ctx(tmp_path / "store", generator={"backend": "vllm", "adapter": adapter, "batch_size": 2,
                                                  "dtype": "float32"})
    run_rollout(ctx)
    assert seen["lora"] is False and seen["exists"] and seen["model"].startswith(str(tmp_path / "cache" / "merged"))
    assert all(call[2] is None for call in gens[-1].calls)  # the engine applies no adapter: it is in the weights
    assert not Path(seen["model"]).exists()  # the merged copy is gone with the stage
    df = ctx.store.read("generations", "t", 0)
    assert set(df["model"]) == {"embedded:smollm2-135m-instruct"} and adapter in df["sampling"][0]
    peft_lm = PeftModel.from_pretrained(load_causal_lm("embedded:smollm2-135m-instruct", device="cpu"), adapter)
    with torch.no_grad():
        want = peft_lm(ids).logits
        base = smol_lm(ids).logits
    got = seen["logits"]  # the merged folder's model = base + adapter, and the adapter matters
    assert torch.allclose(got, want, atol=1e-4) and not torch.allclose(base, want, atol=1e-2)
    # generator.merge_adapter: never: the engine loads the base weights and applies the adapter itself
    seen.clear()
    ctx = make_ctx(tmp_path / "store2", generator={"backend": "vllm", "adapter": adapter, "batch_size": 2,
                                                   "merge_adapter": "never"})
    run_rollout(ctx)
    assert seen["lora"] is True and seen["model"] == "embedded:smollm2-135m-instruct"
    assert all(call[2] is not None for call in gens[-1].calls)


def test_nearby_seeds_share_no_sample_streams(tmp_path, fake):
    """Engines seed sample j of prompt i with seed + i*n + j. Seeds 0 and 1 of a run once differed by 1 there,
    so seed 1 replayed 7 of seed 0's 8 samples per prompt; the batch seed is now hashed from (seed, round, slot)
    and the two runs' seed ranges are disjoint."""
    from pipeline.run import derived_seed

    ranges = []
    for seed in (0, 1):
        gens = fake()
        ctx = make_ctx(tmp_path / f"s{seed}", generator={"seed": seed, "batch_size": 2}, rollout={"m": 8})
        run_rollout(ctx)
        (prompts, sampling, _), = gens[-1].calls
        ranges.append(range(sampling.seed, sampling.seed + len(prompts) * sampling.n))
    assert not set(ranges[0]) & set(ranges[1])
    assert derived_seed(1, "train", 0) != derived_seed(0, "train", 1)  # additive seeds collide: 1 + 0 == 0 + 1


def test_example_menu_draws_one_design_per_slot(tmp_path, fake, monkeypatch):
    """With rollout.example_menu each slot's prompt shows the design drawn for (query, slot, menu_seed) as
    its example and opens the assistant turn with its first lines; the rows name the design shown (`example`) and the
    one written (`design`: FakeGen writes WORKFLOW, which is design `io` token for token)."""
    from pipeline.stages.sampling import draw_design

    io = tmp_path / "io.py"
    io.write_text("# design: answer directly\nasync def solve(problem):\n    return (await llm([{'role': 'user', "
                  "'content': problem}]))[0]  # noqa: F821\n")
    vote = tmp_path / "vote.py"
    vote.write_text("# design: sample and vote\nasync def solve(problem):\n    r = await llm(problem, n=5)\n"
                    "    return max(r, key=r.count)\n")
    gens = fake()
    body = "    return (await llm([{'role': 'user', 'content': problem}]))[0]\n```\n"  # completes the opened solve
    monkeypatch.setattr(FakeGen, "_generate", lambda self, prompts, smp, a: self.calls.append((prompts, smp, a)) or [
        [Completion(body, [1], [3], [-1.0], "stop")] * smp.n for _ in prompts])
    ctx = make_ctx(tmp_path, rollout={"m": 6, "example_menu": [str(io), str(vote)], "menu_prefix_lines": 0})
    run_rollout(ctx)
    df = ctx.store.read("generations", "t", 0).sort("gen_id")
    names = ["io", "vote"]
    for r in df.iter_rows(named=True):
        drawn = names[draw_design(0, r["query_id"], r["slot"], 2)]
        assert r["example"] == drawn and r["design"] == "io"
        shown = "r = await llm(problem, n=5)" if drawn == "vote" else "return (await llm([{'role'"
        assert shown in r["prompt_text"] and r["prompt_text"].endswith("```python\nasync def solve(problem):\n")
        assert r["text"].startswith("```python\nasync def solve(problem):\n")
    # one prompt per (query, drawn design): as many generation requests as distinct draws
    distinct = {(q, draw_design(0, q, s, 2)) for q in ("q0", "q1") for s in range(6)}
    assert sum(len(c[0]) for c in gens[0].calls) == len(distinct) and len(distinct) >= 3


def test_policy_menu_shows_every_design_and_forces_none(tmp_path, fake, monkeypatch):
    """rollout.menu_choice policy (the default): one prompt per query shows every design's code, the assistant turn
    opens with workflow_prefix only, all m slots sample from that one prompt, and each row's `choice` is the design
    its own `# design:` line names (`example` stays null: no design was drawn)."""
    io = tmp_path / "io.py"
    io.write_text("# design: answer directly\nasync def solve(problem):\n    return (await llm(problem))[0]\n")
    vote = tmp_path / "vote.py"
    vote.write_text("# design: sample and vote\nasync def solve(problem):\n    r = await llm(problem, n=5)\n"
                    "    return max(r, key=r.count)\n")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "workflow.txt").write_text("$designs\nTask:\n$problem\n")
    gens = fake()
    said = [" vote\nasync def solve(problem):\n    return 1\n```", " io + vote\nasync def solve(p):\n    return 2\n```",
            " my own\nasync def solve(p):\n    return 3\n```"]
    monkeypatch.setattr(FakeGen, "_generate", lambda self, ps, smp, a: self.calls.append((ps, smp, a)) or [
        [Completion(said[i % 3], [1], [3], [-1.0], "stop") for i in range(smp.n)] for _ in ps])
    ctx = make_ctx(tmp_path, rollout={"m": 6, "example_menu": [str(io), str(vote)], "prompt_dir": str(prompts),
                                      "workflow_prefix": "```python\n# design:"})
    run_rollout(ctx)
    df = ctx.store.read("generations", "t", 0).sort("gen_id")
    assert [len(c[0]) for c in gens[0].calls] == [2] and gens[0].calls[0][1].n == 6  # one prompt a query, n = m
    for r in df.iter_rows(named=True):
        shown = r["prompt_text"]
        assert "r = await llm(problem, n=5)" in shown and "return (await llm(problem))[0]" in shown
        assert r["prompt_text"].endswith("```python\n# design:") and r["example"] is None
    assert df.filter(pl.col("query_id") == "q0")["choice"].to_list() == ["vote", "combined", "own"] * 2


def _two_design_menu(tmp_path) -> list[str]:
    """Two program files of a menu: direct (one executor call) and steps (a constant answer)."""
    menu = []
    for name, body in (("mixed_direct", "return (await llm(problem))[0]"), ("mixed_steps", "return 'steps'")):
        path = tmp_path / f"{name}.py"
        path.write_text(f"# design: {name}\nasync def solve(problem):\n    {body}\n")
        menu.append(str(path))
    return menu


def test_choice_step_draws_the_design_token_from_the_labels_then_writes_after_it(tmp_path, fake, monkeypatch):
    """rollout.choice_step: the engine is asked for the policy's log-probs of exactly the labels' first tokens, each
    slot's design is drawn from them renormalised and tempered (choice_temperature), then a second call writes the
    workflow after the drawn token, one prompt a slot; a row's tokens are the two steps' joined, the design token's
    log-prob the one it was drawn with, and its choice the drawn label's design."""
    menu = _two_design_menu(tmp_path)
    gens = fake()
    tok = rollout.load_tokenizer("embedded:smollm2-135m-instruct")
    prefix = "```python\nasync def solve(problem):\n    # design:"
    expected = {"mixed_direct": tok(prefix + " direct", add_special_tokens=False).input_ids[-1],
                "mixed_steps": tok(prefix + " steps", add_special_tokens=False).input_ids[-1]}
    asked = []

    def odds(self, prompts, token_ids, adapter=None):  # the policy: P(direct) = 0.6, P(steps) = 0.15, others 0.25
        asked.append(list(token_ids))
        return [[math.log(0.6 if t == expected["mixed_direct"] else 0.15) for t in token_ids] for _ in prompts]

    def generate(self, prompts, smp, adapter):
        self.calls.append((prompts, smp, adapter))
        return [[Completion("\n    return 1\n```", [5, 6, 9], [11, 12], [-0.1, -0.2], "stop")] for _ in prompts]

    monkeypatch.setattr(FakeGen, "next_token_logprobs", odds)
    monkeypatch.setattr(FakeGen, "_generate", generate)
    ctx = make_ctx(tmp_path, rollout={"m": 4, "example_menu": menu, "workflow_prefix": prefix, "choice_step": True,
                                      "choice_temperature": 3.0}, training={"old_logprobs": "recompute"})
    run_rollout(ctx)
    assert [set(a) for a in asked] == [set(expected.values())]  # one read for the batch's two queries
    ((second, smp2, _),) = gens[0].calls
    assert len(second) == 8 and smp2.n == 1  # 2 queries x 4 slots, one prompt a slot
    df = ctx.store.read("generations", "t", 0).sort("gen_id")
    by_token = {v: k for k, v in expected.items()}
    # renormalised over the labels 0.8 and 0.2; at temperature 3: P(direct) = 0.8^(1/3) / (0.8^(1/3) + 0.2^(1/3))
    # = 0.9283 / (0.9283 + 0.5848) = 0.6135
    logp = {"mixed_direct": math.log(0.6135), "mixed_steps": math.log(0.3865)}
    for row in df.iter_rows(named=True):
        design = by_token[row["token_ids"][0]]
        assert row["choice"] == design and row["token_ids"][1:] == [11, 12]
        assert row["token_logprobs"] == pytest.approx([logp[design], -0.1, -0.2], abs=2e-4)  # stored as float32
        step = json.loads(row["sampling"])["choice_step"]  # the policy's own odds, whatever the temperature drew
        assert step["temperature"] == 3.0 and step["odds"] == {"mixed_direct": 0.8, "mixed_steps": 0.2}
        # and the drawn label's log-prob over the whole vocabulary: the label's π_old (old_logprobs: rollout)
        assert step["logprob"] == pytest.approx(math.log({"mixed_direct": 0.6, "mixed_steps": 0.15}[design]))
        assert label_logprob(row["sampling"]) == (step["logprob"], True)
    assert second[0].endswith(prefix + tok.decode([df["token_ids"][0][0]]))
    assert df.row(0, named=True)["retokenized"]  # the fake's step-2 prompt ids are not step 1's plus the drawn token
    assert set(df["choice"]) == {"mixed_direct", "mixed_steps"}  # 8 draws at 0.61 / 0.39: both (seeded)
    # a row stored before the policy's log-prob was: a drawn label whose π_old is recomputed
    assert label_logprob(json.dumps({"choice_step": {"temperature": 3.0}})) == (None, True)
    assert label_logprob(json.dumps({"temperature": 1.0})) == (None, False)
    make_ctx(tmp_path, rollout={"example_menu": menu, "choice_step": True}, training={"old_logprobs": "auto"})


def test_route_or_write_runs_a_routed_designs_program_and_writes_only_under_own(tmp_path, fake, monkeypatch):
    """rollout.route_or_write: a drawn menu label is the whole completion and its design's program is what runs (the
    stored text); the label `own` writes a workflow after it. Then curation.choice_credit's groups: the label's
    between-design advantage on every row, the code's within `own` (hand-computed below)."""
    from pipeline.stages.curate import choice_credit_rows, load_round
    from pipeline.stages.train.data import load_sequences

    menu = _two_design_menu(tmp_path)
    gens = fake()
    tok = rollout.load_tokenizer("embedded:smollm2-135m-instruct")
    prefix = "```python\nasync def solve(problem):\n    # design:"
    label = {n: tok(prefix + " " + w, add_special_tokens=False).input_ids[-1]
             for n, w in (("mixed_direct", "direct"), ("mixed_steps", "steps"), ("own", "own"))}
    monkeypatch.setattr(FakeGen, "next_token_logprobs", lambda self, prompts, ids, adapter=None: [
        [math.log(0.25)] * len(ids) for _ in prompts])  # renormalised over the three labels: 1/3 each
    monkeypatch.setattr(FakeGen, "_generate", lambda self, prompts, smp, adapter: self.calls.append(prompts) or [
        [Completion("\n    return 'mine'\n```", [5], [11, 12], [-0.1, -0.2], "stop")] for _ in prompts])
    ctx = make_ctx(tmp_path, rollout={"m": 6, "example_menu": menu, "workflow_prefix": prefix, "choice_step": True,
                                      "choice_temperature": 1.0, "route_or_write": True},
                   curation={"choice_credit": True}, training={"old_logprobs": "recompute"})
    run_rollout(ctx)
    df = ctx.store.read("generations", "t", 0).sort("gen_id")
    by_token = {v: k for k, v in label.items()}
    for row in df.iter_rows(named=True):
        chosen = by_token[row["token_ids"][0]]
        assert row["choice"] == chosen
        if chosen == "own":
            assert row["source"] == "write" and row["token_ids"][1:] == [11, 12] and "'mine'" in row["text"]
        else:
            assert row["source"] == "route" and row["token_ids"] == [label[chosen]]  # the label alone is trained
            assert row["text"] == "```python\n" + rollout.load_design(menu[chosen == "mixed_steps"]).code + "\n```"
    written = sum(len(c) for c in gens[0].calls)
    assert written == int((df["source"] == "write").sum()) and 0 < written < 12  # routed labels write nothing
    # one query's scores, hand-made: pick q0's rows and give direct 1, steps 0, own 1 then 0
    q0 = df.filter(pl.col("query_id") == "q0")
    want = {"mixed_direct": 1.0, "mixed_steps": 0.0}
    own_seen = iter([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    scores = {g: want[c] if c in want else next(own_seen) for g, c in zip(q0["gen_id"], q0["choice"], strict=True)}
    ctx.store.write("scores", [dict(gen_id=g, query_id="q0", rep=0, attempt=0, status="ok", score=v)
                               for g, v in scores.items()], "t", 0)
    rows, _ = choice_credit_rows(ctx, load_round(ctx).filter(pl.col("query_id") == "q0"))
    (choice,) = [r for r in rows if r["level"] == "choice"]
    member_scores = [scores[g] for g in choice["members"]]
    mean = sum(member_scores) / len(member_scores)
    std = (sum((x - mean) ** 2 for x in member_scores) / len(member_scores)) ** 0.5
    choices = dict(zip(q0["gen_id"], q0["choice"], strict=True))
    for g, a in zip(choice["members"], choice["advantages"], strict=True):
        same = [scores[h] for h in choice["members"] if choices[h] == choices[g]]
        assert a == pytest.approx((sum(same) / len(same) - mean) / std, abs=1e-4)  # the design's mean vs the group's
    codes = [r for r in rows if r["level"] == "code"]
    if len([c for c in choices.values() if c == "own"]) >= 2 and len({scores[g] for g in choices
                                                                       if choices[g] == "own"}) > 1:
        (code,) = codes
        assert {choices[g] for g in code["members"]} == {"own"}
    ctx.store.write("groups", rows, "t", 0)
    seqs, _ = load_sequences(ctx)
    assert {len(q.completion_ids) for q in seqs if q.level == "choice"} == {1}  # the label token alone
    assert all(q.gen_id.endswith("/code") and q.completion_ids == [11, 12] for q in seqs if q.level == "code")
    # the label's π_old from the row: the policy's own log-prob (0.25), not the draw's (1/3); the code's as sampled
    assert all(q.gen_logprobs == pytest.approx([math.log(0.25)]) for q in seqs if q.level == "choice")
    assert all(q.gen_logprobs == pytest.approx([-0.1, -0.2]) for q in seqs if q.level == "code")
    assert not any(q.drawn_label for q in seqs)


def test_workflows_after_drawn_labels_are_written_across_batches_each_with_its_own_seed(tmp_path, fake, monkeypatch):
    """rollout.choice_step: where the backend seeds each prompt by itself, the workflows written after several
    batches' labels are sampled in one call of about batch_size x n of them, each prompt with the seed its own
    batch's call would give it: the same rows as one call a batch, in fewer calls."""
    menu = _two_design_menu(tmp_path)
    monkeypatch.setattr(FakeGen, "next_token_logprobs", lambda self, prompts, ids, adapter=None: [
        [math.log(1 / 3)] * len(ids) for _ in prompts])
    # a written workflow returns its prompt's seed: the rows show which seed sampled each
    monkeypatch.setattr(FakeGen, "_generate", lambda self, prompts, smp, adapter: self.calls.append(
        (prompts, smp)) or [[Completion(f"\n    return {smp.prompt_seed(i)}\n```", [5], [11, 12], [-0.1, -0.2],
                                        "stop")] for i in range(len(prompts))])
    gens = fake()
    runs = {}
    for merged in (False, True):
        monkeypatch.setattr(FakeGen, "per_prompt_seeds", merged)
        ctx = make_ctx(tmp_path / str(merged), benchmark={"max_queries": 3}, generator={"batch_size": 1},
                       rollout={"m": 6, "example_menu": menu, "choice_step": True, "choice_temperature": 1.0,
                                "workflow_prefix": "```python\nasync def solve(problem):\n    # design:",
                                "route_or_write": True}, training={"old_logprobs": "recompute"})
        run_rollout(ctx)
        runs[merged] = ctx.store.read("generations", "t", 0).sort("gen_id")
    one_a_batch, across = gens[0].calls, gens[1].calls
    own = runs[True].filter(pl.col("source") == "write")
    # one query a batch: a call per query with workflows to write, none seeded by prompt
    assert len(one_a_batch) == own["query_id"].n_unique() == 3 and all(smp.seeds is None for _, smp in one_a_batch)
    # across batches: a call once the batches drawn hold batch_size x n = 6 workflows to write, then the rest
    (first, first_sampling), *_ = across
    assert len(across) < len(one_a_batch) and len(first) >= 6 and len(first_sampling.seeds) == len(first)
    assert sum(len(prompts) for prompts, _ in across) == own.height
    assert sorted(p for prompts, _ in one_a_batch for p in prompts) == \
        sorted(p for prompts, _ in across for p in prompts)
    assert runs[False].select("gen_id", "choice", "text", "token_ids").rows() == \
        runs[True].select("gen_id", "choice", "text", "token_ids").rows()  # the same draws, the same seeds
    assert own["text"].str.contains("return").all()


def test_batches_join_in_calls_of_call_samples_each_prompt_with_its_own_batch_seed(tmp_path, fake, monkeypatch):
    """generator.call_samples: where the backend seeds each prompt by itself, one call samples several batches (one
    query a batch, m = 2: two batches hold 4 samples), each prompt with the seed its own batch's call gives it: the
    same rows in fewer calls; a crash in the second call keeps the first call's batches, and a re-run samples the
    rest."""
    def seeded(self, prompts, smp, adapter):  # each sample returns its own seed: the rows show which seed drew it
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("crash")
        self.calls.append((prompts, smp))
        return [[Completion(f"```python\nasync def solve(problem):\n    return {smp.prompt_seed(i) + j}\n```", [5],
                            [11, 12 + j], [-0.1, -0.2], "stop") for j in range(smp.n)] for i in range(len(prompts))]

    monkeypatch.setattr(FakeGen, "_generate", seeded)
    runs = {}
    for joined in (False, True):
        gens = fake()
        monkeypatch.setattr(FakeGen, "per_prompt_seeds", joined)
        ctx = make_ctx(tmp_path / str(joined), benchmark={"max_queries": 3},
                       generator={"batch_size": 1, "call_samples": 4}, rollout={"m": 2})
        run_rollout(ctx)
        runs[joined] = (gens[-1].calls, ctx.store.read("generations", "t", 0).sort("gen_id"))
    (apart, rows_apart), (across, rows_across) = runs[False], runs[True]
    assert len(apart) == 3 and all(smp.seeds is None for _, smp in apart)  # one call a query
    (first, first_smp), (second, second_smp) = across
    assert len(first) == 2 and len(second) == 1 and second_smp.seeds is None
    # prompt i of a batch starts at its call's seed + i * n; each batch here holds one prompt
    assert first_smp.seeds == (apart[0][1].seed, apart[1][1].seed) and first_smp.n == 2
    assert first == apart[0][0] + apart[1][0] and second == apart[2][0]
    assert rows_apart.height == 6 and rows_apart.select("gen_id", "text", "token_ids").rows() == \
        rows_across.select("gen_id", "text", "token_ids").rows()
    # a crash in the second call: the first call's two batches are in the store, the re-run samples the third
    monkeypatch.setattr(FakeGen, "per_prompt_seeds", True)
    gens = fake(fail_after=1)
    ctx = make_ctx(tmp_path / "crash", benchmark={"max_queries": 3},
                   generator={"batch_size": 1, "call_samples": 4}, rollout={"m": 2})
    with pytest.raises(RuntimeError, match="crash"):
        run_rollout(ctx)
    assert ctx.store.read("generations", "t", 0)["query_id"].unique().sort().to_list() == ["q0", "q1"]
    fake()
    run_rollout(ctx)
    assert [len(prompts) for prompts, _ in gens[-1].calls] == [1]
    assert ctx.store.read("generations", "t", 0).sort("gen_id").select("gen_id", "text").rows() == \
        rows_across.select("gen_id", "text").rows()


def test_example_menu_file_missing_writes_nothing(tmp_path, fake):
    fake()
    ctx = make_ctx(tmp_path, rollout={"example_menu": [str(tmp_path / "nope.py")]})
    with pytest.raises(RolloutError, match="nope.py is not a file"):
        run_rollout(ctx)
    assert ctx.store.read("generations", "t", 0).height == 0


def test_only_workflow_samples_stop_at_their_block_end_and_batches_keep_kinds_apart():
    """An agent's plan is not code: it runs to EOS; a workflow stops at its block's close unless switched off. A
    generation call holds one kind, so its one Sampling (and stop) suits every prompt in it."""
    from pipeline.config import GeneratorConfig
    from pipeline.stages.sampling import Request, batches, stops

    assert stops(GeneratorConfig(), "workflow") == ("\n```\n",)
    assert stops(GeneratorConfig(), "agent") == ()
    assert stops(GeneratorConfig(stop_at_block_end=False), "workflow") == ()
    reqs = [Request(kind, f"q{i}", None, [f"g{i}"], [0], "p", [], 64) for i, kind in
            enumerate(["agent", "agent", "workflow", "workflow", "agent"])]
    assert [[r.kind for r in b] for b in batches(reqs, 8)] == [["agent"] * 2, ["workflow"] * 2, ["agent"]]
