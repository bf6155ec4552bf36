"""The methods side by side (`pipeline compare-methods CONFIG`): each method of the papers this project
implements trained from the same base model on the same training queries, S seeds x R rounds, then evaluated on the
same held-out queries with its own inference procedure, against the base model, against SPOGW and against the best
fixed workflow chosen on dev (`task_best`).

A method is a record in `METHODS` (pure data, as verl's registries): its overlay on CONFIG (typed changes, as
pipeline.config.with_changes takes them), whether it trains, and how it is evaluated. For each seed s of
`experiment.seeds` (as `pipeline experiment`):
- the base model, once per seed and the same for every method: the run `<run_id>-s<s>` of `pipeline experiment`
  (CONFIG with the seed's overrides) evaluated at k = -1 (pipeline.studies.evaluate: `<run_id>-s<s>-eval-base`), or
  `<run_id>-base-s<s>` when scoring by the metric alone would change CONFIG;
- a method whose overlay leaves CONFIG as it is (the config hash: CONFIG's own method, usually spogw) trains that same
  run `<run_id>-s<s>`: what `pipeline experiment` computed is reused, and the other way round;
- each trained method X: the run `<run_id>-X-s<s>` (CONFIG + seed + X's overlay [+ its swept learning rate] + the
  `--arm-set X:...` overrides) trains `rounds` rounds (pipeline.stages.rounds.run_rounds), then its last checkpoint is
  evaluated on the held-out split, per evaluation of X:
  - `sample`: L workflows per held-out query in the mode's evaluation mode (`evaluate_tracked`); a two-level run
    samples N_A x N_W = L workflows (`two_level_shape`) and adds Sel@L, the proposal's inference rule;
  - `refined` (W4S): the checkpoint refines one workflow for the whole validation part (`rollout.mode: refine`, one
    task of the training query count on `baselines.selection_split`: dev when CONFIG holds one out) in the run
    `<arm>-eval-<split>-r<k>-refine`; the refined candidate with the best validation accuracy (ties: the earliest
    turn; `refined_workflow`) is run L times on every held-out query, like a fixed program
    (`baselines.run_fixed`, run `<arm>-baseline-refined`);
- each training-free reference on the base model: `smc` (BayesFlow's SMC sampler, pipeline.studies.smc, N = L, run
  `<run_id>-s<s>-smc`) and `task_best` (the best fixed program per task chosen on the selection split,
  pipeline.studies.baselines; it samples nothing, so it runs once and pairs with every seed).
Every evaluation scores the benchmark metric alone (`METRIC_ONLY`: FlowReasoner's complexity and diversity weights
shape its training reward, not its held-out score) with the same seed, split, queries and L, so per-query numbers pair
up across arms.

Per arm (a method's evaluation; `w4s` and `w4s/refined` are two arms of one training run) the summary gives Mean@L,
Best@L, Majority@L (Sel@L where the mode selects), valid share, generator and executor tokens per held-out query (the
store's `query_usage`), training wall time (the training run's stage wall seconds, pipeline.studies.report's
`stage_timings`, mean over seeds), evaluation wall time (the evaluation run's sampling and scoring, or its scoring
alone for a fixed program; SMC's particles and look-aheads are its sampling; mean over the seeds that timed it)
and the paired difference to the base model and to SPOGW per (seed, query) with the seeds-then-queries interval
(`experiment.paired_interval`). Sel@L is paired with the other arm's Mean@L when that arm
has none: both are the score of the one workflow delivered per query.

`lr_sweep`: before the comparison, each trained method trains one seed (the first) one round per learning rate, in
`<run_id>-X-lr<lr>-s<s>`, evaluated on the dev split (CONFIG must train on `train` with `benchmark.dev_share` > 0:
the test split is never used for the choice); the best dev Mean@L (ties: the first listed) becomes X's
`training.lr` (a `--arm-set X:training.lr=...` still wins) and the sweep is kept in the summary.

Written to `<store>/experiments/<run_id>-methods/methods.json` (every number, per seed and per query) and
`methods.md` (the tables), rewritten after each seed. Re-running resumes: finished stages are skipped by their
manifests, in training, evaluation, validation and reference runs alike. A run naming fewer methods than the summary
on disk (`--methods smc` to finish one arm) keeps the other arms in it, their numbers read again from their runs
(`earlier_arms`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from pipeline.config import ConfigError, RunConfig, load_config, variant_sets
from pipeline.core.learning import METRICS, paired_differences
from pipeline.engines.servers import sharing
from pipeline.engines.workflow import extract_code
from pipeline.run import open_run
from pipeline.stages.modes import get_mode
from pipeline.store import Store, store_for
from pipeline.studies.baselines import SELECT, TASK_BEST, run_baseline, run_fixed, selection_split
from pipeline.studies.evaluate import EVAL_STAGES, eval_summary, open_eval_run
from pipeline.studies.experiment import (
    PlannedRun,
    SeedPlan,
    drop_resume_copies,
    eval_changes,
    keep_adapter,
    keeping,
    mean_or_none,
    paired_interval,
    plan,
    planned_workflows,
    seed_run_id,
    splits_overlap,
    stage_rows,
)
from pipeline.studies.formatting import round_s
from pipeline.studies.report import stage_timings, write_study
from pipeline.studies.smc import run_smc
from pipeline.studies.summaries import (
    BASE,
    BASE_ARM,
    BEST_FIXED_ARM,
    REFERENCE_ARM,
    ArmDiff,
    ArmRun,
    EvalSummary,
    LrSweep,
    MethodArm,
    MethodSeedRow,
    MethodsSummary,
    SweepRun,
)
from pipeline.studies.tracking import TRACKERS, evaluate_tracked

log = logging.getLogger("pipeline.studies.methods")

# how an arm is evaluated on the held-out split (module doc)
SAMPLE, REFINED, SMC, TASK_BEST_EVAL = "sample", "refined", "smc", TASK_BEST
EVALUATIONS = (SAMPLE, REFINED, SMC, TASK_BEST_EVAL)
# the stages an evaluation's run times (timings.jsonl): sampling then scoring, or scoring alone for fixed programs
TIMED = {SAMPLE: EVAL_STAGES, SMC: EVAL_STAGES, REFINED: ("score",), TASK_BEST_EVAL: ("score",)}
ALL_METRICS = (*METRICS, "select_at_l")
# held-out scores are the benchmark metric: no reward shaping in any evaluation
METRIC_ONLY: dict[str, Any] = {"scoring.reward.complexity_weight": 0.0, "scoring.reward.cost_weight": 0.0,
                               "scoring.reward.diversity_weight": 0.0}


@dataclass(frozen=True)
class Method:
    name: str
    paper: str  # the method in one line: paper, objective, inference
    changes: dict[str, Any] = field(default_factory=dict)  # its overlay on CONFIG (pipeline.config.with_changes)
    trained: bool = True  # False: a training-free reference on the base model
    evaluations: tuple[str, ...] = (SAMPLE,)  # its held-out evaluations; the first one's arm is named after it
    seeded: bool = True  # a reference whose result depends on the seed (run per seed); False: once, for all seeds

    def arm(self, evaluation: str) -> str:
        """The arm (table row) of one of its evaluations: the method's name, or `<name>/<evaluation>`."""
        return self.name if evaluation == self.evaluations[0] else f"{self.name}/{evaluation}"


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    if method.name == BASE_ARM or "/" in method.name:
        raise ValueError(f"method name {method.name!r} is reserved or not a run id part")
    bad = [e for e in method.evaluations if e not in EVALUATIONS]
    if bad or not method.evaluations:
        raise ValueError(f"method {method.name!r}: evaluations must be some of {EVALUATIONS}, got {method.evaluations}")
    if method.trained != all(e in (SAMPLE, REFINED) for e in method.evaluations):
        raise ValueError(f"method {method.name!r}: trained methods are evaluated by sample/refined, references by smc/"
                         "task_best")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}") from None


