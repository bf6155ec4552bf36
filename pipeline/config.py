"""Run configuration: pydantic models, YAML loading, `--set a.b=value` overrides.

Every error names the file and the field path, so a user can fix a config without reading code.
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ForwardRef, Literal, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        # a section as an older version saved it, read in today's fields (Upgrades of saved configs, at the end)
        return upgrade_saved(cls, data)


# A field, or a section as a whole, that is not what a run computes says so on itself, once:
# `json_schema_extra=not_hashed(kind)`. The config hash leaves it out (`RunConfig.config_hash`), the resume check
# (`diff_configs`) too unless its kind is `study`, and docs/config.md notes it; every list of such paths derives from
# these marks (`not_hashed_paths`).
NotHashed = Literal["plan", "draw", "study"]
NOT_HASHED_KINDS: dict[str, str] = {
    "plan": "which extra runs a study makes and how it pairs them, or how often training saves its progress: no run "
    "computes differently, so a run resumed with another value is not refused (an experiment can gain references "
    "after its seeds ran)",
    "draw": "which draw of the same distribution a row is, or the reuse of a computed one: a row scored with or "
    "without common random numbers or the cache is a sample of the same thing, so a run resumed with another value "
    "is not refused and its finished stages stay finished",
    "study": "a study's plan that its runs carry in their own configs (the evaluations' split, queries and L), or "
    "where figures are copied to: no stage computes differently, but a run resumed with another value is refused, so "
    "a study never mixes two plans",
}
_NOT_HASHED = "not_hashed"  # the key of the mark in a field's json_schema_extra


def not_hashed(kind: NotHashed) -> dict[str, str]:
    """The mark of a field (or section) that the config hash leaves out; `json_schema_extra=not_hashed("plan")`."""
    if kind not in NOT_HASHED_KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(NOT_HASHED_KINDS)}")
    return {_NOT_HASHED: kind}


def server_urls(base_url: str | None, endpoints: list[str]) -> list[str]:
    """The OpenAI-compatible servers a section talks to: its `endpoints`, else its one `base_url`."""
    return list(endpoints) or ([base_url] if base_url else [])


def _check_url(url: str) -> str:
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0  # .port checks the port
    except ValueError:  # a port that is no number or out of range
        ok = False
    if not ok:
        raise ValueError(f"{url!r} is not an http(s) URL like http://127.0.0.1:8000/v1")
    return url


def _check_served(section: str, openai: bool, needs: str, base_url: str | None, endpoints: list[str]) -> None:
    """A served section talks to its own server: its URL is set when the stage starts it, never in the config."""
    if not openai:
        raise ValueError(f"{section}.serve needs {section}.{needs}")
    if base_url or endpoints:
        raise ValueError(f"{section}.serve starts its own server: leave {section}.base_url and {section}.endpoints "
                         f"unset (over a saved one: --set {section}.base_url=null), or drop {section}.serve")


class StoreConfig(_Strict):
    root: str = Field("data/runs", description="Where runs live: a directory (with catalog.duckdb) or "
                      "s3://bucket/prefix (docs/scale-out.md, Store on object storage).")
    endpoint_url: str | None = Field(None, description="s3:// roots: an S3-compatible server's URL (default: "
                                     "$AWS_ENDPOINT_URL, else AWS); credentials only from the environment.")


class ServeConfig(_Strict):
    """A model server the pipeline runs itself (pipeline.engines.servers): the stage that calls the model starts one
    vLLM OpenAI-compatible server, waits for it, points the section's base_url at it and stops it when it ends."""

    model: str | None = Field(
        None, description="Model ref to load (embedded:..., a local HF folder, a hub id); null: the section's `model`.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Served weights dtype; auto: bf16 where the device computes it natively, else fp32 "
        "(pipeline.engines.hardware).")
    max_model_len: int = Field(2048, gt=0, description="Context length (prompt + completion) of each request.")
    kv_cache_gb: int = Field(1, gt=0, description="GiB of KV cache (CPU tier: VLLM_CPU_KVCACHE_SPACE).")
    host: str = Field("127.0.0.1", description="Address the server binds to and the pipeline calls.")
    port: int | None = Field(
        None, gt=0, lt=65536, description="Fixed port: a server already there serving this model is reused (and "
        "left running); null: a free port per stage.",
    )
    enforce_eager: bool = Field(True, description="Skip graph capture (starts faster; CPU has none anyway).")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of prompt prefixes requests share (vLLM's --enable-prefix-caching); "
        "the stage's log gives the hit rate.", json_schema_extra=not_hashed("draw"))
    ngram_speculation: int | None = Field(
        None, gt=0, description="Speculative decoding by prompt lookup (vLLM's ngram method): this many tokens a step "
        "proposed from the request's own prompt and output, kept where the model's own choice agrees; a greedy "
        "executor's replies are unchanged up to rounding (measured at temperature 0 only). Executor only. Null: off.",
        json_schema_extra=not_hashed("draw"))
    extra_args: list[str] = Field(
        default_factory=list, description="More vLLM server arguments, e.g. [--max-num-seqs, '8'].",
    )
    start_timeout_s: float = Field(600.0, gt=0, description="Give up (with the log's tail) if not up by then.")


class GeneratorConfig(_Strict):
    model: str = Field(
        "embedded:smollm2-135m-instruct",
        description="Model ref: `embedded:smollm2-135m-instruct`, a local HF folder, or a hub id (online).",
    )
    backend: Literal["transformers", "vllm", "openai"] = Field(
        "transformers", description="Generation backend: transformers (CPU default), vllm (offline), openai."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto: bf16 where the device computes it natively, else fp32 "
        "(pipeline.engines.hardware). Sets sampling speed, and under training.old_logprobs: auto whether π_old is "
        "the rollout's log-probs (fp32) or recomputed.",
    )
    base_url: str | None = Field(None, description="openai backend: the OpenAI-compatible server's URL.")
    endpoints: list[str] = Field(
        default_factory=list, description="openai backend: several servers' URLs to spread prompts over (scale-out)."
    )
    api_key_env: str = Field("OPENAI_API_KEY", description="openai backend: env var holding the API key.")
    served_model: str | None = Field(None, description="openai backend: the model name the server knows.")
    max_new_tokens: int = Field(512, gt=0, description="Completion length cap per sample.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of the generator.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    stop_at_block_end: bool = Field(
        True, description="End a workflow sample at its first code block's closing fence (a line of ```): what "
        "follows is never run (vllm, transformers and vLLM-served backends; another server runs on to EOS).",
    )
    seed: int = Field(0, description="Sampling seed (each round and batch derives its own by hashing).")
    adapter: str | None = Field(
        None, description="LoRA adapter folder of the starting policy: round 0 samples with it and trains from it "
        "(π_old); later rounds use the previous round's checkpoint. Default: the base model.",
    )
    batch_size: int = Field(
        8, gt=0, description="Prompts per generation call; openai: also the most requests in flight on each "
        "endpoint; vllm: a call decodes until its longest sample ends, so fewer, larger calls take fewer steps.",
    )
    call_samples: int | None = Field(
        256, gt=0, description="vllm and openai backends: the samples one call gathers from several batches, each "
        "prompt keeping its batch's seed (the same draws), so one batch's longest samples decode beside the next's; "
        "a crash loses the call in flight. Null: batch_size x n, a batch a call.",
        json_schema_extra=not_hashed("draw"))
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vllm: GPU memory fraction.")
    max_model_len: int = Field(4096, gt=0, description="vllm: context length.")
    enforce_eager: bool = Field(True, description="vllm: skip graph capture (fast start).")
    enable_prefix_caching: bool = Field(
        True, description="vllm: reuse the KV cache of prompt prefixes requests share (system text, contract, "
        "designs); the rollout's log gives the hit rate.", json_schema_extra=not_hashed("draw"))
    block_size: int | None = Field(
        None, gt=0, description="vllm: tokens a KV cache block holds. Prefix caching reuses whole blocks, and vLLM's "
        "CPU default is 128: prompts that share 502 tokens reuse 384 of them; 32 reuses 480 (a multiple of 32 on "
        "CPU). Null: vLLM's default.", json_schema_extra=not_hashed("draw"))
    tensor_parallel_size: int = Field(
        1, gt=0, description="vllm: tensor parallel degree (GPUs per engine); openai endpoints: each server's own "
        "--tensor-parallel-size.",
    )
    max_lora_rank: int = Field(64, gt=0, description="vllm: largest LoRA rank it can load.")
    merge_adapter: Literal["auto", "always", "never"] = Field(
        "auto", description="vllm: sample a round's adapter merged into a copy of the base weights instead of "
        "through LoRA kernels (8x slower than the base model on CPU); auto = merge on CPU.",
    )
    prices: PriceConfig = Field(
        default_factory=lambda: PriceConfig(), description="Generator price table: each sample's cost_usd."
    )
    serve: ServeConfig | None = Field(
        None, description="openai backend: the rollout stage serves `model` itself (vLLM, runtime LoRA loading) "
        "instead of calling base_url (pipeline.engines.servers).",
    )

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v)

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        if len({u.rstrip("/") for u in v}) < len(v):
            raise ValueError(f"an endpoint is listed twice: {v}")
        return [_check_url(u) for u in v]

    @model_validator(mode="after")
    def _one_server_setting(self) -> GeneratorConfig:
        if self.serve is not None:
            _check_served("generator", self.backend == "openai", "backend: openai", self.base_url, self.endpoints)
            if self.serve.ngram_speculation is not None:
                raise ValueError("generator.serve.ngram_speculation: the generator's samples and their log-probs "
                                 "under speculative decoding are not checked; set it on executor.serve")
        elif self.backend == "openai" and bool(self.base_url) == bool(self.endpoints):
            raise ValueError(
                "backend openai needs either generator.base_url (one server) or generator.endpoints (a list), "
                f"not {'both' if self.base_url else 'neither'}"
                + (" (over a saved base_url: --set generator.base_url=null)" if self.base_url else ""))
        return self


