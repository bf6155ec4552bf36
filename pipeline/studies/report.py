"""`pipeline report RUN_ID`: one HTML page with per-round plots and a summary table of a run.

All numbers come from the store's DuckDB views (`Store.sql`); stage wall times from the run's
append-only timings.jsonl (written by the flows). The page embeds plotly.js, so it opens offline.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import polars as pl

from pipeline.store import Store, round_stats
from pipeline.store.schema import STATUSES
from pipeline.store.views import design_spread, part_signal
from pipeline.studies.choices import choice_mix, choice_span, policy_odds
from pipeline.studies.formatting import num
from pipeline.studies.summaries import ExperimentSummary, ReferenceArm, RoundDiff


# Per round: generations and valid share, workflow scores (`generation_scores`), executor usage, generator and
# executor tokens per query (`query_usage`), curated groups and training metrics. FULL JOINs: a round that stopped
# early still shows what it has.
def score_distribution(store: Store, run_id: str) -> pl.DataFrame:
    return store.sql(
        "SELECT round, gen_id, score FROM generation_scores WHERE run_id = $run AND kind = 'workflow' "
        "AND score IS NOT NULL ORDER BY round, gen_id", {"run": run_id}, run=run_id)


def status_counts(store: Store, run_id: str) -> pl.DataFrame:
    return store.sql(
        "SELECT round, status, count(*) AS n FROM latest_scores WHERE run_id = $run GROUP BY round, status "
        "ORDER BY round, status", {"run": run_id}, run=run_id)


def train_curves(store: Store, run_id: str) -> pl.DataFrame:
    return store.sql(
        "SELECT round, step, loss, kl, clip_frac, tokens FROM train_metrics WHERE run_id = $run ORDER BY round, step",
        {"run": run_id}, run=run_id)


def write_study(store: Store, dest, name: str, body: dict, markdown: str):
    """A study's `<name>.json` (written whole or not at all) and `<name>.md` under `dest`; returns `dest`."""
    with store.output_dir(dest) as out:  # on object storage: written locally, then uploaded file by file
        tmp = out / f".{name}.json.tmp"
        tmp.write_text(json.dumps(body, indent=1, default=str))
        tmp.replace(out / f"{name}.json")
        (out / f"{name}.md").write_text(markdown + "\n")
    return dest


def timing_lines(store: Store, run_id: str) -> list[dict]:
    """The lines of the run's timings.jsonl (pipeline.stages.runner.record_timing), oldest first; none before the
    run's first timed stage."""
    path = store.run_dir(run_id) / "timings.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def stage_timings(store: Store, run_id: str) -> pl.DataFrame:
    """Wall seconds per (round, stage), and the machine that took them (null: a line written before lines named
    it): the last run of each stage that did work (skips are 0 s)."""
    rows = [r for r in timing_lines(store, run_id)
            if not r.get("skipped") and "shard" not in r]  # a sharded stage's own line is its total
    schema = {"round": pl.Int64, "stage": pl.String, "wall_s": pl.Float64, "machine": pl.String}
    return (pl.DataFrame([{c: r.get(c) for c in schema} for r in rows], schema=schema)
            .group_by("round", "stage", maintain_order=True).agg(pl.col("wall_s").last(), pl.col("machine").last())
            .sort("round"))


