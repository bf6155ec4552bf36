"""pipeline/engines/neighbours.py: an engine that starts beside another job's engine on this CPU warns, once; a
command's own engines (one job) and engines that are gone (or whose pid was reused) are never neighbours."""

import logging
import os
import subprocess
import sys

import pytest

from pipeline.engines import neighbours as nb


@pytest.fixture
def markers(tmp_path, monkeypatch):
    monkeypatch.setattr(nb, "markers_dir", lambda: tmp_path)
    monkeypatch.setattr(nb, "_warned", set())
    monkeypatch.setenv(nb.JOB_ENV, "mine")
    return tmp_path


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _mark_as(monkeypatch, job: str, what: str, pid: int):
    monkeypatch.setenv(nb.JOB_ENV, job)
    path = nb.mark(what, pid)
    monkeypatch.setenv(nb.JOB_ENV, "mine")
    return path


def test_another_jobs_live_engine_is_a_neighbour_and_warned_about_once(markers, monkeypatch, other_process, caplog):
    _mark_as(monkeypatch, "other", "vLLM server x", other_process.pid)
    nb.mark("vLLM generator")  # this job's own engine
    _mark_as(monkeypatch, "mine", "vLLM server y", other_process.pid)  # a server this job started
    found = nb.neighbours()
    assert [(e.pid, e.job, e.what) for e in found] == [(other_process.pid, "other", "vLLM server x")]
    with caplog.at_level(logging.WARNING, logger="pipeline.neighbours"):
        assert len(nb.warn_if_shared("the train stage")) == 1
        assert nb.warn_if_shared("the train stage") == []  # said once per process
    assert len(caplog.records) == 1
    assert f"another job's vLLM server x (pid {other_process.pid}" in caplog.records[0].getMessage()


def test_a_gone_or_reused_pid_is_stale_and_removed(markers, monkeypatch, other_process):
    gone = _mark_as(monkeypatch, "other", "vLLM server x", other_process.pid)
    other_process.kill()
    other_process.wait()
    reused = _mark_as(monkeypatch, "other", "vLLM generator", os.getpid())
    text = reused.read_text()
    started = nb.start_time(os.getpid())
    reused.write_text(text.replace(f'"started": {started}', f'"started": {started - 1}'))  # the pid, another process
    assert nb.neighbours() == []
    assert not gone.exists() and not reused.exists()


def test_computing_marks_for_the_block_only(markers):
    with nb.computing("the train stage"):
        (marker,) = markers.glob("*.json")
        assert f'"pid": {os.getpid()}' in marker.read_text() and '"job": "mine"' in marker.read_text()
    assert list(markers.glob("*.json")) == []


def test_a_child_process_inherits_the_job(markers):
    out = subprocess.run([sys.executable, "-c", "from pipeline.engines.neighbours import job; print(job())"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.strip() == nb.job() == "mine"
