"""W4S's multi-turn refinement as a rollout mode (`rollout.mode: refine`; Weak-for-Strong, arXiv 2504.04785, and its
reference code, src/main.py and src/agent/meta_agent.py).

A *task* is a set of training items the workflow is run on: with `rollout.refine.unit: task` (W4S) consecutive
chunks of `task_size` queries of the train split, one workflow for the whole task, id `task:<first query id>+<n>`;
with `unit: query` each query is its own task of one item (its id is the query's). Per task and round:

- state: the task, the current workflow (turn 0: `refine.start`, default the prompt's example workflow) and the
  feedback of its runs on the task's items: its accuracy, the accuracies so far, and up to `failure_cases` failed
  items with the question, the workflow's answer and error (task unit: and the gold answer, see `feedback_text`);
- action: an analysis of what to change plus new workflow code, sampled K = `candidates` times from the state
  prompt (`prompts/refine.txt`) by the round's generator (base model + the previous round's adapter);
- self-check: each candidate runs once on the task's first item (`pipeline.stages.repair.self_repair`, scoped to the
  turn: a crash, timeout or empty answer sends it back with its error up to `rollout.repair_attempts` times, W4S: 3); a
  candidate still failing is *skipped*: no validation, no reward, never trained on;
- validation: every other candidate runs on all the task's items (one `checks` row per (candidate, item), purpose
  `refine`, `reward` = the item's metric); its accuracy is the mean metric;
- reward (RLAO, `rlao_rewards`), and the best candidate (highest accuracy, the first on ties) advances the state; if
  every candidate was skipped the state stays. All candidates are kept for training.

T = `turns` turns. The store holds everything: candidates (and their repairs) are `generations` rows of kind
`workflow` with `query_id` = the task id, `parent_id` = the workflow the state showed (null: the start workflow,
which is no generation), `turn`, and `repair_of` / `attempt` for repairs; self-checks and validation runs are
`checks` rows; one `turns` row per candidate (pipeline.store.schema) once its turn is complete. The loop is driven by
the store alone, so a killed rollout resumes where it stopped: a (task, turn) with `turns` rows is done, sampled
candidates are not sampled again, chains are repaired from where they are (pipeline.stages.repair), and only the
(workflow, item) runs without a row are run (an executor error is not a result: it is run again).

The score stage of a refine round runs nothing (`score_refine`): a workflow's score is its validation accuracy (0
for one that failed its self-check), written as one `scores` row per workflow with no executor usage (the runs'
usage is in `checks`, which `query_usage` already counts), so `generation_scores`, the report and curation read it
as usual. `scoring.reps` does not apply. `curate_refine` writes the `groups` rows: per (task, turn) one `weighted`
row (RWR weights exp(r / curation.rwr_temperature) of the RLAO rewards, W4S's convert_data.py) and one GRPO `group`
row over the same candidates.

Not W4S: the state shows the current workflow and the accuracies so far, not a chat history of earlier turns; the
sequence trained on for a repaired candidate is the repair generation itself (its own prompt, the repair prompt) where
W4S splices the fixed code into the original action; held-out evaluation of a refine run samples flat workflows
(`pipeline.studies.evaluate.open_eval_run`); W4S's optimise-on-validation-then-test is the `refined` evaluation of
`pipeline compare-methods` (pipeline.studies.methods).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from pipeline.core.curation import group_row, rwr_weights
from pipeline.core.grpo import group_advantages
from pipeline.engines.benchmarks.base import Item
from pipeline.engines.checks import CheckJob, failure, run_checks
from pipeline.engines.prompting import Design, example, refine_prompt, render
from pipeline.engines.workflow import extract_code
from pipeline.stages.repair import chain_ends, root_of, self_repair
from pipeline.stages.rollout import rollout_counts, start_generator, write_queries
from pipeline.stages.sampling import Request, batches, drawn_design, seeded_rng
from pipeline.store.schema import TRANSIENT_STATUSES

log = logging.getLogger(__name__)

LOW_ACCURACY, LOW_PENALTY = 0.3, 0.1  # W4S main.py (reward_type "discrete"): r -= 0.1 when the accuracy is < 0.3
MAX_FEEDBACK_CHARS = 400  # of a question, an answer or an error shown in feedback (an error keeps its tail)


class RefineExecutorError(ConnectionError):
    """Validation runs ended with an executor error: not results; the stage is retried (a transient failure)."""


# ---- the maths and the text (pure) ------------------------------------------------------------------------------


def rlao_rewards(accuracies: Sequence[float], best_so_far: float, previous: float) -> list[float]:
    """RLAO's turn reward of each candidate (W4S main.py, reward_type "discrete"): 1 if its accuracy beats the best
    accuracy of the task so far, else 0.5 if it beats the current workflow's (`previous`), else 0; minus 0.1 when
    the accuracy is below 0.3."""
    out = []
    for a in accuracies:
        r = 1.0 if a > best_so_far else 0.5 if a > previous else 0.0
        out.append(r - LOW_PENALTY if a < LOW_ACCURACY else r)
    return out


def best_index(accuracies: Sequence[float | None]) -> int | None:
    """The candidate that advances the state: the highest accuracy, the first on ties; None when all are skipped."""
    live = [(a, -i) for i, a in enumerate(accuracies) if a is not None]
    return -max(live)[1] if live else None


@dataclass(frozen=True)
class Task:
    id: str
    items: list[Item]


def make_tasks(items: Sequence[Item], unit: str, task_size: int) -> list[Task]:
    """query: one task per item (its id); task: consecutive chunks of `task_size` items, id
    `task:<first query id>+<n>`."""
    if unit == "query":
        return [Task(it.id, [it]) for it in items]
    chunks = [list(items[i:i + task_size]) for i in range(0, len(items), task_size)]
    return [Task(f"task:{c[0].id}+{len(c)}", c) for c in chunks]


def start_id(round: int, task_id: str) -> str:
    """The `checks` gen_id of the start workflow's runs (it is no generation)."""
    return f"r{round}-{task_id}-start"


