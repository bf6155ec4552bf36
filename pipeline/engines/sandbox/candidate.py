"""The candidate's side of grading (stdlib only): the forked process that holds the program under test.

It keeps only its socket to the grader (grader.py), execs the program, tells which names the tests need it
has, and answers calls with plain values (values.py) or a refusal naming what the function returned. Nothing
here is trusted: the program can rewrite any of it, and the grader checks every reply.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import traceback
import types

from pipeline.engines.sandbox import values

MAX_TEXT = 4000
PR_SET_DUMPABLE = 4


def set_dumpable(on: bool) -> None:
    """A process that is not dumpable cannot be ptraced, nor its /proc/<pid>/mem, fd or environ opened, nor
    its fds taken with pidfd_getfd, by another process of the same uid (CAP_SYS_PTRACE aside)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, int(on), 0, 0, 0)


def serve(sock: socket.socket) -> None:
    """In the forked candidate: keep only the grader's socket, then serve requests until the grader ends us."""
    set_dumpable(True)  # only the grader needs to be out of reach; keep /proc/self usual here
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)  # the run channel (the verdict's way out) is gone before any program runs
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    ns: dict = {"__name__": "__main__"}
    reader = sock.makefile("rb")
    for line in reader:
        req = json.loads(line)
        reply = _serve(req, ns)
        sock.sendall((json.dumps({**reply, "id": req["id"]}) + "\n").encode())
        if "exit" in reply:
            break
    os._exit(0)


def _serve(req: dict, namespace: dict) -> dict:
    operation = req["op"]
    try:
        if operation == "program":
            exec(compile(req["source"], "<solution>", "exec"), namespace)
            return {"ok": True}
        if operation == "names":
            return {"kinds": {n: _kind(namespace, n) for n in req["names"]}}
        fn = namespace.get(req["name"])
        if not callable(fn):
            return {"raise": ["NameError", f"name {req['name']!r} is not defined", ""]}
        v = fn(*values.decode(req["args"]), **values.decode(req["kwargs"]))
        try:
            return {"value": values.encode(v)}
        except values.NotPlain as e:
            return {"hack": str(e)}
    except Exception as e:
        if operation == "program":
            return {"error": f"{type(e).__name__}: {e}"[:MAX_TEXT]}
        return {"raise": [type(e).__name__, str(e)[:MAX_TEXT], "".join(traceback.format_exception(e))[-MAX_TEXT:]]}
    except BaseException as e:  # SystemExit, KeyboardInterrupt: an exit, whatever the candidate meant
        return {"exit": f"{type(e).__name__}: {e}"[:MAX_TEXT]}


def _kind(ns: dict, name: str) -> object:
    if name not in ns:
        return "missing"
    v = ns[name]
    if isinstance(v, types.ModuleType):
        return {"module": v.__name__}
    return "callable" if callable(v) else "missing"  # a test reads no constant of the candidate's
