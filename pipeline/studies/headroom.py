"""The headroom study (`pipeline headroom CONFIG`): before any training run, is there room for a query-level
generator to beat the best fixed workflow at the same budget?

Every design of the menu (`headroom.designs`, default `rollout.example_menu` as `program:<file>` methods) runs as a
fixed program on the first `headroom.queries` queries of `split` (dev), `reps` runs per query: each a baseline run
(pipeline.studies.baselines) `<run_id>-headroom-baseline-<split>-<design>` whose L = reps copies of the program are
the runs, through the normal score stage (resumed like any baseline). The maths is pipeline.core.headroom: (a) the
best single design, (b) the per-query oracle over designs, cross-fitted (chosen on one run, scored on another) at
(a)'s executor budget (`headroom.budget_rule`), (c) the score-vs-executor-tokens frontier with the oracle anchored at
every design, and, with queries from several parts (reasoning-gym families), the best design per part and the
cross-fitted router over parts. The gate: a task goes on to training only where (b) − (a) >= `headroom.gate`.

Only queries that every design ran `reps` times to a final status count (a transient executor failure leaves a query
out until `pipeline score --only-failed` re-runs it; `dropped` counts them). Outputs under
`<store>/headroom/<run_id>/`: headroom.json (everything), designs.csv (the table), per_query.csv (every design x
query x run), frontier.png, headroom.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.config import ConfigError, RunConfig, variant_sets
from pipeline.core.headroom import (
    Runs,
    best_design,
    cross_fit,
    design_points,
    frontier,
    gain_per_query,
    gain_within,
    pareto,
    part_router,
)
from pipeline.core.learning import bootstrap_ci
from pipeline.engines.servers import sharing
from pipeline.store import Store, store_for
from pipeline.store.views import TRUNCATED_SHARE_SQL
from pipeline.studies.baselines import PROGRAM_PREFIX, baseline_run_id, check_method, method_tag, run_baseline
from pipeline.studies.formatting import num, signed, span
from pipeline.studies.summaries import (
    DesignPoint,
    DesignRow,
    HeadroomAnalysis,
    HeadroomSummary,
    OracleResult,
    PartResult,
)

log = logging.getLogger(__name__)

FRONTIER_PNG = "frontier.png"


def headroom_designs(cfg: RunConfig) -> list[str]:
    """The study's designs as baseline methods: `headroom.designs`, else the example menu's programs."""
    designs = list(cfg.headroom.designs) or [PROGRAM_PREFIX + p for p in cfg.rollout.example_menu]
    if len(designs) < 2:
        raise ConfigError(f"headroom: {len(designs)} design(s); set headroom.designs or rollout.example_menu to two "
                          "or more (a per-query choice needs something to choose from)")
    if len(set(map(method_tag, designs))) != len(designs):
        raise ConfigError(f"headroom: designs repeat: {designs}")
    for d in designs:
        check_method(d)
    return designs


def study_changes(cfg: RunConfig, reps: int) -> dict[str, int | None]:
    """Changes of every design's run: L = reps runs per query, the first `headroom.queries` queries."""
    return {"experiment.eval_l": reps, "experiment.eval_queries": cfg.headroom.queries}


def owner(cfg: RunConfig) -> str:
    """The run id the designs' baseline runs are named after: apart from an experiment's own reference runs."""
    return f"{cfg.run_id}-headroom"


def headroom_dir(store: Store, run_id: str) -> Path:
    return store.root / "headroom" / run_id


def design_rows(store: Store, run_id: str) -> pl.DataFrame:
    """One row per (query, slot = run) of a design's baseline run: its score (invalid: 0; null: not final),
    executor tokens and part (the procedural task, else the benchmark)."""
    return store.sql(
        "SELECT s.query_id, s.slot, s.score, coalesce(s.tokens_in, 0) + coalesce(s.tokens_out, 0) AS tokens, "
        "coalesce(json_extract_string(q.meta, '$.task'), q.benchmark) AS part "
        "FROM generation_scores s JOIN (SELECT query_id, any_value(meta) AS meta, any_value(benchmark) AS benchmark "
        "FROM queries WHERE run_id = $run GROUP BY query_id) q USING (query_id) "
        "WHERE s.run_id = $run AND s.round = 0 AND s.kind = 'workflow' AND s.final ORDER BY s.query_id, s.slot",
        {"run": run_id})


