"""Study results as typed records: an evaluation's summary (`EvalSummary`: what `eval_summary` computes for any run
whose round 0 holds workflows), the learning experiment's (`ExperimentSummary`), the objective ablation's
(`AblationSummary`) and the methods comparison's (`MethodsSummary`), with the parts of a fixed shape they share: a
paired difference with its intervals (`PairedDiff`, per round `RoundDiff` or per arm `ArmDiff`), a reference arm, a
point of the held-out curve, the best fixed workflow's choice, an arm's row.

Each is built where its study computes it, read back with `from_dict` from the JSON the study wrote, and formats its
own lines (pipeline.studies.formatting). `to_dict` gives back exactly the dict a record was read from, keys in their
order, so JSON written before stays the same byte for byte; a key the stored dict lacks (written before that figure
existed) reads as the field's default, and a key no field names is kept in `extra` (e.g. a study's run facts: its
command, config, --set and wall seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.headroom import Point, pareto
from pipeline.core.learning import METRICS
from pipeline.core.records import Record
from pipeline.studies.formatting import (
    metric_name,
    metrics_phrase,
    num,
    round_name,
    signed,
    span,
    tokens_phrase,
)

BASE = -1  # the round index of the base model in evaluations
BASE_ARM = "base"  # the base model's arm in the ablation and the methods comparison
REFERENCE_ARM = "spogw"  # the methods comparison pairs every arm with this one too
BEST_FIXED_ARM = "task_best"  # ... and with the best fixed workflow chosen on dev (the baseline baselines.TASK_BEST)


# ---- an evaluation ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EvalSummary(Record):
    """What `eval_summary` (pipeline.studies.evaluate) computes for a run whose round 0 holds workflows."""

    eval_run_id: str
    queries: int
    mean_at_l: float | None = None
    best_at_l: float | None = None
    majority_at_l: float | None = None
    valid_share: float | None = None
    workflows: int = 0
    pending: int = 0
    gen_tokens_per_query: float | None = None
    exec_tokens_per_query: float | None = None
    exec_computed_tokens_per_query: float | None = None
    exec_calls_per_query: float | None = None
    cost_usd_per_query: float | None = None
    cache_hit_rate: float | None = None
    truncated_share: float | None = None
    status: dict[str, int] = field(default_factory=dict)
    per_query: list[dict] = field(default_factory=list)
    # `extra` holds the keys beyond the common ones, in their order: `select_at_l` (two-level runs), `selected`
    # (task-best), ...

    @property
    def select_at_l(self) -> float | None:
        return self.extra.get("select_at_l")

    @property
    def selected(self) -> dict | None:
        """task_best's choice per task (pipeline.studies.baselines)."""
        return self.extra.get("selected")

    @property
    def selection_run(self) -> str | None:
        """task_best: the run in which it chose each task's program."""
        return self.extra.get("selection_run")

    @property
    def workflow_runs_per_query(self) -> float | None:
        """SMC: look-ahead and scoring runs per query (pipeline.studies.smc.executed_per_query)."""
        return self.extra.get("workflow_runs_per_query")

    def phrase(self, more: str = "") -> str:
        """`Mean@L .., Best@L ..[, Sel@L ..], Majority@L .., valid .., tokens/query ..[, more], status {...}`."""
        metrics = metrics_phrase(self.mean_at_l, self.best_at_l, self.majority_at_l, self.select_at_l,
                                 "select_at_l" in self.extra)
        return (f"{metrics}, valid {num(self.valid_share, 2)}, "
                f"{tokens_phrase(self.gen_tokens_per_query, self.exec_tokens_per_query)}"
                f"{', ' + more if more else ''}, status {self.status}")

    def line(self, more: str = "") -> str:
        """`<run>: N queries, <phrase>`: the one line each command prints for an evaluation."""
        return f"{self.eval_run_id}: {self.queries} queries, {self.phrase(more)}"

    def figures(self, tokens: bool = True) -> list[tuple[str, float | None]]:
        """(label, value) of what a table shows of it: the metrics (Sel@L too), the valid share[, tokens per
        query]."""
        out = [(metric_name(m), getattr(self, m)) for m in (*METRICS, "select_at_l")]
        out.append(("valid share", self.valid_share))
        if tokens:
            out += [("generator tokens per query", self.gen_tokens_per_query),
                    ("executor tokens per query", self.exec_tokens_per_query)]
        return out


@dataclass(kw_only=True)
class ExperimentArm(EvalSummary):
    """One seed's evaluation of one round (BASE: the base model), without its per-query rows (the experiment keeps
    them in its own `per_query`, with the seed and round)."""

    seed: int
    round: int
    LEAD = ("seed", "round")
    OPTIONAL = ("per_query",)

    @classmethod
    def of(cls, seed: int, round: int, summary: EvalSummary) -> ExperimentArm:
        """From the evaluation's `eval_summary`, keys in its order."""
        return cls.from_dict({"seed": seed, "round": round,
                              **{k: v for k, v in summary.to_dict().items() if k != "per_query"}})

    def line(self, more: str = "") -> str:
        return f"seed {self.seed} {round_name(self.round)}: held-out {self.phrase(more)}"


@dataclass(kw_only=True)
class ReferenceArm(EvalSummary):
    """A baseline on the experiment's split, queries and L (pipeline.studies.baselines), named by its method and
    label (the method, or `program-<file stem>`), with its per-query rows."""

    method: str
    label: str | None = None
    LEAD = ("method", "label")

    @property
    def name(self) -> str:
        return self.label or self.method

    def line(self, more: str = "") -> str:
        return (f"reference {self.name} ({self.eval_run_id}): held-out "
                f"{metrics_phrase(self.mean_at_l, self.best_at_l, self.majority_at_l)}, "
                f"{tokens_phrase(self.gen_tokens_per_query, self.exec_tokens_per_query)}"
                f"{', ' + more if more else ''}, executor calls cut at the token cap {num(self.truncated_share)}"
                + (f"; picks {picks}" if (picks := self.picks()) else ""))

    def fit_line(self) -> str | None:
        """The learned router's settings as scored on dev (`router.fit`, pipeline.studies.router.fit_router): each
        one's routing score there and the one chosen; None for any other reference."""
        fit = (self.extra.get("router") or {}).get("fit")
        if not fit:
            return None
        tried = ", ".join(f"{t['analyzer']} C={t['c']:g} {num(t['dev_mean'])}" for t in fit["tried"])
        chosen = fit["chosen"]
        return (f"{self.label}: chosen on {fit['dev_queries']} dev queries: {chosen['analyzer']} C={chosen['c']:g} "
                f"({num(chosen['dev_mean'])}); every setting's dev score: {tried}")

    def picks(self) -> str:
        """A router's choices on the held-out queries, counted (its per-query choice is each row's `design` and the
        summary's `router.choices`); empty for a fixed workflow."""
        picked = (self.extra.get("router") or {}).get("picked") or {}
        return ", ".join(f"{name} {n}" for name, n in picked.items())


