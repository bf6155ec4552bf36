"""`pipeline bench crn`: do common random numbers narrow the paired intervals, at the same evaluation budget?

The arms are evaluation runs already in a store (e.g. one seed's base and last-round evaluations and the best fixed
workflow's reference run). Their workflows are kept as they are (no generator runs); only the executor's sampling
is redone. For each mode, without and with `executor.common_random_numbers`, every arm's queries and workflows
(the first `queries` queries every arm has) are copied into a fresh run of `<out>/<mode>/` and the real score stage
runs them against one executor server shared by the mode's arms, with the reply cache as an evaluation has it (a
sampled call is kept only when seeded). Then, per pair (a, b), the per-query Mean@L difference a − b and its 95%
bootstrap interval over queries; the figure is each pair's half-width with CRN over the half-width without (the
goal in docs/performance.md: at most 0.7). Executor tokens computed and the wall time of each mode are the cost.
Per arm and mode it also gives the share of queries whose workflows' scores are not all equal (`varied_share`, the
scores curation reads: mean over reps, 0 for an invalid workflow): with a training round as an arm, whether common
random numbers in training rollouts change how many training problems have score variance, the only ones GRPO
learns from.

Both modes score the same workflows on the same queries with the same calls: the budget is equal by construction.
A mode whose runs were scored before is resumed (the score stage skips what is done), so an interrupted bench
goes on where it stopped.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl

from pipeline.config import ConfigError, variant_sets
from pipeline.core.learning import bootstrap_ci
from pipeline.engines.servers import sharing
from pipeline.run import open_run
from pipeline.stages.runner import run_stage
from pipeline.store import Store
from pipeline.studies.evaluate import eval_summary
from pipeline.studies.formatting import num, round_s

log = logging.getLogger(__name__)

MODES = {"without": False, "with": True}  # executor.common_random_numbers of each mode


@dataclass(frozen=True)
class PairWidth:
    pair: str  # "a - b"
    mode: str
    mean: float
    lo: float
    hi: float

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2


@dataclass(frozen=True)
class ModeCost:
    mode: str
    wall_s: float
    computed_tokens: int  # executor tokens in + out actually computed (cache hits cost none)
    used_tokens: int  # executor tokens in + out the workflows used (what budgets compare: equal in both modes)


@dataclass(frozen=True)
class ArmVariance:
    arm: str
    mode: str
    queries: int
    varied: int  # queries whose workflows' scores are not all equal

    @property
    def share(self) -> float | None:
        return self.varied / self.queries if self.queries else None


@dataclass(frozen=True)
class CrnResult:
    """What the bench measured: each pair's interval per mode, the half-width ratios, each mode's cost."""

    source: str
    arms: dict[str, str]
    queries: int
    sets: list[str]
    widths: list[PairWidth]
    costs: list[ModeCost]
    variance: list[ArmVariance]

    @property
    def ratios(self) -> dict[str, float | None]:
        """Half-width with CRN / without, per pair (None where the one without is 0)."""
        return {p: ratio(self.widths, p) for p in dict.fromkeys(w.pair for w in self.widths)}

    def to_dict(self) -> dict:
        """As crn.json holds it."""
        return {"source": self.source, "arms": self.arms, "queries": self.queries, "sets": self.sets,
                "widths": [asdict(w) | {"half_width": w.half_width} for w in self.widths],
                "ratios": self.ratios, "costs": [asdict(c) for c in self.costs],
                "variance": [asdict(v) | {"varied_share": v.share} for v in self.variance]}

    def lines(self) -> list[str]:
        """What `pipeline bench crn` prints."""
        return ([f"{w.mode:>7} CRN  {w.pair}: {num(w.mean)} [{num(w.lo)}, {num(w.hi)}], half-width "
                 f"{num(w.half_width)}" for w in self.widths]
                + [f"{pair}: half-width with / without CRN {num(r, 2)}" for pair, r in self.ratios.items()]
                + [f"{c.mode:>7} CRN  executor tokens computed {c.computed_tokens} of {c.used_tokens} used, wall "
                   f"{c.wall_s} s in this invocation (a resumed mode: only what it scored now)" for c in self.costs]
                + [f"{v.mode:>7} CRN  arm {v.arm}: {v.varied} of {v.queries} queries with score variance "
                   f"({num(v.share)})" for v in self.variance])


def common_queries(src: Store, arms: dict[str, str], limit: int | None) -> list[str]:
    """The first `limit` query ids (sorted) that every arm's round 0 holds workflows for."""
    sets = []
    for name, rid in arms.items():
        if src.read_config(rid) is None:
            raise ConfigError(f"arm {name}: run {rid!r} not found under {src.root}")
        sets.append(set(src.read("generations", rid, 0)["query_id"].to_list()))
    shared = sorted(set.intersection(*sets))
    if not shared:
        raise ConfigError(f"the arms {', '.join(arms.values())} share no query")
    return shared[:limit] if limit else shared


