"""The headroom study (`pipeline headroom CONFIG`): before any training run, is there room for a query-level
generator to beat the best fixed workflow at the same budget?

Every design of the menu (`headroom.designs`, default `rollout.example_menu` as `program:<file>` methods) runs as a
fixed program on the first `headroom.queries` queries of `split` (dev), `reps` runs per query: each a baseline run
(pipeline.studies.baselines) `<run_id>-headroom-baseline-<split>-<design>` whose L = reps copies of the program are
the runs, through the normal score stage (resumed like any baseline). The maths is pipeline.core.headroom: (a) the
best single design, (b) the per-query oracle over designs, cross-fitted (chosen on one run, scored on another) at
(a)'s executor budget (`headroom.budget_rule`), (c) the score-vs-executor-tokens frontier with the oracle anchored at
every design, and, with queries from several parts (reasoning-gym families), the best design per part and the
cross-fitted router over parts. Whether each design's runs are replays of each other (a temperature-0 executor
answering the second run from the reply cache): then the cross-fitted oracle is the in-sample one, and the study says
so. (c) The learnable room: the project's learned router (TF-IDF + logistic regression per design over the query's
text, pipeline.studies.router, its setting chosen inside the fit folds from `experiment.router`'s c_grid and
analyzers) fitted on `headroom.folds` - 1 folds of the queries and scored on the held-out one, minus the best single
design chosen on the same fit folds, with a bootstrap interval over queries; the same for the per-part router with
several parts. The gate: a task goes on to training only where (c) >= `headroom.gate` (the point estimate): the room
a router fitted on other queries did reach, not the oracle's, which chooses on the scores it is judged on.

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
from itertools import product
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.config import ConfigError, RouterConfig, RunConfig, variant_sets
from pipeline.core.headroom import (
    Room,
    Runs,
    best_design,
    cross_fit,
    design_points,
    fold_labels,
    frontier,
    gain_per_query,
    gain_within,
    in_sample_only,
    learnable_room,
    pareto,
    part_room,
    part_router,
    replays,
)
from pipeline.core.learning import bootstrap_ci
from pipeline.engines.servers import sharing
from pipeline.store import Store, store_for
from pipeline.store.views import TRUNCATED_SHARE_SQL
from pipeline.studies.baselines import PROGRAM_PREFIX, baseline_run_id, check_method, method_tag, run_baseline
from pipeline.studies.formatting import num, signed, span
from pipeline.studies.router import Embed, embedder, hidden_layer, text_chances
from pipeline.studies.summaries import (
    DesignPoint,
    DesignRow,
    GateAnalysis,
    HeadroomReport,
    HeadroomSummary,
    OracleResult,
    PartResult,
    ReplayRow,
    RoomResult,
)

log = logging.getLogger(__name__)

FRONTIER_PNG = "frontier.png"
DEFAULT_SETTINGS = ((1.0, "char_wb"),)  # scikit-learn's default C, character n-grams: with no grid given


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
    executor tokens, part (the procedural task, else the benchmark) and the query's text (`prompt`)."""
    return store.sql(
        "SELECT s.query_id, s.slot, s.score, coalesce(s.tokens_in, 0) + coalesce(s.tokens_out, 0) AS tokens, "
        "coalesce(json_extract_string(q.meta, '$.task'), q.benchmark) AS part, q.prompt "
        "FROM generation_scores s JOIN (SELECT query_id, any_value(meta) AS meta, any_value(benchmark) AS benchmark, "
        "any_value(prompt) AS prompt FROM queries WHERE run_id = $run GROUP BY query_id) q USING (query_id) "
        "WHERE s.run_id = $run AND s.round = 0 AND s.kind = 'workflow' AND s.final ORDER BY s.query_id, s.slot",
        {"run": run_id}, run=run_id)


def truncated_share(store: Store, run_id: str) -> float | None:
    """Of the run's scoring calls whose truncation was recorded, the share with a reply cut at the token cap."""
    df = store.sql(f"SELECT {TRUNCATED_SHARE_SQL} AS share FROM latest_scores WHERE run_id = $run", {"run": run_id},
                   run=run_id)
    return None if df.height == 0 else df["share"][0]


