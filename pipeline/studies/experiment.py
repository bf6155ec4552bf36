"""The learning experiment (`pipeline experiment CONFIG`): does training make the generator better on held-out
queries than the base model it started from?

For each seed s of `experiment.seeds`: the run `<run_id>-s<s>` trains `rounds` rounds of CONFIG with the
generator, training and curation seeds set to s; then the base model (k = -1) and each round's checkpoint are
evaluated on the first `eval_queries` queries of `eval_split`, L = `eval_l` workflows per query, in derived
runs (pipeline.studies.evaluate: prompts built as in training). A base model and a checkpoint of the same seed sample
with the same seed, so their per-query numbers pair up.

The summary pools the per-query paired differences (round k minus base, same seed and query) over seeds. The
headline interval of each mean resamples seeds, then queries within each drawn seed (`lo_seeds_queries`,
`hi_seeds_queries`): a trained model is one draw of training's randomness, so the seed-to-seed spread belongs in
it. Kept beside it: the interval over pairs (`lo`, `hi`), the one over queries (`lo_by_query`, `hi_by_query`: a
drawn query brings all its seeds' pairs), and each seed's own mean and interval (pipeline.core.learning).
Summaries written before the headline interval existed lack its keys; readers show n/a. The summary is written to
`<store>/experiments/<run_id>/` as experiment.json (everything), per_query.csv and report.html.
`run_experiment` runs it through a stage caller (pipeline.stages.rounds: without Prefect, or flows/experiment.py's).
Re-running with the same run id resumes: finished stages are skipped by their manifests, in the seed runs and in
the evaluation runs alike. The summary is rewritten after every seed, so a stopped experiment still leaves its
results so far.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl

from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.core.learning import METRICS, bootstrap_ci, hierarchical_ci, paired_differences, seed_intervals
from pipeline.stages.modes import get_mode
from pipeline.store import Store, store_for
from pipeline.store.views import flagged_rewarded
from pipeline.studies.evaluate import eval_run_id, eval_sets, eval_summary
from pipeline.studies.report import build_experiment_report, span
from pipeline.studies.tracking import TRACKERS, evaluate_tracked

BASE = -1  # the round index of the base model in evaluations
METRIC_NAMES = {"mean_at_l": "Mean@L", "best_at_l": "Best@L", "majority_at_l": "Majority@L", "select_at_l": "Sel@L"}
log = logging.getLogger("pipeline.studies.experiment")


def seed_run_id(run_id: str, seed: int) -> str:
    return f"{run_id}-s{seed}"


def seed_sets(seed: int) -> list[str]:
    """Overrides that make a seed's run: every source of randomness of a round follows the seed."""
    return [f"generator.seed={seed}", f"training.seed={seed}", f"curation.seed={seed}"]


def eval_rounds(cfg: RunConfig) -> list[int]:
    """The base model, then every round's checkpoint (or only the last)."""
    last = cfg.rounds - 1
    return [BASE] + (list(range(cfg.rounds)) if cfg.experiment.eval_rounds == "all" else [last])


@dataclass(frozen=True)
class SeedPlan:
    seed: int
    run_id: str
    sets: list[str]


def compared_metrics(cfg: RunConfig) -> tuple[str, ...]:
    """Mean@L and Best@L; a two-level run adds Sel@L, the proposal's inference-time choice (pipeline.core.selection)."""
    return METRICS + (("select_at_l",) if get_mode(cfg.rollout.mode).selection else ())


def splits_overlap(a: str, b: str) -> bool:
    """Whether two split names share items (`validate` is `train` + `dev`)."""
    return a == b or {a, b} in ({"validate", "train"}, {"validate", "dev"})


def plan(cfg: RunConfig, seeds: list[int] | None = None) -> list[SeedPlan]:
    train, held_out = cfg.benchmark.train_split, cfg.experiment.eval_split
    if splits_overlap(train, held_out):  # evaluating on the training queries would not measure generalisation
        raise ConfigError(f"experiment.eval_split {held_out} shares queries with benchmark.train_split {train}; "
                          "train on `train` (benchmark.dev_share > 0) to evaluate on `dev`")
    seeds = list(cfg.experiment.seeds if seeds is None else seeds)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"experiment seeds repeat: {seeds}")
    return [SeedPlan(s, seed_run_id(cfg.run_id, s), seed_sets(s)) for s in seeds]


