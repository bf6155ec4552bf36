"""How study results read as text, in one place: a number or n/a, the held-out metrics phrase every summary line
shares (Mean@L, Best@L, Sel@L for two-level runs, Majority@L), tokens per query, and wall seconds as stored."""

from __future__ import annotations


def num(x: float | None, digits: int = 3) -> str:
    """A number with `digits` decimals, n/a for none (a metric without a value, or a summary written before it)."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def metrics_phrase(mean_at_l: float | None, best_at_l: float | None, majority_at_l: float | None,
                   select_at_l: float | None = None, selection: bool = False) -> str:
    """`Mean@L a, Best@L b[, Sel@L s], Majority@L c`: Sel@L only for runs that select (two-level)."""
    sel = f", Sel@L {num(select_at_l)}" if selection else ""
    return f"Mean@L {num(mean_at_l)}, Best@L {num(best_at_l)}{sel}, Majority@L {num(majority_at_l)}"


def tokens_phrase(gen_tokens_per_query: float | None, exec_tokens_per_query: float | None) -> str:
    return f"tokens/query generator {num(gen_tokens_per_query, 0)} executor {num(exec_tokens_per_query, 0)}"


def round_s(x: float) -> float:
    """Wall seconds as the studies store them: one decimal."""
    return float(f"{x:.1f}")
