"""Two jobs computing on one CPU share its cores: say so when a model engine starts beside another job's.

Why a warning: each engine (a vLLM server, the offline vLLM generator, the train stage) runs a thread team over all
the cores, so two jobs each run at a fraction of their speed, and a CPU decodes a sequence at nearly the same rate
whatever its batch, so replies get slow enough to outlast call timeouts. Measured on a 2-core Intel Xeon
(docs/performance.md, Two jobs on one CPU): an experiment's rollout took 16-17 s a workflow beside a bench's
executor server and 11.4 s once it had stopped, while the server decoded 0.9 tokens/s a sequence. Neither job gains.
Nothing is refused: a machine with cores to spare may run two jobs on purpose.

How a job is known: every process that starts an engine leaves a marker (`<tmp>/workflow-grpo/engines/<pid>-*.json`:
the engine's pid and start time, its job, what it is, the command line). The job is the `PIPELINE_JOB` environment
variable, set once by the first pipeline process of a command and inherited by its stages and servers, so a
command's own engines are never each other's neighbours. A marker whose process is gone (or whose pid now belongs to
another process: the start time differs) is stale and removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("pipeline.neighbours")

JOB_ENV = "PIPELINE_JOB"


@dataclass(frozen=True)
class Engine:
    """One engine a pipeline process started."""

    pid: int
    started: int  # the process's start time (clock ticks after boot, /proc/<pid>/stat): a reused pid differs
    job: str
    what: str  # e.g. "vLLM server embedded:qwen2.5-coder-0.5b-instruct"
    command: str  # the command line of the job's process that started it
    since: str


def markers_dir() -> Path:
    return Path(tempfile.gettempdir()) / "workflow-grpo" / "engines"


def job() -> str:
    """This process's job: inherited from the process that started it, else this process (and its children from
    now on)."""
    return os.environ.setdefault(JOB_ENV, str(os.getpid()))


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces): the state is [0], the process group
    [2], the start time [19]; None: no such process (or no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot); None: no such process (or no /proc)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _path(pid: int, what: str) -> Path:
    return markers_dir() / f"{pid}-{hashlib.sha256(what.encode()).hexdigest()[:8]}.json"


def mark(what: str, pid: int | None = None) -> Path | None:
    """Leave the marker of an engine run by `pid` (default: this process) for this job; None where there is no
    /proc (the check is Linux's) or the marker cannot be written (a warning's input is never worth a failure)."""
    pid = pid or os.getpid()
    if (started := start_time(pid)) is None:
        return None
    engine = Engine(pid, started, job(), what, " ".join(sys.argv), time.strftime("%Y-%m-%d %H:%M:%S"))
    path = _path(pid, what)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(engine)))
        os.replace(tmp, path)
        return path
    return None


def unmark(what: str, pid: int | None = None) -> None:
    with contextlib.suppress(OSError):
        _path(pid or os.getpid(), what).unlink()


def neighbours() -> list[Engine]:
    """The live engines of other jobs on this machine; stale markers are removed on the way."""
    found, mine = [], job()
    for path in sorted(markers_dir().glob("*.json")):
        try:
            engine = Engine(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours to judge
        if start_time(engine.pid) != engine.started:
            with contextlib.suppress(OSError):
                path.unlink()
        elif engine.job != mine:
            found.append(engine)
    return found


_warned: set[str] = set()


def warn_if_shared(what: str) -> list[Engine]:
    """Warn, once per process and neighbour, that `what` starts beside other jobs' engines on this CPU."""
    others = [e for e in neighbours() if f"{e.pid}:{e.started}" not in _warned]
    for e in others:
        _warned.add(f"{e.pid}:{e.started}")
        log.warning("%s starts beside another job's %s (pid %d since %s: %s) on this CPU (%d cores): the two "
                    "share its cores, each runs slower, and neither gains (docs/performance.md, Two jobs on one "
                    "CPU)", what, e.what, e.pid, e.since, e.command[:120], os.cpu_count() or 0)
    return others


@contextlib.contextmanager
def computing(what: str) -> Iterator[None]:
    """This process computes `what` (e.g. the train stage) for the block: warned about, and marked for others."""
    warn_if_shared(what)
    mark(what)
    try:
        yield
    finally:
        unmark(what)
