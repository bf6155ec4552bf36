"""The objective ablation (`pipeline ablate CONFIG`): one round's curated data, trained with each objective, each
checkpoint evaluated on the held-out split against the base model and against the first objective.

For each seed s of `experiment.seeds` (as `pipeline experiment`): the source run `<run_id>-s<s>` is CONFIG's run,
rounds 0..`round` (curation writes the rows of every objective: groups, pairs, weighted and best rows;
pipeline.stages.curate); its round `round` checkpoint is the arm of CONFIG's own `training.objective`, the reference
arm. Each other objective X is an arm run `<run_id>-s<s>-<X>` with `training.objective=X` and
`training.data_run=<source>`: it trains round `round` on the source's curated rows from the source's previous
checkpoint (the policy that sampled them) and writes only its own checkpoint. The base model and every arm's
checkpoint are evaluated by pipeline.studies.evaluate with the same seed, split, queries and L, so per-query
numbers pair up across arms.

The summary gives per arm and metric the mean over seeds x queries and the paired difference to the base model
and to the reference arm with percentile-bootstrap intervals (pipeline.studies.experiment),
written to `<store>/experiments/<run_id>-ablation/ablation.json` with a Markdown table (ablation.md). Re-running
resumes: finished stages are skipped by their manifests.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.config import variant_sets
from pipeline.core.learning import paired_differences
from pipeline.core.objectives import OBJECTIVES, get_objective
from pipeline.run import open_run
from pipeline.store import Store, store_for
from pipeline.studies.evaluate import eval_changes, eval_run_id, eval_summary
from pipeline.studies.experiment import compared_metrics, mean_or_none, paired_interval, plan
from pipeline.studies.formatting import round_s
from pipeline.studies.report import write_study
from pipeline.studies.summaries import BASE, BASE_ARM, AblationArm, AblationSummary, ArmDiff
from pipeline.studies.tracking import evaluate_tracked

log = logging.getLogger("pipeline.studies.ablation")


def arm_run_id(source: str, objective: str, reference: str) -> str:
    """The run whose checkpoint is the arm: the source run itself for CONFIG's objective."""
    return source if objective == reference else f"{source}-{objective}"


def arm_changes(source: str, objective: str) -> dict[str, str]:
    """An objective's arm as a variant of the config (pipeline.config.with_changes): it trains the source run's
    curated data with `objective`."""
    return {"training.objective": objective, "training.data_run": source}


def ablation_dir(store: Store, run_id: str) -> Path:
    return store.root / "experiments" / f"{run_id}-ablation"


def summarise(store: Store, cfg, objectives: list[str], seeds: list[int], round: int) -> AblationSummary:
    """Per arm: its evaluations' means; per arm and metric: paired differences to the base model and to the
    reference arm (`objectives[0]`)."""
    split, experiment = cfg.experiment.eval_split, cfg.experiment
    per_query: dict[tuple[int, str], dict[str, dict]] = {}  # (seed, arm) -> query -> row; arm "base" or objective
    for seed in seeds:
        src = plan(cfg, [seed])[0].run_id
        runs = {BASE_ARM: eval_run_id(src, BASE, split)} | {
            o: eval_run_id(arm_run_id(src, o, objectives[0]), round, split) for o in objectives}
        for arm, eid in runs.items():
            if (store.run_dir(eid) / "config.yaml").is_file():
                per_query[(seed, arm)] = {q["query_id"]: q for q in eval_summary(store, eid).per_query}
    arms, paired = [], []
    for arm in [BASE_ARM, *objectives]:
        rows = [q for (s, a), qs in per_query.items() if a == arm for q in qs.values()]
        if not rows:
            continue
        means = {m: mean_or_none([q[m] for q in rows if q.get(m) is not None]) for m in compared_metrics(cfg)}
        arms.append(AblationArm(arm=arm, n=len(rows), valid_share=mean_or_none(
            [q["valid_share"] for q in rows if q.get("valid_share") is not None]), **means))
    for arm in objectives:
        for against in dict.fromkeys([BASE_ARM, objectives[0]]):
            if against == arm:
                continue
            for metric in compared_metrics(cfg):
                pairs = []
                for seed in seeds:
                    mine, theirs = per_query.get((seed, arm)), per_query.get((seed, against))
                    if mine and theirs:
                        a = {q: r[metric] for q, r in mine.items() if r.get(metric) is not None}
                        b = {q: r[metric] for q, r in theirs.items() if r.get(metric) is not None}
                        pairs += [(seed, q, d) for q, d in paired_differences(a, b).items()]
                if pairs:
                    paired.append(ArmDiff(arm=arm, against=against, metric=metric,
                                          **paired_interval(pairs, seeds, experiment)))
    return AblationSummary(experiment=cfg.run_id, round=round, objectives=objectives, seeds=seeds, split=split,
                           eval_queries=experiment.eval_queries, eval_l=experiment.eval_l, arms=arms, paired=paired)