def copy_arm(src: Store, dst: Store, run_id: str, queries: list[str]) -> None:
    """`run_id`'s frozen config, its queries and workflows (those of `queries`) and a rollout manifest into `dst`:
    a run whose score stage has not run. Nothing is copied twice: a resumed bench copies nothing, and a bench run
    again with more queries copies only the new ones and reopens the score stage, which then scores only them (it
    resumes by workflow and rep). A copy that fewer `queries` would not cover is refused: its intervals would mix
    in queries the bench was not asked for."""
    manifest = dst.manifest(run_id, 0, "rollout")
    have = set(dst.read("queries", run_id, 0)["query_id"].to_list()) if manifest else set()
    if extra := sorted(have - set(queries)):
        raise ConfigError(f"{dst.root} already holds {len(have)} queries of run {run_id}, {len(extra)} of them "
                          f"beyond the {len(queries)} asked for ({extra[0]}, ...): ask for at least {len(have)} "
                          "queries or give another --out")
    if manifest is not None and have == set(queries):
        return
    # the manifests go first: a copy cut off below is not done, and a rerun copies per table only what is missing
    dst.clear_manifest(run_id, 0, "score")
    dst.clear_manifest(run_id, 0, "rollout")
    dst.put_text(dst.run_dir(run_id) / "config.yaml", src.read_config(run_id))
    for table, key in (("queries", "query_id"), ("generations", "gen_id")):
        done = dst.read(table, run_id, 0)[key].to_list() if dst.parts(table, run_id) else []
        rows = src.read(table, run_id, 0).filter(pl.col("query_id").is_in(queries) & ~pl.col(key).is_in(done))
        dst.write(table, rows.drop("round", strict=False), run_id, 0)  # "round" is the partition's column
    gens = dst.read("generations", run_id, 0).height
    ctx = open_run(None, run_id, 0, None, str(dst.root))
    dst.write_manifest(run_id, 0, "rollout", ctx.frozen_hash, queries=len(queries), generations=gens,
                       copied_from=str(src.root))


def mode_cost(store: Store, mode: str, run_ids: list[str], wall_s: float) -> ModeCost:
    ids = ", ".join(f"'{r}'" for r in run_ids)
    row = store.sql("SELECT sum(coalesce(computed_tokens_in, tokens_in) + coalesce(computed_tokens_out, tokens_out)) "
                    "AS computed, sum(tokens_in + tokens_out) AS used FROM latest_scores "
                    f"WHERE round = 0 AND run_id IN ({ids})").row(0)
    return ModeCost(mode, round_s(wall_s), int(row[0] or 0), int(row[1] or 0))


def arm_variance(store: Store, arm: str, run_id: str, mode: str, reps: int) -> ArmVariance:
    """How many of the run's queries have workflows whose scores are not all equal, by the scores curation reads
    (`Store.generation_scores`: the mean over reps, null for an invalid workflow, read as 0 as curation does)."""
    df = store.generation_scores(run_id, 0, reps, ()).filter(pl.col("kind") == "workflow")
    per_query = df.group_by("query_id").agg(pl.col("score").fill_null(0.0).n_unique().alias("distinct"))
    return ArmVariance(arm, mode, per_query.height, int((per_query["distinct"] > 1).sum()))


def pair_width(per_query: dict[str, dict[str, float]], a: str, b: str, mode: str) -> PairWidth:
    shared = sorted(per_query[a].keys() & per_query[b].keys())
    ci = bootstrap_ci([per_query[a][q] - per_query[b][q] for q in shared])
    return PairWidth(f"{a} - {b}", mode, ci.mean, ci.lo, ci.hi)


def run_crn_bench(src_root: str | Path, arms: dict[str, str], pairs: list[tuple[str, str]], out: str | Path,
                  queries: int | None = None, sets: list[str] | None = None) -> CrnResult:
    """The bench (module docstring); returns and writes `<out>/crn.json`. `sets`: overrides for every scoring of
    both modes (e.g. `executor.serve.dtype=auto` for runs frozen with bf16 on a CPU where it is slow)."""
    for a, b in pairs:
        if a not in arms or b not in arms:
            raise ConfigError(f"pair {a} - {b}: arms are {', '.join(arms)}")
    src = Store(str(src_root))
    shared = common_queries(src, arms, queries)
    widths, costs, variance = [], [], []
    for mode, on in MODES.items():
        dst = Store(str(Path(out) / mode))
        for rid in arms.values():
            copy_arm(src, dst, rid, shared)
        mode_sets = variant_sets({"executor.common_random_numbers": on}, before=sets)
        cfg = open_run(None, next(iter(arms.values())), 0, mode_sets, str(dst.root)).cfg
        t0 = time.perf_counter()
        with sharing(cfg, dst.root / "server-logs"):  # one executor server for every arm of the mode
            for name, rid in arms.items():
                log.info("crn bench: %s CRN, arm %s (%s), %d queries", mode, name, rid, len(shared))
                run_stage("score", rid, 0, str(dst.root), mode_sets)
        costs.append(mode_cost(dst, mode, list(arms.values()), time.perf_counter() - t0))
        variance += [arm_variance(dst, name, rid, mode, cfg.scoring.reps) for name, rid in arms.items()]
        per_query = {name: {q["query_id"]: q["mean_at_l"] for q in eval_summary(dst, rid).per_query}
                     for name, rid in arms.items()}
        widths += [pair_width(per_query, a, b, mode) for a, b in pairs]
    result = CrnResult(str(src_root), arms, len(shared), list(sets or []), widths, costs, variance)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "crn.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def ratio(widths: list[PairWidth], pair: str) -> float | None:
    """Half-width with CRN / without, for `pair` (None where the one without is 0)."""
    by_mode = {w.mode: w.half_width for w in widths if w.pair == pair}
    return by_mode["with"] / by_mode["without"] if by_mode.get("without") else None
