"""Baselines on the evaluation harness: fixed programs run through the same sandbox, executor, score stage and
metrics as generated workflows, so that a trained generator can be compared with simple prompting.

A baseline is a derived run `<run_id>-baseline-<method>` (`-baseline-<split>-<method>` off the test split): CONFIG
with `benchmark.train_split=<split>` and the experiment's held-out query count and L (`evaluate.eval_changes`), as
the base model's and a checkpoint's evaluation runs have. Its round 0 holds the split's queries and, per query, L
generations whose text is the method's program (`backend` = "baseline", `model` = the method; no generator tokens).
The normal score stage runs them; `evaluate.eval_summary` gives Mean@L / Best@L / Majority@L and tokens per query.

Methods (`PROGRAMS`; the executor's settings apply to every `llm()` call, as for generated workflows):
- io: the executor answers the query directly;
- cot: "think step by step", one answer;
- cot_sc: CoT-SC, K = 5 answers at temperature 0.7, majority vote on their last number (else their text);
- self_review: generate, then the executor reviews its own answer and gives the final one (AFlow's Review/Revise);
- ensemble_select: 3 answers at temperature 0.7, then the executor picks one (AFlow's ScEnsemble);
- pot: program of thought: the executor writes one Python expression, the workflow evaluates it (the whole first
  line, else what precedes its "="), else returns the reply (AFlow's Programmer operator);
- task_best: the best task-level workflow, one program for every query of a task (AFlow searches for one;
  SCALE asks whether query-level workflows beat it). Candidates are the fixed programs above and the distinct valid
  workflows with a positive score of `--candidates` runs; each runs once on each query of the selection split
  (`benchmark.max_queries` of `dev` when CONFIG holds one out, `benchmark.dev_share` > 0, else of `validate`,
  CONFIG's training queries) in the run `<run_id>-baseline-<that split>-select`;
  per task the candidate with the best mean score wins (ties: fewer executor tokens, then the earlier candidate),
  and the held-out run holds L copies of its task's winner per query.
- program:<file>: a hand-written program (a task-level workflow someone wrote) run like the fixed ones, in
  `<run_id>-baseline-program-<file stem>`. A generated candidate's mean leaves out the
  query it was written for: a query-level workflow (numbers copied into the code) is right there and nowhere else,
  which says nothing about it as a task-level program.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import ConfigError, RunConfig, diff_configs, load_config, variant_sets
from pipeline.core.records import Record
from pipeline.core.reward import program_key
from pipeline.engines.servers import sharing
from pipeline.engines.workflow import check_workflow, extract_code
from pipeline.run import RunContext, open_run
from pipeline.store import Store, store_for
from pipeline.studies.formatting import num
from pipeline.studies.summaries import BEST_FIXED_ARM, EvalSummary

log = logging.getLogger(__name__)

_COT = "\\nLet's think step by step, then give the final answer on the last line."

PROGRAMS: dict[str, str] = {
    "io": '''async def solve(problem):
    return (await llm(problem))[0]
''',
    "cot": f'''async def solve(problem):
    return (await llm(problem + "{_COT}"))[0]
''',
    "cot_sc": f'''import re

K = 5


def vote(answer):
    numbers = re.findall(r"-?\\d+(?:\\.\\d+)?", answer.replace(",", ""))
    return numbers[-1] if numbers else " ".join(answer.lower().split())


async def solve(problem):
    answers = await llm(problem + "{_COT}", temperature=0.7, n=K)
    votes = [vote(a) for a in answers]
    best = max(votes, key=votes.count)
    return answers[votes.index(best)]
''',
    "self_review": '''async def solve(problem):
    answer = (await llm(problem + "\\nGive the final answer."))[0]
    review = f"Problem: {problem}\\nProposed answer: {answer}\\nCheck the proposed answer. If it is wrong, give " \\
             "the correct final answer, else repeat it. Reply with the final answer only."
    final = (await llm(review))[0]
    return final if final.strip() else answer
''',
    "ensemble_select": '''async def solve(problem):
    answers = await llm(problem + "\\nGive the final answer.", temperature=0.7, n=3)
    listing = "\\n".join(f"{'ABC'[i]}. {a}" for i, a in enumerate(answers))
    ask = f"Problem: {problem}\\nCandidate answers:\\n{listing}\\nWhich candidate is most likely correct? " \\
          "Reply with one letter."
    pick = (await llm(ask))[0].upper()
    for i, letter in enumerate("ABC"):
        if letter in pick[:3]:
            return answers[i]
    return answers[0]
''',
    "pot": '''async def solve(problem):
    ask = problem + "\\nWrite one Python expression that computes the answer. Reply with the expression only."
    reply = (await llm(ask))[0]
    lines = [x.strip() for x in reply.replace("`", "").splitlines() if x.strip() and x.strip() != "python"]
    for line in lines[:1]:
        for expression in (line, line.split("=")[0]):
            try:
                return str(eval(expression, {"__builtins__": {}}, {}))
            except Exception:
                pass
    return reply
''',
}
FIXED = tuple(PROGRAMS)
TASK_BEST = BEST_FIXED_ARM  # "task_best": the methods comparison's arm of that name is this baseline
METHODS = (*FIXED, TASK_BEST)
SELECT = "select"  # the task_best selection run's tag
PROGRAM_PREFIX = "program:"  # method "program:<file>": a hand-written program for every query, run `program-<stem>`
# "program:<file>?K=2&T=0.5": the same program with module-level constants set (`K = 2`): one file for a budget sweep


UNUSED_BY_BASELINES = ("generator", "curation", "training")  # config sections no fixed program reads


def baseline_run_id(run_id: str, method: str, split: str = "test") -> str:
    return f"{run_id}-baseline-{method}" if split == "test" else f"{run_id}-baseline-{split}-{method}"


def program_parts(method: str) -> tuple[Path, dict[str, str]]:
    """`program:<file>[?NAME=VALUE&...]` -> the file and the constants to set."""
    path, _, query = method.removeprefix(PROGRAM_PREFIX).partition("?")
    consts = {}
    for part in filter(None, query.split("&")):
        name, eq, value = part.partition("=")
        if not eq or not name.isidentifier() or not value:
            raise ConfigError(f"{method}: {part!r} is not NAME=VALUE")
        consts[name] = value
    return Path(path), consts


def program_text(method: str) -> str:
    """The program of `program:<file>?...`: the file with each `NAME = ...` line at module level set to the value
    given; a ConfigError when the file has no such line (a typo would otherwise run the file's own value)."""
    path, consts = program_parts(method)
    text = path.read_text()
    for name, value in consts.items():
        text, n = re.subn(rf"^{name} = .*$", lambda _, line=f"{name} = {value}": line, text, count=1, flags=re.M)
        if n == 0:
            raise ConfigError(f"{method}: {path} has no module-level line `{name} = ...` to set")
    return text


def check_method(method: str) -> None:
    """A ConfigError unless `method` is a known method or `program:<file>[?NAME=VALUE...]` of an existing file whose
    constants exist."""
    if method not in METHODS and not method.startswith(PROGRAM_PREFIX):
        raise ConfigError(f"unknown baseline method {method!r}; methods: {', '.join(METHODS)}, program:<file>")
    if method.startswith(PROGRAM_PREFIX):
        path, _ = program_parts(method)
        if not path.is_file():
            raise ConfigError(f"--program {path}: file not found")
        program_text(method)


def method_tag(method: str) -> str:
    """The name of a method's derived run: the method, or `program-<file stem>[-<NAME><VALUE>...]` for a program."""
    if not method.startswith(PROGRAM_PREFIX):
        return method
    path, consts = program_parts(method)
    return "-".join([f"program-{path.stem}", *(re.sub(r"[^\w.]", "_", f"{k}{v}") for k, v in consts.items())])


def baseline_changes(frozen: RunConfig, wanted: RunConfig) -> list[str]:
    """The fields in which the baseline run frozen as `frozen` differs from `wanted`. A fixed program calls the
    executor only, so another generator, curation or training (e.g. the learning rate chosen on dev) is none."""
    return [p for p in diff_configs(frozen, wanted.model_copy(update={"run_id": frozen.run_id}))
            if p.split(".")[0] not in UNUSED_BY_BASELINES]


def baseline_sets(config: str | Path, split: str, sets: list[str] | None = None, before: list[str] | None = None,
                  held_out: bool = True) -> list[str]:
    """A derived run's `--set` text: a study's own `--set` (`before`: an experiment's, e.g. an arm's training
    `rollout.m`), then the derived run's changes (its split and one round; `held_out`: the experiment's query count
    and L, as its evaluation runs), then `sets`, which have the last word (`pipeline baseline --set`)."""
    from pipeline.studies.evaluate import derived_run_changes, eval_changes

    before, sets = list(before or []), list(sets or [])
    cfg = load_config(config, before + sets)
    derived = derived_run_changes(split, cfg) | (eval_changes(cfg, policy=False) if held_out else {})
    return variant_sets(derived, before=before, after=sets)


def reopen_sets(config: str | Path, split: str, sets: list[str] | None = None, before: list[str] | None = None,
                held_out: bool = True) -> list[str]:
    """The `--set` text a derived run is reopened with (its stages, a resumed run): `sets` alone, a per-invocation
    change; under a study's own `--set` (`before`), `baseline_sets`, so the derived run's changes stay over the
    study's as when the run was made."""
    return baseline_sets(config, split, sets, before, held_out) if before else list(sets or [])


def open_baseline_run(config: str, method: str, run_id: str | None = None, split: str = "test",
                      sets: list[str] | None = None, held_out: bool = True, before: list[str] | None = None
                      ) -> RunContext:
    """Create (first call) or reopen the derived run of `method` on `split` (its `--set` text: `baseline_sets`).
    `held_out`: the experiment's query count and L (as evaluation runs); else CONFIG's own queries (task_best's
    selection run). A run reopened with `baseline_changes` is refused, naming them."""
    sets, before = list(sets or []), list(before or [])
    cfg = load_config(config, before + sets)
    bid = baseline_run_id(run_id or cfg.run_id, method, split)
    store = store_for(cfg.store)
    if store.read_config(bid) is None:
        return open_run(config, bid, 0, baseline_sets(config, split, sets, before, held_out))
    ctx = open_run(None, bid, 0, reopen_sets(config, split, sets, before, held_out), str(store.root))
    # as open_run: CONFIG matches alone (`sets` then a deliberate per-invocation change) or with `sets`
    changed = min((baseline_changes(ctx.cfg, load_config(config, baseline_sets(config, split, extra, before, held_out)))
                   for extra in ([], sets)), key=len)
    if changed:
        raise ConfigError(f"baseline run {bid!r} was made with other settings ({', '.join(changed)}): use another "
                          "--run-id, or --set for a deliberate per-invocation change")
    return ctx


def _task(meta: str | None, benchmark: str) -> str:
    """A query's task: the procedural generator that made it, else the benchmark."""
    return json.loads(meta or "{}").get("task") or benchmark


def write_queries(ctx: RunContext) -> list[dict]:
    """The split's queries into round 0 (those not there yet); returns them all as {query_id, task}."""
    from pipeline.engines.benchmarks import load_benchmark

    bench = load_benchmark(ctx.cfg.benchmark)
    items = bench.items()
    have = set(ctx.store.read("queries", ctx.run_id, 0)["query_id"].to_list())
    ctx.store.write("queries", [
        dict(split=ctx.cfg.benchmark.train_split, query_id=it.id, benchmark=ctx.cfg.benchmark.name, prompt=it.prompt,
             reference=json.dumps(it.reference), meta=json.dumps(it.meta)) for it in items if it.id not in have
    ], ctx.run_id, 0)
    return [{"query_id": it.id, "task": _task(json.dumps(it.meta), ctx.cfg.benchmark.name)} for it in items]


def program_rows(query_id: str, programs: list[tuple[str, str, dict]]) -> list[dict]:
    """Generations rows of one query: slot j runs programs[j] = (label, code, provenance)."""
    from pipeline.stages.sampling import gen_id

    rows = []
    for slot, (label, code, extra) in enumerate(programs):
        reason = check_workflow(code)
        rows.append(dict(gen_id=gen_id(0, query_id, "workflow", slot), kind="workflow", query_id=query_id, slot=slot,
                         text=code, model=label, backend="baseline", sampling=json.dumps(extra, sort_keys=True),
                         prompt_token_ids=[], token_ids=[], finish_reason="stop", valid=reason is None,
                         invalid_reason=reason, attempt=0, cost_usd=0.0))
    return rows


def write_programs(ctx: RunContext, per_query: dict[str, list[tuple[str, str, dict]]]) -> int:
    """The generations of a baseline run, in one part (all or nothing), unless its `rollout` manifest says they are
    there; the manifest keeps a later `pipeline rollout` from sampling into it."""
    if ctx.done("rollout"):
        return 0
    rows = [r for qid, progs in per_query.items() for r in program_rows(qid, progs)]
    ctx.store.discard_unfinished(ctx.run_id, 0, ["generations"])  # a crash between the write and the manifest
    ctx.store.write("generations", rows, ctx.run_id, 0)
    ctx.finish("rollout", queries=len(per_query), workflows=len(rows), baseline=True)
    return len(rows)


def _score(ctx: RunContext, call, sets: list[str] | None) -> None:
    """The score stage of a derived run, with `sets` as the run was opened (`open_baseline_run`)."""
    call(stage="score", run_id=ctx.run_id, round=0, store_root=str(ctx.store.root), sets=sets)


def run_fixed(config: str, method: str, call, run_id: str | None = None, split: str = "test",
              sets: list[str] | None = None, program: str | None = None, before: list[str] | None = None
              ) -> EvalSummary:
    """A fixed program's baseline run: L copies of it per held-out query, scored; returns its `eval_summary`.
    `program`: the source of a user-given program (`pipeline baseline --program FILE`), named `method`."""
    from pipeline.studies.evaluate import eval_summary

    code = PROGRAMS[method] if program is None else program
    ctx = open_baseline_run(config, method, run_id, split, sets, before=before)
    L = ctx.cfg.rollout.m
    queries = write_queries(ctx)
    write_programs(ctx, {q["query_id"]: [(method, code, {"method": method})] * L for q in queries})
    _score(ctx, call, reopen_sets(config, split, sets, before))
    return eval_summary(ctx.store, ctx.run_id)


# ---- task_best ------------------------------------------------------------------------------------------------


def candidate_programs(store: Store, runs: list[str], limit: int) -> list[tuple[str, str, dict]]:
    """The fixed programs, then up to `limit` distinct valid workflows of `runs` (round 0) that scored above 0 on
    their own query, best first (ties: gen_id); each (label, code, provenance: a workflow's own `query_id`)."""
    out = [(m, PROGRAMS[m], {"candidate": m}) for m in FIXED]
    seen = {program_key(c) for _, c, _ in out}
    for run in runs:
        if not (store.run_dir(run) / "config.yaml").is_file():
            raise ConfigError(f"--candidates: run {run!r} not found under {store.root}")
    if not runs or limit <= 0:
        return out
    scored = store.sql(
        "SELECT s.run_id, s.gen_id, s.query_id, s.score, g.text FROM generation_scores s JOIN "
        "(SELECT run_id, round, gen_id, any_value(text) AS text FROM generations GROUP BY ALL) g "
        "USING (run_id, round, gen_id) WHERE s.run_id IN (SELECT unnest($runs)) AND s.round = 0 "
        "AND s.kind = 'workflow' AND s.valid AND s.score > 0 ORDER BY s.score DESC, s.run_id, s.gen_id",
        {"runs": runs})
    added = 0
    for run, gid, qid, score, text in scored.iter_rows():
        code = extract_code(text or "")
        key = program_key(code)
        if added >= limit or key in seen:
            continue
        seen.add(key)
        out.append((f"{run}:{gid}", code, {"candidate": f"{run}:{gid}", "own_score": score, "query_id": qid}))
        added += 1
    return out


def select_per_task(rows: list[dict]) -> dict[str, dict]:
    """`rows`: one per (candidate run on a selection query): task, label, order (the candidate's index), score,
    exec_tokens. Per task the candidate with the best mean score; ties: fewer mean executor tokens, then the lower
    order. Returns task -> {label, order, mean_score, exec_tokens, queries}."""
    by_candidate: dict[tuple[str, str], dict] = {}
    for row in rows:
        tally = by_candidate.setdefault((row["task"], row["label"]), {"label": row["label"], "order": row["order"],
                                                                      "scores": [], "tokens": []})
        tally["scores"].append(row["score"])
        tally["tokens"].append(row["exec_tokens"])
    best: dict[str, dict] = {}
    for (task, _), tally in by_candidate.items():
        cand = {"label": tally["label"], "order": tally["order"],
                "mean_score": sum(tally["scores"]) / len(tally["scores"]),
                "exec_tokens": sum(tally["tokens"]) / len(tally["tokens"]), "queries": len(tally["scores"])}
        rank = (-cand["mean_score"], cand["exec_tokens"], cand["order"])
        if task not in best or rank < (-best[task]["mean_score"], best[task]["exec_tokens"], best[task]["order"]):
            best[task] = cand
    return best


def _selection_rows(store: Store, run_id: str, tasks: dict[str, str]) -> list[dict]:
    """The selection run's scores as `select_per_task` rows, without a candidate's run on its own query (tokens as
    floats: DuckDB sums them as decimals, which JSON would write as strings)."""
    scored = store.sql(
        "SELECT s.query_id, s.slot, s.score, coalesce(s.tokens_in, 0) + coalesce(s.tokens_out, 0) AS tok, "
        "g.model, g.sampling FROM generation_scores s JOIN (SELECT run_id, round, gen_id, any_value(model) "
        "AS model, any_value(sampling) AS sampling FROM generations GROUP BY ALL) g "
        "USING (run_id, round, gen_id) WHERE s.run_id = $run AND s.round = 0 AND s.kind = 'workflow'",
        {"run": run_id}, run=run_id)
    return [{"task": tasks[q], "label": m, "order": slot, "score": 0.0 if s is None else s, "exec_tokens": float(tok)}
            for q, slot, s, tok, m, prov in scored.iter_rows() if json.loads(prov or "{}").get("query_id") != q]


def selection_split(cfg) -> str:
    """Where task_best chooses its programs: the development split when the config holds one out (choices are
    made there, not on the queries a generator trains on), else `validate` (the training queries)."""
    return "dev" if cfg.benchmark.dev_share > 0 else "validate"


def run_task_best(config: str, call, run_id: str | None = None, split: str = "test", sets: list[str] | None = None,
                  candidates: list[str] | None = None, max_candidates: int = 16, before: list[str] | None = None
                  ) -> EvalSummary:
    """Select each task's best program on CONFIG's training queries, then run it on the held-out split (module
    doc); returns the held-out run's `eval_summary` with `selected` (task -> the winner and its selection score) and
    `selection_run` (the run in which the winners were chosen)."""
    from pipeline.studies.evaluate import eval_summary

    chosen_on = selection_split(load_config(config, [*(before or []), *(sets or [])]))
    sel = open_baseline_run(config, SELECT, run_id, chosen_on, sets, held_out=False, before=before)
    progs = candidate_programs(sel.store, list(candidates or []), max_candidates)
    sel_queries = write_queries(sel)
    write_programs(sel, {q["query_id"]: progs for q in sel_queries})
    _score(sel, call, reopen_sets(config, chosen_on, sets, before, held_out=False))
    chosen = select_per_task(_selection_rows(sel.store, sel.run_id, {q["query_id"]: q["task"] for q in sel_queries}))
    by_label = {label: (code, extra) for label, code, extra in progs}
    ctx = open_baseline_run(config, TASK_BEST, run_id, split, sets, before=before)
    samples, queries = ctx.cfg.rollout.m, write_queries(ctx)
    missing = sorted({q["task"] for q in queries} - set(chosen))
    if missing:
        raise ConfigError(f"task_best: no selection query of task(s) {missing}; raise benchmark.max_queries")
    per_query = {}
    for q in queries:
        win = chosen[q["task"]]
        code, extra = by_label[win["label"]]
        prov = {"method": TASK_BEST, "selected_on": sel.run_id, "selection_mean": win["mean_score"], **extra}
        per_query[q["query_id"]] = [(win["label"], code, prov)] * samples
    write_programs(ctx, per_query)
    _score(ctx, call, reopen_sets(config, split, sets, before))
    summary = eval_summary(ctx.store, ctx.run_id)
    summary.extra["selected"] = chosen
    summary.extra["selection_run"] = sel.run_id
    return summary


def sharing_executor(config: str, run_id: str | None = None, sets: list[str] | None = None):
    """One executor server for the baselines of one command (pipeline.engines.servers.sharing), its log under
    `<store>/experiments/<run_id>-baselines/server-logs/`."""
    cfg = load_config(config, list(sets or []))
    log_dir = store_for(cfg.store).root / "experiments" / f"{run_id or cfg.run_id}-baselines" / "server-logs"
    return sharing(cfg, log_dir)


def run_baseline(config: str, method: str, call=None, run_id: str | None = None, split: str = "test",
                 sets: list[str] | None = None, candidates: list[str] | None = None, max_candidates: int = 16,
                 before: list[str] | None = None) -> EvalSummary:
    """One baseline's derived run, through `call` (a stage caller; default `pipeline.stages.rounds.direct_call()`).
    `sets` have the last word; a study's own `--set` goes in `before`, under the run's changes (`baseline_sets`)."""
    from pipeline.stages.rounds import direct_call

    check_method(method)
    call = call or direct_call()
    if method.startswith(PROGRAM_PREFIX):
        return run_fixed(config, method_tag(method), call, run_id, split, sets, program_text(method), before)
    if method == TASK_BEST:
        return run_task_best(config, call, run_id, split, sets, candidates, max_candidates, before)
    return run_fixed(config, method, call, run_id, split, sets, before=before)


# ---- side by side ----------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ComparisonRow(Record):
    """One run of `pipeline compare`: what wrote its workflows, its queries and L, and its evaluation's figures."""

    run: str
    method: str
    queries: int
    L: int
    mean_at_l: float | None = None
    best_at_l: float | None = None
    majority_at_l: float | None = None
    valid_share: float | None = None
    gen_tokens_per_query: float | None = None
    exec_tokens_per_query: float | None = None
    exec_calls_per_query: float | None = None


@dataclass(kw_only=True)
class Comparison(Record):
    """`compare`'s result: a row per run, and whether all runs hold the same queries (else their figures are not
    over the same problems)."""

    rows: list[ComparisonRow] = field(default_factory=list)
    same_queries: bool = True
    NESTED = {"rows": ComparisonRow}

    def markdown(self) -> str:
        """The rows as one Markdown table."""
        return markdown_table(self.rows)


def describe(store: Store, run_id: str) -> str:
    """What wrote a run's workflows: a baseline's (or SMC's) `method`, else the generator and its adapter."""
    df = store.sql("SELECT any_value(sampling) AS sampling FROM generations WHERE run_id = $run AND round = 0 "
                   "AND kind = 'workflow'", {"run": run_id}, run=run_id)
    method = json.loads(df["sampling"][0] or "{}").get("method") if df.height else None
    if method:
        return method
    cfg = open_run(None, run_id, 0, None, str(store.root)).cfg
    adapter, repair = cfg.generator.adapter, cfg.rollout.repair_attempts
    m = re.search(r"([^/]+)/round=(\d+)/checkpoint/?$", adapter or "")
    name = ("generator, base model" if not adapter
            else f"generator + {m.group(1)} round {m.group(2)}" if m else f"generator + {adapter}")
    return name + (f", self-repair <= {repair}" if repair else "")


def compare(store: Store, run_ids: list[str], describe_fn: Callable[[Store, str], str] = describe) -> Comparison:
    """`eval_summary` of each run as one table row and whether all runs hold the same queries."""
    from pipeline.studies.evaluate import eval_summary

    rows, query_sets = [], []
    for rid in run_ids:
        if not (store.run_dir(rid) / "config.yaml").is_file():
            raise ConfigError(f"run {rid!r} not found under {store.root}")
        summary = eval_summary(store, rid)
        query_sets.append(frozenset(q["query_id"] for q in summary.per_query))
        L = max((q["workflows"] + q["pending"] for q in summary.per_query), default=0)
        rows.append(ComparisonRow(run=rid, method=describe_fn(store, rid), queries=summary.queries, L=L,
                                  **{name: getattr(summary, name) for name in FIGURES}))
    return Comparison(rows=rows, same_queries=len(set(query_sets)) <= 1)


FIGURES = ("mean_at_l", "best_at_l", "majority_at_l", "valid_share", "gen_tokens_per_query", "exec_tokens_per_query",
           "exec_calls_per_query")  # an evaluation's figures a comparison row shows


def markdown_table(rows: list[ComparisonRow]) -> str:
    head = ("run", "method", "queries", "L", "Mean@L", "Best@L", "Majority@L", "valid", "generator tokens/query",
            "executor tokens/query", "executor calls/query")
    digits = {"mean_at_l": 3, "best_at_l": 3, "majority_at_l": 3, "valid_share": 2, "gen_tokens_per_query": 0,
              "exec_tokens_per_query": 0, "exec_calls_per_query": 2}

    def cell(key: str, v: object) -> str:
        return num(v, digits[key]) if key in digits or v is None else str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    columns = ComparisonRow.names()
    lines += ["| " + " | ".join(cell(k, getattr(r, k)) for k in columns) + " |" for r in rows]
    return "\n".join(lines)
