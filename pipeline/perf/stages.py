"""`pipeline bench stages RUN`: where a run's wall time went, per round and stage, from its timings.jsonl
(pipeline.stages.runner.record_timing): each stage's seconds and share of the whole. A seed of an experiment
(`<experiment>-s<k>`) comes with its evaluations (`<seed>-eval-*`, their own runs), so one command gives the seed's
whole cost. The last attempt of each stage that did work counts (`pipeline.studies.report.stage_timings`).
With `--against STORE` the same run in another store (a baseline: another commit's or another setting's seed on the
same machine) stands beside it, and each line says this run's seconds as a ratio of the baseline's."""

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


def render_against(run_id: str, rows: list[StageTime], base: list[StageTime]) -> list[str]:
    """The run beside its baseline: per (part, round, stage) both seconds and this run's as a ratio of the baseline's
    ("-" where one side has no such stage), a subtotal per part, each stage's total, and the whole."""
    def key(r: StageTime) -> tuple[str, str, str]:
        return r.part, str(r.round), r.stage

    mine, theirs = {key(r): r.wall_s for r in rows}, {key(r): r.wall_s for r in base}
    machines = sorted({r.machine for r in [*rows, *base] if r.machine})
    out = [f"{run_id} against its baseline" + (f" on {', '.join(machines)}" if machines else ""),
           f"{'part':<14} {'round':>5}  {'stage':<10} {'baseline s':>10} {'this s':>9} {'ratio':>6}"]

    def line(part: str, round_: str, stage: str, old: float | None, new: float | None) -> str:
        ratio = f"{new / old:>6.2f}" if old and new is not None else f"{'-':>6}"
        return (f"{part:<14} {round_:>5}  {stage:<10} {'-' if old is None else f'{old:.1f}':>10} "
                f"{'-' if new is None else f'{new:.1f}':>9} {ratio}")

    def total(side: dict[tuple[str, str, str], float], ks: list[tuple[str, str, str]]) -> float | None:
        """The side's seconds over `ks`; None where it ran none of them (a part not run yet is not 0 s)."""
        return sum(side[k] for k in ks if k in side) if any(k in side for k in ks) else None

    keys = list(dict.fromkeys([*mine, *theirs]))
    for part in dict.fromkeys(k[0] for k in keys):
        in_part = [k for k in keys if k[0] == part]
        out += [line(*k, theirs.get(k), mine.get(k)) for k in in_part]
        if len(in_part) > 1:
            out.append(line(part, "all", "(total)", total(theirs, in_part), total(mine, in_part)))
    out.append("by stage:")
    for stage in dict.fromkeys(k[2] for k in keys):
        of_stage = [k for k in keys if k[2] == stage]
        out.append(line("", "", stage, total(theirs, of_stage), total(mine, of_stage)))
    out.append(line("", "", "(whole)", total(theirs, keys), total(mine, keys)))
    return out


def _rows(store_root: str, run_id: str, evaluations: bool) -> list[StageTime]:
    store = Store(store_root)
    if not store.run_dir(run_id).is_dir():
        known = ", ".join(store.runs()[:10]) or "none"
        raise ValueError(f"no run {run_id!r} in store {store_root} (runs there: {known})")
    return breakdown(store, run_id, evaluations)


def main(run_id: str, store_root: str, evaluations: bool = True, echo=print,
         against: str | None = None) -> list[StageTime]:
    rows = _rows(store_root, run_id, evaluations)
    if against is None:
        lines = render(run_id, rows)
    else:
        lines = render_against(run_id, rows, _rows(against, run_id, evaluations))
    for text in lines:
        echo(text)
    return rows
