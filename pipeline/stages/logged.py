"""Logged rows: a round takes scored rows of other runs of the store as training data (`rollout.logged`), offline
GRPO proper. The rollout stage imports them before it samples: each becomes a `generations` row of this round with
`source = logged` and `logged_from` naming where it came from, and its scores are copied, so the score stage has
nothing to run for it and curation groups it with the round's own samples.

What a row is trained on, and with which behaviour probability μ (its `token_logprobs`):
- a fixed design's run (its code is a menu design's, up to comments) under `rollout.route_or_write`: the completion is
  the design's label token under this round's prompt, as if the policy had routed to it; μ = 1/K, K the designs
  logged for the query (the sweep that ran each design on every query is a uniform logging policy);
- a sampled row (an earlier round, another seed, `pipeline import`): its own tokens and logged log-probs, only if
  this round's prompt renders to the same prompt tokens.
A row that cannot be used is refused with an error naming the run and the row, never silently dropped: no score, no
log-probs, a prompt that no longer renders the same, or a query outside the training split. Rows of training queries
that this round does not sample (benchmark.max_queries) are left for rounds that do.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import polars as pl

from pipeline.core.designs import similarity
from pipeline.engines.workflow import extract_code
from pipeline.store.schema import FINAL_STATUSES

log = logging.getLogger(__name__)


class LoggedRowError(ValueError):
    """A logged row that cannot be trained on: the message names the run, the round and the row."""


@dataclass(frozen=True)
class LoggedRow:
    source: str  # <run>/<round>/<gen_id>
    query_id: str
    design: str | None  # the menu design its code is (route_or_write import), else None (a sampled row)
    generation: dict
    scores: list[dict]


def logged_gen_id(round: int, query_id: str, source: str) -> str:
    """This round's id of a logged row: deterministic, so a resumed rollout imports nothing twice."""
    return f"r{round}-{query_id}-logged-{hashlib.sha1(source.encode()).hexdigest()[:12]}"


def exact_design(code: str, menu: dict[str, str]) -> str | None:
    """The menu design whose program `code` is (up to comments and layout), else None."""
    return next((name for name, snippet in menu.items() if similarity(code, snippet) == 1.0), None)


def read_logged(store, run: str, round: int, menu: dict[str, str], route_or_write: bool) -> list[LoggedRow]:
    """Every workflow row of (run, round) with its latest score attempts; a LoggedRowError for a run that holds none
    or a row without a final score."""
    gens = store.read("generations", run, round).filter(pl.col("kind") == "workflow").unique("gen_id", keep="first")
    if gens.height == 0:
        known = ", ".join(store.runs()[:8])
        raise LoggedRowError(f"rollout.logged: run {run!r} round {round} has no workflow rows in {store.root} "
                             f"(runs there: {known}, ...)")
    scores = store.read("scores", run, round)
    latest = (scores.sort("attempt").group_by("gen_id", "rep", maintain_order=True).last()
              if scores.height else scores)
    by_gen: dict[str, list[dict]] = {}
    for row in latest.iter_rows(named=True):
        by_gen.setdefault(row["gen_id"], []).append(row)
    out = []
    for gen in gens.sort("gen_id").iter_rows(named=True):
        source = f"{run}/{round}/{gen['gen_id']}"
        runs = by_gen.get(gen["gen_id"], [])
        if not runs or any(r["status"] not in FINAL_STATUSES or r["status"] == "error" for r in runs):
            states = sorted({r["status"] for r in runs}) or ["unscored"]
            raise LoggedRowError(f"rollout.logged: row {source} has no final score ({', '.join(states)}): score that "
                                 f"run first (`pipeline score ... --run-id {run} --round {round} --only-failed`)")
        design = exact_design(extract_code(gen["text"] or ""), menu) if route_or_write else None
        out.append(LoggedRow(source, gen["query_id"], design, gen, runs))
    return out


def behaviour_logprobs(rows: list[LoggedRow]) -> dict[str, float]:
    """log μ of each design row: -log K_q, K_q the distinct designs logged for its query (a uniform sweep)."""
    designs: dict[str, set[str]] = {}
    for r in rows:
        if r.design is not None:
            designs.setdefault(r.query_id, set()).add(r.design)
    return {r.source: -math.log(len(designs[r.query_id])) for r in rows if r.design is not None}


def _own(row: dict) -> dict:
    """A row read from another run without what the store fills for the run it is written to."""
    return {k: v for k, v in row.items() if k not in ("run_id", "round", "created_at")}


