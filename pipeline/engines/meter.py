"""Progress of a stage's long loop (the rollout's samples, the score stage's workflow runs, the train stage's steps)
while it works, where a person looks: a tqdm bar in the terminal, and every `every_s` seconds one log line with the
rate and the time left (`rollout r0: 12/40 gen (30%), 0.21 gen/s, about 2 min 13 s left`) on the `pipeline.progress`
logger, which a Prefect task relays into its run's log (flows/tasks.py).

A stage often runs in a child process (`python -m pipeline.stages`), whose log a Prefect run does not see: each line
is also appended to a small local file named after the stage call (`relay_path`), which the task that started the
stage reads as it grows (`Relay`). The generators report each finished request (`Generator.generate(progress=...)`),
so a long vLLM call moves the bar as its requests end instead of at its end.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pipeline.progress")

EVERY_S = 30.0  # seconds between two log lines of one meter


def relay_path(run_id: str, round: int, stage: str) -> Path:
    """The local file a stage's progress lines are appended to: the same for the child that works and the process
    (a Prefect task) that waits for it. The shards of a stage share it (each line names its shard)."""
    key = f"{run_id}|{round}|{stage}"
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{run_id}-r{round}-{stage}")[:80]
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / "pipeline-progress" / f"{safe}-{digest}.log"


def duration(seconds: float) -> str:
    """`45 s`, `2 min 13 s`, `1 h 05 min`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class ProgressMeter:
    """Counts work done of `total` (`update(n)`), shows it as a tqdm bar (`bar=False`: none, e.g. a rank other than
    0), and logs `line()` at most every `every_s` seconds and once at the end; `relay`: a file each logged line is
    appended to (`relay_path`). `clock`: seconds, monotonic (tests give a fake one)."""

    def __init__(self, total: int, desc: str, unit: str, *, relay: Path | None = None, bar: bool = True,
                 every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic, done: int = 0):
        self.total, self.desc, self.unit, self.every_s, self.clock = total, desc, unit, every_s, clock
        self.done = self.start_done = done  # work done before this meter started (a resumed loop) adds no rate
        self.started = self.logged_at = clock()
        self.relay = relay
        if relay is not None:
            relay.parent.mkdir(parents=True, exist_ok=True)
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=desc, unit=unit)

    def rate(self) -> float | None:
        """Work per second since the meter started; None before any."""
        elapsed, worked = self.clock() - self.started, self.done - self.start_done
        return worked / elapsed if worked > 0 and elapsed > 0 else None

    def left_s(self) -> float | None:
        """Seconds left at the rate so far; None without a rate."""
        rate = self.rate()
        return None if rate is None else max(0, self.total - self.done) / rate

    def line(self) -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate, left = self.rate(), self.left_s()
        pace = f", {rate:.3g} {self.unit}/s" if rate is not None else ", no rate yet"
        end = (f", about {duration(left)} left" if left is not None and self.done < self.total else
               f", {duration(self.clock() - self.started)} in all" if self.done >= self.total else "")
        return f"{self.desc}: {self.done}/{self.total} {self.unit}{share}{pace}{end}"

    def update(self, n: int = 1) -> None:
        if n <= 0:
            return
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.clock() - self.logged_at >= self.every_s:
            self.emit()

    def emit(self) -> None:
        """Log the line now (and append it to the relay file)."""
        self.logged_at = self.clock()
        text = self.line()
        log.info("%s", text)
        if self.relay is not None:
            with self.relay.open("a") as f:
                f.write(text + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.done > self.start_done:
            self.emit()

    def __enter__(self) -> ProgressMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Relay:
    """Reads the lines a stage call's meters append to its relay file from now on, each once: `new_lines()` gives
    those written since the last call (a Prefect task logs them while it waits for the stage); what the file held
    before (earlier calls of the same stage) is not read."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.is_file() else 0

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:  # the file was removed and written anew
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for its end
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()
