"""`pipeline bench seed CONFIG`: one seed of an experiment as it ran before the executor cache and after (the
cache's goal: after, at most 0.4x the wall time of before, on the same machine).

Each variant is the experiment's first seed (`--seeds 1`: its rounds, the evaluations it needs and the references
on the held-out split and on `experiment.select_split`) in a store of its own, `<out>/<variant>/`, run one after the
other so that each has the whole machine:
- `before`: no reply cache, no cached grader verdicts, no common random numbers, every round evaluated (the
  defaults before the executor cache existed);
- `after`: the defaults (the cache, seeded evaluations and references, the base model and the last round
  evaluated);
- `after_seeded_training` (on request): the defaults with seeded training rollouts too
  (`executor.common_random_numbers`), whose repeated calls in later rounds the cache answers.

The figures are the experiment's own stage timings (`--status`'s rows: the last run of each stage that did work),
summed per part and stage, with the executor calls the reply cache answered, and the machine of every timing: a
bench resumed in another session on another kind of machine says so. Re-running resumes each variant where it
stopped (finished stages are skipped), so the bench may span sessions.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.config import as_sets, variant_sets
from pipeline.stages.rounds import study_config
from pipeline.store import Store, store_for
from pipeline.studies.experiment import plan, status, timing_machines
from pipeline.studies.formatting import num, round_s

log = logging.getLogger(__name__)

VARIANTS: dict[str, dict[str, Any]] = {
    "before": {"executor.cache": "off", "scoring.cache_verdicts": False, "experiment.common_random_numbers": False,
               "experiment.eval_rounds": "all"},
    "after": {},
    "after_seeded_training": {"executor.common_random_numbers": True},
}
GOAL = 0.4  # the executor cache's goal: a seed after the cache at most 0.4x its wall time before


@dataclass(frozen=True)
class PartTime:
    variant: str
    part: str  # status's part: train, evaluate, reference, reference on <split>
    stage: str
    wall_s: float
    stages: int  # stages timed
    calls: int | None  # executor calls of the part's runs (score stage only), None where it has none
    cached: int | None  # of them answered by the reply cache


@dataclass
class SeedBench:
    config: str
    out: str
    variants: list[str]
    parts: list[PartTime]
    machines: dict[str, dict[str, int]]  # variant -> machine -> stages timed there

    def total(self, variant: str) -> float:
        return sum(p.wall_s for p in self.parts if p.variant == variant)

    def ratio(self, variant: str, base: str = "before") -> float | None:
        b = self.total(base)
        return self.total(variant) / b if b else None

    def to_dict(self) -> dict:
        return {**asdict(self), "totals": {v: round_s(self.total(v)) for v in self.variants},
                "ratios": {v: self.ratio(v) for v in self.variants if v != "before"}, "goal": GOAL}

    def lines(self) -> list[str]:
        head = ["part / stage", *(f"{v} s" for v in self.variants), *(f"{v} cache hits" for v in self.variants)]
        rows = []
        for part, stage in dict.fromkeys((p.part, p.stage) for p in self.parts):
            got = {p.variant: p for p in self.parts if (p.part, p.stage) == (part, stage)}
            cells = [num(got[v].wall_s, 0) if v in got else "" for v in self.variants]
            cells += [f"{got[v].cached} of {got[v].calls}" if v in got and got[v].calls else "" for v in self.variants]
            rows.append([f"{part} / {stage}", *cells])
        rows.append(["total", *(num(self.total(v), 0) for v in self.variants), *("" for _ in self.variants)])
        out = [" | ".join(head), *(" | ".join(r) for r in rows)]
        out += [f"{v}: {num(r, 3)}x before (goal: at most {GOAL}x)" for v in self.variants
                if v != "before" and (r := self.ratio(v)) is not None]
        out += [f"{v} timed on: " + "; ".join(f"{m}: {n} stages" for m, n in ms.items())
                for v, ms in self.machines.items()]
        return out


def variant_changes(variant: str, out: str | Path) -> dict[str, Any]:
    """A variant's changes: its store, what it turns off or on (the caller's `--set` values come after them)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    return {"store.root": str(Path(out) / variant), **VARIANTS[variant]}


def cache_use(store: Store, run_ids: list[str]) -> tuple[int, int] | None:
    """(executor calls, of them answered by the cache) of the runs' latest scoring attempts; None without calls."""
    df = store.sql("SELECT sum(llm_calls)::BIGINT AS calls, sum(coalesce(cached_calls, 0))::BIGINT AS cached "
                   "FROM latest_scores WHERE list_contains($runs, run_id)", {"runs": run_ids})
    calls, cached = df.row(0)
    return (int(calls), int(cached)) if calls else None


def variant_parts(config: str | Path, variant: str, out: str | Path, sets: list[str] | None) -> tuple[
        list[PartTime], dict[str, int]]:
    """A variant's timed stages summed per (part, stage) in plan order, with the score stages' cache use, and the
    machines that took them."""
    _, _, cfg = study_config(config, variant_sets(variant_changes(variant, out), after=sets), None)
    store = store_for(cfg.store)
    rows = status(store, cfg, [p.seed for p in plan(cfg, [0])])
    parts: list[PartTime] = []
    for part, stage in dict.fromkeys((r["part"], r["stage"]) for r in rows):
        mine = [r for r in rows if (r["part"], r["stage"]) == (part, stage) and r["done"] and r["wall_s"]]
        if not mine:
            continue
        use = cache_use(store, sorted({r["run_id"] for r in mine})) if stage == "score" else None
        parts.append(PartTime(variant, part, stage, round_s(sum(r["wall_s"] for r in mine)), len(mine),
                              use[0] if use else None, use[1] if use else None))
    return parts, timing_machines(rows)


def run_seed_bench(config: str | Path, out: str | Path, call, variants: list[str] | None = None,
                   sets: list[str] | None = None) -> SeedBench:
    """Run each variant's seed (resuming what is done) through `call` (a stage caller), then read the timings; writes
    `<out>/seed-bench.json`."""
    from pipeline.studies.experiment import run_experiment

    variants = variants or ["before", "after"]
    if "before" not in variants:
        raise ValueError("bench seed: the variants must hold `before`, the baseline of every ratio")
    for variant in variants:  # every name checked before anything runs
        variant_changes(variant, out)
    for variant in variants:
        log.info("bench seed: variant %s (%s)", variant, ", ".join(as_sets(VARIANTS[variant])) or "the defaults")
        run_experiment(config, call, seeds=1, sets=variant_sets(variant_changes(variant, out), after=sets))
    parts, machines = [], {}
    for variant in variants:
        got, machines[variant] = variant_parts(config, variant, out, sets)
        parts += got
    bench = SeedBench(str(config), str(out), variants, parts, machines)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "seed-bench.json").write_text(json.dumps(bench.to_dict(), indent=2) + "\n")
    return bench
