"""Inside the sandbox: runs one workflow (or grades one test suite, grader.py) and reports over the run channel.

Stdlib only: the zygote imports this before forking, so a child starts with everything loaded.
Everything here runs with the sandbox's identity and limits; nothing here is trusted by the parent,
which parses only bounded JSON lines from the channel.

Channel: newline-delimited JSON. Parent -> child: the payload, then replies `{"id", "texts"|"error"}`.
Child -> parent: helper requests `{"op": "llm", "id", ...}`, output chunks are kept locally, and one
final `{"op": "result", ...}`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import doctest  # noqa: F401  (pre-imported for workflows that use it)
import io
import json
import math  # noqa: F401
import os
import random
import re  # noqa: F401
import resource
import signal
import socket
import sys
import traceback
import typing  # noqa: F401

from pipeline.engines.sandbox import grader
from pipeline.engines.workflow import extract_code  # stdlib-only too (ast, re)

RUN_FD = 3
MAX_TEXT = 4000  # chars of a traceback / failure message sent back


class OutputLimitExceeded(Exception):
    """The workflow printed more than its output cap."""


class HelperError(RuntimeError):
    """A helper call was refused or failed in the parent (budget, executor error)."""


class _CappedWriter(io.TextIOBase):
    """stdout/stderr of the workflow: keeps the head, raises once the cap is passed."""

    def __init__(self, cap: int):
        self.cap, self.size, self.head = cap, 0, []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.size += len(text)
        if self.size > self.cap:
            raise OutputLimitExceeded(f"output limit exceeded: more than {self.cap} chars printed")
        if sum(map(len, self.head)) < MAX_TEXT:
            self.head.append(text)
        return len(text)

    def text(self) -> str:
        return "".join(self.head)[:MAX_TEXT]


def _short_tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))[-MAX_TEXT:]


def _arrange_fds(run_fd: int, nofile: int) -> None:
    if run_fd != RUN_FD:
        os.dup2(run_fd, RUN_FD)
        os.close(run_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(RUN_FD + 1, 65536)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


# ---- test suites (hidden tests in suite mode; public tests via run_tests): grader.py -------------------
async def _run_tests_forked(code: str, tests: list[str], timeout_s: float) -> str | list | dict:
    """`run_tests` helper: the public tests run in a forked grandchild (the grader, which forks the candidate
    in turn) so the candidate code cannot disturb the workflow's own state; a hard deadline covers code that
    blocks in C."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            out = grader.grade(grader.Candidate(), code, tests, timeout_s)
            os.write(write_fd, json.dumps(out).encode()[: 1 << 20])
        finally:
            os._exit(0)
    os.close(write_fd)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 21)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb"))
    try:
        raw = await asyncio.wait_for(reader.read(), timeout_s * (len(tests) + 2) + 1)
    except TimeoutError:
        raw = b""
    finally:
        transport.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        out = json.loads(raw)
    except ValueError:
        return {"exec_fail_case": "tests crashed or timed out"}
    if "exec_fail_case" in out:
        return out
    if out["failures"]:
        return out["failures"]
    return "no error" if out["status"] == "pass" else {"status": out["status"]}


def _suite_main() -> None:
    """Suite mode: fork the candidate first, while this process holds no hidden test yet, then read the
    payload, grade, and send the verdict on the run channel, which the candidate never held."""
    cand = grader.Candidate()
    channel = socket.socket(fileno=RUN_FD)
    buf = b""
    while b"\n" not in buf:
        chunk = channel.recv(1 << 20)
        if not chunk:
            return
        buf += chunk
    p = json.loads(buf.split(b"\n", 1)[0])
    report = grader.grade(cand, p["program"], p["tests"], p["timeout_s"], p.get("setup", ""), p.get("entry_points", ()))
    channel.sendall((json.dumps({"op": "result", "suite": report}) + "\n").encode())


# ---- the workflow run ------------------------------------------------------------------------------
class _Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0

    async def pump(self) -> None:
        while line := await self.reader.readline():
            msg = json.loads(line)
            fut = self.pending.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(HelperError("parent closed the channel"))

    async def send(self, msg: dict) -> None:
        self.writer.write(json.dumps(msg).encode() + b"\n")
        await self.writer.drain()

    async def call(self, op: str, **kw) -> dict:
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        await self.send({"op": op, "id": self.next_id, **kw})
        return await fut


async def _workflow(channel: _Channel, payload: dict) -> dict:
    public = payload.get("public_tests") or {}

    async def llm(messages, temperature=None, n=1, role="", instructions=""):
        if isinstance(messages, dict):  # one message: weak generators often forget the list
            messages = [messages]
        if not isinstance(messages, str | list):
            raise TypeError("llm(messages): messages must be a str or a list of {role, content} dicts")
        reply = await channel.call("llm", messages=messages, temperature=temperature, n=n, role=str(role),
                                   instructions=str(instructions))
        if "error" in reply:
            raise HelperError(reply["error"])
        return reply["texts"]

    async def run_tests(code, entry_point=None):
        # the code as the hidden tests will read it: an executor's fenced reply is its code block
        code, name = extract_code(str(code)), public.get("entry_point")
        if entry_point and name and entry_point != name:  # public tests call the benchmark's name
            code += f"\n{name} = {entry_point}\n"
        return await _run_tests_forked(code, list(public.get("tests") or []), float(public.get("timeout_s", 5.0)))

    ns = {"__name__": "workflow", "__builtins__": builtins, "llm": llm, "run_tests": run_tests}
    if payload.get("random_seed") is not None:  # common random numbers: the workflow's own draws pair across arms
        random.seed(int(payload["random_seed"]))
    try:
        exec(compile(payload["code"], "<workflow>", "exec"), ns)
        answer = await ns["solve"](payload["problem"])
    except BaseException as e:  # any failure of the workflow, SystemExit included, is its result
        return {"op": "result", "error": _short_tb(e)}
    if answer is None:
        return {"op": "result", "error": "solve() returned None"}
    if isinstance(answer, list | tuple) and answer and isinstance(answer[0], str):
        answer = answer[0]  # `return await llm(...)` returns llm's list: score its first answer
    return {"op": "result", "answer": answer if isinstance(answer, str) else str(answer)}


async def _amain() -> None:
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=RUN_FD), limit=1 << 26)
    channel = _Channel(reader, writer)
    payload = json.loads(await reader.readline())
    cap = int(payload.get("output_chars", 1 << 20))
    sys.stdout = sys.stderr = out = _CappedWriter(cap)
    pump = asyncio.ensure_future(channel.pump())
    result = await _workflow(channel, payload)
    pump.cancel()
    result["stdout"] = out.text()
    await channel.send(result)


def main(run_fd: int, mode: str) -> None:
    """Entry point in the forked child (after the zygote's setup); exits the process."""
    _arrange_fds(run_fd, 64)
    try:
        if mode == "suite":
            _suite_main()
        else:
            asyncio.run(_amain())
        code = 0
    except BaseException:  # the parent sees "no result" and the exit code
        code = 3
    os._exit(code)
