"""The pipeline from Python (a notebook, a script): open a store, read its tables as polars frames, a run's config,
a round's policy as a peft model, run a stage, all rounds, an evaluation, a baseline or a study, and write a run's
report. The `pipeline` command calls these same functions, so what a notebook does and what the command does cannot
drift apart. Every function that runs work returns a typed record (pipeline.core.records: fields, and `to_dict` for
the JSON a study stores). docs/api.md lists them, with a worked example.

Each function is a thin layer over the internals its docstring names; heavy libraries load inside them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import ConfigError, StoreConfig
from pipeline.core.records import Record
from pipeline.run import run_config
from pipeline.store import Store
from pipeline.store.schema import TABLES
from pipeline.store.views import VIEWS

if TYPE_CHECKING:
    import polars as pl

    from pipeline.config import RunConfig
    from pipeline.engines.benchmarks.base import Benchmark
    from pipeline.stages.rounds import RoundsSummary
    from pipeline.stages.runner import StageResult
    from pipeline.stages.sampling import PromptSharing
    from pipeline.studies.arms import ArmChoice
    from pipeline.studies.baselines import Comparison
    from pipeline.studies.summaries import (
        AblationSummary,
        EvalSummary,
        ExperimentSummary,
        HeadroomSummary,
        MethodsSummary,
    )

DEFAULT_STORE = StoreConfig.model_fields["root"].default  # where runs live when neither a flag nor a config says


def open_store(root: str | Path | None = None) -> Store:
    """The store at `root` (a directory or s3://bucket/prefix; default data/runs)."""
    return Store(root or DEFAULT_STORE)


def import_rollouts(path: str | Path, run_id: str, store: str | Path | None = None, round: int = 0) -> int:
    """Rollouts logged elsewhere (JSONL, a JSON array or Parquet; pipeline.stages.logged.IMPORT_FIELDS) into the store
    as run `run_id`, for a config's `rollout.logged`; every bad row is reported in one ValueError and nothing is
    written."""
    from pipeline.stages.logged import import_file

    return import_file(open_store(store), run_id, str(path), round)


def table(store: Store, name: str, run_id: str | None = None, round: int | None = None) -> pl.DataFrame:
    """A table (`generations`, `scores`, `groups`, ...) or view (`latest_scores`, `generation_scores`,
    `query_usage`) as a polars frame, through the store's DuckDB views; `run_id` / `round` keep those rows."""
    if name not in TABLES and name not in VIEWS:
        raise KeyError(f"unknown table {name!r}; tables and views: {', '.join([*TABLES, *VIEWS])}")
    where = {"run_id": run_id, "round": round}
    where = {k: v for k, v in where.items() if v is not None}
    sql = f"SELECT * FROM {name}" + (" WHERE " + " AND ".join(f"{k} = ${k}" for k in where) if where else "")
    return store.sql(sql, where or None)


def round_policy(store: Store, run_id: str, round: int, device: str = "cpu") -> tuple[Any, Any]:
    """(tokenizer, model) of the generator after round `round`'s training: the run's base model with that round's
    LoRA adapter as a `peft.PeftModel` in eval mode (round -1: the base model alone, as the run started)."""
    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm, load_tokenizer

    gen = run_config(store, run_id).generator
    base = load_causal_lm(gen.model, device=device)
    if round < 0:
        return load_tokenizer(gen.model), base
    if not store.checkpoint_complete(run_id, round):
        raise ConfigError(f"run {run_id!r} has no complete checkpoint for round {round} "
                          f"({store.checkpoint_dir(run_id, round)}); train that round first")
    return load_tokenizer(gen.model), PeftModel.from_pretrained(base, str(store.checkpoint_dir(run_id, round))).eval()


def run_stage(stage: str, config: str | Path | None = None, run_id: str | None = None, round: int = 0,
              sets: Sequence[str] = (), store: str | None = None, only_failed: bool = False, shards: int = 1,
              wait: bool = False) -> StageResult:
    """One stage (rollout, score, curate, train) of a round in this process, as `pipeline <stage>` runs it: a
    finished stage is skipped, an unfinished attempt's leftovers are discarded, no retries (a re-run resumes);
    shards run one after another. `config` may be None for a run that exists (its frozen config is used)."""
    from pipeline.run import open_run
    from pipeline.stages.rounds import call_stage, direct_call
    from pipeline.stages.runner import RetryPolicy

    ctx = open_run(config, run_id, round, list(sets), store)
    return call_stage(direct_call(RetryPolicy(retries=0), isolate=False, wait=wait), stage, ctx.run_id, round,
                      str(ctx.store.root), list(sets), only_failed, shards, wait)


def run(config: str | Path, rounds: int | None = None, run_id: str | None = None, retries: int = 2,
        sets: Sequence[str] = (), shards: int = 1, wait: bool = False) -> RoundsSummary:
    """All rounds of a run in this process, as `pipeline run` (pipeline.stages.rounds.run_rounds): finished stages
    skipped, a transient failure retried `retries` times, the run's trackers told of each round; returns a
    `RoundsSummary` (per round: mean and best score, each stage's wall seconds)."""
    from pipeline.stages.rounds import direct_call, run_rounds
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.tracking import TRACKERS

    return run_rounds(config, rounds, run_id, direct_call(RetryPolicy(retries), wait=wait), sets=list(sets),
                      shards=shards, observer=TRACKERS, wait=wait)


def evaluate(run_id: str, round: int, split: str = "test", store: str | None = None,
             sets: Sequence[str] = ()) -> EvalSummary:
    """Roll out and score round `round`'s checkpoint (-1: the base model) on `split` in the derived run
    `<run_id>-eval-r<k>`, then update the run's trackers (pipeline.studies.tracking.evaluate_tracked)."""
    from pipeline.studies.tracking import evaluate_tracked

    return evaluate_tracked(str(store or DEFAULT_STORE), run_id, round, split, list(sets))


def evaluate_adapter(folder: str | Path, split: str = "test", store: str | None = None,
                     sets: Sequence[str] = ()) -> EvalSummary:
    """Roll out and score a kept adapter folder (`<store>/adapters/<run>-r<k>/`, pipeline.studies.experiment.
    keep_adapter) on `split` of its run's benchmark, as its experiment evaluated it, in the derived run
    `<folder name>-eval[-<split>][-<hash of sets>]`; new problems: the override of its README
    (pipeline.studies.evaluate.new_problems, open_adapter_eval_run)."""
    from pipeline.studies.evaluate import evaluate_adapter as run_adapter

    return run_adapter(str(store or DEFAULT_STORE), folder, split, list(sets))


def run_study(study: str, config: str | Path, retries: int = 2,
              **options: Any) -> ExperimentSummary | AblationSummary | MethodsSummary:
    """A study through the Prefect-free stage caller with `retries` retries of a transient failure: `experiment`
    (pipeline.studies.experiment.run_experiment), `ablation` (ablation.run_ablation) or `methods`
    (methods.run_methods); `options` are that function's keyword arguments. Returns its summary (the typed record
    of pipeline.studies.summaries)."""
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.ablation import run_ablation
    from pipeline.studies.experiment import run_experiment
    from pipeline.studies.methods import run_methods

    studies = {"experiment": run_experiment, "ablation": run_ablation, "methods": run_methods}
    if study not in studies:
        raise ValueError(f"unknown study {study!r}; studies: {', '.join(studies)}")
    return studies[study](config, direct_call(RetryPolicy(retries)), **options)


def study_status(study: str, config: str | Path, run_id: str | None = None, sets: Sequence[str] = (),
                 **options: Any) -> list[dict]:
    """Where a study stands, read from the store (nothing runs), as a study's `--status`: one row per stage of every
    run its plan makes (part, run_id, round, stage, done, wall_s, workflows, machine). `study`: `experiment`
    (option `seeds`), `headroom` (`split`, `reps`) or `methods` (`methods`, `seeds`, `arm_sets`, `lr_sweep`)."""
    from pipeline.stages.rounds import study_config
    from pipeline.store import store_for
    from pipeline.studies import experiment, headroom, methods

    if study == "experiment":
        cfg = study_config(config, list(sets), run_id)[2]
        seeds = options.get("seeds")
        order = [p.seed for p in experiment.plan(cfg, None if seeds is None else list(range(seeds)))]
        return experiment.status(store_for(cfg.store), cfg, order)
    if study == "headroom":
        return headroom.status(config, run_id, options.get("split", "dev"), options.get("reps"), list(sets))
    if study == "methods":
        return methods.status(config, options.get("methods"), options.get("seeds"), run_id, list(sets),
                              options.get("arm_sets") or {}, options.get("lr_sweep"))
    raise ValueError(f"unknown study {study!r}; studies with a status: experiment, headroom, methods")


def experiment_summary(config: str | Path, run_id: str | None = None, sets: Sequence[str] = (),
                       rewrite: bool = False) -> ExperimentSummary | None:
    """An experiment's summary: as last written (None before any), or with `rewrite` recomputed from the runs in the
    store and written again, nothing run (pipeline.studies.experiment.summarise_stored)."""
    from pipeline.stages.rounds import study_config
    from pipeline.store import store_for
    from pipeline.studies.experiment import read_summary, summarise_stored

    if rewrite:
        return summarise_stored(config, list(sets), run_id)
    cfg = study_config(config, list(sets), run_id)[2]
    return read_summary(store_for(cfg.store), cfg.run_id)


def prompt_sharing(cfg: RunConfig, bench: Benchmark, queries: int = 4) -> PromptSharing | None:
    """How much of the first `queries` training prompts a training pass computes once (their common token prefix
    against their mean length, rendered as round 0's rollout renders them with the generator's tokenizer;
    `pipeline.stages.sampling.prompt_sharing`); None for an embedded generator not prepared yet (converting it takes
    minutes: `pipeline prepare-model`)."""
    from pipeline.engines.models import embedded_ready, load_tokenizer
    from pipeline.stages.sampling import prompt_sharing as sharing

    if not embedded_ready(cfg.generator.model):
        return None
    return sharing(cfg, bench.items(), bench.family, load_tokenizer(cfg.generator.model), queries)


def headroom(config: str | Path, split: str = "dev", reps: int | None = None, run_id: str | None = None,
             sets: Sequence[str] = (), retries: int = 2) -> HeadroomSummary:
    """The headroom study (pipeline.studies.headroom.run_headroom): every design of the menu as a fixed program on
    `split`, `reps` runs per query, the best single design against the cross-fitted per-query oracle at its budget;
    writes <store>/headroom/<run_id>/ and returns its `HeadroomSummary` (`passes`: the gate)."""
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.headroom import run_headroom

    return run_headroom(config, direct_call(RetryPolicy(retries)), run_id, split, reps, list(sets))


def baseline(config: str | Path, method: str, run_id: str | None = None, split: str = "test",
             sets: Sequence[str] = (), candidates: Sequence[str] = (), max_candidates: int = 16,
             retries: int = 2) -> EvalSummary:
    """One baseline (a fixed program: io, cot, cot_sc, self_review, ensemble_select, pot, task_best, or
    `program:FILE`) on `split` in the derived run <run_id>-baseline-<method> (pipeline.studies.baselines); its
    `EvalSummary` (task_best: `selected` per task and `selection_run`)."""
    return baselines(config, [method], run_id, split, sets, candidates, max_candidates, retries)[0]


def baselines(config: str | Path, methods: Sequence[str], run_id: str | None = None, split: str = "test",
              sets: Sequence[str] = (), candidates: Sequence[str] = (), max_candidates: int = 16, retries: int = 2,
              on_result: Callable[[EvalSummary], None] | None = None) -> list[EvalSummary]:
    """`baseline` of each method in turn with one executor server for all (a served executor starts once);
    `on_result` hears of each summary as its baseline finishes (`pipeline baseline` prints it)."""
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.baselines import run_baseline, sharing_executor

    call, out = direct_call(RetryPolicy(retries)), []
    with sharing_executor(str(config), run_id, list(sets)):
        for method in methods:
            out.append(run_baseline(str(config), method, call, run_id, split, list(sets), list(candidates),
                                    max_candidates))
            if on_result is not None:
                on_result(out[-1])
    return out


def smc(config: str | Path, run_id: str | None = None, split: str = "test", sets: Sequence[str] = (),
        retries: int = 2) -> EvalSummary:
    """BayesFlow's SMC workflow sampler on `split` in the derived run <run_id>-smc (pipeline.studies.smc.run_smc);
    its `EvalSummary`, with `workflow_runs_per_query` (look-ahead and scoring runs: the L at which plain sampling
    spends about the same executor budget)."""
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.smc import run_smc

    return run_smc(str(config), direct_call(RetryPolicy(retries)), run_id, split, list(sets))


def sample(config: str | Path, L: int, run_id: str | None = None, split: str = "test", sets: Sequence[str] = (),
           retries: int = 2) -> EvalSummary:
    """Plain sampling: L workflows per query of `split` from the configured generator, scored, in the derived run
    <run_id>-plain-l<L> (pipeline.studies.smc.run_plain); its `EvalSummary`."""
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.smc import run_plain

    return run_plain(str(config), L, direct_call(RetryPolicy(retries)), run_id, split, list(sets))


def compare(run_ids: Sequence[str], store: str | Path | None = None) -> Comparison:
    """Runs whose round 0 holds workflows side by side (pipeline.studies.baselines.compare): a `Comparison`, a row
    per run (Mean@L, Best@L, Majority@L, tokens per query) and whether they hold the same queries; `markdown()`."""
    from pipeline.studies.baselines import compare as compare_runs

    return compare_runs(open_store(store), list(run_ids))


def choose_arm(experiments: Sequence[str], store: str | Path | None = None, seed: int = 0) -> ArmChoice:
    """The arm a verdict reads among experiments on one task, chosen on dev by a fixed rule
    (pipeline.studies.arms.choose_arm), read from their summaries and written beside them
    (<store>/experiments/arms/<a>+<b>....json); a ValueError names an experiment without a summary."""
    from pipeline.studies.arms import choose_arm as choose
    from pipeline.studies.experiment import experiment_dir, read_summary

    opened = open_store(store)
    summaries = []
    for name in experiments:
        if (summary := read_summary(opened, name)) is None:
            raise ValueError(f"no summary of experiment {name!r} under {opened.root}/experiments: run `pipeline "
                             "experiment CONFIG --report` for it first")
        summaries.append(summary)
    choice = choose(summaries, seed)
    folder, name = experiment_dir(opened, "arms"), "+".join(experiments) + ".json"
    with opened.output_dir(folder) as out:
        (out / name).write_text(json.dumps(choice.to_dict(), indent=1) + "\n")
    choice.written = str(folder / name)
    return choice


@dataclass(kw_only=True)
class Report(Record):
    """What `report` wrote: the HTML report, the per-query pages, and the lines `pipeline report` prints (per round
    of a run; every evaluation and the headline of an experiment)."""

    run_id: str
    kind: str  # "run" or "experiment"
    report: str
    pages: str | None = None  # the per-query pages' index; None: none (`pages_missing` says why)
    pages_missing: str | None = None
    lines: list[str] = field(default_factory=list)


def report(run_id: str, store: str | Path | None = None, out: str | Path | None = None, round: int | None = None,
           query: str | None = None, pages: bool = True) -> Report:
    """A run's HTML report (per-round plots, summary table) and per-query pages, or an experiment's (its run id
    names <store>/experiments/<run_id>/); `round` / `query`: the per-query pages of that round / query only, an
    error (FileNotFoundError) when they do not exist; `pages=False`: a run's report alone."""
    from pipeline.studies.browse import build_experiment_pages, build_run_pages
    from pipeline.studies.experiment import experiment_dir
    from pipeline.studies.formatting import num
    from pipeline.studies.report import build_report, round_stats, stage_timings
    from pipeline.studies.summaries import ExperimentSummary

    opened = open_store(store)
    exp = experiment_dir(opened, run_id) / "experiment.json"
    if not (opened.run_dir(run_id) / "config.yaml").is_file() and exp.is_file():
        summary = ExperimentSummary.read(exp)
        result = Report(run_id=run_id, kind="experiment", report=str(exp.parent / "report.html"),
                        lines=[a.line() for a in summary.arms] + summary.headline())
        try:
            result.pages = str(build_experiment_pages(opened, exp.parent, query))
        except FileNotFoundError as e:
            if query is not None:  # the page asked for does not exist
                raise
            result.pages_missing = str(e)  # the report itself is there
        return result
    result = Report(run_id=run_id, kind="run", report=str(build_report(opened, run_id, Path(out) if out else None)))
    if not pages:
        return result
    try:
        result.pages = str(build_run_pages(opened, run_id, round, query))
    except FileNotFoundError as e:
        if round is not None or query is not None:  # asked for: an error; else the run has no scores yet
            raise
        result.pages_missing = str(e)
    timings = stage_timings(opened, run_id)
    for r in round_stats(opened, run_id).iter_rows(named=True):
        walls = {t["stage"]: t["wall_s"] for t in timings.filter(timings["round"] == r["round"]).iter_rows(named=True)}
        result.lines.append(f"round {r['round']}: mean score {num(r['mean_score'])}, workflows {r['workflows']}, "
                            f"valid {r['valid_share']}, flagged rewarded runs {r['flagged_rewarded'] or 0}, "
                            f"stage wall s {walls}, round wall s {sum(walls.values()):.1f}")
    return result


def track(run_id: str, store: str | Path | None = None) -> dict[str, str]:
    """Rewrite a run's tracker output (its config's `tracking`: TensorBoard events, MLflow) from the store
    (pipeline.studies.tracking.sync_run); tracker -> where it wrote (empty: the run tracks nothing)."""
    from pipeline.studies.tracking import sync_run

    return sync_run(open_store(store), run_id)
