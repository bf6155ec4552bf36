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
Summaries written before the headline interval existed lack its keys; readers show n/a.

`experiment.shared_base`: the base model is evaluated once, in the first seed's run with its sampling seed, and its
per-query numbers are the base of every seed's pairs; this saves one evaluation per extra seed, but the base's own
sampling noise is then one draw, not resampled across seeds. `experiment.base_from` pairs seed k with another
experiment's evaluation of the base model at seed k (arms of one study), checked to be made with this experiment's
evaluation settings (`check_base`); `experiment.start_from` starts seed k's round 0 from another experiment's seed k
(`start_changes`). `experiment.references`: after the seeds, each named
baseline (pipeline.studies.baselines: a fixed program, task_best or `program:<file>`) runs on the same split,
queries and L in its derived run `<run_id>-baseline-<method>`; the summary gives it as a reference arm (Mean@L,
Best@L, Majority@L, tokens per query) with every evaluated round's paired difference to it (pairs over seed x
query, the reference's per-query value the base of every seed). `curve`: per evaluated round, the mean over
(seed, query) with its seeds-then-queries interval and each seed's mean (the report plots it with the references).
`experiment.select_split` (dev): the references also run there (first `select_queries` queries), and `selection`
names the best fixed workflow by its Mean@L there, at the trained generator's executor budget and at any
(`best_fixed`): the choice a reviewer asks for, made by a rule fixed before the test numbers are read.

The summary is written to `<store>/experiments/<run_id>/` as experiment.json (everything), per_query.csv,
report.html, curve.png and frontier.png. After a seed's evaluations its last round's adapter is kept apart from the
checkpoint, in `<store>/adapters/<seed run>-r<k>/` with its run's config and a README (`keep_adapter`): a store kept in
git commits it while it leaves the checkpoints out, and `pipeline evaluate-adapter` evaluates it on new problems.
While a seed runs, every round's checkpoint is kept there as soon as it is trained (`keeping`), so that a store
committed mid-seed resumes on a fresh clone with its checkpoints restored (pipeline.stages.rounds.
restore_kept_checkpoints) instead of training them again; the earlier rounds' copies go once the seed is evaluated.
`run_experiment` runs it through a stage caller (pipeline.stages.rounds: without Prefect, or flows/experiment.py's).
Re-running with the same run id resumes: finished stages are skipped by their manifests, in the seed runs and in
the evaluation runs alike; a re-entered seed whose checkpoint was lost after training (a store cloned from git) with
no kept copy to restore it first sets aside the rounds and evaluations made from the lost weights
(`set_aside_evaluations`), which run again.
The summary is rewritten after every seed and after the references, so a stopped experiment still leaves its
results so far. `only_seeds` (`--only-seed`) runs some seeds of the plan and no reference, so that seeds can run in
separate processes or machines on one store; every summary covers the seeds run here and every other seed whose
evaluations are all scored in the store, and a last run without it (everything skipped) adds the references and
writes the whole report.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import polars as pl

from pipeline.config import ConfigError, RunConfig, diff_configs, load_config, variant_sets
from pipeline.core.designs import OWN
from pipeline.core.learning import METRICS, bootstrap_ci, hierarchical_ci, paired_differences, seed_intervals
from pipeline.core.router import part_choice
from pipeline.engines.models import half_weights
from pipeline.engines.servers import sharing
from pipeline.run import run_config
from pipeline.stages import ROUND_STAGES
from pipeline.stages.modes import get_mode
from pipeline.stages.progress import progress_path, saved_steps
from pipeline.store import ADAPTER_WEIGHTS, KEPT_SOURCE, Store, adapter_complete, store_for, weights_sha256
from pipeline.store.views import flagged_rewarded
from pipeline.studies.baselines import (
    PROGRAM_PREFIX,
    baseline_changes,
    baseline_run_id,
    baseline_sets,
    check_method,
    method_tag,
    program_parts,
    run_baseline,
)
from pipeline.studies.choices import likeliest_labels, part_rows
from pipeline.studies.evaluate import (
    EVAL_STAGES,
    eval_changes,
    eval_run_id,
    eval_summary,
    frozen_eval_changes,
    new_problems,
)
from pipeline.studies.report import build_experiment_report, stage_timings
from pipeline.studies.router import design_table, embedder, router_arms
from pipeline.studies.summaries import (
    BASE,
    Candidate,
    CurvePoint,
    ExperimentArm,
    ExperimentSummary,
    KeptAdapter,
    LabelCheck,
    PartRound,
    ReferenceArm,
    RoundDiff,
    SeedDiff,
    SeedMean,
    Selection,
)
from pipeline.studies.tracking import TRACKERS, evaluate_tracked
from pipeline.studies.verdict import verdict

log = logging.getLogger("pipeline.studies.experiment")


def seed_run_id(run_id: str, seed: int) -> str:
    return f"{run_id}-s{seed}"


def seed_changes(seed: int) -> dict[str, int]:
    """A seed's variant of the config (pipeline.config.with_changes): every source of randomness of a round follows
    the seed."""
    return {"generator.seed": seed, "training.seed": seed, "curation.seed": seed}


def eval_rounds(cfg: RunConfig) -> list[int]:
    """The base model, then every round's checkpoint (or only the last)."""
    last = cfg.rounds - 1
    return [BASE] + (list(range(cfg.rounds)) if cfg.experiment.eval_rounds == "all" else [last])


@dataclass(frozen=True)
class SeedPlan:
    seed: int
    run_id: str
    changes: dict[str, Any]  # seed_changes: the seed's variant of the config


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
    for method in cfg.experiment.references:  # a typo fails now, not after hours of training
        check_method(method)
    if (chooser := cfg.experiment.select_split) is not None:
        if not cfg.experiment.references:
            raise ConfigError(f"experiment.select_split {chooser}: no experiment.references to choose from")
        for other, name in ((held_out, "experiment.eval_split"), (train, "benchmark.train_split")):
            if splits_overlap(chooser, other):  # choosing on reported or trained-on queries biases the choice
                raise ConfigError(f"experiment.select_split {chooser} shares queries with {name} {other}")
    designs = router_designs(cfg)  # a router over designs that are no reference fails now too
    if (chosen := cfg.experiment.select_references) is not None and (left := [d for d in designs if d not in chosen]):
        raise ConfigError(f"experiment.select_references: the router's designs {', '.join(left)} must run on "
                          f"{chooser} too (the routers' settings are chosen there)")
    if cfg.experiment.base_from == cfg.run_id:
        raise ConfigError(f"experiment.base_from {cfg.run_id}: an experiment cannot borrow its own base evaluations")
    if (start := cfg.experiment.start_from) is not None and (start == cfg.run_id or cfg.generator.adapter):
        raise ConfigError(f"experiment.start_from {start}: " + (
            "an experiment cannot start from its own seeds" if start == cfg.run_id else
            f"round 0 would also start from generator.adapter {cfg.generator.adapter}; set one of the two"))
    seeds = list(cfg.experiment.seeds if seeds is None else seeds)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"experiment seeds repeat: {seeds}")
    return [SeedPlan(s, seed_run_id(cfg.run_id, s), seed_changes(s)) for s in seeds]