class PriceConfig(_Strict):
    input_per_mtok: float = Field(0.0, ge=0, description="USD per million prompt tokens.")
    output_per_mtok: float = Field(0.0, ge=0, description="USD per million completion tokens.")


class ExecutorConfig(_Strict):
    # Not a setting: the `serve` section a stage's server was started from, kept when `serving` points the section at
    # that server (base_url set, serve cleared), so the reply cache still knows what answers (weights, dtype).
    _served_from: ServeConfig | None = PrivateAttr(None)

    kind: Literal["local", "openai"] = Field(
        "local", description="local: the embedded model in-process (a call past the model's context is refused, as a "
        "server refuses one past its max_model_len); openai: any OpenAI-compatible server."
    )
    model: str = Field("embedded:smollm2-135m-instruct", description="Model ref (local) or served name.")
    base_url: str | None = Field(None, description="openai: base URL, e.g. http://127.0.0.1:8000/v1.")
    endpoints: list[str] = Field(
        default_factory=list, description="openai: several base URLs to spread calls over (scale-out)."
    )
    api_key_env: str = Field("OPENAI_API_KEY", description="Env var holding the API key (never stored).")
    temperature: float = Field(0.0, ge=0, description="Executor sampling temperature (paper: 0).")
    max_tokens: int = Field(256, gt=0, description="Completion cap per executor call.")
    concurrency: int = Field(
        32, gt=0, description="Most executor sequences in flight at once, a request for n samples counting n (32: "
        "the most tokens/s a vLLM CPU server gave here, `pipeline bench executor`, docs/performance.md); halved "
        "while calls time out, widened again as they finish.",
    )
    max_retries: int = Field(4, ge=0, description="Retries on 429/5xx/timeouts/connection errors.")
    timeout_s: float = Field(60.0, gt=0, description="Per-call timeout in seconds; a call asked again after "
                             "a timeout gets twice its last attempt's time (a slow CPU's whole reply can outlast it).")
    prices: PriceConfig = Field(default_factory=PriceConfig, description="Price table for cost accounting.")
    serve: ServeConfig | None = Field(
        None, description="The stages that call the executor serve `model` themselves (vLLM) and stop it after "
        "(pipeline.engines.servers); needs kind: openai and no base_url/endpoints.",
    )
    common_random_numbers: bool = Field(
        False, description="Seed each sampled executor call from executor.seed, the query, the workflow's sample slot, "
        "the rep and the call itself (messages, parameters, identical calls made before), so that two arms making "
        "the same call on the same query and slot get the same sample. Evaluation and reference runs turn it on "
        "(experiment.common_random_numbers); off: training rollouts draw fresh samples.",
        json_schema_extra=not_hashed("draw"),
    )
    seed: int = Field(0, description="The executor's common random numbers' seed, shared by every arm they pair.",
                      json_schema_extra=not_hashed("draw"))
    cache: Literal["auto", "on", "off"] = Field(
        "auto", description="Replies computed once, kept in <store>/cache/executor/ (pipeline.engines.cache): greedy "
        "and seeded calls. auto: for the local executor and a served one (their model and settings are known); on: "
        "also for an endpoint the pipeline does not start (you vouch that its model never changes); off: never.",
        json_schema_extra=not_hashed("draw"),
    )

    @model_validator(mode="after")
    def _served(self) -> ExecutorConfig:
        if self.serve is not None:
            _check_served("executor", self.kind == "openai", "kind: openai", self.base_url, self.endpoints)
        return self


class JudgeConfig(_Strict):
    base_url: str = Field(..., description="OpenAI-compatible endpoint of the judge model.")
    model: str = Field(..., description="Judge model name.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Env var holding the judge's API key.")


# Tasks (benchmarks) are found by name in this entry-point group: the shipped ones register in pyproject.toml the
# same way a plugin package does, so `benchmark.name` is any installed task (pipeline.engines.benchmarks.base).
TASK_GROUP = "workflow_grpo.tasks"
SCORER_BUILTINS = ("exact", "text", "number", "math", "choice", "regex", "unit_tests")


def task_entry_points() -> dict:
    """name -> importlib.metadata.EntryPoint of every task installed under TASK_GROUP. Reading the installed metadata
    takes ~0.1 s, and configs are validated often: read once per sys.path, so a folder added to the path (a plugin
    installed into a target folder) is seen."""
    return _entry_points_on(tuple(sys.path))


@cache
def _entry_points_on(path: tuple[str, ...]) -> dict:
    from importlib.metadata import EntryPoint, entry_points

    found = {ep.name: ep for ep in entry_points(group=TASK_GROUP)}
    if any(ep.value.startswith("pipeline.") for ep in found.values()):
        return found
    # The source tree's own tasks missing from the installed metadata: an install older than the entry points (or
    # none, running from a checkout). Its pyproject.toml, the one list of them, is read instead, and the fix said.
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        return found
    import logging
    import tomllib

    table = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {}).get(TASK_GROUP, {})
    if table:
        logging.getLogger(__name__).warning("the installed metadata lists none of this package's tasks: read from %s; "
                                            "run `pip install -e .` again", pyproject)
    return {name: EntryPoint(name, value, TASK_GROUP) for name, value in table.items()} | found


def unknown_task_message(name: str, known: list[str]) -> str:
    """The error for a task name nothing registers: the installed names, and how a name gets registered."""
    if not known:
        return (f"unknown task {name!r}: no task is registered under the entry-point group {TASK_GROUP!r}, not even "
                "the shipped ones; install the package (pip install -e .) so its entry points exist")
    return (f"unknown task {name!r}; installed tasks: {', '.join(sorted(known))}. A plugin package registers its "
            f"tasks under the entry-point group {TASK_GROUP!r} (docs/tasks.md); after editing pyproject.toml run "
            "pip install -e . again")


class ColumnMap(_Strict):
    """`benchmark.name: file`: which columns of the dataset hold what; every other column is metadata, passed to the
    scorer as keyword arguments."""

    query: str = Field("question", description="Column with the query text (what the workflow's solve gets).")
    answer: str = Field("answer", description="Column with the reference answer the scorer compares against.")
    id: str | None = Field(None, description="Column with a unique row id; null: `<file stem>-<row index>`.")
    label: str | None = Field(
        None, description="Column with a part/family label (the mix `pipeline validate` prints); null: none.",
    )


# A benchmark's items: `test` (test_share of them) and `validate` (the rest), which dev_share divides into `dev`
# (model selection) and `train` (what rounds optimise on); pipeline.engines.benchmarks.base.split_items.
Split = Literal["validate", "train", "dev", "test"]
SPLITS: tuple[str, ...] = get_args(Split)


