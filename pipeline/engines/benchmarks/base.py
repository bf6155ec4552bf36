"""The benchmark interface every loader implements, the registry, and deterministic splits."""

from __future__ import annotations

import hashlib
import importlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.config import BenchmarkConfig


class BenchmarkError(ValueError):
    """Unusable benchmark input (missing file, wrong format); the message says how to fix it."""


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str  # what the workflow's `solve(problem)` receives
    reference: dict[str, Any]  # hidden from the workflow: gold answer(s) or tests (JSON-serialisable)
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. entry_point, public tests, level

    def gold_text(self) -> str:
        """The gold answer as text (what an LLM judge and W4S's feedback are shown): `answer`, `answers` or
        `gold` of the reference, else the whole reference as JSON."""
        for key in ("answer", "answers", "gold"):
            if key in self.reference:
                value = self.reference[key]
                return value if isinstance(value, str) else json.dumps(value)
        return json.dumps(self.reference)


@dataclass
class MetricResult:
    score: float  # in [0, 1]
    details: dict[str, Any] = field(default_factory=dict)


class Benchmark(ABC):
    name: str
    family: str  # code | math | qa | procedural: picks the prompt's example workflow

    def __init__(self, cfg: BenchmarkConfig):
        self.cfg = cfg

    @abstractmethod
    def load(self) -> list[Item]:
        """All items, in a stable order."""

    @abstractmethod
    def score(self, item: Item, answer: str) -> MetricResult:
        """Score a workflow's final answer against the hidden reference."""

    def items(self, split: str | None = None) -> list[Item]:
        """The items of `split` (default: the config's train split), capped by max_queries."""
        split = split or self.cfg.train_split
        items = split_items(self.load(), self.cfg.split_seed, self.cfg.validate_fraction)[split]
        return items[: self.cfg.max_queries] if self.cfg.max_queries else items


def split_items(items: list[Item], seed: int, validate_fraction: float = 0.2) -> dict[str, list[Item]]:
    """Deterministic validate/test split (exactly 1:4 by default): rank items by a seeded hash of
    their id, so the split depends on the ids and the seed, never on the file's row order."""
    def key(it: Item) -> str:
        return hashlib.sha256(f"{seed}:{it.id}".encode()).hexdigest()

    ranked = sorted(items, key=key)
    k = round(len(items) * validate_fraction)
    chosen = {it.id for it in ranked[:k]}
    return {"validate": [it for it in items if it.id in chosen], "test": [it for it in items if it.id not in chosen]}


# name -> "module:Class"; modules import lazily so one missing optional library fails only its benchmark.
REGISTRY = {
    "humaneval": "pipeline.engines.benchmarks.code:HumanEval",
    "mbpp": "pipeline.engines.benchmarks.code:MBPP",
    "gsm8k": "pipeline.engines.benchmarks.gsm8k:GSM8K",
    "math": "pipeline.engines.benchmarks.math:MATH",
    "drop": "pipeline.engines.benchmarks.qa:DROP",
    "hotpotqa": "pipeline.engines.benchmarks.qa:HotpotQA",
    "procedural": "pipeline.engines.benchmarks.procedural:Procedural",
}


def load_benchmark(cfg: BenchmarkConfig) -> Benchmark:
    mod, cls = REGISTRY[cfg.name].split(":")
    return getattr(importlib.import_module(mod), cls)(cfg)