def start_changes(store: Store, cfg: RunConfig, seed: int) -> dict[str, str]:
    """`experiment.start_from`: seed `seed`'s round 0 starts from the last round's checkpoint of that experiment's
    seed run (generator.adapter: its sampler, π_old and KL reference), restored from its kept copy where a fresh clone
    lacks it; {} without start_from. A ConfigError names the run and round when that seed is not trained."""
    if (start := cfg.experiment.start_from) is None:
        return {}
    run = seed_run_id(start, seed)
    if store.read_config(run) is None:
        raise ConfigError(f"experiment.start_from {start}: no run {run} in {store.root}; train seed {seed} of "
                          f"experiment {start} first")
    last = run_config(store, run).rounds - 1
    store.restore_checkpoint(run, last)
    if not store.checkpoint_complete(run, last):
        raise ConfigError(f"experiment.start_from {start}: run {run} has no checkpoint of its last round {last} "
                          f"({store.checkpoint_dir(run, last)}); finish seed {seed} of experiment {start} first")
    return {"generator.adapter": str(store.checkpoint_dir(run, last))}


def experiment_dir(store: Store, run_id: str) -> Path:
    return store.root / "experiments" / run_id


def summary_rounds(cfg: RunConfig, seed: int, seeds: list[int]) -> list[int]:
    """The rounds whose evaluation of seed `seed` the summary reads: all of `eval_rounds`, but the base model only
    for the first seed when `experiment.shared_base` is on."""
    shared = cfg.experiment.shared_base and seed != seeds[0]
    return [k for k in eval_rounds(cfg) if not (shared and k == BASE)]


def seed_rounds(cfg: RunConfig, seed: int, seeds: list[int]) -> list[int]:
    """The rounds evaluated in seed `seed`'s runs: `summary_rounds`, less the base model's when another experiment's
    evaluation of it is borrowed (`experiment.base_from`)."""
    return [k for k in summary_rounds(cfg, seed, seeds) if not (cfg.experiment.base_from and k == BASE)]


def seed_eval_run(cfg: RunConfig, seed: int, k: int, split: str | None = None) -> str:
    """The evaluation run of seed `seed`'s round `k` (BASE: the base model) on `split` (default: the held-out one):
    this experiment's, or for the base model `experiment.base_from`'s."""
    owner = cfg.experiment.base_from if k == BASE and cfg.experiment.base_from else cfg.run_id
    return eval_run_id(seed_run_id(owner, seed), k, split or cfg.experiment.eval_split)


def check_base(store: Store, cfg: RunConfig, config: str | Path, sets: list[str], seed_plan: SeedPlan,
               changes: dict[str, Any]) -> None:
    """`experiment.base_from`: the borrowed base-model evaluation of seed `seed_plan` is finished and was made with
    the settings this experiment's own would have (the seed's config, its `changes` to CONFIG, then the evaluation's
    changes); a ConfigError naming the run and the fields otherwise, before the seed trains."""
    if (owner := cfg.experiment.base_from) is None:
        return
    rid = seed_eval_run(cfg, seed_plan.seed, BASE)
    if store.manifest(rid, 0, "score") is None:
        raise ConfigError(f"experiment.base_from {owner}: its base-model evaluation {rid} is not finished under "
                          f"{store.root}; finish seed {seed_plan.seed} of experiment {owner} first, or drop base_from")
    seed_sets = variant_sets(changes, before=sets)
    seed_cfg = load_config(config, seed_sets)
    split = cfg.experiment.eval_split
    mine = load_config(config, variant_sets(frozen_eval_changes(seed_cfg, BASE, None, split, store)
                                            | eval_changes(seed_cfg), before=seed_sets))
    theirs = run_config(store, rid)
    # the run's own name and the run its exemplars would come from (none are shown: `exemplars`) name runs, not
    # what the evaluation computes; the plan's sections are each experiment's own, and an evaluation trains nothing
    changed = [p for p in diff_configs(theirs, mine.model_copy(update={"run_id": theirs.run_id}))
               if p != "rollout.exemplar_run"
               and p.split(".")[0] not in ("experiment", "headroom", "tracking", "training", "curation")]
    if changed:
        raise ConfigError(f"experiment.base_from {owner}: {rid} was made with other settings than this experiment's "
                          f"base evaluation would be ({', '.join(changed)}); drop base_from")


def query_values(per_query: list[dict], seed: int, round: int, metric: str) -> dict[str, float]:
    """query -> `metric` of (seed, round) in the summary's per-query rows (queries without it left out)."""
    return {q["query_id"]: q[metric] for q in per_query
            if q["seed"] == seed and q["round"] == round and q.get(metric) is not None}


def pair_rows(cfg: RunConfig, seeds: list[int], per_query: list[dict], rounds: list[int], metrics: tuple[str, ...],
              base_of, reference: str | None = None) -> list[RoundDiff]:
    """Per round of `rounds` and metric: round k minus `base_of(seed, metric)` (query -> value) per (seed, query),
    pooled over seeds (`paired_interval`), with both arms' means; `reference`: the arm `base_of` reads, if not the
    base model."""
    rows = []
    for round_number in rounds:
        for metric in metrics:
            base = {s: base_of(s, metric) for s in seeds}
            arm = {s: query_values(per_query, s, round_number, metric) for s in seeds}
            pairs = [(s, q, d) for s in seeds for q, d in paired_differences(arm[s], base[s]).items()]
            if pairs:
                rows.append(RoundDiff(reference=reference, round=round_number, metric=metric,
                                      base=mean_or_none([v for b in base.values() for v in b.values()]),
                                      trained=mean_or_none([v for x in arm.values() for v in x.values()]),
                                      **paired_interval(pairs, seeds, cfg.experiment)))
    return rows


def curve(cfg: RunConfig, seeds: list[int], per_query: list[dict]) -> list[CurvePoint]:
    """Per evaluated round and metric: the mean over (seed, query) with its seeds-then-queries interval, and each
    seed's own mean (the report's held-out curve)."""
    experiment, rows = cfg.experiment, []
    for round_number in eval_rounds(cfg):
        for metric in compared_metrics(cfg):
            by_seed = {s: v for s in seeds if (v := query_values(per_query, s, round_number, metric))}
            if by_seed:
                ci = hierarchical_ci([(s, q, x) for s, v in by_seed.items() for q, x in v.items()],
                                     experiment.bootstrap, experiment.ci_level, seed=0)
                rows.append(CurvePoint(round=round_number, metric=metric, **asdict(ci),
                                       per_seed=[SeedMean(seed=s, mean=mean_or_none(list(v.values())))
                                                 for s, v in by_seed.items()]))
    return rows


def reference_methods(cfg: RunConfig, split: str) -> list[str]:
    """The `experiment.references` that run on `split`: on select_split those of `select_references` (every one by
    default), on any other split every one."""
    setup = cfg.experiment
    chosen = setup.select_references if split == setup.select_split else None
    return [m for m in setup.references if chosen is None or m in chosen]


