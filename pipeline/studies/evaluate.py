"""Evaluation of a round's generator on a held-out split, without touching the run's training data.

The evaluation is its own run, `<run_id>-eval-r<k>` (`-eval-<split>-r<k>` for a split other than
test, `-eval-base` / `-eval-<split>-base` for the base model, k = -1): the trained run's config with
`benchmark.train_split=<split>` and `generator.adapter=<checkpoint of round k>`, rolled out and
scored at its round 0. Queries, generations and scores of the trained run are never written.

Prompts are built as in training: checkpoint k samples round k+1's workflows in the trained run, so its
evaluation shows exemplars drawn from the trained run's rounds <= k (`rollout.exemplar_run/round`); the
base model (k = -1) gets round 0's prompts, which have none. Held-out queries have no exemplars of their
own, so, as for any query without a pool in training, exemplars come from the run's whole pool.

`eval_summary` reports per-query Mean@L, Best@L and Majority@L (pipeline.core.learning), the valid share, the status
mix and the tokens per query of the generator and the executor (the store's `query_usage` view), with a workflow's
score from the store's `generation_scores` view, as in curation (mean over reps, invalid = 0, transient or
unscored = no score yet). Of a self-repair chain only its last attempt counts (`final`): a query's L workflows are
its L slots. Any derived run whose round 0 holds workflows (baselines, SMC) is summarised the same way.
A refine run (rollout.mode: refine) is evaluated in flat mode: its feedback shows gold answers, so held-out
queries get L workflows each from the flat workflow prompt. W4S's own procedure (refine on a validation split with
the trained checkpoint, then run the best refined workflow on test) is `pipeline.studies.methods`' `refined`
evaluation: `open_eval_run(..., mode="refine")` opens its validation run.
For a two-level run it adds the proposal's inference-time selection (pipeline.core.selection: per query the best
agent, then its best workflow) as Sel@L, `select_at_l`.
`evaluate_round` runs the evaluation's stages through a stage caller.

A kept adapter (`<store>/adapters/<run>-r<k>/`: the LoRA files and the run's frozen config, written by the experiment
for stores kept in git) is evaluated the same way by `evaluate_adapter`, in the run `<folder name>-eval[-<split>]`
(`-<hash>` of any extra overrides), from the folder alone: on new problems (`new_problems`: a procedural benchmark's
`split_seed` moved on by its size), never on a question the run trained on (`check_new_problems`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import polars as pl

from pipeline.config import SPLITS, ConfigError, RunConfig, load_config, variant_sets
from pipeline.run import RunContext, open_run
from pipeline.stages.modes import get_mode
from pipeline.store import CHECKPOINT_MARKER, KEPT_CONFIG, Store
from pipeline.studies.summaries import EvalSummary

log = logging.getLogger("pipeline.studies.evaluate")

EVAL_STAGES = ("rollout", "score")  # of pipeline.stages, run at round 0 of the evaluation run


def eval_run_id(run_id: str, round: int, split: str = "test", mode: str | None = None) -> str:
    """`mode`: an evaluation sampled in another rollout mode than the run's evaluation mode gets it as a suffix."""
    tag = "base" if round < 0 else f"r{round}"
    eid = f"{run_id}-eval-{tag}" if split == "test" else f"{run_id}-eval-{split}-{tag}"
    return eid if mode is None else f"{eid}-{mode}"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def derived_run_changes(split: str, cfg: RunConfig | None = None) -> dict[str, Any]:
    """The frozen changes of a method's derived run on `split` (baselines, SMC, plain sampling): CONFIG's
    queries of that split, one round, no exemplars; flat rollouts for a refine CONFIG `cfg` (its feedback reads
    gold answers, and its score stage reads refine turns)."""
    check_split(split)
    changes = {"benchmark.train_split": split, "rounds": 1, "rollout.exemplars": False}
    return changes | ({} if cfg is None else _evaluated_as(cfg.rollout.mode))


def held_out_queries(cfg: RunConfig) -> dict[str, Any]:
    """The change that makes a run on a held-out split hold the experiment's query count (`experiment.eval_queries`,
    None: all of them)."""
    return {"benchmark.max_queries": cfg.experiment.eval_queries}