class BenchmarkConfig(_Strict):
    name: str = Field(
        "procedural", description="Which task supplies the queries: a shipped benchmark, `file` (a dataset and a "
        "scorer of your own, docs/tasks.md) or a plugin's task (`pipeline tasks` lists them).",
    )
    path: str | None = Field(
        None, description="Local data file: a shipped benchmark's in its official format; `file`: JSONL, JSON, CSV, "
        "Parquet or a folder saved by `datasets`.",
    )
    hub_id: str | None = Field(None, description="Hub dataset id (only where the hub is reachable).")
    tasks: list[str] = Field(
        default_factory=lambda: ["chain_sum", "basic_arithmetic"],
        description="procedural: reasoning-gym generators to draw from.",
    )
    size: int = Field(100, gt=0, description="procedural: items generated in total.")
    levels: list[int] = Field(default_factory=list, description="math: keep only these levels (e.g. [5]).")
    split_seed: int = Field(0, description="Seed of the deterministic splits (a hash of seed and item id).")
    test_seed: int | None = Field(
        None, description="A test split no run has read: the test split of the same task loaded at this seed (a "
        "generator draws new items), less every item whose normalised text is any item of this split_seed's; train "
        "and dev, and the runs made on them, stay as they are. Null: the test split of split_seed.",
    )
    test_share: float = Field(0.8, gt=0, lt=1, description="Share of items held out as `test` (0.8: 1:4).")
    dev_share: float = Field(
        0.0, ge=0, lt=1, description="Share of the non-test items (`validate`) held out as `dev`; the rest is `train`.",
    )
    train_split: Split = Field("validate", description="Split the rounds optimise on (validate = train + dev).")
    max_queries: int | None = Field(None, gt=0, description="Use only the first N queries of the split.")
    one_split_per_text: bool = Field(
        True, description="Queries whose text is the same once normalised (lowercase, whitespace collapsed, "
        "punctuation at the ends stripped) all go to the split of the first of them in the seeded ranking, so no "
        "held-out query is word for word a training or dev one; false: each item by its id alone, as splits were "
        "made before (a saved config without the field reads as false).",
    )
    exact_number: bool | None = Field(
        None, description="procedural: score 1 only when the answer's last number equals the gold number (GSM8K's "
        "rule); null: for gsm_symbolic only (its own check gives near misses partial credit).",
    )

    columns: ColumnMap = Field(
        default_factory=ColumnMap, description="file: the dataset's columns for the query, answer, id and label.",
    )
    scorer: str = Field(
        "exact", description="file: a built-in (" + ", ".join(SCORER_BUILTINS) + ") or your function as "
        "`module:function` or `path/to/file.py:function`, called as score(answer, reference, **metadata) and "
        "returning a float in [0, 1] or (float, details).",
    )
    tolerance: float = Field(1e-6, ge=0, description="file, scorer number: relative tolerance of the comparison.")
    pattern: str | None = Field(
        None, description="file, scorer regex: what to extract from the answer (its last match; group 1 if the "
        "pattern has a group), then compared as normalised text with the reference.",
    )
    scorer_timeout_s: float = Field(
        10.0, gt=0, description="file: a call of your own scorer running longer is killed and its row gets status "
        "`error`.",
    )
    scorer_stop_after: int = Field(
        3, ge=0, description="file: when the first N calls of your own scorer all fail the same way (a timeout, one "
        "error message), it is called no more: the other rows get status `error`, not scored; 0: never stop.",
    )
    family: Literal["code", "math", "qa", "procedural"] | None = Field(
        None, description="file: the prompt family (its example workflow and contract); null: code for the "
        "unit_tests scorer, math for math, else procedural.",
    )

    @field_validator("name")
    @classmethod
    def _installed_task(cls, name: str) -> str:
        known = task_entry_points()
        if name not in known:
            raise ValueError(unknown_task_message(name, list(known)))
        return name

    @field_validator("scorer")
    @classmethod
    def _scorer_form(cls, scorer: str) -> str:
        if scorer not in SCORER_BUILTINS and ":" not in scorer:
            raise ValueError(f"scorer {scorer!r}: use a built-in ({', '.join(SCORER_BUILTINS)}) or your function as "
                             "module:function or path/to/file.py:function")
        return scorer

    @model_validator(mode="after")
    def _regex_has_pattern(self) -> BenchmarkConfig:
        if self.scorer == "regex" and not self.pattern:
            raise ValueError("scorer regex needs benchmark.pattern (what to extract from an answer)")
        return self

    @model_validator(mode="after")
    def _dev_split_exists(self) -> BenchmarkConfig:
        if self.train_split == "dev" and self.dev_share == 0:
            raise ValueError("train_split dev needs dev_share > 0 (dev is empty)")
        return self


class RefineConfig(_Strict):
    """`rollout.mode: refine`: W4S's multi-turn refinement (pipeline.stages.refine). A task's state is its current
    workflow and the feedback of its validation runs; each turn samples K candidates, self-checks (and repairs, up to
    `rollout.repair_attempts`) them, runs them on the task's items, and the best advances the state."""

    turns: int = Field(3, gt=0, description="T: refinement turns per task and round.")
    candidates: int = Field(4, gt=0, description="K: candidate workflows sampled from each state.")
    unit: Literal["task", "query"] = Field(
        "task", description="task: one workflow for a task of `task_size` training queries (W4S); query: each query "
        "is its own task of one item.",
    )
    task_size: int = Field(
        8, gt=0, description="task unit: validation items per task (consecutive queries of the train split; the last "
        "task of a round may be smaller).",
    )
    failure_cases: int = Field(3, ge=0, description="Failed validation items shown in a state's feedback.")
    show_gold: bool = Field(
        True, description="task unit: feedback shows a failed item's gold answer (W4S; training items). The query "
        "unit never shows it: it is the answer the workflow is asked for.",
    )
    start: str | None = Field(
        None, description="Code of the workflow shown at turn 0; null: the prompt's example workflow of the "
        "benchmark family.",
    )


class LoggedRun(_Strict):
    """A run of the store whose scored rows a round takes as logged (off-policy) data (`rollout.logged`)."""

    run: str = Field(description="The run id (in this store).")
    round: int = Field(0, ge=0, description="Its round.")


class RolloutConfig(_Strict):
    mode: Literal["flat", "two_level", "refine"] = Field(
        "flat", description="flat (SPOGW), two_level (agent/workflow) or refine (W4S's multi-turn refinement).",
    )
    m: int = Field(16, ge=0, description="flat: workflows sampled per query (0: none, the round trains on its "
                   "`logged` rows alone).")
    n_agents: int = Field(4, gt=0, description="two_level: agent plans per query (N_A).")
    n_workflows: int = Field(4, gt=0, description="two_level: workflows per agent plan (N_W).")
    tau_agent: float = Field(1.0, gt=0, description="Softmax temperature of agent exemplar buckets.")
    tau_workflow: float = Field(1.0, gt=0, description="Softmax temperature of workflow exemplar buckets.")
    tau_decay: float = Field(1.0, gt=0, description="Per-round multiplier of both temperatures (annealing).")
    r_min_agent: float = Field(0.0, ge=0, le=1, description="Agents enter the exemplar pool from this reward.")
    r_min_workflow: float = Field(0.0, ge=0, le=1, description="Workflows enter the pool from this score.")
    max_plan_tokens: int = Field(256, gt=0, description="two_level: completion cap of an agent plan.")
    prompt_dir: str | None = Field(
        None, description="A folder of hand-written prompt templates (system.txt, workflow.txt, contract.txt, "
        "contract_code.txt, example_<family>.txt; two-level: agent.txt, agent_system.txt, workflow_under_plan.txt; "
        "refine: refine.txt): "
        "each file there replaces the shipped template of that name.",
    )
    workflow_prefix: str = Field(
        "", description="The assistant turn of a workflow prompt starts with this text (e.g. an open ```python "
        "fence and the `solve` signature) so small generators stay on format; it is part of the prompt tokens "
        "and of the stored `text`.",
    )
    max_workflow_chars: int = Field(20000, gt=0, description="Static check: larger workflows are invalid.")
    example_menu: list[str] = Field(
        default_factory=list, description="A menu of designs: workflow program files (configs/programs/"
        "*.py, each also a fixed program and a reference). How a sample uses it: `menu_choice`. `$menu` lists every "
        "design (name and `# design:` line), `$designs` shows every design's code too. Empty: the prompt folder's "
        "one example, as before.",
    )
    menu_choice: Literal["policy", "drawn"] = Field(
        "policy", description="policy: every prompt shows the whole menu and the generator's own tokens choose (the "
        "assistant turn opens with workflow_prefix, e.g. a ```python fence and `# design:`; the declared design is "
        "stored as `generations.choice`). drawn: each sample's prompt shows one design as its example (`$example`, "
        "`$design`), drawn by a seeded hash of (query, slot, menu_seed), the same draws for the base model and every "
        "round; the choice is then the hash's, not the policy's.",
    )
    choice_step: bool = Field(
        False, description="menu_choice policy: the design is a sampling step of its own. The first token after "
        "workflow_prefix is drawn from the generator's odds over the first tokens of the designs' labels (their "
        "names without the prefix all share, as `$designs` shows them), renormalised over them, at "
        "choice_temperature, then the workflow is sampled after it; both are the sample's tokens and train alike "
        "(the row's first log-prob is the draw's; its `sampling` keeps the policy's own, choice_step.logprob, which "
        "training.old_logprobs: rollout takes as the label's π_old). workflow_prefix ends where a label starts, e.g. "
        "with `# design:`.",
    )
    choice_temperature: float | None = Field(
        None, gt=0, le=100, description="choice_step: temperature of the design token: the policy's odds over the "
        "labels, renormalised and raised to 1/temperature (above 1 it explores the designs more, still by the "
        "policy's own odds; drawn by the rollout, so above vLLM's cap of 2 too); null: generator.temperature.",
    )
    route_or_write: bool = Field(
        False, description="choice_step: the design label is a commitment. A menu label runs that design's program "
        "(the workflow is the design's code; the completion trained on is the label token alone) and the label "
        "`own` lets the generator write its own workflow after it (label plus code trained). `generations.source` "
        "says which: route or write.",
    )
    own_label: str = Field("own", description="route_or_write: the label that writes a workflow of its own.")
    logged: list[LoggedRun] = Field(
        default_factory=list, description="Scored runs of the store whose rows on this round's queries join the "
        "round as logged rows (`generations.source` logged, their scores copied, trained under training.off_policy): "
        "a fixed design's runs (with route_or_write: the label of that design, behaviour probability 1/K over the K "
        "designs logged for the query), or sampled rows with their log-probs (an earlier round, another seed, "
        "`pipeline import`). A row that cannot be used is refused by name.",
    )
    menu_seed: int = Field(0, description="menu_choice drawn: seed of the draws (not the generator's: every seed of "
                           "an experiment draws alike).")
    menu_prefix_lines: int | None = Field(
        None, ge=0, description="menu_choice drawn: the assistant turn opens with a ```python fence and the "
        "drawn design's code through its `async def solve` line plus this many lines of its body (what "
        "workflow_prefix holds for a single example); null: workflow_prefix as it is.",
    )
    exemplars: Literal["none", "buckets"] = Field(
        "buckets", description="Scored exemplars of earlier rounds in prompts from round 1 on: none (SPOGW has none) "
        "or buckets (the two-level proposal's contrastive F/M/S pick, flat prompts too); legacy true/false = "
        "buckets/none.",
    )
    exemplar_run: str | None = Field(
        None, description="Draw exemplars from this run's rounds < exemplar_round instead of this run's earlier "
        "rounds (evaluation runs: the trained run's, so prompts are built as in training).",
    )
    exemplar_round: int | None = Field(None, ge=0, description="With exemplar_run: use its rounds below this one.")
    repair_attempts: int = Field(
        0, ge=0, description="Self-repair (W4S: 3): a workflow that is invalid or fails its self-check goes back to "
        "the generator with its error up to this many times (pipeline.stages.repair); 0 = off. Refine mode always "
        "self-checks its candidates and skips one still failing after this many repairs.",
    )
    repair_check: Literal["run", "static"] = Field(
        "run", description="Self-repair's check: `run` = one sandbox run on its own query (a crash, timeout or no "
        "answer fails it; the gold answer is never read), `static` = the contract check only.",
    )
    refine: RefineConfig = Field(
        default_factory=RefineConfig, description="refine mode: turns, candidates, task unit and feedback (W4S)."
    )

    @model_validator(mode="after")
    def _choice_step_needs_the_policy_menu(self) -> RolloutConfig:
        if self.choice_step and (self.menu_choice != "policy" or not self.example_menu or self.mode != "flat"):
            raise ValueError("rollout.choice_step samples the policy's design from rollout.example_menu: it needs "
                             "menu_choice policy, a menu, and mode flat")
        return self

    @model_validator(mode="after")
    def _route_or_write_needs_the_choice_step(self) -> RolloutConfig:
        if self.route_or_write and not self.choice_step:
            raise ValueError("rollout.route_or_write commits the design token: it needs rollout.choice_step")
        if self.m == 0 and not self.logged and self.mode == "flat":
            raise ValueError("rollout.m is 0: the round samples nothing; name the runs it takes rows from in "
                             "rollout.logged, or set m > 0")
        return self

    @model_validator(mode="after")
    def _prefix_of_a_drawn_design(self) -> RolloutConfig:
        if self.menu_choice == "policy" and self.menu_prefix_lines is not None and self.example_menu:
            raise ValueError("rollout.menu_prefix_lines opens the turn with a drawn design's lines, which chooses for "
                             "the policy; with menu_choice policy open it with workflow_prefix (e.g. a ```python fence "
                             "and `# design:`), or set menu_choice: drawn")
        return self


