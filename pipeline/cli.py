"""The `pipeline` command: stages, studies, inspection, set-up (the panels of --help); `bench` measures speed.

Each option is defined once below and means the same on every command; the work is pipeline.api's (the Python door
notebooks use too). Heavy libraries load inside commands so `--help` and `validate` stay instant.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pipeline.config import ConfigError, load_config

if TYPE_CHECKING:  # the commands import what they run inside themselves: `pipeline --help` stays fast
    from pipeline.studies.summaries import AblationSummary, EvalSummary, ExperimentSummary, MethodsSummary

app = typer.Typer(help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks that print numbers (ratios against a baseline in the same run).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

STAGES, STUDIES, INSPECT, SETUP = "Stages", "Studies", "Inspection", "Set-up"  # --help panels

ConfigArg = Annotated[Path | None, typer.Argument(help="Run config YAML (optional for an existing --run-id).")]
RunIdOpt = Annotated[str | None, typer.Option("--run-id", help="Run id (default: the config's run_id); a study's and "
                                              "a derived run's ids are made from it.")]
RoundOpt = Annotated[int | None, typer.Option("--round", help="Round index k (0: the first round; where a checkpoint "
                                              "is read, -1: the base model).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: --set rollout.m=4 (repeatable).")]
StoreOpt = Annotated[str | None, typer.Option("--store", help="Store root (default: the run config's store.root, "
                                              "without a config data/runs).")]
SplitOpt = Annotated[str, typer.Option("--split", help="Queries of this split: test, dev, train or validate "
                                       "(= train + dev).")]
RetriesOpt = Annotated[int, typer.Option("--retries", help="Retries of a transiently failing stage.")]
SeedsOpt = Annotated[int | None, typer.Option("--seeds", help="Seeds 0..N-1 (default: experiment.seeds).")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Write the output here (sql: the result as .csv, .json "
                                            "or .parquet; report: the HTML, default <store>/<run_id>/report.html).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the result dict here as JSON.")]
StatusOpt = Annotated[bool, typer.Option("--status", help="Run nothing: print every run of the study in the store, "
                                         "its stages done, and the time left estimated from the stages of its kind "
                                         "already done.")]
WaitOpt = Annotated[bool, typer.Option("--wait", help="Another process running the same stage of the run (or the "
                                      "same run's rounds): wait for it, then skip what it finished, instead of "
                                      "stopping with an error that names it.")]
ShardsOpt = Annotated[int, typer.Option("--shards", min=1, help="Score each round as N shards split by query "
                                        "(docs/scale-out.md, Sharded scoring); the result is the same for any N.")]


def _fail(msg: str) -> None:
    typer.secho(msg, fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _command() -> str:
    """This command line as typed, for a study's summary."""
    import shlex

    return "pipeline " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Debug logging.")] = False) -> None:
    from pipeline import LOG_FORMAT  # not the runner's imports (the store, DuckDB): `bench train` runs without them

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    from pipeline.engines.neighbours import job

    job()  # this command's stages and servers are one job: their engines are not each other's neighbours


@app.command(rich_help_panel=SETUP)
def validate(config: Path, sets: SetOpt = None) -> None:
    """Check a config and its task before any compute: the rows, split sizes and label mix, then every row's
    reference answer scored by the task's scorer (anything below 1.0 is a scorer or mapping bug, named with its
    row; identical errors grouped with a count; a scorer failing the same way on its first
    benchmark.scorer_stop_after calls is called no more), then how much of the first training prompts a training pass
    computes once (their common token prefix; the generator's tokenizer, no model). No model is loaded. Exits non-zero
    on any problem."""
    from pipeline.engines.benchmarks import BenchmarkError, load_benchmark
    from pipeline.engines.benchmarks.tasks import check_task, problem_lines
    from pipeline.engines.servers import ServeError, check_served

    try:
        cfg = load_config(config, sets or [])
        bench = load_benchmark(cfg.benchmark)
        query_count = len(bench.items())
        check_served(cfg)  # served sections: vLLM, the model and the port
        check = check_task(bench)
    except (ConfigError, BenchmarkError, ServeError) as e:
        _fail(str(e))
    typer.echo(f"task {check.name}: {check.rows} rows, scorer {check.scorer}")
    typer.echo("splits: " + ", ".join(f"{k} {v}" for k, v in check.splits.items())
               + f" (benchmark.train_split {cfg.benchmark.train_split}: {query_count} queries a round)")
    if check.labels:
        typer.echo("labels: " + ", ".join(f"{label} {count}" for label, count in check.labels.items()))
    if check.note:
        typer.echo(check.note)
    if check.problems:
        skipped = f"; {check.not_scored} not scored" if check.not_scored else ""
        typer.secho(f"{check.failed} of {check.checked} reference answers do not score 1.0 with the scorer{skipped}:",
                    fg=typer.colors.RED, err=True)
        for line in problem_lines(check.problems):  # identical messages grouped, with a count and the first rows
            typer.secho(f"  {line}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.echo(f"references: {check.checked} of {check.checked} score 1.0" if check.checked else
               "references: none scored")
    _echo_prompt_sharing(cfg, bench)
    typer.echo(f"{config}: ok (run_id={cfg.run_id}, {query_count} {cfg.benchmark.name} queries, "
               f"mode={cfg.rollout.mode}, generator={cfg.generator.model} via {cfg.generator.backend}, "
               f"executor={cfg.executor.kind})")


def _echo_prompt_sharing(cfg, bench) -> None:
    """The token prefix the first training prompts share (a training pass computes it once,
    training.shared_prefix_min), against their mean length; says so where the template puts the query first."""
    from pipeline.api import prompt_sharing

    try:
        sharing = prompt_sharing(cfg, bench)
    except Exception as e:  # a hub model out of reach, a prompt folder without a template: the rest still checks
        typer.echo(f"prompt sharing: not measured ({type(e).__name__}: {e})")
        return
    if sharing is None:
        typer.echo(f"prompt sharing: not measured (`pipeline prepare-model {cfg.generator.model}` first)")
        return
    if not sharing.prompts:
        return
    min_prefix = cfg.training.shared_prefix_min
    typer.echo(f"prompt sharing: the first {sharing.prompts} training prompts open with the same {sharing.common} "
               f"tokens of {sharing.mean:.0f} on average ({sharing.share:.0%}); a pass that holds several of them "
               f"computes those once (training.shared_prefix_min {min_prefix})")
    if sharing.query_first(min_prefix):
        typer.secho(f"prompt sharing: the template puts the query (or another per-query part) before most of its "
                    f"fixed text: only {sharing.common} of {sharing.mean:.0f} tokens can be computed once a pass; "
                    "put $problem after the fixed parts (contract, designs, examples) to share them",
                    fg=typer.colors.YELLOW)


