"""The trajectory store's tables: one pyarrow schema each (docs/design.md §2).

`round` is not a column inside the files: it is the hive partition (`round=<k>/`) and DuckDB/polars
add it on read. Every table carries `run_id` so views over all runs stay unambiguous.
JSON-valued fields are stored as strings (DuckDB can `json_extract` them).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

# `reward_hack`: the workflow ran, but its answer's code returned a look-alike of a value
# (pipeline/engines/sandbox/grader.py)
# `error`: the task's own scorer (a user's function, pipeline.engines.benchmarks.tasks) failed on the answer: it raised,
# hung past its timeout or returned no score in [0, 1]; the message is in `error`. Final for the stage (it goes on),
# left out by curation, and re-scored by `score --only-failed` (RESCORED_STATUSES) once the function is fixed.
STATUSES = ("ok", "invalid", "exec_error", "timeout", "killed", "executor_error", "reward_hack", "error")
FINAL_STATUSES = ("ok", "invalid", "exec_error", "killed", "reward_hack", "error")  # `timeout`: final unless configured
TRANSIENT_STATUSES = ("executor_error",)
RESCORED_STATUSES = ("error",)  # final, but `score --only-failed` runs them again


def transient_statuses(retry_timeouts: bool) -> set[str]:
    """Statuses that `score --only-failed` re-runs and curation waits for (`timeout` only if configured)."""
    return set(TRANSIENT_STATUSES) | ({"timeout"} if retry_timeouts else set())

_ts = pa.timestamp("us", tz="UTC")

# What one sandbox run of a workflow used, in `scores` (the score stage) and `checks` (runs at generation time)
_RUN_USAGE = [
    ("llm_calls", pa.int32()),
    ("tokens_in", pa.int64()),
    ("tokens_out", pa.int64()),
    ("cost_usd", pa.float64()),
    ("wall_s", pa.float64()),
    ("created_at", _ts),
    # added later (nullable: parts written before read them as null). tokens_in / tokens_out are what the
    # workflow used (a cache hit counts its reply's tokens: budgets compare them); computed_* what the executor
    # computed for the run (hits excluded: what it cost); null in older parts, where every token was computed
    ("truncated_calls", pa.int32()),  # calls whose reply stopped at the token cap (finish_reason "length")
    ("cached_calls", pa.int32()),  # calls answered from the reply cache (pipeline.engines.cache)
    ("computed_tokens_in", pa.int64()),
    ("computed_tokens_out", pa.int64()),
]

TABLES: dict[str, pa.Schema] = {
    "queries": pa.schema(
        [
            ("run_id", pa.string()),
            ("split", pa.string()),
            ("query_id", pa.string()),
            ("benchmark", pa.string()),
            ("prompt", pa.string()),
            ("reference", pa.string()),  # JSON: gold answer(s) or hidden tests
            ("meta", pa.string()),  # JSON
        ]
    ),
    "generations": pa.schema(
        [
            ("run_id", pa.string()),
            ("gen_id", pa.string()),
            ("kind", pa.string()),  # agent | workflow | smc (an SMC look-ahead rollout, pipeline.studies.smc)
            ("parent_id", pa.string()),  # the agent of a two-level workflow; refine: the state's workflow; else null
            ("query_id", pa.string()),  # refine rollouts of the task unit: the task id (`task:<first query>+<n>`)
            ("slot", pa.int32()),  # sample index within (query, parent): the idempotency key
            ("prompt_text", pa.string()),
            ("text", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("token_ids", pa.list_(pa.int32())),
            ("token_logprobs", pa.list_(pa.float32())),
            ("model", pa.string()),
            ("backend", pa.string()),
            ("adapter_round", pa.int32()),  # round whose checkpoint generated it; null = base model
            ("sampling", pa.string()),  # JSON sampling params
            ("exemplar_ids", pa.list_(pa.string())),
            ("finish_reason", pa.string()),
            ("valid", pa.bool_()),
            ("invalid_reason", pa.string()),
            ("retokenized", pa.bool_()),  # token ids re-derived from text (server gave none)
            ("latency_s", pa.float64()),
            ("created_at", _ts),
            # added later (nullable: parts written before read them as null)
            ("cost_usd", pa.float64()),  # generator cost of this sample (generator.prices); null = not priced
            ("repair_of", pa.string()),  # self-repair: the gen_id this generation repairs, else null
            ("attempt", pa.int32()),  # self-repair: 0 = first sample, a = a-th repair; null = before repair existed
            ("turn", pa.int32()),  # refine rollouts: the refinement turn (0-based) it was sampled in, else null
            # added later (null: no example menu, or written before): the menu design the prompt showed as its example
            # (rollout.example_menu), and the one the written workflow follows (pipeline.core.designs, `other`: none)
            ("example", pa.string()),
            ("design", pa.string()),
            # added later (null: no menu, or written before): the design the workflow's `# design:` line declares
            # (rollout.menu_choice policy; pipeline.core.designs.declared_choice: a menu name, `combined` or `own`)
            ("choice", pa.string()),
            # added later (null: sampled, as before): `route` (rollout.route_or_write: a menu label that ran its
            # design's program, the completion is the label token), `write` (the `own` label, the generator's code
            # after it), `logged` (a row from another scored run, rollout.logged: its log-probs are the behaviour
            # policy's), `imported` (`pipeline import`)
            ("source", pa.string()),
            ("logged_from", pa.string()),  # logged rows: `<run>/<round>/<gen_id>` of the row it was taken from
        ]
    ),
    "scores": pa.schema(
        [
            ("run_id", pa.string()),
            ("gen_id", pa.string()),
            ("query_id", pa.string()),
            ("rep", pa.int32()),
            ("attempt", pa.int32()),
            ("status", pa.string()),
            ("score", pa.float64()),  # reward in [0, 1] (metric minus weighted penalties)
            ("metric", pa.float64()),  # the benchmark metric alone
            ("complexity", pa.float64()),  # complexity penalty component (before weighting)
            ("cost", pa.float64()),  # cost penalty component (before weighting)
            ("details", pa.string()),  # JSON metric details
            ("answer", pa.string()),
            ("error", pa.string()),
            *_RUN_USAGE,
            ("diversity", pa.float64()),  # FlowReasoner's distinctness component (before weighting); null = older
            # added later: `where:reason` pairs where the workflow or its answer's code touches the
            # harness's surface (pipeline.core.tamper), '' = none, null = scored before the scan existed
            ("flags", pa.string()),
        ]
    ),
    # Runs of a workflow at generation time, before the score stage: self-repair's quick self-check and SMC's
    # look-ahead scoring. Their executor usage is part of a query's cost (the `query_usage` view).
    "checks": pa.schema(
        [
            ("run_id", pa.string()),
            ("gen_id", pa.string()),
            ("query_id", pa.string()),
            ("purpose", pa.string()),  # repair (a self-check) | smc | refine (a validation run of a refine turn)
            ("status", pa.string()),  # a sandbox status (STATUSES)
            ("answer", pa.string()),
            ("error", pa.string()),
            ("reward", pa.float64()),  # smc: R(workflow) used in its particle's weight; refine: the item's metric;
            # repair: null
            *_RUN_USAGE,
        ]
    ),
    # Refine rollouts (pipeline.stages.refine, W4S): one row per candidate of a (task, turn), written when the turn is
    # complete (its presence marks the turn done for a resumed rollout).
    "turns": pa.schema(
        [
            ("run_id", pa.string()),
            ("task_id", pa.string()),  # the generations' query_id: `task:<first query id>+<n>` or a query id
            ("turn", pa.int32()),
            ("slot", pa.int32()),  # the candidate's index k in 0..K-1
            ("gen_id", pa.string()),  # the candidate's workflow: the last attempt of its repair chain
            ("root_id", pa.string()),  # the sampled action (attempt 0); = gen_id when it was not repaired
            ("attempts", pa.int32()),  # repairs used (0 = none)
            ("parent_id", pa.string()),  # the workflow the state showed (the last advanced one); null: the start
            ("items", pa.int32()),  # validation items it ran on (0 when skipped)
            ("accuracy", pa.float64()),  # mean metric over those items; null when skipped
            ("previous", pa.float64()),  # accuracy of the state's workflow
            ("best_before", pa.float64()),  # best accuracy of the task before this turn (start and advanced ones)
            ("reward", pa.float64()),  # RLAO (pipeline.stages.refine.rlao_rewards); null when skipped
            ("advanced", pa.bool_()),  # the best candidate of the turn: the next turn's state
            ("skipped", pa.bool_()),  # still failing its self-check after rollout.repair_attempts repairs
            ("created_at", _ts),
        ]
    ),
    "groups": pa.schema(
        [
            ("run_id", pa.string()),
            ("group_id", pa.string()),
            ("query_id", pa.string()),
            ("level", pa.string()),  # flat | agent | workflow
            ("members", pa.list_(pa.string())),  # gen_ids
            ("member_scores", pa.list_(pa.float64())),
            ("variance", pa.float64()),
            ("kept", pa.bool_()),
            ("reason", pa.string()),
            ("advantages", pa.list_(pa.float64())),
            ("kl_mask", pa.list_(pa.bool_())),
            ("buckets", pa.list_(pa.string())),  # F / M / S per member
            # added later (nullable: parts written before read them as null = a GRPO group)
            ("kind", pa.string()),  # what the row is for an objective (pipeline.core.objectives.KINDS): group | pair |
            # weighted | best
            ("weights", pa.list_(pa.float64())),  # per member: pair / weighted / best rows' loss weights
        ]
    ),
    "train_metrics": pa.schema(
        [
            ("run_id", pa.string()),
            ("step", pa.int32()),
            ("epoch", pa.int32()),
            ("loss", pa.float64()),
            ("pg_loss", pa.float64()),
            ("kl", pa.float64()),
            ("clip_frac", pa.float64()),
            ("ratio_dev", pa.float64()),  # max |π_θ/π_old − 1| over the step's tokens (0 at step 0: they agree)
            ("lr", pa.float64()),
            ("grad_norm", pa.float64()),
            ("tokens", pa.int64()),
            ("logp_mismatch", pa.float64()),  # mean |generation-time − trainer old logprob|
            ("wall_s", pa.float64()),
            ("created_at", _ts),
            # added later (nullable: parts written before read it as null)
            ("padding_share", pa.float64()),  # share of the step's computed token positions that were padding
            # added later (null in older parts): KL(π_old‖π_θ) on π_old's samples; `kl` (the loss's k3) explodes
            # once a sampled token is all but ruled out
            ("kl_old", pa.float64()),
        ]
    ),
    "checkpoints": pa.schema(
        [
            ("run_id", pa.string()),
            ("path", pa.string()),
            ("base_model", pa.string()),
            ("parent_round", pa.int32()),
            ("rows_used", pa.int64()),
            ("created_at", _ts),
        ]
    ),
}


def schema(table: str) -> pa.Schema:
    try:
        return TABLES[table]
    except KeyError:
        raise KeyError(f"unknown table {table!r}; tables: {', '.join(TABLES)}") from None
