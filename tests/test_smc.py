"""BayesFlow's SMC sampler: step cutting, look-ahead weights, multinomial resampling and one scripted sweep,
all by hand; then the derived run end to end with a scripted generator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import yaml

from pipeline.config import RunConfig, SMCConfig
from pipeline.engines.generation.base import Completion, Generator
from pipeline.studies.smc import (
    SMC,
    Particle,
    Query,
    _reward_fn,
    consistency_rewards,
    cut_step,
    lookahead_weight,
    resample,
)

HEAD = "```python\nasync def solve(problem):\n"
S1 = "    # Step 1: a\n    x = 1\n"
S2 = "    # Step 2: b\n    return str(x)\n```"
X = HEAD + S1 + S2  # two steps, answers "1"
X_ALT = HEAD + S1 + "    # Step 2: c\n    return str(x + 1)\n```"  # the same first step, answers "2"
Y = HEAD + "    # Step 1: a\n    return '1'\n```"  # one step, answers "1"


def test_cut_step_ends_before_the_next_step_comment():
    assert cut_step(X, 1) == (HEAD + S1, False)
    assert cut_step(X, 2) == (X, True)  # no third step: complete
    assert cut_step(Y, 1) == (Y, True)
    assert cut_step("async def solve(p):\n    return 1\n", 1) == ("async def solve(p):\n    return 1\n", True)
    assert cut_step("#step 1\na\n  # STEP 2: b\nc", 1) == ("#step 1\na\n", False)  # case and spacing


def test_lookahead_weight_is_the_mean_of_exp_beta_r():
    assert lookahead_weight([1.0, 0.0]) == pytest.approx((math.e + 1) / 2)
    assert lookahead_weight([0.5], beta=2.0) == pytest.approx(math.e)
    assert lookahead_weight([0.0, 0.0, 0.0], beta=5.0) == 1.0
    with pytest.raises(ValueError, match="at least one"):
        lookahead_weight([])


def test_resample_is_multinomial_by_the_inverse_cdf():
    # weights 1, e, 1: cdf 1/(2+e) = 0.2119, (1+e)/(2+e) = 0.7881, 1
    assert resample([1.0, math.e, 1.0], [0.1, 0.5, 0.79, 0.95, 0.2119]) == [0, 1, 2, 2, 0]
    assert resample([0.0, 2.0], [0.0, 0.99]) == [1, 1]  # a zero weight is never drawn
    with pytest.raises(ValueError, match="positive sum"):
        resample([0.0, 0.0], [0.5])


def test_consistency_reward_is_the_share_of_the_same_answer():
    assert consistency_rewards(["5", "5", "7", None]) == [0.5, 0.5, 0.25, 0.0]
    assert consistency_rewards([None]) == [0.0] and consistency_rewards([]) == []


class Uniforms:
    """A stand-in for the query's numpy Generator: the resampling uniforms, step by step."""

    def __init__(self, *steps):
        self.steps = list(steps)

    def random(self, n):
        u = self.steps.pop(0)
        assert len(u) == n
        return u


def _comp(text):
    return Completion(text, [1, 2], [3, 4, 5], [-0.1, -0.1, -0.1], "stop")