def build_runs(frames: dict[str, pl.DataFrame], reps: int) -> tuple[Runs, list[str], list[str], list[str]]:
    """`Runs` over the queries every design ran `reps` times to a final score, their parts, their texts (a frame's
    `prompt` column; "" without one), and the queries left out (fewer runs or a run not final in some design)."""
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
    texts: dict[str, str] = {}
    index = {q: i for i, q in enumerate(kept)}
    for number, design in enumerate(designs):
        ran = frames[design].filter(pl.col("query_id").is_in(kept) & (pl.col("slot") < reps))
        if "prompt" not in ran.columns:
            ran = ran.with_columns(prompt=pl.lit(""))
        for q, slot, score, tok, part, text in ran.select("query_id", "slot", "score", "tokens", "part",
                                                          "prompt").iter_rows():
            scores[number, index[q], slot], tokens[number, index[q], slot] = score, tok
            parts[q] = part
            texts[q] = text or texts.get(q, "")
    return (Runs(designs, tuple(kept), scores, tokens), [parts[q] for q in kept], [texts[q] for q in kept],
            sorted(every - set(kept)))


def router_settings(cfg: RunConfig) -> list[tuple[float, str]]:
    """The learned router's settings (C, analyzer) the fit folds choose among: `experiment.router`'s grid (its
    defaults where the config has no router), in its order (analyzers, then C: as
    pipeline.studies.router.fit_router tries them on dev)."""
    router = cfg.experiment.router or RouterConfig()
    return [(c, analyzer) for analyzer, c in product(router.analyzers, router.c_grid)]


def features_named(settings: Sequence[tuple[float, str]]) -> str:
    """The features the settings try, in words: "TF-IDF" alone where no setting reads hidden states."""
    return " or ".join(dict.fromkeys("TF-IDF" if hidden_layer(a) is None else "hidden states" for _, a in settings))


def setting_name(setting: tuple[float, str]) -> str:
    return f"{setting[1]} C={setting[0]:g}"


def room_result(room: Room, note: str, settings: Sequence[tuple[float, str]] = ()) -> RoomResult:
    """A `Room` as the summary's record, its gain's 95% interval from the per-query differences (queries
    resampled, pipeline.core.learning.bootstrap_ci)."""
    ci = bootstrap_ci(room.differences)
    picked = [setting_name(settings[i]) for i in room.settings]
    return RoomResult(router=room.name, score=room.score, tokens=room.tokens, best_score=room.best_score,
                      best_tokens=room.best_tokens, gain=room.gain, gain_interval=[ci.lo, ci.hi], folds=room.folds,
                      chosen=room.chosen, best_chosen=room.best_chosen,
                      settings={n: picked.count(n) / len(picked) for n in dict.fromkeys(picked)}, note=note)


def learnable(runs: Runs, parts: Sequence[str], texts: Sequence[str], folds: int = 5,
              settings: Sequence[tuple[float, str]] = DEFAULT_SETTINGS, embed: Embed | None = None
              ) -> tuple[RoomResult, RoomResult | None]:
    """The learnable room (module doc): the learned router over the query texts (one of `settings`, (C, analyzer),
    chosen inside the fit folds) and, with several parts, the per-part router, each cross-fitted over `folds` folds
    of the queries (fewer where there are fewer queries) against the best single design chosen on the same folds."""
    if len(texts) != len(runs.queries):
        raise ValueError(f"headroom: {len(texts)} query texts for {len(runs.queries)} queries")
    if not settings:
        raise ValueError("headroom: no router setting to fit (experiment.router.c_grid and analyzers)")
    labels = fold_labels(parts, min(folds, len(runs.queries)))
    scores = runs.scores.mean(axis=2)
    fitted: dict[tuple[bytes, int], tuple[np.ndarray, np.ndarray]] = {}

    def predict(fit: np.ndarray, held: np.ndarray, setting: int) -> np.ndarray:
        # one fit predicts every query outside it: the inner fold g of outer fold f and the inner fold f of outer
        # fold g share their fit (all but f and g), so each such fit is made once (fit and held come sorted)
        key = (fit.tobytes(), setting)
        if key not in fitted:
            rest = np.setdiff1d(np.arange(len(texts)), fit)
            c, analyzer = settings[setting]
            fitted[key] = rest, text_chances([texts[i] for i in fit], scores[:, fit], [texts[i] for i in rest], c,
                                             analyzer, embed)
        rest, chance = fitted[key]
        return chance[np.searchsorted(rest, held)]

    count = len(set(labels.tolist()))
    grid = ", ".join(setting_name(x) for x in settings)
    learned = room_result(learnable_room(runs, labels, predict, len(settings)),
                          f"{features_named(settings)} + logistic regression per design over the query text "
                          "(pipeline.studies.router), "
                          f"fitted on {count - 1} of {count} query folds and scored on the other, its setting chosen "
                          f"inside the fit folds among {grid}; against the best single design chosen on the same "
                          "fit folds", settings)
    if len(set(parts)) < 2:
        return learned, None
    return learned, room_result(part_room(runs, parts, labels),
                                f"one design per part (reads the part label), chosen on {count - 1} of {count} "
                                "query folds and scored on the other; against the best single design chosen on the "
                                "same fit folds")


