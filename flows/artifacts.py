"""Results in the Prefect UI: the artifacts a flow run publishes (prefect.artifacts), so that a user who ran
`prefect deployment run experiment/demo` reads the answer on the flow run's Artifacts tab.

  <run>-round-<k>            table: per stage of round k its figures from the store and its wall seconds
  <eval run id>              table: a held-out evaluation's Mean@L, Best@L, Majority@L, valid share, tokens
  <experiment>-paired        table: trained - base per round and metric with both bootstrap intervals
  <experiment>-evaluations   table: every (seed, round) evaluation of the experiment
  <experiment>-summary       markdown: the headline lines (as printed) and where the results are
  <run or experiment>-report link: the HTML report (a file:// link for a local store)
  <experiment>-ablation      markdown and a `-paired` table for `ablate`
  <experiment>-methods       markdown and a `-paired` table for `compare-methods`

Keys make each artifact one line of history across flow runs (Prefect keeps every version). All numbers are read
from the store or the library's summaries; nothing here computes a result.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from pipeline.store import Store
from pipeline.studies.formatting import metric_name, rounded
from pipeline.studies.report import round_stats, stage_timings, status_counts
from pipeline.studies.summaries import (
    AblationSummary,
    EvalSummary,
    ExperimentSummary,
    MethodsSummary,
    PairedDiff,
    RoundDiff,
)

# the figures of each stage, as (label, round_stats column)
STAGE_FIGURES = {
    "rollout": [("workflows", "workflows"), ("valid share", "valid_share"),
                ("generator tokens per query", "gen_tokens_per_query")],
    "score": [("scored workflows", "scored"), ("mean score", "mean_score"), ("best score", "best_score"),
              ("executor calls", "llm_calls"), ("executor tokens per query", "exec_tokens_per_query"),
              ("executor cache hit rate", "cache_hit_rate"),
              ("executor completion tokens computed", "computed_tokens_out"),
              ("replies cut at the token cap", "truncated_calls")],
    "curate": [("groups kept", "groups_kept")],
    "train": [("optimiser steps", "steps"), ("mean loss", "loss"), ("mean KL", "kl"),
              ("mean clip fraction", "clip_frac"), ("tokens", "train_tokens")],
}


def artifact_key(*parts: object) -> str:
    """Prefect keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


def link_to(path) -> str:
    p = str(path)
    return p if "://" in p else Path(p).resolve().as_uri()


def round_rows(store: Store, run_id: str, k: int) -> list[dict]:
    stats = round_stats(store, run_id).filter(pl.col("round") == k).to_dicts()
    r = stats[0] if stats else {}
    walls = {t["stage"]: t["wall_s"] for t in stage_timings(store, run_id).filter(pl.col("round") == k).to_dicts()}
    st = status_counts(store, run_id).filter(pl.col("round") == k)
    rows = []
    for stage, figures in STAGE_FIGURES.items():
        rows.append({"stage": stage, "figure": "wall seconds", "value": walls.get(stage)})
        rows += [{"stage": stage, "figure": label, "value": rounded(r.get(col))} for label, col in figures]
        if stage == "score":
            rows.append({"stage": stage, "figure": "status of the latest runs",
                         "value": ", ".join(f"{s} {n}" for s, n in zip(st["status"], st["n"], strict=True))})
    return rows


def publish_round(run_id: str, store_root: str, k: int) -> None:
    """Round k's table; the signature of `run_rounds`' after_round."""
    store = Store(store_root)
    rows = round_rows(store, run_id, k)
    mean = next(x["value"] for x in rows if x["figure"] == "mean score")
    create_table_artifact(rows, key=artifact_key(run_id, "round", k),
                          description=f"run {run_id} round {k}: mean score {mean}")


def figure_rows(summary: EvalSummary, tokens: bool = True) -> dict:
    """label -> value of an evaluation's figures that it has."""
    return {label: rounded(v) for label, v in summary.figures(tokens) if v is not None}


def publish_evaluation(s: EvalSummary, run_id: str, k: int, split: str) -> None:
    """`s`: the evaluation's `eval_summary`."""
    rows = [{"metric": label, "value": v} for label, v in figure_rows(s).items()]
    rows.append({"metric": "status of the latest runs", "value": ", ".join(f"{st} {n}" for st, n in s.status.items())})
    what = "the base model" if k < 0 else f"round {k}'s checkpoint"
    create_table_artifact(rows, key=artifact_key(s.eval_run_id),
                          description=f"held-out {split}: {what} of run {run_id} ({s.eval_run_id})")


def paired_rows(paired: list[PairedDiff]) -> list[dict]:
    """Each paired difference as a table row: what it pairs (round; or arm, against [and the other arm's metric]),
    both arms' means where it has them, the difference with its intervals over pairs and over queries."""
    return [{**p.pairing(), "metric": metric_name(p.metric),
             **({"base": rounded(p.base), "trained": rounded(p.trained)} if isinstance(p, RoundDiff) else {}),
             "difference": rounded(p.mean), "lo": rounded(p.lo), "hi": rounded(p.hi),
             "lo (resampling queries)": rounded(p.lo_by_query), "hi (resampling queries)": rounded(p.hi_by_query),
             "pairs": p.n, "level": p.level} for p in paired]


def publish_experiment(summary: ExperimentSummary, report: Path | str) -> None:
    exp = summary.experiment
    create_table_artifact(paired_rows(summary.paired), key=artifact_key(exp, "paired"),
                          description=f"experiment {exp}: trained - base, held-out {summary.split}, "
                                      f"L={summary.eval_l}, seeds {summary.seeds}")
    arms = [{"seed": a.seed, "round": "base" if a.round < 0 else a.round, **figure_rows(a, tokens=False)}
            for a in summary.arms]
    create_table_artifact(arms, key=artifact_key(exp, "evaluations"),
                          description=f"experiment {exp}: every held-out evaluation")
    lines = summary.headline() or ["no evaluation yet"]
    create_markdown_artifact("\n".join(f"- {x}" for x in lines) + f"\n\nReport: {link_to(report)}",
                             key=artifact_key(exp, "summary"), description=f"experiment {exp}: the result")
    create_link_artifact(link_to(report), link_text=f"experiment {exp} report", key=artifact_key(exp, "report"))


def publish_ablation(summary: AblationSummary) -> None:
    exp = summary.experiment
    create_table_artifact(paired_rows(summary.paired), key=artifact_key(exp, "ablation-paired"),
                          description=f"ablation {exp}: paired differences per arm")
    create_markdown_artifact(summary.table(), key=artifact_key(exp, "ablation"), description=f"ablation {exp}")
    if summary.results:
        md = f"{summary.results}/ablation.md" if "://" in summary.results else Path(summary.results) / "ablation.md"
        create_link_artifact(link_to(md), link_text=f"ablation {exp} results", key=artifact_key(exp, "ablation-report"))


def publish_methods(summary: MethodsSummary) -> None:
    exp = summary.experiment
    create_table_artifact(paired_rows(summary.paired), key=artifact_key(exp, "methods-paired"),
                          description=f"methods {exp}: paired differences")
    create_markdown_artifact(summary.table(), key=artifact_key(exp, "methods"), description=f"methods {exp}")


def publish_report_link(run_id: str, report: Path | str) -> None:
    create_link_artifact(link_to(report), link_text=f"run {run_id} report", key=artifact_key(run_id, "report"))
