"""MATH (competition mathematics): gold from the solution's last \\boxed{}; scored with math_verify.
`benchmark.levels` keeps only those difficulty levels (e.g. [5] for the level-5 subset)."""

from __future__ import annotations

import re

from pipeline.engines.benchmarks.base import Benchmark, BenchmarkError, Item, MetricResult
from pipeline.engines.benchmarks.files import Row, load_rows, unique_ids
from pipeline.engines.benchmarks.metrics import last_boxed, math_score

FORMAT = (
    '{"problem": str, "level": "Level 5", "type": "Algebra", "solution": "... \\\\boxed{<answer>}"} '
    '(hendrycks MATH; an "answer" field, int level and "unique_id" as in MATH-500 also work; '
    "a folder of the original per-problem .json files works too)"
)


def parse_level(row: Row) -> int | None:
    """ "Level 5" or 5 -> 5; "Level ?" (a few MATH rows) -> None."""
    level = row.get("level", (str, int), default=None)
    if isinstance(level, int) or level is None:
        return level
    m = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", level, re.IGNORECASE)
    return int(m.group(1)) if m else None


class MATH(Benchmark):
    name = "math"
    family = "math"
    scorer_name = "math-verify"

    def load(self) -> list[Item]:
        rows = load_rows(self.cfg, FORMAT, default_split="test")
        wanted = set(self.cfg.levels)
        items, kept = [], []
        for row in rows:
            level = parse_level(row)
            if wanted and level not in wanted:
                continue
            gold = row.get("answer", (str, int, float), default=None)
            gold = str(gold) if gold is not None else last_boxed(row.get("solution"))
            if gold is None:
                raise row.fail("field 'solution' has no \\boxed{...} answer (and there is no 'answer' field)")
            item_id = row.get("unique_id", default=None) or f"math-{row.key or row.index}"
            meta = {"level": level, "type": row.get("type", default=None) or row.get("subject", default=None)}
            items.append(Item(id=item_id, prompt=row.get("problem"), reference={"answer": gold}, meta=meta))
            kept.append(row)
        if not items:
            source = self.cfg.path or self.cfg.hub_id
            raise BenchmarkError(f"benchmark 'math': no problems of levels {sorted(wanted)} in {source}")
        unique_ids([it.id for it in items], kept)
        return items

    def score(self, item: Item, answer: str) -> MetricResult:
        return math_score("" if answer is None else str(answer), item.reference["answer"])