class RewardConfig(_Strict):
    complexity_weight: float = Field(0.0, ge=0, description="Weight of the complexity penalty (AST/calls).")
    cost_weight: float = Field(0.0, ge=0, description="Weight of the executor-token cost penalty.")
    token_budget: int | None = Field(
        None, gt=0, description="The cost term's unit: a run's cost is min(1, executor tokens / token_budget) "
        "(pipeline.core.reward). Set it to about the dearest design's executor tokens per run, so the term ranks "
        "the designs a task's runs spend; null: the legacy 20,000 tokens, at which a run of these tasks costs "
        "almost nothing.",
    )
    diversity_weight: float = Field(
        0.0, ge=0,
        description="Weight of FlowReasoner's diversity term, a penalty on 1 - diversity (pipeline.core.reward).",
    )
    judge: JudgeConfig | None = Field(None, description="Optional LLM-as-judge for free-form answers.")
    zero_flagged: bool = Field(
        True, description="A scored sample whose code touches the harness's surface (`scores.flags`, "
        "pipeline.core.tamper) gets reward 0; its metric is kept.",
    )


class ScoringConfig(_Strict):
    reps: int = Field(1, gt=0, description="Runs per workflow; the score is their mean (paper: 3).")
    concurrency: int | None = Field(
        None, gt=0, description="Workflows running at once; null: executor.concurrency for an OpenAI-compatible "
        "executor (a workflow mostly waits on its calls, so as many workflows as requests keep the server's batch "
        "full), 2 for the in-process one.",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="Wall-clock limit per workflow run, less its time waiting on executor calls (a "
        "queue at a shared server is not the workflow's; executor.timeout_s bounds each call).",
    )
    cpu_time_s: int = Field(30, gt=0, description="CPU-time limit per workflow run.")
    memory_mb: int = Field(1024, gt=0, description="Address-space limit of a workflow process.")
    max_llm_calls: int = Field(20, gt=0, description="Executor-call budget per workflow run.")
    test_timeout_s: float = Field(5.0, gt=0, description="Per-test timeout of code metrics.")
    retry_timeouts: bool = Field(False, description="Treat `timeout` as transient for --only-failed.")
    batch_size: int = Field(16, gt=0, description="Score rows per Parquet part.")
    cache_verdicts: bool = Field(
        True, description="A code grader's verdict on an identical (benchmark, item, answer) computed once, kept in "
        "<store>/cache/grader/ (timeouts excepted).", json_schema_extra=not_hashed("draw"),
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Multi-purpose reward weights.")


class CurationConfig(_Strict):
    n: int = Field(14, gt=1, description="Group size before sharpening (C(m, n) groups per query).")
    t: int = Field(4, gt=0, description="Sharpening keeps the t lowest and t highest members (2t < n).")
    top_n: int = Field(100, gt=0, description="Variance screening keeps the top-N groups of a round.")
    max_groups_per_query: int | None = Field(
        1000, gt=0, description="Sample this many subsets per query when C(m, n) is larger."
    )
    mode: Literal["random", "random_filter", "screen", "screen_sharpen"] = Field(
        "screen_sharpen", description="SPOGW ablation: random, random+filter, screening, screening+sharpening."
    )
    eps_adv: float = Field(1e-6, gt=0, description="ε in (s - mean) / (std + ε).")
    adv_norm: Literal["batch", "query"] = Field("batch", description="two_level: normalise over batch or query.")
    agent_adv_stats: Literal["workflows", "agents"] = Field(
        "workflows", description="two_level: normalise agent advantages by the mean/std of all workflow scores "
        "(the proposal, §4.3 step 5) or of the agent rewards r_i.",
    )
    seed: int = Field(0, description="Seed of group sampling.")
    dedupe: bool = Field(False, description="Keep a query's groups with the same sharpened member set once.")
    max_kept_per_query: int | None = Field(
        None, gt=0, description="Cap of kept groups per query, any mode (slots go to next groups); null: none."
    )
    rwr_temperature: float = Field(
        0.4, gt=0, description="`weighted` rows (rwr): a workflow's weight is exp(reward / this) (W4S: 0.4); the "
        "reward is its score, or in refine rollouts RLAO's turn reward.",
    )
    pairs_per_query: int = Field(
        4, gt=0, description="`pair` rows (score_dpo): pairs drawn per query, with replacement, with probability "
        "proportional to (s_w - s_l)^pair_gap_power over the round's pairs with s_w > s_l (ScoreFlow).",
    )
    pair_gap_power: float = Field(3.0, gt=0, description="ScoreFlow's d(x) = x^p of a pair's score gap; its p is 3.")
    choice_credit: bool = Field(
        False, description="rollout.route_or_write: one group per query; the label token's advantage compares the "
        "designs (each design's mean score against the group's), the code tokens' compares rows of the same design; "
        "each term averaged over its own rows (pipeline.core.grpo.choice_credit).",
    )
    best_above: float = Field(
        0.0, ge=0, description="`best` rows (sft_best): a query's best workflow is kept when its score is above this "
        "(rejection sampling; 0: any workflow that scored).",
    )

    @model_validator(mode="after")
    def _sharpen_fits(self) -> CurationConfig:
        if 2 * self.t >= self.n:
            raise ValueError(f"needs 2*t < n, got t={self.t}, n={self.n}")
        return self


class TwoLevelLossConfig(_Strict):
    """The two-level loss (the proposal's L_GRPO, §4.3): an agent term and a workflow term, each averaged over
    its own sequences, summed with these weights; each term carries its level's β·KL."""

    agent_weight: float = Field(1.0, ge=0, description="Weight of the agent (plan) term; the proposal: 1.")
    workflow_weight: float = Field(1.0, ge=0, description="Weight of the workflow term; the proposal: 1.")
    agent_kl_mask: bool = Field(False, description="Agent KL only where A^A > 0 (mKL); the proposal's is unmasked.")
    workflow_kl_mask: bool = Field(False, description="Workflow KL only where A^W > 0; the proposal's is unmasked.")


class TrainingConfig(_Strict):
    objective: str = Field(
        "iogrpo_mkl", description="Loss, a name in the registry of pipeline.core.objectives: iogrpo_mkl (SPOGW), grpo "
        "(KL on every token), rwr (reward-weighted regression; W4S's RLAO on refine rollouts), score_dpo (ScoreFlow), "
        "sft_best (SFT on each query's best workflow), or any objective registered there.",
    )
    dpo_beta: float = Field(0.1, gt=0, description="score_dpo: β of the preference sigmoid (ScoreFlow / TRL: 0.1).")
    data_run: str | None = Field(
        None, description="Train on this run's curated round (same round) instead of this run's, starting from its "
        "previous checkpoint: `pipeline ablate` trains one round's data with several objectives this way.",
    )
    lora_r: int = Field(16, gt=0, description="LoRA rank.")
    lora_alpha: int = Field(32, gt=0, description="LoRA alpha.")
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout (also applied to a loaded adapter); above 0, π_θ (train mode) "
        "differs from π_old (eval mode) before any update: ρ ≠ 1 at step 1.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules LoRA adapts.",
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    epochs: int = Field(1, gt=0, description="Passes over the round's curated data.")
    micro_batch_size: int = Field(
        4, gt=0, description="Rows (group members) per micro-batch: an optimiser step trains micro_batch_size x "
        "grad_accum of them; the forward/backward passes that compute them are packed by micro_batch_tokens.",
    )
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimiser step.")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="Token positions (padding included; a shared prompt counted once) per forward/"
        "backward pass; default micro_batch_size x max_seq_len, the former worst case.",
    )
    step_order: Literal["groups", "rows"] = Field(
        "groups", description="Rows of a step: whole groups, a query's groups together (its passes share the prompt "
        "and the sequences in several groups), or shuffled rows (a group may span steps; no sharing across them).",
    )
    prompt_layout: Literal["split", "packed"] = Field(
        "split", description="A pass's layout: split (the prompts' keys and values once, then the completions "
        "attending to them; least memory) or packed (each prompt and its completions in one row under a 4D mask: "
        "one decoder call, no padding between completions; faster on CPU, attention memory quadratic in the row).",
    )
    shared_prefix_min: int = Field(
        32, ge=0, description="Prompts of a pass that differ but open alike (a template's fixed text, then the "
        "query): their common token prefix, from this many tokens, is computed once a pass, forward and backward, "
        "and each prompt computes only its rest (both layouts; packing counts it once); 0: each prompt whole.",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    beta: float = Field(0.1, ge=0, description="KL weight β.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip ε.")
    kl_mask: bool = Field(True, description="flat: apply KL only where the advantage is positive (SPOGW's mKL).")
    two_level: TwoLevelLossConfig = Field(
        default_factory=TwoLevelLossConfig, description="two_level rollouts: weights and KL masks of the two terms."
    )
    reference: Literal["previous", "base", "none"] = Field(
        "previous", description="KL reference: previous round's checkpoint, the base model, or no KL."
    )
    old_logprobs: Literal["recompute", "rollout", "auto"] = Field(
        "recompute", description="π_old: recomputed before the first update (ρ = 1 at step 1, one pass over the "
        "round's sequences), or the rollout's sampled-token log-probs (no pass; they differ by the engines' numerics, "
        "logged as logp_mismatch; needs generator.temperature 1 and top_p 1, where they are the model's own); auto: "
        "the rollout's where a local generator sampled in fp32 and training runs in fp32, else recompute.",
    )
    off_policy: Literal["is_clip", "luffy", "expected"] = Field(
        "is_clip", description="Logged rows (rollout.logged): is_clip = PPO's clipped ratio against the behaviour "
        "probability; luffy = LUFFY's p/(p + γ), unclipped; expected = the unclipped ratio, which over a complete "
        "design sweep is the exact expected gradient of the label (pipeline.core.grpo.OFF_POLICY_RULES).",
    )
    luffy_gamma: float = Field(0.1, gt=0, description="off_policy luffy: γ of p/(p + γ) (LUFFY: 0.1).")
    loss_norm: Literal["sequence", "token"] = Field(
        "sequence", description="Mean per sequence then over sequences, or over all tokens of the batch."
    )
    bf16: bool | Literal["auto"] = Field(
        "auto", description="bf16 autocast of the policy forward passes, frozen weights kept in bf16; auto: where "
        "the device computes bf16 natively (a CUDA GPU with bf16, a CPU with AMX/AVX512-BF16), else fp32.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory.")
    max_seq_len: int = Field(2048, gt=0, description="Prompt+completion tokens kept per sequence.")
    seed: int = Field(0, description="Training seed.")
    save_steps: int = Field(
        8, ge=0, description="Save the loop's progress every N optimiser steps, so that a killed train stage resumes "
        "there, not at step 0 (0: never; local stores only). Changes no result.", json_schema_extra=not_hashed("plan"))

    @field_validator("objective")
    @classmethod
    def _registered_objective(cls, v: str) -> str:
        # The registry's module imports torch (~3 s of CPU), which every CLI and stage process that opens a config
        # would pay, most of them for nothing: until something imports the registry (a training process; a
        # plugin registering its own loss), its names are the ones registered in its source.
        mod = sys.modules.get("pipeline.core.objectives")
        return registered(v, mod.OBJECTIVES if mod is not None else builtin_objectives(), "objective")


@cache
def builtin_objectives() -> tuple[str, ...]:
    """The names `@register_objective(...)` registers in pipeline/core/objectives.py, read from its source."""
    import ast

    tree = ast.parse((Path(__file__).parent / "core" / "objectives.py").read_text())
    return tuple(d.args[0].value for f in tree.body if isinstance(f, ast.FunctionDef) for d in f.decorator_list
                 if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register_objective")


def registered(name: str, registry: dict | tuple[str, ...], what: str) -> str:
    """`name` when a registry of pure functions holds it, else a ValueError naming what is registered."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; registered: {', '.join(registry)}")
    return name


class RouterConfig(_Strict):
    """`experiment.router`: the learned router, the per-part router and the per-query oracle over a menu of designs,
    composed from the designs' own runs (pipeline.studies.router)."""

    designs: list[str] = Field(
        default_factory=list, description="The designs routed among, each one of experiment.references; empty: "
        "rollout.example_menu as program:<file>.",
    )
    fit_split: Literal["train"] = Field("train", description="Split whose design runs the routers are fitted on.")
    fit_queries: int | None = Field(None, gt=0, description="The first N queries of fit_split; null: all.")
    c_grid: list[float] = Field(
        default_factory=lambda: [0.1, 1.0, 10.0], min_length=1,
        description="Inverse regularisation strengths of the logistic regressions tried on dev.",
    )
    analyzers: list[Annotated[str, StringConstraints(pattern=r"^(word|char_wb|hidden:\d+)$")]] = Field(
        default_factory=lambda: ["word", "char_wb"], min_length=1,
        description="Query features tried on dev: TF-IDF of word 1-2-grams (word) or of character 2-4-grams within "
        "words (char_wb), or hidden:<layer>, generator.model's own hidden states at that layer (0: the token "
        "embeddings), mean-pooled over the query: a probe (pipeline.engines.hidden).",
    )


CRITERION_RULES = ("above", "not_below", "share", "labels")  # pipeline.studies.verdict reads them


def criterion_test(text: str) -> str:
    """`<name>: <reference> <rule>` as written in experiment.criterion, else a ValueError naming what is wrong:
    `reference` a reference's label or best_fixed, `rule` above, not_below, share:<arm>:<fraction> or, against
    part_router only, labels:<parts>."""
    name, sep, rest = text.partition(":")
    words = rest.split()
    rule = words[-1] if len(words) == 2 else ""
    kind, *args = rule.split(":")
    shape = {"share": lambda: len(args) == 2 and args[0] != "" and _fraction(args[1]),
             "labels": lambda: len(args) == 1 and args[0].isdigit() and int(args[0]) > 0 and words[0] == "part_router"}
    ok = sep and name.strip() and len(words) == 2 and kind in CRITERION_RULES and shape.get(kind, lambda: not args)()
    if not ok:
        raise ValueError(f"experiment.criterion {text!r}: write `<name>: <reference> <rule>`, the reference a "
                         "reference's label or best_fixed, the rule above (the interval's lower end above 0), "
                         "not_below (its upper end at or above 0), share:<arm>:<fraction> (the mean difference at "
                         "least that fraction of <arm>'s mean minus the reference's), or `part_router labels:<k>` "
                         "(the policy's likeliest label scores on select_split at least as well as the per-part "
                         "router's pick on at least k parts; needs experiment.select_eval), e.g. "
                         "`a: best_fixed above`")
    return text


def _fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


class CriterionConfig(_Strict):
    """`experiment.criterion`: the success criterion, written before the held-out numbers exist; the summary reads the
    verdict from the paired differences (pipeline.studies.verdict)."""

    round: int | None = Field(None, ge=0, description="The trained round compared; null: the last.")
    metric: Literal["mean_at_l", "best_at_l"] = Field("mean_at_l", description="The held-out metric compared.")
    require: list[str] = Field(
        default_factory=list, description="Every one must hold: `<name>: <reference> <rule>`; reference a "
        "reference's label (program-<stem>, cot_sc, learned_router, part_router, oracle) or best_fixed "
        "(selection.same_budget, else any_budget); rule above (interval's lower end > 0), not_below (upper end "
        ">= 0), share:<arm>:<fraction>, or `part_router labels:<k>` (the likeliest label on at least k parts scores "
        "on select_split at least as well as the per-part router's pick: experiment.select_eval).",
    )
    stretch: list[str] = Field(default_factory=list, description="The stretch goal: one of these holding, written "
                               "as in require.")

    @field_validator("require", "stretch")
    @classmethod
    def _tests(cls, tests: list[str]) -> list[str]:
        return [criterion_test(t) for t in tests]


class ExperimentConfig(_Strict):
    """`pipeline experiment`: S seeds x R rounds, every checkpoint and the base model on a held-out split."""

    seeds: list[int] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1,
        description="One run `<run_id>-s<seed>` per seed; the seed sets generator, training and curation seeds.",
    )
    eval_split: Literal["validate", "dev", "test"] = Field(
        "test", description="Held-out split of the evaluations: test (reported) or dev (choices).",
    )
    eval_queries: int | None = Field(32, gt=0, description="Evaluate on the first N queries of that split.")
    eval_l: int = Field(4, gt=0, description="L: workflows sampled per held-out query (Mean@L, Best@L).")
    eval_temperature: float | None = Field(
        None, ge=0, description="Generator temperature of the evaluations (base and checkpoints alike); null: "
        "generator.temperature, the rollout's.",
    )
    eval_rounds: Literal["all", "last"] = Field(
        "last", description="Checkpoints evaluated besides the base model: the last (what the comparison uses), or "
        "all (the per-round curve; each adds an evaluation's executor cost).")
    bootstrap: int = Field(10000, gt=0, description="Bootstrap resamples of the paired differences.")
    ci_level: float = Field(0.95, gt=0, lt=1, description="Level of the bootstrap interval.")
    references: list[str] = Field(
        default_factory=list, description="Baselines (`pipeline baseline` methods, e.g. io, cot_sc, program:<file>) "
        "run after the seeds on the same held-out queries and L, reported with each round's paired difference to them.",
        json_schema_extra=not_hashed("plan"),
    )
    references_from: str | None = Field(
        None, description="Use the reference runs of this experiment run id (<id>-baseline-<method>, made by `pipeline "
        "baseline --run-id <id>`) instead of making them: experiments that differ only in training (e.g. the learning "
        "rate chosen on dev) share their references. Their benchmark and executor must be this config's.",
        json_schema_extra=not_hashed("plan"),
    )
    start_from: str | None = Field(
        None, description="Seed k's round 0 starts from experiment <id>'s seed k: the last round's checkpoint of run "
        "<id>-s<k> in this store (restored from its kept copy where gone) becomes generator.adapter, so it samples "
        "round 0, is its π_old and its KL reference; that seed must be trained first. Null: the base model.",
        json_schema_extra=not_hashed("plan"),
    )
    base_from: str | None = Field(
        None, description="Pair seed k with experiment <id>'s base-model evaluation of seed k (<id>-s<k>-eval-base) "
        "instead of evaluating the base model again: arms of one study that start from one base model share its "
        "samples. That evaluation must be finished and made with this experiment's evaluation settings.",
        json_schema_extra=not_hashed("plan"),
    )
    select_split: Literal["dev"] | None = Field(
        None, description="Also run every reference on this split and name the best fixed workflow by it: the highest "
        "Mean@L there, at the trained generator's executor budget and at any (test is never used to choose).",
        json_schema_extra=not_hashed("plan"),
    )
    select_queries: int | None = Field(None, gt=0, description="The first N queries of select_split; null: all.",
                                       json_schema_extra=not_hashed("plan"))
    select_references: list[str] | None = Field(
        None, description="The references that also run on select_split, the candidates for the best fixed workflow "
        "(null: every reference), e.g. the menu's designs where the criterion names the best single design, so that "
        "a reference far above the generator's executor budget (CoT-SC) is not run there.",
        json_schema_extra=not_hashed("plan"),
    )
    select_eval: bool = Field(
        False, description="Also evaluate each seed's last round on select_split (its first select_queries queries, "
        "L = eval_l): the arm chosen on dev, and the policy's labels per part against the per-part router's picks.",
        json_schema_extra=not_hashed("plan"),
    )
    budget_slack: float = Field(
        0.25, ge=0, description="A reference is at the trained generator's budget when its held-out executor tokens "
        "per query are at most (1 + slack) x those of the last evaluated round (mean over seeds).",
        json_schema_extra=not_hashed("plan"),
    )
    shared_base: bool = Field(
        False, description="Evaluate the base model once (the first seed's run and sampling seed) and pair every seed "
        "with it: one evaluation less per extra seed, but the base's sampling noise is not resampled across seeds.",
        json_schema_extra=not_hashed("plan"),
    )
    common_random_numbers: bool = Field(
        True, description="Evaluation and reference runs seed their executor calls (executor.common_random_numbers), "
        "so paired arms share the executor's noise; false: unseeded, to measure what that buys.",
        json_schema_extra=not_hashed("plan"),
    )
    criterion: CriterionConfig | None = Field(
        None, description="The success criterion the summary's verdict reads (round, metric, the comparisons that "
        "must hold and the stretch goal); null: no verdict.",
        json_schema_extra=not_hashed("plan"),
    )
    router: RouterConfig | None = Field(
        None, description="Routers over the menu's designs as references (a generator that chooses its design is "
        "measured against them): the designs also run on router.fit_split; needs select_split. Null: none.",
        json_schema_extra=not_hashed("plan"),
    )

    @model_validator(mode="after")
    def _router_needs_dev(self) -> ExperimentConfig:
        if self.router is not None and self.select_split is None:
            raise ValueError("experiment.router chooses its settings on dev: set experiment.select_split: dev")
        if self.select_eval and self.select_split is None:
            raise ValueError("experiment.select_eval evaluates on select_split: set experiment.select_split: dev")
        if self.base_from is not None and self.shared_base:
            raise ValueError("experiment.base_from borrows every seed's base evaluation; experiment.shared_base "
                             "evaluates the first seed's: set one of the two")
        if self.select_references is not None:
            if self.select_split is None:
                raise ValueError("experiment.select_references run on select_split: set experiment.select_split: dev")
            if stray := [m for m in self.select_references if m not in self.references]:
                raise ValueError(f"experiment.select_references: {', '.join(stray)} not among experiment.references")
        labels = [t for t in (self.criterion.require + self.criterion.stretch if self.criterion else [])
                  if t.split()[-1].startswith("labels:")]
        if labels and not (self.select_eval and self.router is not None):
            raise ValueError(f"experiment.criterion {labels[0]!r} reads the policy's labels on select_split against "
                             "the per-part router: set experiment.select_eval: true and experiment.router")
        return self


class SMCConfig(_Strict):
    """`pipeline smc`: BayesFlow's SMC workflow sampler (pipeline.studies.smc), with the paper's parameter names."""

    N: int = Field(4, gt=0, description="Particles (partial workflows) per query; also L of the final workflows.")
    K: int = Field(2, gt=0, description="Look-ahead rollouts per particle and step.")
    T: int = Field(3, gt=0, description="Steps (`# Step <n>:` chunks) built one at a time.")
    beta: float = Field(1.0, ge=0, description="Particle weight (1/K) sum_k exp(beta R); the paper's is 1.")
    reward: Literal["consistency", "oracle"] = Field(
        "consistency", description="R of a rollout: agreement of its answer with the step's other rollouts (no "
        "gold answer); oracle: the benchmark metric (reads the gold answer: analysis only).",
    )
    seed: int = Field(0, description="Seed of the resampling draws.")
    resample: bool = Field(
        True, description="false: plain sampling of N complete workflows from the same prompt (no steps, runs or "
        "weights), SMC's comparison at an executor budget.",
    )


class HeadroomConfig(_Strict):
    """`pipeline headroom`: every design of the menu as a fixed program on dev, the best single design against the
    cross-fitted per-query oracle over designs at its executor budget and against a router fitted on other queries
    (the learnable room, which the gate reads: pipeline.studies.headroom)."""

    designs: list[str] = Field(
        default_factory=list, description="The designs: baseline methods (io, cot, ..., program:<file>); empty: "
        "rollout.example_menu, each as program:<file>.",
    )
    queries: int | None = Field(None, gt=0, description="The first N queries of the split; null: all of them.")
    reps: int = Field(2, ge=2, description="Runs of every design on every query (the oracle is chosen on one run and "
                      "scored on another, so at least 2).")
    gate: float = Field(0.05, ge=0, description="A task goes on to training only where the learned router, fitted "
                        "on other query folds, beats the best single design chosen on them by at least this much.")
    folds: int = Field(5, ge=2, description="Query folds of the learnable room: the router is fitted on all but one "
                       "and scored on that one (fewer where there are fewer queries); its setting is chosen among "
                       "experiment.router's c_grid and analyzers inside the fit folds.")
    budget_rule: str = Field(
        "greedy", description="How the oracle keeps to the best design's executor budget "
        "(pipeline.core.headroom.BUDGET_RULES): greedy (the best per-query picks, then the cheapest trades until "
        "the mean fits) or per_query (per query only designs no dearer than the best design there).",
    )

    @field_validator("budget_rule")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        from pipeline.core.headroom import BUDGET_RULES

        return registered(v, BUDGET_RULES, "budget rule")


class ComputeConfig(_Strict):
    """What a run computes: the sections of a run's YAML file that its stages read, hashed into every stage manifest
    but for the fields marked `not_hashed`."""

    run_id: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run name (a folder).")
    rounds: int = Field(3, gt=0, description="Rounds of rollout -> score -> curate -> train.")
    store: StoreConfig = Field(default_factory=StoreConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    curation: CurationConfig = Field(default_factory=CurationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)

    @model_validator(mode="after")
    def _scoring_concurrency(self) -> ComputeConfig:
        if self.scoring.concurrency is None:
            self.scoring.concurrency = self.executor.concurrency if self.executor.kind == "openai" else 2
        return self

    @model_validator(mode="after")
    def _rollout_logprobs(self) -> ComputeConfig:
        # stored log-probs are of the sampling distribution (pipeline.engines.generation.base); π_θ is the model's
        g = self.generator
        if self.training.old_logprobs == "rollout" and (g.temperature != 1.0 or g.top_p != 1.0):
            raise ValueError(f"training.old_logprobs: rollout needs generator.temperature 1 and top_p 1 (got "
                             f"{g.temperature} and {g.top_p}): otherwise the rollout's log-probs are not the "
                             "policy's; use recompute")
        if (self.rollout.logged or self.rollout.m == 0) and self.training.old_logprobs != "recompute":
            raise ValueError("rollout.logged rows carry the behaviour policy's log-probs, not π_old's: set "
                             "training.old_logprobs: recompute")
        return self

    @model_validator(mode="after")
    def _choice_credit_needs_route_or_write(self) -> ComputeConfig:
        if self.curation.choice_credit and not self.rollout.route_or_write:
            raise ValueError("curation.choice_credit splits the label's credit from the code's: it needs "
                             "rollout.route_or_write (the label is then a commitment to what runs)")
        if self.curation.choice_credit and self.training.objective not in ("iogrpo_mkl", "grpo"):
            raise ValueError(f"curation.choice_credit writes group rows of two levels (choice, code), which "
                             f"training.objective {self.training.objective!r} does not read; use iogrpo_mkl or grpo")
        return self


class StudyConfig(_Strict):
    """The studies planned over a run: the sections of a run's YAML file that `pipeline experiment`, `pipeline smc`,
    `pipeline headroom` and the trackers read. Each is hashed or not by its own mark, not by being here: `smc` is
    hashed, as it is what the rollout of a `<run>-smc` run computes."""

    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig, json_schema_extra=not_hashed("study"))
    smc: SMCConfig = Field(default_factory=SMCConfig)
    headroom: HeadroomConfig = Field(default_factory=HeadroomConfig, json_schema_extra=not_hashed("plan"))
    tracking: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers the run's figures also go to (TRL's `report_to` names; [] or none: only "
        "the store): training curves per optimiser step, rollout and scoring figures per round, held-out "
        "evaluations. tensorboard: event files in <store>/<run_id>/tensorboard/; mlflow: a local file store "
        "<store>/mlruns (needs `pip install -e .[mlflow]`). Rewritten from the store after each round and "
        "evaluation (pipeline.studies.tracking), so it never holds a number the store does not.",
        json_schema_extra=not_hashed("study"),
    )

    @field_validator("tracking", mode="before")
    @classmethod
    def _tracking_names(cls, v: Any) -> Any:
        # TRL's report_to also takes one name or "none"; duplicates would write the same figures twice
        if v is None or v == "none":
            return []
        v = [v] if isinstance(v, str) else v
        return list(dict.fromkeys(v)) if isinstance(v, list) else v