def candidate_id(round: int, task_id: str, turn: int, k: int) -> str:
    return f"r{round}-{task_id}-t{turn}-c{k}"


@dataclass
class State:
    """What a turn's prompt shows: the current workflow and its validation runs (one check row per item, in item
    order), its accuracy, the best accuracy so far and the accuracies of the workflows the task went through."""

    gen_id: str | None  # None: the start workflow
    code: str
    accuracy: float
    best: float
    runs: list[dict]
    history: list[tuple[str, float]] = field(default_factory=list)


def _clip(text: str | None, tail: bool = False) -> str:
    text = " ".join(str(text).split()) if text is not None else ""
    if len(text) <= MAX_FEEDBACK_CHARS:
        return text
    return "..." + text[-MAX_FEEDBACK_CHARS:] if tail else text[:MAX_FEEDBACK_CHARS] + "..."


def feedback_text(task: Task, state: State, failure_cases: int, show_gold: bool, rng) -> str:
    """The feedback block of a state: accuracy, accuracies so far, and up to `failure_cases` failed items (metric
    below 1; a seeded sample in item order when there are more) with the question, the workflow's answer and its
    error. `show_gold` adds the failed item's gold answer: W4S shows it, and these are training items (the train
    split); callers pass it only for the task unit, where the workflow is for the whole task and not for that item
    alone."""
    n = len(task.items)
    correct = sum(1 for r in state.runs if (r["reward"] or 0.0) >= 1.0)
    lines = [f"Feedback from running the current workflow on the task's {n} question{'s' if n > 1 else ''}:",
             f"Validation accuracy: {state.accuracy:.2f} ({correct} of {n} correct)."]
    if len(state.history) > 1:
        lines.append("Accuracy so far: " + ", ".join(f"{w} {a:.2f}" for w, a in state.history)
                     + f"; best {state.best:.2f}.")
    failed = [(it, r) for it, r in zip(task.items, state.runs, strict=True) if (r["reward"] or 0.0) < 1.0]
    if not failed:
        lines.append("Every question was answered correctly.")
        return "\n".join(lines)
    shown = failed
    if len(failed) > failure_cases:
        keep = sorted(rng.sample(range(len(failed)), failure_cases))
        shown = [failed[i] for i in keep]
    if not shown:
        return "\n".join(lines)
    lines.append(f"Failed cases ({len(shown)} of {len(failed)}):")
    for item, r in shown:
        lines.append(f"- Question: {_clip(item.prompt)}")
        lines.append(f"  Workflow answer: {_clip(r['answer']) or '(none)'}")
        if r["status"] != "ok" or r["error"]:
            lines.append(f"  Error: {r['status']}: {_clip(r['error'], tail=True) or 'no error message'}")
        if show_gold:
            lines.append(f"  Correct answer: {_clip(item.gold_text())}")
    return "\n".join(lines)