def test_one_sweep_hand_computed():
    """N = 2, K = 2, T = 2 on one query. Step 1: particle 0 samples X (two steps) and is cut after step 1; its
    second rollout is X_ALT; particle 1 samples Y (complete). Runs: X -> "1", X_ALT -> "2", Y -> "1", so R = 2/3,
    1/3, 2/3; w0 = (e^(2/3) + e^(1/3)) / 2, w1 = e^(2/3); uniforms 0.3, 0.5 against cdf w0 / (w0 + w1) = 0.4619
    keep both. Step 2: particle 0 samples the rest of X and completes; X and Y answer "1": R = 1, w = e, e;
    uniforms 0.9, 0.1 swap them. Final workflows: Y, X; three runs (X is not run twice)."""
    cfg = RunConfig(smc=SMCConfig(N=2, K=2, T=2))
    prefix1 = HEAD + S1
    script = {("extend:1", ""): [[_comp(X)], [_comp(Y)]],
              ("lookahead:1", prefix1): [[_comp("    # Step 2: c\n    return str(x + 1)\n```")]],
              ("extend:2", prefix1): [[_comp(S2)]]}
    prompts = []

    def sample(ps, n, key):
        prompts.append((key, ps))
        return script[(key, ps[0].removeprefix("P"))]

    answers = {"return str(x)": "1", "return str(x + 1)": "2", "return '1'": "1"}

    def run(jobs):
        return [{"gen_id": j.gen_id, "query_id": j.item.id, "status": "ok",
                 "answer": next(a for k, a in answers.items() if j.code.rstrip().endswith(k))} for j in jobs]

    smc = SMC(SimpleNamespace(cfg=cfg), sample, run, _reward_fn(SimpleNamespace(cfg=cfg),
                                                               SimpleNamespace(family="procedural")))
    q = Query(SimpleNamespace(id="q", prompt="p"), "P", [Particle(""), Particle("")],
              Uniforms([0.3, 0.5], [0.9, 0.1]))
    smc.sweep([q])
    w0 = (math.exp(2 / 3) + math.exp(1 / 3)) / 2
    assert [s["t"] for s in q.steps] == [1, 2]
    assert q.steps[0]["weights"] == pytest.approx([w0, math.exp(2 / 3)]) and q.steps[0]["ancestors"] == [0, 1]
    assert q.steps[1]["weights"] == pytest.approx([math.e, math.e]) and q.steps[1]["ancestors"] == [1, 0]
    assert [p.rollouts[0] for p in q.particles] == [Y, X] and all(p.complete for p in q.particles)
    assert [k for k, _ in prompts] == ["extend:1", "lookahead:1", "extend:2"]
    assert prompts[2][1] == ["P" + prefix1]  # only the unfinished particle is extended
    assert sorted(r["answer"] for r in smc.checks) == ["1", "1", "2"]
    ids = [r["gen_id"] for r in smc.rows]
    assert ids == ["smc-q-t1-p0-k0", "smc-q-t1-p1-k0", "smc-q-t1-p0-k1", "smc-q-t2-p0-k0"]
    assert {r["gen_id"]: r["reward"] for r in smc.checks} == {  # the last R each run had: X and Y at step 2
        "smc-q-t1-p0-k0": 1.0, "smc-q-t1-p1-k0": 1.0, "smc-q-t1-p0-k1": pytest.approx(1 / 3)}


class Scripted(Generator):
    backend = "scripted"

    def __init__(self):
        self.calls = 0

    def _generate(self, prompts, sampling, adapter):
        self.calls += 1
        body = "    # Step 1: compute\n    return str(eval(problem.split(': ')[1].rstrip(' =')))\n```"
        return [[_comp(HEAD + body) for _ in range(sampling.n)] for _ in prompts]


def run_scripted_smc(tmp_path: Path, monkeypatch, gen: Generator, rollout: dict, smc: dict) -> dict:
    """`run_smc` on 2 test queries of chain sums (smoke config + `rollout` and `smc`), sampling from `gen`, scoring
    in this process; returns its summary."""
    import pipeline.engines.generation
    from pipeline.stages.runner import run_stage
    from pipeline.studies.smc import run_smc

    cfg = yaml.safe_load(Path("configs/smoke.yaml").read_text())
    cfg.update(run_id="s", rounds=1)
    cfg["store"]["root"] = str(tmp_path / "store")
    cfg["benchmark"] = {"name": "procedural", "tasks": ["chain_sum"], "size": 20}
    cfg["rollout"] = {"mode": "flat", "exemplars": False, **rollout}
    cfg["experiment"] = {"eval_queries": 2}
    cfg["smc"] = smc
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(pipeline.engines.generation, "make_generator", lambda g, **kw: gen)
    return run_smc(str(path), lambda **kw: run_stage(kw["stage"], kw["run_id"], kw["round"], kw["store_root"],
                                                    kw.get("sets"), isolate=False))