def import_logged(ctx, sampler, train_ids: set[str]) -> int:
    """Import the rows of `rollout.logged` on this round's queries (see the module doc); returns the rows written now.
    `sampler` renders this round's prompts (pipeline.stages.rollout.Sampler); `train_ids`: the whole training split."""
    rollout = ctx.cfg.rollout
    if not rollout.logged:
        return 0
    round_items = {it.id: it for it in sampler.items}
    rows = [r for src in rollout.logged for r in read_logged(ctx.store, src.run, src.round, sampler.menu_code,
                                                         rollout.route_or_write)]
    outside = [r for r in rows if r.query_id not in train_ids]
    if outside:
        raise LoggedRowError(f"rollout.logged: {len(outside)} rows are on queries outside the training split "
                             f"{ctx.cfg.benchmark.train_split!r}, e.g. row {outside[0].source} (query "
                             f"{outside[0].query_id!r}): training on them would leak held-out queries")
    rows = [r for r in rows if r.query_id in round_items]
    have = set(ctx.store.read("generations", ctx.run_id, ctx.round)["gen_id"].to_list())
    scored = set(ctx.store.read("scores", ctx.run_id, ctx.round)["gen_id"].to_list())
    behaviour = behaviour_logprobs(rows)
    prompts: dict[str, tuple[str, list[int]]] = {}
    generations, scores = [], []
    for row in rows:
        gid = logged_gen_id(ctx.round, row.query_id, row.source)
        if row.query_id not in prompts:
            req = sampler.workflow_request(round_items[row.query_id])
            prompts[row.query_id] = (req.prompt_text,
                                     sampler.tokenizer(req.prompt_text, add_special_tokens=False).input_ids)
        prompt_text, prompt_ids = prompts[row.query_id]
        gen = row.generation
        if row.design is not None:
            token_ids, logprobs = [sampler.choice_tokens[row.design]], [behaviour[row.source]]
        else:
            tokens, logged = gen["token_ids"] or [], gen["token_logprobs"] or []
            if not tokens or len(logged) != len(tokens):
                raise LoggedRowError(f"rollout.logged: row {row.source} has no behaviour log-probs for its "
                                     f"{len(tokens)} tokens (a fixed program's run is usable only as a "
                                     "menu design under rollout.route_or_write)")
            if list(gen["prompt_token_ids"] or []) != list(prompt_ids):
                raise LoggedRowError(f"rollout.logged: row {row.source} was sampled under another prompt than this "
                                     f"round renders for query {row.query_id!r} "
                                     f"({len(gen['prompt_token_ids'] or [])} vs "
                                     f"{len(prompt_ids)} tokens): its tokens' probabilities are not comparable")
            token_ids, logprobs = list(tokens), list(logged)
        if gid not in have:
            generations.append(_own(gen) | dict(
                gen_id=gid, query_id=row.query_id, slot=None, parent_id=None, prompt_text=prompt_text,
                prompt_token_ids=prompt_ids, token_ids=token_ids, token_logprobs=logprobs,
                adapter_round=None, exemplar_ids=[], attempt=0, source="logged", logged_from=row.source,
                choice=row.design if row.design is not None else gen.get("choice")))
        if gid not in scored:
            scores += [_own(s) | {"gen_id": gid, "query_id": row.query_id} for s in row.scores]
    # generations first: a crash between the two writes leaves rows whose scores the next attempt copies
    ctx.store.write("generations", generations, ctx.run_id, ctx.round)
    ctx.store.write("scores", scores, ctx.run_id, ctx.round)
    if generations:
        log.info("rollout round %d: %d logged rows imported from %s (%d designs' runs)", ctx.round, len(generations),
                 ", ".join(f"{s.run}/{s.round}" for s in rollout.logged), sum(r.design is not None for r in rows))
    return len(generations)


IMPORT_FIELDS = ("query_id", "text", "prompt_token_ids", "token_ids", "token_logprobs", "score")


def import_file(store, run_id: str, path: str, round: int = 0) -> int:
    """`pipeline import`: rollouts logged elsewhere, one record a row with IMPORT_FIELDS (the prompt's and the
    completion's token ids under the generator's tokenizer, the completion's per-token log-probs as sampled, the score
    in [0, 1]): a JSONL file, a JSON array or a Parquet table (`pipeline.engines.benchmarks.files.read_rows`), written
    as run `run_id` round `round` of the store: a `generations` row (source `imported`) and a `scores` row each.
    Every bad row is reported in one pass (a ValueError naming each) and nothing is written; a run that holds rows
    already is refused. A config then names the run in `rollout.logged`."""
    from pipeline.engines.benchmarks.files import read_rows

    if store.read("generations", run_id, round).height:
        raise ValueError(f"run {run_id!r} round {round} already holds rows in {store.root}; import into a new run id")
    problems, gens, scores = [], [], []
    for number, row in enumerate(read_rows(path, keep_bad=True), 1):
        where, data = row.where, row.data
        if row.problem is not None:
            problems.append(f"{where}: {row.problem}")
            continue
        missing = [k for k in IMPORT_FIELDS if data.get(k) is None or (isinstance(data[k], str | list)
                                                                        and len(data[k]) == 0)]
        if missing:
            problems.append(f"{where}: missing {', '.join(missing)}")
            continue
        if len(data["token_logprobs"]) != len(data["token_ids"]):
            problems.append(f"{where}: {len(data['token_logprobs'])} log-probs for {len(data['token_ids'])} tokens")
        score = data["score"]
        if not isinstance(score, int | float) or not 0 <= score <= 1:
            problems.append(f"{where}: score {score!r} is not a number in [0, 1]")
        gid = f"r{round}-{data['query_id']}-imported-{number}"
        gens.append(dict(gen_id=gid, kind="workflow", query_id=str(data["query_id"]), slot=None,
                         prompt_text=data.get("prompt_text"), text=data["text"],
                         prompt_token_ids=list(data["prompt_token_ids"]), token_ids=list(data["token_ids"]),
                         token_logprobs=list(data["token_logprobs"]), model=data.get("model"), valid=True, attempt=0,
                         source="imported", logged_from=where))
        scores.append(dict(gen_id=gid, query_id=str(data["query_id"]), rep=0, attempt=0, status="ok",
                           score=float(score), metric=float(score)))
    if problems:
        raise ValueError(f"{path}: {len(problems)} bad rows, nothing imported:\n  " + "\n  ".join(problems))
    if not gens:
        raise ValueError(f"{path}: no rows")
    store.write("generations", gens, run_id, round)
    store.write("scores", scores, run_id, round)
    return len(gens)