def analyse(runs: Runs, parts: Sequence[str], rule: str, gate: float, texts: Sequence[str], folds: int = 5,
            settings: Sequence[tuple[float, str]] = DEFAULT_SETTINGS, embed: Embed | None = None) -> GateAnalysis:
    """Everything the study reports, from the runs and the queries' parts and texts (pure apart from the numbers'
    rounding: none). The gate reads the learnable room of the learned router (`learnable`), not the oracle.
    `embed`: the base model's hidden states, for `hidden:<layer>` settings."""
    points = design_points(runs)
    best = best_design(runs)
    oracle = cross_fit(runs, rule, best)
    in_sample = cross_fit(runs, rule, best, in_sample=True)
    front = frontier(runs, rule)
    on_front = pareto(points)
    interval = bootstrap_ci(gain_per_query(runs, rule, best))  # the oracle's gain's 95% interval, queries resampled
    learned, by_part = learnable(runs, parts, texts, folds, settings, embed) if len(runs.queries) >= 2 else (None, None)
    out = GateAnalysis(
        designs=[DesignRow(**asdict(p), pareto=on) for p, on in zip(points, on_front, strict=True)],
        best=DesignPoint(**asdict(points[best])), oracle=OracleResult(**asdict(oracle)),
        oracle_in_sample=OracleResult(**asdict(in_sample)), gain=oracle.score - points[best].score, gate=gate,
        rule=rule, gain_interval=[interval.lo, interval.hi], passes=learned is not None and learned.gain >= gate,
        frontier=[OracleResult(**asdict(o), gain=gain_within(points, o)) for o in front],
        queries=len(runs.queries), reps=runs.reps,
        replay=[ReplayRow(**asdict(r)) for r in replays(runs)], oracle_in_sample_only=in_sample_only(runs),
        learnable=learned, learnable_part=by_part, gate_on="learnable")
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
                 reps: int | None = None, sets: list[str] | None = None) -> HeadroomReport:
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
    runs, parts, texts, dropped = build_runs(frames, reps)
    settings = router_settings(cfg)
    analysis = analyse(runs, parts, cfg.headroom.budget_rule, cfg.headroom.gate, texts, cfg.headroom.folds,
                       settings, embedder(cfg.generator.model, [a for _, a in settings]))
    summary = HeadroomReport(run_id=cfg.run_id, config=str(path), sets=sets, split=split, design_runs=runs_of,
                              dropped=dropped, **analysis.field_values())
    for row in summary.designs:
        row.truncated_share = truncated_share(store, runs_of[row.name])
    summary.results = str(write_outputs(store, summary, runs))
    return summary


def write_outputs(store: Store, summary: HeadroomReport, runs: Runs) -> Path:
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