# SPOGW (arXiv 2510.04147 / docs/algorithms.md): flat rollouts, C(m,n) groups screened and sharpened, ioGRPO with
# the advantage-masked KL; no exemplars.
register_method(Method(
    "spogw", "SPOGW: flat rollout, C(m,n) groups with screening and sharpening, ioGRPO with masked KL; sampling",
    {"rollout.mode": "flat", "rollout.exemplars": "none", "training.objective": "iogrpo_mkl",
     "training.kl_mask": True}))
# The project's proposal (configs/two-level.yaml): N_A plans, N_W workflows under each, F/M/S contrastive exemplars,
# agent and workflow advantages over one batch mean and std, the two-term loss with unmasked KL; Sel@L at inference.
register_method(Method(
    "two_level", "two-level agent/workflow proposal: plans then workflows, F/M/S exemplars, agent + workflow "
    "advantages; Mean@L and Sel@L",
    {"rollout.mode": "two_level", "rollout.n_agents": 2, "rollout.n_workflows": 3, "rollout.exemplars": "buckets",
     "curation.adv_norm": "batch", "curation.agent_adv_stats": "workflows", "training.objective": "iogrpo_mkl",
     "training.two_level.agent_weight": 1.0, "training.two_level.workflow_weight": 1.0,
     "training.two_level.agent_kl_mask": False, "training.two_level.workflow_kl_mask": False}))
# W4S (arXiv 2504.04785, configs/refine.yaml): T turns of K candidates per task with self-repair, RLAO turn rewards,
# reward-weighted regression (exp(r / 0.4)); evaluated by sampling and by refine-on-validation-then-test.
register_method(Method(
    "w4s", "W4S: multi-turn refinement with self-repair, RLAO rewards, RWR; sampling, and refine on validation then "
    "the best refined workflow on test",
    {"rollout.mode": "refine", "rollout.exemplars": "none", "rollout.repair_attempts": 3, "rollout.repair_check": "run",
     "rollout.refine.turns": 3, "rollout.refine.candidates": 4, "rollout.refine.unit": "task",
     "rollout.refine.task_size": 8, "rollout.refine.failure_cases": 3, "rollout.refine.show_gold": True,
     "curation.rwr_temperature": 0.4, "training.objective": "rwr"},
    evaluations=(SAMPLE, REFINED)))
# ScoreFlow (arXiv 2502.04306): Score-DPO on pairs drawn by score gap^3, the base model as the reference (its code).
register_method(Method(
    "scoreflow", "ScoreFlow: Score-DPO on score-gap-weighted pairs of the same flat rollouts, reference = base; "
    "sampling",
    {"rollout.mode": "flat", "rollout.exemplars": "none", "training.objective": "score_dpo",
     "training.reference": "base"}))
# FlowReasoner (arXiv 2504.15257): GRPO on a multi-purpose reward for performance, complexity and efficiency (its
# abstract; its formula names pass rate, AST complexity and diversity). Weights: ours (0.1 each; the paper gives
# none), the reward penalises complexity, executor cost (in the task's `scoring.reward.token_budget`, so it bites at
# the task's budgets) and redundancy (pipeline.core.reward).
register_method(Method(
    "flowreasoner", "FlowReasoner: GRPO (KL on every token) on metric - 0.1 complexity - 0.1 cost - 0.1 "
    "(1 - diversity); sampling",
    {"rollout.mode": "flat", "rollout.exemplars": "none", "training.objective": "grpo",
     "scoring.reward.complexity_weight": 0.1, "scoring.reward.cost_weight": 0.1,
     "scoring.reward.diversity_weight": 0.1}))
# Training-free references on the base model.
register_method(Method(
    "smc", "BayesFlow's SMC sampler (M = 0, consistency reward) on the base model, N = L particles",
    trained=False, evaluations=(SMC,)))