def reference_runs(cfg: RunConfig, split: str | None = None) -> dict[str, str]:
    """method -> the derived run of each reference that runs on `split` (`reference_methods`; default: the held-out
    split), of `references_from` when set."""
    owner, split = cfg.experiment.references_from or cfg.run_id, split or cfg.experiment.eval_split
    return {m: baseline_run_id(owner, method_tag(m), split) for m in reference_methods(cfg, split)}


NOT_COMPUTED = ("executor.serve.port",)  # where a run's executor listened, not what it computed


def select_changes(cfg: RunConfig) -> dict[str, int | None]:
    """The change that makes a reference run on `select_split` hold its first `select_queries` queries."""
    return {"experiment.eval_queries": cfg.experiment.select_queries}


def fit_changes(cfg: RunConfig) -> dict[str, int | None]:
    """The change that makes a router design's run on `router.fit_split` hold its first `fit_queries` queries."""
    return {"experiment.eval_queries": cfg.experiment.router.fit_queries if cfg.experiment.router else None}


def check_borrowed(store: Store, cfg: RunConfig, config: str | Path, sets: list[str]) -> None:
    """References of another experiment (`references_from`) pair with this one's evaluations only where this
    experiment's CONFIG would make the same baseline runs (pipeline.studies.baselines.baseline_changes): a
    ConfigError naming the run and the fields otherwise, or a missing run with the command that makes it. The same
    for its runs on `select_split` that exist (a missing one is listed by `selection`, never chosen)."""
    experiment = cfg.experiment
    checks = [(experiment.eval_split, [], True)]
    if experiment.select_split is not None:
        checks.append((experiment.select_split, variant_sets(select_changes(cfg)), False))
    for split, changes, required in checks:
        # the reference's evaluation changes have the last word over this experiment's --set, as where the
        # experiment makes its references (an arm's `--set rollout.m=6` is its training rollout's; a reference
        # samples L, as its evaluations do)
        wanted = load_config(config, baseline_sets(config, split, changes, before=sets))
        for m, rid in reference_runs(cfg, split).items():
            if not (store.run_dir(rid) / "config.yaml").is_file():
                if not required:
                    continue
                raise ConfigError(f"reference run {rid} not found under {store.root}: make it with `pipeline "
                                  f"baseline CONFIG --run-id {experiment.references_from} --method {m}`")
            # this experiment's plan (seeds, rounds evaluated) is its own; L and the queries are in rollout and
            # benchmark
            changed = [p for p in baseline_changes(load_config(store.run_dir(rid) / "config.yaml"), wanted)
                       if not p.startswith("experiment.") and p not in NOT_COMPUTED]
            if changed:
                sections = "/".join(dict.fromkeys(p.split(".")[0] for p in changed))
                raise ConfigError(f"reference run {rid} has another {sections} section than this experiment "
                                  f"({', '.join(changed)}): its numbers would not pair with these evaluations; drop "
                                  "experiment.references_from")


def references(store: Store, cfg: RunConfig, split: str | None = None) -> list[ReferenceArm]:
    """`eval_summary` of each `experiment.references` baseline run on `split` (default: the held-out one) that
    exists, with its `method` and `label` (the method, or `program-<file stem>`)."""
    runs = reference_runs(cfg, split)
    return [ReferenceArm.from_dict({"method": m, "label": method_tag(m), **eval_summary(store, rid).to_dict()})
            for m, rid in runs.items() if (store.run_dir(rid) / "config.yaml").is_file()]


def router_designs(cfg: RunConfig) -> list[str]:
    """The methods `experiment.router` routes among: router.designs, else the example menu's programs; each must be a
    reference (its held-out runs are what a router's choices are scored on)."""
    rc = cfg.experiment.router
    if rc is None:
        return []
    designs = list(rc.designs) or [PROGRAM_PREFIX + p for p in cfg.rollout.example_menu]
    if len(designs) < 2 or (missing := [d for d in designs if d not in cfg.experiment.references]):
        raise ConfigError("experiment.router: " + (f"{len(designs)} design(s), a router needs two or more"
                                                   if len(designs) < 2 else
                                                   f"{', '.join(missing)} not among experiment.references"))
    return designs


def reference_plan(cfg: RunConfig) -> list[tuple[str, str, dict, str]]:
    """The references' runs in the order the experiment makes them: (method, split, config changes, why). The
    router's designs go first on every split (held out, `select_split`, `router.fit_split`), so the routers and the
    choice among the designs can be read while the other references (CoT-SC samples at a temperature and replays
    nothing from the cache: an order of magnitude dearer a run) still run; then the others, held out and on
    `select_split`."""
    setup, designs = cfg.experiment, router_designs(cfg)
    splits = [(setup.eval_split, {}, "")]
    if setup.select_split:
        splits.append((setup.select_split, select_changes(cfg), " (the best fixed workflow is chosen there)"))
    fit = [(setup.router.fit_split, fit_changes(cfg), " (the routers are fitted there)")] if setup.router else []
    first = [(m, *split) for split in splits + fit for m in designs]
    return first + [(m, *split) for split in splits for m in reference_methods(cfg, split[0]) if m not in designs]


def routers(store: Store, cfg: RunConfig, held_out: list[ReferenceArm]) -> list[ReferenceArm]:
    """`experiment.router`'s arms on the held-out queries (pipeline.studies.router), once every design has finished
    its runs on the fit split, dev and the held-out split; none before (logged)."""
    router = cfg.experiment.router
    if router is None:
        return []
    labels = [method_tag(d) for d in router_designs(cfg)]
    fit_on, dev = references(store, cfg, router.fit_split), references(store, cfg, cfg.experiment.select_split)
    if not designs_finished(labels, fit_on, dev, held_out):
        log.info("router: the designs' runs on %s, %s and the held-out split are not all finished yet",
                 router.fit_split, cfg.experiment.select_split)
        return []
    arms, _ = router_arms(store, labels, fit_on, dev, held_out, router.c_grid, router.analyzers,
                          embedder(cfg.generator.model, router.analyzers))
    return arms


def designs_finished(labels: list[str], *splits: list[ReferenceArm]) -> bool:
    """Whether every design of `labels` has a finished run (no pending workflow) among each split's references."""
    return all(any(a.label == lab and not a.pending for a in arms) for arms in splits for lab in labels)


def best_fixed(chosen_on: list[ReferenceArm], held_out: list[ReferenceArm], budget: float | None,
               slack: float) -> Selection:
    """The best fixed workflow, chosen on another split than the held-out one. `chosen_on`, `held_out`: the
    references' summaries on each split (`references`); `budget`: the trained generator's held-out executor tokens
    per query. Candidates: the references whose run on the choosing split is finished (no pending workflow), ranked
    by Mean@L there (ties: fewer held-out executor tokens, then the label). `same_budget`: the first whose held-out
    executor tokens per query are at most (1 + slack) x budget (none without a budget); `any_budget`: the first."""
    tokens = {r.label: r.exec_tokens_per_query for r in held_out}
    rows = [Candidate(label=r.label, run_id=r.eval_run_id, queries=r.queries, mean_at_l=r.mean_at_l,
                      best_at_l=r.best_at_l, pending=r.pending, exec_tokens_per_query=(t := tokens.get(r.label)),
                      within_budget=budget is not None and t is not None and t <= (1 + slack) * budget)
            for r in chosen_on]
    ranked = sorted((r for r in rows if not r.pending and r.queries and r.mean_at_l is not None),
                    key=lambda r: (-r.mean_at_l, r.exec_tokens_per_query or 0.0, r.label))
    unfinished = [r for r in rows if r not in ranked]
    return Selection(budget_exec_tokens_per_query=budget, slack=slack,
                     same_budget=next((r.label for r in ranked if r.within_budget), None),
                     any_budget=ranked[0].label if ranked else None, candidates=ranked + unfinished,
                     unfinished=[r.label for r in unfinished])