def experiment_dir(store: Store, run_id: str) -> Path:
    return store.root / "experiments" / run_id


def summarise(store: Store, cfg: RunConfig, seeds: list[int]) -> dict:
    """Per (seed, evaluated round): the eval run's summary; per round k >= 0 and metric: the pooled paired
    difference to the base model with its bootstrap interval."""
    split, ex = cfg.experiment.eval_split, cfg.experiment
    arms, per_query = [], []
    for s in seeds:
        for k in eval_rounds(cfg):
            eid = eval_run_id(seed_run_id(cfg.run_id, s), k, split)
            if not (store.run_dir(eid) / "config.yaml").is_file():
                continue
            summ = eval_summary(store, eid)
            arms.append({"seed": s, "round": k, **{key: v for key, v in summ.items() if key != "per_query"}})
            per_query += [{"seed": s, "round": k, **q} for q in summ["per_query"]]
    paired = []
    for k in [r for r in eval_rounds(cfg) if r != BASE]:
        for metric in compared_metrics(cfg):
            pairs: list[tuple[int, str, float]] = []  # (seed, query, arm - base)
            for s in seeds:
                base = {q["query_id"]: q[metric] for q in per_query
                        if q["seed"] == s and q["round"] == BASE and q.get(metric) is not None}
                arm = {q["query_id"]: q[metric] for q in per_query
                       if q["seed"] == s and q["round"] == k and q.get(metric) is not None}
                pairs += [(s, qid, d) for qid, d in paired_differences(arm, base).items()]
            if not pairs:
                continue
            base_mean = mean_or_none([q[metric] for q in per_query if q["round"] == BASE and q.get(metric) is not None])
            arm_mean = mean_or_none([q[metric] for q in per_query if q["round"] == k and q.get(metric) is not None])
            paired.append({"round": k, "metric": metric, "base": base_mean, "trained": arm_mean,
                           **paired_interval(pairs, seeds, ex)})
    # training runs' rewarded samples whose code touched the harness's surface (docs/sandbox.md, scores.flags)
    flagged = {seed_run_id(cfg.run_id, s): flagged_rewarded(store, seed_run_id(cfg.run_id, s)) for s in seeds}
    return {"experiment": cfg.run_id, "seeds": seeds, "rounds": cfg.rounds, "split": split,
            "eval_queries": ex.eval_queries, "eval_l": ex.eval_l, "arms": arms, "paired": paired,
            "per_query": per_query, "flagged_rewarded": flagged}


def paired_interval(pairs: list[tuple[int, str, float]], seeds: list[int], ex) -> dict:
    """(seed, query, arm - base) differences -> their mean with the seeds-then-queries interval (the headline),
    the intervals over pairs and over queries, and each seed's own mean and interval (in `seeds` order)."""
    diffs = [d for _, _, d in pairs]
    ci = bootstrap_ci(diffs, ex.bootstrap, ex.ci_level, seed=0)
    by_query = bootstrap_ci(diffs, ex.bootstrap, ex.ci_level, seed=0, clusters=[q for _, q, _ in pairs])
    hier = hierarchical_ci(pairs, ex.bootstrap, ex.ci_level, seed=0)
    mine = seed_intervals(pairs, ex.bootstrap, ex.ci_level, seed=0)
    per_seed = [{"seed": s, "n": c.n, "mean": c.mean, "lo": c.lo, "hi": c.hi}
                for s in seeds if (c := mine.get(s)) is not None]
    return {**asdict(ci), "lo_seeds_queries": hier.lo, "hi_seeds_queries": hier.hi, "lo_by_query": by_query.lo,
            "hi_by_query": by_query.hi, "per_seed": per_seed}


def mean_or_none(xs: list[float]) -> float | None:
    """The mean, or None for no values (an arm without evaluations)."""
    return sum(xs) / len(xs) if xs else None