# ---- paired differences ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SeedDiff(Record):
    """One seed's own mean paired difference, with its interval over its queries."""

    seed: int
    n: int
    mean: float
    lo: float
    hi: float

    def line(self) -> str:
        return f"  seed {self.seed}: {signed(self.mean)} {span(self.lo, self.hi)} over {self.n} queries"


@dataclass(kw_only=True)
class PairedDiff(Record):
    """Differences per (seed, query) pooled (pipeline.studies.experiment.paired_interval): the mean with the
    bootstrap interval over pairs (`lo`, `hi`), resampling seeds then queries (the headline; summaries written
    before it lack it) and over queries, and each seed's own."""

    n: int
    mean: float
    lo: float
    hi: float
    level: float
    lo_seeds_queries: float | None = None
    hi_seeds_queries: float | None = None
    lo_by_query: float | None = None
    hi_by_query: float | None = None
    per_seed: list[SeedDiff] = field(default_factory=list)
    NESTED = {"per_seed": SeedDiff}

    @property
    def ci_seeds_queries(self) -> str:
        return span(self.lo_seeds_queries, self.hi_seeds_queries)

    @property
    def ci_pairs(self) -> str:
        return span(self.lo, self.hi)

    @property
    def ci_queries(self) -> str:
        return span(self.lo_by_query, self.hi_by_query)

    def phrase(self) -> str:
        """`+0.125 [+0.050, +0.200]`: the mean and the headline interval."""
        return f"{signed(self.mean)} {self.ci_seeds_queries}"

    def pairing(self) -> dict:
        """What it pairs, besides the metric (a table row's first cells)."""
        raise NotImplementedError


@dataclass(kw_only=True)
class RoundDiff(PairedDiff):
    """Round `round`'s evaluations (BASE: the base model's) minus the base model's, or minus a `reference` arm's, on
    one metric; `base` and `trained`: both sides' means."""

    reference: str | None = None
    round: int
    metric: str
    base: float | None
    trained: float | None
    LEAD = ("reference", "round", "metric", "base", "trained")
    OPTIONAL = ("reference",)

    def pairing(self) -> dict:
        return ({"reference": self.reference} if self.reference is not None else {}) | {"round": self.round}

    def versus_base(self, eval_l: int) -> str:
        return (f"round {self.round} vs base, held-out {metric_name(self.metric)} (L={eval_l}, {self.n} seed x "
                f"query pairs): base {num(self.base)} -> trained {num(self.trained)}, paired difference "
                f"{self.phrase()} {int(round(100 * self.level))}% bootstrap CI resampling seeds, then queries (pairs: "
                f"{self.ci_pairs}; queries: {self.ci_queries})")

    def versus_reference(self) -> str:
        return (f"{round_name(self.round)} vs {self.reference}, held-out {metric_name(self.metric)}: "
                f"{num(self.trained)} vs {num(self.base)}, paired difference {self.phrase()} (seeds, then queries; "
                f"{self.n} pairs)")


@dataclass(kw_only=True)
class ArmDiff(PairedDiff):
    """Arm `arm` minus arm `against` on `metric` (the methods comparison: on `against_metric` of the other arm,
    Mean@L where it has no Sel@L)."""

    arm: str
    against: str
    metric: str
    against_metric: str | None = None
    LEAD = ("arm", "against", "metric", "against_metric")
    OPTIONAL = ("against_metric",)

    def pairing(self) -> dict:
        return {"arm": self.arm, "against": self.against} | (
            {"against_metric": self.against_metric} if self.against_metric is not None else {})


def find_diff(paired: list[ArmDiff], arm: str, against: str, metric: str) -> ArmDiff | None:
    return next((p for p in paired if (p.arm, p.against, p.metric) == (arm, against, metric)), None)


# ---- the learning experiment (pipeline.studies.experiment) -----------------------------------------------------------


@dataclass(kw_only=True)
class SeedMean(Record):
    seed: int
    mean: float | None


@dataclass(kw_only=True)
class CurvePoint(Record):
    """A point of the held-out curve: round `round`'s mean over (seed, query) on `metric` with its seeds-then-queries
    interval, and each seed's mean."""

    round: int
    metric: str
    n: int
    mean: float
    lo: float
    hi: float
    level: float
    per_seed: list[SeedMean] = field(default_factory=list)
    NESTED = {"per_seed": SeedMean}


@dataclass(kw_only=True)
class Candidate(Record):
    """A reference as a candidate best fixed workflow: its run on the choosing split, and its held-out executor
    tokens per query."""

    label: str
    run_id: str
    queries: int
    mean_at_l: float | None
    best_at_l: float | None
    pending: int
    exec_tokens_per_query: float | None
    within_budget: bool


@dataclass(kw_only=True)
class Selection(Record):
    """The best fixed workflow chosen on `split` (pipeline.studies.experiment.best_fixed): at the trained
    generator's executor budget (round `last_round`'s, with `slack`) and at any."""

    split: str | None = None
    last_round: int | None = None
    budget_exec_tokens_per_query: float | None
    slack: float
    same_budget: str | None
    any_budget: str | None
    candidates: list[Candidate]
    unfinished: list[str]
    missing: list[str] = field(default_factory=list)
    NESTED = {"candidates": Candidate}

    def lines(self) -> list[str]:
        b = self.budget_exec_tokens_per_query
        limit = None if b is None else (1 + self.slack) * b
        within = ("" if limit is None else "<= ") + num(limit, 0)
        means = {c.label: c.mean_at_l for c in self.candidates}
        out = [f"best fixed workflow on {self.split} {what}: "
               + ("none" if pick is None else f"{pick} ({self.split} Mean@L {num(means[pick])})")
               for pick, what in ((self.same_budget, f"at the trained generator's executor budget ({within} "
                                                     "tokens/query)"), (self.any_budget, "at any budget"))]
        if left := self.missing + self.unfinished:
            out.append(f"not chosen from (not run or not finished on {self.split}): {', '.join(left)}")
        return out


