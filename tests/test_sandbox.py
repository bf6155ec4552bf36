"""The sandbox's ordinary behaviour: answers, errors, helpers over the pipe, budget, accounting, run_tests."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.engines.executors import ExecutorReply, RequestRefused
from pipeline.engines.sandbox import Limits, Sandbox, build_messages, run_test_suite, run_workflow, run_workflow_sync

LIMITS = Limits(timeout_s=5, cpu_s=3, max_llm_calls=3)


@pytest.fixture(scope="module")
def sb():
    s = Sandbox()
    s.ensure_started()
    yield s
    s.close()


class FakeExecutor:
    """Echoes the conversation; counts tokens as characters; fails on demand."""

    def __init__(self, fail: bool = False, refuse: bool = False):
        self.fail, self.refuse, self.calls = fail, refuse, []

    async def complete(self, messages, temperature=None, n=1, max_tokens=None, seed=None):
        self.calls.append({"messages": messages, "temperature": temperature, "n": n})
        if self.fail:
            raise ConnectionError("endpoint down")
        if self.refuse:
            raise RequestRefused("the prompt's 9205 tokens and 24 to generate exceed the context of 8192 tokens")
        text = json.dumps(messages)
        return ExecutorReply([f"{i}:{text}" for i in range(n)], tokens_in=len(text), tokens_out=2, cost_usd=0.5)


def run(sb, code, problem="p", **kw):
    kw.setdefault("limits", LIMITS)
    return asyncio.run(run_workflow(code, problem, sandbox=sb, **kw))


def test_answer_and_isolated_process(sb):
    code = ("import os\nasync def solve(problem):\n"
            "    return '|'.join([problem, str(os.listdir('.')), ','.join(sorted(os.environ))])\n")
    r1, r2 = run(sb, code, "hello"), run(sb, code, "again")
    assert r1.status == "ok" and r2.status == "ok"
    problem, listing, env = r1.answer.split("|")
    assert problem == "hello" and listing == "[]"  # a fresh empty work dir per run
    assert env == "HOME,LANG,PATH,PYTHONDONTWRITEBYTECODE,TMPDIR"  # scrubbed environment
    assert r1.details["exit"]["code"] == 0 and isinstance(r1.wall_s, float)  # recorded; speed: pipeline bench sandbox


def test_non_str_answer_is_stringified_and_none_is_an_error(sb):
    assert run(sb, "async def solve(p):\n    return 42\n").answer == "42"
    r = run(sb, "async def solve(p):\n    return None\n")
    assert r.status == "exec_error" and r.error == "solve() returned None"


def test_exception_is_exec_error_with_traceback(sb):
    r = run(sb, "async def solve(p):\n    print('thinking')\n    raise KeyError('boom')\n")
    assert r.status == "exec_error" and "KeyError: 'boom'" in r.error and "<workflow>" in r.error
    assert r.details["stdout"] == "thinking\n"


def test_invalid_workflow_never_runs(sb):
    r = run(sb, "def solve(p):\n    return p\n")
    assert r.status == "invalid" and "async" in r.error and r.details == {}
    assert run(sb, "async def solve(p):\n  return (\n").status == "invalid"
    assert run(sb, "async def solve(p):\n    return p\n", max_chars=10).status == "invalid"
    r = run(sb, "async def solve(p):\n    *a = p\n    return a\n")  # parses, but does not compile
    assert r.status == "invalid" and "starred assignment" in r.error


def test_wall_timeout(sb):
    r = run(sb, "import asyncio\nasync def solve(p):\n    await asyncio.sleep(30)\n", limits=Limits(timeout_s=0.5))
    assert r.status == "timeout" and r.error == "wall timeout after 0.5s"


class SlowExecutor(FakeExecutor):
    """Answers after `delay_s`, as a server with a queue would."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    async def complete(self, messages, temperature=None, n=1, max_tokens=None, seed=None):
        await asyncio.sleep(self.delay_s)
        return await super().complete(messages, temperature, n, max_tokens)


def test_the_wall_limit_leaves_out_waiting_on_the_executor(sb):
    # two calls of 1.5 s each (one after the other) against a 1 s limit: the workflow's own time is far below it
    code = "async def solve(p):\n    a = await llm(p)\n    b = await llm(p)\n    return 'done'\n"
    r = run(sb, code, executor=SlowExecutor(1.5), limits=Limits(timeout_s=1.0))
    assert (r.status, r.answer, r.llm_calls) == ("ok", "done", 2)
    # its own time still counts, after a wait as before one
    slow = "import asyncio\nasync def solve(p):\n    await llm(p)\n    await asyncio.sleep(30)\n"
    r = run(sb, slow, executor=SlowExecutor(1.5), limits=Limits(timeout_s=1.0))
    assert r.status == "timeout" and r.llm_calls == 1