@app.command(rich_help_panel=SETUP)
def tasks(config: Annotated[Path | None, typer.Argument(help="Run config YAML: its task as configured (the others "
                                                           "with their defaults).")] = None,
          sets: SetOpt = None) -> None:
    """List the installed tasks (entry-point group workflow_grpo.tasks: the shipped benchmarks, `file` and any
    plugin's): name, size, scorer and where each comes from."""
    from pipeline.engines.benchmarks.tasks import list_tasks

    try:
        bench_cfg = load_config(config, sets or []).benchmark if config is not None else None
    except ConfigError as e:
        _fail(str(e))
    rows = list_tasks(bench_cfg)
    width = max(len(r.name) for r in rows)
    for r in rows:
        size = f"{r.size} items" if r.size is not None else "-"
        typer.echo(f"{r.name:<{width}}  {size:>10}  {r.scorer:<22}  {r.source}" + (f"  [{r.note}]" if r.note else ""))


@app.command("prepare-model", rich_help_panel=SETUP)
def prepare_model(
    ref: Annotated[str, typer.Argument(help="Embedded model ref.")] = "embedded:smollm2-135m-instruct",
    force: Annotated[bool, typer.Option(help="Rebuild even if cached.")] = False,
) -> None:
    """Convert the embedded GGUF model into a cached HF folder (once; $PIPELINE_CACHE_DIR overrides)."""
    from pipeline.engines.models import ModelError, prepare_embedded

    if not ref.startswith("embedded:"):
        _fail(f"{ref}: only embedded:<name> refs need preparing")
    try:
        path = prepare_embedded(ref.split(":", 1)[1], force=force)
    except ModelError as e:
        _fail(str(e))
    typer.echo(str(path))


@app.command(rich_help_panel=SETUP)
def chat(
    prompt: str,
    model: Annotated[str, typer.Option(help="Model ref.")] = "embedded:smollm2-135m-instruct",
    max_new_tokens: Annotated[int, typer.Option(help="Completion cap.")] = 64,
) -> None:
    """One greedy chat turn with a model (a smoke test of the embedded model)."""
    from pipeline.engines.models import load_causal_lm, load_tokenizer

    tok, lm = load_tokenizer(model), load_causal_lm(model)
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True).to(lm.device)
    out = lm.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    typer.echo(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())


def _stage(stage: str, config, run_id, round, sets, store, only_failed: bool = False, shards: int = 1,
           wait: bool = False) -> None:
    """One stage in this process (pipeline.api.run_stage); a failure is printed as `round K STAGE: reason`
    (another process running the stage too: named, unless `wait`)."""
    from pipeline import api
    from pipeline.stages.runner import StageError

    try:
        res = api.run_stage(stage, config, run_id, round, sets or [], store, only_failed, shards, wait)
    except (ConfigError, StageError) as e:
        _fail(str(e))
    typer.echo({**res.counts, "skipped": True} if res.skipped else res.counts)


@app.command(rich_help_panel=STAGES)
def rollout(config: ConfigArg = None, run_id: RunIdOpt = None, round: RoundOpt = 0, sets: SetOpt = None,
            store: StoreOpt = None, wait: WaitOpt = False) -> None:
    """Sample agent plans / workflows for a round and write `generations` (resumes per query slot)."""
    _stage("rollout", config, run_id, round, sets, store, wait=wait)


@app.command(rich_help_panel=STAGES)
def score(
    config: ConfigArg = None, run_id: RunIdOpt = None, round: RoundOpt = 0, sets: SetOpt = None,
    store: StoreOpt = None, wait: WaitOpt = False,
    only_failed: Annotated[bool, typer.Option("--only-failed", help="Re-run transient failures, and the runs whose "
                                              "task scorer failed (status error), only.")] = False,
    shards: ShardsOpt = 1,
) -> None:
    """Run each workflow of a round in the sandbox and write `scores` (idempotent)."""
    _stage("score", config, run_id, round, sets, store, only_failed, shards, wait)


@app.command(rich_help_panel=STAGES)
def curate(config: ConfigArg = None, run_id: RunIdOpt = None, round: RoundOpt = 0, sets: SetOpt = None,
           store: StoreOpt = None, wait: WaitOpt = False) -> None:
    """Build group-wise training data (screening, sharpening, advantages) into `groups`."""
    _stage("curate", config, run_id, round, sets, store, wait=wait)


@app.command(rich_help_panel=STAGES)
def train(config: ConfigArg = None, run_id: RunIdOpt = None, round: RoundOpt = 0, sets: SetOpt = None,
          store: StoreOpt = None, wait: WaitOpt = False) -> None:
    """LoRA GRPO with advantage-masked KL on the round's groups; writes the round's checkpoint."""
    _stage("train", config, run_id, round, sets, store, wait=wait)


@app.command("import", rich_help_panel=SETUP)
def import_(
    path: Annotated[Path, typer.Argument(help="Rollouts (JSONL, a JSON array or Parquet): query_id, text, "
                                         "prompt_token_ids, token_ids, token_logprobs, score (docs/offline.md).")],
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
) -> None:
    """Import rollouts logged elsewhere as a new run of the store (--run-id, required); a config trains on them via
    rollout.logged."""
    from pipeline import api

    if run_id is None:
        _fail("pipeline import: name the new run that holds the rows with --run-id")
    try:
        count = api.import_rollouts(path, run_id, store)
    except (OSError, ValueError) as e:
        _fail(str(e))
    typer.echo(f"imported {count} rows as run {run_id}; train on them with rollout.logged: [{{run: {run_id}}}]")


