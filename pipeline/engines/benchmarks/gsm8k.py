"""GSM8K: grade-school word problems; the gold is the number after "####"; scored by the last number."""

from __future__ import annotations

from pipeline.engines.benchmarks.base import Benchmark, Item, MetricResult
from pipeline.engines.benchmarks.files import load_rows, unique_ids
from pipeline.engines.benchmarks.metrics import gsm8k_gold, numeric_score

FORMAT = '{"question": str, "answer": "<worked solution>\\n#### <number>"} (openai/gsm8k, config main)'


class GSM8K(Benchmark):
    name = "gsm8k"
    family = "math"
    scorer_name = "number"

    def load(self) -> list[Item]:
        rows = load_rows(self.cfg, FORMAT, default_split="test")
        items = []
        for row in rows:
            solution = row.get("answer")
            gold = gsm8k_gold(solution)
            if gold is None:
                raise row.fail("field 'answer' has no '#### <number>' final answer")
            # the official files carry no ids: the row index is stable for a given file
            items.append(Item(id=f"gsm8k-{row.index}", prompt=row.get("question"), reference={"answer": gold}))
        unique_ids([it.id for it in items], rows)
        return items

    def score(self, item: Item, answer: str) -> MetricResult:
        return numeric_score("" if answer is None else str(answer), item.reference["answer"])