def selection(store: Store, cfg: RunConfig, arms: list[ExperimentArm], refs: list[ReferenceArm]) -> Selection | None:
    """`best_fixed` on `experiment.select_split`, the budget the last evaluated round's executor tokens per query
    (mean over seeds); the references not run there yet listed as `missing`. None without a select_split."""
    experiment = cfg.experiment
    if experiment.select_split is None:
        return None
    last = max(eval_rounds(cfg))
    spent = [a.exec_tokens_per_query for a in arms if a.round == last and a.exec_tokens_per_query is not None]
    chosen_on = references(store, cfg, experiment.select_split)
    done = {r.method for r in chosen_on}
    return replace(best_fixed(chosen_on, refs, mean_or_none(spent), experiment.budget_slack),
                   split=experiment.select_split, last_round=last,
                   missing=[method_tag(m) for m in reference_methods(cfg, experiment.select_split)
                            if m not in done])


def evaluated(store: Store, cfg: RunConfig, seed: int, seeds: list[int]) -> bool:
    """Whether every evaluation of seed `seed` (`seed_rounds`) has finished its score stage in the store."""
    return all(store.manifest(eval_run_id(seed_run_id(cfg.run_id, seed), k, cfg.experiment.eval_split), 0, "score")
               is not None for k in seed_rounds(cfg, seed, seeds))


def select_eval_run(cfg: RunConfig, seed: int) -> str:
    """The evaluation run of seed `seed`'s last round on `select_split` (experiment.select_eval)."""
    return eval_run_id(seed_run_id(cfg.run_id, seed), cfg.rounds - 1, cfg.experiment.select_split)


def evaluate_on_select(store: Store, cfg: RunConfig, seed_plan: SeedPlan, call) -> bool:
    """experiment.select_eval: seed `seed_plan`'s last round evaluated on `select_split` (its first select_queries
    queries, L = eval_l, sampled as the held-out evaluations are), unless already scored; the checkpoint restored
    from the kept adapter first where it is gone (a store cloned from git). Returns whether it evaluated."""
    from pipeline.stages.rounds import restore_kept_checkpoints

    experiment = cfg.experiment
    if not experiment.select_eval or store.manifest(select_eval_run(cfg, seed_plan.seed), 0, "score") is not None:
        return False
    restore_kept_checkpoints(store, seed_plan.run_id)
    log.info("seed %d: evaluating round %d on %s (experiment.select_eval)", seed_plan.seed, cfg.rounds - 1,
             experiment.select_split)
    evaluate_tracked(str(store.root), seed_plan.run_id, cfg.rounds - 1, experiment.select_split, call=call,
                     changes=eval_changes(cfg) | {"benchmark.max_queries": experiment.select_queries})
    return True


def set_aside_evaluations(store: Store, cfg: RunConfig, seed_plan: SeedPlan, seeds: list[int],
                          lost: int | None) -> list[str]:
    """The evaluation runs of seed `seed_plan`'s checkpoints from round `lost` on, when its rounds are about to train
    them again (`lost`: pipeline.stages.rounds.lost_weights, a checkpoint gone after its train stage finished):
    moved intact under the seed run's `stale/` folder (Store.set_aside), where no view reads them, so that they
    sample again with the new weights instead of being reused. Returns their ids."""
    if lost is None:
        return []
    split = cfg.experiment.eval_split
    stale = [eid for k in seed_rounds(cfg, seed_plan.seed, seeds)
             if k >= lost and store.run_dir(eid := eval_run_id(seed_plan.run_id, k, split)).exists()]
    if stale:
        why = (f"run {seed_plan.run_id}: round {lost}'s checkpoint is gone and trains again, so evaluations {stale} "
               "are stale")
        where = store.set_aside(seed_plan.run_id, [store.run_dir(e) for e in stale], why)
        log.warning("seed %d: round %d's checkpoint is gone and trains again; the evaluations of its checkpoints "
                    "from round %d on (%s) are moved, intact, to %s, and run again", seed_plan.seed, lost, lost,
                    ", ".join(stale), where)
    return stale


def summarise(store: Store, cfg: RunConfig, seeds: list[int]) -> ExperimentSummary:
    """Per (seed, evaluated round): the eval run's summary; per round k >= 0 and metric: the pooled paired
    difference to the base model with its bootstrap interval (the first seed's base for every seed when
    `shared_base`); the curve over rounds; each reference's summary and every round's paired difference to it (the
    reference's per-query value is the base of every seed)."""
    split, experiment = cfg.experiment.eval_split, cfg.experiment
    arms, per_query = [], []
    for seed in seeds:
        for round_number in summary_rounds(cfg, seed, seeds):
            eid = seed_eval_run(cfg, seed, round_number)
            if not (store.run_dir(eid) / "config.yaml").is_file():
                continue
            summ = eval_summary(store, eid)
            arms.append(ExperimentArm.of(seed, round_number, summ))
            per_query += [{"seed": seed, "round": round_number, **q} for q in summ.per_query]
    base_seed = (lambda s: seeds[0]) if experiment.shared_base else (lambda s: s)
    paired = pair_rows(cfg, seeds, per_query, [k for k in eval_rounds(cfg) if k != BASE], compared_metrics(cfg),
                       lambda s, m: query_values(per_query, base_seed(s), BASE, m))
    refs = references(store, cfg)
    refs += routers(store, cfg, refs)
    against = [row for r in refs for row in pair_rows(
        cfg, seeds, per_query, eval_rounds(cfg), METRICS,
        lambda s, m, r=r: {q["query_id"]: q[m] for q in r.per_query if q.get(m) is not None}, r.label)]
    # training runs' rewarded samples whose code touched the harness's surface (docs/sandbox.md, scores.flags)
    flagged = {seed_run_id(cfg.run_id, s): flagged_rewarded(store, seed_run_id(cfg.run_id, s)) for s in seeds}
    chosen = selection(store, cfg, arms, refs)
    select_arms = [ExperimentArm.of(s, cfg.rounds - 1, eval_summary(store, eid)) for s in seeds if
                   experiment.select_eval and store.manifest(eid := select_eval_run(cfg, s), 0, "score") is not None]
    parts = part_rounds(store, cfg, seeds, [a.seed for a in select_arms])
    labels = label_checks(store, cfg, parts)
    return ExperimentSummary(experiment=cfg.run_id, seeds=seeds, rounds=cfg.rounds, split=split,
                             eval_queries=experiment.eval_queries, eval_l=experiment.eval_l,
                             shared_base=experiment.shared_base, base_from=experiment.base_from,
                             start_from=experiment.start_from, arms=arms,
                             paired=paired, curve=curve(cfg, seeds, per_query), references=refs,
                             paired_references=against, selection=chosen,
                             per_query=per_query, flagged_rewarded=flagged,
                             adapters=[a for s in seeds if (a := kept_adapter(store, cfg, s)) is not None],
                             verdict=verdict(experiment.criterion, max(eval_rounds(cfg)), experiment.ci_level, against,
                                             refs, chosen, labels),
                             query_parts=query_parts(store, [a.eval_run_id for a in arms] + [
                                 r.eval_run_id for r in refs if r.method in experiment.references]),
                             select_arms=select_arms, parts=parts, labels=labels,
                             stage_walls=[{k: r[k] for k in ("part", "run_id", "round", "stage", "wall_s", "machine")}
                                          for r in status(store, cfg, seeds) if r["done"] and r["wall_s"]])


