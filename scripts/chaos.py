"""Chaos suite: seeded faults against the public CLI, then resume and check the store.

    python scripts/chaos.py --out OUT [--seed 0] [--trials 2] [--stages rollout,score,curate,train,evaluate]
                            [--soak 1000] [--vllm] [--prefect N] [--two-writers N]

Kill trials: `pipeline run` (or `pipeline evaluate`) is started in its own session and, at a seeded random
moment while the chosen stage is running, its whole process group gets SIGKILL. The same command is then run
again. After each trial: no process of the trial survives (stage child, sandbox zygote, sandboxed runs), the
resumed command completes, no table has a duplicated key, no row that existed before the resume is gone
(rows of a stage without a manifest may be redone), every manifest matches its rows, and every checkpoint
loads in peft (and, with --vllm, once in vLLM). Score, curate and train trials start from a scripted rollout
(hand-written workflows with different scores, as tests/test_flows.py uses) so each of those stages has real
work; rollout and evaluate trials sample with the embedded model.

Soak: an OpenAI-compatible executor on 127.0.0.1 that answers 429, 500/503, a timeout or garbage on 30% of
calls (seeded) scores N workflow runs; `pipeline score --only-failed` is repeated until the score manifest is
written; then every row must be final, none duplicated.

Two writers: the same stage command (`pipeline score`, `pipeline train`) started twice, a seeded
0-2 s apart, on one store: exactly one must run and the other be refused at once (exit 2) naming the first's pid
and `--wait`; the store then holds one set of rows and manifests that match them. And the holder killed with
`kill -9` inside the stage: the same command started right after must proceed (no stale lease) and complete.

Figures (trials, where each kill landed, faults injected, failures) go to OUT/chaos.json; docs/reliability.md
records them. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.store import Store  # noqa: E402  (the store's public read API; the CLI does all writing)

PIPELINE = str(Path(sys.executable).parent / "pipeline")
STAGES = ("rollout", "score", "curate", "train")
KEYS = {"queries": ("split", "query_id"), "generations": ("gen_id",), "scores": ("gen_id", "rep", "attempt"),
        "groups": ("group_id",), "train_metrics": ("step",), "checkpoints": ("path",)}
# Kill moments are drawn uniformly in [0, STAGE_S] after the stage starts: about each stage's wall time in
# these trials on the 2-core machine (a kill after the stage ended is recorded as landing in a later one).
STAGE_S = {"rollout": 60.0, "score": 30.0, "curate": 2.0, "train": 15.0}
OWNER = {"groups": "curate", "train_metrics": "train", "checkpoints": "train"}  # tables redone if unfinished
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
# Hand-written workflows on basic_arithmetic: exact (score 1), one executor call (varies), slow and wrong.
SCRIPTED = [
    "async def solve(problem):\n    expr = problem.split('Calculate', 1)[1].strip().rstrip('.')\n"
    "    v = eval(expr)\n    return str(int(v)) if float(v).is_integer() else str(v)\n",
    "async def solve(problem):\n    out = await llm([{'role': 'user', 'content': problem}])\n    return out[0]\n",
    "import time\n\nasync def solve(problem):\n    time.sleep(1.0)\n    return '0'\n",
]


# ---- configs and scripted rollout ------------------------------------------------------------------------
def write_config(d: Path, queries: int, **over) -> Path:
    import yaml

    data = yaml.safe_load((REPO / "tests" / "data" / "tiny_flow.yaml").read_text())
    data["run_id"], data["store"] = "chaos", {"root": str(d / "runs")}
    data["benchmark"]["max_queries"] = queries
    for section, values in over.items():
        data.setdefault(section, {}).update(values)
    cfg = d / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def scripted_rollout(cfg: Path, run_id: str, workflows: list[str]) -> None:
    """Queries and generations rows as rollout writes them (real items and token ids), then its manifest."""
    from pipeline.engines.benchmarks.base import load_benchmark
    from pipeline.engines.models import load_tokenizer
    from pipeline.run import open_run

    ctx = open_run(cfg, run_id)
    tok = load_tokenizer(ctx.cfg.generator.model)
    items = load_benchmark(ctx.cfg.benchmark).items()
    ctx.store.write("queries", [{"split": "validate", "query_id": it.id, "benchmark": "procedural",
                                 "prompt": it.prompt, "reference": json.dumps(it.reference),
                                 "meta": json.dumps(it.meta)} for it in items], run_id, 0)
    rows = []
    for it in items:
        prompt = f"Write a workflow for: {it.prompt}"
        for slot, code in enumerate(workflows):
            text = f"```python\n{code}```"
            rows.append({"gen_id": f"r0-{it.id}-w{slot}", "kind": "workflow", "query_id": it.id, "slot": slot,
                         "prompt_text": prompt, "text": text, "valid": True,
                         "prompt_token_ids": tok(prompt)["input_ids"], "token_ids": tok(text)["input_ids"],
                         "model": ctx.cfg.generator.model, "backend": "scripted", "finish_reason": "stop"})
    ctx.store.write("generations", rows, run_id, 0)
    ctx.finish("rollout", workflows=len(rows))


# ---- processes ---------------------------------------------------------------------------------------------
def procs_mentioning(text: str) -> list[int]:
    """Live processes whose command line names `text` (the trial dir: the run, its stage child, the
    sandbox zygote, whose argv carries the deny list with the working directory, and the zygote's forks)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if text in cmd and "Z" not in state.split()[1]:
            out.append(int(d.name))
    return out


def stage_running(marks: list[str], store: Store, run_id: str, stage: str) -> bool:
    """The stage has started (its predecessor's manifest is there, or its child process runs) and has not
    finished (no manifest of its own)."""
    if store.manifest(run_id, 0, stage) is not None:
        return False
    i = STAGES.index(stage)
    if i and store.manifest(run_id, 0, STAGES[i - 1]) is None:
        return False
    return stage != "rollout" or any("flows.stages" in _cmd(p) for m in marks for p in procs_mentioning(m))


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_to_end(args: list[str], cwd: Path, log: Path, timeout: float = 1200) -> int:
    with open(log, "ab") as f:
        return subprocess.run([PIPELINE, *args], cwd=cwd, env=ENV, stdout=f, stderr=f, timeout=timeout).returncode


# ---- store checks --------------------------------------------------------------------------------------------
def keys(store: Store, run_id: str) -> dict[str, list[tuple]]:
    out = {}
    for t, cols in KEYS.items():
        df = store.read(t, run_id, 0)
        out[t] = [tuple(r) for r in df.select(list(cols)).iter_rows()] if df.height else []
    return out


def check_store(store: Store, run_id: str, before: dict[str, list[tuple]], done_before: set[str]) -> list[str]:
    """Failures: duplicated keys, rows lost since `before`, manifests that disagree with their rows."""
    fails = []
    after = keys(store, run_id)
    for t, ks in after.items():
        if len(ks) != len(set(ks)):
            fails.append(f"{t}: {len(ks) - len(set(ks))} duplicated rows")
        redone = t in OWNER and OWNER[t] not in done_before
        lost = set(before.get(t, [])) - set(ks)
        if lost and not redone:
            fails.append(f"{t}: {len(lost)} rows lost, e.g. {sorted(lost)[:2]}")
    return fails + check_manifests(store, run_id)


def check_manifests(store: Store, run_id: str) -> list[str]:
    fails = []
    m = {s: store.manifest(run_id, 0, s) for s in STAGES}
    gens = store.read("generations", run_id, 0)
    if m["rollout"] and m["rollout"]["counts"].get("workflows") != int((gens["kind"] == "workflow").sum()):
        fails.append(f"rollout manifest {m['rollout']['counts']} vs {gens.height} generations rows")
    if m["score"]:
        latest = store.sql(f"select status, count(*) n from latest_scores where run_id = '{run_id}' group by 1")
        by_status = dict(latest.iter_rows())
        if m["score"]["counts"]["by_status"] != by_status or m["score"]["counts"]["runs"] != sum(by_status.values()):
            fails.append(f"score manifest {m['score']['counts']} vs latest_scores {by_status}")
        if set(by_status) & {"executor_error"}:
            fails.append(f"score manifest written with non-final rows: {by_status}")
    if m["curate"]:
        groups = store.read("groups", run_id, 0)
        groups = groups.filter(groups["kind"].fill_null("group") == "group")  # the GRPO groups the manifest counts
        kept = int(groups["kept"].sum()) if groups.height else 0
        if m["curate"]["counts"]["groups_kept"] != kept:
            fails.append(f"curate manifest {m['curate']['counts']['groups_kept']} kept vs {kept} rows")
    if m["train"]:
        steps = store.read("train_metrics", run_id, 0).height
        ckpts = store.read("checkpoints", run_id, 0).height
        if m["train"]["counts"]["steps"] != steps or ckpts != 1:
            fails.append(f"train manifest {m['train']['counts']['steps']} steps vs {steps} rows, {ckpts} checkpoints")
    return fails


def check_checkpoint(store: Store, run_id: str) -> list[str]:
    """The round's adapter loads in peft on the base model and changes nothing it should not."""
    from peft import PeftModel

    from pipeline.engines.models import load_causal_lm

    ckpt = store.checkpoint_dir(run_id, 0)
    if not (ckpt / "adapter_config.json").is_file():
        return [f"no adapter at {ckpt}"]
    try:
        model = PeftModel.from_pretrained(load_causal_lm("embedded:smollm2-135m-instruct", device="cpu"), str(ckpt))
    except Exception as e:  # any load failure is the finding
        return [f"peft cannot load {ckpt}: {type(e).__name__}: {e}"]
    n = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    return [] if n > 0 else [f"{ckpt}: no LoRA weights loaded"]


def check_vllm(ckpt: Path) -> list[str]:
    """The adapter loads and samples in vLLM (the rollout engine), through the project's engine settings; a
    small share of memory (on CPU it sizes the KV cache from the machine's free memory)."""
    from pipeline.engines.generation.vllm_offline import cpu_defaults, engine_kwargs, import_vllm, lora_request

    try:
        vllm = import_vllm()
    except Exception:  # not installed: nothing to check
        return []
    cpu_defaults()
    try:
        llm = vllm.LLM(**engine_kwargs("embedded:smollm2-135m-instruct", enable_lora=True, max_lora_rank=8,
                                       max_model_len=512, gpu_memory_utilization=0.1))
        out = llm.generate(["1 + 1 ="], vllm.SamplingParams(max_tokens=4), lora_request=lora_request(str(ckpt)))
    except Exception as e:  # the finding is the failure to load
        return [f"vLLM cannot load {ckpt}: {type(e).__name__}: {str(e)[:300]}"]
    return [] if out and out[0].outputs else [f"vLLM generated nothing with {ckpt}"]


# ---- one kill trial ------------------------------------------------------------------------------------------
def prepare(trial: Path, stage: str, finished: Path | None, rng: random.Random) -> tuple[list[str], Path, str, str]:
    """(command, store root, run id watched, stage watched) for a trial."""
    if stage == "evaluate":  # the finished, trained run of a train trial: its evaluation is the victim
        root = finished / "runs"
        cmd = ["evaluate", "chaos", "--round", "0", "--split", "test", "--store", str(root)]
        return cmd, root, "chaos-eval-r0", "rollout"  # its scoring of untrained samples takes < 1 s
    if stage == "rollout":  # one sample per generate call: a kill can land between written batches
        cfg = write_config(trial, 2, benchmark={"size": 20}, generator={"batch_size": 1})
    else:
        cfg = write_config(trial, 4, benchmark={"size": 20}, scoring={"batch_size": 1, "concurrency": 1, "reps": 2})
        scripted_rollout(cfg, "chaos", SCRIPTED)
    return ["run", str(cfg), "--run-id", "chaos", "--rounds", "1"], trial / "runs", "chaos", stage


def kill_trial(out: Path, stage: str, i: int, rng: random.Random, finished: Path | None) -> dict:
    trial = out / f"{stage}-{i}"
    trial.mkdir(parents=True)
    cmd, root, run_id, watched = prepare(trial, stage, finished, rng)
    store, marks, log = Store(root), [str(trial), str(root)], trial / "log.txt"
    delay = rng.uniform(0, STAGE_S[watched])
    rec = {"stage": stage, "trial": i, "watched": watched, "delay_s": round(delay, 2), "failures": []}
    with open(log, "ab") as f:
        proc = subprocess.Popen([PIPELINE, *cmd], cwd=trial, env=ENV, stdout=f, stderr=f, start_new_session=True)
    rec["landed_in"] = wait_and_kill(proc, marks, store, run_id, watched, delay)
    rec["failures"] += orphans(marks, rec)
    done_before = {s for s in STAGES if store.manifest(run_id, 0, s)}
    before = keys(store, run_id)
    rec["rows_before"] = {t: len(v) for t, v in before.items()}
    t0 = time.time()
    rc = run_to_end(cmd, trial, log)
    rec["resume_s"] = round(time.time() - t0, 1)
    if rc != 0:
        rec["failures"].append(f"resumed command exited {rc} (see {log})")
    rec["failures"] += check_store(store, run_id, before, done_before)
    if stage != "evaluate":
        rec["failures"] += check_checkpoint(store, run_id) if store.manifest(run_id, 0, "train") else [
            "the resumed run has no train manifest"]
    elif store.manifest(run_id, 0, "score") is None:
        rec["failures"].append("the resumed evaluation has no score manifest")
    rec["failures"] += orphans(marks, rec, after_resume=True)
    return rec


def wait_and_kill(proc, marks: list[str], store: Store, run_id: str, watched: str, delay: float) -> str:
    """Kill the run's process group `delay` s after `watched` started; returns the stage it was in."""
    deadline = time.time() + 900
    while not stage_running(marks, store, run_id, watched) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    end = time.time() + delay
    while time.time() < end and proc.poll() is None:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):  # it may have finished first: recorded as "finished"
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return next((s for s in STAGES if store.manifest(run_id, 0, s) is None), "finished")