@pytest.mark.usefixtures("shared_sandbox")
def test_smc_run_end_to_end(tmp_path, monkeypatch):
    from pipeline.store import Store

    gen = Scripted()
    s = run_scripted_smc(tmp_path, monkeypatch, gen, {}, {"N": 3, "K": 2, "T": 2})
    # one step per workflow: every particle completes at step 1; its workflow evaluates the expression: right
    assert (s.eval_run_id, s.queries, s.workflows) == ("s-smc", 2, 6)
    assert (s.mean_at_l, s.best_at_l, s.majority_at_l) == (1.0, 1.0, 1.0)
    assert s.extra["smc"] == {"queries": 2, "rollouts": 6, "runs": 2, "workflows": 6, "steps_with_comments": 0}
    st = Store(tmp_path / "store")
    gens = st.read("generations", "s-smc", 0)
    assert sorted(gens["kind"].unique().to_list()) == ["smc", "workflow"]
    # generator tokens: 6 rollouts x (2 prompt + 3 completion); executor: no llm() calls
    assert (s.gen_tokens_per_query, s.exec_tokens_per_query) == (15.0, 0.0)
    prov = json.loads(gens.filter(gens["kind"] == "workflow")["sampling"][0])
    assert (prov["method"], prov["N"], prov["K"], prov["T"]) == ("smc", 3, 2, 2)
    assert gen.calls == 1  # step 1's extension only: complete particles need no look-ahead or step 2
    # the sampling is timed: one chunk of 2 queries, then the stage's own line (their sum; the score stage, called
    # here without a flow, writes none)
    lines = [json.loads(x) for x in (st.run_dir("s-smc") / "timings.jsonl").read_text().splitlines()]
    assert [(t["stage"], t.get("shard")) for t in lines] == [("rollout", "chunk 1/1"), ("rollout", None)]
    assert lines[1]["wall_s"] == lines[0]["wall_s"] and not lines[1]["skipped"]


def test_plain_draw_samples_n_complete_workflows_and_runs_nothing():
    cfg = RunConfig(smc=SMCConfig(N=3, resample=False))
    smc = SMC(SimpleNamespace(cfg=cfg), lambda ps, n, key: [[_comp(X)] for _ in ps],
              lambda jobs: pytest.fail("plain sampling runs nothing"), lambda item, rows: [])
    q = Query(SimpleNamespace(id="q", prompt="p"), "P", [Particle(""), Particle(""), Particle("")], Uniforms())
    smc.draw([q])
    assert [p.rollouts for p in q.particles] == [[X]] * 3 and all(p.complete for p in q.particles)
    assert [r["gen_id"] for r in smc.rows] == ["smc-q-t1-p0-k0", "smc-q-t1-p1-k0", "smc-q-t1-p2-k0"]
    assert smc.checks == [] and q.steps == []


@pytest.mark.usefixtures("shared_sandbox")
def test_smc_on_a_menu_task_shows_the_menu_and_the_design_the_first_slot_draws(tmp_path, monkeypatch):
    """With `rollout.example_menu` SMC's prompt is the menu prompt the base model's rollout sees: every design, as
    its example the design slot 0 of the query draws, and the assistant turn opening with that design's lines."""
    from pipeline.engines.prompting import load_design
    from pipeline.stages.sampling import draw_design
    from pipeline.store import Store

    class Recording(Scripted):
        prompts: list[str] = []

        def _generate(self, prompts, sampling, adapter):
            self.prompts += prompts
            return super()._generate(prompts, sampling, adapter)

    menu = ["configs/programs/mixed_direct.py", "configs/programs/mixed_pot.py"]
    gen = Recording()
    run_scripted_smc(tmp_path, monkeypatch, gen, {"prompt_dir": "configs/prompts/mixed-menu", "example_menu": menu,
                                                  "menu_prefix_lines": 1}, {"N": 2, "K": 2, "T": 1})
    designs = [load_design(p) for p in menu]
    queries = Store(tmp_path / "store").read("queries", "s-smc", 0)
    assert queries.height == 2 and len(gen.prompts) == 4  # step 1's extension: one prompt per particle
    for qid, text in queries.select("query_id", "prompt").iter_rows():
        mine = [p for p in gen.prompts if text.strip() in p]
        d = designs[draw_design(0, qid, 0, 2)]  # rollout.menu_seed's default
        body = d.code.splitlines()
        at = next(i for i, x in enumerate(body) if x.startswith("async def solve"))
        assert len(mine) == 2
        for prompt in mine:
            assert "- mixed_direct: " in prompt and "- mixed_pot: " in prompt
            assert f"Example workflow ({d.note}):\n```python\n{d.code}\n```" in prompt
            assert prompt.endswith("<|im_start|>assistant\n```python\n" + "\n".join(body[: at + 2]) + "\n")


