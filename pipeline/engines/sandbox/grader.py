"""Grading the candidate cannot reach (stdlib only; runs inside the sandboxed child).

The program under test and the tests that grade it never share a process:

- the *grader* (this process) holds the verdict's channel, compiles the tests and runs their trusted setup
  (HumanEval's prompt and `check`) before any candidate code runs, runs each test under its own timer, and
  reports the verdict;
- the *candidate* is forked from the grader before the tests are known (suite mode forks it before even
  reading the payload, so no copy of the hidden tests is in its memory). It closes every fd but its socket
  to the grader, then execs the program and answers calls, by value only.

A test that calls the entry point calls a proxy here: the arguments go to the candidate as plain values
(copies: mutating them changes nothing here) and the returned value comes back built from exact plain
types (values.py), else the test fails with `RewardHack`. So the candidate cannot patch the grader's
builtins, walk its frames or garbage, write its verdict (the grader is not dumpable: no ptrace,
/proc/<pid>/mem or pidfd_getfd from the same uid), or exit its way to a pass: once it is gone, every
remaining call fails, and a suite whose candidate did not outlive its last test is `early_exit`.

Statuses of a suite: pass | fail | exec_error | timeout | early_exit | reward_hack | forged.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback

from pipeline.engines.sandbox import candidate, values

MAX_TEXT = 4000  # chars of a message or traceback in a report
MAX_LINE = 8 << 20  # bytes of one message from the candidate
# a module name the candidate says a test's free name is bound to; the grader imports only stdlib ones
NOT_IMPORTED = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"})


class GradingFailure(Exception):
    """A test failed for a reason the candidate caused outside plain Python errors; `status` names it."""
    status = "fail"


class RewardHack(GradingFailure):
    status = "reward_hack"


class ForgedReply(GradingFailure):
    status = "forged"


class CandidateExited(GradingFailure):
    status = "early_exit"


class CandidateError(Exception):
    """The candidate raised something that is not a builtin exception the grader can rebuild."""


# most telling first: a suite's status is the first of these that any failure has
ORDER = ("reward_hack", "forged", "early_exit", "timeout", "fail")


def status_of(e: BaseException) -> str:
    if isinstance(e, GradingFailure):
        return e.status
    return "timeout" if isinstance(e, TimeoutError) else "fail"


class Candidate:
    """The forked process that holds the candidate's program (see the module doc)."""

    def __init__(self):
        candidate.set_dumpable(False)  # before the fork: the candidate must never find us ptrace-able
        ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                ours.close()
                candidate.serve(theirs)
            finally:
                os._exit(0)
        theirs.close()
        self.sock, self.buf, self.seq = ours, b"", 0
        self.gone: tuple[type[GradingFailure] | type[TimeoutError], str] | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): poll waitpid instead
            self.pidfd = None

    def alive(self) -> bool:
        if self.gone is not None:
            return False
        if self.pidfd is not None:
            return not select.select([self.pidfd], [], [], 0)[0]
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:  # reaped by an earlier look
            return False

    def call(self, msg: dict) -> dict:
        """Send one request and wait (under the caller's timer) for its reply. Anything but the reply (a
        message out of turn, broken JSON, the candidate's end, a timeout) stops the candidate for the rest
        of the suite: its state is unknown, and a hung one would cost every later test a timeout."""
        if self.gone is not None:
            raise self.gone[0](self.gone[1])
        self.seq += 1
        try:
            self.sock.sendall((json.dumps({**msg, "id": self.seq}) + "\n").encode(), socket.MSG_NOSIGNAL)
            line = self._line()
        except TimeoutError as e:  # our timer (TimeoutError is an OSError: this clause comes first)
            self.end(TimeoutError, str(e))
            raise
        except GradingFailure as e:
            self.end(type(e), str(e))
            raise
        except OSError as e:  # its end of the socket is gone
            self.end(CandidateExited, f"the candidate's channel broke: {e}")
            raise CandidateExited(self.gone[1]) from None
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if type(reply) is not dict or reply.get("id") != self.seq:
            self.end(ForgedReply, f"a message that is not the reply: {line[:200]!r}")
            raise ForgedReply(self.gone[1])
        return reply

    def _line(self) -> bytes:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise GradingFailure(f"a reply over {MAX_LINE} bytes")
            waits = [self.sock] + ([self.pidfd] if self.pidfd is not None else [])
            ready = select.select(waits, [], [], None if self.pidfd is not None else 0.05)[0]
            if self.sock in ready:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise CandidateExited("the candidate closed its channel (exited)")
                self.buf += chunk
            elif ready or not self.alive():
                raise CandidateExited("the candidate process exited")
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def end(self, kind: type, why: str) -> None:
        """Kill the candidate; later calls fail at once with `kind`."""
        signal.setitimer(signal.ITIMER_REAL, 0)  # a late tick must not turn this failure into a timeout
        if self.gone is None:
            self.gone = (kind, f"{why} (the candidate was stopped)")
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class _Remote:
    """What a test calls in place of the candidate's function."""

    def __init__(self, cand: Candidate, name: str):
        self.cand, self.name = cand, name

    def __call__(self, *args, **kwargs):
        try:
            a, k = values.encode(list(args)), values.encode(kwargs)
        except values.NotPlain as e:
            raise TypeError(f"the test passes {e} to {self.name}(): only plain values reach the candidate") from None
        reply = self.cand.call({"op": "call", "name": self.name, "args": a, "kwargs": k})
        if "value" in reply:
            try:
                return values.decode(reply["value"])
            except ValueError as e:
                self.cand.end(ForgedReply, f"{self.name}() sent a value that is not plain: {e}")
                raise ForgedReply(self.cand.gone[1]) from None
        if "hack" in reply:
            raise RewardHack(f"{self.name}() returned {str(reply['hack'])[:200]}, not a plain value")
        if "raise" in reply:
            raise _rebuild(reply["raise"])
        if "exit" in reply:
            self.cand.end(CandidateExited, f"{self.name}() ended the candidate: {str(reply['exit'])[:200]}")
        else:  # none of the replies the candidate's side sends
            self.cand.end(ForgedReply, f"{self.name}() got a reply of no known kind: {str(reply)[:200]}")
        raise self.cand.gone[0](self.cand.gone[1])

    def __repr__(self) -> str:
        return f"<candidate function {self.name}>"