# The temperature of the design step (rollout.choice_step) in a generator's evaluations: 1.0 draws the design at the
# policy's own odds over the menu's labels. Not the training rollout's exploring temperature (it would credit the
# policy with the exploration's choices), and not the generator's evaluation temperature either (0.7 sharpens the
# odds toward the likeliest design); the committed mixed-choice evaluations, made before this, drew at 0.7.
POLICY_ODDS = 1.0


def eval_changes(cfg: RunConfig, policy: bool = True) -> dict[str, Any]:
    """Changes of an evaluation run: the held-out query count, L (flat: L samples per query), the sampling
    temperature when it is not the rollout's (explore while training, sample as chosen on dev when evaluating), the
    design step at the policy's own odds (`POLICY_ODDS`) and common random numbers for the executor
    (`experiment.common_random_numbers`). `policy` False: a reference's run (a fixed program, no design step), whose
    design-step temperature is unset as it always was (its frozen config keeps its hash)."""
    experiment = cfg.experiment
    changes = held_out_queries(cfg)
    if experiment.eval_temperature is not None:
        changes["generator.temperature"] = experiment.eval_temperature
    if cfg.rollout.choice_step and policy:
        changes["rollout.choice_temperature"] = POLICY_ODDS
    elif cfg.rollout.choice_step and cfg.rollout.choice_temperature is not None:
        changes["rollout.choice_temperature"] = None  # a reference samples no design: as its runs were frozen
    if cfg.rollout.logged:  # an evaluation samples the policy alone: the training rounds' logged rows stay there
        changes["rollout.logged"] = []
    if get_mode(cfg.rollout.mode).evaluated_as == "flat":  # L samples per query (refine runs are evaluated flat)
        changes["rollout.m"] = experiment.eval_l
    # the arms an experiment pairs share the executor's noise: the same call on the same query and slot, one sample
    return changes | {"executor.common_random_numbers": experiment.common_random_numbers}


def _evaluated_as(mode: str) -> dict[str, Any]:
    """The change that makes held-out evaluation sample in the mode's evaluation mode (refine: flat)."""
    as_mode = get_mode(mode).evaluated_as
    return {} if as_mode == mode else {"rollout.mode": as_mode}


def frozen_eval_changes(saved: RunConfig, round: int, adapter: str | None, split: str, store: Store,
                        mode: str | None = None) -> dict[str, Any]:
    """The frozen changes of the evaluation run of `saved`'s round `round` (-1: the base model), sampled with
    `adapter` (None: none) on `split`, one round, in `store`. Prompts are built as in training: exemplars from the
    run whose rounds the checkpoint's data came from (an ablation arm trains on training.data_run's round), below round
    `round + 1`. A refine run samples L flat workflows (its feedback reads gold answers) unless `mode` asks for a
    rollout mode (refinement itself)."""
    pool = saved.training.data_run or saved.run_id
    frozen = {"benchmark.train_split": split, "generator.adapter": adapter, "rounds": 1, "store.root": str(store.root),
              "rollout.exemplar_run": pool, "rollout.exemplar_round": round + 1}
    return frozen | (_evaluated_as(saved.rollout.mode) if mode is None else {"rollout.mode": mode})


def open_eval_run(store_root: str, run_id: str, round: int, split: str = "test", sets: list[str] | None = None,
                  mode: str | None = None, changes: dict[str, Any] | None = None) -> RunContext:
    """Create (first call) or reopen the evaluation run of round `round`'s checkpoint (-1: base model), with a study's
    typed `changes` (e.g. `eval_changes`) and the user's `sets` after them. `mode`: sample in that rollout mode instead
    of the run's evaluation mode, in the run `eval_run_id(..., mode)` (W4S's refinement of the checkpoint on a
    validation split, pipeline.studies.methods: `refine`)."""
    check_split(split)
    store = Store(store_root)
    saved = store.run_dir(run_id) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"run {run_id!r} not found under {store.root}")
    if mode is not None:
        get_mode(mode)  # an unknown mode fails before the run is frozen
    eid = eval_run_id(run_id, round, split, mode)
    if (store.run_dir(eid) / "config.yaml").is_file():
        return open_run(None, eid, 0, variant_sets(changes, after=sets), str(store.root))
    adapter = None
    if round >= 0:
        ckpt = store.checkpoint_dir(run_id, round)
        if not ckpt.is_dir():
            raise ConfigError(f"run {run_id!r} has no checkpoint for round {round} ({ckpt}); train that round first")
        adapter = str(ckpt)
    frozen = frozen_eval_changes(load_config(saved), round, adapter, split, store, mode)
    return open_run(saved, eid, 0, variant_sets(frozen | (changes or {}), after=sets), str(store.root))


