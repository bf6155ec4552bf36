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
        items = split_items(self.load(), self.cfg.split_seed, self.cfg.test_share, self.cfg.dev_share)[split]
        if not items and split in ("train", "dev"):  # a share too small for the benchmark's size
            raise BenchmarkError(f"benchmark {self.name!r}: split {split!r} is empty (benchmark.test_share "
                                 f"{self.cfg.test_share}, benchmark.dev_share {self.cfg.dev_share}); raise dev_share "
                                 f"or the benchmark's size")
        return items[: self.cfg.max_queries] if self.cfg.max_queries else items


def split_items(items: list[Item], seed: int, test_share: float = 0.8, dev_share: float = 0.0) -> dict[str, list[Item]]:
    """Deterministic splits: rank items by a seeded hash of their id (so membership depends on the ids and the seed,
    never on the file's row order or on other items); the first round(n (1 − test_share)) are `validate`, the rest
    `test`. Within `validate`, the last round(|validate| dev_share) of the ranking are `dev` and the others `train`:
    `test` does not move when dev_share changes, and a larger dev_share moves items from train to dev only.
    Each split keeps the items' original order."""
    def key(it: Item) -> str:
        return hashlib.sha256(f"{seed}:{it.id}".encode()).hexdigest()

    ranked = sorted(items, key=key)
    k = round(len(items) * (1 - test_share))  # rounding the validate count, as the former validate_fraction did
    n_train = k - round(k * dev_share)
    member = {it.id: "train" if i < n_train else "dev" if i < k else "test" for i, it in enumerate(ranked)}
    out: dict[str, list[Item]] = {"validate": [], "train": [], "dev": [], "test": []}
    for it in items:
        out[member[it.id]].append(it)
        if member[it.id] != "test":
            out["validate"].append(it)
    return out


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
