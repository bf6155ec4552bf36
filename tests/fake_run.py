"""A small run written by fake stages (no model): two queries, four workflows a round with an ok / timeout /
invalid mix, a kept group with advantages, three optimiser steps. Shared by the tracking, artifact and browse
tests, which check what they show against these rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pipeline import stages

CODE = "async def solve(problem: str) -> str:\n    return await llm(problem)  # answer directly\n"


def fake_stage(stage: str):
    def fn(ctx, only_failed=False):
        trained = ctx.cfg.generator.adapter is not None or ctx.round > 0
        k = ctx.round
        if stage == "rollout":
            ctx.store.write("queries", [{"query_id": f"q{j}", "prompt": f"What is {j} + 40 + 2?", "reference":
                                         json.dumps(str(42 + j))} for j in range(2)], ctx.run_id, k)
            ctx.store.write("generations", [
                {"gen_id": f"g{i}", "kind": "workflow", "query_id": f"q{i // 2}", "slot": i % 2, "valid": i != 3,
                 "text": f"```python\n{CODE}```" if i != 3 else "def solve(: oops", "invalid_reason": None
                 if i != 3 else "syntax error", "prompt_token_ids": [1] * 10, "token_ids": [2] * (5 + i)}
                for i in range(4)], ctx.run_id, k)
        if stage == "score":
            rows = [("ok", 1.0 if trained else 0.5, 2), ("ok", 0.0, 1), ("timeout", 0.0, 0), ("invalid", 0.0, 0)]
            ctx.store.write("scores", [
                {"gen_id": f"g{i}", "query_id": f"q{i // 2}", "rep": 0, "attempt": 0, "status": s, "score": sc,
                 "llm_calls": calls, "tokens_in": 100 * calls, "tokens_out": 7 * calls, "answer": "42"}
                for i, (s, sc, calls) in enumerate(rows)], ctx.run_id, k)
        if stage == "curate":
            ctx.store.write("groups", [
                {"group_id": "q0-0", "query_id": "q0", "level": "flat", "members": ["g0", "g1"], "kept": True,
                 "advantages": [0.7, -0.7], "member_scores": [1.0, 0.0], "kind": "group"},
                {"group_id": "q1-0", "query_id": "q1", "level": "flat", "members": ["g2", "g3"], "kept": False,
                 "reason": "zero variance", "member_scores": [0.0, 0.0], "kind": "group"}], ctx.run_id, k)
        if stage == "train":
            ctx.store.write("train_metrics", [
                {"step": s, "epoch": 0, "loss": 1.0 / (s + 1 + 3 * k), "pg_loss": 0.5 - s - k, "kl": 0.01 * (s + k),
                 "clip_frac": 0.1 * s, "ratio_dev": 0.02 * s, "lr": 1e-5 * (s + 1), "grad_norm": 2.0 + s,
                 "tokens": 100 + 10 * s, "wall_s": 0.5 * (s + 1)} for s in range(3)], ctx.run_id, k)
            ctx.store.checkpoint_dir(ctx.run_id, k).mkdir(parents=True)
        ctx.finish(stage, rows=1)
        return {"rows": 1}
    return fn


def install_fake_stages(monkeypatch) -> None:
    for name, st in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=fake_stage(name), isolated=False,
                                                                     checkpoint=False))


def write_config(tmp_path: Path, extra: str = "", rounds: int = 2) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(f"run_id: t\nrounds: {rounds}\nstore:\n  root: {tmp_path / 'runs'}\n"
                 f"experiment:\n  seeds: [0]\n  eval_queries: 2\n  eval_l: 2\n{extra}")
    return p