@app.command(rich_help_panel=INSPECT)
def sql(
    query: Annotated[str | None, typer.Argument(help="SQL to run; none: an interactive shell.")] = None,
    store: StoreOpt = None,
    out: OutOpt = None,
    limit: Annotated[int, typer.Option(help="Rows printed.")] = 50,
) -> None:
    """SQL over the store's views (queries, generations, scores, latest_scores, groups, ...). Without a
    query: a shell reading `;`-terminated statements until `.quit` or end of input."""
    import duckdb

    from pipeline import api

    opened = api.open_store(store)
    if query is None:
        if not opened.remote:  # catalog.duckdb is local-only; the shell below loads the views itself
            opened.refresh_catalog()
        return _sql_shell(opened, limit)
    try:
        result = opened.sql(query)
    except duckdb.Error as e:
        _fail(f"SQL error: {e}")
    if not opened.remote:
        opened.refresh_catalog()
    if out is not None:
        writers = {".csv": result.write_csv, ".json": result.write_json, ".parquet": result.write_parquet}
        if out.suffix not in writers:
            _fail(f"--out {out}: use .csv, .json or .parquet")
        writers[out.suffix](out)
        typer.echo(f"wrote {result.height} rows to {out}")
        return
    _print_df(result, limit)


def _print_df(rows, limit: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(caption=f"{rows.height} rows")
    for name in rows.columns:  # folded, not cut with an ellipsis: run ids and numbers stay readable whole
        table.add_column(name, overflow="fold")
    for row in rows.head(limit).iter_rows():
        table.add_row(*("" if v is None else str(v)[:80] for v in row))
    Console().print(table)


def _sql_shell(store, limit: int) -> None:
    """The SQL shell of `pipeline sql` with no query: one connection with the store's views (refreshed at
    start), a SQL error costs that statement only. Works without the `duckdb` CLI."""
    import duckdb

    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        from pipeline.store.schema import TABLES

        typer.echo(f"store {store.root}: views {', '.join([*TABLES, 'latest_scores'])}. End statements with ';', "
                   ".quit to leave.")
    con, buf = store.connect(), ""
    try:
        while True:
            try:
                line = input(("sql> " if not buf else "...> ") if tty else "")
            except EOFError:
                break
            if not buf and line.strip() in (".quit", ".exit", "\\q"):
                break
            buf += line + "\n"
            if buf.strip() and buf.rstrip().endswith(";"):
                _shell_statement(con, buf, limit, duckdb.Error)
                buf = ""
        if buf.strip():  # a last statement without ';' at end of input
            _shell_statement(con, buf, limit, duckdb.Error)
    finally:
        con.close()


def _shell_statement(con, stmt: str, limit: int, error: type[Exception]) -> None:
    import polars as pl

    try:
        rel = con.sql(stmt)
    except error as e:
        typer.secho(f"SQL error: {e}", fg=typer.colors.RED, err=True)
        return
    _print_df(rel.pl() if rel is not None else pl.DataFrame(), limit)



@bench_app.command("store")
def bench_store(
    rows: Annotated[int, typer.Option(help="Synthetic generations rows.")] = 1_000_000,
    root: Annotated[Path | None, typer.Option(help="Scratch store root (default: a temp dir).")] = None,
) -> None:
    """Write N synthetic `generations` rows, then time an aggregate SQL over them."""
    from pipeline.perf.store import main

    main(rows, root)


@bench_app.command("dtype")
def bench_dtype(
    refresh: Annotated[bool, typer.Option(help="Measure again instead of reading this machine's cached verdict.")]
    = True,
) -> None:
    """fp32 and bf16 matrix-product rates on this machine and the dtype `auto` picks (pipeline.engines.hardware)."""
    from pipeline.engines.hardware import PROBE_SHAPE, local_device, probe

    verdict = probe(local_device(), refresh=refresh)
    m, k, n = PROBE_SHAPE
    typer.echo(f"device: {verdict.device} ({verdict.machine}); probe: {m}x{k} @ {k}x{n}, one thread")
    if verdict.fp32_gflops is not None:
        typer.echo(f"fp32 {verdict.fp32_gflops:.1f} GFLOP/s, bf16 {verdict.bf16_gflops:.1f} GFLOP/s (bf16/fp32 = "
                   f"{verdict.bf16_gflops / verdict.fp32_gflops:.2f})")
    typer.echo(f"auto -> {'bfloat16' if verdict.native_bf16 else 'float32'}: {verdict.reason}")


@bench_app.command("sandbox")
def bench_sandbox() -> None:
    """Per-workflow sandbox overhead vs a bare `python -c pass`, and throughput at concurrency 2."""
    from pipeline.perf.sandbox import main

    main()


@bench_app.command("rollout")
def bench_rollout(
    backends: Annotated[str, typer.Option(help="Comma list of backends to measure.")] = "transformers,vllm,openai",
    prompts: Annotated[int, typer.Option(help="Rendered workflow prompts per call.")] = 8,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 2,
    max_new_tokens: Annotated[int, typer.Option(help="Completion cap.")] = 64,
    reps: Annotated[int, typer.Option(help="Timed runs of each side (best is kept).")] = 2,
    openai_url: Annotated[str | None, typer.Option(help="A running OpenAI-compatible server's /v1 URL.")] = None,
) -> None:
    """Generation tokens/s of each available backend against its raw engine on the same prompts."""
    from pipeline.perf.rollout import main

    main(backends, prompts, n, max_new_tokens, reps, openai_url)


@bench_app.command("curate")
def bench_curate() -> None:
    """Curation over 10,000 queries x m=16."""
    from pipeline.perf.curate import main

    main()


@bench_app.command("train")
def bench_train(
    arch: Annotated[str | None, typer.Option(help="Built-in architecture with seeded random weights, from its config "
                                             "(qwen2-1.5b, qwen2-0.5b, tiny); default: the embedded 135M model.")]
    = None,
    batch: Annotated[int, typer.Option(min=1, help="Sequences per step.")] = 8,
    completion_len: Annotated[int | None, typer.Option(min=1, help="Longest completion (default 512 on CUDA, "
                                                       "128 on CPU); completions are ragged below it.")] = None,
    prompt_len: Annotated[int | None, typer.Option(min=1, help="Random prompt ids per sequence (default: chat-template "
                                                   "prompts on the embedded model, 256 with --arch).")] = None,
    group_size: Annotated[int | None, typer.Option(min=1, help="Consecutive sequences sharing a prompt (default: the "
                                                   "batch, one GRPO group).")] = None,
    sweep: Annotated[bool, typer.Option(help="Instead: the shared-prompt saving against prompt length and group "
                                        "size (embedded model, ours only).")] = False,
    reps: Annotated[int, typer.Option(min=1, help="Timed steps per side (median), after one warm-up.")] = 3,
    gradient_checkpointing: Annotated[bool, typer.Option(help="Checkpoint the decoder layers (both sides).")] = False,
    weights_dtype: Annotated[str, typer.Option(help="float32 (the trainer's fp32 master weights) or bfloat16.")]
    = "float32",
    prompt_layout: Annotated[str, typer.Option(help="Ours: split (the prompts, then the completions over their "
                                               "cache) or packed (one decoder call), as training.prompt_layout.")]
    = "split",
    compile_decoder: Annotated[bool, typer.Option("--compile", help="torch.compile the decoder (both sides call it; "
                                                  "the first step, a warm-up, compiles).")] = False,
    json_out: JsonOpt = None,
) -> None:
    """Training-step tokens/s against TRL's GRPO loss + backward on the same model and batch (CUDA: bf16 autocast,
    peak memory and MFU)."""
    from pipeline.perf.train import TrlMissing, run
    from pipeline.perf.train import sweep as run_sweep

    if sweep:
        run_sweep(batch=batch, completion_len=completion_len or 64, reps=reps, echo=typer.echo)
        return
    try:
        run(arch, batch, completion_len, reps, prompt_len, gradient_checkpointing, weights_dtype, json_out,
            echo=typer.echo, group_size=group_size, prompt_layout=prompt_layout, compile_decoder=compile_decoder)
    except (TrlMissing, ValueError) as e:
        _fail(str(e))


@bench_app.command("train-prefix")
def bench_train_prefix(
    config: Annotated[Path, typer.Argument(help="Run config whose prompts are rendered.")]
    = Path("configs/mixed-choice.yaml"),
    model: Annotated[str, typer.Option(help="Model (and tokenizer) of the step, fp32.")]
    = "embedded:smollm2-135m-instruct",
    queries: Annotated[str, typer.Option(help="Comma list: queries in one pass.")] = "1,4",
    per_query: Annotated[int, typer.Option(min=1, help="Completions per query (a group's members).")] = 2,
    completion_len: Annotated[int, typer.Option(min=2, help="Longest completion; ragged below it.")] = 85,
    reps: Annotated[int, typer.Option(min=1, help="Timed runs per side (median), after one warm-up.")] = 2,
    min_prefix: Annotated[int, typer.Option(min=1, help="training.shared_prefix_min of the new side.")] = 32,
    layout: Annotated[str, typer.Option(help="split, packed, or both (comma list).")] = "split,packed",
    json_out: JsonOpt = None,
) -> None:
    """The shared-prefix saving on a config's own prompts: a training step and a no-grad forward over one pass of
    its first training queries (random completions), each prompt whole (before) against their common prefix computed
    once (training.shared_prefix_min)."""
    import json

    from pipeline.perf.train import prefix

    rows = prefix(config, model, tuple(_ints(queries)), per_query, completion_len, reps, min_prefix,
                  tuple(x.strip() for x in layout.split(",")), echo=typer.echo)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(rows, indent=1) + "\n")