def _rebuild(info: object) -> Exception:
    """The candidate's exception as one the tests can catch: a builtin type with its message, else
    CandidateError. The candidate's traceback rides along as text."""
    if not (type(info) is list and len(info) == 3 and all(type(x) is str for x in info)):
        return ForgedReply(f"a malformed exception report: {str(info)[:200]}")
    name, msg, remote_traceback = info
    cls = getattr(builtins, name, None)
    error: Exception | None = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        with contextlib.suppress(Exception):
            error = cls(msg)
    error = error or CandidateError(f"{name}: {msg}")
    error.candidate_traceback = remote_traceback[-MAX_TEXT:]
    return error


def _timer(timeout_s: float):
    signal.setitimer(signal.ITIMER_REAL, timeout_s)


def _alarm(_sig, _frame):
    raise TimeoutError("test timed out")


def _free_names(sources: list[str]) -> set[str]:
    out: set[str] = set()
    for src in sources:
        with contextlib.suppress(SyntaxError, ValueError):
            out |= {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return out


def _bind(namespace: dict, cand: Candidate, kinds: dict, asked: set[str], entry_points: tuple[str, ...]) -> None:
    """Bind the names the tests need from the candidate's program, and only those asked for (never the
    setup's own, such as `check`): functions as proxies, stdlib modules imported here. A forced entry point
    the program lacks stays unbound (NameError)."""
    for name in entry_points:
        namespace.pop(name, None)  # e.g. HumanEval's prompt stub: the tests must call the candidate's
    for name, kind in kinds.items():
        if name not in asked:
            continue
        if kind == "callable":
            namespace[name] = _Remote(cand, name)
        elif isinstance(kind, dict) and type(kind.get("module")) is str:
            mod = kind["module"]
            if mod.split(".")[0] in sys.stdlib_module_names and mod not in NOT_IMPORTED:
                with contextlib.suppress(ImportError):
                    namespace[name] = importlib.import_module(mod)


def _failure(test: str, error: BaseException) -> dict:
    # the test's own frames (<setup>, <test>): the grader's are noise to whoever reads the failure
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith("<")]
    text = "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                    *traceback.format_exception_only(error)])
    extra = getattr(error, "candidate_traceback", None)
    if extra:
        text += "\nin the candidate:\n" + extra
    return {"test": test[:MAX_TEXT], "error_type": type(error).__name__, "message": str(error)[:MAX_TEXT],
            "traceback": text[-MAX_TEXT:]}