# ---- a kept adapter (pipeline.studies.experiment.keep_adapter) on new problems ---------------------------------------


def adapter_eval_run_id(folder: Path, split: str = "test", sets: list[str] | None = None) -> str:
    """`<folder name>-eval[-<split>]`, then `-<hash>` of the extra overrides where there are any: another
    `benchmark.split_seed` (new problems) is a run of its own, and the same command reopens the same run."""
    eid = f"{folder.name}-eval" + ("" if split == "test" else f"-{split}")
    if not sets:
        return eid
    digest = hashlib.sha256("\n".join(sets).encode()).hexdigest()
    return f"{eid}-{digest[:8]}"


def kept_adapter_config(folder: Path) -> RunConfig:
    """The frozen config a kept adapter folder carries, once the folder is known to hold an adapter and its base
    model (the config's generator.model) resolves on this machine."""
    from pipeline.engines.models import ModelError, resolve_model

    missing = [f for f in (CHECKPOINT_MARKER, KEPT_CONFIG) if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{folder}: not a kept adapter folder (no {' or '.join(missing)}); an experiment keeps "
                          "each seed's last round under <store>/adapters/")
    saved = load_config(folder / KEPT_CONFIG)
    try:
        resolve_model(saved.generator.model)
    except ModelError as e:
        raise ConfigError(f"{folder}: its base model {saved.generator.model!r} cannot be loaded here: {e}") from None
    return saved


def new_problems(cfg: RunConfig) -> str:
    """The override that asks `cfg`'s benchmark for problems none of its runs drew. Procedural: a split_seed `size`
    further on, since reasoning-gym draws item i with the seed + i (a seed 1 further asks the same questions again, one
    place on, under new ids); a file benchmark: another file (another split_seed only reshuffles the same items)."""
    if cfg.benchmark.name == "procedural":
        return f"benchmark.split_seed={cfg.benchmark.split_seed + cfg.benchmark.size}"
    return "benchmark.path=<a file of problems the run never saw>"


def check_new_problems(trained: RunConfig, evaluated: RunConfig) -> None:
    """Refuse to evaluate on a question the trained run trained on (the same item, or the same question under another
    id: `new_problems`); log how many of the queries are items of the trained run's benchmark at all (held out from
    training; none for new problems)."""
    from pipeline.engines.benchmarks import load_benchmark

    bench = load_benchmark(trained.benchmark)
    seen, asked = bench.items(), load_benchmark(evaluated.benchmark).items()
    ids, prompts = {it.id for it in seen}, {it.prompt for it in seen}
    if trained_on := [it.id for it in asked if it.id in ids or it.prompt in prompts]:
        raise ConfigError(f"{len(trained_on)} of the {len(asked)} queries to evaluate (e.g. {trained_on[0]}) ask a "
                          f"question run {trained.run_id} trained on: not new problems. Evaluate on another split, or "
                          f"on new problems: --set {new_problems(trained)}")
    known = {it.prompt for it in bench.load()}
    log.info("%d of the %d queries to evaluate are questions of run %s's benchmark (held out from its training)",
             sum(it.prompt in known for it in asked), len(asked), trained.run_id)