def part_rounds(store: Store, cfg: RunConfig, seeds: list[int], select_seeds: list[int]) -> list[PartRound]:
    """Per split, evaluated round and part, pooled over the seeds evaluated there (pipeline.studies.choices.
    part_rows): the held-out evaluations of `seeds`, and the last round's on select_split of `select_seeds`."""
    split, out = cfg.experiment.eval_split, []
    plans = [(split, k, [(s, seed_eval_run(cfg, s, k)) for s in seeds if k in summary_rounds(cfg, s, seeds)])
             for k in eval_rounds(cfg)]
    if select_seeds:
        plans.append((cfg.experiment.select_split, cfg.rounds - 1,
                      [(s, select_eval_run(cfg, s)) for s in select_seeds]))
    for on, k, runs in plans:
        runs = [(s, rid) for s, rid in runs if store.manifest(rid, 0, "score") is not None]
        out += [PartRound(split=on, round=k, seeds=[s for s, _ in runs], **row)
                for row in part_rows(store, [rid for _, rid in runs])]
    return out


def label_checks(store: Store, cfg: RunConfig, parts: list[PartRound]) -> list[LabelCheck]:
    """experiment.select_eval with a router: per part, the policy's likeliest label on select_split (its odds pooled
    over the seeds' last-round evaluations there) against the per-part router's pick fitted on `router.fit_split`
    (pipeline.core.router.part_choice), each scored on select_split: a design by its reference run there (the part's
    queries), `own` by the workflows the generator wrote there. [] until the designs' runs on both splits are
    finished."""
    experiment = cfg.experiment
    if not experiment.select_eval or experiment.router is None:
        return []
    methods = router_designs(cfg)
    tags = [method_tag(m) for m in methods]
    # a design as the policy's labels name it: a menu program by its file's stem
    names = {t: program_parts(m)[0].stem if m.startswith(PROGRAM_PREFIX) else m for m, t in zip(methods, tags,
                                                                                                  strict=True)}
    fit_on, dev = references(store, cfg, experiment.router.fit_split), references(store, cfg, experiment.select_split)
    if not designs_finished(tags, fit_on, dev):
        return []
    train, chosen_on = design_table(store, fit_on, tags), design_table(store, dev, tags)
    picks = {p: names[tags[d]] for p, d in part_choice(train.scores, train.tokens, train.parts).items()}
    scores: dict[str, dict[str, float | None]] = {}
    for part in picks:
        cols = [i for i, p in enumerate(chosen_on.parts) if p == part]
        scores[part] = {names[t]: float(chosen_on.scores[d, cols].mean()) if cols else None for d, t in enumerate(tags)}
    odds = {}
    for row in parts:
        if row.split == experiment.select_split and row.round == cfg.rounds - 1:
            odds[row.part] = row.odds()
            scores.setdefault(row.part, {})[OWN] = (row.labels.get(OWN) or {}).get("mean_score")
    return [LabelCheck(**c) for c in likeliest_labels(odds, scores, picks)]


def query_parts(store: Store, runs: list[str]) -> dict[str, str]:
    """Held-out query -> its part (a procedural task; else the benchmark), from the queries of `runs` (the first
    that holds a query names it): the per-part tables of `ExperimentSummary.markdown` read them."""
    out: dict[str, str] = {}
    for rid in runs:
        rows = store.sql(QUERY_PARTS_SQL, {"run": rid}, run=rid)
        for row in rows.iter_rows(named=True):
            out.setdefault(row["query_id"], row["part"] or "")
    return dict(sorted(out.items()))


QUERY_PARTS_SQL = ("SELECT query_id, coalesce(json_extract_string(any_value(meta), '$.task'), any_value(benchmark)) "
                   "AS part FROM queries WHERE run_id = $run GROUP BY query_id")


def kept_round(cfg: RunConfig, seed: int) -> tuple[str, int]:
    """(seed run, round) of the adapter the experiment keeps for seed `seed`: its last round."""
    return seed_run_id(cfg.run_id, seed), cfg.rounds - 1


def kept_adapter(store: Store, cfg: RunConfig, seed: int) -> KeptAdapter | None:
    """Seed `seed`'s last-round adapter as the summary records it, or None where none is kept (`keep_adapter`)."""
    run_id, k = kept_round(cfg, seed)
    folder = store.adapter_dir(run_id, k)
    if store.remote or not adapter_complete(folder):
        return None
    mb = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6
    return KeptAdapter(seed=seed, run_id=run_id, round=k, folder=folder.relative_to(store.root).as_posix(),
                       mb=round(mb, 2))


def keep_adapter(store: Store, cfg: RunConfig, seed: int, round: int | None = None) -> KeptAdapter | None:
    """Keep seed `seed`'s last-round checkpoint (or round `round`'s) apart from it (Store.keep_adapter): a store kept
    in git leaves its checkpoints out (data/README.md), but keeps `<store>/adapters/<seed run>-r<k>/`: the LoRA files,
    the run's config, a README naming the base, the run, the round and the command that evaluates it on new problems,
    so that anyone can check the result on problems the experiment never saw, and the digest of the checkpoint it
    was made from (KEPT_SOURCE), with which a fresh clone restores the checkpoint (Store.restore_checkpoint).
    An earlier round's copy is kept only while its seed runs, for that restore (`drop_resume_copies`). Unchanged when
    already kept; None without a complete checkpoint (a store cloned from git) or on object storage, or for an
    earlier round."""
    run_id, last = kept_round(cfg, seed)
    round_number = last if round is None else round
    if store.remote:  # never committed to git: its checkpoints stay in the bucket, where any machine can read them
        log.info("seed %d: the s3:// store keeps its adapter as round %d's checkpoint only", seed, round_number)
        return None
    ckpt = store.checkpoint_dir(run_id, round_number)
    if not adapter_complete(ckpt):
        return None
    notes: dict[str, str | bytes] = {"README.md": adapter_readme(cfg, seed, store, round_number),
                                     KEPT_SOURCE: weights_sha256(ckpt) + "\n"}
    try:
        notes[ADAPTER_WEIGHTS] = half_weights((ckpt / ADAPTER_WEIGHTS).read_bytes())  # half the bytes for git
    except ValueError as e:  # kept as trained: the evaluations read the same file and will say what is wrong
        log.warning("seed %d: %s: %s; kept as it is", seed, ckpt / ADAPTER_WEIGHTS, e)
    store.keep_adapter(run_id, round_number, notes)
    if round_number != last:
        return None
    kept = kept_adapter(store, cfg, seed)
    log.info("%s, under %s", kept.line(), store.root)
    return kept