class RunConfig(StudyConfig, ComputeConfig):  # bases in this order: ComputeConfig's sections come first
    """A run's YAML file (and its frozen `<store>/<run_id>/config.yaml`): what the run computes (`ComputeConfig`)
    and the studies planned over it (`StudyConfig`), each top-level section read into the part that declares it.
    Readers keep `cfg.experiment` and `cfg.training` alike; `cfg.study` is the study part alone."""

    @property
    def study(self) -> StudyConfig:
        """The study sections of this config (the same objects, not copies)."""
        return StudyConfig.model_construct(**{name: getattr(self, name) for name in StudyConfig.model_fields})

    def config_hash(self) -> str:
        """Fingerprint of what the stages compute, kept in every stage manifest. Fields at their default value
        are left out, so a field added to the schema later (at its default) keeps existing runs' manifests valid
        instead of re-running every finished stage; so are the fields and sections marked `not_hashed` (plans,
        draws, trackers: `not_hashed_paths()`), and `_legacy_hash_form` hashes a saved config as it was hashed when
        it was frozen."""
        body = _legacy_hash_form(self, self.model_dump(mode="json", exclude_defaults=True,
                                                       exclude=_hash_exclude(type(self))))
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {path}: {msg}" + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" else ""))
    return "\n".join(lines)


