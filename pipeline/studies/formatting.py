"""How study results read as text, in one place: a number or n/a, a signed difference and an interval, a metric's
name, the held-out metrics phrase every summary line shares (Mean@L, Best@L, Sel@L for two-level runs, Majority@L),
tokens per query, a round's name, a number in a table artifact, and wall seconds as stored."""

from __future__ import annotations

NA = "n/a"  # a number without a value, or one a summary written before it lacks
METRIC_NAMES = {"mean_at_l": "Mean@L", "best_at_l": "Best@L", "majority_at_l": "Majority@L", "select_at_l": "Sel@L"}


def num(x: float | None, digits: int = 3) -> str:
    """A number with `digits` decimals, n/a for none."""
    return NA if x is None else f"{x:.{digits}f}"


def signed(x: float | None, digits: int = 3) -> str:
    """A difference with its sign (+0.125), n/a for none."""
    return NA if x is None else f"{x:+.{digits}f}"


def span(lo: float | None, hi: float | None) -> str:
    """An interval of differences, `[lo, hi]`, or n/a when a bound is missing (a summary written before it)."""
    return NA if lo is None or hi is None else f"[{signed(lo)}, {signed(hi)}]"


def metric_name(metric: str) -> str:
    """Mean@L for mean_at_l, and so on; a name it does not know as it is."""
    return METRIC_NAMES.get(metric, metric)


def metrics_phrase(mean_at_l: float | None, best_at_l: float | None, majority_at_l: float | None,
                   select_at_l: float | None = None, selection: bool = False) -> str:
    """`Mean@L a, Best@L b[, Sel@L s], Majority@L c`: Sel@L only for runs that select (two-level)."""
    sel = f", Sel@L {num(select_at_l)}" if selection else ""
    return f"Mean@L {num(mean_at_l)}, Best@L {num(best_at_l)}{sel}, Majority@L {num(majority_at_l)}"


def tokens_phrase(gen_tokens_per_query: float | None, exec_tokens_per_query: float | None) -> str:
    return f"tokens/query generator {num(gen_tokens_per_query, 0)} executor {num(exec_tokens_per_query, 0)}"


def round_name(k: int) -> str:
    """`base model` for the base model's evaluations (round -1), else `round k`."""
    return "base model" if k < 0 else f"round {k}"


def rounded(x):
    """A value in a table artifact: a float to 4 decimals (a number the UI sorts, not text), anything else as it is."""
    return round(x, 4) if isinstance(x, float) else x


def round_s(x: float) -> float:
    """Wall seconds as the studies store them: one decimal."""
    return float(f"{x:.1f}")