def keeping(store: Store, cfg: RunConfig, seed: int, after_round=None):
    """`run_rounds`' after_round for a seed run: each round's checkpoint kept as soon as it is trained (`keep_adapter`),
    so that a store committed while the seed runs resumes on a fresh clone; then the caller's `after_round`."""
    def hook(run_id: str, store_root: str, k: int) -> None:
        keep_adapter(store, cfg, seed, k)
        if after_round is not None:
            after_round(run_id, store_root, k)
    return hook


def drop_resume_copies(store: Store, cfg: RunConfig, seed: int) -> None:
    """Once seed `seed` is evaluated, no stage needs its earlier rounds' checkpoints again: their kept copies
    (`keep_adapter` with a round) go, and only the last round's stays for git."""
    run_id, last = kept_round(cfg, seed)
    for k in range(last):
        if (folder := store.adapter_dir(run_id, k)).is_dir():
            shutil.rmtree(folder)


def adapter_readme(cfg: RunConfig, seed: int, store: Store, round_number: int | None = None) -> str:
    """A kept adapter's README.md: what it is and the commands that evaluate, load and serve it, with the base and the
    folder as the config names them (an embedded or hub id; a store kept in git: a path relative to the repository's
    root)."""
    (run_id, last), base = kept_round(cfg, seed), cfg.generator.model
    round_number = last if round_number is None else round_number
    folder = PurePosixPath(cfg.store.root) / store.adapter_dir(run_id, round_number).relative_to(store.root).as_posix()
    base_dir = f"the folder `pipeline prepare-model {base}` prints" if base.startswith("embedded:") else f"`{base}`"
    rank = 1 << max(3, (cfg.training.lora_r - 1).bit_length())  # vLLM takes powers of two from 8 up
    which, resume = ("the last", "") if round_number == last else ("not the last", (
        "\nIt is kept only while the seed runs, so that a fresh clone of the store resumes the run instead of training "
        "this round again,\nand goes once the seed is evaluated.\n"))
    trained = f"round {round_number}, {which} of {cfg.rounds}"
    return f"""# {folder.name}

The LoRA adapter (peft: adapter_config.json, adapter_model.safetensors) that {trained},
of run `{run_id}` trained: seed {seed} of the experiment `{cfg.run_id}`. Its base model is `{base}`
(adapter_config.json names it too); config.yaml is the run's frozen config. Its weights are the checkpoint's,
rounded to float16 for size; loaders cast them to the model's dtype.
{resume}
Evaluate it on new problems, with the experiment's evaluation settings (queries, L), in a run of its own:

    pipeline evaluate-adapter {folder} --set {new_problems(cfg)}

Without `--set` it runs on the experiment's own test queries again. Load it with peft, the base model loaded from
{base_dir}:

    PeftModel.from_pretrained(base_model, "{folder}")

Serve it with vLLM (its OpenAI-compatible server; requests name the model `{folder.name}`):

    python -m vllm.entrypoints.openai.api_server --model <the base model's folder> \\
        --enable-lora --max-lora-rank {rank} --lora-modules {folder.name}={folder}
"""


def status(store: Store, cfg: RunConfig, seeds: list[int]) -> list[dict]:
    """Where the experiment stands, read from the store (nothing runs): per stage of every run of the plan (the
    seeds' rounds, their evaluations, the references on every split they run on: `reference_rows`), whether it is
    done (its manifest), its wall seconds (the last run that did work, `stage_timings`) and its workflows."""
    split = cfg.experiment.eval_split
    held_out = planned_workflows(cfg, "evaluate")
    runs: list[PlannedRun] = []
    for s in seeds:
        runs.append(("train", seed_run_id(cfg.run_id, s), cfg.rounds, ROUND_STAGES, planned_workflows(cfg, "train")))
        runs += [("evaluate", eval_run_id(seed_run_id(cfg.run_id, s), k, split), 1, EVAL_STAGES, held_out)
                 for k in seed_rounds(cfg, s, seeds)]
        if cfg.experiment.select_eval:
            runs.append((f"evaluate on {cfg.experiment.select_split}", select_eval_run(cfg, s), 1, EVAL_STAGES,
                         planned_workflows(cfg, "select")))
    return stage_rows(store, runs + reference_rows(cfg))


def reference_rows(cfg: RunConfig) -> list[PlannedRun]:
    """The references' runs as `status` lists them: in the order the experiment makes them (`reference_plan`: the
    router's fit runs on `router.fit_split` among them), or, borrowed (`references_from`), the owner's runs on the
    held-out split and `select_split`."""
    setup = cfg.experiment
    splits = (setup.eval_split, setup.select_split)
    plan = ([(m, s) for s in splits if s for m in reference_methods(cfg, s)] if setup.references_from
            else [(m, s) for m, s, _, _ in reference_plan(cfg)])
    planned = dict(zip(splits, (planned_workflows(cfg, "evaluate"), planned_workflows(cfg, "select")), strict=True))
    if setup.router is not None:
        planned.setdefault(setup.router.fit_split, planned_workflows(cfg, "fit"))
    return [("reference" if s == setup.eval_split else f"reference on {s}", reference_runs(cfg, s)[m], 1, EVAL_STAGES,
             planned.get(s)) for m, s in plan]


def planned_workflows(cfg: RunConfig, kind: str) -> int | None:
    """The workflows a round of a run is planned to hold, the unit `time_left` scales by: a training round's queries
    x workflows a query (flat: m; two-level: N_A x N_W), an evaluation's or a reference's held-out queries x L
    (`select`: on the selection split; `fit`: a router design's on `router.fit_split`); None where it is not known in
    advance (all queries of a split, W4S's refinement)."""
    setup, ro = cfg.experiment, cfg.rollout
    if kind == "train":
        per_query = {"flat": ro.m, "two_level": ro.n_agents * ro.n_workflows}.get(ro.mode)
        queries = cfg.benchmark.max_queries
    elif kind in ("evaluate", "select", "fit"):
        per_query = setup.eval_l
        queries = {"evaluate": setup.eval_queries, "select": setup.select_queries,
                   "fit": setup.router.fit_queries if setup.router else None}[kind]
    else:
        raise ValueError(f"planned_workflows: kind {kind!r} (train, evaluate, select or fit)")
    return None if per_query is None or queries is None else queries * per_query


PlannedRun = tuple[str, str, int, tuple[str, ...], int | None]  # (part, run id, rounds, stages, workflows a round)