register_method(Method(
    BEST_FIXED_ARM, "the best fixed program per task, chosen on the selection split (dev), L runs per query",
    trained=False, evaluations=(TASK_BEST_EVAL,), seeded=False))


# ---- names and overrides -------------------------------------------------------------------------------------------


def base_run_id(run_id: str, seed: int) -> str:
    return f"{run_id}-base-s{seed}"


def same_hash(a: RunConfig, b: RunConfig) -> bool:
    """Whether two configs compute the same (pipeline.config.RunConfig.config_hash)."""
    return a.config_hash() == b.config_hash()


def method_study_id(run_id: str, method: str) -> str:
    """The study whose seeds a method's training runs are: seed s of it is `<run>-<method>-s<s>` (`seed_run_id`)."""
    return f"{run_id}-{method}"


def method_run_id(run_id: str, method: str, seed: int) -> str:
    return seed_run_id(method_study_id(run_id, method), seed)


def sweep_run_id(run_id: str, method: str, lr: float, seed: int) -> str:
    return f"{run_id}-{method}-lr{lr:g}-s{seed}"


def seed_base(path: Path, cfg: RunConfig, sets: list[str], seed_plan: SeedPlan) -> tuple[RunConfig, bool, str]:
    """(the seed's config, whether it is `pipeline experiment`'s seed run, the run its base evaluation hangs off).
    The experiment's run of the seed is CONFIG's own method: its base evaluation and training are the comparison's
    too when scoring by the metric alone changes nothing (config hash), so neither command computes them twice."""
    seed_cfg = load_config(path, variant_sets(seed_plan.changes, before=sets))
    same_base = same_hash(seed_cfg, load_config(path, variant_sets(seed_plan.changes | METRIC_ONLY, before=sets)))
    base = seed_run_id(cfg.run_id, seed_plan.seed) if same_base else base_run_id(cfg.run_id, seed_plan.seed)
    return seed_cfg, same_base, base


def arm_run(path: Path, cfg: RunConfig, method: Method, sets: list[str], seed_plan: SeedPlan, lr: float | None,
            extra: list[str], seed_cfg: RunConfig, same_base: bool) -> tuple[list[str], RunConfig, str]:
    """(overrides, config, training run) of trained method `method` on seed `seed_plan`: the experiment's seed run
    where `method` is CONFIG's own method, else `method_run_id`."""
    own = method_sets(method, sets, seed_plan.changes, lr, extra)
    arm_cfg = load_config(path, own)
    same = same_base and same_hash(arm_cfg, seed_cfg)
    train_run = seed_run_id(cfg.run_id, seed_plan.seed) if same else method_run_id(cfg.run_id, method.name,
                                                                                    seed_plan.seed)
    return own, arm_cfg, train_run


def methods_dir(store: Store, run_id: str) -> Path:
    return store.root / "experiments" / f"{run_id}-methods"


def parse_arm_sets(items: list[str] | None) -> dict[str, list[str]]:
    """`METHOD:key=value` items (`--arm-set`) -> method -> its overrides, in order."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        name, sep, kv = item.partition(":")
        if not sep or "=" not in kv:
            raise ValueError(f"--arm-set {item!r}: expected METHOD:key.path=value")
        out.setdefault(get_method(name.strip()).name, []).append(kv.strip())
    return out


def method_changes(m: Method, seed: dict[str, Any], lr: float | None = None) -> dict[str, Any]:
    """A method run's variant of CONFIG: the seed's changes, the method's overlay, the swept lr."""
    return seed | m.changes | ({} if lr is None else {"training.lr": lr})


def method_sets(m: Method, sets: list[str], seed: dict[str, Any], lr: float | None = None,
                extra: list[str] | None = None) -> list[str]:
    """A method run's overrides: CONFIG's --set, `method_changes`, then its --arm-set."""
    return variant_sets(method_changes(m, seed, lr), before=sets, after=extra)


def two_level_shape(L: int) -> tuple[int, int]:
    """(N_A, N_W) with N_A x N_W = L, as square as L allows, N_A >= N_W. A prime L gives N_W = 1, where Sel@L (best
    agent, then its best workflow) is Best@L: use a composite experiment.eval_l (4) for two-level runs."""
    w = max(d for d in range(1, int(L ** 0.5) + 1) if L % d == 0)
    return L // w, w


def arm_eval_changes(cfg: RunConfig) -> dict[str, Any]:
    """Changes of a held-out evaluation of a run of `cfg`: the experiment's queries and L (two-level: N_A x N_W =
    L), scored by the metric alone."""
    out = eval_changes(cfg) | METRIC_ONLY
    if get_mode(cfg.rollout.mode).evaluated_as == "two_level":
        agents, workflows = two_level_shape(cfg.experiment.eval_l)
        out |= {"rollout.n_agents": agents, "rollout.n_workflows": workflows}
    return out


def run_wall_s(store: Store, run_id: str) -> float:
    """Wall seconds the run's stages took (timings.jsonl: the last attempt of each stage that did work)."""
    return round_s(float(stage_timings(store, run_id)["wall_s"].sum()))


def eval_wall_s(store: Store, run_id: str, evaluation: str) -> float | None:
    """Wall seconds of a held-out evaluation run, its sampling and scoring (`TIMED`); None where one of them has no
    timing (an SMC run sampled before its sampling was timed): a part of the cost is not a cost."""
    t = stage_timings(store, run_id)  # read once: the stages it has and their sum
    return round_s(float(t["wall_s"].sum())) if set(TIMED[evaluation]) <= set(t["stage"]) else None


# ---- W4S: refine on validation, then the best refined workflow on test --------------------------------------------