def open_adapter_eval_run(store_root: str, folder: str | Path, split: str = "test",
                          sets: list[str] | None = None) -> RunContext:
    """Create (first call) or reopen the evaluation run of a kept adapter folder (adapter_config.json,
    adapter_model.safetensors, KEPT_CONFIG) on `split` of its config's benchmark with the extra overrides `sets` (new
    problems: `new_problems`), as the experiment evaluated its checkpoint (eval_changes: its queries and L); the run
    `adapter_eval_run_id` in the store at `store_root`. A kept adapter is its run's last round, whose prompts were
    built as in round `rounds`."""
    check_split(split)
    folder, sets = Path(folder).resolve(), list(sets or [])
    saved = kept_adapter_config(folder)
    store = Store(store_root)
    eid = adapter_eval_run_id(folder, split, sets)
    if (store.run_dir(eid) / "config.yaml").is_file():
        return open_run(None, eid, 0, None, str(store.root))
    frozen = variant_sets(frozen_eval_changes(saved, saved.rounds - 1, str(folder), split, store) | eval_changes(saved),
                          after=sets)
    check_new_problems(saved, load_config(folder / KEPT_CONFIG, frozen))
    if saved.rollout.exemplars != "none" and store.read_config(saved.run_id) is None:
        log.warning("run %s, whose scored workflows its prompts showed as exemplars, is not in %s: these prompts "
                    "show none", saved.run_id, store.root)
    return open_run(folder / KEPT_CONFIG, eid, 0, frozen, str(store.root))


def generation_votes(store: Store, run_id: str, round: int, family: str) -> dict[str, str | None]:
    """gen_id -> the normalised answer it votes with in Majority@L: of its reps' latest runs that ended `ok`, the
    most frequent vote (a tie: the earliest rep's); None when no rep gave an answer."""
    from pipeline.engines.benchmarks.metrics import vote_key

    df = store.sql("SELECT gen_id, rep, status, answer FROM latest_scores WHERE run_id = $run AND round = $round "
                   "ORDER BY gen_id, rep", {"run": run_id, "round": round}, run=run_id)
    votes: dict[str, list[str]] = {}
    for gid, _, status, answer in df.iter_rows():
        key = vote_key(answer, family) if status == "ok" else None
        votes.setdefault(gid, [])
        if key is not None:
            votes[gid].append(key)
    return {g: (max(v, key=v.count) if v else None) for g, v in votes.items()}


USAGE_KEYS = ("gen_tokens_in", "gen_tokens_out", "gen_cost_usd", "exec_calls", "exec_tokens_in", "exec_tokens_out",
              "exec_cost_usd", "exec_computed_tokens_in", "exec_computed_tokens_out", "exec_cached_calls",
              "exec_truncated_calls", "exec_known_calls")


def query_usage(store: Store, run_id: str, round: int = 0) -> dict[str, dict]:
    """query_id -> its row of the store's `query_usage` view (generator and executor tokens and cost)."""
    df = store.sql("SELECT * FROM query_usage WHERE run_id = $run AND round = $round", {"run": run_id, "round": round},
                   run=run_id)
    return {r["query_id"]: {k: r[k] for k in USAGE_KEYS} for r in df.iter_rows(named=True)}


def usage_summary(usage: list[dict]) -> dict:
    """Means per query: generator tokens (in + out), executor tokens (in + out) the workflows used and those the
    executor computed (cache hits left out), executor calls, cost (both); the share of calls the cache answered; and
    `truncated_share`, of the executor calls whose truncation was recorded, those with a reply cut at the token cap
    (None when none was recorded: a store written before `truncated_calls`). Budgets compare used tokens: what an arm
    computed depends on what ran before it."""
    if not usage:
        return {"gen_tokens_per_query": None, "exec_tokens_per_query": None, "exec_computed_tokens_per_query": None,
                "exec_calls_per_query": None, "cost_usd_per_query": None, "cache_hit_rate": None,
                "truncated_share": None}
    queries, calls = len(usage), sum(u["exec_calls"] for u in usage)
    known = sum(u.get("exec_known_calls") or 0 for u in usage)
    return {"gen_tokens_per_query": sum(u["gen_tokens_in"] + u["gen_tokens_out"] for u in usage) / queries,
            "exec_tokens_per_query": sum(u["exec_tokens_in"] + u["exec_tokens_out"] for u in usage) / queries,
            "exec_computed_tokens_per_query":
                sum(u["exec_computed_tokens_in"] + u["exec_computed_tokens_out"] for u in usage) / queries,
            "exec_calls_per_query": calls / queries,
            "cost_usd_per_query": sum(u["gen_cost_usd"] + u["exec_cost_usd"] for u in usage) / queries,
            "cache_hit_rate": sum(u["exec_cached_calls"] for u in usage) / calls if calls else None,
            "truncated_share": sum(u.get("exec_truncated_calls") or 0 for u in usage) / known if known else None}