def task_text(task: Task, unit: str, benchmark: str) -> tuple[str, str]:
    """(the task paragraph, the caution after the ask) of a state prompt."""
    if unit == "query":
        return f"Task:\n{task.items[0].prompt.strip()}", ""
    n = len(task.items)
    return (f"Task: the workflow is run on each of {n} {benchmark} questions (each passed to `solve` as `problem`) "
            f"and scored by its accuracy over them. One of the questions:\n{task.items[0].prompt.strip()}",
            " It will also be run on new questions of the same kind: do not hard-code the answers of the questions "
            "shown.")


def state_prompt(task: Task, state: State, turn: int, turns: int, unit: str, benchmark: str, family: str,
                 failure_cases: int, show_gold: bool, rng, prompt_dir: str | None = None,
                 menu: Sequence[Design] = ()) -> str:
    """The user message of a turn (`refine.txt`, the prompt folder's where it has one): instructions, the current
    workflow, the feedback (and the example menu's designs where the template shows them)."""
    origin = "the start workflow" if state.gen_id is None else f"the best of {state.history[-1][0]}"
    text, caution = task_text(task, unit, benchmark)
    fb = feedback_text(task, state, failure_cases, show_gold and unit == "task", rng)
    return refine_prompt(family, text, state.code, origin, fb, turn + 1, turns, caution, prompt_dir, menu)


# ---- the loop ----------------------------------------------------------------------------------------------------


def _transient(status: str | None) -> bool:
    return status in TRANSIENT_STATUSES


def _metric(bench, item: Item, row: dict) -> float:
    if row["status"] != "ok" or row["answer"] is None or not str(row["answer"]).strip():
        return 0.0
    return float(bench.score(item, row["answer"]).score)


