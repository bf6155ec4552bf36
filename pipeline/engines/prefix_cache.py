"""How much of the prompts a vLLM engine took from its prefix cache: the counters `vllm:prefix_cache_queries` (prompt
tokens looked up) and `vllm:prefix_cache_hits` (of those, tokens whose KV blocks were cached), read from an offline
engine's `LLM.get_metrics()` or a server's Prometheus text at /metrics.

Why it matters here: every prompt of a rollout opens with the same system text, contract and designs' code (about
600 tokens on the mixed tasks) before its query, and an evaluation's or the executor's prompts share theirs too, so
most prompt tokens can be hits (`pipeline bench prefix-cache`). vLLM counts only whole KV blocks (16 tokens on CPU),
so a prompt's last partial block is never a hit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"


@dataclass(frozen=True)
class CacheCounts:
    """Prompt tokens looked up in the prefix cache (`queries`) and found there (`hits`), over an engine's life or,
    as a difference of two readings, over a span."""

    hits: int = 0
    queries: int = 0

    def __sub__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(self.hits - other.hits, self.queries - other.queries)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    def describe(self) -> str:
        if self.hit_rate is None:
            return "prefix cache: no prompt tokens looked up"
        return f"prefix cache hit rate {self.hit_rate:.1%} ({self.hits:,} of {self.queries:,} prompt tokens)"


def _counter_name(name: str) -> str:
    """A counter's name without the `_total` Prometheus's text format adds to it."""
    return name.removesuffix("_total")


def from_metrics_text(text: str) -> CacheCounts | None:
    """The counts in Prometheus text (a vLLM server's /metrics), summed over their label sets (engines, models);
    None where neither counter is there (not a vLLM server, or one without prefix caching metrics)."""
    totals = {QUERIES: 0.0, HITS: 0.0}
    seen = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # name{label="value",...} value [timestamp]; a label value may hold spaces
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        name = _counter_name(name.strip())
        if name in totals:
            try:
                totals[name] += float(rest.split()[0])
            except (IndexError, ValueError):
                continue  # a torn line: the counter reads as absent rather than wrong
            seen = True
    return CacheCounts(int(totals[HITS]), int(totals[QUERIES])) if seen else None


def from_metrics(metrics: Iterable[Any]) -> CacheCounts | None:
    """The counts in `vllm.LLM.get_metrics()`'s snapshot (objects with `name` and `value`); None where absent."""
    totals = {QUERIES: 0, HITS: 0}
    seen = False
    for metric in metrics:
        name = _counter_name(getattr(metric, "name", ""))
        if name in totals and isinstance(getattr(metric, "value", None), int | float):
            totals[name] += int(metric.value)
            seen = True
    return CacheCounts(totals[HITS], totals[QUERIES]) if seen else None


def read_server(url: str, timeout: float = 5.0) -> CacheCounts | None:
    """The counts of the server at `url` (its root, http://host:port); None where it has no such metrics or cannot
    be read (a reading is never worth a stage)."""
    import httpx

    try:
        response = httpx.get(url + "/metrics", timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return from_metrics_text(response.text)
