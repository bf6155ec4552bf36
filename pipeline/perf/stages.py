"""`pipeline bench stages RUN`: where a run's wall time went, per round and stage, from its timings.jsonl
(pipeline.stages.runner.record_timing): each stage's seconds and share of the whole. A seed of an experiment
(`<experiment>-s<k>`) comes with its evaluations (`<seed>-eval-*`, their own runs), so one command gives the seed's
whole cost. The last attempt of each stage that did work counts (`pipeline.studies.report.stage_timings`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.store import Store
from pipeline.studies.report import stage_timings


@dataclass(frozen=True)
class StageTime:
    part: str  # "run" for the run itself, else the evaluation's suffix (eval-r0, eval-base, ...)
    round: int
    stage: str
    wall_s: float
    machine: str | None  # the CPU kind that took it (None: a line written before lines named it)


def evaluation_runs(store: Store, run_id: str) -> list[str]:
    """The runs that evaluate `run_id` (`<run_id>-eval-...`), in name order."""
    return [r for r in store.runs() if r.startswith(f"{run_id}-eval-")]


def breakdown(store: Store, run_id: str, evaluations: bool = True) -> list[StageTime]:
    """The stage times of `run_id` (and of its evaluation runs), in the order they ran within each run."""
    rows = []
    for run in [run_id, *(evaluation_runs(store, run_id) if evaluations else [])]:
        part = "run" if run == run_id else run[len(run_id) + 1:]
        rows += [StageTime(part, r["round"], r["stage"], r["wall_s"], r["machine"])
                 for r in stage_timings(store, run).iter_rows(named=True)]
    return rows


def render(run_id: str, rows: list[StageTime]) -> list[str]:
    """The table: one line per (part, round, stage) with its seconds and share of the total, a subtotal per part,
    then each stage's total over everything."""
    if not rows:
        return [f"{run_id}: no timed stage (timings.jsonl is written as stages finish)"]
    total = sum(r.wall_s for r in rows)
    machines = sorted({r.machine for r in rows if r.machine})
    out = [f"{run_id}: {total:.1f} s in {len(rows)} stages" + (f" on {', '.join(machines)}" if machines else ""),
           f"{'part':<14} {'round':>5}  {'stage':<10} {'wall s':>9} {'share':>6}"]

    def line(part: str, round_: str, stage: str, seconds: float) -> str:
        return f"{part:<14} {round_:>5}  {stage:<10} {seconds:>9.1f} {seconds / total:>6.1%}"

    for part in dict.fromkeys(r.part for r in rows):
        mine = [r for r in rows if r.part == part]
        out += [line(part, str(r.round), r.stage, r.wall_s) for r in mine]
        if len(mine) > 1:
            out.append(line(part, "all", "(total)", sum(r.wall_s for r in mine)))
    out.append("by stage:")
    for stage in dict.fromkeys(r.stage for r in rows):
        out.append(line("", "", stage, sum(r.wall_s for r in rows if r.stage == stage)))
    return out


def main(run_id: str, store_root: str, evaluations: bool = True, echo=print) -> list[StageTime]:
    store = Store(store_root)
    if not store.run_dir(run_id).is_dir():
        known = ", ".join(store.runs()[:10]) or "none"
        raise ValueError(f"no run {run_id!r} in store {store_root} (runs there: {known})")
    rows = breakdown(store, run_id, evaluations)
    for text in render(run_id, rows):
        echo(text)
    return rows
