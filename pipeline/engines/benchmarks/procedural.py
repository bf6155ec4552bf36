"""The offline procedural benchmark (demo, tests, word problems): reasoning-gym generators with their own answer
checks. Items are deterministic in (tasks, size, split_seed); each Item.reference holds what the
generator's `score_answer` needs as plain JSON, so an Item rebuilt from the store scores the same.

Word problems (`gsm_symbolic`, GSM8K-style) are scored as GSM8K is, by the exact final number: 1 when the last
number of the answer equals the gold number ("1,234" and "$12.00" read as 1234 and 12), else 0. Their generator's
own check gives any other number 0.01, so a near miss would still earn a reward. `benchmark.exact_number` turns
this rule on (true) or off (false) for every generator; null keeps it for EXACT_NUMBER_TASKS only."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import yaml
from tqdm import tqdm

from pipeline.engines.benchmarks.base import Benchmark, BenchmarkError, Item, MetricResult
from pipeline.engines.benchmarks.metrics import last_number, numeric_score

EXACT_NUMBER_TASKS = frozenset({"gsm_symbolic"})  # scored by the exact final number unless exact_number says otherwise


def parse_task(spec: str) -> tuple[str, dict[str, Any]]:
    """ "chain_sum" or "chain_sum:max_terms=3,max_digits=1" (generator options, YAML scalars) ->
    (name, options). Options let the demo pick a difficulty a tiny model can sometimes solve."""
    name, _, opts = spec.partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in opts.split(","))):
        key, eq, raw = part.partition("=")
        if not eq or not key.strip():
            raise BenchmarkError(f"benchmark.tasks: {spec!r}: expected name:key=value,key=value")
        options[key.strip()] = yaml.safe_load(raw)
    return name.strip(), options


def task_sizes(tasks: list[str], size: int) -> dict[str, int]:
    """`size` items in total, split as evenly as possible, earlier tasks taking the remainder."""
    if not tasks:
        raise BenchmarkError("benchmark 'procedural': benchmark.tasks is empty; name reasoning-gym generators")
    q, r = divmod(size, len(tasks))
    return {t: q + (i < r) for i, t in enumerate(tasks)}


def _dataset(task: str, seed: int, size: int, options: dict[str, Any]) -> Any:
    return _cached_dataset(task, seed, size, json.dumps(options, sort_keys=True))


@lru_cache(maxsize=64)
def _cached_dataset(task: str, seed: int, size: int, options_json: str) -> Any:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise BenchmarkError(
            f"benchmark.tasks: unknown reasoning-gym generator {task!r}; known: {', '.join(sorted(DATASETS))}"
        )
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(options_json))
    except (TypeError, AssertionError, ValueError) as e:
        raise BenchmarkError(f"benchmark.tasks: {task} with options {options_json}: {e}") from None


def _plain(x: Any) -> Any:
    """JSON round trip (tuples -> lists, odd objects -> str): exactly what the store gives back."""
    return json.loads(json.dumps(x, default=str))


def answer_candidates(answer: str) -> dict[str, str]:
    """The free-form answer, its last non-empty line and its last number: the generator's check is
    strict about format ("The answer is 42." is not "42"), a workflow's answer need not be."""
    text = answer.strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    out = {"raw": text}
    if lines and lines[-1] != text:
        out["last_line"] = lines[-1]
    num = last_number(text)
    if num is not None:
        out["last_number"] = num
    return out


class Procedural(Benchmark):
    name = "procedural"
    family = "procedural"
    scorer_name = "reasoning-gym checks"

    def load(self) -> list[Item]:
        seed = self.cfg.split_seed
        if len(set(self.cfg.tasks)) != len(self.cfg.tasks):
            raise BenchmarkError(f"benchmark.tasks: duplicate entries in {self.cfg.tasks}")
        per_task = {t: n for t, n in task_sizes(list(self.cfg.tasks), self.cfg.size).items() if n}
        generated: dict[str, list[Item]] = {}
        with tqdm(total=self.cfg.size, desc="procedural items", unit="item", leave=False) as bar:
            for spec, count in per_task.items():
                task, options = parse_task(spec)
                dataset = _dataset(task, seed, count, options)
                # options change the items: they get their own id prefix
                prefix = task + (f"[{','.join(f'{k}={v}' for k, v in sorted(options.items()))}]" if options else "")
                generated[spec] = []
                for idx in range(count):
                    example = dataset[idx]
                    ref = {
                        "task": task,
                        "options": options,
                        "seed": seed,
                        "size": count,
                        "question": example["question"],
                        "answer": _plain(example["answer"]),
                        "metadata": _plain(example.get("metadata", {})),
                    }
                    item = Item(id=f"{prefix}-{seed}-{idx}", prompt=example["question"], reference=ref,
                                meta={"task": task})
                    generated[spec].append(item)
                    bar.update()
        # interleave tasks so that a max_queries prefix of a split mixes them
        longest = max(len(v) for v in generated.values())
        return [g[i] for i in range(longest) for g in generated.values() if i < len(g)]

    def exact_number(self, task: str) -> bool:
        """Whether `task`'s answers are scored by the exact final number (module doc)."""
        return task in EXACT_NUMBER_TASKS if self.cfg.exact_number is None else self.cfg.exact_number

    def score(self, item: Item, answer: str) -> MetricResult:
        ref = item.reference
        if self.exact_number(ref["task"]):
            return exact_number_score(item, "" if answer is None else str(answer))
        ds = _dataset(ref["task"], ref["seed"], ref["size"], ref.get("options") or {})
        entry = {"question": ref["question"], "answer": ref["answer"], "metadata": ref["metadata"]}
        scores: dict[str, float] = {}
        for name, cand in answer_candidates("" if answer is None else str(answer)).items():
            try:
                scores[name] = min(1.0, max(0.0, float(ds.score_answer(cand, entry))))
            except Exception:  # a generator's check may choke on odd text: that candidate scores 0
                scores[name] = 0.0
        best = max(scores, key=scores.__getitem__)
        return MetricResult(scores[best], {"matched": best, "candidates": scores, "gold": ref["answer"]})


def exact_number_score(item: Item, answer: str) -> MetricResult:
    """GSM8K's rule (metrics.numeric_score): the answer's last number against the gold number, 1 or 0."""
    gold = str(item.reference["answer"])
    if last_number(gold) is None:
        raise BenchmarkError(f"benchmark.exact_number: item {item.id} ({item.reference['task']}) has the gold answer "
                             f"{gold!r}, which is no number; score that generator with its own check "
                             "(benchmark.exact_number: null or false)")
    res = numeric_score(answer, gold)
    return MetricResult(res.score, {**res.details, "metric": "exact_number"})