def truncated_share(store: Store, run_id: str) -> float | None:
    """Of the run's scoring calls whose truncation was recorded, the share with a reply cut at the token cap."""
    df = store.sql(f"SELECT {TRUNCATED_SHARE_SQL} AS share FROM latest_scores WHERE run_id = $run", {"run": run_id})
    return None if df.height == 0 else df["share"][0]


def build_runs(frames: dict[str, pl.DataFrame], reps: int) -> tuple[Runs, list[str], list[str]]:
    """`Runs` over the queries every design ran `reps` times to a final score, their parts, and the queries left out
    (fewer runs or a run not final in some design)."""
    full: dict[str, set[str]] = {}
    for design, df in frames.items():
        done = df.filter(pl.col("score").is_not_null() & (pl.col("slot") < reps))
        counts = done.group_by("query_id").len()
        full[design] = set(counts.filter(pl.col("len") == reps)["query_id"].to_list())
    every = set.union(*(set(df["query_id"].to_list()) for df in frames.values()))
    kept = sorted(set.intersection(*full.values()))
    if not kept:
        raise ConfigError(f"headroom: no query has {reps} final runs of every design ({len(every)} queries seen); "
                          "re-run the study (it resumes) or `pipeline score --only-failed` the design runs")
    designs = tuple(frames)
    scores = np.zeros((len(designs), len(kept), reps))
    tokens = np.zeros_like(scores)
    parts: dict[str, str] = {}
    index = {q: i for i, q in enumerate(kept)}
    for i, design in enumerate(designs):
        ran = frames[design].filter(pl.col("query_id").is_in(kept) & (pl.col("slot") < reps))
        for q, slot, score, tok, part in ran.iter_rows():
            scores[i, index[q], slot], tokens[i, index[q], slot] = score, tok
            parts[q] = part
    return Runs(designs, tuple(kept), scores, tokens), [parts[q] for q in kept], sorted(every - set(kept))


def analyse(runs: Runs, parts: Sequence[str], rule: str, gate: float) -> HeadroomAnalysis:
    """Everything the study reports, from the runs (pure apart from the numbers' rounding: none)."""
    points = design_points(runs)
    best = best_design(runs)
    oracle = cross_fit(runs, rule, best)
    in_sample = cross_fit(runs, rule, best, in_sample=True)
    front = frontier(runs, rule)
    on_front = pareto(points)
    ci = bootstrap_ci(gain_per_query(runs, rule, best))  # the gain's 95% interval, queries resampled
    out = HeadroomAnalysis(
        designs=[DesignRow(**asdict(p), pareto=on) for p, on in zip(points, on_front, strict=True)],
        best=DesignPoint(**asdict(points[best])), oracle=OracleResult(**asdict(oracle)),
        oracle_in_sample=OracleResult(**asdict(in_sample)), gain=oracle.score - points[best].score, gate=gate,
        rule=rule, gain_interval=[ci.lo, ci.hi], passes=oracle.score - points[best].score >= gate,
        frontier=[OracleResult(**asdict(o), gain=gain_within(points, o)) for o in front],
        queries=len(runs.queries), reps=runs.reps)
    if len(set(parts)) > 1:
        router, chosen = part_router(runs, parts, best)
        for part in sorted(set(parts)):
            members = [i for i, x in enumerate(parts) if x == part]
            out.per_part[part] = PartResult(queries=len(members), best=chosen[part], scores={
                d: float(runs.scores[i][members].mean()) for i, d in enumerate(runs.designs)})
        out.part_router = OracleResult(**asdict(router))
    return out


def status(config: str | Path, run_id: str | None = None, split: str = "dev", reps: int | None = None,
           sets: list[str] | None = None) -> list[dict]:
    """Where the study stands, read from the store (nothing runs): per design's run, its stages done and their wall
    seconds (`pipeline.studies.experiment.stage_rows`), for `pipeline headroom --status`."""
    from pipeline.stages.rounds import study_config

    cfg = study_config(config, sets or [], run_id)[2]
    return stage_status(store_for(cfg.store), cfg, split, reps or cfg.headroom.reps)