def _figures(store: Store, run_id: str, stats: pl.DataFrame) -> list[tuple[str, object]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rounds = stats["round"].to_list()
    figs: list[tuple[str, object]] = []

    dist = score_distribution(store, run_id)
    fig = go.Figure([go.Box(y=dist.filter(pl.col("round") == r)["score"].to_list(), name=f"round {r}",
                            boxpoints="all", jitter=0.4) for r in dist["round"].unique().sort().to_list()])
    fig.update_layout(yaxis_title="score per workflow (mean over reps)")
    figs.append(("Score distribution", fig))

    fig = go.Figure([go.Scatter(x=rounds, y=stats["mean_score"].to_list(), name="mean", mode="lines+markers"),
                     go.Scatter(x=rounds, y=stats["best_score"].to_list(), name="best", mode="lines+markers")])
    fig.update_layout(xaxis_title="round", yaxis_title="score", xaxis_dtick=1)
    figs.append(("Mean and best score", fig))

    fig = go.Figure(go.Bar(x=rounds, y=stats["valid_share"].to_list()))
    fig.update_layout(xaxis_title="round", yaxis_title="share of valid workflows", yaxis_range=[0, 1], xaxis_dtick=1)
    figs.append(("Valid workflows", fig))

    st = status_counts(store, run_id)
    present = [s for s in STATUSES if s in set(st["status"].to_list())]
    fig = go.Figure([go.Bar(x=st.filter(pl.col("status") == s)["round"].to_list(),
                            y=st.filter(pl.col("status") == s)["n"].to_list(), name=s) for s in present])
    fig.update_layout(barmode="stack", xaxis_title="round", yaxis_title="runs", xaxis_dtick=1)
    figs.append(("Status counts", fig))

    tc = train_curves(store, run_id).with_row_index("global_step")
    fig = make_subplots(rows=1, cols=3, subplot_titles=("loss", "KL", "clip fraction"))
    for r in tc["round"].unique().sort().to_list():
        part = tc.filter(pl.col("round") == r)
        for col, name in enumerate(("loss", "kl", "clip_frac"), start=1):
            fig.add_trace(go.Scatter(x=part["global_step"].to_list(), y=part[name].to_list(), mode="lines+markers",
                                     name=f"round {r}", legendgroup=str(r), showlegend=col == 1), row=1, col=col)
    fig.update_xaxes(title_text="optimiser step (all rounds)")
    figs.append(("Training: loss, KL, clip fraction", fig))

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for name in ("tokens_in", "tokens_out", "computed_tokens_in", "computed_tokens_out", "train_tokens"):
        fig.add_trace(go.Bar(x=rounds, y=stats[name].to_list(), name=name), secondary_y=False)
    fig.add_trace(go.Scatter(x=rounds, y=stats["cost_usd"].to_list(), name="executor cost (USD)",
                             mode="lines+markers"), secondary_y=True)
    fig.update_yaxes(title_text="tokens", secondary_y=False)
    fig.update_yaxes(title_text="USD", secondary_y=True)
    fig.update_layout(xaxis_title="round", xaxis_dtick=1)
    figs.append(("Tokens and cost", fig))

    tim = stage_timings(store, run_id)
    fig = go.Figure([go.Bar(x=tim.filter(pl.col("stage") == s)["round"].to_list(),
                            y=tim.filter(pl.col("stage") == s)["wall_s"].to_list(), name=s)
                     for s in tim["stage"].unique(maintain_order=True).to_list()])
    fig.update_layout(barmode="stack", xaxis_title="round", yaxis_title="wall seconds", xaxis_dtick=1)
    figs.append(("Wall time per stage", fig))
    return figs


def _table(rows: pl.DataFrame) -> str:
    def cell(v: object) -> str:
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows.columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows.iter_rows())
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def build_report(store: Store, run_id: str, out: Path | None = None) -> Path:
    """Write the run's HTML report (default <store>/<run_id>/report.html) and return its path."""
    if not (store.run_dir(run_id) / "config.yaml").is_file():
        known = ", ".join(store.runs()) or "none"
        raise FileNotFoundError(f"run {run_id!r} not found under {store.root} (runs: {known})")
    stats = round_stats(store, run_id)
    tim = stage_timings(store, run_id)
    summary = stats
    if tim.height:
        walls = tim.pivot(on="stage", index="round", values="wall_s")
        walls = walls.rename({c: f"{c}_s" for c in walls.columns if c != "round"})
        walls = walls.with_columns(pl.sum_horizontal(pl.exclude("round")).alias("round_s"))
        summary = stats.join(walls.with_columns(pl.col("round").cast(stats["round"].dtype)), on="round", how="left")
    parts = [_part_and_design_tables(store, run_id)]
    for i, (title, fig) in enumerate(_figures(store, run_id, stats)):
        fig.update_layout(height=380, margin={"t": 30})
        parts.append(f"<h2>{html.escape(title)}</h2>" + fig.to_html(full_html=False, include_plotlyjs=i == 0))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>run {html.escape(run_id)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style>"
        f"</head><body><h1>Run {html.escape(run_id)}</h1><p>store: {html.escape(str(store.root))}</p>"
        f"<h2>Summary per round</h2>{_table(summary)}{''.join(parts)}</body></html>"
    )
    if out is None:
        out = store.run_dir(run_id) / "report.html"
        store.put_text(out, page)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