class Refine:
    """One round's refinement of every task. `engine()`: the generator, started on first use; `executor`: shared by
    every sandbox run (None: each call makes its own)."""

    def __init__(self, ctx, sampler, bench, engine: Callable, executor=None):
        self.ctx, self.sampler, self.bench, self.engine, self.executor = ctx, sampler, bench, engine, executor
        self.refine_cfg = ctx.cfg.rollout.refine
        self.tasks = make_tasks(sampler.items, self.refine_cfg.unit, self.refine_cfg.task_size)
        self.start_code = {t.id: self._start(t) for t in self.tasks}
        self.counts = {"sampled": 0, "checked": 0, "repairs": 0, "validation_runs": 0}

    def _start(self, task: Task) -> str:
        """A task's start workflow: `refine.start`; else, with an example menu, the design the task's first slot
        draws (as a flat rollout's prompt shows it); else the prompt's example."""
        if self.refine_cfg.start:
            return extract_code(self.refine_cfg.start)
        if (d := drawn_design(self.ctx.cfg.rollout, self.sampler.menu, task.id, 0)) is not None:
            return d.code
        return example(self.sampler.family, self.ctx.cfg.rollout.prompt_dir)

    # ---- store reads
    def _read(self, table: str) -> pl.DataFrame:
        return self.ctx.store.read(table, self.ctx.run_id, self.ctx.round)

    def _runs(self) -> dict[str, dict[str, dict]]:
        """gen_id -> item id -> its validation run (executor errors left out: they run again)."""
        df = self._read("checks").filter(pl.col("purpose") == "refine").sort("created_at")
        out: dict[str, dict[str, dict]] = {}
        for r in df.iter_rows(named=True):
            if not _transient(r["status"]):
                out.setdefault(r["gen_id"], {})[r["query_id"]] = r
        return out

    def _done_turns(self) -> set[tuple[str, int]]:
        return {(a, b) for a, b in self._read("turns").select("task_id", "turn").iter_rows()}

    # ---- validation runs
    def validate(self, todo: list[tuple[str, str, Task]]) -> int:
        """Run each (gen_id, code, task) on the task's items it has no run on yet; writes `checks` rows (purpose
        refine, reward = the item's metric) in parts of scoring.batch_size runs."""
        runs = self._runs()
        jobs = [CheckJob(g, code, it) for g, code, task in todo for it in task.items if it.id not in runs.get(g, {})]
        items = {j.item.id: j.item for j in jobs}
        size, transient = max(self.ctx.cfg.scoring.batch_size, self.ctx.cfg.scoring.concurrency), 0
        for i in range(0, len(jobs), size):
            rows = run_checks(self.ctx.cfg, jobs[i:i + size], "refine", self.executor, self.ctx.store.cache_dir())
            for r in rows:
                r["reward"] = _metric(self.bench, items[r["query_id"]], r)
                transient += _transient(r["status"])
            self.ctx.store.write("checks", rows, self.ctx.run_id, self.ctx.round)
        self.counts["validation_runs"] += len(jobs)
        if transient:
            raise RefineExecutorError(f"{transient} of {len(jobs)} validation runs ended with an executor error; "
                                      "they run again when the rollout is re-run")
        return len(jobs)

    # ---- states
    def states(self, turn: int) -> dict[str, State]:
        """Each task's state at the start of `turn`, rebuilt from the store: the start workflow, then each earlier
        turn's advanced candidate (a turn whose candidates were all skipped leaves it)."""
        runs, turns = self._runs(), self._read("turns").sort(["task_id", "turn", "slot"])
        gens = self._read("generations")
        texts = dict(zip(gens["gen_id"], gens["text"], strict=True))
        adv = {(r["task_id"], r["turn"]): r for r in turns.filter(pl.col("advanced")).iter_rows(named=True)}
        out = {}
        for task in self.tasks:
            rows = [runs[start_id(self.ctx.round, task.id)][it.id] for it in task.items]
            acc = float(np.mean([r["reward"] for r in rows]))
            state = State(None, self.start_code[task.id], acc, acc, rows, [("start", acc)])
            for earlier in range(turn):
                a = adv.get((task.id, earlier))
                if a is not None:
                    rows = [runs[a["gen_id"]][it.id] for it in task.items]
                    state = State(a["gen_id"], extract_code(texts[a["gen_id"]] or ""), a["accuracy"],
                                  max(state.best, a["accuracy"]), rows,
                                  [*state.history, (f"turn {earlier + 1}", a["accuracy"])])
            out[task.id] = state
        return out

    # ---- one turn
    def sample(self, turn: int, tasks: list[Task], states: dict[str, State]) -> int:
        """The K candidates of each task's state that are not in the store yet."""
        ctx, sampler, refine_cfg, generator = self.ctx, self.sampler, self.refine_cfg, self.ctx.cfg.generator
        have = set(self._read("generations")["gen_id"].to_list())
        prefix, reqs = ctx.cfg.rollout.workflow_prefix, []
        for task in tasks:
            ids = [candidate_id(ctx.round, task.id, turn, k) for k in range(refine_cfg.candidates)]
            slots = [k for k, gid in enumerate(ids) if gid not in have]
            if not slots:
                continue
            st = states[task.id]
            rng = seeded_rng(generator.seed, f"refine:{ctx.round}:{task.id}:{turn}")
            user = state_prompt(task, st, turn, refine_cfg.turns, refine_cfg.unit, ctx.cfg.benchmark.name,
                                sampler.family, refine_cfg.failure_cases, refine_cfg.show_gold, rng,
                                ctx.cfg.rollout.prompt_dir, sampler.menu)
            reqs.append(Request("workflow", task.id, st.gen_id, [ids[k] for k in slots], slots,
                                render(sampler.tokenizer, user, prompt_dir=sampler.cfg.rollout.prompt_dir) + prefix, [],
                                generator.max_new_tokens, prefix))
        written = 0
        for batch in batches(reqs, generator.batch_size):
            sampling = sampler.sampling(batch)
            t0 = time.perf_counter()
            outs = self.engine().generate([r.prompt_text for r in batch], sampling, sampler.sample_adapter)
            latency = (time.perf_counter() - t0) / max(1, sampling.n * len(batch))
            rows = [row | {"turn": turn} for r, comps in zip(batch, outs, strict=True)
                    for row in sampler.rows(r, comps, sampling, latency)]
            ctx.store.write("generations", rows, ctx.run_id, ctx.round)
            written += len(rows)
        return written

    def _scope(self, turn: int, tasks: list[Task]) -> Callable[[pl.DataFrame], pl.DataFrame]:
        ids = [t.id for t in tasks]
        return lambda df: df.filter((pl.col("turn") == turn) & pl.col("query_id").is_in(ids))

    def _passed(self) -> dict[str, bool]:
        """gen_id -> whether its self-check passed."""
        df = self._read("checks").filter(pl.col("purpose") == "repair")
        return {r["gen_id"]: failure(r["status"], r["answer"], r["error"]) is None for r in df.iter_rows(named=True)}

    def turn(self, turn: int, tasks: list[Task]) -> list[dict]:
        """Sample, self-check and repair, validate, reward; returns the `turns` rows written."""
        ctx, by_id = self.ctx, {t.id: t for t in tasks}
        states = self.states(turn)
        self.counts["sampled"] += self.sample(turn, tasks, states)
        scope = self._scope(turn, tasks)
        rep = self_repair(ctx, self.sampler, self.engine, items={t.id: t.items[0] for t in tasks}, scope=scope,
                          extra={"turn": turn}, executor=self.executor)
        self.counts["checked"] += rep["checked"]
        self.counts["repairs"] += rep["repairs"]
        ends = chain_ends(scope(self._read("generations"))).sort(["query_id", "slot"])
        passed = self._passed()
        self.validate([(r["gen_id"], extract_code(r["text"] or ""), by_id[r["query_id"]])
                       for r in ends.iter_rows(named=True) if passed.get(r["gen_id"])])
        runs, gens = self._runs(), self._read("generations")
        parent = dict(zip(gens["gen_id"], gens["repair_of"], strict=True))
        out = []
        for task in tasks:
            state, cands = states[task.id], ends.filter(pl.col("query_id") == task.id).to_dicts()
            accs = [float(np.mean([runs[c["gen_id"]][it.id]["reward"] for it in task.items]))
                    if passed.get(c["gen_id"]) else None for c in cands]
            live = rlao_rewards([a for a in accs if a is not None], state.best, state.accuracy)
            rewards = [None if a is None else live.pop(0) for a in accs]
            best = best_index(accs)
            out += [{"task_id": task.id, "turn": turn, "slot": c["slot"], "gen_id": c["gen_id"],
                     "root_id": root_of(c["gen_id"], parent), "attempts": c["attempt"] or 0,
                     "parent_id": state.gen_id, "items": 0 if a is None else len(task.items), "accuracy": a,
                     "previous": state.accuracy, "best_before": state.best, "reward": r, "advanced": j == best,
                     "skipped": a is None}
                    for j, (c, a, r) in enumerate(zip(cands, accs, rewards, strict=True))]
        ctx.store.write("turns", out, ctx.run_id, ctx.round)
        return out

    def run(self) -> dict:
        rnd = self.ctx.round
        self.validate([(start_id(rnd, t.id), self.start_code[t.id], t) for t in self.tasks])
        for turn in range(self.refine_cfg.turns):
            done = self._done_turns()
            todo = [t for t in self.tasks if (t.id, turn) not in done]
            if todo:
                rows = self.turn(turn, todo)
                log.info("refine round %d turn %d: %d tasks, %d candidates, %d skipped", rnd, turn, len(todo),
                         len(rows), sum(r["skipped"] for r in rows))
        turns = self._read("turns")
        return {"tasks": len(self.tasks), "turns": turns.select("task_id", "turn").unique().height,
                "candidates": turns.height, "skipped": int(turns["skipped"].sum()),
                "advanced": int(turns["advanced"].sum())} | self.counts


