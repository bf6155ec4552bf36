"""Self-repair (W4S): a workflow that is invalid or fails a quick self-check goes back to the generator with its
error, up to `rollout.repair_attempts` times; then, still failing, it is left as it is (and scored as it is).

It runs inside the rollout stage after sampling, for any rollout mode (a two-level workflow keeps its agent plan as
`parent_id`; refine rollouts call it once per turn, on that turn's candidates, and skip what still fails). The
self-check (`rollout.repair_check`) is `run`: one sandbox run of the workflow on its own query
(`pipeline.engines.checks`: crashes, timeouts and missing answers fail it; the gold answer is never read), or `static`:
the contract check alone. A repair is a new `generations` row of the same query and slot with `repair_of` = the
workflow it repairs and `attempt` = 1, 2, ...; its prompt (`prompts/repair.txt`) shows the task, the failed code
and the error. Every row is scored by the score stage, so SQL shows how often repair helps; a query's L workflows
in evaluation are the last attempts of its slots (`generation_scores.final`).

The loop is driven by the store alone (chain ends without a check are checked; failed ones without a repair are
repaired), so a rollout that dies half-way resumes where it stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import polars as pl

from pipeline.engines.checks import CheckJob, failure, run_checks, static_row
from pipeline.engines.prompting import render, repair_prompt
from pipeline.engines.workflow import extract_code
from pipeline.stages.sampling import Request

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 1500  # of an error shown to the generator


def chain_ends(gens: pl.DataFrame) -> pl.DataFrame:
    """Workflow rows that no other row repairs: the current attempt of each slot."""
    wf = gens.filter(pl.col("kind") == "workflow")
    repaired = set(wf["repair_of"].drop_nulls().to_list())
    return wf.filter(~pl.col("gen_id").is_in(list(repaired)))


def root_of(gen_id: str, parent: dict[str, str | None]) -> str:
    """The first attempt of a repair chain (`parent`: gen_id -> repair_of)."""
    while parent.get(gen_id):
        gen_id = parent[gen_id]
    return gen_id


def repair_id(root: str, attempt: int) -> str:
    return f"{root}-fix{attempt}"


def _checked(ctx) -> dict[str, dict]:
    df = ctx.store.read("checks", ctx.run_id, ctx.round).filter(pl.col("purpose") == "repair")
    return {r["gen_id"]: r for r in df.iter_rows(named=True)}


def _check(ctx, ends: pl.DataFrame, items: dict, checked: dict[str, dict], executor=None) -> int:
    """Self-check the chain ends that have no check yet; writes their `checks` rows. `executor`: one to reuse."""
    todo = [CheckJob(r["gen_id"], extract_code(r["text"] or ""), items[r["query_id"]])
            for r in ends.iter_rows(named=True) if r["gen_id"] not in checked]
    if not todo:
        return 0
    if ctx.cfg.rollout.repair_check == "static":
        rows = [static_row(j, "repair", ctx.cfg.rollout.max_workflow_chars) for j in todo]
    else:
        rows = run_checks(ctx.cfg, todo, "repair", executor, ctx.store.cache_dir())
    ctx.store.write("checks", rows, ctx.run_id, ctx.round)
    checked.update({r["gen_id"]: r for r in rows})
    return len(rows)


def _requests(sampler, failing: list[tuple[dict, str]], parent: dict[str, str | None], items: dict,
              family: str) -> list:
    out = []
    for row, error in failing:
        item, attempt = items[row["query_id"]], (row["attempt"] or 0) + 1
        user = repair_prompt(item.prompt, family, extract_code(row["text"] or ""), error[:MAX_ERROR_CHARS])
        prefix = sampler.cfg.rollout.workflow_prefix
        out.append(Request("workflow", row["query_id"], row["parent_id"],
                           [repair_id(root_of(row["gen_id"], parent), attempt)], [row["slot"]],
                           render(sampler.tokenizer, user, prompt_dir=sampler.cfg.rollout.prompt_dir) + prefix, [],
                           sampler.cfg.generator.max_new_tokens, prefix))
    return out


def _repair(ctx, sampler, engine: Callable, failing: list[tuple[dict, str]], parent: dict, items: dict,
            extra: dict | None = None) -> int:
    """One repair per failing chain end, sampled in batches of generator.batch_size; returns rows written. `extra`:
    columns set on every repair row (a refine rollout's turn)."""
    reqs = _requests(sampler, failing, parent, items, sampler.family)
    by_id = {repair_id(root_of(r["gen_id"], parent), (r["attempt"] or 0) + 1): r for r, _ in failing}
    written, size = 0, ctx.cfg.generator.batch_size
    for i in range(0, len(reqs), size):
        batch = reqs[i:i + size]
        sampling = sampler.sampling(batch)
        t0 = time.perf_counter()
        outs = engine().generate([r.prompt_text for r in batch], sampling, sampler.sample_adapter)
        latency = (time.perf_counter() - t0) / len(batch)
        rows = [row for r, comps in zip(batch, outs, strict=True) for row in sampler.rows(r, comps, sampling, latency)]
        for row in rows:
            broken = by_id[row["gen_id"]]
            row.update(repair_of=broken["gen_id"], attempt=(broken["attempt"] or 0) + 1, **(extra or {}))
        ctx.store.write("generations", rows, ctx.run_id, ctx.round)
        written += len(rows)
    return written


def self_repair(ctx, sampler, engine: Callable, *, items: dict | None = None,
                scope: Callable[[pl.DataFrame], pl.DataFrame] | None = None, extra: dict | None = None,
                executor=None) -> dict:
    """Check, repair, check again ... up to `rollout.repair_attempts` repairs per slot (module doc). `sampler`: the
    rollout's `Sampler` (prompt rendering, sampling, row building); `engine()`: the generator, started on first
    use. Returns counts: checked, repairs, fixed (chains that pass after a repair), gave_up (still failing after
    the last attempt). Refine rollouts (pipeline.stages.refine) pass `items` (a generation's query_id -> the item its
    self-check runs on and its repair prompt shows), `scope` (the generations of one turn), `extra` (the turn
    column of its repairs) and `executor` (one shared by every check)."""
    limit = ctx.cfg.rollout.repair_attempts
    items = {it.id: it for it in sampler.items} if items is None else items
    scope = scope or (lambda df: df)
    checked, counts = _checked(ctx), {"checked": 0, "repairs": 0}
    for _ in range(limit + 1):
        gens = scope(ctx.store.read("generations", ctx.run_id, ctx.round))
        parent = dict(zip(gens["gen_id"], gens["repair_of"], strict=True))
        ends = chain_ends(gens)
        counts["checked"] += _check(ctx, ends, items, checked, executor)
        failing = [(r, why) for r in ends.iter_rows(named=True)
                   if (why := failure(checked[r["gen_id"]]["status"], checked[r["gen_id"]]["answer"],
                                      checked[r["gen_id"]]["error"])) is not None and (r["attempt"] or 0) < limit]
        if not failing:
            break
        counts["repairs"] += _repair(ctx, sampler, engine, failing, parent, items, extra)
    return counts | _outcome(ctx, checked, scope)


def _outcome(ctx, checked: dict[str, dict], scope: Callable[[pl.DataFrame], pl.DataFrame]) -> dict:
    ends = chain_ends(scope(ctx.store.read("generations", ctx.run_id, ctx.round)))
    fixed = gave_up = 0
    for r in ends.iter_rows(named=True):
        c = checked.get(r["gen_id"])
        failed = c is None or failure(c["status"], c["answer"], c["error"]) is not None
        fixed += int((r["attempt"] or 0) > 0 and not failed)
        gave_up += int((r["attempt"] or 0) >= ctx.cfg.rollout.repair_attempts > 0 and failed)
    return {"fixed": fixed, "gave_up": gave_up}