def refined_workflow(store: Store, run_id: str) -> dict:
    """The refine run's candidate with the best validation accuracy (ties: the earliest turn, then task and slot), of
    those that passed their self-check; with its code, and the start workflow's accuracy for reference."""
    turns = store.read("turns", run_id, 0)
    live = turns.filter(~pl.col("skipped")) if turns.height else turns
    if live.height == 0:
        raise ValueError(f"run {run_id!r}: no refined workflow passed its self-check; nothing to run on test")
    best = live.sort(["accuracy", "turn", "task_id", "slot"], descending=[True, False, False, False]).row(0, named=True)
    text = store.read("generations", run_id, 0).filter(pl.col("gen_id") == best["gen_id"])["text"][0]
    start = turns.filter(pl.col("turn") == 0)["previous"].to_list()
    return {"gen_id": best["gen_id"], "task_id": best["task_id"], "turn": best["turn"], "slot": best["slot"],
            "accuracy": best["accuracy"], "start_accuracy": start[0] if start else None,
            "candidates": live.height, "code": extract_code(text or "")}


def evaluate_refined(store: Store, arm_run: str, round: int, arm_cfg: RunConfig, split: str, call) -> dict:
    """W4S's evaluation of `arm_run`'s round `round` checkpoint (module doc); returns the test run's id, the
    validation run's and the chosen workflow."""
    if arm_cfg.rollout.mode != "refine":
        raise ConfigError(f"the refined evaluation needs rollout.mode refine, {arm_run} has {arm_cfg.rollout.mode}")
    val = selection_split(arm_cfg)
    if splits_overlap(val, split):
        raise ConfigError(f"the refined evaluation chooses on {val}, which shares queries with the held-out {split}")
    root = str(store.root)
    refine = {"rollout.refine.unit": "task", "rollout.refine.task_size": arm_cfg.benchmark.max_queries or 1_000_000}
    ctx = open_eval_run(root, arm_run, round, val, mode="refine", changes=refine)
    for stage in EVAL_STAGES:
        call(stage=stage, run_id=ctx.run_id, round=0, store_root=root, sets=variant_sets(refine))
    choice = refined_workflow(store, ctx.run_id)
    # the test run holds the chosen program L times per query, scored as a flat workflow (its run is flat)
    summ = run_fixed(frozen_config(store, arm_run), REFINED, call, arm_run, split,
                     variant_sets(METRIC_ONLY | {"rollout.mode": "flat"}), choice["code"])
    return {"eval_run_id": summ.eval_run_id, "validation_run_id": ctx.run_id, "validation_split": val,
            "selected": {k: v for k, v in choice.items() if k != "code"}}


# ---- the runs --------------------------------------------------------------------------------------------------------


def frozen_config(store: Store, run_id: str) -> Path:
    """A run's saved config: CONFIG with the study's --set (and the seed's) frozen in. Derived runs start from it, so
    their own held-out overrides (the experiment's queries and L) come after those --set, as in evaluation runs."""
    return store.run_dir(run_id) / "config.yaml"


def run_reference(method: Method, evaluation: str, store: Store, cfg: RunConfig, seed_plan: SeedPlan, extra: list[str],
                  call, base: str) -> dict:
    """A training-free reference's held-out run from the config of the seed's base run `base`; returns
    {eval_run_id[, selected]}."""
    split, config = cfg.experiment.eval_split, frozen_config(store, base)
    if evaluation == SMC:
        own = variant_sets({"smc.seed": seed_plan.seed, "smc.N": cfg.experiment.eval_l} | METRIC_ONLY | method.changes,
                           after=extra)
        return {"eval_run_id": run_smc(config, call, seed_run_id(cfg.run_id, seed_plan.seed), split, own).eval_run_id}
    s = run_baseline(config, TASK_BEST, call, cfg.run_id, split,
                     variant_sets(METRIC_ONLY | method.changes, after=extra))
    return {"eval_run_id": s.eval_run_id, "selected": s.selected}


def sweep_lr(path: Path, cfg: RunConfig, chosen: list[Method], sets: list[str], arm_sets: dict[str, list[str]],
             lrs: list[float], seed_plan: SeedPlan, call) -> dict[str, LrSweep]:
    """One round per (trained method, learning rate) on seed `seed_plan`, each evaluated on dev; per method the runs
    and the chosen lr (the best dev Mean@L, ties: the first listed)."""
    from pipeline.stages.rounds import run_rounds

    b = cfg.benchmark
    if b.dev_share == 0 or splits_overlap(b.train_split, "dev"):
        raise ConfigError("--lr-sweep chooses on the dev split: train on `train` with a dev split held out "
                          f"(benchmark.train_split=train, benchmark.dev_share > 0); got train_split {b.train_split}, "
                          f"dev_share {b.dev_share}")
    store, out = store_for(cfg.store), {}
    for method in [m for m in chosen if m.trained]:
        rows = []
        for learning_rate in lrs:
            rid = sweep_run_id(cfg.run_id, method.name, learning_rate, seed_plan.seed)
            own = variant_sets({"rounds": 1, "training.lr": learning_rate},
                               before=method_sets(method, sets, seed_plan.changes, None, arm_sets.get(method.name)))
            log.info("lr sweep: %s at lr %g (%s)", method.name, learning_rate, rid)
            run_rounds(path, 1, rid, call, sets=own, observer=TRACKERS)
            summ = evaluate_tracked(str(store.root), rid, 0, "dev", call=call,
                                    changes=arm_eval_changes(load_config(path, own)))
            rows.append(SweepRun(lr=learning_rate, run_id=rid, eval_run_id=summ.eval_run_id, queries=summ.queries,
                                 mean_at_l=summ.mean_at_l, best_at_l=summ.best_at_l,
                                 train_wall_s=run_wall_s(store, rid)))
        scored = [r for r in rows if r.mean_at_l is not None]
        best = max(scored, key=lambda r: r.mean_at_l) if scored else None  # max keeps the first of equal ones
        out[method.name] = LrSweep(split="dev", seed=seed_plan.seed, runs=rows,
                                   chosen=None if best is None else best.lr)
    return out