def _part_and_design_tables(store: Store, run_id: str) -> str:
    """HTML: per round and task part, the queries whose workflows' scores differ and the groups kept from them (a
    task of several parts only); with an example menu, whether a query's workflows span designs and each design's
    written and shown share."""
    out = ""
    signal = part_signal(store, run_id)
    if signal["part"].n_unique() > 1:
        out += ("<h2>By part: what the gradient sees</h2><p>queries_varied: queries whose workflows do not all score "
                f"the same, the only ones GRPO learns from</p>{_table(signal)}")
    span, shares = design_spread(store, run_id)
    if shares["design"].drop_nulls().len():
        out += ("<h2>Designs</h2><p>spanning_share: queries whose workflows follow two designs or more; written: the "
                f"nearest menu design of a workflow, shown: its prompt's example</p>{_table(span)}{_table(shares)}")
    mix = choice_mix(store, run_id)
    if mix.height:
        out += ("<h2>Designs the policy chose</h2><p>choice: the design a workflow's `# design:` line names "
                "(combined: two or more, own: none of the menu); reply_free_share: workflows whose answer depends on "
                "no executor reply; spanning: kept groups whose members chose two designs or more</p>"
                f"{_table(mix)}{_table(choice_span(store, run_id))}")
    odds = policy_odds(store, run_id)
    if odds.height:
        out += ("<h2>The policy's odds of each design</h2><p>odds: the generator's probability of the design's label "
                "token, renormalised over the designs, before rollout.choice_temperature flattens it for the draw; the "
                f"mean over the part's workflows</p>{_table(odds)}")
    copies = design_copies(store, run_id)
    if copies.height:
        out += ("<h2>Copies of the menu's designs</h2><p>copies: workflows whose code is the design's own (up to "
                "comments and layout); their mean score is the design's as a fixed program on these queries, the "
                f"others' is what the generator's variants of it score</p>{_table(copies)}")
    return out


COPY_SIMILARITY = 1.0  # pipeline.core.designs.similarity of a workflow that is its design's code, token for token


def design_copies(store: Store, run_id: str) -> pl.DataFrame:
    """Per round, task part ('' for a benchmark without parts) and written design of the run's menu: the workflows,
    how many are exact copies of the design's code (`COPY_SIMILARITY`), and the mean score of the copies and of the
    rest. Where a design wins a part on dev but its copies are rare, or its variants score 0, training cannot reach
    that design's room (docs/learning.md, the mixed task). Empty without a menu, or where its files are not here."""
    from pipeline.config import ConfigError
    from pipeline.core.designs import similarity
    from pipeline.engines.prompting import PromptError, menu_code
    from pipeline.engines.workflow import extract_code
    from pipeline.run import run_config

    empty = pl.DataFrame()
    try:
        menu = menu_code(run_config(store, run_id).rollout.example_menu)
    except (PromptError, ConfigError):  # no such run, a config this version does not read, the menu's files not here
        return empty
    if not menu:
        return empty
    rows = store.sql("""
        SELECT g.round, coalesce(json_extract_string(q.meta, '$.task'), '') AS part, g.design, g.text, s.score
        FROM generations g JOIN generation_scores s USING (run_id, round, gen_id)
        LEFT JOIN queries q ON q.run_id = g.run_id AND q.round = g.round AND q.query_id = g.query_id
        WHERE g.run_id = $run AND g.kind = 'workflow' AND g.design IS NOT NULL""", {"run": run_id}, run=run_id)
    if not rows.height:
        return empty
    copy = [d in menu and similarity(extract_code(t or ""), menu[d]) >= COPY_SIMILARITY
            for d, t in zip(rows["design"], rows["text"], strict=True)]
    rows = rows.with_columns(pl.Series("copy", copy), pl.col("score").fill_null(0.0)).filter(
        pl.col("design").is_in(list(menu)))
    return rows.group_by("round", "part", "design").agg(
        pl.len().alias("workflows"), pl.col("copy").sum().alias("copies"),
        pl.col("score").filter(pl.col("copy")).mean().alias("copies_score"),
        pl.col("score").filter(~pl.col("copy")).mean().alias("others_score"),
    ).sort("round", "part", "design")