@pytest.mark.usefixtures("shared_sandbox")
def test_a_run_cut_off_mid_chunk_resumes_after_its_whole_chunks(tmp_path, monkeypatch):
    """Chunks of one query: the run dies in the second chunk after its rollouts and runs were written but before its
    final workflows. The next attempt keeps the first chunk, removes the second's parts and samples only it again;
    the counts are those of an uninterrupted run (test_smc_run_end_to_end)."""
    import pipeline.studies.smc as smc_mod
    from pipeline.store import Store

    monkeypatch.setattr(smc_mod, "CHUNK", 1)
    real, seen = smc_mod.final_rows, []

    def cut_in_second_chunk(ctx, queries):
        seen.append(queries[0].item.id)
        if len(seen) == 2:
            raise RuntimeError("cut off")
        return real(ctx, queries)

    monkeypatch.setattr(smc_mod, "final_rows", cut_in_second_chunk)
    gen = Scripted()
    with pytest.raises(RuntimeError, match="cut off"):
        run_scripted_smc(tmp_path, monkeypatch, gen, {}, {"N": 3, "K": 2, "T": 2})
    st = Store(tmp_path / "store")
    first = st.read("generations", "s-smc", 0).filter(pl.col("query_id") == seen[0]).sort("gen_id")
    # chunk 1: rollouts and finals; chunk 2: rollouts
    assert gen.calls == 2 and len(st.parts("generations", "s-smc", 0)) == 3
    s = run_scripted_smc(tmp_path, monkeypatch, gen, {}, {"N": 3, "K": 2, "T": 2})
    assert gen.calls == 3 and seen == [seen[0], seen[1], seen[1]]  # the second chunk only, once more
    assert s.extra["smc"] == {"queries": 2, "rollouts": 6, "runs": 2, "workflows": 6, "steps_with_comments": 0}
    gens = st.read("generations", "s-smc", 0)
    assert gens.filter(pl.col("query_id") == seen[0]).sort("gen_id").equals(first)  # kept as it was
    assert gens["gen_id"].n_unique() == gens.height == 12 and s.workflows == 6
    # the sampling's wall time is the sum of the whole chunks of both attempts (the cut-off chunk's is not counted)
    lines = [json.loads(x) for x in (st.run_dir("s-smc") / "timings.jsonl").read_text().splitlines()]
    chunks = [t for t in lines if t.get("shard")]
    assert [t["shard"] for t in chunks] == ["chunk 1/2", "chunk 2/2"]
    total = [t for t in lines if t["stage"] == "rollout" and "shard" not in t]
    assert len(total) == 1 and total[0]["wall_s"] == pytest.approx(chunks[0]["wall_s"] + chunks[1]["wall_s"], abs=0.01)


def test_final_workflows_name_their_written_design_of_the_menu():
    """As the rollout stage does: a final workflow that is a menu design's code is that design, one unlike any is
    `other`; without a menu no design is named."""
    from pipeline.config import RolloutConfig
    from pipeline.engines.prompting import load_design
    from pipeline.studies.smc import final_rows

    menu = ["configs/programs/mixed_direct.py", "configs/programs/mixed_pot.py"]
    pot = load_design(menu[1]).code
    particles = [Particle("", True, [f"```python\n{pot}\n```"]), Particle("", True, [X])]
    q = Query(SimpleNamespace(id="q"), "P", particles, Uniforms())
    ctx = SimpleNamespace(cfg=RunConfig(smc=SMCConfig(N=2), rollout=RolloutConfig(example_menu=menu)))
    assert [r["design"] for r in final_rows(ctx, [q])] == ["mixed_pot", "other"]
    assert [r["design"] for r in final_rows(SimpleNamespace(cfg=RunConfig(smc=SMCConfig(N=2))), [q])] == [None, None]