@dataclass(kw_only=True)
class CriterionCheck(Record):
    """One comparison of the success criterion (experiment.criterion, pipeline.studies.verdict): the trained round
    minus `against` (the reference read; None: not in the summary yet), the mean paired difference and its
    seeds-then-queries interval over `n` (seed, query) pairs, what `rule` requires of them (`threshold`: a share
    rule's bound on the mean) and whether it holds (None: not readable yet)."""

    name: str
    text: str
    against: str | None
    rule: str
    mean: float | None = None
    lo: float | None = None
    hi: float | None = None
    n: int = 0
    threshold: float | None = None
    met: bool | None = None
    note: str = ""

    def requirement(self) -> str:
        if self.rule == "labels":
            return f"the likeliest label at least the pick on {self.threshold:.0f} or more parts"
        return {"above": "interval above 0", "not_below": "upper end at or above 0"}.get(
            self.rule, f"mean at least {signed(self.threshold)}")

    def result(self) -> str:
        """What was read: the mean difference and its interval, or for the labels rule the parts where it holds."""
        if self.rule == "labels":
            return "n/a" if self.mean is None else f"{self.mean:.0f} of {self.n} parts"
        return f"{signed(self.mean)} {span(self.lo, self.hi)}"

    def line(self) -> str:
        verdict = {True: "met", False: "not met", None: "not readable yet"}[self.met]
        read = (f"the labels on select_split against the per-part router's picks: {self.result()}"
                if self.rule == "labels" else f"minus {self.against or 'n/a'}: {self.result()} over {self.n} pairs")
        return (f"({self.name}) {read}; required: {self.requirement()}: {verdict}"
                + (f" ({self.note})" if self.note else ""))


@dataclass(kw_only=True)
class Verdict(Record):
    """The success criterion read from the summary's paired differences: round `round` on `metric`, intervals at
    `level` resampling seeds then queries; `met`: every required comparison holds (None: one is not readable yet);
    `stretch_met`: one of the stretch's holds (None without a stretch goal, or none readable)."""

    round: int
    metric: str
    level: float
    checks: list[CriterionCheck] = field(default_factory=list)
    stretch: list[CriterionCheck] = field(default_factory=list)
    met: bool | None = None
    stretch_met: bool | None = None
    NESTED = {"checks": CriterionCheck, "stretch": CriterionCheck}

    def lines(self) -> list[str]:
        word = {True: "met", False: "not met (negative)", None: "not readable yet"}[self.met]
        out = [f"verdict ({round_name(self.round)}, held-out {metric_name(self.metric)}, "
               f"{int(round(100 * self.level))}% intervals resampling seeds, then queries): criterion {word}"]
        out += ["  " + c.line() for c in self.checks]
        if self.stretch:
            out.append("  stretch (one of): " + {True: "met", False: "not met", None: "not readable yet"}[
                self.stretch_met])
            out += ["    " + c.line() for c in self.stretch]
        return out


@dataclass(kw_only=True)
class PartRound(Record):
    """One part of one evaluated round on one split, pooled over the seeds' evaluations (pipeline.studies.choices.
    part_rows): workflows, mean score, executor and generator tokens a workflow (the generator's: prompt and
    completion), and per label its share of the workflows, their mean score and the policy's mean odds of it."""

    split: str
    round: int
    part: str
    seeds: list[int]
    workflows: int
    mean_score: float | None = None
    exec_tokens: float | None = None
    gen_tokens: float | None = None
    labels: dict[str, dict] = field(default_factory=dict)

    def odds(self) -> dict[str, float]:
        return {lab: v["odds"] for lab, v in self.labels.items() if v.get("odds") is not None}


@dataclass(kw_only=True)
class LabelCheck(Record):
    """On one part of select_split: the policy's likeliest label (its mean odds over the seeds' last-round
    evaluations there) and its score, against the per-part router's pick (fitted on train) and its score
    (pipeline.studies.choices.likeliest_labels); `met`: the label scores at least as well (None: not known yet)."""

    part: str
    label: str | None
    odds: float | None
    score: float | None
    pick: str
    pick_score: float | None
    met: bool | None = None

    def line(self) -> str:
        word = {True: "at least the pick", False: "below the pick", None: "not readable yet"}[self.met]
        return (f"{self.part}: likeliest label {self.label or 'n/a'} (odds {num(self.odds)}) scores {num(self.score)}; "
                f"per-part router's pick {self.pick} {num(self.pick_score)}: {word}")


@dataclass(kw_only=True)
class KeptAdapter(Record):
    """A seed's last-round adapter kept in the store for git (pipeline.studies.experiment.keep_adapter): its folder
    relative to the store's root (the same on every clone), the run and round it is the checkpoint of, its size."""

    seed: int
    run_id: str
    round: int
    folder: str
    mb: float

    def line(self) -> str:
        return f"seed {self.seed}: {round_name(self.round)}'s adapter kept in {self.folder} ({self.mb:.1f} MB)"


@dataclass(kw_only=True)
class FrontierPoint(Record):
    """A point of the experiment's score-vs-executor-tokens frontier: a reference (a fixed workflow), or a round's
    held-out evaluation (BASE: the base model) as the mean over its seeds' evaluations (`seed` None) or one seed's.
    `pareto`: no other reference or round mean scores at least as well for at most its tokens, better in one; seed
    points are not ranked (None)."""

    kind: str  # "reference" or "round"
    name: str
    round: int | None
    seed: int | None
    mean_at_l: float
    exec_tokens_per_query: float
    gen_tokens_per_query: float | None
    pareto: bool | None


