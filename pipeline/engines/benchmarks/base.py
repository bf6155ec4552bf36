"""The benchmark interface every loader implements, the registry, and deterministic splits."""

from __future__ import annotations

import copy
import hashlib
import json
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.config import task_entry_points, unknown_task_message

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pipeline.config import BenchmarkConfig


class BenchmarkError(ValueError):
    """Unusable benchmark input (missing file, wrong format); the message says how to fix it."""


class ScorerError(RuntimeError):
    """A user's scorer failed on one answer (it raised, hung past its timeout, or returned no score in [0, 1]): the
    score stage gives that run status `error` with this message and goes on."""


class ScorerStopped(ScorerError):
    """A row the user's scorer was not called on: its first calls all failed the same way
    (`benchmark.scorer_stop_after`), so the rest of the rows are not sent to it. The score stage stores it as any
    ScorerError (status `error`, re-scored by --only-failed once the scorer is fixed); `pipeline validate` counts
    the row as not scored."""


@dataclass(frozen=True)
class ErrorGroup:
    """One error message and the rows that got it: `count` rows, the first few of them (in order) in `rows`."""

    message: str
    count: int
    rows: tuple[str, ...]


def group_errors(errors: Iterable[tuple[str, str]], shown: int = 3) -> list[ErrorGroup]:
    """(row, message) pairs grouped by identical message, in the order each message first came, each with its
    count and its first `shown` rows: a scorer failing the same way on 10,000 rows is one line, not 10,000."""
    rows: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for row, message in errors:
        counts[message] = counts.get(message, 0) + 1
        first = rows.setdefault(message, [])
        if len(first) < shown:
            first.append(row)
    return [ErrorGroup(message, counts[message], tuple(first)) for message, first in rows.items()]


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
    scorer_name: str = "its own"  # what `pipeline tasks` says scores an answer

    def __init__(self, cfg: BenchmarkConfig):
        self.cfg = cfg

    @abstractmethod
    def load(self) -> list[Item]:
        """All items, in a stable order."""

    @abstractmethod
    def score(self, item: Item, answer: str) -> MetricResult:
        """Score a workflow's final answer against the hidden reference."""

    def reference_answer(self, item: Item) -> str | None:
        """A correct answer to `item` as a workflow would return it, which `pipeline validate` scores (it must score
        1.0); None where the reference is no answer (a code benchmark's hidden tests)."""
        return None if self.family == "code" else item.gold_text()

    def close(self) -> None:
        """Release what scoring holds (a user scorer's worker process); scoring calls it when done."""
        return None

    def items(self, split: str | None = None) -> list[Item]:
        """The items of `split` (default: the config's train split), capped by max_queries."""
        split = split or self.cfg.train_split
        if split == "test" and self.cfg.test_seed is not None:
            return self._fresh_test()
        items = split_items(self.load(), self.cfg.split_seed, self.cfg.test_share, self.cfg.dev_share,
                            self.cfg.one_split_per_text)[split]
        if not items and split in ("train", "dev"):  # a share too small for the benchmark's size
            raise BenchmarkError(f"benchmark {self.name!r}: split {split!r} is empty (benchmark.test_share "
                                 f"{self.cfg.test_share}, benchmark.dev_share {self.cfg.dev_share}); raise dev_share "
                                 f"or the benchmark's size")
        return items[: self.cfg.max_queries] if self.cfg.max_queries else items


    def with_config(self, **update: Any) -> Benchmark:
        """This task with some `benchmark` fields changed (e.g. max_queries=None: a split whole), its loaded state
        shared."""
        changed = copy.copy(self)
        changed.cfg = self.cfg.model_copy(update=update)
        return changed

    def _fresh_test(self) -> list[Item]:
        """benchmark.test_seed: the test split of this task loaded at test_seed, without any item whose normalised
        text is an item of split_seed's (whichever split: the old test split has been read), capped by max_queries."""
        fresh = self.with_config(split_seed=self.cfg.test_seed, test_seed=None, max_queries=None)
        seen = {normalised_text(it.prompt) for it in self.load()}
        items = [it for it in fresh.items("test") if normalised_text(it.prompt) not in seen]
        return items[: self.cfg.max_queries] if self.cfg.max_queries else items


def split_items(items: list[Item], seed: int, test_share: float = 0.8, dev_share: float = 0.0,
                one_split_per_text: bool = False) -> dict[str, list[Item]]:
    """Deterministic splits: rank items by a seeded hash of their id (so membership depends on the ids and the seed,
    never on the file's row order or on other items); the first round(n (1 − test_share)) are `validate`, the rest
    `test`. Within `validate`, the last round(|validate| dev_share) of the ranking are `dev` and the others `train`:
    `test` does not move when dev_share changes, and a larger dev_share moves items from train to dev only.
    `one_split_per_text` (benchmark.one_split_per_text): items whose prompts are the same `normalised_text` all go to
    the split of the first of them in the ranking, so that a held-out query is never word for word a training one
    (the split sizes then move by the duplicates moved). Each split keeps the items' original order."""
    def key(it: Item) -> str:
        return hashlib.sha256(f"{seed}:{it.id}".encode()).hexdigest()

    ranked = sorted(items, key=key)
    k = round(len(items) * (1 - test_share))  # rounding the validate count, as the former validate_fraction did
    n_train = k - round(k * dev_share)
    member = {it.id: "train" if i < n_train else "dev" if i < k else "test" for i, it in enumerate(ranked)}
    if one_split_per_text:
        first: dict[str, str] = {}  # normalised text -> the split of its first item in the ranking
        for item in ranked:
            member[item.id] = first.setdefault(normalised_text(item.prompt), member[item.id])
    out: dict[str, list[Item]] = {"validate": [], "train": [], "dev": [], "test": []}
    for it in items:
        out[member[it.id]].append(it)
        if member[it.id] != "test":
            out["validate"].append(it)
    return out


def normalised_text(text: str) -> str:
    """A query's text as `split_items` compares it: lowercase, whitespace runs as one space, punctuation and spaces at
    both ends stripped ("Is 2101 a leap year?" and " is 2101 a  leap year" are one text)."""
    return " ".join(text.lower().split()).strip(string.punctuation + " ")


def load_benchmark(cfg: BenchmarkConfig) -> Benchmark:
    """The task `cfg.name`, found in the entry-point group `workflow_grpo.tasks` (the shipped benchmarks and any
    installed plugin's tasks alike): its entry point is a Benchmark class or a function of the config returning a
    Benchmark. Modules import on use, so one missing optional library fails only its task."""
    known = task_entry_points()
    if cfg.name not in known:
        raise BenchmarkError(unknown_task_message(cfg.name, list(known)))
    try:
        factory = known[cfg.name].load()
    except Exception as e:  # a plugin that fails to import: say which, not a bare traceback
        raise BenchmarkError(f"task {cfg.name!r}: its entry point {known[cfg.name].value!r} does not load: "
                             f"{type(e).__name__}: {e}") from e
    bench = factory(cfg)
    if not isinstance(bench, Benchmark):
        raise BenchmarkError(f"task {cfg.name!r}: its entry point {known[cfg.name].value!r} gave a "
                             f"{type(bench).__name__}, not a Benchmark")
    return bench