@bench_app.command("prefix-cache")
def bench_prefix_cache(
    config: Annotated[Path, typer.Option(help="Run config whose rollout prompts are sampled (its prompt folder, menu "
                                         "and benchmark).")] = Path("configs/mixed-choice.yaml"),
    model: Annotated[str, typer.Option(help="Generator model ref.")] = "embedded:smollm2-135m-instruct",
    prompts: Annotated[int, typer.Option(min=1, help="Queries (prompts) in the call.")] = 8,
    n: Annotated[int, typer.Option(min=1, help="Samples per prompt.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Completion cap.")] = 32,
    reps: Annotated[int, typer.Option(min=1, help="Timed calls per side (best kept), after one warm-up.")] = 2,
    block_size: Annotated[int | None, typer.Option(min=1, help="Also an engine with this KV block size (tokens; "
                                                   "a multiple of 32 on CPU), beside vLLM's default.")] = None,
) -> None:
    """One rollout-like vLLM call (prompts sharing a long opening, n samples each) with prefix caching on and off:
    wall time and the cache's hit rate of each."""
    from pipeline.engines.generation import GenerationError
    from pipeline.perf.prefix_cache import main

    try:
        main(config, model, prompts, n, max_new_tokens, reps, block_size=block_size, echo=typer.echo)
    except (ConfigError, GenerationError) as e:
        _fail(str(e))