def write_results(store: Store, summary: dict, extra: dict | None = None) -> Path:
    """experiment.json, per_query.csv and report.html under <store>/experiments/<run_id>/; returns the folder."""
    dest = experiment_dir(store, summary["experiment"])
    body = {**summary, **(extra or {})}
    with store.output_dir(dest) as out:  # on object storage: written locally, then uploaded file by file
        tmp = out / ".experiment.json.tmp"
        tmp.write_text(json.dumps(body, indent=1, default=str))
        tmp.replace(out / "experiment.json")
        if summary["per_query"]:
            pl.DataFrame(summary["per_query"]).write_csv(out / "per_query.csv")
        build_experiment_report(body, out / "report.html")
    return dest


def headline(summary: dict) -> list[str]:
    """Lines a person reads first: per evaluated round and metric, held-out base -> trained with the paired
    difference and its seeds-then-queries interval, the pooled intervals beside it, then one line per seed."""
    lines = []
    for p in summary["paired"]:
        name = METRIC_NAMES.get(p["metric"], p["metric"])
        lines.append(
            f"round {p['round']} vs base, held-out {name} (L={summary['eval_l']}, {p['n']} seed x query pairs): "
            f"base {p['base']:.3f} -> trained {p['trained']:.3f}, paired difference {p['mean']:+.3f} "
            f"{span(p, 'lo_seeds_queries', 'hi_seeds_queries')} {int(round(100 * p['level']))}% bootstrap CI "
            f"resampling seeds, then queries (pairs: {span(p, 'lo', 'hi')}; queries: "
            f"{span(p, 'lo_by_query', 'hi_by_query')})")
        lines += [f"  seed {x['seed']}: {x['mean']:+.3f} {span(x, 'lo', 'hi')} over {x['n']} queries"
                  for x in p.get("per_seed", [])]
    if "flagged_rewarded" in summary:  # summaries written before issue 22 lack it
        lines.append(f"flagged rewarded training runs (scores.flags): {summary['flagged_rewarded']}")
    return lines


def run_experiment(config: str | Path, call, seeds: int | None = None, run_id: str | None = None,
                   sets: list[str] | None = None, command: str | None = None, after_round=None,
                   after_seed=None) -> dict:
    """Train and evaluate every seed through `call` (a stage caller), then write the summary; returns it.
    `after_round(run_id, store_root, k)` runs after each round of a seed run, `after_seed(summary, results folder)`
    after each seed's summary is written (the experiment flow publishes both as Prefect artifacts)."""
    from pipeline.stages.rounds import resolve_config, run_rounds

    path = resolve_config(config)
    sets = list(sets or [])
    cfg = load_config(path, sets)
    if run_id:
        cfg = cfg.model_copy(update={"run_id": run_id})
    store = store_for(cfg.store)
    t0 = time.perf_counter()
    walls: dict[int, float] = {}
    done: list[int] = []
    summary: dict = {}
    for sp in plan(cfg, list(range(seeds)) if seeds is not None else None):
        t_seed = time.perf_counter()
        log.info("seed %d: training run %s (%d rounds)", sp.seed, sp.run_id, cfg.rounds)
        run_rounds(path, cfg.rounds, sp.run_id, call, after_round, sets=sets + sp.sets, observer=TRACKERS)
        for k in eval_rounds(cfg):
            log.info("seed %d: evaluating %s on %s", sp.seed, "the base model" if k < 0 else f"round {k}",
                     cfg.experiment.eval_split)
            evaluate_tracked(str(store.root), sp.run_id, k, cfg.experiment.eval_split, eval_sets(cfg), call)
        walls[sp.seed] = round(time.perf_counter() - t_seed, 1)
        done.append(sp.seed)
        summary = summarise(store, cfg, done)
        out = write_results(store, summary, {"command": command, "seed_wall_s": walls,
                                             "wall_s": round(time.perf_counter() - t0, 1), "config": str(path),
                                             "sets": sets})
        for line in headline(summary):
            log.info("after seed %d: %s", sp.seed, line)
        if after_seed is not None:
            after_seed(summary, out)
    summary["results"] = str(out)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    return summary