@dataclass(kw_only=True)
class ExperimentSummary(Record):
    """experiment.json (pipeline.studies.experiment.summarise; the run's facts, command to wall seconds, in
    `extra`). Summaries written before the references, the curve or the choice lack them."""

    experiment: str
    seeds: list[int]
    rounds: int
    split: str
    eval_queries: int | None
    eval_l: int
    shared_base: bool = False
    base_from: str | None = None  # experiment.base_from: whose base-model evaluations the seeds pair with
    start_from: str | None = None  # experiment.start_from: whose seeds' adapters round 0 started from
    arms: list[ExperimentArm] = field(default_factory=list)
    paired: list[RoundDiff] = field(default_factory=list)
    curve: list[CurvePoint] = field(default_factory=list)
    references: list[ReferenceArm] = field(default_factory=list)
    paired_references: list[RoundDiff] = field(default_factory=list)
    selection: Selection | None = None
    per_query: list[dict] = field(default_factory=list)  # per (seed, round, query): the evaluations' rows
    flagged_rewarded: dict[str, int] | None = None
    adapters: list[KeptAdapter] = field(default_factory=list)  # each seed's last-round adapter, where kept
    verdict: Verdict | None = None  # experiment.criterion read from `paired_references` (pipeline.studies.verdict)
    query_parts: dict[str, str] = field(default_factory=dict)  # held-out query -> its part (a procedural task)
    # experiment.select_eval: each seed's last round evaluated on select_split, and the labels' check there
    select_arms: list[ExperimentArm] = field(default_factory=list)
    parts: list[PartRound] = field(default_factory=list)  # per split, evaluated round and part, pooled over seeds
    labels: list[LabelCheck] = field(default_factory=list)
    # per run of the plan and stage done: wall seconds and the machine that took them (pipeline.studies.experiment.
    # status), so that the page's compute is read from the summary too
    stage_walls: list[dict] = field(default_factory=list)
    results: str | None = None  # the folder written; returned, not stored
    wall_s: float | None = None  # stored with the run's facts
    NESTED = {"arms": ExperimentArm, "paired": RoundDiff, "curve": CurvePoint, "references": ReferenceArm,
              "paired_references": RoundDiff, "selection": Selection, "adapters": KeptAdapter, "verdict": Verdict,
              "select_arms": ExperimentArm, "parts": PartRound, "labels": LabelCheck}
    OPTIONAL = ("base_from", "start_from", "adapters", "verdict", "query_parts", "select_arms", "parts", "labels",
                "stage_walls", "results", "wall_s")

    def headline(self) -> list[str]:
        """Lines a person reads first: per evaluated round and metric, held-out base -> trained with the paired
        difference and its seeds-then-queries interval, the pooled intervals beside it, then one line per seed;
        the share of executor replies cut at the token cap; each reference and every round against it; the best
        fixed workflow; the flagged rewarded training samples; the adapters kept."""
        lines = []
        for p in self.paired:
            lines += [p.versus_base(self.eval_l), *(x.line() for x in p.per_seed)]
        if cut := self.truncation():
            lines.append(cut)
        lines += [r.line() for r in self.references]
        lines += [p.versus_reference() for p in self.paired_references if p.metric == "mean_at_l"]
        if self.selection is not None:
            lines += self.selection.lines()
        lines += [f"seed {a.seed} {round_name(a.round)} on the selection split ({a.eval_run_id}): {a.phrase()}"
                  for a in self.select_arms]
        lines += [c.line() for c in self.labels]
        if self.verdict is not None:
            lines += self.verdict.lines()
        if self.flagged_rewarded is not None:  # older summaries lack it
            lines.append(f"flagged rewarded training runs (scores.flags): {self.flagged_rewarded}")
        return lines + [a.line() for a in self.adapters]

    def frontier(self) -> list[FrontierPoint]:
        """Every reference and every evaluated round on held-out Mean@L against executor tokens per query: a round's
        point is the mean over its seeds' evaluations (each seed's point too, after them); an arm without both
        numbers (not evaluated yet) is left out. Pareto over the references and round means."""
        pts = [FrontierPoint(kind="reference", name=r.name, round=None, seed=None, mean_at_l=r.mean_at_l,
                             exec_tokens_per_query=r.exec_tokens_per_query,
                             gen_tokens_per_query=r.gen_tokens_per_query, pareto=None)
               for r in self.references if r.mean_at_l is not None and r.exec_tokens_per_query is not None]
        seeds = []
        by_round: dict[int, list[ExperimentArm]] = {}
        for a in self.arms:
            if a.mean_at_l is not None and a.exec_tokens_per_query is not None:
                by_round.setdefault(a.round, []).append(a)
        for round_number, arms in sorted(by_round.items()):
            gen = [a.gen_tokens_per_query for a in arms if a.gen_tokens_per_query is not None]
            pts.append(FrontierPoint(kind="round", name=round_name(round_number), round=round_number, seed=None,
                                     mean_at_l=sum(a.mean_at_l for a in arms) / len(arms),
                                     exec_tokens_per_query=sum(a.exec_tokens_per_query for a in arms) / len(arms),
                                     gen_tokens_per_query=sum(gen) / len(gen) if gen else None, pareto=None))
            seeds += [FrontierPoint(kind="round", name=f"{round_name(round_number)}, seed {a.seed}", round=round_number,
                                    seed=a.seed, mean_at_l=a.mean_at_l, exec_tokens_per_query=a.exec_tokens_per_query,
                                    gen_tokens_per_query=a.gen_tokens_per_query, pareto=None)
                      for a in sorted(arms, key=lambda a: a.seed)]
        fronts = pareto([Point(p.name, p.mean_at_l, p.exec_tokens_per_query) for p in pts])
        for p, front in zip(pts, fronts, strict=True):
            p.pareto = front
        return pts + seeds

    def compared_round(self) -> int | None:
        """The round the verdict reads (the criterion's), else the last evaluated one; None before any."""
        if self.verdict is not None:
            return self.verdict.round
        return max((a.round for a in self.arms), default=None)

    def results_lines(self) -> list[str]:
        """What `--status` prints of the summary: every reference's held-out line (a router's with its picks), the
        learned router's settings on dev, the compared round minus each, the best fixed workflow and the verdict."""
        k = self.compared_round()
        lines = [r.line() for r in self.references]
        lines += [fit for r in self.references if (fit := r.fit_line())]
        lines += [p.versus_reference() for p in self.paired_references if p.metric == "mean_at_l" and p.round == k]
        if self.selection is not None:
            lines += self.selection.lines()
        return lines + (self.verdict.lines() if self.verdict is not None else [])

    def part_means(self, rows: list[dict], metric: str = "mean_at_l") -> dict[str, tuple[float, int]]:
        """Part -> (mean of `metric` over `rows`' queries of that part, queries); rows of no known part left out."""
        by_part: dict[str, list[float]] = {}
        queries: dict[str, set[str]] = {}
        for r in rows:
            if r.get(metric) is not None and (part := self.query_parts.get(r["query_id"])) is not None:
                by_part.setdefault(part, []).append(r[metric])
                queries.setdefault(part, set()).add(r["query_id"])
        return {p: (sum(v) / len(v), len(queries[p])) for p, v in sorted(by_part.items())}

    def markdown(self) -> str:
        """The results page's tables, read from the summary: each seed's base model and compared round with the
        paired difference; every reference (fixed designs, routers with their picks) per part with the compared round
        minus it; per part the policy's labels, scores and tokens, and its labels against the per-part router's
        picks (experiment.select_eval); the verdict against experiment.criterion; each stage's wall time."""
        compared = self.compared_round()
        if compared is None:
            return "No evaluation in this summary yet."
        parts = ["", *self._parts_markdown()] if self.parts else []
        labels = ["", *self._labels_markdown()] if self.labels else []
        walls = ["", *self._walls_markdown()] if self.stage_walls else []
        return "\n".join([*self._seeds_markdown(compared), "", *self._references_markdown(compared), *parts, *labels,
                          "", *self._verdict_markdown(), *walls])

    def _walls_markdown(self) -> list[str]:
        stages = list(dict.fromkeys(r["stage"] for r in self.stage_walls))
        runs: dict[tuple[str, str, int], dict] = {}
        for r in self.stage_walls:
            runs.setdefault((r["part"], r["run_id"], r["round"]), {})[r["stage"]] = r
        lines = ["| run | round | " + " | ".join(f"{st} (s)" for st in stages) + " | machine |", "|---" * (
            len(stages) + 3) + "|"]
        for (_, rid, k), by_stage in runs.items():
            machines = ", ".join(sorted({r["machine"] or "unrecorded" for r in by_stage.values()}))
            lines.append(f"| {rid} | {k} | " + " | ".join(
                num(by_stage[st]["wall_s"], 0) if st in by_stage else "" for st in stages) + f" | {machines} |")
        return [*lines, "", "Wall seconds of each stage done (the last attempt that did work), and the machine."]

    def _parts_markdown(self) -> list[str]:
        lines = ["| split | round | part | seeds | workflows | mean score | executor tokens a workflow | generator "
                 "tokens a workflow | per label: odds / share of workflows / mean score |", "|---" * 9 + "|"]
        for r in self.parts:
            labels = "; ".join(f"{lab} {num(v.get('odds'))} / {num(v.get('share'))} / {num(v.get('mean_score'))}"
                               for lab, v in r.labels.items())
            lines.append(f"| {r.split} | {round_name(r.round)} | {r.part} | {len(r.seeds)} | {r.workflows} | "
                         f"{num(r.mean_score)} | {num(r.exec_tokens, 0)} | {num(r.gen_tokens, 0)} | {labels} |")
        return [*lines, "", "Pooled over the seeds evaluated there. Generator tokens: prompt and completion, the "
                "generator's own compute a workflow; odds: the policy's mean probability of the label (n/a without a "
                "design step)."]

    def _labels_markdown(self) -> list[str]:
        word = {True: "yes", False: "no", None: "not yet"}
        lines = ["| part | the policy's likeliest label (odds) | its score | per-part router's pick | its score | "
                 "at least the pick |", "|---" * 6 + "|"]
        lines += [f"| {c.part} | {c.label or 'n/a'} ({num(c.odds)}) | {num(c.score)} | {c.pick} | "
                  f"{num(c.pick_score)} | {word[c.met]} |" for c in self.labels]
        return lines

    def _seeds_markdown(self, compared: int) -> list[str]:
        arm = {(a.seed, a.round): a for a in self.arms}
        diff = next((p for p in self.paired if p.round == compared and p.metric == "mean_at_l"), None)
        own = {x.seed: x for x in diff.per_seed} if diff is not None else {}
        lines = [f"| held out, Mean@{self.eval_l} | base model | {round_name(compared)} | paired difference "
                 f"({self.eval_queries} queries a seed) | executor tokens a query: base -> {round_name(compared)} |",
                 "|---|---|---|---|---|"]
        for seed in self.seeds:
            base, trained = arm.get((seed, BASE)), arm.get((seed, compared))
            x = own.get(seed)
            lines.append(f"| seed {seed} | {num(base and base.mean_at_l)} | {num(trained and trained.mean_at_l)} | "
                         + ("n/a" if x is None else f"{signed(x.mean)} {span(x.lo, x.hi)}")
                         + f" | {num(base and base.exec_tokens_per_query, 0)} -> "
                         f"{num(trained and trained.exec_tokens_per_query, 0)} |")
        if diff is not None:
            def tokens(r: int) -> float | None:
                vals = [a.exec_tokens_per_query for a in self.arms if a.round == r and a.exec_tokens_per_query
                        is not None]
                return sum(vals) / len(vals) if vals else None
            lines.append(f"| {len(self.seeds)} seeds (seeds, then queries) | {num(diff.base)} | {num(diff.trained)} | "
                         f"**{diff.phrase()}** | {num(tokens(BASE), 0)} -> {num(tokens(compared), 0)} |")
        return lines

    def _references_markdown(self, compared: int) -> list[str]:
        trained_rows = [q for q in self.per_query if q.get("round") == compared]
        parts = list(self.part_means(trained_rows)) or sorted(set(self.query_parts.values()))
        diffs = {p.reference: p for p in self.paired_references if p.round == compared and p.metric == "mean_at_l"}
        lines = [f"| held out, Mean@{self.eval_l} | " + " | ".join(parts) + f" | all | executor tokens a query | "
                 f"{round_name(compared)} minus it ({len(self.seeds)} seeds) | picks |",
                 "|---" * (len(parts) + 5) + "|"]
        for arm in self.references:
            means = self.part_means(arm.per_query)
            d = diffs.get(arm.name)
            lines.append(f"| {arm.name} | " + " | ".join(
                f"{num(means[p][0])} ({means[p][1]})" if p in means else "n/a" for p in parts)
                + f" | {num(arm.mean_at_l)} ({arm.queries}) | {num(arm.exec_tokens_per_query, 0)} | "
                + ("n/a" if d is None else f"{d.phrase()} ({d.n} pairs)") + f" | {arm.picks()} |")
        if trained_rows:
            means = self.part_means(trained_rows)
            point = next((c for c in self.curve if c.round == compared and c.metric == "mean_at_l"), None)
            tokens = [a.exec_tokens_per_query for a in self.arms if a.round == compared and a.exec_tokens_per_query
                      is not None]
            lines.append(f"| trained generator, {round_name(compared)} (mean of the seeds) | " + " | ".join(
                f"{num(means[p][0])}" if p in means else "n/a" for p in parts)
                + f" | {num(point and point.mean)} | {num(sum(tokens) / len(tokens) if tokens else None, 0)} | | |")
        return [*lines, "", "Parts: mean over the part's queries (queries in brackets); picks: a router's design per "
                "held-out query, counted."]

    def _verdict_markdown(self) -> list[str]:
        verdict = self.verdict
        if verdict is None:
            return ["No experiment.criterion: no verdict."]
        word = {True: "yes", False: "no", None: "not yet"}
        lines = [f"| | reference | {round_name(verdict.round)} minus it | required | met |", "|---|---|---|---|---|"]
        lines += [f"| ({c.name}) | {c.against or 'n/a'}" + (f" ({c.note})" if c.note else "") + f" | {c.result()} | "
                  f"{c.requirement()} | **{word[c.met]}** |" for c in verdict.checks]
        lines += [f"| stretch ({c.name}) | {c.against or 'n/a'} | {c.result()} | "
                  f"{c.requirement()} | {word[c.met]} |" for c in verdict.stretch]
        said = {True: "met", False: "not met", None: "not readable yet"}[verdict.met]
        return [*lines, "", f"Verdict: criterion {said}"
                + ("" if verdict.stretch_met is None else f"; stretch {'met' if verdict.stretch_met else 'not met'}")
                + "."]

    def truncation(self) -> str | None:
        """Executor calls with a reply cut at the token cap, held out, per round (mean over seeds); None where no
        arm has the share (summaries written before it)."""
        cut: dict[int, list[float]] = {}
        for a in self.arms:
            if a.truncated_share is not None:
                cut.setdefault(a.round, []).append(a.truncated_share)
        if not cut:
            return None
        return "executor calls cut at the token cap, held out (mean over seeds): " + ", ".join(
            f"{'base' if k == BASE else f'round {k}'} {num(sum(v) / len(v))}" for k, v in sorted(cut.items()))