def load_yaml(text: str) -> Any:
    """YAML text as Python data, read by libyaml's parser where PyYAML was built with it and the same safe resolver
    (the types are resolved in Python either way): about ten times the pure-Python parser's speed, and a study reads
    its runs' frozen configs hundreds of times."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _parse_value(raw: str) -> Any:
    """`--set` values are YAML scalars/lists: `3`, `0.1`, `true`, `null`, `[a, b]`, plain strings. An empty value
    (`key=`) is the empty string: YAML would read it as null, and null must be asked for by name."""
    if not raw.strip():
        return raw
    try:
        return load_yaml(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict, sets: list[str]) -> dict:
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {p} is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(raw)
    return data


def with_changes(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """A typed copy of `cfg` with `changes` (dotted field path -> value, e.g. {"training.lr": 2e-4}) applied and
    validated: how a study makes a variant of its config (a seed, an arm, a swept learning rate)."""
    data = json.loads(cfg.model_dump_json())
    for key, value in changes.items():
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # a section left out (None), e.g. generator.serve
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = value
    return config_from_dict(data, "a study's variant")


def as_sets(changes: dict[str, Any]) -> list[str]:
    """`changes` (dotted path -> value) as `--set` text, where a variant crosses a process boundary (a stage's
    child process, a Prefect parameter, a frozen run's overrides): each value in YAML flow style, which
    `apply_overrides` reads back as the same value (a float stays a float, the string "true" a string)."""
    out = []
    for key, value in changes.items():
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
        out.append(f"{key}={text.removesuffix('...').strip()}")
    return out


def variant_sets(changes: dict[str, Any] | None, before: list[str] | None = None,
                 after: list[str] | None = None) -> list[str]:
    """A study's typed variant as the overrides a process boundary takes (`open_run`, a stage's call or child
    process, a Prefect parameter): `changes` as `--set` text (`as_sets`) between the user's own `--set` text that it
    changes (`before`, a study's CONFIG --set) and the user's text that has the last word (`after`)."""
    return [*(before or []), *as_sets(changes or {}), *(after or [])]


def config_from_dict(data: dict, source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path) if isinstance(path, str) else path  # a store's UPath (s3://) reads as it is
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def load_config(path: str | Path, sets: list[str] | None = None) -> RunConfig:
    data = apply_overrides(read_yaml(path), sets or [])
    return config_from_dict(data, str(path))


# ---- What the hash leaves out: the fields marked `not_hashed` --------------------------------------------------------


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (`ServeConfig | None` and a model named before its class is defined
    included), else None."""
    kinds = [globals().get(a.__forward_arg__) if isinstance(a, ForwardRef) else a
             for a in (get_args(annotation) or (annotation,))]
    found = [a for a in kinds if isinstance(a, type) and issubclass(a, BaseModel)]
    return found[0] if found else None


def _mark(field: Any) -> NotHashed | None:
    """The `not_hashed` kind a field is marked with, else None."""
    extra = field.json_schema_extra
    return extra.get(_NOT_HASHED) if isinstance(extra, dict) else None


@cache
def _marks(model: type[BaseModel], prefix: str = "") -> tuple[tuple[str, NotHashed], ...]:
    out: list[tuple[str, NotHashed]] = []
    for name, f in model.model_fields.items():
        if (kind := _mark(f)) is not None:
            out.append((prefix + name, kind))
        if (sub := _sub_model(f.annotation)) is not None:
            out.extend(_marks(sub, f"{prefix}{name}."))
    return tuple(out)


def not_hashed_paths(model: type[BaseModel] | None = None) -> dict[str, NotHashed]:
    """The dotted path and kind of every field and section marked `not_hashed` (RunConfig's by default); a marked
    section is listed as itself, and its fields marked otherwise besides."""
    return dict(_marks(model or RunConfig))


@cache
def _hash_exclude(model: type[BaseModel]) -> dict[str, Any]:
    """model_dump's `exclude` of the config hash: the marked fields and sections."""
    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        if _mark(f) is not None:
            out[name] = True
        elif (sub := _sub_model(f.annotation)) is not None and (inner := _hash_exclude(sub)):
            out[name] = inner
    return out


PLAN_ONLY = frozenset(p for p, kind in not_hashed_paths().items() if kind == "plan")
DRAW_ONLY = frozenset(p for p, kind in not_hashed_paths().items() if kind == "draw")


def diff_configs(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted paths whose values differ, the fields and sections marked `not_hashed` but for `study` left out (used
    to refuse silently resuming a run with another config)."""
    out: list[str] = []
    free = {path for path, kind in _marks(type(old)) if kind != "study"}  # PLAN_ONLY | DRAW_ONLY for a RunConfig

    def walk(old_value: Any, new_value: Any, prefix: str) -> None:
        if prefix in free:
            return
        if isinstance(old_value, dict) and isinstance(new_value, dict):
            for k in sorted(set(old_value) | set(new_value)):
                walk(old_value.get(k), new_value.get(k), f"{prefix}.{k}" if prefix else k)
        elif old_value != new_value:
            out.append(prefix)

    walk(json.loads(old.model_dump_json()), json.loads(new.model_dump_json()), "")
    return out


# ---- Upgrades of saved configs ------------------------------------------------------------------------------------


def upgrade_saved(model: type[BaseModel], data: Any) -> Any:
    """A section's raw values as an older version saved them, in today's fields. Every saved config must still
    validate and hash to what its stage manifests recorded (`<store>/<run>/config.yaml` holds every field), so each
    change of the schema that would break one is undone here or in `_legacy_hash_form`, and nowhere else:

    Reading (each section's values before validation, run by `_Strict` for every section and `--set`):
    - `benchmark.validate_fraction` (the non-test share) became `test_share` = 1 - it; both given must agree.
    - `rollout.exemplars` was a bool before it named a kind: true showed bucket exemplars (`buckets`), false none.
    - `rollout.menu_choice` did not exist while every menu sample's design was drawn by a hash: a saved config (it
      spells `menu_seed` out) or one opening with the drawn design's lines (`menu_prefix_lines`) with a menu and
      no `menu_choice` is `drawn`.
    - `benchmark.one_split_per_text` did not exist while every item was split by its id alone: a saved benchmark
      section (it spells out every field of then, `SAVED_BENCHMARK_FIELDS`) without it reads as false.

    Hashing (`RunConfig.config_hash` through `_legacy_hash_form`):
    - `_FORMER_DEFAULTS`: fields whose default changed after runs were frozen are hashed against their former
      default (a saved config spells the old default out; hashing it as a non-default would re-run every stage).
    - `rollout.exemplars: none` is hashed as `false`, the bool it was.
    - `rollout.menu_choice`: hashed only as `policy` with a menu (`drawn`, or no menu, as before the field).
    """
    if not isinstance(data, dict):
        return data
    name = model.__name__
    if name == "BenchmarkConfig" and "validate_fraction" in data:
        data = dict(data)
        former = data.pop("validate_fraction")
        if not isinstance(former, int | float) or not 0 < former < 1:
            raise ValueError(f"validate_fraction (now 1 - test_share) must be in (0, 1), got {former!r}")
        if "test_share" in data and abs(data["test_share"] + former - 1) > 1e-9:
            raise ValueError(f"validate_fraction {former} and test_share {data['test_share']} disagree; "
                             "give test_share only")
        data.setdefault("test_share", 1 - former)
    if name == "BenchmarkConfig" and "one_split_per_text" not in data and set(data) >= SAVED_BENCHMARK_FIELDS:
        data = {**data, "one_split_per_text": False}  # a section saved before the field: split by item id alone
    if name == "RolloutConfig" and isinstance(data.get("exemplars"), bool):
        data = {**data, "exemplars": "buckets" if data["exemplars"] else "none"}
    if name == "RolloutConfig" and "menu_choice" not in data and data.get("example_menu") and (
            data.get("menu_prefix_lines") is not None or "menu_seed" in data):
        data = {**data, "menu_choice": "drawn"}  # a menu before the policy chose: each sample's design was drawn
    return data


# Fields whose default changed after runs were frozen, with the default they had: hashed against it, so the
# finished stages of those runs stay finished (a saved config holds every field, the old default included).
# The fields a saved benchmark section has spelt out since the first frozen config (to_yaml writes every field), and a
# config a person writes does not (the hub id and the levels of a procedural task): such a section without
# `one_split_per_text` was saved before it existed.
SAVED_BENCHMARK_FIELDS = frozenset({"name", "path", "hub_id", "tasks", "size", "levels", "split_seed", "train_split",
                                    "max_queries"})

_FORMER_DEFAULTS = {("benchmark", "one_split_per_text"): False,
                    ("training", "lora_dropout"): 0.05, ("executor", "concurrency"): 8, ("scoring", "concurrency"): 2,
                    ("generator", "dtype"): "float32", ("training", "bf16"): False,
                    ("generator", "serve", "dtype"): "bfloat16", ("executor", "serve", "dtype"): "bfloat16"}


def _legacy_hash_form(cfg: RunConfig, body: dict) -> dict:
    """`body` (the non-default fields) as the config hash saw it before the changes above."""
    for (*parents, key), former in _FORMER_DEFAULTS.items():
        owners: list[Any] = [cfg]
        for name in parents:
            owners.append(getattr(owners[-1], name))
        if owners[-1] is None:  # an optional section (serve) that is not set
            continue
        value, chain = getattr(owners[-1], key), [body]
        for name in parents:
            chain.append(chain[-1].setdefault(name, {}))
        if value == former:
            chain[-1].pop(key, None)
        else:
            chain[-1][key] = value
        # a section left at its defaults was not in the dump then; an optional one that is set (`serve: {}`) was
        for i in range(len(parents) - 1, -1, -1):
            optional = type(owners[i]).model_fields[parents[i]].default is None
            if not chain[i][parents[i]] and not optional:
                del chain[i][parents[i]]
    if body.get("rollout", {}).get("exemplars") == "none":
        body["rollout"]["exemplars"] = False  # the field was a bool: `false` then
    # menu_choice: `drawn` was the only way before the field, so it hashes as its absence; `policy` is spelt out
    # wherever there is a menu, so that a policy run never hashes as a drawn one
    if cfg.rollout.example_menu and cfg.rollout.menu_choice == "policy":
        body.setdefault("rollout", {})["menu_choice"] = "policy"
    elif "menu_choice" in body.get("rollout", {}):
        del body["rollout"]["menu_choice"]
        if not body["rollout"]:
            del body["rollout"]
    return body


# ---- The reference (docs/config.md) -----------------------------------------------------------------------------


def _default_text(field: Any) -> str:
    if field.is_required():
        return "(required)"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return "`" + json.dumps(value, ensure_ascii=False) + "`"


def config_reference() -> str:
    """docs/config.md: every field of RunConfig under its section's heading, a table of field, default and help
    (the field's description, and its `not_hashed` mark), as TRL documents GRPOConfig. tests/test_config.py checks
    the file matches."""
    study = ", ".join(f"`{name}`" for name in StudyConfig.model_fields)
    out = ["# Config reference", "",
           "Every field of a run's config (`pipeline/config.py`), by section: its default and what it does. Generated "
           "by `pipeline.config.config_reference()`; `tests/test_config.py` checks this file matches it.", "",
           f"One file holds both parts of a run's config: the studies planned over the run ({study}: `StudyConfig`) "
           "and what the run computes (the other sections: `ComputeConfig`). Every field is in the config hash, "
           "which each stage manifest records, unless it or its section is marked *not hashed* below, by kind:", "",
           *(f"- *{kind}*: {text}." for kind, text in NOT_HASHED_KINDS.items()), ""]

    def section(model: type[BaseModel], path: str, mark: str | None) -> None:
        leaves, subs = [], []
        for name, field in model.model_fields.items():
            sub = _sub_model(field.annotation)
            (subs if sub else leaves).append((name, field, sub))
        out.extend([f"## {path or 'Run'}", ""])
        doc = (model.__doc__ or "").strip() if model.__doc__ != BaseModel.__doc__ else ""
        if mark:
            doc = f"*Not hashed ({mark}): the whole section.* {doc}".strip()
        if doc:
            out.extend([" ".join(doc.split()), ""])
        if leaves:
            out.extend(["| field | default | help |", "|---|---|---|"])
            for name, field, _ in leaves:
                desc = " ".join((field.description or "").split()).replace("|", "\\|")
                if (kind := _mark(field)) is not None:
                    desc += f" *Not hashed ({kind}).*"
                out.append(f"| `{path + '.' if path else ''}{name}` | {_default_text(field)} | {desc} |")
            out.append("")
        for name, field, sub in subs:
            section(sub, f"{path}.{name}" if path else name, _mark(field))

    section(RunConfig, "", None)
    return "\n".join(out).rstrip("\n") + "\n"