def stage_rows(store: Store, runs: list[PlannedRun]) -> list[dict]:
    """`status` rows of planned runs: per round and stage whether it is done (its manifest), its wall seconds (the
    last run that did work, `stage_timings`), the round's workflows (its rollout's count once it has one, else
    the plan's) and, for a train stage not done, the step its saved progress resumes at (`saved_step`: (next step,
    the plan's steps), pipeline.stages.progress)."""
    rows = []
    for part, rid, rounds, stages, planned in runs:
        walls = {(r["round"], r["stage"]): (r["wall_s"], r["machine"])
                 for r in stage_timings(store, rid).iter_rows(named=True)}
        for k in range(rounds):
            done = {st: store.manifest(rid, k, st) for st in dict.fromkeys(("rollout", *stages))}
            workflows = (done["rollout"] or {}).get("counts", {}).get("workflows", planned)
            saved = saved_steps(progress_path(store, rid, k)) if "train" in done and done["train"] is None else None
            rows += [{"part": part, "run_id": rid, "round": k, "stage": st, "done": done[st] is not None,
                      "wall_s": walls.get((k, st), (None, None))[0], "machine": walls.get((k, st), (None, None))[1],
                      "workflows": workflows, "saved_step": saved if st == "train" else None} for st in stages]
    return rows


def timing_machines(rows: list[dict]) -> dict[str, int]:
    """How many of the done, timed stages of `status` each machine took (`unrecorded`: lines older than the record):
    an estimate from stages of two kinds of machine is no estimate for either."""
    out: dict[str, int] = {}
    for r in rows:
        if r["done"] and r["wall_s"]:
            key = r.get("machine") or "unrecorded"
            out[key] = out.get(key, 0) + 1
    return out


def time_left(rows: list[dict], machine: str | None = None) -> tuple[float, int, int]:
    """(seconds, stages without an estimate, stages estimated from other machines' stages) for the stages of
    `status` not done. A stage is estimated from the done stages of the same part and stage name (e.g. every
    evaluation's score stage), else of the same stage name in any part (a reference's score stage by the
    evaluations'): their wall seconds per workflow times its workflows, so an evaluation of 32 queries is not costed
    as one of 64; where either side has no workflow count, their mean wall time. With `machine` (this one,
    `pipeline.engines.hardware.machine()`), the done stages that machine timed come first, kind by kind: machines
    differ by several times (docs/performance.md), and a stage another machine timed is no estimate for this one
    where this one has timed its kind. A done stage without a timing counts 0 s: a fixed program's rollout writes
    its programs in the command, not as a timed stage. A train stage with saved progress (`saved_step`) counts the
    share of its steps left (its passes before step 0 are done by then: an estimate a little high)."""
    walls: dict[tuple, list[float]] = {}
    rates: dict[tuple, list[float]] = {}  # key -> [seconds, workflows] of the done stages counted
    for row in rows:
        if row["done"]:
            mine = machine is not None and row.get("machine") == machine
            for key in ((row["part"], row["stage"]), (row["stage"],)):
                for k in ((*key, machine), key) if mine else (key,):
                    walls.setdefault(k, []).append(row["wall_s"] or 0.0)
                    if row.get("workflows"):
                        acc = rates.setdefault(k, [0.0, 0])
                        acc[0] += row["wall_s"] or 0.0
                        acc[1] += row["workflows"]
    known, unknown, elsewhere = 0.0, 0, 0
    for row in (r for r in rows if not r["done"]):
        kinds = ((row["part"], row["stage"]), (row["stage"],))
        order = [(*k, machine) for k in kinds] + list(kinds) if machine is not None else list(kinds)
        key = next((k for k in order if k in walls), None)
        if key is None:
            unknown += 1
            continue
        elsewhere += machine is not None and key[-1] != machine
        share = 1.0 - row["saved_step"][0] / row["saved_step"][1] if row.get("saved_step") else 1.0
        if row.get("workflows") and key in rates:
            known += rates[key][0] / rates[key][1] * row["workflows"] * share
        else:
            known += mean_or_none(walls[key]) * share
    return known, unknown, elsewhere


def status_table(rows: list[dict]) -> pl.DataFrame:
    """`status` one line a run, in plan order: its part, stages done of all, wall minutes spent (done stages) and,
    where a train stage has saved progress, its round and step (`saved`)."""
    df = pl.DataFrame([r | {"saved": f"round {r['round']}: step {r['saved_step'][0]} of {r['saved_step'][1]}"
                            if r.get("saved_step") else None} for r in rows],
                      schema={"part": pl.String, "run_id": pl.String, "round": pl.Int64, "stage": pl.String,
                              "done": pl.Boolean, "wall_s": pl.Float64, "saved": pl.String})
    table = (df.group_by("part", "run_id", maintain_order=True)
             .agg(stages_done=pl.format("{}/{}", pl.col("done").sum(), pl.len()),
                  minutes=(pl.col("wall_s").filter(pl.col("done")).sum() / 60).round(1),
                  saved=pl.col("saved").drop_nulls().first()))
    return table if table["saved"].null_count() < table.height else table.drop("saved")


def paired_interval(pairs: list[tuple[int, str, float]], seeds: list[int], experiment) -> dict:
    """(seed, query, arm - base) differences -> their mean with the seeds-then-queries interval (the headline),
    the intervals over pairs and over queries, and each seed's own mean and interval (in `seeds` order): the fields
    of a PairedDiff, for the paired row (RoundDiff, ArmDiff) that holds them."""
    diffs = [d for _, _, d in pairs]
    ci = bootstrap_ci(diffs, experiment.bootstrap, experiment.ci_level, seed=0)
    by_query = bootstrap_ci(diffs, experiment.bootstrap, experiment.ci_level, seed=0, clusters=[q for _, q, _ in pairs])
    hier = hierarchical_ci(pairs, experiment.bootstrap, experiment.ci_level, seed=0)
    mine = seed_intervals(pairs, experiment.bootstrap, experiment.ci_level, seed=0)
    per_seed = [SeedDiff(seed=s, n=c.n, mean=c.mean, lo=c.lo, hi=c.hi) for s in seeds if (c := mine.get(s)) is not None]
    return {**asdict(ci), "lo_seeds_queries": hier.lo, "hi_seeds_queries": hier.hi, "lo_by_query": by_query.lo,
            "hi_by_query": by_query.hi, "per_seed": per_seed}


def mean_or_none(xs: list[float]) -> float | None:
    """The mean, or None for no values (an arm without evaluations)."""
    return sum(xs) / len(xs) if xs else None


def write_results(store: Store, summary: ExperimentSummary, extra: dict | None = None) -> Path:
    """experiment.json (the summary, then the run's facts in `extra`), per_query.csv and report.html under
    <store>/experiments/<run_id>/; returns the folder."""
    dest = experiment_dir(store, summary.experiment)
    with store.output_dir(dest) as out:  # on object storage: written locally, then uploaded file by file
        tmp = out / ".experiment.json.tmp"
        tmp.write_text(json.dumps(summary.to_dict() | (extra or {}), indent=1, default=str))
        tmp.replace(out / "experiment.json")
        if summary.per_query:
            pl.DataFrame(summary.per_query).write_csv(out / "per_query.csv")
        build_experiment_report(summary, out / "report.html")
    return dest