def test_llm_helper_counts_tokens_cost_and_builds_system_message(sb):
    ex = FakeExecutor()
    code = ("import asyncio\nasync def solve(problem):\n"
            "    a, b = await asyncio.gather(llm(problem, role='Solver.', instructions='Be brief.'),\n"
            "                                llm([{'role': 'user', 'content': 'x'}], temperature=0.7, n=2))\n"
            "    return str(len(a)) + str(len(b))\n")
    r = run(sb, code, "2+2?", executor=ex)
    assert r.status == "ok" and r.answer == "12"
    assert r.llm_calls == 2 and r.tokens_out == 4 and r.cost_usd == pytest.approx(1.0)
    first = next(c for c in ex.calls if c["n"] == 1)
    assert first["messages"] == [{"role": "system", "content": "Solver.\nBe brief."},
                                 {"role": "user", "content": "2+2?"}]
    assert first["temperature"] is None  # the executor's configured default (paper: 0)
    assert r.tokens_in == sum(len(json.dumps(c["messages"])) for c in ex.calls)


def test_llm_budget_is_enforced(sb):
    code = ("async def solve(problem):\n    out = []\n    for i in range(5):\n        try:\n"
            "            await llm('q')\n            out.append('ok')\n        except Exception as e:\n"
            "            out.append(str(e))\n    return '|'.join(out)\n")
    r = run(sb, code, executor=FakeExecutor())
    assert r.status == "ok" and r.llm_calls == 3
    assert r.answer.split("|") == ["ok"] * 3 + ["llm call budget exhausted (3 calls)"] * 2
    assert r.details["budget_exhausted"] is True


def test_bad_llm_arguments_are_the_workflows_error(sb):
    r = run(sb, "async def solve(p):\n    return (await llm('q', n=100))[0]\n", executor=FakeExecutor())
    assert r.status == "exec_error" and "bad llm() call" in r.error
    r = run(sb, "async def solve(p):\n    return (await llm([{'role': 'x'}]))[0]\n", executor=FakeExecutor())
    assert r.status == "exec_error" and "messages must be" in r.error


def test_executor_failure_is_executor_error_even_if_caught(sb):
    code = ("async def solve(p):\n    try:\n        await llm('q')\n    except Exception:\n        pass\n"
            "    return 'x'\n")
    r = run(sb, code, executor=FakeExecutor(fail=True))
    assert r.status == "executor_error" and "endpoint down" in r.error


def test_a_refused_call_is_the_workflows_error_told_to_it(sb):
    """A call the executor refuses for what it asks (a prompt past the context) is no outage: the workflow's llm()
    raises with the reason, and a workflow that does not catch it fails as its own error (scored, never re-scored)."""
    code = ("async def solve(p):\n    try:\n        await llm('q' * 100000)\n    except Exception as e:\n"
            "        return str(e)\n")
    r = run(sb, code, executor=FakeExecutor(refuse=True))
    assert r.status == "ok" and r.llm_calls == 1
    assert r.answer == ("the executor refused the call: the prompt's 9205 tokens and 24 to generate exceed the "
                        "context of 8192 tokens")
    r = run(sb, "async def solve(p):\n    return (await llm('q'))[0]\n", executor=FakeExecutor(refuse=True))
    assert r.status == "exec_error" and "the executor refused the call" in r.error


def test_run_tests_helper(sb):
    public = {"entry_point": "add", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "timeout_s": 2}
    code = ("async def solve(problem):\n    good = await run_tests('def add(a, b):\\n    return a + b', 'add')\n"
            "    bad = await run_tests('def plus(a, b):\\n    return a - b', 'plus')\n"
            "    broken = await run_tests('def add(:', 'add')\n"
            "    slow = await run_tests('def add(a, b):\\n    while True: pass', 'add')\n"
            "    import json\n    return json.dumps([good, bad, broken, slow])\n")
    r = run(sb, code, public_tests=public, limits=Limits(timeout_s=20, cpu_s=15))
    good, bad, broken, slow = json.loads(r.answer)
    assert good == "no error"
    assert [f["error_type"] for f in bad] == ["AssertionError", "AssertionError"]
    assert bad[0]["test"] == public["tests"][0]
    assert set(bad[0]) == {"test", "error_type", "message", "traceback"}
    assert "exec_fail_case" in broken and "SyntaxError" in broken["exec_fail_case"]
    assert [f["error_type"] for f in slow] == ["TimeoutError", "TimeoutError"]