def paired_row(diff: RoundDiff) -> dict:
    """A paired row of the summary as the report's table shows it: the numbers, each interval as "[lo, hi]" text
    (n/a when missing; the seeds-then-queries one, the headline, first), and the bounds themselves for the plot."""
    return {"round": diff.round, "metric": diff.metric, "n": diff.n, "base": diff.base, "trained": diff.trained,
            "mean": diff.mean, "level": diff.level, "ci_seeds_queries": diff.ci_seeds_queries,
            "ci_pairs": diff.ci_pairs, "ci_queries": diff.ci_queries, "lo_seeds_queries": diff.lo_seeds_queries,
            "hi_seeds_queries": diff.hi_seeds_queries, "lo": diff.lo, "hi": diff.hi, "lo_by_query": diff.lo_by_query,
            "hi_by_query": diff.hi_by_query}


def reference_row(arm: ReferenceArm) -> dict:
    """A reference arm as the report's table shows it."""
    return {"label": arm.label, "eval_run_id": arm.eval_run_id, "queries": arm.queries, "mean_at_l": arm.mean_at_l,
            "best_at_l": arm.best_at_l, "majority_at_l": arm.majority_at_l, "valid_share": arm.valid_share,
            "gen_tokens_per_query": arm.gen_tokens_per_query, "exec_tokens_per_query": arm.exec_tokens_per_query,
            "exec_calls_per_query": arm.exec_calls_per_query, "truncated_share": arm.truncated_share,
            "picks": arm.picks()}  # a router's designs over the held-out queries; empty for a fixed workflow


CURVE_PNG = "curve.png"  # the held-out curve over rounds, next to an experiment's report.html


def plot_curve(summary: ExperimentSummary, out: Path):
    """The held-out Mean@L over rounds of an experiment summary (its `curve` and `references`) as a PNG at `out`:
    x = rounds of training (0: the base model), the mean over seeds with its seeds-then-queries interval as error
    bars, each seed as a thin line, each reference as a labelled horizontal line. Returns the matplotlib Figure."""
    from matplotlib.figure import Figure

    rows = sorted((c for c in summary.curve if c.metric == "mean_at_l"), key=lambda c: c.round)
    positions = [c.round + 1 for c in rows]
    fig = Figure(figsize=(7, 4.5))
    axes = fig.add_subplot()
    for s in sorted({p.seed for c in rows for p in c.per_seed}):
        pts = [(c.round + 1, p.mean) for c in rows for p in c.per_seed if p.seed == s]
        axes.plot([u for u, _ in pts], [v for _, v in pts], linewidth=0.8, alpha=0.6, marker=".", label=f"seed {s}")
    level = int(round(100 * rows[0].level)) if rows else 95
    axes.errorbar(positions, [c.mean for c in rows],
                  yerr=[[c.mean - c.lo for c in rows], [c.hi - c.mean for c in rows]],
                  color="black", linewidth=2, marker="o", capsize=0,
                  label=f"mean over seeds, {level}% CI (seeds, then queries)")
    refs = [r for r in summary.references if r.mean_at_l is not None]
    for i, r in enumerate(refs):
        axes.axhline(r.mean_at_l, linestyle="--", linewidth=1.2, color=f"C{(i + 3) % 10}",
                     label=f"{r.name} ({num(r.mean_at_l)})")
    axes.set_xticks(positions, ["base" if k == 0 else str(k) for k in positions])
    axes.set_xlabel("rounds of training (base: the base model)")
    return _save(fig, axes, summary, out, "small")


def _save(fig, axes, summary: ExperimentSummary, out: Path, legend_size: str):
    """An experiment plot's y label, title and legend, written to `out`; returns the Figure."""
    axes.set_ylabel(f"held-out Mean@L (L = {summary.eval_l})")
    axes.set_title(f"experiment {summary.experiment}: {summary.split} split", fontsize="medium")
    # beside the axes, not on them: the lines and labels cluster where the legend would otherwise go
    axes.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return fig


FRONTIER_PNG = "frontier.png"  # held-out score against executor tokens, next to an experiment's report.html


