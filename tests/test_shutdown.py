"""Stopping what the demo started: `python -m flows.serve` ends on SIGTERM even when the Prefect API went away first
(its graceful shutdown calls the API and retried for many minutes), and `scripts/demo.sh stop` ends the whole
process group of each process it started, not just the pid it wrote down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import wait_until

REPO = Path(__file__).resolve().parents[1]


def live(pgid: int) -> list[int]:
    from pipeline.engines.servers import group_alive

    return group_alive(pgid)



def catches_sigterm(pid: int) -> bool:
    """Process `pid` has a SIGTERM handler (Linux: the SigCgt mask): Prefect's runner installs one when it starts."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_flows_serve_exits_on_sigterm_after_its_api_is_gone(tmp_path):
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    log = tmp_path / "serve.log"
    with prefect_test_harness(server_startup_timeout=120):
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
        with open(log, "w") as out:
            serve = subprocess.Popen([sys.executable, "-m", "flows.serve"], env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: catches_sigterm(serve.pid) or serve.poll() is not None, 180,
                       "the runner did not start")
            assert serve.poll() is None, log.read_text()
        except BaseException:
            serve.kill()
            raise
    # the API server is stopped now, as `demo.sh stop` used to stop it right after SIGTERM to serve
    try:
        serve.send_signal(signal.SIGTERM)
        # Prefect's client retries a dead API for about a minute per call (the unbounded shutdown took 64 s here):
        # the deadline is below that, and above the runner's SHUTDOWN_GRACE_S
        wait_until(lambda: serve.poll() is not None, 45, f"flows.serve still running after SIGTERM:\n"
                   f"{log.read_text()[-2000:]}")
        assert "SIGTERM received" in log.read_text()  # by the runner's handler, not the default action
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


# The leader exits on SIGTERM (as the Prefect server does); its child ignores it, as a hung shutdown or a stuck
# flow run would: only the group's SIGKILL ends that one.
GROUP = ("import signal, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import signal, time; "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)']); time.sleep(3600)")


def test_demo_stop_ends_every_process_group_it_started(tmp_path):
    state = tmp_path / "prefect" / "workflow-grpo"
    state.mkdir(parents=True)
    started = {}
    for name in ("serve", "server", "bystander"):
        started[name] = subprocess.Popen([sys.executable, "-c", GROUP], start_new_session=True)
    try:
        wait_until(lambda: all(len(live(p.pid)) == 2 for p in started.values()), 60, "groups not started")
        for name in ("serve", "server"):
            (state / f"{name}.pid").write_text(f"{started[name].pid}\n")
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "STOP_WAIT_S": "3"}
        res = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "stop"], env=env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        for name in ("serve", "server"):
            assert f"stopped {name} (pid {started[name].pid}" in res.stdout
            assert live(started[name].pid) == [], f"{name}'s group outlived demo.sh stop"
            assert not (state / f"{name}.pid").exists()
        assert len(live(started["bystander"].pid)) == 2  # a group it did not start is left alone
    finally:
        for p in started.values():
            if live(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
