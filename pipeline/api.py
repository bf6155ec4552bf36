"""The pipeline from Python (a notebook, a script): open a store, read its tables as polars frames, a run's config,
a round's policy as a peft model, run a stage, an evaluation or a study. The `pipeline` command calls these same
functions, so what a notebook does and what the command does cannot drift apart. docs/api.md has a worked example.

Each function is a thin layer over the internals its docstring names; heavy libraries load inside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import ConfigError, StoreConfig
from pipeline.run import run_config
from pipeline.store import Store
from pipeline.store.schema import TABLES
from pipeline.store.views import VIEWS

if TYPE_CHECKING:
    import polars as pl

    from pipeline.stages.runner import StageResult
    from pipeline.studies.summaries import AblationSummary, EvalSummary, ExperimentSummary, MethodsSummary

DEFAULT_STORE = StoreConfig.model_fields["root"].default  # where runs live when neither a flag nor a config says


def open_store(root: str | Path | None = None) -> Store:
    """The store at `root` (a directory or s3://bucket/prefix; default data/runs)."""
    return Store(root or DEFAULT_STORE)


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


def evaluate(run_id: str, round: int, split: str = "test", store: str | None = None,
             sets: Sequence[str] = ()) -> EvalSummary:
    """Roll out and score round `round`'s checkpoint (-1: the base model) on `split` in the derived run
    `<run_id>-eval-r<k>`, then update the run's trackers (pipeline.studies.tracking.evaluate_tracked)."""
    from pipeline.studies.summaries import EvalSummary
    from pipeline.studies.tracking import evaluate_tracked

    return EvalSummary.from_dict(evaluate_tracked(str(store or DEFAULT_STORE), run_id, round, split, list(sets)))


def evaluate_adapter(folder: str | Path, split: str = "test", store: str | None = None,
                     sets: Sequence[str] = ()) -> EvalSummary:
    """Roll out and score a kept adapter folder (`<store>/adapters/<run>-r<k>/`, pipeline.studies.experiment.
    keep_adapter) on `split` of its run's benchmark, as its experiment evaluated it, in the derived run
    `<folder name>-eval[-<split>][-<hash of sets>]`; new problems: the override of its README
    (pipeline.studies.evaluate.new_problems, open_adapter_eval_run)."""
    from pipeline.studies.evaluate import evaluate_adapter as run
    from pipeline.studies.summaries import EvalSummary

    return EvalSummary.from_dict(run(str(store or DEFAULT_STORE), folder, split, list(sets)))


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
