"""The verdict of an experiment's success criterion (`experiment.criterion`), read from its summary's paired
differences: no number of its own, so that the verdict a results page states is the one the summary holds.

Each comparison `<name>: <reference> <rule>` reads the trained round's paired difference to the reference
(`paired_references`: per (seed, query) round k minus the reference's value on that query, the interval resampling
seeds, then queries within each drawn seed: pipeline.studies.experiment.paired_interval):

- `above`: the interval's lower end is above 0 (the trained generator beats the reference);
- `not_below`: its upper end is at or above 0 (it is not shown below the reference);
- `share:<arm>:<fraction>`: the mean difference is at least `fraction` of `arm`'s mean minus the reference's (e.g. a
  gain over the best single design of at least half the oracle's gain over it);
- `part_router labels:<k>`: no paired difference but the summary's `labels` (experiment.select_eval): on at least
  k parts the policy's likeliest label scores on select_split at least as well as the per-part router's pick there
  (`mean`: the parts where it does; `n`: the parts; unreadable while a part that could decide it is not known).

The reference `best_fixed` is the best fixed workflow chosen on `select_split` at the trained generator's executor
budget (`selection.same_budget`), and where no reference fits that budget the best at any budget
(`selection.any_budget`), said so in the comparison's note: that reference spends more executor than the generator.
A comparison whose reference has no paired difference yet (not run, or not finished) is not readable (`met` None),
and so is the verdict until every required one is.
"""

from __future__ import annotations

from pipeline.config import CriterionConfig
from pipeline.studies.summaries import CriterionCheck, LabelCheck, ReferenceArm, RoundDiff, Selection, Verdict

BEST_FIXED = "best_fixed"


def parse_test(text: str) -> tuple[str, str, str, str | None, float | None]:
    """(name, reference, rule kind, share arm, share fraction) of a criterion's `<name>: <reference> <rule>` (the
    config validated its form: pipeline.config.criterion_test)."""
    name, _, rest = text.partition(":")
    reference, rule = rest.split()
    kind, *args = rule.split(":")
    return name.strip(), reference, kind, (args[0] if args else None), (float(args[1]) if len(args) > 1 else None)


def best_fixed_label(selection: Selection | None) -> tuple[str | None, str]:
    """The reference `best_fixed` names and a note where it is the best at any budget (none at the generator's)."""
    if selection is None:
        return None, "no experiment.select_split: no best fixed workflow chosen"
    if selection.same_budget is not None:
        return selection.same_budget, ""
    if selection.any_budget is None:
        return None, f"no reference finished on {selection.split} yet"
    budget = selection.budget_exec_tokens_per_query
    limit = "" if budget is None else f" ({(1 + selection.slack) * budget:.0f} executor tokens a query)"
    return selection.any_budget, (f"no single design fits the trained generator's executor budget{limit}: the best "
                                  f"on {selection.split} at any budget, which spends more executor")


def labels_check(name: str, text: str, parts: int, labels: list[LabelCheck]) -> CriterionCheck:
    """`part_router labels:<parts>`: read from the summary's per-part label checks."""
    out = CriterionCheck(name=name, text=text, against="part_router", rule="labels", threshold=float(parts),
                         n=len(labels))
    if not labels:
        out.note = "no label check yet (experiment.select_eval: each seed's last round evaluated on select_split)"
        return out
    met, open_ = sum(c.met is True for c in labels), sum(c.met is None for c in labels)
    out.mean = float(met)
    out.met = True if met >= parts else (False if met + open_ < parts else None)
    return out


def check(text: str, round_number: int, metric: str, diffs: list[RoundDiff], refs: list[ReferenceArm],
          selection: Selection | None, labels: list[LabelCheck] | None = None) -> CriterionCheck:
    """One comparison, read from the paired differences `diffs` (the summary's `paired_references`), or for the
    labels rule from `labels`."""
    name, reference, kind, arm, fraction = parse_test(text)
    if kind == "labels":
        return labels_check(name, text, int(arm), labels or [])
    note = ""
    if reference == BEST_FIXED:
        reference, note = best_fixed_label(selection)
    out = CriterionCheck(name=name, text=text, against=reference, rule=kind, note=note)
    diff = next((d for d in diffs if (d.reference, d.round, d.metric) == (reference, round_number, metric)), None)
    if diff is None:
        out.note = "; ".join(x for x in (note, f"no paired difference to {reference or BEST_FIXED} yet") if x)
        return out
    out.mean, out.n = diff.mean, diff.n
    out.lo, out.hi = diff.lo_seeds_queries, diff.hi_seeds_queries
    if kind == "above":
        out.met = out.lo is not None and out.lo > 0
    elif kind == "not_below":
        out.met = out.hi is not None and out.hi >= 0
    else:  # share: of `arm`'s gain over the reference, both means over the same held-out queries
        means = {r.label: getattr(r, metric) for r in refs}
        if means.get(arm) is None or means.get(reference) is None:
            out.note = "; ".join(x for x in (note, f"no mean of {arm} or {reference} yet") if x)
            return out
        out.threshold = fraction * (means[arm] - means[reference])
        out.met = out.mean >= out.threshold
    if out.lo is None and kind != "share":  # a summary without the seeds-then-queries interval
        out.met = None
    return out


def verdict(criterion: CriterionConfig | None, last_round: int, level: float, diffs: list[RoundDiff],
            refs: list[ReferenceArm], selection: Selection | None,
            labels: list[LabelCheck] | None = None) -> Verdict | None:
    """The criterion's verdict (None without a criterion): every required comparison, then the stretch's."""
    if criterion is None:
        return None
    round_number = last_round if criterion.round is None else criterion.round
    checks = [check(t, round_number, criterion.metric, diffs, refs, selection, labels) for t in criterion.require]
    stretch = [check(t, round_number, criterion.metric, diffs, refs, selection, labels) for t in criterion.stretch]
    met = None if any(c.met is None for c in checks) else all(c.met for c in checks)
    readable = [c.met for c in stretch if c.met is not None]
    stretch_met = True if any(readable) else (None if not readable or len(readable) < len(stretch) else False)
    return Verdict(round=round_number, metric=criterion.metric, level=level, checks=checks, stretch=stretch, met=met,
                   stretch_met=stretch_met)