def grade(cand: Candidate, program: str, tests: list[str], timeout_s: float, setup: str = "",
          entry_points: tuple[str, ...] | list[str] = ()) -> dict:
    """Run `program` in the candidate, then each test here under `timeout_s`. Returns {status,
    exec_fail_case} when the program itself fails, else {status, passed, total, failures}."""
    signal.signal(signal.SIGALRM, _alarm)
    try:
        return _grade(cand, program, tests, timeout_s, setup, tuple(entry_points))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        cand.end(CandidateExited, "grading finished")


def _grade(cand: Candidate, program: str, tests: list[str], timeout_s: float, setup: str,
           entry_points: tuple[str, ...]) -> dict:
    # 1. the tests and their setup, compiled and bound before any candidate code runs
    namespace: dict = {"__name__": "__main__"}
    try:
        _timer(timeout_s)
        exec(compile(setup, "<setup>", "exec"), namespace)
        _timer(0)
    except BaseException as e:  # trusted code: a broken benchmark, said as such
        _timer(0)
        why = f"the tests' setup failed: {type(e).__name__}: {e}"
        return {"status": "exec_error", "exec_fail_case": why[:MAX_TEXT]}
    codes: list = []
    for test in tests:
        try:
            codes.append(compile(test, "<test>", "exec"))
        except (SyntaxError, ValueError) as e:
            codes.append(e)
    wanted = {n for n in _free_names([setup, *tests]) if n not in namespace and not hasattr(builtins, n)}
    # 2. the program, in the candidate
    try:
        _timer(timeout_s)
        done = cand.call({"op": "program", "source": program})
        if "error" in done or "exit" in done:
            status = "exec_error" if "error" in done else "early_exit"
            return {"status": status, "exec_fail_case": str(done.get("error") or done.get("exit"))[:MAX_TEXT]}
        _timer(timeout_s)
        asked = wanted | set(entry_points)
        kinds = cand.call({"op": "names", "names": sorted(asked)}).get("kinds")
        _timer(0)
    except BaseException as e:
        return {"status": status_of(e), "exec_fail_case": f"{type(e).__name__}: {e}"[:MAX_TEXT]}
    _bind(namespace, cand, kinds if type(kinds) is dict else {}, asked, entry_points)
    # 3. the tests, each under its own timer, here
    failures, kinds_seen = [], []
    for test, code in zip(tests, codes, strict=True):
        try:
            if isinstance(code, BaseException):
                raise code
            _timer(timeout_s)
            exec(code, namespace)
            _timer(0)
        except BaseException as e:  # noqa: BLE001  (any failure of a test is a result)
            _timer(0)
            failures.append(_failure(test, e))
            kinds_seen.append(status_of(e))
    if cand.gone is None and not cand.alive():  # an exit of any kind before the last test reported fails it
        kinds_seen.append("early_exit")
    status = next((s for s in ORDER if s in kinds_seen), "pass")
    return {"status": status, "passed": len(tests) - len(failures), "total": len(tests), "failures": failures}