def orphans(marks: list[str], rec: dict, after_resume: bool = False) -> list[str]:
    """Processes of the trial still alive 10 s after the kill (or after the resumed run returned)."""
    t0 = time.time()
    while (left := [p for m in marks for p in procs_mentioning(m)]) and time.time() - t0 < 10:
        time.sleep(0.1)
    rec["orphans_gone_s" if not after_resume else "orphans_gone_after_resume_s"] = round(time.time() - t0, 2)
    return [f"orphan processes: {sorted({_cmd(p)[:120] for p in left})}"] if left else []


# ---- two writers: the same stage twice at once, and after kill -9 of the holder ---------------------------------
def holder_pid(root: Path, run_id: str, stage: str) -> int | None:
    """The pid in the stage's lease record (pipeline/store/lease.py), once a process has taken the lease."""
    try:
        return json.loads((root / run_id / "_leases" / f"round-0.{stage}.holder.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def two_writers_trial(out: Path, stage: str, i: int, rng: random.Random, kill: bool) -> dict:
    """`pipeline STAGE` twice on one round: started a seeded 0-2 s apart (kill=False), or the second right after
    `kill -9` of the first inside the stage (kill=True)."""
    trial = out / f"two-writers-{'kill-' if kill else ''}{stage}-{i}"
    trial.mkdir(parents=True)
    cfg = write_config(trial, 4, benchmark={"size": 20}, scoring={"batch_size": 1, "concurrency": 1, "reps": 2})
    scripted_rollout(cfg, "chaos", SCRIPTED)
    root, log, store = trial / "runs", trial / "log.txt", Store(trial / "runs")
    for before in STAGES[1:STAGES.index(stage)]:  # train: its round scored and curated first
        if run_to_end([before, str(cfg), "--run-id", "chaos", "--round", "0"], trial, log) != 0:
            return {"stage": f"two-writers:{stage}", "trial": i, "failures": [f"{before} failed (see {log})"]}
    cmd = [PIPELINE, stage, str(cfg), "--run-id", "chaos", "--round", "0"]
    delay = 0.0 if kill else rng.uniform(0, 2)
    rec = {"stage": f"two-writers{'-kill' if kill else ''}:{stage}", "trial": i, "delay_s": round(delay, 2),
           "failures": []}
    first = subprocess.Popen(cmd, cwd=trial, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    if kill:  # inside the stage: the first has taken the lease
        t0 = time.time()
        while holder_pid(root, "chaos", stage) != first.pid and first.poll() is None and time.time() - t0 < 300:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, STAGE_S[stage] / 3))
        rec["killed_inside"] = store.manifest("chaos", 0, stage) is None
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    else:
        time.sleep(delay)
    t0 = time.time()
    second = subprocess.Popen(cmd, cwd=trial, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    _, err2 = second.communicate(timeout=1200)
    rec["second_s"] = round(time.time() - t0, 2)
    err1 = "" if kill else first.communicate(timeout=1200)[1]
    with open(log, "a") as f:
        f.write(err1 + err2)
    rec["rc"] = [None if kill else first.returncode, second.returncode]
    if kill and second.returncode != 0:
        rec["failures"].append(f"after kill -9 of the holder the next command exited {second.returncode}: "
                               f"{err2[-400:]}")
    if not kill:
        # (exit status, its stderr, the other's pid): the refused one must name the other as the holder
        both = [(first.returncode, err1, second.pid), (second.returncode, err2, first.pid)]
        refused = [(" ".join(err.split()), other) for rc, err, other in both if rc == 2]
        rec["refused"] = len(refused)
        if sorted(rc for rc, _, _ in both) != [0, 2]:
            rec["failures"].append(f"expected one run and one refusal, got exit statuses {rec['rc']}")
        for text, other in refused:
            if f"is being written by another process: pid {other} " not in text or "--wait" not in text:
                rec["failures"].append(f"the refusal does not name the holder (pid {other}) and --wait: {text[-400:]}")
    rec["failures"] += check_manifests(store, "chaos")
    k = keys(store, "chaos")
    rec["rows"] = {t: len(v) for t, v in k.items()}
    rec["failures"] += [f"{t}: {len(v) - len(set(v))} duplicated rows" for t, v in k.items() if len(v) != len(set(v))]
    if stage == "score" and {a for _, _, a in k["scores"]} != {0}:
        rec["failures"].append("a workflow run was repeated (attempt > 0): the executor did work twice")
    if store.manifest("chaos", 0, stage) is None:
        rec["failures"].append(f"no {stage} manifest after both commands")
    return rec


# ---- Prefect: kill -9 of the serve process (with its flow run) or of the server ----------------------------
class Prefect:
    """A private Prefect server (own PREFECT_HOME, free port) and `python -m flows.serve`."""

    def __init__(self, home: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.home, self.procs = home, {}
        self.env = {**ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{self.port}/api",
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def start(self, what: str) -> None:
        cmd = {"server": [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                          str(self.port)], "serve": [sys.executable, "-m", "flows.serve"]}[what]
        env = {k: v for k, v in self.env.items() if not (what == "server" and k == "PREFECT_API_URL")}
        with open(self.home / f"{what}.log", "ab") as f:
            self.procs[what] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=f, start_new_session=True)
        self._wait(what)

    def _wait(self, what: str) -> None:
        import urllib.request

        for _ in range(600):
            try:
                if what == "server":
                    urllib.request.urlopen(f"{self.env['PREFECT_API_URL']}/health", timeout=2)
                elif self.cli("deployment", "inspect", "iterate/default").returncode == 0:
                    return
                else:
                    time.sleep(1)
                    continue
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"Prefect {what} did not come up (log {self.home / what}.log)")

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def kill(self, what: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[what].pid, signal.SIGKILL)
        self.procs[what].wait()

    def stop(self) -> None:
        for what in list(self.procs):
            self.kill(what)


def prefect_trial(out: Path, victim: str, i: int, rng: random.Random, pf: Prefect) -> dict:
    """A deployment run of iterate/default killed with its serve process, or with the server, inside a stage;
    the victim is restarted and the same run id is run again through the deployment, to the end."""
    trial = out / f"prefect-{victim}-{i}"
    trial.mkdir(parents=True)
    cfg = write_config(trial, 4, benchmark={"size": 20}, scoring={"batch_size": 1, "concurrency": 1, "reps": 2})
    scripted_rollout(cfg, "chaos", SCRIPTED)
    store, marks = Store(trial / "runs"), [str(trial)]
    watched = rng.choice(["score", "train"])
    delay = rng.uniform(0, STAGE_S[watched])
    rec = {"stage": f"prefect:{victim}", "trial": i, "watched": watched, "delay_s": round(delay, 2), "failures": []}
    params = [x for kv in (f"config={cfg}", "run_id=chaos", "rounds=1", "retry_delay_s=1") for x in ("--param", kv)]
    first = pf.cli("deployment", "run", "iterate/default", *params)
    if first.returncode != 0:
        return {**rec, "failures": [f"deployment run failed to start: {first.stderr[-500:]}"]}
    t0 = time.time()
    while not stage_running(marks, store, "chaos", watched) and time.time() - t0 < 900:
        time.sleep(0.05)
    time.sleep(delay)
    rec["landed_in"] = next((s for s in STAGES if store.manifest("chaos", 0, s) is None), "finished")
    pf.kill(victim)
    if victim == "serve":  # the server lives on: the flow run it thought running is left as it is
        rec["failures"] += orphans(marks, rec)
    done_before, before = {s for s in STAGES if store.manifest("chaos", 0, s)}, keys(store, "chaos")
    pf.start(victim)
    if victim == "server":  # serve and its flow run never died: their stage goes on (API calls fail meanwhile)
        rec["stage_alive_after_server_kill"] = bool([p for m in marks for p in procs_mentioning(m)])
    t0 = time.time()
    res = pf.cli("deployment", "run", "iterate/default", *params, "--watch", timeout=1200)
    rec["resume_s"] = round(time.time() - t0, 1)
    if res.returncode != 0:
        rec["failures"].append(f"the re-run flow did not complete: {res.stdout[-800:]}")
    rec["failures"] += check_store(store, "chaos", before, done_before) + check_checkpoint(store, "chaos")
    rec["failures"] += orphans(marks, rec, after_resume=True)
    return rec


# ---- executor soak -------------------------------------------------------------------------------------------
class FaultyExecutor(BaseHTTPRequestHandler):
    """OpenAI-compatible chat completions; `rng`/`rate` decide the faults, `counts` records them."""
    rng: random.Random
    rate: float
    counts: dict
    lock = threading.Lock()

    def log_message(self, *a) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802  (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            kind = self.rng.choice(["429", "500", "503", "timeout", "garbage"]) if self.rng.random() < self.rate \
                else "ok"
            self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "timeout":
            time.sleep(2.5)  # the client gives up after executor.timeout_s = 1
            kind = "ok"
        if kind in ("429", "500", "503"):
            return self._send(int(kind), b'{"error": {"message": "injected"}}')
        if kind == "garbage":
            return self._send(200, b"<html>not json")
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "fake",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "42"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
        self._send(200, json.dumps(body).encode())

    def _send(self, code: int, body: bytes) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out first


def soak(out: Path, runs: int, seed: int, rate: float = 0.3) -> dict:
    d = out / "soak"
    d.mkdir(parents=True)
    FaultyExecutor.rng, FaultyExecutor.rate, FaultyExecutor.counts = random.Random(seed), rate, {}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FaultyExecutor)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    queries = max(1, runs // 10)
    cfg = write_config(d, queries, benchmark={"size": max(50, queries * 5)},
                       executor={"kind": "openai", "base_url": f"http://127.0.0.1:{srv.server_port}/v1",
                                 "model": "fake", "max_retries": 0, "timeout_s": 1.0, "concurrency": 4},
                       scoring={"reps": 1, "concurrency": 4, "batch_size": 25})
    llm_once = "async def solve(problem):\n    return (await llm(problem))[0]\n"
    llm_twice = ("async def solve(problem):\n    plan = (await llm(problem))[0]\n"
                 "    return (await llm(problem + plan))[0]\n")
    scripted_rollout(cfg, "soak", [llm_once] * 7 + [llm_twice] * 2 + SCRIPTED[:1])  # 10 per query
    store, passes, rec = Store(d / "runs"), [], {"runs": runs, "fault_rate": rate, "failures": []}
    t0 = time.time()
    for p in range(12):
        again = ["--only-failed"] if p else []
        args = ["score", "--run-id", "soak", "--round", "0", "--store", str(d / "runs"), *again]
        rc = run_to_end(args, d, d / "log.txt")
        by = dict(store.sql("select status, count(*) from latest_scores where run_id='soak' group by 1").iter_rows())
        passes.append({"pass": p, "rc": rc, "latest_by_status": by})
        if store.manifest("soak", 0, "score"):
            break
    srv.shutdown()
    rec.update(passes=passes, wall_s=round(time.time() - t0, 1), faults_injected=FaultyExecutor.counts)
    rec["failures"] += soak_checks(store, runs)
    return rec


def soak_checks(store: Store, runs: int) -> list[str]:
    fails = check_manifests(store, "soak")
    k = keys(store, "soak")["scores"]
    if len(k) != len(set(k)):
        fails.append(f"scores: {len(k) - len(set(k))} duplicated (gen_id, rep, attempt)")
    latest = store.sql("select status, count(*) n from latest_scores where run_id='soak' group by 1")
    by = dict(latest.iter_rows())
    if sum(by.values()) != runs:
        fails.append(f"latest_scores has {sum(by.values())} rows, expected {runs}")
    if "executor_error" in by or store.manifest("soak", 0, "score") is None:
        fails.append(f"not every row final after re-scoring: {by}")
    return fails


def prefect_trials(out: Path, n: int, rng: random.Random) -> list[dict]:
    home = out / "prefect-home"
    home.mkdir()
    pf, recs = Prefect(home), []
    try:
        pf.start("server")
        pf.start("serve")
        for victim in ("serve", "server"):
            for i in range(n):
                recs.append(rec := prefect_trial(out, victim, i, rng, pf))
                print(json.dumps(rec), flush=True)
    finally:
        pf.stop()
    return recs


# ---- main ----------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Fresh directory for trial stores, logs, chaos.json.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=2, help="Kill trials per stage.")
    ap.add_argument("--stages", default="rollout,score,curate,train,evaluate")
    ap.add_argument("--soak", type=int, default=1000, help="Workflow runs in the executor soak (0: none).")
    ap.add_argument("--vllm", action="store_true", help="Also load one resumed checkpoint in vLLM (slow).")
    ap.add_argument("--prefect", type=int, default=0, help="Trials per victim (serve, server) through Prefect.")
    ap.add_argument("--two-writers", type=int, default=0, help="Two-writer trials per stage (score, train): at once, "
                                                               "and after kill -9 of the holder.")
    a = ap.parse_args()
    if a.out.exists() and any(a.out.iterdir()):
        ap.error(f"--out {a.out} is not empty: give a fresh directory (trial stores are created there)")
    a.out.mkdir(parents=True, exist_ok=True)
    stages = [s for s in a.stages.split(",") if s]
    unknown = set(stages) - {*STAGES, "evaluate"}
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}; use {', '.join(STAGES)}, evaluate")
    rng, report = random.Random(a.seed), {"seed": a.seed, "trials": []}
    for stage in stages:
        for i in range(a.trials):
            finished = a.out / f"train-{i}" if stage == "evaluate" else None
            if finished is not None and not Store(finished / "runs").manifest("chaos", 0, "train"):
                ap.error("evaluate trials evaluate the finished runs of train trials: list train before evaluate")
            report["trials"].append(rec := kill_trial(a.out, stage, i, rng, finished))
            print(json.dumps(rec), flush=True)
            save(a.out, report)  # a crash of the suite keeps the figures so far
    for stage in ("score", "train") if a.two_writers else ():
        for i in range(a.two_writers):
            for kill in (False, True):
                report["trials"].append(rec := two_writers_trial(a.out, stage, i, rng, kill))
                print(json.dumps(rec), flush=True)
                save(a.out, report)
    if a.prefect:
        report["trials"] += prefect_trials(a.out, a.prefect, rng)
    if a.vllm and (ck := next(iter(sorted(a.out.glob("train-*/runs/chaos/round=0/checkpoint"))), None)):
        report["vllm"] = {"checkpoint": str(ck), "failures": check_vllm(ck)}
        save(a.out, report)
    if a.soak:
        report["soak"] = soak(a.out, a.soak, a.seed)
        print(json.dumps(report["soak"]), flush=True)
    failures = save(a.out, report)
    print(f"{len(report['trials'])} kill trials, {len(failures)} failures; figures in {a.out / 'chaos.json'}")
    return 1 if failures else 0


def save(out: Path, report: dict) -> list[str]:
    report["failures"] = [f for t in report["trials"] for f in t["failures"]] + [
        f for k in ("soak", "vllm") for f in report.get(k, {}).get("failures", [])]
    tmp = out / ".chaos.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out / "chaos.json")
    return report["failures"]


if __name__ == "__main__":
    sys.exit(main())
