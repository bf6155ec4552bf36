"""The routers an experiment whose generator chooses its design is measured against (`experiment.router`), built
from the menu designs' own runs: no extra executor call.

Every design of the router's menu (`experiment.router.designs`, each one of `experiment.references`) runs as a fixed
program on three splits: train (`fit_split`, its baseline run `<run_id>-baseline-train-<design>`), dev
(`experiment.select_split`) and the held-out split (the references' runs). From them (pipeline.core.router):

- `learned_router`: a classifier over the query's text alone: per design, features of the text and a logistic
  regression predicting whether the design solves the query (mean score >= 0.5), fitted on train; its settings (the
  regularisation C and the features: TF-IDF of word or character n-grams, or `hidden:<layer>`, the base model's own
  hidden states at that layer, mean-pooled over the text and standardised: a probe, pipeline.engines.hidden) are the
  ones whose routing scores best on dev. It sends each held-out query to the design with the highest predicted
  chance.
- `part_router`: one design per part (the reasoning-gym family), chosen on train. It reads the part label.
- `oracle`: per held-out query the design that scored best on it: the ceiling, chosen on the scores it is judged on.

A router's held-out row for a query is its chosen design's row there (that design's L runs of that query: Mean@L,
Best@L, executor tokens), so each router is scored as the fixed workflow "run the chosen design" would be, on the same
runs the single designs are; its paired differences to the trained generator are read like any reference's.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from pipeline.core.learning import QueryMetrics, split_summary
from pipeline.core.records import Record
from pipeline.core.router import oracle_choice, part_choice, route, solved
from pipeline.store import Store
from pipeline.studies.evaluate import usage_summary
from pipeline.studies.summaries import ReferenceArm

log = logging.getLogger(__name__)

ANALYZERS = {"word": dict(analyzer="word", ngram_range=(1, 2)), "char_wb": dict(analyzer="char_wb", ngram_range=(2, 4))}
HIDDEN = "hidden:"  # an analyzer `hidden:<layer>`: the base model's hidden states at that layer (a probe)
Embed = Callable[[Sequence[str], int], np.ndarray]  # (texts, layer) -> (texts, features): pipeline.engines.hidden
QUERY_SQL = ("SELECT query_id, any_value(prompt) AS prompt, coalesce(json_extract_string(any_value(meta), '$.task'), "
             "any_value(benchmark)) AS part FROM queries WHERE run_id = $run GROUP BY query_id")


@dataclass(frozen=True)
class DesignTable:
    """Every design's held-out rows on one split's queries (those every design finished): `scores` and `tokens` of
    shape (designs, queries), the queries' text and part, and each design's per-query rows to compose routers from."""

    designs: tuple[str, ...]
    queries: tuple[str, ...]
    texts: tuple[str, ...]
    parts: tuple[str, ...]
    scores: np.ndarray
    tokens: np.ndarray
    rows: dict[str, dict[str, dict]]
    runs: dict[str, str]


def design_table(store: Store, arms: Sequence[ReferenceArm], designs: Sequence[str]) -> DesignTable:
    """The table of `designs` (labels) from their reference arms on one split; a ValueError names a missing one."""
    by_label = {a.label: a for a in arms}
    missing = [d for d in designs if d not in by_label]
    if missing:
        raise ValueError(f"router: no finished run of {', '.join(missing)} on this split")
    rows = {d: {r["query_id"]: r for r in by_label[d].per_query if r.get("mean_at_l") is not None
                and not r.get("pending")} for d in designs}
    common = [q for q in rows[designs[0]] if all(q in rows[d] for d in designs)]
    if not common:
        raise ValueError(f"router: the designs {', '.join(designs)} share no finished query")
    first = by_label[designs[0]].eval_run_id
    info = {r["query_id"]: r for r in store.sql(QUERY_SQL, {"run": first}, run=first).iter_rows(named=True)}
    scores = np.array([[rows[d][q]["mean_at_l"] for q in common] for d in designs], dtype=float)
    tokens = np.array([[exec_tokens(rows[d][q]) for q in common] for d in designs], dtype=float)
    return DesignTable(tuple(designs), tuple(common), tuple(info[q]["prompt"] for q in common),
                       tuple(info[q]["part"] or "" for q in common), scores, tokens, rows,
                       {d: by_label[d].eval_run_id for d in designs})


def exec_tokens(row: dict) -> float:
    """A query's executor tokens (in + out) from its per-query row's usage columns (0 where none were recorded)."""
    return float((row.get("exec_tokens_in") or 0) + (row.get("exec_tokens_out") or 0))


def hidden_layer(analyzer: str) -> int | None:
    """The layer of a `hidden:<layer>` analyzer; None for a TF-IDF one."""
    return int(analyzer.removeprefix(HIDDEN)) if analyzer.startswith(HIDDEN) else None


def embedder(model_ref: str, analyzers: Sequence[str]) -> Embed | None:
    """The hidden states of `model_ref` (the base generator) where an analyzer reads them, else None (no model
    is loaded, nor its cache opened)."""
    if all(hidden_layer(a) is None for a in analyzers):
        return None
    from pipeline.engines.hidden import HiddenStates

    return HiddenStates(model_ref)


def describe_features(analyzer: str) -> str:
    """An analyzer's features in words, for the learned router's note."""
    layer = hidden_layer(analyzer)
    if layer is None:
        return f"TF-IDF ({analyzer})"
    return f"the base model's hidden states (layer {layer}, mean-pooled over the query, standardised)"


def features(analyzer: str, fit_texts: Sequence[str], texts: Sequence[str], embed: Embed | None = None) -> tuple:
    """The fit texts' and the other texts' features under `analyzer`, fitted on the fit texts alone (the TF-IDF
    vocabulary and weights, or the hidden states' standardisation)."""
    layer = hidden_layer(analyzer)
    if layer is not None:
        if embed is None:
            raise ValueError(f"router: analyzer {analyzer} reads the base model's hidden states; none were given "
                             "(pipeline.engines.hidden.HiddenStates)")
        from sklearn.preprocessing import StandardScaler

        fit_x = embed(list(fit_texts), layer)
        scaler = StandardScaler().fit(fit_x)
        return scaler.transform(fit_x), scaler.transform(embed(list(texts), layer))
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(sublinear_tf=True, **ANALYZERS[analyzer])
    return vectorizer.fit_transform(list(fit_texts)), vectorizer.transform(list(texts))


def chances(train: DesignTable, texts: Sequence[str], inverse_regularisation: float, analyzer: str,
            embed: Embed | None = None) -> np.ndarray:
    """(len(texts), designs): each design's predicted chance of solving each text, from the analyzer's features
    and a logistic regression fitted on train's labels (`solved`), `inverse_regularisation` its C; a design that
    solves all or none of train gets that rate."""
    return text_chances(train.texts, train.scores, texts, inverse_regularisation, analyzer, embed)


def text_chances(fit_texts: Sequence[str], fit_scores: np.ndarray, texts: Sequence[str],
                 inverse_regularisation: float, analyzer: str, embed: Embed | None = None) -> np.ndarray:
    """`chances` from the fit queries' texts and their scores (designs x queries, each a mean over runs). The
    features are made once from the fit texts and shared by every design's regression: each design's features +
    regression pipeline would make the same ones."""
    labels = solved(np.asarray(fit_scores))
    if labels.shape[1] != len(fit_texts):
        raise ValueError(f"router: {len(fit_texts)} fit texts for scores on {labels.shape[1]} queries")
    out = np.zeros((len(texts), labels.shape[0]))
    made = None
    for design in range(labels.shape[0]):
        if labels[design].all() or not labels[design].any():
            out[:, design] = float(labels[design].mean())
            continue
        if made is None:  # scikit-learn imported only where a design needs a regression (seconds to import)
            from sklearn.linear_model import LogisticRegression

            made = features(analyzer, fit_texts, texts, embed)
        model = LogisticRegression(C=inverse_regularisation, max_iter=2000).fit(made[0], labels[design])
        out[:, design] = model.predict_proba(made[1])[:, 1]
    return out


@dataclass(kw_only=True)
class RouterSetting(Record):
    """One setting of the learned router and its routing's mean score on dev."""

    c: float
    analyzer: str
    dev_mean: float


@dataclass(kw_only=True)
class RouterFit(Record):
    """The learned router's chosen setting, with every setting tried on dev, and the train set it was fitted on."""

    chosen: RouterSetting
    tried: list[RouterSetting] = field(default_factory=list)
    train_queries: int = 0
    dev_queries: int = 0


def fit_router(train: DesignTable, dev: DesignTable, c_grid: Sequence[float], analyzers: Sequence[str],
               embed: Embed | None = None) -> RouterFit:
    """The setting (C, analyzer) whose routing of dev's queries scores best there (ties: the earlier in the grid).
    `embed`: the base model's hidden states, for `hidden:<layer>` analyzers."""
    cost = train.tokens.mean(axis=1)
    tried = []
    for analyzer in analyzers:
        for c in c_grid:
            choice = route(chances(train, dev.texts, c, analyzer, embed), cost)
            tried.append(RouterSetting(c=c, analyzer=analyzer,
                                       dev_mean=float(dev.scores[choice, np.arange(len(dev.queries))].mean())))
    best = max(tried, key=lambda s: s.dev_mean)  # max keeps the first of equals
    return RouterFit(chosen=best, tried=tried, train_queries=len(train.queries), dev_queries=len(dev.queries))


def compose(method: str, label: str, table: DesignTable, choice: np.ndarray, note: str) -> ReferenceArm:
    """A router as a reference arm: each query's row is its chosen design's row (with `design` naming it)."""
    per_query = [table.rows[table.designs[d]][q] | {"design": table.designs[d]}
                 for q, d in zip(table.queries, choice, strict=True)]
    metrics = [QueryMetrics(**{f.name: r.get(f.name) for f in fields(QueryMetrics)}) for r in per_query]
    picked = Counter(r["design"] for r in per_query)
    return ReferenceArm.from_dict({
        "method": method, "label": label,
        "eval_run_id": f"{label}: composed from " + ", ".join(table.runs[d] for d in table.designs if picked[d]),
        **split_summary(metrics), **usage_summary(per_query), "status": {}, "per_query": per_query,
        "router": {"note": note, "picked": dict(sorted(picked.items())),
                   "choices": {r["query_id"]: r["design"] for r in per_query}}})


def router_arms(store: Store, designs: Sequence[str], train_arms: Sequence[ReferenceArm],
                dev_arms: Sequence[ReferenceArm], test_arms: Sequence[ReferenceArm], c_grid: Sequence[float],
                analyzers: Sequence[str], embed: Embed | None = None) -> tuple[list[ReferenceArm], RouterFit]:
    """The learned router, the per-part router and the per-query oracle on the held-out queries, and the fit.
    `embed`: the base model's hidden states, for `hidden:<layer>` analyzers."""
    train, dev, test = (design_table(store, arms, designs) for arms in (train_arms, dev_arms, test_arms))
    fit = fit_router(train, dev, c_grid, analyzers, embed)
    learned = route(chances(train, test.texts, fit.chosen.c, fit.chosen.analyzer, embed), train.tokens.mean(axis=1))
    by_part = part_choice(train.scores, train.tokens, train.parts)
    unknown = sorted(set(test.parts) - set(by_part))
    if unknown:
        raise ValueError(f"router: held-out parts {unknown} have no train query")
    parts = np.array([by_part[p] for p in test.parts], dtype=int)
    arms = [
        compose("router:learned", "learned_router", test, learned,
                f"{describe_features(fit.chosen.analyzer)} + logistic regression per design (C={fit.chosen.c}) over "
                f"the query text, fitted on {len(train.queries)} train queries, set on {len(dev.queries)} dev queries"),
        compose("router:part", "part_router", test, parts,
                "one design per part (reads the part label), chosen on train: "
                + ", ".join(f"{p} -> {designs[d]}" for p, d in by_part.items())),
        compose("router:oracle", "oracle", test, oracle_choice(test.scores, test.tokens),
                "per query the design that scored best on it (the ceiling; chosen on the scores it is judged on)"),
    ]
    arms[0].extra["router"]["fit"] = fit.to_dict()  # the setting chosen on dev, and every one tried
    log.info("router: %s chosen on dev (%.3f); learned router picks %s", fit.chosen.to_dict(), fit.chosen.dev_mean,
             arms[0].extra["router"]["picked"])
    return arms, fit