def run_methods(config: str | Path, call, methods: list[str] | None = None, seeds: int | None = None,
                run_id: str | None = None, sets: list[str] | None = None, arm_sets: dict[str, list[str]] | None = None,
                lr_sweep: list[float] | None = None, command: str | None = None,
                after_seed: Callable[[MethodsSummary, Path], None] | None = None) -> MethodsSummary:
    """The comparison (module doc) through `call` (a stage caller); returns the summary. `after_seed(summary,
    results folder)` runs after each seed's summary is written."""
    from pipeline.stages.rounds import run_rounds, study_config

    path, sets, cfg = study_config(config, sets, run_id)
    chosen = [get_method(n) for n in (methods or list(METHODS))]
    if len({m.name for m in chosen}) != len(chosen):
        raise ValueError(f"methods repeat: {[m.name for m in chosen]}")
    arm_sets = {get_method(k).name: list(v) for k, v in (arm_sets or {}).items()}
    stray = sorted(set(arm_sets) - {m.name for m in chosen})
    if stray:
        raise ValueError(f"--arm-set names methods not compared: {stray}")
    plans = plan(cfg, list(range(seeds)) if seeds is not None else None)
    for method in chosen:  # every arm's config validates before any work
        method_cfg = load_config(path, method_sets(method, sets, plans[0].changes, None, arm_sets.get(method.name)))
        if REFINED in method.evaluations and method_cfg.rollout.mode != "refine":
            raise ConfigError(f"method {method.name}: the refined evaluation needs rollout.mode refine")
        if REFINED in method.evaluations and splits_overlap(selection_split(method_cfg), cfg.experiment.eval_split):
            raise ConfigError(f"method {method.name}: the refined evaluation chooses on {selection_split(method_cfg)}, "
                              f"which shares queries with the held-out {cfg.experiment.eval_split}")
    store, split = store_for(cfg.store), cfg.experiment.eval_split
    root = str(store.root)
    # one executor server for every stage of every arm, seed and evaluation (pipeline.engines.servers)
    with sharing(cfg, methods_dir(store, cfg.run_id) / "server-logs"):
        started = time.perf_counter()
        sweep = sweep_lr(path, cfg, chosen, sets, arm_sets, list(lr_sweep), plans[0], call) if lr_sweep else {}
        lrs = {name: s.chosen for name, s in sweep.items()}
        records: list[ArmRun] = []
        on_disk = read_summary(store, cfg)  # read once: the arms it keeps and the seeds it holds
        earlier, earlier_sweep, earlier_lr = earlier_arms(store, cfg, chosen, on_disk)
        held = on_disk.seeds if on_disk is not None and same_comparison(on_disk, cfg) else []
        shared: dict[tuple[str, str], dict] = {}  # references' runs by (method, evaluation); unseeded: the one run
        walls: dict[int, float] = {}
        done: list[int] = []
        for seed_plan in plans:
            t_seed = time.perf_counter()
            seed_cfg, same_base, base = seed_base(path, cfg, sets, seed_plan)
            # frozen, never trained: the base model's evaluation run's parent
            open_run(path, base, 0, variant_sets(seed_plan.changes, before=sets))
            log.info("seed %d: evaluating the base model on %s", seed_plan.seed, split)
            b = evaluate_tracked(root, base, BASE, split, call=call, changes=arm_eval_changes(cfg))
            records.append(ArmRun(arm=BASE_ARM, method=BASE_ARM, evaluation=SAMPLE, seed=seed_plan.seed,
                                  train_run_id=None, eval_run_id=b.eval_run_id))
            for method in chosen:
                extra = arm_sets.get(method.name, [])
                if not method.trained:
                    for evaluation in method.evaluations:
                        if method.seeded or (method.name, evaluation) not in shared:
                            log.info("seed %d: reference %s", seed_plan.seed, method.name)
                            shared[(method.name, evaluation)] = run_reference(method, evaluation, store, cfg,
                                                                              seed_plan, extra, call, base)
                        records.append(ArmRun(arm=method.arm(evaluation), method=method.name, evaluation=evaluation,
                                              seed=seed_plan.seed, train_run_id=None,
                                              **shared[(method.name, evaluation)]))
                    continue
                own, arm_cfg, arm = arm_run(path, cfg, method, sets, seed_plan, lrs.get(method.name), extra, seed_cfg,
                                            same_base)
                log.info("seed %d: training %s (%s, %d rounds)", seed_plan.seed, method.name, arm, cfg.rounds)
                # the arm's adapters kept as the experiment keeps its seeds' (`keep_adapter` names seed s's run
                # `seed_run_id(cfg.run_id, s)`): each round's while it runs, so a fresh clone resumes it, and the last
                # round's after its evaluations; the experiment's own seed run keeps its adapters itself
                kept = None if arm == seed_run_id(cfg.run_id, seed_plan.seed) else \
                    arm_cfg.model_copy(update={"run_id": method_study_id(cfg.run_id, method.name)})
                run_rounds(path, cfg.rounds, arm, call, keeping(store, kept, seed_plan.seed) if kept else None,
                           sets=own, observer=TRACKERS)
                last = cfg.rounds - 1
                for evaluation in method.evaluations:
                    log.info("seed %d: evaluating %s (%s) on %s", seed_plan.seed, method.name, evaluation, split)
                    if evaluation == SAMPLE:
                        got = {"eval_run_id": evaluate_tracked(root, arm, last, split, call=call,
                                                               changes=arm_eval_changes(arm_cfg)).eval_run_id}
                    else:
                        got = evaluate_refined(store, arm, last, arm_cfg, split, call)
                    records.append(ArmRun(arm=method.arm(evaluation), method=method.name, evaluation=evaluation,
                                          seed=seed_plan.seed, train_run_id=arm, **got))
                if kept is not None:
                    keep_adapter(store, kept, seed_plan.seed)  # the last round's, with the command that evaluates it
                    drop_resume_copies(store, kept, seed_plan.seed)
            walls[seed_plan.seed] = round_s(time.perf_counter() - t_seed)
            done.append(seed_plan.seed)
            # the registry's order: a run of fewer methods writes the tables in the order of a run of them all
            names = [n for n in METHODS if n in {m.name for m in chosen} | {r.method for r in earlier}]
            ahead = sorted(set(held) - set(done))
            if ahead and seed_plan is not plans[-1]:
                # a resumed run passes its finished seeds first: their summary must not replace a fuller one
                log.info("after seed %d: the summary on disk holds seeds %s this run has not reached; it is kept "
                         "until this run's last seed", seed_plan.seed, ahead)
                continue
            if ahead:
                log.warning("this run's summary of seeds %s replaces one that also held seeds %s", done, ahead)
            summary = summarise(store, cfg, names, with_earlier(records, earlier, done, names), done)
            summary.lr_sweep, summary.lr = earlier_sweep | sweep, earlier_lr | lrs
            out = write_results(store, summary, {"command": command, "config": str(path), "sets": sets,
                                                 "arm_sets": arm_sets, "seed_wall_s": walls,
                                                 "wall_s": round_s(time.perf_counter() - started)})
            log.info("after seed %d:\n%s", seed_plan.seed, summary.table())
            if after_seed is not None:
                after_seed(summary, out)
        summary.results = str(out)
        summary.wall_s = round_s(time.perf_counter() - started)
        return summary


