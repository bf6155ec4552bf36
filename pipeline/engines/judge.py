"""Optional LLM-as-judge for free-form answers, on its own OpenAI-compatible endpoint (`scoring.reward.judge`).

The judge sees the question, the gold answer and the candidate, and must answer CORRECT or INCORRECT;
the verdict (1.0 / 0.0) becomes the metric of non-code benchmarks, the benchmark's own metric is kept
in the details.
"""

from __future__ import annotations

import re

from pipeline.config import ExecutorConfig, JudgeConfig
from pipeline.engines.benchmarks.base import MetricResult
from pipeline.engines.executors import OpenAIExecutor

PROMPT = """You grade answers. Decide whether the candidate answer means the same as the gold answer for \
the question (ignore formatting and wording; numbers must match).

Question:
{question}

Gold answer:
{gold}

Candidate answer:
{answer}

Reply with exactly one word: CORRECT or INCORRECT."""

_VERDICT = re.compile(r"\b(INCORRECT|CORRECT)\b", re.IGNORECASE)


def parse_verdict(text: str) -> float | None:
    """1.0 for CORRECT, 0.0 for INCORRECT (the first verdict word wins), None when neither appears."""
    m = _VERDICT.search(text or "")
    if m is None:
        return None
    return 1.0 if m.group(1).upper() == "CORRECT" else 0.0


class Judge:
    def __init__(self, cfg: JudgeConfig, timeout_s: float = 60.0, max_retries: int = 4):
        self.executor = OpenAIExecutor(ExecutorConfig(
            kind="openai", model=cfg.model, base_url=cfg.base_url, api_key_env=cfg.api_key_env,
            temperature=0.0, max_tokens=8, timeout_s=timeout_s, max_retries=max_retries))

    async def grade(self, question: str, gold: str, answer: str) -> MetricResult:
        """Raises ExecutorError when the judge endpoint fails (a transient failure of the row)."""
        prompt = PROMPT.format(question=question, gold=gold, answer=answer)
        comp = await self.executor.complete([{"role": "user", "content": prompt}])
        text = comp.texts[0] if comp.texts else ""
        verdict = parse_verdict(text)
        return MetricResult(verdict or 0.0, {"judge_reply": text[:200], "judge_parsed": verdict is not None,
                                             "judge_tokens": comp.tokens_in + comp.tokens_out})

    async def aclose(self) -> None:
        await self.executor.aclose()