def summarise_stored(config: str | Path, sets: list[str] | None = None, run_id: str | None = None) -> ExperimentSummary:
    """The summary rewritten from the runs in the store, nothing run (no model, no executor): every seed whose
    evaluations are all scored, the references and routers that exist, the verdict; written as `run_experiment`
    writes it (the run facts of the summary it replaces kept, `resummarised` added). Returns it."""
    from pipeline.stages.rounds import study_config

    path, sets, cfg = study_config(config, sets, run_id)
    store = store_for(cfg.store)
    order = [p.seed for p in plan(cfg)]
    summary = summarise(store, cfg, [s for s in order if evaluated(store, cfg, s, order)])
    stored = read_summary(store, cfg.run_id)
    known = set(ExperimentSummary.names())
    facts = {k: v for k, v in (stored.extra.items() if stored is not None else ()) if k not in known}
    summary.results = str(write_results(store, summary, facts | {
        "resummarised": {"config": str(path), "sets": sets, "note": "rewritten from the store, nothing run"}}))
    return summary


def read_summary(store: Store, run_id: str) -> ExperimentSummary | None:
    """The experiment's experiment.json as last written, or None before any."""
    file = experiment_dir(store, run_id) / "experiment.json"
    return ExperimentSummary.read(file) if file.is_file() else None


def run_experiment(config: str | Path, call, seeds: int | None = None, run_id: str | None = None,
                   sets: list[str] | None = None, command: str | None = None, after_round=None,
                   after_seed=None, only_seeds: list[int] | None = None,
                   only_references: bool = False) -> ExperimentSummary:
    """Train and evaluate every seed through `call` (a stage caller), then write the summary; returns it.
    `after_round(run_id, store_root, k)` runs after each round of a seed run, `after_seed(summary, results folder)`
    after each seed's summary is written and after the references' (the experiment flow publishes both as Prefect
    artifacts). `only_references`: no seed runs, only the references (the summary holds the seeds already in the
    store). A seed with every evaluation in the store is not re-entered; one that is first sets aside the evaluations
    of checkpoints that its rounds train again (`set_aside_evaluations`)."""
    from pipeline.stages.rounds import (
        lost_weights,
        restore_kept_checkpoints,
        run_rounds,
        settled_round,
        study_config,
    )

    path, sets, cfg = study_config(config, sets, run_id)
    store = store_for(cfg.store)
    if cfg.experiment.references_from:
        check_borrowed(store, cfg, path, sets)
    started = time.perf_counter()
    extra: dict = {"command": command, "seed_wall_s": {}, "config": str(path), "sets": sets}
    done: list[int] = []
    out: Path | None = None

    plans = plan(cfg, list(range(seeds)) if seeds is not None else None)
    order = [p.seed for p in plans]
    if only_seeds is not None and (unknown := sorted(set(only_seeds) - set(order))):
        raise ValueError(f"--only-seed {unknown}: not among the experiment's seeds {order}")
    if only_seeds is not None and not only_seeds:
        raise ValueError("--only-seed: no seed given")
    if only_references and (only_seeds is not None or not cfg.experiment.references):
        raise ValueError("--only-references: " + ("not with --only-seed" if only_seeds is not None
                                                   else "the config's experiment.references is empty"))
    mine = [] if only_references else [p for p in plans if only_seeds is None or p.seed in only_seeds]

    def publish(when: str) -> tuple[ExperimentSummary, Path]:
        ready = [s for s in order if s in done or evaluated(store, cfg, s, order)]  # in plan order: shared_base
        summary = summarise(store, cfg, ready)
        out = write_results(store, summary, extra | {"wall_s": round(time.perf_counter() - started, 1)})
        for line in summary.headline():
            log.info("%s: %s", when, line)
        if after_seed is not None:
            after_seed(summary, out)
        return summary, out

    # one executor server for every stage of every seed, evaluation and reference (pipeline.engines.servers); a
    # process running some seeds logs its own server apart from the others'
    logs = experiment_dir(store, cfg.run_id) / "server-logs"
    if only_seeds is not None:
        logs = logs / ("seed-" + "-".join(map(str, sorted(only_seeds))))
    with sharing(cfg, logs):
        for seed_plan in mine:
            if evaluated(store, cfg, seed_plan.seed, order):
                # finished (`publish` counts it): its checkpoints may be pruned (data/README.md keeps stores without
                # them in git), and re-entering its rounds would then train them again
                log.info("seed %d: every evaluation is in the store; not re-entered", seed_plan.seed)
                keep_adapter(store, cfg, seed_plan.seed)  # where its weights are still here
                if evaluate_on_select(store, cfg, seed_plan, call):  # select_eval set after the seed was evaluated
                    summary, out = publish(f"after seed {seed_plan.seed} on {cfg.experiment.select_split}")
                continue
            changes = seed_plan.changes | start_changes(store, cfg, seed_plan.seed)
            check_base(store, cfg, path, sets, seed_plan, changes)
            t_seed = time.perf_counter()
            log.info("seed %d: training run %s (%d rounds)", seed_plan.seed, seed_plan.run_id, cfg.rounds)
            restore_kept_checkpoints(store, seed_plan.run_id)  # a fresh clone of a store cut off mid-seed
            since = 0  # as run_rounds will see it: settled_round once the run is frozen
            if store.read_config(seed_plan.run_id) is not None:
                since = settled_round(store, seed_plan.run_id, cfg.rounds,
                                      run_config(store, seed_plan.run_id).config_hash())
            set_aside_evaluations(store, cfg, seed_plan, order, lost_weights(store, seed_plan.run_id, since))
            run_rounds(path, cfg.rounds, seed_plan.run_id, call, keeping(store, cfg, seed_plan.seed, after_round),
                       sets=variant_sets(changes, before=sets), observer=TRACKERS)
            for k in seed_rounds(cfg, seed_plan.seed, order):
                log.info("seed %d: evaluating %s on %s", seed_plan.seed, "the base model" if k < 0 else f"round {k}",
                         cfg.experiment.eval_split)
                evaluate_tracked(str(store.root), seed_plan.run_id, k, cfg.experiment.eval_split, call=call,
                                 changes=eval_changes(cfg))
            evaluate_on_select(store, cfg, seed_plan, call)
            keep_adapter(store, cfg, seed_plan.seed)
            drop_resume_copies(store, cfg, seed_plan.seed)
            extra["seed_wall_s"][seed_plan.seed] = round(time.perf_counter() - t_seed, 1)
            done.append(seed_plan.seed)
            summary, out = publish(f"after seed {seed_plan.seed}")
        # derived runs on the same split, queries and L, resumed like the rest; not in a process of some seeds, which
        # may run beside others
        if only_seeds is None and cfg.experiment.references:
            t_refs = time.perf_counter()
            for method, split, changes, why in [] if cfg.experiment.references_from else reference_plan(cfg):
                log.info("reference %s on %s%s", method, split, why)
                # the experiment's --set (an arm's training rollout.m) under the reference's evaluation changes, as
                # in its evaluation runs and in check_borrowed
                run_baseline(str(path), method, call, cfg.run_id, split, variant_sets(changes), before=sets)
            extra["references_wall_s"] = round(time.perf_counter() - t_refs, 1)
            summary, out = publish("after the references")
    if out is None:  # every seed of the plan was finished already, and no reference to run
        summary, out = publish("from the store")
    summary.results = str(out)
    summary.wall_s = round(time.perf_counter() - started, 1)
    return summary