def earlier_arms(store: Store, cfg: RunConfig, chosen: list[Method],
                 old: MethodsSummary | None) -> tuple[list[ArmRun], dict[str, LrSweep], dict[str, float | None]]:
    """The arms of the comparison's summary on disk (`old`, `read_summary`) whose methods this run leaves out
    (`--methods` naming fewer than an earlier run of the same comparison), with their learning-rate sweeps and rates,
    so that this run's summary keeps them rather than replacing the fuller table with a smaller one. Their numbers are
    computed again from their runs in the store; an arm whose evaluation run is gone is dropped with a warning.
    Nothing (empty) where the summary on disk was written for another split, L, query count or number of rounds: it
    is replaced (with a warning)."""
    none: tuple[list[ArmRun], dict, dict] = ([], {}, {})
    if old is None:
        return none
    names = {m.name for m in chosen}
    left = [r for r in old.per_seed if r.method not in names and r.arm != BASE_ARM]
    if not left:
        return none
    if not same_comparison(old, cfg):
        log.warning("the summary in %s was written for another comparison (split %s, L %s, %s queries, %s rounds): "
                    "this run replaces it, and its arms %s are left out", methods_dir(store, cfg.run_id), old.split,
                    old.eval_l, old.eval_queries, old.rounds, sorted({r.arm for r in left}))
        return none
    kept, gone = [], []
    for r in left:
        (kept if store.manifest(r.eval_run_id, 0, "score") else gone).append(ArmRun(**{
            n: getattr(r, n) for n in ArmRun.names()}))
    if gone:
        log.warning("earlier arms whose evaluation runs are no longer in the store are left out: %s",
                    sorted({(r.arm, r.seed) for r in gone}))
    if kept:
        log.info("the summary keeps the arms of an earlier run of this comparison: %s",
                 list(dict.fromkeys(r.arm for r in kept)))
    return (kept, {k: v for k, v in old.lr_sweep.items() if k not in names},
            {k: v for k, v in old.lr.items() if k not in names})


def same_comparison(old: MethodsSummary, cfg: RunConfig) -> bool:
    """Whether a summary on disk was written for the comparison `cfg` runs: the same split, L, query count and
    number of rounds (other arms or seeds may differ)."""
    ex = cfg.experiment
    return (old.split, old.eval_l, old.eval_queries, old.rounds) == (ex.eval_split, ex.eval_l, ex.eval_queries,
                                                                     cfg.rounds)


def read_summary(store: Store, cfg: RunConfig) -> MethodsSummary | None:
    """The comparison's methods.json as written last, or None before its first seed."""
    text = store.read_text(methods_dir(store, cfg.run_id) / "methods.json")
    return None if text is None else MethodsSummary.from_dict(json.loads(text))


def with_earlier(records: list[ArmRun], earlier: list[ArmRun], seeds: list[int], methods: list[str]) -> list[ArmRun]:
    """This run's records and the earlier arms' records of `seeds`, seed by seed in the order of `methods` (the base
    model first), so the tables read as one run's would."""
    order = {m: i for i, m in enumerate(methods)}
    merged = records + [r for r in earlier if r.seed in seeds]
    return sorted(merged, key=lambda r: (r.seed, -1 if r.arm == BASE_ARM else order[r.method]))