def eval_summary(store: Store, eval_id: str) -> EvalSummary:
    """Split-level Mean@L / Best@L / Majority@L / valid share and tokens per query over the eval run's queries,
    the status mix of its latest runs, and `per_query` (one dict per query: workflows, mean_at_l, best_at_l,
    majority_at_l, valid_share, pending and its `query_usage` columns)."""
    from pipeline.core.learning import query_metrics, split_summary
    from pipeline.engines.benchmarks import load_benchmark
    from pipeline.stages.curate import load_round

    ctx = open_run(None, eval_id, 0, None, str(store.root))
    gens = load_round(ctx).filter((pl.col("kind") == "workflow") & pl.col("final"))
    votes = generation_votes(store, eval_id, 0, load_benchmark(ctx.cfg.benchmark).family)
    rows = [{"query_id": r["query_id"], "gen_id": r["gen_id"], "parent_id": r["parent_id"], "valid": r["valid"],
             "score": r["score"] if r["state"] == "ok" else None, "vote": votes.get(r["gen_id"])}
            for r in gens.iter_rows(named=True)]
    per_query = query_metrics(rows)
    usage = query_usage(store, eval_id)
    status = store.sql("SELECT status, count(*) AS n FROM latest_scores WHERE run_id = $run AND round = 0 "
                       "GROUP BY status ORDER BY status", {"run": eval_id}, run=eval_id)
    out = {"eval_run_id": eval_id, **split_summary(per_query),
           **usage_summary([usage[q.query_id] for q in per_query if q.query_id in usage]),
           "status": dict(zip(status["status"].to_list(), status["n"].to_list(), strict=True)),
           "per_query": [asdict(q) | usage.get(q.query_id, {}) for q in per_query]}
    if get_mode(ctx.cfg.rollout.mode).selection:
        add_selection(out, rows)
    return EvalSummary.from_dict(out)


def add_selection(summary: dict, rows: list[dict]) -> None:
    """Two-level runs: the proposal's inference rule (pipeline.core.selection), per query and as the split's Sel@L
    (`select_at_l`), next to Mean@L and Best@L; each query also names its chosen agent and workflow."""
    from pipeline.core.selection import select_all, select_at_l

    chosen = {s.query_id: s for s in select_all(rows)}
    summary["select_at_l"] = select_at_l(list(chosen.values()))
    for q in summary["per_query"]:
        s = chosen.get(q["query_id"])
        q.update(select_at_l=s.score if s else None, selected_agent=s.agent_id if s else None,
                 selected_workflow=s.workflow_id if s else None)


def run_evaluation(ctx: RunContext, sets: list[str] | None = None, call=None,
                   changes: dict[str, Any] | None = None) -> EvalSummary:
    """Roll out and score an evaluation run's round 0 through `call` (a stage caller, default:
    `pipeline.stages.rounds.direct_call()`), `changes` then `sets` applied to each stage; returns `eval_summary`."""
    from pipeline.stages.rounds import direct_call

    call, stage_sets = call or direct_call(), variant_sets(changes, after=sets) if changes else sets
    for stage in EVAL_STAGES:
        call(stage=stage, run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=stage_sets)
    return eval_summary(ctx.store, ctx.run_id)


def evaluate_round(store_root: str, run_id: str, round: int, split: str = "test", sets: list[str] | None = None,
                   call=None, changes: dict[str, Any] | None = None) -> EvalSummary:
    """Roll out and score round `round`'s checkpoint (-1: the base model) on `split` in its evaluation run
    (`run_evaluation`), with a study's typed `changes` and the user's `sets`; returns `eval_summary`."""
    ctx = open_eval_run(store_root, run_id, round, split, sets, changes=changes)
    return run_evaluation(ctx, sets, call, changes)


def evaluate_adapter(store_root: str, folder: str | Path, split: str = "test", sets: list[str] | None = None,
                     call=None) -> EvalSummary:
    """Roll out and score a kept adapter folder on `split` in its evaluation run (`open_adapter_eval_run`: the
    overrides `sets` are frozen into it); returns `eval_summary`."""
    return run_evaluation(open_adapter_eval_run(store_root, folder, split, sets), None, call)
