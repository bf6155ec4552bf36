"""The arm a verdict reads, chosen on dev (`pipeline arms EXPERIMENT...`): several experiments on one task (arms
that differ in what they train on, e.g. the mixed task's A, B and C in configs/mixed-route.yaml) each evaluate their
seeds' last round on the held-out split and, with `experiment.select_eval`, on the selection split (dev). The rule,
fixed before any held-out number is read: the arm whose `seed`'s last round scores the highest Mean@L on dev (ties:
the first arm named). Until every arm has that dev evaluation no arm is chosen, and no verdict is read.

Nothing here computes a number of its own: each arm's row is read from its experiment's summary (experiment.json),
and the chosen arm's verdict is the one its summary holds, so that the page that states it prints what the files
hold. The choice is written beside the experiments' summaries (`<store>/experiments/arms/<a>+<b>+....json`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.records import Record
from pipeline.studies.formatting import NA, num
from pipeline.studies.summaries import ExperimentSummary, Verdict


@dataclass(kw_only=True)
class ArmRow(Record):
    """One arm: its experiment, the seeds evaluated on the held-out split, the rule seed's dev Mean@L (None: not
    evaluated on dev yet), the mean over every seed evaluated on dev (a figure to read, not the rule), the last round's
    held-out Mean@L over its seeds, and whether its own criterion is met (None: not readable)."""

    arm: str
    seeds: list[int] = field(default_factory=list)
    last_round: int = 0
    dev_mean_at_l: float | None = None
    dev_seeds: list[int] = field(default_factory=list)
    dev_mean_all_seeds: float | None = None
    held_out_mean_at_l: float | None = None
    criterion_met: bool | None = None


@dataclass(kw_only=True)
class ArmChoice(Record):
    """The arms compared on dev, the one chosen (None until every arm has the rule seed's dev evaluation), and that
    arm's verdict as its summary holds it."""

    rule: str
    seed: int
    arms: list[ArmRow] = field(default_factory=list)
    chosen: str | None = None
    waiting_for: list[str] = field(default_factory=list)  # arms without the rule seed's dev evaluation yet
    verdict: Verdict | None = None
    written: str | None = None  # the file it was written to; returned, not stored
    NESTED = {"arms": ArmRow, "verdict": Verdict}
    OPTIONAL = ("written",)

    def lines(self) -> list[str]:
        out = [f"rule: {self.rule}"]
        out += [f"  {r.arm}: dev Mean@L (seed {self.seed}) {num(r.dev_mean_at_l)}; over seeds {r.dev_seeds or NA} "
                f"{num(r.dev_mean_all_seeds)}; held-out round {r.last_round} over seeds {r.seeds or NA} "
                f"{num(r.held_out_mean_at_l)}" for r in self.arms]
        if self.chosen is None:
            out.append(f"no arm chosen: waiting for seed {self.seed}'s dev evaluation of {', '.join(self.waiting_for)}")
            return out
        seeds = next(r.seeds for r in self.arms if r.arm == self.chosen)
        out.append(f"chosen on dev: {self.chosen}; its verdict reads the seeds evaluated so far, {seeds}")
        if self.verdict is None:
            out.append(f"{self.chosen}'s summary holds no verdict (experiment.criterion)")
        else:
            out += self.verdict.lines()
        return out

    def markdown(self) -> str:
        rows = [f"| arm | dev Mean@L, seed {self.seed} (the rule) | dev Mean@L, every seed evaluated there | "
                "held-out Mean@L, last round, its seeds | its criterion |", "|---|---|---|---|---|"]
        met = {True: "met", False: "not met", None: "not readable yet"}
        for r in self.arms:
            mark = "**" if r.arm == self.chosen else ""
            rows.append(f"| {mark}{r.arm}{mark} | {num(r.dev_mean_at_l)} | {num(r.dev_mean_all_seeds)} "
                        f"({', '.join(map(str, r.dev_seeds)) or 'none'}) | {num(r.held_out_mean_at_l)} "
                        f"({', '.join(map(str, r.seeds)) or 'none'}) | {met[r.criterion_met]} |")
        chosen = (f"Chosen on dev: **{self.chosen}**." if self.chosen else
                  f"No arm chosen yet: {', '.join(self.waiting_for)} lack seed {self.seed}'s dev evaluation.")
        return "\n".join(rows) + "\n\n" + chosen


def arm_row(summary: ExperimentSummary, seed: int) -> ArmRow:
    """An arm's row, read from its experiment's summary."""
    last = summary.rounds - 1
    dev = {a.seed: a.mean_at_l for a in summary.select_arms if a.round == last and a.mean_at_l is not None}
    held = [p.mean for p in summary.curve if p.metric == "mean_at_l" and p.round == last]
    return ArmRow(arm=summary.experiment, seeds=list(summary.seeds), last_round=last, dev_mean_at_l=dev.get(seed),
                  dev_seeds=sorted(dev), dev_mean_all_seeds=sum(dev.values()) / len(dev) if dev else None,
                  held_out_mean_at_l=held[0] if held else None,
                  criterion_met=None if summary.verdict is None else summary.verdict.met)


def choose_arm(summaries: list[ExperimentSummary], seed: int = 0) -> ArmChoice:
    """The arm with the highest dev Mean@L of seed `seed`'s last round (ties: the first named), once every arm has
    it; with that arm's verdict."""
    if len({s.experiment for s in summaries}) != len(summaries) or not summaries:
        raise ValueError(f"arms: name each experiment once (got {[s.experiment for s in summaries]})")
    rows = [arm_row(s, seed) for s in summaries]
    rule = (f"the highest Mean@L on the selection split (dev) of seed {seed}'s last round (experiment.select_eval); "
            "ties: the first arm named")
    waiting = [r.arm for r in rows if r.dev_mean_at_l is None]
    if waiting:
        return ArmChoice(rule=rule, seed=seed, arms=rows, waiting_for=waiting)
    best = max(range(len(rows)), key=lambda i: (rows[i].dev_mean_at_l, -i))
    return ArmChoice(rule=rule, seed=seed, arms=rows, chosen=rows[best].arm, verdict=summaries[best].verdict)
