"""`pipeline bench sandbox`: per-workflow sandbox overhead against a bare `python -c pass` subprocess
(measured in the same run), trivial-workflow throughput at concurrency 2, and the cost of grading one
HumanEval answer (its canonical solution against the hidden tests, the score stage's other sandbox run).
Goal: <= 30 ms overhead, >= 40 workflows/s."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

from pipeline.engines.sandbox import Limits, Sandbox, run_workflow

TRIVIAL = "async def solve(problem):\n    return problem\n"


def _bare_python_ms(count: int) -> list[float]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        out.append((time.perf_counter() - t) * 1000)
    return out


async def _sequential_ms(sandbox: Sandbox, count: int) -> list[float]:
    out = []
    for i in range(count):
        t = time.perf_counter()
        r = await run_workflow(TRIVIAL, str(i), sandbox=sandbox, limits=Limits())
        out.append((time.perf_counter() - t) * 1000)
        if r.status != "ok":
            raise RuntimeError(f"trivial workflow failed: {r.status}: {r.error}")
    return out


async def _throughput(sandbox: Sandbox, count: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> str:
        async with sem:
            return (await run_workflow(TRIVIAL, str(i), sandbox=sandbox, limits=Limits())).status

    t = time.perf_counter()
    statuses = await asyncio.gather(*(one(i) for i in range(count)))
    dt = time.perf_counter() - t
    if set(statuses) != {"ok"}:
        raise RuntimeError(f"trivial workflows failed: {statuses}")
    return count / dt


def _grading_ms(count: int) -> list[float]:
    """Grade the canonical solutions of the first `count` HumanEval tasks one after another (the process-wide
    sandbox, as the benchmark uses it); every one must pass."""
    from pipeline.config import BenchmarkConfig
    from pipeline.engines.benchmarks.code import HumanEval, canonical_humaneval_answers

    bench = HumanEval(BenchmarkConfig(name="humaneval"))
    items, answers = bench.load()[:count], canonical_humaneval_answers()
    out = []
    for it in items:
        t = time.perf_counter()
        m = bench.score(it, answers[it.id])
        out.append((time.perf_counter() - t) * 1000)
        if m.score != 1.0:
            raise RuntimeError(f"canonical solution of {it.id} not graded 1.0: {m.details}")
    return out


def main(count: int = 100) -> None:
    sandbox = Sandbox()
    t = time.perf_counter()
    iso = sandbox.ensure_started()
    start_ms = (time.perf_counter() - t) * 1000
    try:
        asyncio.run(_sequential_ms(sandbox, 5))  # warm-up
        bare = statistics.median(_bare_python_ms(20))
        seq = statistics.median(asyncio.run(_sequential_ms(sandbox, count)))
        rate = asyncio.run(_throughput(sandbox, 2 * count, 2))
    finally:
        sandbox.close()
    _grading_ms(5)  # warm-up (starts the process-wide sandbox)
    grading = statistics.median(_grading_ms(count))
    active = [k for k, v in iso.items() if v is True]
    print(f"isolation: {', '.join(active)}" + (f"; notes: {iso['notes']}" if iso.get("notes") else ""))
    print(f"zygote start (once):                 {start_ms:8.1f} ms")
    print(f"bare `python -c pass` subprocess:    {bare:8.1f} ms (median of 20)")
    print(f"sandboxed trivial workflow:          {seq:8.1f} ms (median of {count}, sequential)")
    print(f"overhead vs bare python:             {seq - bare:8.1f} ms  (ratio {seq / bare:.2f}x; goal <= 30 ms)")
    print(f"throughput at concurrency 2:         {rate:8.1f} workflows/s (goal >= 40)")
    print(f"grading one HumanEval answer:        {grading:8.1f} ms (median of {count}, sequential)")


if __name__ == "__main__":
    main()