def stage_status(store: Store, cfg: RunConfig, split: str, reps: int) -> list[dict]:
    """`status` of a loaded config: the designs' runs as planned runs of one round (rollout, score)."""
    from pipeline.studies.evaluate import EVAL_STAGES
    from pipeline.studies.experiment import stage_rows

    n = cfg.headroom.queries
    planned = None if n is None else n * reps  # None (all queries): each design's rollout gives its count
    return stage_rows(store, [(f"design on {split}", baseline_run_id(owner(cfg), method_tag(d), split), 1,
                               EVAL_STAGES, planned) for d in headroom_designs(cfg)])


def run_headroom(config: str | Path, call=None, run_id: str | None = None, split: str = "dev",
                 reps: int | None = None, sets: list[str] | None = None) -> HeadroomSummary:
    """Run (or resume) every design on `split` through `call` (a stage caller; default in this process), analyse,
    write the outputs; returns the summary (`analyse` plus run ids, truncation shares, dropped queries, `results`)."""
    from pipeline.stages.rounds import direct_call, study_config

    path, sets, cfg = study_config(config, sets, run_id)
    reps = reps or cfg.headroom.reps
    if reps < 2:
        raise ConfigError(f"headroom: --reps {reps}; cross-fitting needs at least 2 runs per design and query")
    designs = headroom_designs(cfg)
    call = call or direct_call()
    store = store_for(cfg.store)
    extra = variant_sets(study_changes(cfg, reps), before=sets)
    runs_of = {method_tag(d): baseline_run_id(owner(cfg), method_tag(d), split) for d in designs}
    left = not all(r["done"] for r in stage_status(store, cfg, split, reps))  # all done: read back, start nothing
    with sharing(cfg, headroom_dir(store, cfg.run_id) / "server-logs") if left else nullcontext():
        for d in designs:
            log.info("headroom: design %s on %s (%d runs per query)", d, split, reps)
            run_baseline(str(path), d, call, owner(cfg), split, extra)
    frames = {tag: design_rows(store, rid) for tag, rid in runs_of.items()}
    runs, parts, dropped = build_runs(frames, reps)
    analysis = analyse(runs, parts, cfg.headroom.budget_rule, cfg.headroom.gate)
    summary = HeadroomSummary(run_id=cfg.run_id, config=str(path), sets=sets, split=split, design_runs=runs_of,
                              dropped=dropped, **analysis.field_values())
    for row in summary.designs:
        row.truncated_share = truncated_share(store, runs_of[row.name])
    summary.results = str(write_outputs(store, summary, runs))
    return summary


def write_outputs(store: Store, summary: HeadroomSummary, runs: Runs) -> Path:
    """headroom.json, designs.csv, per_query.csv, frontier.png and headroom.md under <store>/headroom/<run_id>/."""
    dest = headroom_dir(store, summary.run_id)
    with store.output_dir(dest) as out:
        tmp = out / ".headroom.json.tmp"
        tmp.write_text(json.dumps(summary.to_dict(), indent=1, default=str))
        tmp.replace(out / "headroom.json")
        pl.DataFrame([row.to_dict() for row in summary.designs]).write_csv(out / "designs.csv")
        d, q, r = np.meshgrid(np.arange(len(runs.designs)), np.arange(len(runs.queries)), np.arange(runs.reps),
                              indexing="ij")
        pl.DataFrame({"design": [runs.designs[i] for i in d.ravel()], "query_id": [runs.queries[i] for i in q.ravel()],
                      "run": r.ravel(), "score": runs.scores.ravel(), "tokens": runs.tokens.ravel()}
                     ).write_csv(out / "per_query.csv")
        plot_frontier(summary, out / FRONTIER_PNG)
        (out / "headroom.md").write_text("\n".join(markdown(summary)) + "\n")
    return dest