def plot_frontier(summary: ExperimentSummary, out: Path):
    """Held-out Mean@L against executor tokens per query (`ExperimentSummary.frontier`) as a PNG at `out`: each
    reference a labelled point (the Pareto ones among references and rounds joined), the rounds' means over seeds a
    black line from the base model on, each seed's evaluations small grey points. Returns the Figure, or None where
    nothing has both numbers yet."""
    from matplotlib.figure import Figure

    pts = summary.frontier()
    if not pts:
        return None
    fig = Figure(figsize=(7, 4.5))
    axes = fig.add_subplot()
    refs = [p for p in pts if p.kind == "reference"]
    rounds = [p for p in pts if p.kind == "round" and p.seed is None]
    seeds = [p for p in pts if p.seed is not None]
    if refs:
        axes.scatter([p.exec_tokens_per_query for p in refs], [p.mean_at_l for p in refs], color="C0", zorder=3,
                     label="fixed workflow (reference)")
    for p in refs + rounds:
        axes.annotate(p.name.removeprefix("program-"), (p.exec_tokens_per_query, p.mean_at_l), fontsize="x-small",
                      xytext=(4, 3), textcoords="offset points")
    if seeds:
        axes.scatter([p.exec_tokens_per_query for p in seeds], [p.mean_at_l for p in seeds], color="grey", s=10,
                     alpha=0.6, zorder=2, label="one seed's evaluation")
    if rounds:
        axes.plot([p.exec_tokens_per_query for p in rounds], [p.mean_at_l for p in rounds], color="black", marker="o",
                  linewidth=1.5, zorder=4, label="generator: base model, then each round (mean over seeds)")
    front = sorted((p for p in refs + rounds if p.pareto), key=lambda p: p.exec_tokens_per_query)
    axes.plot([p.exec_tokens_per_query for p in front], [p.mean_at_l for p in front], color="C0", linestyle="--",
              linewidth=1, alpha=0.6, label="Pareto frontier")
    axes.set_xlabel("executor tokens per query (held out)")
    return _save(fig, axes, summary, out, "x-small")


def frontier_section(summary: ExperimentSummary, out_dir: Path) -> str:
    """HTML of the frontier: the PNG (written into `out_dir`) and its table, generator tokens beside executor
    tokens; empty where nothing has both numbers yet."""
    if plot_frontier(summary, out_dir / FRONTIER_PNG) is None:
        return ""
    rows = pl.DataFrame([p.to_dict() for p in summary.frontier()])
    return (f"<h2>Score against executor tokens</h2><p><img src='{FRONTIER_PNG}' alt='held-out Mean@L against "
            f"executor tokens per query'></p><p>rounds: the mean over seeds, then each seed's evaluation; pareto: "
            f"among the references and the rounds' means</p>{_table(rows)}")


def reference_tables(summary: ExperimentSummary) -> str:
    """HTML of the experiment's reference arms, every round's paired difference to them and the best fixed workflow
    chosen on another split (`selection`; none: empty)."""
    refs = [reference_row(r) for r in summary.references]
    pairs = [{"reference": p.reference, **paired_row(p)} for p in summary.paired_references]
    if not refs:
        return ""
    chosen = ""
    if sel := summary.selection:
        cands = [c.to_dict() for c in sel.candidates]
        chosen = (f"<h2>The best fixed workflow, chosen on {sel.split}</h2><p>the highest {sel.split} Mean@L: "
                  f"at the trained generator's executor budget (held-out executor tokens per query at most "
                  f"(1 + {sel.slack}) × {num(sel.budget_exec_tokens_per_query, 0)}, round {sel.last_round}"
                  f"): <b>{sel.same_budget}</b>; at any budget: <b>{sel.any_budget}</b>; not run or not "
                  f"finished there: {', '.join(sel.missing + sel.unfinished) or 'none'}</p>"
                  f"{_table(pl.DataFrame(cands)) if cands else ''}")
    return (f"<h2>References</h2><p>baselines on the same held-out queries and L (experiment.references)</p>"
            f"{_table(pl.DataFrame(refs))}<h2>Paired differences to the references</h2><p>round (-1: the base "
            f"model) − reference per (seed, query), the reference's value the base of every seed; base: the "
            f"reference's mean</p>{_table(pl.DataFrame(pairs)) if pairs else ''}{chosen}{verdict_section(summary)}")


def verdict_section(summary: ExperimentSummary) -> str:
    """HTML of the verdict against experiment.criterion (pipeline.studies.verdict), its lines as the summary gives
    them; empty without a criterion."""
    if summary.verdict is None:
        return ""
    head, *rest = summary.verdict.lines()
    return (f"<h2>Verdict</h2><p><b>{html.escape(head)}</b></p><ul>"
            + "".join(f"<li>{html.escape(line.strip())}</li>" for line in rest) + "</ul>")


