"""Self-repair (W4S): through the rollout stage with a scripted generator, so every row is known."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.engines.generation.base import Completion, Generator
from pipeline.run import open_run
from pipeline.stages import rollout
from pipeline.store import Store

BROKEN = "```python\nasync def solve(problem):\n    return str(1/0)\n```"
FIXED = "```python\nasync def solve(problem):\n    return '42'\n```"
NO_SOLVE = "```python\ndef helper(problem):\n    return 1\n```"


class Scripted(Generator):
    """Answers a repair prompt (it quotes the failed check) with `on_repair`, any other prompt with `first`."""

    backend = "scripted"

    def __init__(self, first: str, on_repair: str):
        self.first, self.on_repair, self.prompts = first, on_repair, []

    def _generate(self, prompts, sampling, adapter):
        self.prompts.append(list(prompts))
        return [[Completion(self.on_repair if "failed its check" in p else self.first, [1, 2, 3], [4, 5],
                            [-0.5, -0.25], "stop") for _ in range(sampling.n)] for p in prompts]


def _ctx(tmp_path: Path, m: int, attempts: int, check: str = "run"):
    cfg = yaml.safe_load(Path("configs/smoke.yaml").read_text())
    cfg.update(run_id="rp", rounds=1)
    cfg["store"]["root"] = str(tmp_path / "store")
    cfg["benchmark"] = {"name": "procedural", "tasks": ["chain_sum"], "size": 10, "max_queries": 1}
    cfg["rollout"] = {"mode": "flat", "m": m, "exemplars": False, "repair_attempts": attempts, "repair_check": check}
    cfg["scoring"] = {"timeout_s": 20, "concurrency": 2}
    path = tmp_path / "rp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return open_run(path, "rp", 0)


def _rollout(monkeypatch, ctx, gen: Scripted) -> dict:
    monkeypatch.setattr(rollout, "make_generator", lambda g, enable_lora=False: gen)
    return rollout.run_rollout(ctx)


@pytest.mark.usefixtures("shared_sandbox")
def test_a_repair_fixes_a_broken_workflow(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, m=2, attempts=3)
    gen = Scripted(BROKEN, FIXED)
    out = _rollout(monkeypatch, ctx, gen)
    # both samples crash (ZeroDivisionError) on their self-check; one repair each runs and answers "42"
    assert out["repair"] == {"checked": 4, "repairs": 2, "fixed": 2, "gave_up": 0}
    st = Store(tmp_path / "store")
    rows = {r["gen_id"]: r for r in st.read("generations", "rp", 0).to_dicts()}
    originals = sorted(g for g, r in rows.items() if r["attempt"] == 0)
    assert len(originals) == 2 and all(rows[g]["repair_of"] is None for g in originals)
    for g in originals:
        fix = rows[f"{g}-fix1"]
        assert (fix["repair_of"], fix["attempt"], fix["slot"], fix["text"]) == (g, 1, rows[g]["slot"], FIXED)
    checks = {r["gen_id"]: r for r in st.read("checks", "rp", 0).to_dicts()}
    assert {checks[g]["status"] for g in originals} == {"exec_error"}
    assert {checks[f"{g}-fix1"]["answer"] for g in originals} == {"42"}
    # the generator saw the failed code and its error
    repair_prompts = gen.prompts[1]
    assert len(repair_prompts) == 2 and all("return str(1/0)" in p and "ZeroDivisionError" in p
                                            for p in repair_prompts)
    final = {r["gen_id"]: r["final"] for r in st.generation_scores("rp", 0, 1, set()).to_dicts()}
    assert final == {g: False for g in originals} | {f"{g}-fix1": True for g in originals}


@pytest.mark.usefixtures("shared_sandbox")
def test_repair_gives_up_after_n_attempts(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, m=1, attempts=2)
    gen = Scripted(BROKEN, BROKEN)  # every repair is broken again
    out = _rollout(monkeypatch, ctx, gen)
    assert out["repair"] == {"checked": 3, "repairs": 2, "fixed": 0, "gave_up": 1}
    st = Store(tmp_path / "store")
    df = st.read("generations", "rp", 0).sort("attempt")
    root = df["gen_id"][0]
    assert df["gen_id"].to_list() == [root, f"{root}-fix1", f"{root}-fix2"]
    assert df["repair_of"].to_list() == [None, root, f"{root}-fix1"] and df["attempt"].to_list() == [0, 1, 2]
    assert [len(p) for p in gen.prompts] == [1, 1, 1]  # the sample, then exactly 2 repairs: no third
    assert sorted(st.read("checks", "rp", 0)["status"].to_list()) == ["exec_error"] * 3
    # resuming finds nothing left to do
    from pipeline.stages.repair import self_repair

    ro = rollout.Sampler(ctx, [], "procedural", None, rollout.Pools(), None, None)
    ro.items = rollout.load_benchmark(ctx.cfg.benchmark).items()
    again = self_repair(ctx, ro, engine=lambda: pytest.fail("no repair is left to sample"))
    assert again == {"checked": 0, "repairs": 0, "fixed": 0, "gave_up": 1}


def test_static_check_repairs_an_invalid_workflow_without_running_it(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, m=1, attempts=1, check="static")
    gen = Scripted(NO_SOLVE, FIXED)
    out = _rollout(monkeypatch, ctx, gen)
    assert out["repair"] == {"checked": 2, "repairs": 1, "fixed": 1, "gave_up": 0}
    checks = Store(tmp_path / "store").read("checks", "rp", 0).sort("status")
    assert checks["status"].to_list() == ["invalid", "ok"] and checks["tokens_in"].to_list() == [0, 0]
    assert "no top-level `async def solve(problem)`" in gen.prompts[1][0]
