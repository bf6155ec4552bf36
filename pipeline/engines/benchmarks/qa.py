"""Reading-comprehension QA: DROP (HF ucinlp/drop) and HotpotQA (original and HF formats).
The prompt carries the passage/context and the question; scored by max token F1 over the gold answers."""

from __future__ import annotations

from pipeline.engines.benchmarks.base import Benchmark, Item, MetricResult
from pipeline.engines.benchmarks.files import Row, load_rows, unique_ids
from pipeline.engines.benchmarks.metrics import f1_score

DROP_FORMAT = (
    '{"section_id": str, "query_id": str, "passage": str, "question": str, '
    '"answers_spans": {"spans": [str, ...], "types": [str, ...]}} (HF ucinlp/drop)'
)
HOTPOT_FORMAT = (
    '{"_id", "question", "answer", "context": [[title, [sentence, ...]], ...]} (original HotpotQA) or '
    '{"id", "question", "answer", "context": {"title": [...], "sentences": [[...], ...]}} (HF hotpot_qa)'
)


class _QA(Benchmark):
    family = "qa"
    scorer_name = "token F1"
    FORMAT: str  # the record format named in errors

    def load(self) -> list[Item]:
        rows = load_rows(self.cfg, self.FORMAT, default_split="validation")
        items = [self._item(r) for r in rows]
        unique_ids([it.id for it in items], rows)
        return items

    @staticmethod
    def _item(r: Row) -> Item:
        raise NotImplementedError

    def score(self, item: Item, answer: str) -> MetricResult:
        return f1_score("" if answer is None else str(answer), item.reference["answers"])


class DROP(_QA):
    name = "drop"
    FORMAT = DROP_FORMAT

    @staticmethod
    def _item(row: Row) -> Item:
        spans = row.get("answers_spans", dict)
        # HF flattens the validated answers (and the parts of multi-span answers) into one list: each
        # span counts as a gold alternative, as in common DROP evaluations of generated answers.
        golds = list(dict.fromkeys(s for s in spans.get("spans") or [] if isinstance(s, str) and s.strip()))
        if not golds:
            raise row.fail("field 'answers_spans.spans' holds no answer")
        prompt = f"Passage: {row.get('passage')}\n\nQuestion: {row.get('question')}"
        meta = {"section_id": row.get("section_id", default=None), "types": spans.get("types") or []}
        return Item(id=row.get("query_id"), prompt=prompt, reference={"answers": golds}, meta=meta)


def hotpot_paragraphs(row: Row) -> list[tuple[str, list[str]]]:
    """(title, sentences) pairs from either HotpotQA layout."""
    ctx = row.get("context", (list, dict))
    if isinstance(ctx, dict):  # HF: {"title": [...], "sentences": [[...], ...]}
        titles, sents = ctx.get("title"), ctx.get("sentences")
        if not isinstance(titles, list) or not isinstance(sents, list) or len(titles) != len(sents):
            raise row.fail("field 'context' should hold equal-length lists 'title' and 'sentences'")
        return [(str(t), list(s)) for t, s in zip(titles, sents, strict=True)]
    out = []
    for para in ctx:  # original: [[title, [sentence, ...]], ...]
        if not (isinstance(para, list) and len(para) == 2 and isinstance(para[1], list)):
            raise row.fail("field 'context' should be a list of [title, [sentences...]] pairs")
        out.append((str(para[0]), list(para[1])))
    return out


class HotpotQA(_QA):
    name = "hotpotqa"
    FORMAT = HOTPOT_FORMAT

    @staticmethod
    def _item(r: Row) -> Item:
        item_id = r.get("_id", default=None) or r.get("id")
        context = "\n\n".join(f"{title}: {''.join(sents).strip()}" for title, sents in hotpot_paragraphs(r))
        prompt = f"Context:\n{context}\n\nQuestion: {r.get('question')}"
        meta = {"type": r.get("type", default=None), "level": r.get("level", default=None)}
        return Item(id=item_id, prompt=prompt, reference={"answers": [r.get("answer")]}, meta=meta)