def build_experiment_report(summary: ExperimentSummary, out: Path) -> Path:
    """HTML page of a learning experiment (pipeline.studies.experiment): the paired differences with their intervals
    (table and plot), the held-out curve over rounds with the references (`plot_curve`, a PNG beside the page), the
    score-vs-executor-tokens frontier (`plot_frontier`, a PNG beside it), the references' numbers, the held-out
    numbers of every (seed, round) evaluation and the config's key numbers."""
    import plotly.graph_objects as go

    paired = pl.DataFrame([paired_row(p) for p in summary.paired]) if summary.paired else pl.DataFrame()
    per_seed = pl.DataFrame([{"round": p.round, "metric": p.metric, **x.to_dict()} for p in summary.paired
                             for x in p.per_seed])
    # the evaluations' stored keys (older summaries have fewer), the status counts as one JSON cell
    arms = pl.DataFrame([{k: v for k, v in a.to_dict().items() if k != "status"} | {"status": json.dumps(a.status)}
                         for a in summary.arms]) if summary.arms else pl.DataFrame()
    parts = []
    if paired.height:
        fig = go.Figure()
        for metric, name in (("mean_at_l", "Mean@L"), ("best_at_l", "Best@L")):
            metric_rows = paired.filter(pl.col("metric") == metric)
            # a summary written before the seeds-then-queries interval: over pairs
            lower, upper = (metric_rows["lo_seeds_queries"], metric_rows["hi_seeds_queries"]) \
                if metric_rows["hi_seeds_queries"].null_count() == 0 else (metric_rows["lo"], metric_rows["hi"])
            fig.add_trace(go.Scatter(
                x=[f"round {r}" for r in metric_rows["round"]], y=metric_rows["mean"].to_list(), mode="markers",
                name=name,
                error_y={"type": "data", "symmetric": False, "array": (upper - metric_rows["mean"]).to_list(),
                         "arrayminus": (metric_rows["mean"] - lower).to_list()}))
        fig.add_hline(y=0, line_dash="dot")
        fig.update_layout(yaxis_title="trained − base, per (seed, query)", height=380, margin={"t": 30})
        parts.append("<h2>Paired difference to the base model (bootstrap interval)</h2>"
                     + fig.to_html(full_html=False, include_plotlyjs=True))
    if arms.height:
        fig = go.Figure()
        for metric, name in (("mean_at_l", "Mean@L"), ("best_at_l", "Best@L")):
            for s in arms["seed"].unique().sort().to_list():
                a = arms.filter(pl.col("seed") == s).sort("round")
                fig.add_trace(go.Scatter(x=a["round"].to_list(), y=a[metric].to_list(), mode="lines+markers",
                                         name=f"{name} seed {s}"))
        fig.update_layout(xaxis_title="round (-1 = base model)", yaxis_title="held-out score", xaxis_dtick=1,
                          height=380, margin={"t": 30})
        parts.append("<h2>Held-out score per seed</h2>" + fig.to_html(full_html=False, include_plotlyjs=not parts))
    curve = ""
    if any(c.metric == "mean_at_l" for c in summary.curve):
        plot_curve(summary, out.parent / CURVE_PNG)
        rows = [{"round": c.round, "metric": c.metric, "n": c.n, "mean": c.mean, "lo": c.lo, "hi": c.hi}
                for c in summary.curve]
        curve = (f"<h2>Held-out score over rounds</h2><p><img src='{CURVE_PNG}' alt='held-out Mean@L over rounds'>"
                 f"</p><p>mean over (seed, query); lo, hi: the seeds-then-queries interval</p>"
                 f"{_table(pl.DataFrame(rows))}")
    title = f"experiment {summary.experiment}"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>"
        f"<p>seeds {summary.seeds}, {summary.rounds} round(s), held-out split {summary.split}: "
        f"{summary.eval_queries} queries x L={summary.eval_l} workflows</p>"
        f"<h2>Paired differences</h2><p>trained − base per (seed, query), pooled; ci_seeds_queries (the headline): "
        f"bootstrap resampling seeds, then queries within each drawn seed; ci_pairs: over pairs; ci_queries: over "
        f"queries (all seeds of a drawn query together); n/a: not in this summary (written before it existed)</p>"
        f"{_table(paired) if paired.height else '<p>no evaluation yet</p>'}"
        f"<h2>Per seed</h2>{_table(per_seed) if per_seed.height else ''}{curve}"
        f"{frontier_section(summary, out.parent)}{reference_tables(summary)}"
        f"<h2>Evaluations</h2>{_table(arms) if arms.height else ''}{''.join(parts)}</body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
