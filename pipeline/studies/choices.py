"""What a generator that chooses its design chose (rollout.menu_choice policy), read from the store: per round, part
and declared design (`generations.choice`), the workflows, their share of the part, their mean score, executor and
generator tokens per workflow, and the share whose answer depends on no executor reply
(pipeline.core.designs.reply_independent: the query's own numbers computed in the code, or a reply asked for and
ignored); and per round the kept GRPO groups whose members declare two or more designs, the only groups whose
advantages compare designs (pipeline.store.views.CHOICE_SPAN_SQL); under a design step, the policy's own odds of
each design per round and part (`policy_odds`). `pipeline report RUN` shows them."""

from __future__ import annotations

import json

import polars as pl

from pipeline.core.designs import reply_independent
from pipeline.engines.workflow import extract_code
from pipeline.store import Store
from pipeline.store.views import CHOICE_SPAN_SQL

WORKFLOWS_SQL = """
SELECT g.round, coalesce(json_extract_string(q.meta, '$.task'), '') AS part, g.choice, g.text, s.score,
       coalesce(s.tokens_in, 0) + coalesce(s.tokens_out, 0) AS exec_tokens,
       coalesce(len(g.prompt_token_ids), 0) + coalesce(len(g.token_ids), 0) AS gen_tokens
FROM generations g
JOIN (SELECT round, query_id, any_value(meta) AS meta FROM queries WHERE run_id = $run GROUP BY ALL) q
  USING (round, query_id)
LEFT JOIN generation_scores s ON s.run_id = g.run_id AND s.round = g.round AND s.gen_id = g.gen_id
WHERE g.run_id = $run AND g.kind = 'workflow' AND g.choice IS NOT NULL
"""


def choice_mix(store: Store, run_id: str) -> pl.DataFrame:
    """One row per (round, part, choice); empty for a run whose workflows declare no choice."""
    df = store.sql(WORKFLOWS_SQL, {"run": run_id}, run=run_id)
    if df.height == 0:
        return pl.DataFrame()
    df = df.with_columns(pl.col("text").map_elements(lambda t: reply_independent(extract_code(t)) is True,
                                                     return_dtype=pl.Boolean).alias("reply_free"))
    out = df.group_by("round", "part", "choice").agg(
        pl.len().alias("workflows"), pl.col("score").mean().alias("mean_score"),
        pl.col("exec_tokens").mean().alias("exec_tokens"), pl.col("gen_tokens").mean().alias("gen_tokens"),
        pl.col("reply_free").mean().alias("reply_free_share"))
    out = out.with_columns((pl.col("workflows") / pl.col("workflows").sum().over("round", "part")).alias("share"))
    return out.select("round", "part", "choice", "workflows", "share", "mean_score", "exec_tokens", "gen_tokens",
                      "reply_free_share").sort("round", "part", "workflows", "choice", descending=[False, False, True,
                                                                                                      False])


# The label a workflow was made under: a routed row's design (route_or_write runs the design's program), `own` for a
# workflow the generator wrote after the `own` label; without route_or_write, the design its code declares.
LABELS_SQL = """
SELECT g.round, coalesce(json_extract_string(q.meta, '$.task'), '') AS part,
       CASE WHEN g.source = 'write' THEN 'own' ELSE coalesce(g.choice, 'own') END AS label,
       s.score, coalesce(s.tokens_in, 0) + coalesce(s.tokens_out, 0) AS exec_tokens,
       coalesce(len(g.prompt_token_ids), 0) + coalesce(len(g.token_ids), 0) AS gen_tokens,
       json_extract(g.sampling, '$.choice_step.odds') AS odds
FROM generations g
JOIN (SELECT round, query_id, any_value(meta) AS meta FROM queries WHERE run_id = $run GROUP BY ALL) q
  USING (round, query_id)
LEFT JOIN generation_scores s ON s.run_id = g.run_id AND s.round = g.round AND s.gen_id = g.gen_id
WHERE g.run_id = $run AND g.kind = 'workflow'
"""