def _shared_executor(ctx):
    """A local executor is shared by every check of the stage (its model loads once); a client of a server is made
    per call (its connections belong to that call's event loop)."""
    if ctx.cfg.executor.kind != "local":
        return None
    from pipeline.engines.cache import make_cached_executor

    return make_cached_executor(ctx.cfg.executor, ctx.store.cache_dir())


def run_refine(ctx, sampler, bench) -> dict:
    """The rollout stage in refine mode (registered in `pipeline.stages.modes`; `sampler`: the rollout's `Sampler`)."""
    with contextlib.ExitStack() as stack:
        gen = None

        def engine():  # started on first use: a resumed rollout may have only runs left
            nonlocal gen
            if gen is None:
                gen = start_generator(ctx, sampler, stack)
                stack.callback(gen.close)
            return gen

        write_queries(ctx, sampler.items)
        refine = Refine(ctx, sampler, bench, engine, _shared_executor(ctx))
        counts = refine.run()
    counts = {"queries": len(sampler.items), **rollout_counts(ctx, counts.pop("sampled")), **counts}
    ctx.finish("rollout", mode="refine", **counts)
    log.info("rollout round %d (refine): %s", ctx.round, counts)
    return counts


# ---- the score stage: the validation accuracy is the score -----------------------------------------------------


