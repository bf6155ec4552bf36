"""Curation: F/M/S buckets, SPOGW group-wise data, two-level advantages, and the curate stage."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def assign_buckets(scores: Sequence[float]) -> list[str]:
    """Fast if >= the 2/3 quantile, Slow if <= the 1/3 quantile, else Medium (numpy's default
    linear quantiles; an item meeting both bounds, e.g. when all scores are equal, is Fast)."""
    s = np.asarray(scores, dtype=float)
    if s.size == 0:
        return []
    hi, lo = np.quantile(s, 2 / 3), np.quantile(s, 1 / 3)
    return ["F" if x >= hi else "S" if x <= lo else "M" for x in s]
