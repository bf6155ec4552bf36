"""Trajectories to browse: the report's per-query pages (`pipeline report RUN` / `pipeline report EXPERIMENT`).

For a run, one page per (round, query): every workflow's code (highlighted by pygments), status of each rep,
score, executor calls and tokens, and the curated groups it is in with its advantage (kept groups are what
training used). For an experiment, one page per (seed, round, held-out query): the base model's workflows beside
the trained checkpoint's. Each folder has an index.html linking the pages; plotly.js is written once beside them
(pages load it by relative path, so they open offline and stay small).

All rows come from the store's tables and views (generations, `generation_scores`, `latest_scores`, groups).
"""

from __future__ import annotations

import html
import re
import zlib
from pathlib import Path

import polars as pl

from pipeline.engines.workflow import extract_code
from pipeline.store import Store
from pipeline.studies.formatting import round_name
from pipeline.studies.summaries import BASE, ExperimentSummary

STYLE = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
         "padding:3px 8px;text-align:right}.cols{display:grid;grid-template-columns:1fr 1fr;gap:2em}"
         ".cols>div{min-width:0;overflow-x:auto}"
         ".card{border:1px solid #ddd;margin:1em 0;padding:.5em}pre{white-space:pre-wrap;margin:0}")


def page_name(*parts: object) -> str:
    """A file name for (round, query): query ids hold any characters; the crc keeps sanitised ids apart."""
    raw = "-".join(str(p) for p in parts)
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', raw)[:80]}-{zlib.crc32(raw.encode()):08x}.html"


def workflows(store: Store, run_id: str, round: int, query_id: str | None = None) -> dict[str, list[dict]]:
    """query_id -> one dict per generation of the query (workflows and, for two-level runs, agent plans): its text,
    score, usage, each rep's latest status, and `groups`: [(group_id, kept, advantage)] of the curated groups it is
    in. The whole round (or one query) in three queries, not three per query."""
    params = {"run": run_id, "round": round, "q": query_id}
    only = " AND ($q IS NULL OR query_id = $q)"
    gens = store.sql(
        "SELECT g.query_id, g.gen_id, g.kind, g.parent_id, g.slot, g.text, g.valid, g.invalid_reason, g.attempt, "
        "s.score, s.llm_calls, s.tokens_in, s.tokens_out FROM generations g LEFT JOIN generation_scores s USING "
        "(run_id, round, gen_id) WHERE g.run_id = $run AND g.round = $round AND ($q IS NULL OR g.query_id = $q) "
        "ORDER BY g.kind, g.parent_id NULLS FIRST, g.slot, g.attempt, g.gen_id", params, run=run_id)
    runs = store.sql("SELECT gen_id, rep, status, answer, error FROM latest_scores WHERE run_id = $run AND "
                     "round = $round" + only + " ORDER BY gen_id, rep", params, run=run_id)
    groups = store.sql("SELECT group_id, kept, members, advantages FROM groups WHERE run_id = $run AND "
                       "round = $round AND coalesce(kind, 'group') = 'group'" + only + " ORDER BY group_id", params,
                       run=run_id)
    member_of: dict[str, list[tuple[str, bool, float | None]]] = {}
    for g in groups.iter_rows(named=True):
        for i, m in enumerate(g["members"] or []):
            adv = g["advantages"][i] if g["advantages"] else None
            member_of.setdefault(m, []).append((g["group_id"], bool(g["kept"]), adv))
    reps: dict[str, list[dict]] = {}
    for r in runs.iter_rows(named=True):
        reps.setdefault(r["gen_id"], []).append(r)
    out: dict[str, list[dict]] = {}
    for r in gens.iter_rows(named=True):
        out.setdefault(r["query_id"], []).append({**r, "runs": reps.get(r["gen_id"], []),
                                                  "groups": member_of.get(r["gen_id"], [])})
    return out


def highlight(code: str) -> str:
    try:
        from pygments import highlight as pyg
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ImportError:  # plain text, still readable
        return f"<pre>{html.escape(code)}</pre>"
    return pyg(code, PythonLexer(), HtmlFormatter())


def code_css() -> str:
    try:
        from pygments.formatters import HtmlFormatter
    except ImportError:
        return ""
    return HtmlFormatter().get_style_defs(".highlight")


def _fmt(v: object) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def _groups(gs: list[tuple[str, bool, float | None]]) -> str:
    return "; ".join(f"{html.escape(g)} {'kept' if kept else 'screened'} A={_fmt(a)}" for g, kept, a in gs)