@bench_app.command("choice-rollout")
def bench_choice_rollout(
    config: Annotated[Path, typer.Option(help="Run config with rollout.choice_step (its menu, prompts and "
                                         "benchmark).")] = Path("configs/mixed-route.yaml"),
    queries: Annotated[int, typer.Option(min=1, help="Training queries sampled.")] = 36,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Queries a label batch (default: the config's).")]
    = None,
    sets: SetOpt = None,
) -> None:
    """A round's rollout under the design step twice on the same queries: the workflows after the labels written one
    call a batch, then across batches (`Sampler.write_after`): wall, CPU seconds and whether the rows agree."""
    from pipeline.engines.generation import GenerationError
    from pipeline.perf.choice_rollout import main

    try:
        main(config, queries, batch_size, sets, echo=typer.echo)
    except (ConfigError, GenerationError) as e:
        _fail(str(e))


@bench_app.command("stages")
def bench_stages(
    run_id: Annotated[str, typer.Argument(help="The run (an experiment's seed: <experiment>-s<k>).")],
    evaluations: Annotated[bool, typer.Option(help="With its evaluation runs (<run>-eval-*).")] = True,
    store: StoreOpt = None,
    against: Annotated[str | None, typer.Option(help="Another store holding the same run (a baseline on the same "
                                                "machine): both seconds and the ratio per stage.")] = None,
) -> None:
    """Where a run's wall time went: per round and stage the seconds and share, from its timings.jsonl (a seed's
    evaluations included); with --against, beside the same run in another store, as ratios."""
    from pipeline.perf.stages import main

    try:
        main(run_id, store or "data/runs", evaluations, echo=typer.echo, against=against)
    except ValueError as e:
        _fail(str(e))


@bench_app.command("train-parity")
def bench_train_parity(
    arch: Annotated[str, typer.Option(help="Built-in architecture with seeded random weights (qwen2-0.5b: the "
                                      "generator's; qwen2-1.5b, tiny).")] = "qwen2-0.5b",
    sides: Annotated[str, typer.Option(help="device:precision list; the first is the reference the others are "
                                       "compared with.")] = "cpu:fp32,cuda:fp32,cuda:bf16",
    batch: Annotated[int, typer.Option(min=2, help="Sequences (half with a positive advantage).")] = 8,
    prompt_len: Annotated[int, typer.Option(min=1, help="Random prompt ids per sequence.")] = 128,
    completion_len: Annotated[int, typer.Option(min=1, help="Longest completion; ragged below it.")] = 128,
    steps: Annotated[int, typer.Option(min=1, help="AdamW steps per side.")] = 3,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-4,
    json_out: JsonOpt = None,
) -> None:
    """The train step on each device and precision against the first side (CPU fp32) on one random-weight model, LoRA
    init and batch: log-probs, losses, the gradient and the update's effect."""
    from pipeline.perf.train_parity import parse_sides, run

    try:
        run(arch, parse_sides(sides), batch, prompt_len, completion_len, steps, lr, json_out, echo=typer.echo)
    except ValueError as e:
        _fail(str(e))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@bench_app.command("executor")
def bench_executor(
    config: Annotated[Path, typer.Argument(help="Run config YAML with `executor.serve` (its server is started).")],
    problems: Annotated[int, typer.Option(min=1, help="Development problems, one request / workflow each.")] = 24,
    concurrency: Annotated[str, typer.Option(help="Plain client: requests in flight, comma list.")] = "2,4,8,16,32",
    scoring: Annotated[str, typer.Option(help="Score stage: scoring.concurrency values, comma list.")] = "8,16",
    program: Annotated[Path | None, typer.Option(help="Workflow scored (default: the code prompt's example).")]
    = None,
    sets: SetOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Executor tokens/s during the score stage against the same server driven by a plain concurrent client."""
    from pipeline.perf.executor import main

    try:
        main(str(config), sets or [], problems, _ints(concurrency), _ints(scoring), program, json_out)
    except ConfigError as e:
        _fail(str(e))


def _named(values: list[str], what: str) -> dict[str, str]:
    """NAME=VALUE options as a dict (in order)."""
    out = {}
    for v in values:
        name, sep, value = v.partition("=")
        if not sep or not name or not value:
            raise typer.BadParameter(f"{what}: expected NAME=VALUE, got {v!r}")
        out[name] = value
    return out


@bench_app.command("crn")
def bench_crn(
    arms: Annotated[list[str], typer.Option("--arm", help="NAME=RUN_ID: an evaluation run, or a training run (its "
                                                         "round 0's workflows) (repeatable).")],
    out: Annotated[Path, typer.Option(help="Scratch store of the re-scored copies, and crn.json.")],
    pairs: Annotated[list[str] | None, typer.Option("--pair", help="A-B: a paired difference of two arms "
                                                                   "(repeatable; none: the score variance only).")]
    = None,
    queries: Annotated[int | None, typer.Option(min=1, help="The first N queries every arm has (default all); "
                                                            "more than --out holds: only the new ones are scored.")]
    = None,
    store: StoreOpt = None,
    sets: SetOpt = None,
) -> None:
    """Re-score stored runs' workflows (the arms, in --store) without and with common random numbers (the same calls:
    the same budget) and print each pair's interval half-width both ways, and each arm's share of queries with score
    variance."""
    from pipeline.perf.crn import run_crn_bench

    named = _named(arms, "--arm")
    if bad := [n for n in named if "-" in n]:
        raise typer.BadParameter(f"--arm names may not hold '-' (it joins a --pair): {bad}")
    split = [tuple(p.split("-", 1)) for p in pairs or []]
    if any(len(p) != 2 for p in split):
        raise typer.BadParameter(f"--pair: expected A-B, got {pairs}")
    try:
        result = run_crn_bench(store or "data/runs", named, split, out, queries, sets or [])
    except ConfigError as e:
        _fail(str(e))
    for line in result.lines():
        typer.echo(line)
    typer.echo(f"written: {out / 'crn.json'}")


@bench_app.command("seed")
def bench_seed(
    config: Annotated[Path, typer.Argument(help="Experiment config YAML; its first seed is run per variant.")],
    out: Annotated[Path, typer.Option(help="One store per variant below it, and seed-bench.json.")]
    = Path("data/bench-seed"),
    variants: Annotated[str, typer.Option(help="Comma list of before, after, after_seeded_training (before: the "
                                          "baseline of every ratio).")] = "before,after",
    retries: RetriesOpt = 2,
    sets: SetOpt = None,
) -> None:
    """One seed of an experiment before the executor cache (no cache, no common random numbers, every round
    evaluated) and after (the defaults), one after the other, each in a store of its own: wall time per part and
    stage, cache hits, the ratio (the cache's goal: at most 0.4x) and the machine of every timing. Resumes."""
    from pipeline.perf.seed import run_seed_bench
    from pipeline.stages.rounds import direct_call
    from pipeline.stages.runner import RetryPolicy, StageError

    try:
        result = run_seed_bench(config, out, direct_call(RetryPolicy(retries)),
                                [v.strip() for v in variants.split(",") if v.strip()], sets or [])
    except (ConfigError, StageError, ValueError) as e:
        _fail(str(e))
    for line in result.lines():
        typer.echo(line)
    typer.echo(f"written: {out / 'seed-bench.json'}")


@app.command("run", rich_help_panel=STAGES)
def run_cmd(
    config: Annotated[Path, typer.Argument(help="Run config YAML.")],
    run_id: RunIdOpt = None,
    rounds: Annotated[int | None, typer.Option("--rounds", help="Rounds (default: the config's).")] = None,
    retries: RetriesOpt = 2,
    sets: SetOpt = None, shards: ShardsOpt = 1, wait: WaitOpt = False,
) -> None:
    """All rounds without a Prefect server (same skip/resume/retry rules as the iterate flow); --shards N scores
    each round as N child processes at once."""
    from pipeline import api
    from pipeline.engines.servers import ServeError
    from pipeline.stages.runner import StageError
    from pipeline.store import LeaseHeld
    from pipeline.studies.formatting import num

    try:
        summary = api.run(config, rounds, run_id, retries, sets or [], shards, wait)
    except (ConfigError, StageError, ServeError, LeaseHeld) as e:
        _fail(str(e))
    for r in summary.rounds:
        typer.echo(f"round {r.round}: mean score {num(r.mean_score)}, stage wall s {r.wall_s}")
    typer.echo(f"report: {api.report(summary.run_id, summary.store, pages=False).report}")


@app.command(rich_help_panel=STUDIES)
def experiment(
    config: Annotated[Path, typer.Argument(help="Run config YAML (its `experiment` section).")],
    seeds: SeedsOpt = None,
    run_id: RunIdOpt = None,
    retries: RetriesOpt = 2,
    sets: SetOpt = None,
    only_seed: Annotated[list[int] | None, typer.Option(
        "--only-seed", help="Run only this seed of the plan, no reference (repeatable): seeds in parallel processes "
                            "on one store; a last run without it adds the references and the whole report.")] = None,
    only_references: Annotated[bool, typer.Option(
        "--only-references", help="Run no seed, only the references (on the held-out split and on "
                                  "experiment.select_split); the report holds the seeds already in the store.")
    ] = False,
    show_status: StatusOpt = False,
    show_report: Annotated[bool, typer.Option(
        "--report", help="Run nothing: rewrite the summary from the runs in the store (no model, no executor: the "
                         "references, the routers' picks, the verdict) and print the results page's tables.")] = False,
) -> None:
    """Train S seeds x R rounds, evaluate the base model and every checkpoint on held-out queries, and print
    the paired difference with its bootstrap interval (results under <store>/experiments/<run_id>/)."""
    from pipeline import api
    from pipeline.stages.runner import StageError
    from pipeline.store import LeaseHeld

    if show_status:
        try:
            rows = api.study_status("experiment", config, run_id, sets or [], seeds=seeds)
            stored = api.experiment_summary(config, run_id, sets or [])
        except (ConfigError, ValueError) as e:
            _fail(str(e))
        _echo_status(rows)
        if stored is not None:  # what the summary last written holds: references, routers' picks, verdict
            typer.echo("summary as last written:")
            for line in stored.results_lines():
                typer.echo(line)
        return
    if show_report:
        try:
            stored = api.experiment_summary(config, run_id, sets or [], rewrite=True)
        except (ConfigError, ValueError) as e:
            _fail(str(e))
        typer.echo(stored.markdown())
        typer.echo(f"results: {stored.results}")
        return
    try:
        summary = api.run_study("experiment", config, retries, seeds=seeds, run_id=run_id, sets=sets or [],
                                command=_command(), only_seeds=only_seed, only_references=only_references)
    except (ConfigError, StageError, ValueError, LeaseHeld) as e:
        _fail(str(e))
    _echo_experiment(summary)
    _echo_done(summary)


@app.command(rich_help_panel=STUDIES)
def ablate(
    config: Annotated[Path, typer.Argument(help="Run config YAML (`experiment` sets seeds and evaluation).")],
    objectives: Annotated[str | None, typer.Option(
        "--objectives", help="Comma-separated objectives, the first is the reference arm (default: all registered)."
    )] = None,
    seeds: SeedsOpt = None,
    round: RoundOpt = 0,
    run_id: RunIdOpt = None,
    retries: RetriesOpt = 2,
    sets: SetOpt = None,
) -> None:
    """Train one round's curated data with several objectives (training.objective) and compare their held-out
    evaluations with paired bootstrap intervals (results under <store>/experiments/<run_id>-ablation/); --round is
    the round whose curated data every objective trains on."""
    from pipeline import api
    from pipeline.stages.runner import StageError

    names = [o.strip() for o in objectives.split(",") if o.strip()] if objectives else None
    try:
        summary = api.run_study("ablation", config, retries, objectives=names, seeds=seeds, round=round,
                                run_id=run_id, sets=sets or [], command=_command())
    except (ConfigError, StageError, ValueError) as e:
        _fail(str(e))
    typer.echo(summary.table())
    _echo_done(summary)


@app.command("compare-methods", rich_help_panel=STUDIES)
def compare_methods(
    config: Annotated[Path, typer.Argument(help="Run config YAML: the task, base model and `experiment` (seeds, "
                                                "held-out split, queries, L).")],
    methods: Annotated[str | None, typer.Option(
        "--methods", help="Comma-separated methods (default: all registered: spogw, two_level, w4s, scoreflow, "
        "flowreasoner, smc, task_best; docs/methods.md)."
    )] = None,
    seeds: SeedsOpt = None,
    run_id: RunIdOpt = None,
    lr_sweep: Annotated[str | None, typer.Option(
        "--lr-sweep", help="Comma-separated learning rates: each trained method trains one seed one round per rate, "
        "evaluated on the dev split; the best dev Mean@L is its training.lr."
    )] = None,
    arm_sets: Annotated[list[str] | None, typer.Option(
        "--arm-set", help="One method's override: --arm-set w4s:training.lr=5e-4 (repeatable)."
    )] = None,
    retries: RetriesOpt = 2,
    sets: SetOpt = None,
    show_status: StatusOpt = False,
) -> None:
    """Train each method (S seeds x R rounds, same base model and training queries) and compare their held-out
    evaluations with the base model and SPOGW, paired intervals over seeds then queries (results under
    <store>/experiments/<run_id>-methods/)."""
    from pipeline import api
    from pipeline.stages.runner import StageError
    from pipeline.studies.methods import parse_arm_sets

    names = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    try:
        lrs = [float(x) for x in lr_sweep.split(",") if x.strip()] if lr_sweep else None
    except ValueError:
        _fail(f"--lr-sweep {lr_sweep!r}: expected comma-separated learning rates, e.g. 1e-4,2e-4,5e-4")
    if show_status:
        try:
            rows = api.study_status("methods", config, run_id, sets or [], methods=names, seeds=seeds,
                                    arm_sets=parse_arm_sets(arm_sets), lr_sweep=lrs)
        except (ConfigError, ValueError) as e:
            _fail(str(e))
        _echo_status(rows)
        return
    try:
        summary = api.run_study("methods", config, retries, methods=names, seeds=seeds, run_id=run_id,
                                sets=sets or [], arm_sets=parse_arm_sets(arm_sets), lr_sweep=lrs, command=_command())
    except (ConfigError, StageError, ValueError) as e:
        _fail(str(e))
    typer.echo(summary.table())
    _echo_done(summary)


def _echo_status(rows: list[dict]) -> None:
    """A study's `--status`: one line a run, then the stages left and the time they need by those done so far."""
    from pipeline.engines.hardware import machine
    from pipeline.studies.experiment import status_table, time_left, timing_machines

    _print_df(status_table(rows), len(rows))
    here = machine()
    left, unknown, elsewhere = time_left(rows, here)
    todo = sum(not r["done"] for r in rows)
    typer.echo(f"{todo} of {len(rows)} stages left" + (f": about {left / 60:.0f} min by the stages done so far"
                                                       if todo else "")
               + (f", {unknown} of them without an estimate (none of their kind done yet)" if unknown else ""))
    if elsewhere:
        typer.echo(f"{elsewhere} of the stages left are estimated from stages other machines took (this one, {here}, "
                   "has timed none of their kind); the rest with an estimate from this machine's")
    if machines := timing_machines(rows):
        typer.echo("timed on: " + "; ".join(f"{m}: {n} stages" for m, n in machines.items()))


def _echo_done(summary: ExperimentSummary | AblationSummary | MethodsSummary) -> None:
    """A study's last line."""
    typer.echo(f"wall time {summary.wall_s:.0f} s; results: {summary.results}")


def _echo_experiment(summary: ExperimentSummary) -> None:
    """Every evaluation of an ExperimentSummary, one line each, then its headline."""
    for line in [a.line() for a in summary.arms] + summary.headline():
        typer.echo(line)


@app.command(rich_help_panel=INSPECT)
def report(
    run_id: Annotated[str, typer.Argument(help="Run id.")],
    store: StoreOpt = None,
    out: OutOpt = None,
    round: RoundOpt = None,
    query: Annotated[str | None, typer.Option("--query", help="The per-query page of this query id.")] = None,
) -> None:
    """HTML report of a run (per-round plots, summary table) or of an experiment (paired held-out comparison);
    prints its numbers. Also writes per-query pages (browse/: each workflow's code, status, score, usage, group
    and advantage; for an experiment the base model's and the trained round's workflows side by side). --round:
    the per-query pages of that round only."""
    from pipeline import api

    try:
        result = api.report(run_id, store, out, round, query)
    except FileNotFoundError as e:
        _fail(str(e))
    for line in result.lines:
        typer.echo(line)
    typer.echo(f"report: {result.report}")
    if result.kind == "experiment":
        typer.echo(f"queries: {result.pages}" if result.pages else f"queries: none ({result.pages_missing})")
    else:
        typer.echo(f"queries: {result.pages}" if result.pages else f"queries: none yet ({result.pages_missing})")


@app.command(rich_help_panel=INSPECT)
def track(run_id: Annotated[str, typer.Argument(help="Run id.")], store: StoreOpt = None) -> None:
    """Rewrite a run's tracker output (its config's `tracking`: TensorBoard events, MLflow) from the store, e.g.
    for a run made before tracking existed; `pipeline run` and the flows do it after every round."""
    from pipeline import api
    from pipeline.studies.tracking import TrackingError

    try:
        out = api.track(run_id, store)
    except TrackingError as e:
        _fail(str(e))
    for tracker, where in out.items():
        typer.echo(f"{tracker}: {where}")
    if not out:
        typer.echo(f"run {run_id} has tracking: [] (nothing to write)")


@app.command(rich_help_panel=STUDIES)
def baseline(
    config: Annotated[Path, typer.Argument(help="Run config YAML: its benchmark, executor and experiment section.")],
    methods: Annotated[list[str] | None, typer.Option("--method", help="io, cot, cot_sc, self_review, "
                                                      "ensemble_select, pot, task_best (repeatable).")] = None,
    run_id: RunIdOpt = None,
    split: SplitOpt = "test",
    candidates: Annotated[list[str] | None, typer.Option(
        "--candidates", help="task_best: runs whose round-0 workflows are candidates too (repeatable).")] = None,
    max_candidates: Annotated[int, typer.Option(help="task_best: at most this many workflows of --candidates.")] = 16,
    programs: Annotated[list[Path] | None, typer.Option(
        "--program", help="A hand-written workflow file run on every query (repeatable); FILE?K=2 sets the "
        "file's module-level constant K.")] = None,
    sets: SetOpt = None,
) -> None:
    """Run baselines (fixed programs) on the held-out queries through the same sandbox, executor and score stage
    as generated workflows, each in the derived run <run_id>-baseline-<method>; prints Mean@L / Best@L /
    Majority@L and tokens per query."""
    from pipeline import api
    from pipeline.engines.servers import ServeError
    from pipeline.stages.runner import StageError

    def echo(summ: EvalSummary) -> None:
        typer.echo(summ.line())
        for task, win in (summ.selected or {}).items():
            typer.echo(f"  task {task}: {win['label']} (mean {win['mean_score']:.3f} on {win['queries']} selection "
                       f"queries, run {summ.selection_run})")

    try:
        api.baselines(config, [*(methods or []), *(f"program:{p}" for p in programs or [])], run_id, split,
                      sets or [], candidates or [], max_candidates, on_result=echo)
    except (ConfigError, ServeError, StageError) as e:
        _fail(str(e))


@app.command(rich_help_panel=STUDIES)
def headroom(
    config: Annotated[Path, typer.Argument(help="Run config YAML: its menu (rollout.example_menu or "
                                           "headroom.designs), benchmark, executor and headroom section.")],
    split: SplitOpt = "dev",
    reps: Annotated[int | None, typer.Option("--reps", help="Runs per design and query (default headroom.reps, 2).")]
    = None,
    run_id: RunIdOpt = None,
    sets: SetOpt = None,
    show_status: StatusOpt = False,
) -> None:
    """Headroom before training: every design of the menu as a fixed program on dev, the best single
    design against the cross-fitted per-query oracle at its executor budget, the frontier; writes
    <store>/headroom/<run_id>/ (headroom.json, designs.csv, per_query.csv, frontier.png) and prints the gate."""
    from pipeline import api
    from pipeline.engines.servers import ServeError
    from pipeline.stages.runner import StageError
    from pipeline.studies.headroom import markdown

    if show_status:
        try:
            rows = api.study_status("headroom", config, run_id, sets or [], split=split, reps=reps)
        except (ConfigError, ValueError) as e:
            _fail(str(e))
        _echo_status(rows)
        return
    try:
        summ = api.headroom(config, split, reps, run_id, sets or [])
    except (ConfigError, StageError, ServeError) as e:
        _fail(str(e))
    for line in markdown(summ):
        typer.echo(line)
    typer.echo(f"results: {summ.results}")


@app.command(rich_help_panel=STUDIES)
def smc(
    config: Annotated[Path, typer.Argument(help="Run config YAML: generator, executor, smc, experiment.")],
    run_id: RunIdOpt = None,
    split: SplitOpt = "test",
    sets: SetOpt = None,
    plain_l: Annotated[int | None, typer.Option("--plain-l", hidden=True)] = None,
) -> None:
    """BayesFlow's SMC workflow sampler (N particles, K look-ahead rollouts, T steps; smc.* in the config) on the
    held-out queries, in the derived run <run_id>-smc; prints Mean@L / Best@L / Majority@L (L = N), tokens and
    workflow runs per query. Plain sampling to compare with at a budget is `pipeline sample CONFIG --l L`."""
    from pipeline import api
    from pipeline.stages.runner import StageError

    if plain_l is not None:  # one command per job: plain sampling is `sample`'s
        _fail(f"smc --plain-l is `pipeline sample {config} --l {plain_l}` (the same run <run_id>-plain-l{plain_l})")
    try:
        summ = api.smc(config, run_id, split, sets or [])
    except (ConfigError, StageError) as e:
        _fail(str(e))
    typer.echo(summ.line(f"workflow runs/query {summ.workflow_runs_per_query:.1f}"))


@app.command(rich_help_panel=STUDIES)
def sample(
    config: Annotated[Path, typer.Argument(help="Run config YAML: generator, executor, experiment.")],
    L: Annotated[int, typer.Option("--l", help="Workflows sampled per held-out query.")],
    run_id: RunIdOpt = None,
    split: SplitOpt = "test",
    sets: SetOpt = None,
) -> None:
    """Plain sampling, in the derived run <run_id>-plain-l<L>: the configured generator writes L workflows per
    held-out query (rollout and score stages; with rollout.repair_attempts, self-repair too); prints Mean@L / Best@L /
    Majority@L and tokens per query (to compare with `smc` at an executor budget)."""
    from pipeline import api
    from pipeline.stages.runner import StageError

    try:
        summ = api.sample(config, L, run_id, split, sets or [])
    except (ConfigError, StageError) as e:
        _fail(str(e))
    typer.echo(summ.line())


@app.command(rich_help_panel=INSPECT)
def compare(
    run_ids: Annotated[list[str], typer.Argument(help="Runs whose round 0 holds workflows (evaluations, baselines, "
                                                 "SMC).")],
    store: StoreOpt = None,
) -> None:
    """One Markdown table of Mean@L / Best@L / Majority@L and tokens per query, one row per run."""
    from pipeline import api

    try:
        res = api.compare(run_ids, store)
    except ConfigError as e:
        _fail(str(e))
    typer.echo(res.markdown())
    if not res.same_queries:
        typer.secho("warning: the runs do not hold the same queries", fg=typer.colors.YELLOW, err=True)


@app.command(rich_help_panel=STUDIES)
def arms(
    experiments: Annotated[list[str], typer.Argument(help="Experiment run ids on one task (the arms), each with its "
                                                     "summary in the store.")],
    seed: Annotated[int, typer.Option(help="The seed whose dev evaluation the rule reads.")] = 0,
    store: StoreOpt = None,
) -> None:
    """The arm a verdict reads, chosen on dev: the highest Mean@L of one seed's last round on the selection split
    (experiment.select_eval), read from the experiments' summaries, with that arm's verdict; written under
    <store>/experiments/arms/."""
    from pipeline import api

    try:
        choice = api.choose_arm(experiments, store, seed)
    except ValueError as e:
        _fail(str(e))
    for line in choice.lines():
        typer.echo(line)
    typer.echo(choice.markdown())
    typer.echo(f"written: {choice.written}")


@app.command(rich_help_panel=STUDIES)
def evaluate(
    run_id: Annotated[str, typer.Argument(help="The trained run.")],
    round: RoundOpt,
    split: SplitOpt = "test",
    store: StoreOpt = None,
    sets: SetOpt = None,
) -> None:
    """Roll out and score a round's checkpoint (--round -1: the base model) on a split, in the derived run
    <run_id>-eval-r<k>."""
    from pipeline import api
    from pipeline.stages.runner import StageError

    try:
        summ = api.evaluate(run_id, round, split, store, sets or [])
    except (ConfigError, StageError) as e:
        _fail(str(e))
    _echo_evaluation(summ)


@app.command("evaluate-adapter", rich_help_panel=STUDIES)
def evaluate_adapter(
    folder: Annotated[Path, typer.Argument(help="A kept adapter folder (<store>/adapters/<run>-r<k>/: the LoRA files "
                                                "and its run's config.yaml).")],
    split: SplitOpt = "test",
    store: StoreOpt = None,
    sets: SetOpt = None,
) -> None:
    """Roll out and score a kept adapter on a split as its experiment evaluated it, in the derived run
    <folder name>-eval (a hash of --set added); new problems: the --set of its README.md (procedural: a
    benchmark.split_seed benchmark.size further on)."""
    from pipeline import api
    from pipeline.stages.runner import StageError

    try:
        summ = api.evaluate_adapter(folder, split, store, sets or [])
    except (ConfigError, StageError) as e:
        _fail(str(e))
    _echo_evaluation(summ)


def _echo_evaluation(summ: EvalSummary) -> None:
    """An evaluation's one line, and where its per-query rows are."""
    typer.echo(f"{summ.line()} (per query: pipeline sql over run {summ.eval_run_id})")


if __name__ == "__main__":  # `python -m pipeline.cli ...` where the package is not installed
    app()
