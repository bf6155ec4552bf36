"""Generation-time runs of workflows (the `checks` table): self-repair's quick self-check and SMC's look-ahead runs.

A check runs a workflow once on its own query in the sandbox with the run's executor and limits, as scoring does,
but never reads the gold answer: it learns only whether the workflow ran and what it answered. Its executor usage
is stored (one `checks` row per run) and counted in the query's cost (the store's `query_usage` view).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.config import RunConfig
from pipeline.engines.benchmarks.base import Item
from pipeline.engines.sandbox import Limits, run_workflow
from pipeline.engines.workflow import check_workflow

MAX_CHARS = 4000  # of an answer or an error kept in a checks row


@dataclass(frozen=True)
class CheckJob:
    gen_id: str
    code: str
    item: Item


def public_tests(cfg: RunConfig, item: Item) -> dict | None:
    """What backs the `run_tests` helper for a code item (its public tests), as in scoring."""
    if item.meta.get("public_tests") is None:
        return None
    return {"entry_point": item.meta.get("entry_point"), "tests": item.meta["public_tests"],
            "timeout_s": cfg.scoring.test_timeout_s}


def failure(status: str, answer: str | None, error: str | None) -> str | None:
    """Why a check failed, in words for the generator; None when the workflow ran and answered."""
    if status != "ok":
        return f"{status}: {error or 'no error message'}"
    if answer is None or not str(answer).strip():
        return "the workflow returned no answer (None or an empty string)"
    return None


def static_row(job: CheckJob, purpose: str, max_chars: int) -> dict:
    """A check that does not run the workflow: the contract's static check alone."""
    reason = check_workflow(job.code, max_chars)
    return {"gen_id": job.gen_id, "query_id": job.item.id, "purpose": purpose,
            "status": "ok" if reason is None else "invalid", "answer": None if reason else "(not run)",
            "error": reason, "llm_calls": 0, "tokens_in": 0, "tokens_out": 0, "cost_usd": 0.0, "wall_s": 0.0,
            "truncated_calls": 0}


async def _run(cfg: RunConfig, jobs: Sequence[CheckJob], purpose: str, executor) -> list[dict]:
    limits, sem = Limits.from_config(cfg.scoring), asyncio.Semaphore(cfg.scoring.concurrency)

    async def one(job: CheckJob) -> dict:
        async with sem:
            res = await run_workflow(job.code, job.item.prompt, executor=executor, limits=limits,
                                     public_tests=public_tests(cfg, job.item),
                                     max_chars=cfg.rollout.max_workflow_chars)
        return {"gen_id": job.gen_id, "query_id": job.item.id, "purpose": purpose, "status": res.status,
                "answer": None if res.answer is None else res.answer[:MAX_CHARS],
                "error": None if res.error is None else res.error[:MAX_CHARS], "llm_calls": res.llm_calls,
                "tokens_in": res.tokens_in, "tokens_out": res.tokens_out, "cost_usd": res.cost_usd,
                "wall_s": res.wall_s, "truncated_calls": res.truncated_calls}

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def run_checks(cfg: RunConfig, jobs: Sequence[CheckJob], purpose: str, executor=None) -> list[dict]:
    """One `checks` row per job (not written), in job order. `executor`: an Executor to reuse (else the run's own,
    made and closed here; a local model loads only if a workflow calls `llm`)."""
    if not jobs:
        return []

    async def go() -> list[dict]:
        from pipeline.engines.executors import make_executor

        ex = executor or make_executor(cfg.executor)
        try:
            return await _run(cfg, jobs, purpose, ex)
        finally:
            if executor is None:
                await ex.aclose()

    return asyncio.run(go())