def workflow_cards(rows: list[dict], plot_id: str) -> str:
    """The query's table, a plot of score (and mean advantage over its kept groups) per workflow, then each
    workflow's code. `plot_id` also prefixes the anchors, as a comparison page holds two sets of the same ids."""
    import plotly.graph_objects as go

    head = ("workflow", "kind", "slot", "valid", "status per rep", "score", "executor calls", "tokens in",
            "tokens out", "groups (advantage)")
    body = "".join(
        "<tr>" + "".join(f"<td>{c}</td>" for c in (
            f"<a href='#{plot_id}-{html.escape(r['gen_id'])}'>{html.escape(r['gen_id'])}</a>", _fmt(r["kind"]),
            _fmt(r["slot"]), _fmt(r["valid"]), html.escape(", ".join(x["status"] for x in r["runs"])), _fmt(r["score"]),
            _fmt(r["llm_calls"]), _fmt(r["tokens_in"]), _fmt(r["tokens_out"]), _groups(r["groups"]))) + "</tr>"
        for r in rows)
    table = f"<table><thead><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr></thead><tbody>{body}</tbody></table>"
    names = [r["gen_id"] for r in rows]
    kept = [[a for _, k, a in r["groups"] if k and a is not None] for r in rows]
    adv = [sum(a) / len(a) if a else None for a in kept]
    traces = [go.Bar(x=names, y=[r["score"] for r in rows], name="score")]
    if any(a is not None for a in adv):
        traces.append(go.Scatter(x=names, y=adv, mode="markers", name="mean advantage (kept groups)"))
    fig = go.Figure(traces)
    lo, hi = min([0.0] + [a for a in adv if a is not None]), max([1.0] + [a for a in adv if a is not None])
    # a fixed score range at least [0, 1]: the two sides of a comparison page read on the same scale
    fig.update_layout(height=300, margin={"t": 20}, yaxis_title="score / advantage", yaxis_range=[lo - .05, hi + .05])
    plot = fig.to_html(full_html=False, include_plotlyjs=False, div_id=plot_id)
    cards = []
    for row in rows:
        text = row["text"] or ""
        code = highlight(extract_code(text)) if row["kind"] == "workflow" else f"<pre>{html.escape(text)}</pre>"
        runs = "".join(f"<li>rep {x['rep']}: {html.escape(x['status'] or '')}; answer {html.escape(str(x['answer']))}"
                       + (f"; error <code>{html.escape(x['error'])}</code>" if x["error"] else "") + "</li>"
                       for x in row["runs"])
        why = f" ({html.escape(row['invalid_reason'])})" if row["invalid_reason"] else ""
        gid = html.escape(row["gen_id"])
        cards.append(f"<div class='card' id='{plot_id}-{gid}'><h3>{gid}: score {_fmt(row['score'])}, valid "
                     f"{_fmt(row['valid'])}{why}</h3>{code}<ul>{runs}</ul></div>")
    return table + plot + "".join(cards)


def query_text(store: Store, run_id: str, round: int, query_id: str) -> str:
    q = store.sql("SELECT prompt, reference FROM queries WHERE run_id = $run AND round = $round AND query_id = $q "
                  "LIMIT 1", {"run": run_id, "round": round, "q": query_id}, run=run_id)
    if not q.height:
        return "<p>(query text not in the store)</p>"
    prompt, ref = q.row(0)
    return (f"<h2>Query</h2><pre>{html.escape(prompt or '')}</pre>"
            f"<p>reference: <code>{html.escape(ref or '')}</code></p>")


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}{code_css()}</style><script src='plotly.min.js'></script></head>"
            f"<body><h1>{html.escape(title)}</h1>{body}</body></html>")


def write_plotly(folder: Path) -> None:
    from plotly.offline import get_plotlyjs

    (folder / "plotly.min.js").write_text(get_plotlyjs())


def round_queries(store: Store, run_id: str, round: int | None = None) -> pl.DataFrame:
    """Per (round, query): workflows, mean and best score, valid share, as listed on the index page."""
    return store.sql(
        "SELECT round, query_id, count(*) AS workflows, avg(score) AS mean_score, max(score) AS best_score, "
        "avg(CASE WHEN valid THEN 1.0 ELSE 0.0 END) AS valid_share FROM generation_scores WHERE run_id = $run AND "
        "kind = 'workflow' AND ($round IS NULL OR round = $round) GROUP BY round, query_id ORDER BY round, query_id",
        {"run": run_id, "round": round}, run=run_id)


