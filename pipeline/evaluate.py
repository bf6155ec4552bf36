"""Evaluation of a round's generator on a held-out split, without touching the run's training data.

The evaluation is its own run, `<run_id>-eval-r<k>` (`-eval-<split>-r<k>` for a split other than
test, `-eval-base` / `-eval-<split>-base` for the base model, k = -1): the trained run's config with
`benchmark.train_split=<split>` and `generator.adapter=<checkpoint of round k>`, rolled out and
scored at its round 0. Queries, generations and scores of the trained run are never written.

Prompts are built as in training: checkpoint k samples round k+1's workflows in the trained run, so its
evaluation shows exemplars drawn from the trained run's rounds <= k (`rollout.exemplar_run/round`); the
base model (k = -1) gets round 0's prompts, which have none. Held-out queries have no exemplars of their
own, so, as for any query without a pool in training, exemplars come from the run's whole pool.

`eval_summary` reports per-query Mean@L and Best@L (pipeline.learning), the valid share and the status mix,
with a workflow's score from the store's `generation_scores` view, as in curation (mean over reps, invalid = 0,
transient or unscored = no score yet). For a two-level run it adds the proposal's inference-time selection
(pipeline.selection: per query the best agent, then its best workflow) as Sel@L, `select_at_l`.
`evaluate_round` runs the evaluation's stages through a stage caller.
"""

from __future__ import annotations

from dataclasses import asdict

import polars as pl

from pipeline.config import ConfigError
from pipeline.run import RunContext, open_run
from pipeline.store import Store

EVAL_STAGES = ("rollout", "score")  # of pipeline.stages, run at round 0 of the evaluation run


def eval_run_id(run_id: str, round: int, split: str = "test") -> str:
    tag = "base" if round < 0 else f"r{round}"
    return f"{run_id}-eval-{tag}" if split == "test" else f"{run_id}-eval-{split}-{tag}"


def open_eval_run(store_root: str, run_id: str, round: int, split: str = "test",
                  sets: list[str] | None = None) -> RunContext:
    """Create (first call) or reopen the evaluation run of round `round`'s checkpoint (-1: base model)."""
    if split not in ("validate", "test"):
        raise ConfigError(f"split must be 'validate' or 'test', got {split!r}")
    store = Store(store_root)
    saved = store.run_dir(run_id) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"run {run_id!r} not found under {store.root}")
    eid = eval_run_id(run_id, round, split)
    if (store.run_dir(eid) / "config.yaml").is_file():
        return open_run(None, eid, 0, sets, str(store.root))
    adapter = "null"
    if round >= 0:
        ckpt = store.checkpoint_dir(run_id, round)
        if not ckpt.is_dir():
            raise ConfigError(f"run {run_id!r} has no checkpoint for round {round} ({ckpt}); train that round first")
        adapter = str(ckpt)
    frozen = [f"benchmark.train_split={split}", f"generator.adapter={adapter}", "rounds=1",
              f"store.root={store.root}", f"rollout.exemplar_run={run_id}", f"rollout.exemplar_round={round + 1}"]
    return open_run(saved, eid, 0, frozen + list(sets or []), str(store.root))


def eval_summary(store: Store, eval_id: str) -> dict:
    """Split-level Mean@L / Best@L / valid share over the eval run's queries, the status mix of its latest
    runs, and `per_query` (one dict per query: workflows, mean_at_l, best_at_l, valid_share, pending)."""
    from pipeline.curate import load_round
    from pipeline.learning import query_metrics, split_summary

    ctx = open_run(None, eval_id, 0, None, str(store.root))
    gens = load_round(ctx).filter(pl.col("kind") == "workflow")
    rows = [{"query_id": r["query_id"], "gen_id": r["gen_id"], "parent_id": r["parent_id"], "valid": r["valid"],
             "score": r["score"] if r["state"] == "ok" else None} for r in gens.iter_rows(named=True)]
    per_query = query_metrics(rows)
    status = store.sql("SELECT status, count(*) AS n FROM latest_scores WHERE run_id = $run AND round = 0 "
                       "GROUP BY status ORDER BY status", {"run": eval_id})
    out = {"eval_run_id": eval_id, **split_summary(per_query),
           "status": dict(zip(status["status"].to_list(), status["n"].to_list(), strict=True)),
           "per_query": [asdict(q) for q in per_query]}
    if ctx.cfg.rollout.mode == "two_level":
        add_selection(out, rows)
    return out


def add_selection(summary: dict, rows: list[dict]) -> None:
    """Two-level runs: the proposal's inference rule (pipeline.selection), per query and as the split's Sel@L
    (`select_at_l`), next to Mean@L and Best@L; each query also names its chosen agent and workflow."""
    from pipeline.selection import select_all, select_at_l

    chosen = {s.query_id: s for s in select_all(rows)}
    summary["select_at_l"] = select_at_l(list(chosen.values()))
    for q in summary["per_query"]:
        s = chosen.get(q["query_id"])
        q.update(select_at_l=s.score if s else None, selected_agent=s.agent_id if s else None,
                 selected_workflow=s.workflow_id if s else None)


def evaluate_round(store_root: str, run_id: str, round: int, split: str = "test", sets: list[str] | None = None,
                   call=None) -> dict:
    """Roll out and score round `round`'s checkpoint (-1: the base model) on `split` in its evaluation run,
    through `call` (a stage caller, default: `pipeline.stages.rounds.direct_call()`); returns `eval_summary`."""
    from pipeline.stages.rounds import direct_call

    call = call or direct_call()
    ctx = open_eval_run(store_root, run_id, round, split, sets)
    for stage in EVAL_STAGES:
        call(stage=stage, run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=sets)
    return eval_summary(ctx.store, ctx.run_id)