def status(config: str | Path, methods: list[str] | None = None, seeds: int | None = None, run_id: str | None = None,
           sets: list[str] | None = None, arm_sets: dict[str, list[str]] | None = None,
           lr_sweep: list[float] | None = None) -> list[dict]:
    """Where the comparison stands, read from the store (nothing runs): per stage of every run its plan makes (the
    rows of `pipeline.studies.experiment.status`). Parts name the kind of work (`train`, `evaluate`, `reference`,
    `lr sweep`), so `time_left` estimates an arm's training from any arm's done training. Without --lr-sweep's
    choice in the store yet, the arms are listed at CONFIG's learning rate (the same run ids). task_best is its
    selection run (every candidate program on the selection split) and its held-out run."""
    from pipeline.stages import ROUND_STAGES
    from pipeline.stages.rounds import study_config
    from pipeline.studies.baselines import baseline_run_id
    from pipeline.studies.evaluate import eval_run_id
    from pipeline.studies.smc import smc_run_id

    path, sets, cfg = study_config(config, sets, run_id)
    chosen = [get_method(n) for n in (methods or list(METHODS))]
    arm_sets = {get_method(k).name: list(v) for k, v in (arm_sets or {}).items()}
    plans = plan(cfg, list(range(seeds)) if seeds is not None else None)
    store, split, last = store_for(cfg.store), cfg.experiment.eval_split, cfg.rounds - 1
    held_out = planned_workflows(cfg, "evaluate")  # the sweep's dev evaluations hold as many
    runs: list[PlannedRun] = []
    if lr_sweep:
        first_cfg, first_same, _ = seed_base(path, cfg, sets, plans[0])
    for method in [m for m in chosen if m.trained] if lr_sweep else []:
        for lr in lr_sweep:
            rid = sweep_run_id(cfg.run_id, method.name, lr, plans[0].seed)
            _, arm_cfg, _ = arm_run(path, cfg, method, sets, plans[0], lr, arm_sets.get(method.name, []), first_cfg,
                                    first_same)
            runs += [("lr sweep", rid, 1, ROUND_STAGES, planned_workflows(arm_cfg, "train")),
                     ("lr sweep", eval_run_id(rid, 0, "dev"), 1, EVAL_STAGES, held_out)]
    shared: set[str] = set()
    for seed_plan in plans:
        seed_cfg, same_base, base = seed_base(path, cfg, sets, seed_plan)
        runs.append(("evaluate", eval_run_id(base, BASE, split), 1, EVAL_STAGES, held_out))
        for method in chosen:
            if not method.trained:  # SMC's particles and look-aheads, task_best's candidates: counts not known ahead
                if SMC in method.evaluations:
                    refs = [(smc_run_id(seed_run_id(cfg.run_id, seed_plan.seed), split), None)]
                else:  # the selection of each task's program on the selection split, then the winner held out
                    refs = [(baseline_run_id(cfg.run_id, SELECT, selection_split(cfg)), None),
                            (baseline_run_id(cfg.run_id, TASK_BEST, split), held_out)]
                for rid, workflows in refs:
                    if rid not in shared:
                        shared.add(rid)
                        runs.append(("reference", rid, 1, EVAL_STAGES, workflows))
                continue
            _, arm_cfg, arm = arm_run(path, cfg, method, sets, seed_plan, None, arm_sets.get(method.name, []), seed_cfg,
                                      same_base)
            runs.append(("train", arm, cfg.rounds, ROUND_STAGES, planned_workflows(arm_cfg, "train")))
            for ev in method.evaluations:
                if ev == SAMPLE:
                    runs.append(("evaluate", eval_run_id(arm, last, split), 1, EVAL_STAGES, held_out))
                else:  # W4S: the refinement on the validation part, then the chosen workflow held out
                    runs += [("evaluate", eval_run_id(arm, last, selection_split(arm_cfg), mode="refine"), 1,
                              EVAL_STAGES, None), ("evaluate", baseline_run_id(arm, REFINED, split), 1, EVAL_STAGES,
                                                   held_out)]
    return stage_rows(store, list(dict.fromkeys(runs)))  # an arm that is the experiment's run once


# ---- the summary -----------------------------------------------------------------------------------------------------


def _tokens(row: dict, side: str) -> float | None:
    a, b = row.get(f"{side}_tokens_in"), row.get(f"{side}_tokens_out")
    return None if a is None or b is None else float(a + b)


def _mean_of(rows: list[dict], key: str) -> float | None:
    """The mean of `key` over the per-query rows that have it."""
    return mean_or_none([q[key] for q in rows if q[key] is not None])


def _metrics(rows: list[dict]) -> dict:
    """Means over rows of each metric (None where no row has it: Sel@L of an arm that does not select, which its
    record leaves out)."""
    return {m: mean_or_none([r[m] for r in rows if r.get(m) is not None]) for m in ALL_METRICS}


def design_counts(store: Store, run_id: str, keep: set[str] | None = None) -> dict[str, int] | None:
    """The evaluation run's workflows per written design, on the queries of `keep` (None: all): the rollout's
    `generations.design`, the nearest design of the task's menu by code similarity (`other`: none near enough).
    None for a run without designs: no menu, or fixed programs (task_best, W4S's refined workflow)."""
    df = store.sql("SELECT query_id, design FROM generations WHERE run_id = $run AND round = 0 AND kind = 'workflow' "
                   "AND design IS NOT NULL", {"run": run_id}, run=run_id)
    designs = [d for q, d in df.iter_rows() if keep is None or q in keep]
    return dict(sorted(Counter(designs).items())) or None


def pooled_designs(rows: list[MethodSeedRow]) -> dict[str, int] | None:
    """An arm's design counts over its seeds (None: no seed's run has designs)."""
    total = sum((Counter(r.designs) for r in rows if r.designs), Counter())
    return dict(sorted(total.items())) or None


def summarise(store: Store, cfg: RunConfig, methods: list[str], records: list[ArmRun],
              seeds: list[int]) -> MethodsSummary:
    """Per (arm, seed, query) numbers from the evaluation runs of `records`; per arm their means, tokens and training
    wall time; per arm, other arm (base, spogw) and metric the pooled paired difference with its intervals."""
    summaries: dict[str, EvalSummary] = {}
    for rec in records:
        if rec.eval_run_id not in summaries:
            summaries[rec.eval_run_id] = eval_summary(store, rec.eval_run_id)
    keep = shared_queries(records, summaries)
    per_query, per_seed = [], []
    for rec in records:
        rows, row = seed_rows(store, rec, summaries[rec.eval_run_id], keep)
        per_query += rows
        per_seed.append(row)
    arms = [arm_means(arm, [q for q in per_query if q["arm"] == arm], [p for p in per_seed if p.arm == arm])
            for arm in dict.fromkeys(r.arm for r in records)]
    ex = cfg.experiment
    return MethodsSummary(experiment=cfg.run_id, methods=methods, seeds=seeds, rounds=cfg.rounds,
                          split=ex.eval_split, eval_queries=ex.eval_queries, eval_l=ex.eval_l, arms=arms,
                          paired=paired_arms(arms, per_query, seeds, ex), per_seed=per_seed, per_query=per_query,
                          not_run=[n for n in METHODS if n not in methods])