def test_run_test_suite(sb):
    rep = asyncio.run(run_test_suite("def f(x):\n    return x * 2\n", ["assert f(2) == 4", "assert f(3) == 7"],
                                     timeout_s=2, sandbox=sb))
    assert rep["passed"] == 1 and rep["total"] == 2 and rep["failures"][0]["test"] == "assert f(3) == 7"
    rep = asyncio.run(run_test_suite("import time\ntime.sleep(60)\n", ["assert f(1) == 2"], timeout_s=0.5, sandbox=sb))
    assert "exec_fail_case" in rep and "timed out" in rep["exec_fail_case"]


def test_sync_wrapper():
    r = run_workflow_sync("async def solve(p):\n    return p * 2\n", "ab")
    assert r.status == "ok" and r.answer == "abab"


def test_build_messages():
    assert build_messages("hi") == [{"role": "user", "content": "hi"}]
    assert build_messages("hi", role="R", instructions="") == [{"role": "system", "content": "R"},
                                                               {"role": "user", "content": "hi"}]
    merged = build_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], instructions="I")
    assert merged[0] == {"role": "system", "content": "I\nS"} and len(merged) == 2
    for bad in ([], [{"role": "tool", "content": "x"}], [{"role": "user"}], 3):
        with pytest.raises(ValueError):
            build_messages(bad)


def test_isolation_report(sb):
    iso = sb.isolation
    assert {"privilege_drop", "net_namespace", "mount_namespace", "readonly_root", "file_view", "notes"} <= set(iso)
    assert isinstance(iso["notes"], list)
    if not iso["file_view"]:  # the exposure is said, not implied
        assert any("NO FILE VIEW" in n for n in iso["notes"]), iso["notes"]
    else:
        assert iso["view"]["masked"] or iso["view"]["exposed"]


def test_workflows_import_the_stdlib_but_not_site_packages(sb):
    """The file view keeps what workflows legitimately use: stdlib modules the zygote never imported
    (C extensions from lib-dynload included), and a Python subprocess; third-party packages stay out."""
    code = ("import subprocess, sys\nasync def solve(p):\n    import sqlite3, decimal, zlib, csv, fractions\n"
            "    n = sqlite3.connect(':memory:').execute('select 6*7').fetchone()[0]\n"
            "    out = subprocess.run([sys.executable, '-c', 'import json; print(json.dumps([1]))'],\n"
            "                         capture_output=True, text=True, check=True).stdout.strip()\n"
            "    try:\n        import numpy  # noqa\n        third = 'numpy'\n    except ImportError:\n"
            "        third = 'none'\n    return f'{n} {decimal.Decimal(\"1.5\") * 2} {out} {third}'\n")
    r = run(sb, code, limits=Limits(timeout_s=20, cpu_s=10))
    assert r.status == "ok", r.error
    n, dec, out, third = r.answer.split()
    assert (n, dec, out) == ("42", "3.0", "[1]")
    if sb.isolation.get("file_view"):
        assert third == "none"


def test_a_workflows_set_order_is_the_same_in_every_sandbox_process(sb):
    """A vote's tie-break (`max(set(votes), key=votes.count)`) follows the set's iteration order, which Python
    randomises per interpreter unless PYTHONHASHSEED is fixed. Two zygotes (two scoring processes, or two sessions)
    must iterate alike, or the same replies give other answers and common random numbers leave that noise behind
    (seen in the CRN bench: the same program, the same cached replies, 60 in one arm and 44 in the other)."""
    code = ("async def solve(p):\n    votes = [str(n) for n in range(40)]\n"
            "    return ','.join(set(votes)) + '|' + str(hash('tie-break'))\n")
    other = Sandbox()
    try:
        other.ensure_started()
        answers = [run(sb, code).answer, run(sb, code).answer, run(other, code).answer]
    finally:
        other.close()
    assert answers[0] == answers[1] == answers[2]


def test_the_workflows_random_module_is_seeded_by_its_slot_under_common_random_numbers(sb):
    """The workflow's own draws pair across arms like its executor calls: the same slot draws the same, another
    rep or query draws otherwise; without a slot (common random numbers off) two runs draw independently."""
    from pipeline.engines.executors import CallSeeds, SampleSlot

    code = "import random\nasync def solve(p):\n    return repr([random.random() for _ in range(3)])\n"
    slot = SampleSlot(seed=0, query_id="q1", slot=2, rep=0)
    first, again = (run(sb, code, seeds=CallSeeds(slot)).answer for _ in range(2))
    other_rep = run(sb, code, seeds=CallSeeds(SampleSlot(seed=0, query_id="q1", slot=2, rep=1))).answer
    other_query = run(sb, code, seeds=CallSeeds(SampleSlot(seed=0, query_id="q2", slot=2, rep=0))).answer
    unseeded = [run(sb, code, seeds=CallSeeds(None)).answer for _ in range(2)]
    assert first == again
    assert len({first, other_rep, other_query}) == 3
    assert unseeded[0] != unseeded[1] and first not in unseeded