def write_results(store: Store, summary: AblationSummary, extra: dict) -> Path:
    """ablation.json (the summary, then the run's facts in `extra`) and ablation.md (its table)."""
    dest = ablation_dir(store, summary.experiment)
    return write_study(store, dest, "ablation", summary.to_dict() | extra, summary.table())


def run_ablation(config: str | Path, call, objectives: list[str] | None = None, seeds: int | None = None,
                 round: int = 0, run_id: str | None = None, sets: list[str] | None = None,
                 command: str | None = None) -> AblationSummary:
    """Source rounds, then one arm per objective, each evaluated, through `call` (a stage caller)."""
    from pipeline.stages import ROUND_STAGES
    from pipeline.stages.rounds import study_config

    path, sets, cfg = study_config(config, sets, run_id)
    ref = cfg.training.objective
    objectives = [ref] + [o for o in (objectives or OBJECTIVES) if o != ref]  # the reference arm first
    for objective in objectives:
        get_objective(objective)  # an unknown name fails before any work
    if len(set(objectives)) != len(objectives):
        raise ValueError(f"objectives repeat: {objectives}")
    if round < 0:
        raise ValueError(f"--round must be >= 0, got {round}")
    store, split = store_for(cfg.store), cfg.experiment.eval_split
    started, done, walls = time.perf_counter(), [], {}
    for seed_plan in plan(cfg, list(range(seeds)) if seeds is not None else None):
        t_seed = time.perf_counter()
        src = seed_plan.run_id
        src_sets = variant_sets(seed_plan.changes, before=sets)
        open_run(path, src, 0, src_sets)  # freeze the source run
        for k in range(round + 1):  # round `round` trained with CONFIG's objective: the reference arm
            for stage in ROUND_STAGES:
                call(stage=stage, run_id=src, round=k, store_root=str(store.root), sets=src_sets)
        log.info("seed %d: evaluating the base model and %s on %s", seed_plan.seed, ref, split)
        evaluation = eval_changes(cfg)
        evaluate_tracked(str(store.root), src, BASE, split, call=call, changes=evaluation)
        evaluate_tracked(str(store.root), src, round, split, call=call, changes=evaluation)
        for objective in objectives[1:]:
            arm = arm_run_id(src, objective, ref)
            arm_all = variant_sets(seed_plan.changes | arm_changes(src, objective), before=sets)
            open_run(path, arm, round, arm_all)  # freeze the arm: CONFIG + seed + objective + data_run
            log.info("seed %d: training %s on %s's round %d", seed_plan.seed, objective, src, round)
            call(stage="train", run_id=arm, round=round, store_root=str(store.root), sets=arm_all)
            evaluate_tracked(str(store.root), arm, round, split, call=call, changes=evaluation)
        walls[seed_plan.seed] = round_s(time.perf_counter() - t_seed)
        done.append(seed_plan.seed)
        summary = summarise(store, cfg, objectives, done, round)
        out = write_results(store, summary, {"command": command, "seed_wall_s": walls, "config": str(path),
                                             "sets": sets, "wall_s": round_s(time.perf_counter() - started)})
        log.info("after seed %d:\n%s", seed_plan.seed, summary.table())
    summary.results = str(out)
    summary.wall_s = round_s(time.perf_counter() - started)
    return summary