def replay_line(rows: Sequence[ReplayRow], in_sample: bool | None) -> str:
    """Whether the designs' runs are replays: if every design scored the same on every run of every query, the
    cross-fitted oracle is the in-sample one."""
    shares = ", ".join(f"{r.design} {r.same_scores:.0%} ({r.same_runs:.0%} same tokens too)" for r in rows)
    if in_sample:
        return (f"runs identical: every design scored the same on every run of every query ({shares}): a replay "
                "(an executor at temperature 0 answering again from its reply cache), so the cross-fitted oracle is "
                "the in-sample one")
    replayed = [r.design for r in rows if r.same_runs == 1.0]
    return (f"runs identical (share of queries, scores): {shares}"
            + (f"; replayed on every query (scores and tokens): {', '.join(replayed)}, whose runs cross-fitting "
               "cannot tell apart" if replayed else ""))


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
    learned = getattr(summary, "learnable", None)
    room = "" if learned is None else f", learnable {learned.gain:+.3f}"
    axes.set_title(f"headroom {summary.run_id}: oracle gain {summary.gain:+.3f}{room}, gate {summary.gate:.2f} "
                   f"{'passed' if summary.passes else 'not passed'}", fontsize="medium")
    # beside the axes: inside, it hides the designs' labels
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return fig


def markdown(summary: HeadroomReport) -> list[str]:
    """The study as lines of Markdown (the CLI prints them): the oracle, whether its runs are replays, the learnable
    room and the gate, the designs' table, per part. A summary written before the learnable room: its gate line as
    it read then (on the oracle)."""
    best, oracle, in_sample = summary.best, summary.oracle, summary.oracle_in_sample
    interval = summary.gain_interval  # None in summaries written before the interval existed
    learned = getattr(summary, "learnable", None)
    verdict = "PASSES: go on to training" if summary.passes else "does not pass: no training run"
    lines = [f"headroom {summary.run_id} on {summary.split}: {summary.queries} queries x {summary.reps} "
             f"runs ({len(summary.dropped)} left out: not final in every design)",
             f"(a) best single design: {best.name} {best.score:.3f} at {best.tokens:.0f} executor tokens per run",
             f"(b) per-query oracle, cross-fitted ({oracle.rule}, budget {oracle.budget:.0f}): {oracle.score:.3f} at "
             f"{oracle.tokens:.0f} tokens; in sample (optimistic) {in_sample.score:.3f}"]
    oracle_gain = (f"{summary.gain:+.3f}" + (f" {span(*interval)} (95%, queries resampled)" if interval is not None
                                             else ""))
    if learned is None:
        lines.append(f"gain (b) - (a): {oracle_gain}; gate {summary.gate:.2f} on the point estimate: {verdict}")
    else:
        lines.append(f"gain (b) - (a): {oracle_gain}: the oracle chooses on the scores it is judged on, an upper "
                     "bound; the gate reads (c)")
        lines.append(replay_line(summary.replay, summary.oracle_in_sample_only))
        lines.append(f"(c) learnable room: learned router fitted on other queries ({learned.folds} folds) "
                     f"{learned.score:.3f} at {learned.tokens:.0f} tokens, best single design chosen on the same "
                     f"folds {learned.best_score:.3f} at {learned.best_tokens:.0f}: {learned.gain:+.3f} "
                     f"{span(*learned.gain_interval)} (95%, queries resampled); settings "
                     + ", ".join(f"{name} {share:.0%}" for name, share in learned.settings.items()))
        if summary.learnable_part is not None:
            part = summary.learnable_part
            lines.append(f"    per-part router, the same folds: {part.score:.3f} at {part.tokens:.0f} tokens: "
                         f"{part.gain:+.3f} {span(*part.gain_interval)} over the fold-chosen best design")
        lines.append(f"gate {summary.gate:.2f} on (c)'s point estimate: {verdict}")
    oracle_at = {point.anchor: point for point in summary.frontier}
    if summary.frontier[0].gain is not None:  # summaries written before the column have none
        top = max(summary.frontier, key=lambda point: point.gain)
        lines.append(f"largest gain along the frontier: {top.gain:+.3f} at {top.anchor}'s budget "
                     f"({top.budget:.0f} tokens) over the designs within it ((b) reads it at (a)'s budget)")
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
        lines.append(f"router over parts (one design per part, cross-fitted over runs): {router.score:.3f} at "
                     f"{router.tokens:.0f} tokens per run")
    return lines