def score_refine(ctx, only_failed: bool = False, shard=None) -> dict:
    """One `scores` row per workflow generation of a refine round that has none, without running anything: a
    validated candidate's accuracy, or 0 for a workflow that failed its self-check (a skipped candidate, an attempt
    that was repaired) with the check's status. No executor usage (the runs are `checks` rows, already counted)."""
    store, rid, rnd = ctx.store, ctx.run_id, ctx.round
    gens = store.read("generations", rid, rnd).filter(pl.col("kind") == "workflow").unique("gen_id", keep="first")
    turns = {r["gen_id"]: r for r in store.read("turns", rid, rnd).iter_rows(named=True)}
    if gens.height == 0 or not turns:
        raise ValueError(f"run {rid!r} round {rnd}: no refine turns; run `pipeline rollout` (rollout.mode: refine)")
    checks = {r["gen_id"]: r for r in store.read("checks", rid, rnd).filter(pl.col("purpose") == "repair")
              .iter_rows(named=True)}
    have = set(store.read("scores", rid, rnd)["gen_id"].to_list())
    rows = []
    for generation in gens.sort("gen_id").iter_rows(named=True):
        if generation["gen_id"] in have:
            continue
        turn = turns.get(generation["gen_id"])
        row = {"gen_id": generation["gen_id"], "query_id": generation["query_id"], "rep": 0, "attempt": 0,
               "complexity": 0.0, "cost": 0.0, "llm_calls": 0, "tokens_in": 0, "tokens_out": 0, "cost_usd": 0.0,
               "wall_s": 0.0}
        info = {"turn": generation["turn"], "task_id": generation["query_id"]}
        if turn is not None and not turn["skipped"]:
            rows.append(row | {"status": "ok", "score": turn["accuracy"], "metric": turn["accuracy"],
                               "details": json.dumps({"refine": info | {"validated": True, "items": turn["items"]}})})
            continue
        check = checks.get(generation["gen_id"])
        if check is None:
            raise ValueError(f"run {rid!r} round {rnd}: {generation['gen_id']} was neither validated nor self-checked; "
                             "finish the rollout first")
        why = failure(check["status"], check["answer"], check["error"]) or "not validated"
        status = "exec_error" if _transient(check["status"]) else check["status"]  # the rollout's decision is final
        rows.append(row | {"status": status, "score": 0.0, "metric": 0.0, "answer": check["answer"],
                           "error": f"self-check failed: {why}"[:4000],
                           "details": json.dumps({"refine": info | {"validated": False}})})
    store.write("scores", rows, rid, rnd)
    by_status: dict[str, int] = {}
    for s in store.read("scores", rid, rnd)["status"]:
        by_status[s] = by_status.get(s, 0) + 1
    ctx.finish("score", runs=gens.height, workflows=gens.height, by_status=by_status, refine=True)
    return {"ran": 0, "written": len(rows), "runs": gens.height, "by_status": by_status, "left": 0, "done": True}