def policy_odds(store: Store, run_id: str) -> pl.DataFrame:
    """Under rollout.choice_step, per round and part: the policy's own mean probability of each design (its odds
    over the labels renormalised, before choice_temperature flattens them for the draw; one read a query, averaged
    over the part's workflows): what training moved, whatever the exploration drew. Empty without a design step."""
    df = store.sql(LABELS_SQL, {"run": run_id}, run=run_id)
    df = df.filter(pl.col("odds").is_not_null()).select("round", "part", "odds")
    if df.height == 0:
        return pl.DataFrame()
    rows = [{"round": r, "part": part, "design": name, "odds": float(p)}
            for r, part, odds in df.iter_rows() for name, p in json.loads(odds).items()]
    return (pl.DataFrame(rows).group_by("round", "part", "design").agg(pl.col("odds").mean())
            .sort("round", "part", "design"))


def choice_span(store: Store, run_id: str) -> pl.DataFrame:
    """Per round: the kept GRPO groups and those whose members declare two or more designs."""
    return store.sql(CHOICE_SPAN_SQL, {"run": run_id}, run=run_id)


def part_rows(store: Store, runs: list[str]) -> list[dict]:
    """Per part, pooled over the evaluation runs `runs` (a round's seeds): its workflows, their mean score, executor
    tokens and generator tokens (prompt and completion: the generator's own compute) a workflow, and per label the
    share of workflows made under it, their mean score and the policy's mean odds of it (`policy_odds`' read, over the
    part's workflows; None without a design step). Parts in name order; [] for runs without workflows."""
    frames = [df for rid in runs if (df := store.sql(LABELS_SQL, {"run": rid}, run=rid)).height]
    if not frames:
        return []
    df = pl.concat(frames)
    out = []
    for (part,), rows in sorted(df.group_by("part"), key=lambda kv: kv[0]):
        odds: dict[str, list[float]] = {}
        for raw in rows["odds"].drop_nulls():
            for name, p in json.loads(raw).items():
                odds.setdefault(name, []).append(float(p))
        by_label = {lab: grp for (lab,), grp in rows.group_by("label")}
        names = sorted(set(by_label) | set(odds))
        out.append({"part": part, "workflows": rows.height, "mean_score": rows["score"].mean(),
                    "exec_tokens": rows["exec_tokens"].mean(), "gen_tokens": rows["gen_tokens"].mean(),
                    "labels": {lab: {"share": (g.height if (g := by_label.get(lab)) is not None else 0) / rows.height,
                                     "mean_score": g["score"].mean() if g is not None else None,
                                     "odds": sum(odds[lab]) / len(odds[lab]) if lab in odds else None}
                               for lab in names}})
    return out


def likeliest_labels(odds: dict[str, dict[str, float]], label_scores: dict[str, dict[str, float | None]],
                     picks: dict[str, str]) -> list[dict]:
    """Per part of `picks` (part -> the per-part router's design): the policy's likeliest label there (the highest
    mean odds; ties: the first name), its score on the part (`label_scores[part][label]`: a design's mean over the
    part's queries, `own`'s the mean of the workflows the generator wrote), the pick's score, and whether the label
    scores at least as well as the pick (None where the label or its score is not known yet)."""
    out = []
    for part, pick in sorted(picks.items()):
        mine = odds.get(part) or {}
        label = min(mine, key=lambda lab: (-mine[lab], lab)) if mine else None
        scores = label_scores.get(part, {})
        score, pick_score = scores.get(label) if label else None, scores.get(pick)
        out.append({"part": part, "label": label, "odds": mine.get(label) if label else None, "score": score,
                    "pick": pick, "pick_score": pick_score,
                    "met": None if score is None or pick_score is None else score >= pick_score})
    return out