# ---- the objective ablation (pipeline.studies.ablation) --------------------------------------------------------------


@dataclass(kw_only=True)
class AblationArm(Record):
    """An arm (`base`, or an objective) over seeds x queries: held-out means and valid share."""

    arm: str
    n: int
    valid_share: float | None
    mean_at_l: float | None = None
    best_at_l: float | None = None
    majority_at_l: float | None = None
    select_at_l: float | None = None
    OPTIONAL = ("select_at_l",)


@dataclass(kw_only=True)
class AblationSummary(Record):
    """ablation.json (pipeline.studies.ablation.summarise; the run's facts in `extra`)."""

    experiment: str
    round: int
    objectives: list[str]
    seeds: list[int]
    split: str
    eval_queries: int | None
    eval_l: int
    arms: list[AblationArm] = field(default_factory=list)
    paired: list[ArmDiff] = field(default_factory=list)
    results: str | None = None
    wall_s: float | None = None
    NESTED = {"arms": AblationArm, "paired": ArmDiff}
    OPTIONAL = ("results", "wall_s")

    def table(self) -> str:
        """The Markdown table of docs/objectives.md: per arm, held-out means and paired differences with their
        intervals over pairs."""
        metrics = [m for m in ("mean_at_l", "best_at_l") if any(getattr(a, m) is not None for a in self.arms)]
        ref = self.objectives[0]
        head = ["arm", *map(metric_name, metrics), *(f"{metric_name(m)} vs {who}" for m in metrics
                                                     for who in (BASE_ARM, ref)), "valid"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        from pipeline.core.objectives import get_objective  # here: the registry imports torch (seconds a process)

        for row in self.arms:
            cells = [row.arm + ("" if row.arm == BASE_ARM else f" ({get_objective(row.arm).kind} rows)")]
            cells += [num(getattr(row, m)) for m in metrics]
            for m in metrics:
                for who in (BASE_ARM, ref):
                    p = find_diff(self.paired, row.arm, who, m)
                    cells.append("" if p is None else f"{signed(p.mean)} {p.ci_pairs}")
            cells.append(num(row.valid_share, 2))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


# ---- the methods comparison (pipeline.studies.methods) ---------------------------------------------------------------


@dataclass(kw_only=True)
class ArmRun(Record):
    """The runs behind one arm's evaluation for one seed: the training run (none for a reference) and the held-out
    evaluation run; W4S's refined arm adds its validation run and the workflow chosen there, task_best its
    programs."""

    arm: str
    method: str
    evaluation: str
    seed: int
    train_run_id: str | None
    eval_run_id: str
    validation_run_id: str | None = None
    validation_split: str | None = None
    selected: dict | None = None
    OPTIONAL = ("validation_run_id", "validation_split", "selected")


@dataclass(kw_only=True)
class ArmNumbers(Record):
    """An arm's held-out numbers, for one seed or over its seeds: means (Sel@L only where the arm selects), valid
    share, tokens per query, wall seconds of training, of the held-out evaluation (sampling and scoring; None where a
    part of it was not timed) and (W4S's refined arm) of validation; the held-out workflows per written design of
    the task's menu (`designs`: counts; none without a menu or for fixed programs)."""

    mean_at_l: float | None = None
    best_at_l: float | None = None
    majority_at_l: float | None = None
    select_at_l: float | None = None
    valid_share: float | None = None
    gen_tokens_per_query: float | None = None
    exec_tokens_per_query: float | None = None
    train_wall_s: float | None = None
    select_wall_s: float | None = None
    eval_wall_s: float | None = None
    designs: dict[str, int] | None = None
    OPTIONAL = ("select_at_l", "select_wall_s", "eval_wall_s", "designs")


@dataclass(kw_only=True)
class MethodSeedRow(ArmRun, ArmNumbers):
    """An arm's runs and numbers for one seed."""

    queries: int
    LEAD = (*ArmRun.names(), "queries")
    OPTIONAL = (*ArmRun.OPTIONAL, *ArmNumbers.OPTIONAL)


@dataclass(kw_only=True)
class MethodArm(ArmNumbers):
    """An arm over its seeds x queries (wall seconds: the mean over seeds)."""

    arm: str
    method: str
    evaluation: str
    seeds: list[int]
    n: int
    LEAD = ("arm", "method", "evaluation", "seeds", "n")


@dataclass(kw_only=True)
class SweepRun(Record):
    """One learning rate of the sweep: its one-round run and that run's dev evaluation."""

    lr: float
    run_id: str
    eval_run_id: str
    queries: int
    mean_at_l: float | None
    best_at_l: float | None
    train_wall_s: float


@dataclass(kw_only=True)
class LrSweep(Record):
    """A method's learning-rate sweep on `split` (seed `seed`) and the rate chosen (None: no run scored)."""

    split: str
    seed: int
    runs: list[SweepRun]
    chosen: float | None
    NESTED = {"runs": SweepRun}


@dataclass(kw_only=True)
class MethodsSummary(Record):
    """methods.json (pipeline.studies.methods.summarise; the run's facts in `extra`)."""

    experiment: str
    methods: list[str]
    seeds: list[int]
    rounds: int
    split: str
    eval_queries: int | None
    eval_l: int
    arms: list[MethodArm] = field(default_factory=list)
    paired: list[ArmDiff] = field(default_factory=list)
    per_seed: list[MethodSeedRow] = field(default_factory=list)
    per_query: list[dict] = field(default_factory=list)  # per (arm, seed, query): metrics and tokens
    lr_sweep: dict[str, LrSweep] = field(default_factory=dict)
    lr: dict[str, float | None] = field(default_factory=dict)
    not_run: list[str] = field(default_factory=list)  # registered methods this comparison left out (--methods)
    results: str | None = None
    wall_s: float | None = None
    NESTED = {"arms": MethodArm, "paired": ArmDiff, "per_seed": MethodSeedRow}
    KEYED = {"lr_sweep": LrSweep}
    OPTIONAL = ("not_run", "results", "wall_s")

    def table(self) -> str:
        """The Markdown of docs/methods.md: per arm the held-out means and paired differences (seeds-then-queries
        intervals), every paired difference, per seed rows, and the learning-rate sweep."""
        sel = any(a.select_at_l is not None for a in self.arms)
        metrics = [*METRICS, *(["select_at_l"] if sel else [])]
        left = ([f"Not run in this comparison (left out by --methods; docs/methods.md gives why): "
                 f"{', '.join(self.not_run)}.", ""] if self.not_run else [])
        return "\n".join([*self._arms_table(metrics), "", *left, *self._designs_table(), *self._paired_table(), "",
                          *self._seeds_table(metrics), *self._sweep_table()])

    def _designs_table(self) -> list[str]:
        """Per arm with designs, its held-out workflows per design: count (share of the arm's workflows)."""
        arms = [a for a in self.arms if a.designs]
        names = sorted({d for a in arms for d in a.designs}, key=lambda d: (d == "other", d))  # other: last
        if not arms:
            return []
        lines = ["Held-out workflows per design (the nearest design of the menu by code similarity; other: none near "
                 "enough): count (share).", "", "| arm | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for a in arms:
            n = sum(a.designs.values())
            lines.append(f"| {a.arm} | " + " | ".join(f"{a.designs.get(d, 0)} ({a.designs.get(d, 0) / n:.0%})"
                                                      for d in names) + " |")
        return [*lines, ""]

    def _diff(self, arm: str, against: str) -> str:
        p = find_diff(self.paired, arm, against, "mean_at_l")
        return "" if p is None else p.phrase()

    def _arms_table(self, metrics: list[str]) -> list[str]:
        head = ["arm", "evaluation", "seeds", *map(metric_name, metrics), "Mean@L vs base",
                f"Mean@L vs {REFERENCE_ARM}", f"Mean@L vs {BEST_FIXED_ARM}", "generator tokens/query",
                "executor tokens/query", "training s/seed", "evaluation s/seed", "valid"]
        lines = [f"Held-out {self.split}, {self.eval_queries} queries, L = {self.eval_l}, seeds {self.seeds}, "
                 f"{self.rounds} round(s); differences: mean [95% interval resampling seeds, then queries].", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for a in self.arms:
            cells = [a.arm, a.evaluation, str(len(a.seeds)), *(num(getattr(a, m)) for m in metrics),
                     self._diff(a.arm, BASE_ARM), self._diff(a.arm, REFERENCE_ARM), self._diff(a.arm, BEST_FIXED_ARM),
                     num(a.gen_tokens_per_query, 0),
                     num(a.exec_tokens_per_query, 0), num(a.train_wall_s, 0), num(a.eval_wall_s, 0),
                     num(a.valid_share, 2)]
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    def _paired_table(self) -> list[str]:
        lines = ["| arm | against | metric | difference | interval: seeds, queries | interval: pairs | pairs |",
                 "|---|---|---|---|---|---|---|"]
        for p in self.paired:
            name = metric_name(p.metric) + ("" if p.against_metric == p.metric
                                            else f" vs {metric_name(p.against_metric)}")
            lines.append(f"| {p.arm} | {p.against} | {name} | {signed(p.mean)} | {p.ci_seeds_queries} | "
                         f"{p.ci_pairs} | {p.n} |")
        return lines

    def _seeds_table(self, metrics: list[str]) -> list[str]:
        lines = ["| arm | seed | " + " | ".join(map(metric_name, metrics))
                 + " | generator tokens/query | executor tokens/query | training s | evaluation s | evaluation run |",
                 "|" + "---|" * (len(metrics) + 7)]
        lines += [f"| {p.arm} | {p.seed} | " + " | ".join(num(getattr(p, m)) for m in metrics)
                  + f" | {num(p.gen_tokens_per_query, 0)} | {num(p.exec_tokens_per_query, 0)} | "
                  f"{num(p.train_wall_s, 0)} | {num(p.eval_wall_s, 0)} | {p.eval_run_id} |" for p in self.per_seed]
        return lines

    def _sweep_table(self) -> list[str]:
        if not self.lr_sweep:
            return []
        lines = ["", "| method | lr | dev Mean@L | dev Best@L | run | chosen |", "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {r.lr:g} | {num(r.mean_at_l)} | {num(r.best_at_l)} | {r.run_id} | "
                  f"{'yes' if r.lr == s.chosen else ''} |" for name, s in self.lr_sweep.items() for r in s.runs]
        return lines


# ---- the headroom study (pipeline.studies.headroom) ------------------------------------------------------------------


@dataclass(kw_only=True)
class DesignPoint(Record):
    """A design as a fixed program: its mean score and executor tokens per run (pipeline.core.headroom.Point)."""

    name: str
    score: float
    tokens: float


@dataclass(kw_only=True)
class DesignRow(DesignPoint):
    """A row of the designs' table: on the score-vs-tokens Pareto front or not, and the share of its executor calls
    cut at the token cap (None: no call recorded one)."""

    pareto: bool
    truncated_share: float | None = None


@dataclass(kw_only=True)
class OracleResult(Record):
    """The per-query oracle over designs (pipeline.core.headroom.Oracle) at the budget of the design `anchor`: its
    score and tokens, the (run, run) pairs it was cross-fitted over and the share of queries given to each design;
    on the frontier also `gain`, its score minus the best design within that budget."""

    rule: str
    anchor: str
    score: float
    tokens: float
    budget: float
    pairs: int
    chosen: dict[str, float] = field(default_factory=dict)
    gain: float | None = None
    OPTIONAL = ("gain",)


@dataclass(kw_only=True)
class PartResult(Record):
    """One part's queries (a procedural task, else the benchmark): how many, its best design and each design's
    score on them."""

    queries: int
    best: str
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class HeadroomAnalysis(Record):
    """What the headroom study computes from its runs (pipeline.studies.headroom.analyse): the designs, (a) the best
    single design, (b) the cross-fitted oracle at (a)'s budget (and in sample), the gain (b) - (a) with its interval
    and whether it passes the gate, the oracle along the frontier, and with several parts the best design per part
    and the router over parts."""

    designs: list[DesignRow] = field(default_factory=list)
    best: DesignPoint
    oracle: OracleResult
    oracle_in_sample: OracleResult
    gain: float
    gate: float
    rule: str
    gain_interval: list[float] | None = None  # None: a summary written before the interval existed
    passes: bool
    frontier: list[OracleResult] = field(default_factory=list)
    queries: int
    reps: int
    per_part: dict[str, PartResult] = field(default_factory=dict)
    part_router: OracleResult | None = None
    NESTED = {"designs": DesignRow, "best": DesignPoint, "oracle": OracleResult, "oracle_in_sample": OracleResult,
              "frontier": OracleResult, "part_router": OracleResult}
    KEYED = {"per_part": PartResult}
    OPTIONAL = ("part_router",)


@dataclass(kw_only=True)
class HeadroomSummary(HeadroomAnalysis):
    """The headroom study's summary (headroom.json): its run facts (the run id, config, --set, split, each design's
    baseline run, the queries left out) and the analysis, and where its outputs are (`results`)."""

    run_id: str
    config: str
    sets: list[str] = field(default_factory=list)
    split: str
    design_runs: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    results: str | None = None
    LEAD = ("run_id", "config", "sets", "split", "design_runs", "dropped")
    OPTIONAL = ("part_router", "results")


# ---- the headroom gate's records (pipeline.studies.headroom.analyse): what the gate reads beyond the oracle --------


@dataclass(kw_only=True)
class ReplayRow(Record):
    """One design's runs (pipeline.core.headroom.Replay): the share of queries on which all its runs scored the same,
    and on which they also spent the same executor tokens."""

    design: str
    same_scores: float
    same_runs: float


@dataclass(kw_only=True)
class RoomResult(Record):
    """A router scored on query folds it was not fitted on (pipeline.core.headroom.Room), against the best single
    design chosen on the same fit folds: both sides' mean score and executor tokens per run, `gain` (router - that
    design) with its 95% bootstrap interval over queries, the share of queries routed to each design and held out
    under each fold-best design, the settings the folds chose (setting -> share of folds), and what it is (`note`)."""

    router: str
    score: float
    tokens: float
    best_score: float
    best_tokens: float
    gain: float
    gain_interval: list[float]
    folds: int
    chosen: dict[str, float] = field(default_factory=dict)
    best_chosen: dict[str, float] = field(default_factory=dict)
    settings: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass(kw_only=True)
class GateFields(Record):
    """What the gate reads beyond the oracle: each design's replay shares, whether the oracle is in sample (every
    design's runs scored the same on every query), the learnable room of the learned router (`learnable`, the gate's
    number) and of the per-part router, and the number the gate read (`gate_on`). None where a summary was written
    before these existed (its gate read the oracle)."""

    replay: list[ReplayRow] = field(default_factory=list)
    oracle_in_sample_only: bool | None = None
    learnable: RoomResult | None = None
    learnable_part: RoomResult | None = None
    gate_on: str = "oracle"
    NESTED = {"replay": ReplayRow, "learnable": RoomResult, "learnable_part": RoomResult}


@dataclass(kw_only=True)
class GateAnalysis(GateFields, HeadroomAnalysis):
    """`HeadroomAnalysis` with the gate's fields (`GateFields`): what `analyse` returns."""

    NESTED = HeadroomAnalysis.NESTED | GateFields.NESTED
    OPTIONAL = (*HeadroomAnalysis.OPTIONAL, "learnable_part")


@dataclass(kw_only=True)
class HeadroomReport(GateFields, HeadroomSummary):
    """`HeadroomSummary` with the gate's fields (`GateFields`): headroom.json."""

    NESTED = HeadroomSummary.NESTED | GateFields.NESTED
    OPTIONAL = (*HeadroomSummary.OPTIONAL, "learnable_part")