# ---- curation ------------------------------------------------------------------------------------------------------


def curate_refine(ctx, generation_scores: pl.DataFrame) -> tuple[list[dict], dict]:
    """`groups` rows of a refine round from its `turns` rows, per (task, turn), over the candidates that were not
    skipped (in slot order): a `weighted` row (member_scores = accuracies, weights = exp(RLAO reward /
    curation.rwr_temperature), kept) for `training.objective: rwr`, and a `group` row (GRPO advantages of the
    accuracies, kl_mask = advantage > 0, kept when the accuracies vary) for the GRPO objectives. A turn whose
    candidates were all skipped gets one `weighted` row, not kept. `generation_scores`: the round's (load_round);
    every member must be in it."""
    curation = ctx.cfg.curation
    turns = ctx.store.read("turns", ctx.run_id, ctx.round).sort(["task_id", "turn", "slot"])
    if turns.height == 0:
        raise RuntimeError(f"run {ctx.run_id!r} round {ctx.round}: no refine turns to curate (rollout.mode: refine)")
    known = set(generation_scores["gen_id"].to_list())
    rows: list[dict] = []
    for (task_id, turn), grp in turns.group_by(["task_id", "turn"], maintain_order=True):
        live = grp.filter(~pl.col("skipped"))
        gid = f"{task_id}/t{turn}"
        if live.height == 0:
            rows.append(group_row(task_id, f"{gid}/weighted", "flat", grp["gen_id"].to_list(),
                                   [None] * grp.height, kept=False, kind="weighted",
                                   reason=f"all {grp.height} candidates skipped (self-check failed after the repairs)"))
            continue
        members, accs, rewards = live["gen_id"].to_list(), live["accuracy"].to_list(), live["reward"].to_list()
        missing = sorted(set(members) - known)
        if missing:
            raise RuntimeError(f"refine candidates without a generation or score: {missing[:5]}")
        rows.append(group_row(task_id, f"{gid}/weighted", "flat", members, accs, kept=True, kind="weighted",
                              weights=rwr_weights(rewards, curation.rwr_temperature)))
        adv = group_advantages(accs, curation.eps_adv)
        var = float(np.var(accs))
        flat = None if var > 0 else f"no variance: all {len(accs)} candidates scored {accs[0]:g}"
        rows.append(group_row(task_id, f"{gid}/group", "flat", members, accs, kept=var > 0, advantages=adv,
                         reason=flat))
    kept = [r for r in rows if r["kept"]]
    counts = {"level": "refine", "tasks": turns["task_id"].n_unique(),
              "turns": turns.select("task_id", "turn").unique().height, "candidates": turns.height,
              "skipped": int(turns["skipped"].sum()), "advanced": int(turns["advanced"].sum()),
              "groups_kept": sum(1 for r in kept if r["kind"] == "group"),
              "weighted_kept": sum(1 for r in kept if r["kind"] == "weighted"),
              "sequences": len({g for r in kept for g in r["members"]})}
    return rows, counts