def plot_frontier(summary: HeadroomSummary, out: Path):
    """Score vs executor tokens per run: each design (the Pareto ones joined), the cross-fitted oracle anchored at
    every design (its budget on x), the best design's oracle marked. Returns the matplotlib Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    axes = fig.add_subplot()
    pts = summary.designs
    axes.scatter([p.tokens for p in pts], [p.score for p in pts], color="C0", zorder=3, label="design (fixed)")
    for p in pts:
        axes.annotate(p.name.removeprefix("program-"), (p.tokens, p.score), fontsize="x-small",
                      xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in pts if p.pareto), key=lambda p: p.tokens)
    axes.plot([p.tokens for p in front], [p.score for p in front], color="C0", linewidth=1, alpha=0.6)
    orc = sorted(summary.frontier, key=lambda o: o.budget)
    axes.plot([o.budget for o in orc], [o.score for o in orc], color="C3", marker="x", linestyle="--",
              label=f"per-query oracle at each design's budget (cross-fitted, {summary.rule})")
    o = summary.oracle
    axes.scatter([o.tokens], [o.score], color="C3", marker="*", s=140, zorder=4,
                 label=f"oracle at the best design's budget: {o.score:.3f} (best {summary.best.score:.3f})")
    axes.set_xlabel("executor tokens per run (mean over queries and runs)")
    axes.set_ylabel(f"score (mean over {summary.queries} {summary.split} queries x {summary.reps} runs)")
    axes.set_title(f"headroom {summary.run_id}: gain {summary.gain:+.3f}, gate {summary.gate:.2f} "
                 f"{'passed' if summary.passes else 'not passed'}", fontsize="medium")
    # beside the axes: inside, it hides the designs' labels
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return fig


def markdown(summary: HeadroomSummary) -> list[str]:
    """The study as lines of Markdown (the CLI prints them): the gate, the designs' table, per part."""
    best, oracle, in_sample = summary.best, summary.oracle, summary.oracle_in_sample
    interval = summary.gain_interval  # None in summaries written before the interval existed
    lines = [f"headroom {summary.run_id} on {summary.split}: {summary.queries} queries x {summary.reps} "
             f"runs ({len(summary.dropped)} left out: not final in every design)",
             f"(a) best single design: {best.name} {best.score:.3f} at {best.tokens:.0f} executor tokens per run",
             f"(b) per-query oracle, cross-fitted ({oracle.rule}, budget {oracle.budget:.0f}): {oracle.score:.3f} at "
             f"{oracle.tokens:.0f} tokens; in sample (optimistic) {in_sample.score:.3f}",
             f"gain (b) - (a): {summary.gain:+.3f}"
             + (f" {span(*interval)} (95%, queries resampled)" if interval is not None else "")
             + f"; gate {summary.gate:.2f} on the point estimate: "
             + ("PASSES: go on to training" if summary.passes else "does not pass: no training run")]
    oracle_at = {point.anchor: point for point in summary.frontier}
    if summary.frontier[0].gain is not None:  # summaries written before the column have none
        top = max(summary.frontier, key=lambda point: point.gain)
        lines.append(f"largest gain along the frontier: {top.gain:+.3f} at {top.anchor}'s budget "
                     f"({top.budget:.0f} tokens) over the designs within it (the gate reads it at (a)'s budget)")
    lines += ["", "| design | score | executor tokens / run | Pareto | executor calls cut at the cap | oracle at its "
              "budget | oracle - the best design within that budget |", "|---|---|---|---|---|---|---|"]
    for row in summary.designs:
        anchored = oracle_at.get(row.name)
        lines.append(f"| {row.name} | {row.score:.3f} | {row.tokens:.0f} | {'yes' if row.pareto else ''} | "
                     f"{num(row.truncated_share)} | {num(anchored and anchored.score)} | "
                     f"{signed(anchored and anchored.gain)} |")
    if summary.per_part:
        names = [row.name for row in summary.designs]
        lines += ["", "| part | queries | best design | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
        lines += [f"| {part} | {v.queries} | {v.best} | " + " | ".join(f"{v.scores[n]:.3f}" for n in names) + " |"
                  for part, v in summary.per_part.items()]
        router = summary.part_router
        lines.append(f"router over parts (one design per part, cross-fitted): {router.score:.3f} at "
                     f"{router.tokens:.0f} tokens per run")
    return lines