def index_table(df: pl.DataFrame, links: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(
        f"<td><a href='{html.escape(link)}'>{_fmt(v)}</a></td>" if c == "query_id" else f"<td>{_fmt(v)}</td>"
        for c, v in zip(df.columns, row, strict=True)) + "</tr>" for row, link in zip(df.iter_rows(), links,
                                                                                      strict=True))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def build_run_pages(store: Store, run_id: str, round: int | None = None, query: str | None = None) -> Path:
    """Pages of the run's queries (one round, one query if given) in <store>/<run_id>/browse/; returns the index
    (or the one query's page)."""
    queries = round_queries(store, run_id, round)
    if query is not None:
        queries = queries.filter(pl.col("query_id") == query)
    if not queries.height:
        what = f"query {query!r} " if query else ""
        raise FileNotFoundError(f"run {run_id!r} has no scored workflows for {what}"
                                f"{'any round' if round is None else f'round {round}'} under {store.root}")
    dest = store.run_dir(run_id) / "browse"
    names = [page_name("r", k, q) for k, q in zip(queries["round"], queries["query_id"], strict=True)]
    with store.output_dir(dest) as out:
        write_plotly(out)
        per_round = {k: workflows(store, run_id, k, query) for k in set(queries["round"].to_list())}
        for (k, q), name in zip(zip(queries["round"], queries["query_id"], strict=True), names, strict=True):
            body = ("<p><a href='index.html'>all queries</a> · <a href='../report.html'>run report</a></p>"
                    + query_text(store, run_id, k, q) + "<h2>Workflows</h2>"
                    + workflow_cards(per_round[k].get(q, []), "scores"))
            (out / name).write_text(page(f"run {run_id} round {k} query {q}", body))
        if query is None:  # one query's page leaves the index of the others alone
            (out / "index.html").write_text(page(f"run {run_id}: queries", index_table(queries, names)))
    return dest / (names[0] if query is not None else "index.html")


def build_experiment_pages(store: Store, exp_dir: Path, query: str | None = None) -> Path:
    """Base versus trained, side by side, per (seed, trained round, held-out query) of an experiment
    (<store>/experiments/<id>/experiment.json); pages in its browse/ folder; returns the index."""
    summary = ExperimentSummary.read(exp_dir / "experiment.json")
    arms = {(a.seed, a.round): a.eval_run_id for a in summary.arms}
    per_query = pl.DataFrame(summary.per_query) if summary.per_query else pl.DataFrame()
    if not per_query.height or (query is not None and query not in per_query["query_id"].to_list()):
        raise FileNotFoundError(f"experiment {summary.experiment!r} has no held-out evaluation"
                                + (f" of query {query!r}" if query else ""))
    rows, names = [], []
    gens = {rid: workflows(store, rid, 0, query) for rid in arms.values()}
    with store.output_dir(exp_dir / "browse") as out:
        write_plotly(out)
        for (seed, trained_round), trained in sorted(arms.items()):
            base = arms.get((seed, -1))
            if trained_round < 0 or base is None:
                continue
            for query_id in sorted(set(per_query.filter(pl.col("seed") == seed)["query_id"].to_list())):
                if query is not None and query_id != query:
                    continue
                means = {r["round"]: r["mean_at_l"] for r in per_query.filter(
                    (pl.col("seed") == seed) & (pl.col("query_id") == query_id)).to_dicts()}
                cols = "".join(f"<div><h2>{label}: {html.escape(rid)}</h2>"
                               f"{workflow_cards(gens[rid].get(query_id, []), f'scores-{i}')}</div>"
                               for i, (label, rid) in enumerate(((round_name(BASE), base),
                                                                  (round_name(trained_round), trained))))
                name = page_name("s", seed, "r", trained_round, query_id)
                body = ("<p><a href='index.html'>all queries</a> · <a href='../report.html'>experiment report</a></p>"
                        + query_text(store, trained, 0, query_id) + f"<div class='cols'>{cols}</div>")
                (out / name).write_text(page(f"seed {seed}: base vs round {trained_round}, query {query_id}", body))
                rows.append({"seed": seed, "round": trained_round, "query_id": query_id,
                             "base_mean_at_l": means.get(-1), "trained_mean_at_l": means.get(trained_round)})
                names.append(name)
        if query is None:
            (out / "index.html").write_text(page(f"experiment {summary.experiment}: held-out queries",
                                                 index_table(pl.DataFrame(rows), names)))
    return exp_dir / "browse" / (names[0] if query is not None else "index.html")