def shared_queries(records: list[ArmRun], summaries: dict[str, EvalSummary]) -> set[str]:
    """The held-out queries every arm's evaluations hold. An arm can hold more: the SPOGW arm and the base model
    share their runs with `pipeline experiment`, which may have evaluated more queries (the first N of the split;
    the comparison's `experiment.eval_queries` is a prefix of them), and every arm is compared on the same ones."""
    per_arm: dict[str, set[str]] = {}
    for rec in records:
        per_arm.setdefault(rec.arm, set()).update(q["query_id"] for q in summaries[rec.eval_run_id].per_query)
    held = [qs for qs in per_arm.values() if qs]  # an arm with no rows at all does not empty every other arm
    shared = set.intersection(*held) if held else set()
    if more := {a: len(qs) - len(shared) for a, qs in per_arm.items() if qs and len(qs) > len(shared)}:
        log.info("every arm is compared on the %d queries all hold; left out of the arms that hold more: %s",
                 len(shared), more)
    return shared


def seed_rows(store: Store, rec: ArmRun, summ: EvalSummary,
              keep: set[str] | None = None) -> tuple[list[dict], MethodSeedRow]:
    """One arm's evaluation for one seed: its per-query rows (metrics, valid share, tokens) and its row, on the
    queries of `keep` (None: all); where that leaves some out, the row's shares and tokens are the rows' means."""
    rows = [{"arm": rec.arm, "seed": rec.seed, "query_id": q["query_id"], **{m: q.get(m) for m in ALL_METRICS},
             "valid_share": q.get("valid_share"), "gen_tokens": _tokens(q, "gen"), "exec_tokens": _tokens(q, "exec")}
            for q in summ.per_query if keep is None or q["query_id"] in keep]
    whole = len(rows) == len(summ.per_query)
    row = MethodSeedRow(**rec.field_values(), queries=summ.queries if whole else len(rows), **_metrics(rows),
                        valid_share=summ.valid_share if whole else _mean_of(rows, "valid_share"),
                        gen_tokens_per_query=summ.gen_tokens_per_query if whole else _mean_of(rows, "gen_tokens"),
                        exec_tokens_per_query=summ.exec_tokens_per_query if whole else _mean_of(rows, "exec_tokens"),
                        train_wall_s=run_wall_s(store, rec.train_run_id) if rec.train_run_id else None,
                        eval_wall_s=eval_wall_s(store, rec.eval_run_id, rec.evaluation),
                        designs=design_counts(store, rec.eval_run_id, keep),
                        select_wall_s=run_wall_s(store, rec.validation_run_id) if rec.validation_run_id else None)
    return rows, row


def arm_means(arm: str, rows: list[dict], mine: list[MethodSeedRow]) -> MethodArm:
    """An arm over its seeds: means of its per-query rows `rows`, mean wall seconds of its seeds' rows `mine`."""
    return MethodArm(arm=arm, method=mine[0].method, evaluation=mine[0].evaluation, seeds=[p.seed for p in mine],
                     n=len(rows), **_metrics(rows), valid_share=_mean_of(rows, "valid_share"),
                     gen_tokens_per_query=_mean_of(rows, "gen_tokens"),
                     exec_tokens_per_query=_mean_of(rows, "exec_tokens"),
                     train_wall_s=mean_or_none([p.train_wall_s for p in mine if p.train_wall_s is not None]),
                     eval_wall_s=mean_or_none([p.eval_wall_s for p in mine if p.eval_wall_s is not None]),
                     designs=pooled_designs(mine),
                     select_wall_s=mean_or_none([p.select_wall_s for p in mine if p.select_wall_s is not None]))


def paired_arms(arms: list[MethodArm], per_query: list[dict], seeds: list[int], experiment) -> list[ArmDiff]:
    """Per arm, other arm (base, spogw, task_best: the best fixed workflow chosen on dev) and metric the arm has: the
    pooled paired difference per (seed, query); Sel@L against the other arm's Mean@L where it has no Sel@L."""
    has = {a.arm: {m for m in ALL_METRICS if getattr(a, m) is not None} for a in arms}
    paired = []
    for row in arms:
        for against in (BASE_ARM, REFERENCE_ARM, BEST_FIXED_ARM):
            if against == row.arm or against not in has or row.arm == BASE_ARM:
                continue
            for metric in [m for m in ALL_METRICS if m in has[row.arm]]:
                theirs = metric if metric in has[against] else "mean_at_l" if metric == "select_at_l" else None
                if theirs is None:
                    continue
                pairs = []
                for s in seeds:
                    mine = {q["query_id"]: q[metric] for q in per_query
                            if q["arm"] == row.arm and q["seed"] == s and q[metric] is not None}
                    other = {q["query_id"]: q[theirs] for q in per_query
                             if q["arm"] == against and q["seed"] == s and q[theirs] is not None}
                    pairs += [(s, q, d) for q, d in paired_differences(mine, other).items()]
                if pairs:
                    paired.append(ArmDiff(arm=row.arm, against=against, metric=metric, against_metric=theirs,
                                          **paired_interval(pairs, seeds, experiment)))
    return paired


def write_results(store: Store, summary: MethodsSummary, extra: dict) -> Path:
    """methods.json (the summary, then the run's facts in `extra`) and methods.md (its tables)."""
    dest = methods_dir(store, summary.experiment)
    return write_study(store, dest, "methods", summary.to_dict() | extra, summary.table())
