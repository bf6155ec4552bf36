"""Common random numbers for the executor (seeds derived on the trusted side), executor replies and grader
verdicts computed once (the shard cache beside the store: concurrent writers, kill -9, never another model's reply),
and the token accounting of used against computed tokens, also over stores written before."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from conftest import wait_until
from test_executors import FaultServer
from test_scoring import make_run, scores

from pipeline.config import ExecutorConfig, RunConfig, ServeConfig, diff_configs
from pipeline.engines import cache as cache_mod
from pipeline.engines.cache import CachedExecutor, ShardCache, VerdictCache, executor_identity
from pipeline.engines.executors import (
    CallSeeds,
    Executor,
    ExecutorError,
    ExecutorReply,
    LocalExecutor,
    OpenAIExecutor,
    SampleSlot,
)
from pipeline.engines.sandbox import Limits, run_workflow
from pipeline.run import open_run
from pipeline.stages.score import run_score
from pipeline.store import Store, round_stats
from pipeline.studies.evaluate import eval_changes

MSG = [{"role": "user", "content": "hi"}]
SLOT = SampleSlot(seed=0, query_id="q1", slot=2, rep=0)


# ---- common random numbers: the seeds ---------------------------------------------------------------------------


def test_a_change_of_any_input_changes_the_seed():
    base = CallSeeds(SLOT).seed(MSG, 0.7, 1, 256)
    assert isinstance(base, int) and 0 <= base < 2**31
    assert CallSeeds(SLOT).seed(MSG, 0.7, 1, 256) == base  # a function of its inputs: another arm gets it too
    other_slots = [SampleSlot(1, "q1", 2, 0), SampleSlot(0, "q2", 2, 0), SampleSlot(0, "q1", 3, 0),
                   SampleSlot(0, "q1", 2, 1)]  # executor seed, query, slot, rep
    other_calls = [([{"role": "user", "content": "hi!"}], 0.7, 1, 256), ([{"role": "system", "content": "hi"}], 0.7,
                   1, 256), (MSG, 0.8, 1, 256), (MSG, 0.7, 2, 256), (MSG, 0.7, 1, 128), (MSG, 0.7, 1, None)]
    seeds = [CallSeeds(w).seed(MSG, 0.7, 1, 256) for w in other_slots]
    seeds += [CallSeeds(SLOT).seed(*c) for c in other_calls]
    assert base not in seeds and len(set(seeds)) == len(seeds)


def test_identical_calls_of_one_run_get_new_seeds_and_greedy_calls_none():
    s = CallSeeds(SLOT)
    vote = [s.seed(MSG, 0.7, 1, 256) for _ in range(3)]  # a vote of three identical calls: three samples
    assert len(set(vote)) == 3
    other = s.seed([{"role": "user", "content": "else"}], 0.7, 1, 256)
    assert s.seed(MSG, 0.7, 1, 256) not in vote and other not in vote  # the fourth identical call: a fourth seed
    fresh = CallSeeds(SLOT)  # the next arm's run: the same sequence of seeds for the same calls
    assert [fresh.seed(MSG, 0.7, 1, 256) for _ in range(3)] == vote
    assert s.seed(MSG, 0.0, 3, 256) is None  # greedy: no seed needed
    assert CallSeeds(SLOT, default_temperature=0.0).seed(MSG, None, 1, 256) is None  # None: the executor's default
    assert CallSeeds(SLOT, default_temperature=0.7).seed(MSG, None, 1, 256) == vote[0]
    assert CallSeeds(None).seed(MSG, 0.7, 1, 256) is None  # no slot: common random numbers off


def test_openai_executor_sends_the_seed_only_when_sampling_and_counts_truncated_replies():
    srv = FaultServer()
    srv.finish_reason = "length"
    cfg = ExecutorConfig(kind="openai", model="m", base_url=srv.url, timeout_s=5, max_retries=0)

    async def go():
        ex = OpenAIExecutor(cfg)
        try:
            return [await ex.complete(MSG, 0.7, 2, seed=11), await ex.complete(MSG, 0.0, 3, seed=11)]
        finally:
            await ex.aclose()
    try:
        sampled, greedy = asyncio.run(go())
    finally:
        srv.close()
    assert [r["body"].get("seed") for r in srv.requests] == [11, None]
    assert sampled.texts == ["echo 0: hi (seed 11)", "echo 1: hi (seed 12)"] and sampled.truncated == 2
    assert greedy.texts == ["echo 0: hi"] * 3 and greedy.truncated == 3  # asked once, repeated: each one cut


@pytest.mark.slow
def test_local_executor_seeded_rows_do_not_depend_on_their_batch(tiny_model):
    ex = LocalExecutor(ExecutorConfig(kind="local", model=tiny_model, max_tokens=6))
    other = [{"role": "user", "content": "something else entirely"}]

    async def go():
        await ex.start()
        alone = await ex.complete(MSG, 1.0, 1, seed=5)
        batch = await asyncio.gather(ex.complete(other, 1.0, 2, seed=40), ex.complete(MSG, 1.0, 3, seed=5),
                                     ex.complete(MSG, 1.0, 1, seed=6), ex.complete(MSG, 1.0, 1))
        return alone, batch
    alone, (o, three, six, unseeded) = asyncio.run(go())
    assert ex.generate_calls == 2  # the four requests ran as one batch
    assert three.texts[0] == alone.texts[0]  # seed 5 alone and beside others: one sample
    assert three.texts[1] == six.texts[0]  # sample 1 of n = 3 seeded 5 draws with seed 6, as vLLM's server does
    assert len(set(three.texts)) == 3 and unseeded.texts[0] not in three.texts


@pytest.mark.slow
def test_two_workflows_making_the_same_call_get_the_same_reply(tiny_model, shared_sandbox):
    """Through the sandbox with the real local executor: the seed is derived in the parent from the run's slot."""
    ex = LocalExecutor(ExecutorConfig(kind="local", model=tiny_model, max_tokens=6))
    a = "async def solve(problem):\n    return (await llm(problem, temperature=1.0))[0]\n"
    b = ("import asyncio\nasync def solve(problem):\n    first = await llm(problem, temperature=1.0)\n"
         "    more = await asyncio.gather(llm(problem, temperature=1.0), llm(problem, temperature=1.0))\n"
         "    vote = await llm(problem, temperature=1.0, n=3)\n"
         "    return '\\x1f'.join(first + more[0] + more[1] + vote)\n")

    async def go():
        await ex.start()
        limits = Limits(timeout_s=120)
        runs = []
        for code, where in ((a, SLOT), (b, SLOT), (a, SampleSlot(0, "q1", 2, 1)), (a, None)):
            runs.append(await run_workflow(code, "hello", executor=ex, limits=limits, sandbox=shared_sandbox,
                                           seeds=CallSeeds(where)))
        return runs
    ra, rb, rep1, unseeded = asyncio.run(go())
    assert {r.status for r in (ra, rb, rep1, unseeded)} == {"ok"}, [r.error for r in (ra, rb, rep1, unseeded)]
    b_texts = rb.answer.split("\x1f")
    assert b_texts[0] == ra.answer  # another workflow, the same call in the same slot: the same sample
    assert len(set(b_texts[:3])) == 3  # three identical calls: three samples
    assert len(set(b_texts[3:])) == 3  # a vote of three in one call: three samples
    assert rep1.answer != ra.answer and unseeded.answer != ra.answer  # another rep, or no slot: another draw


# ---- the reply cache -----------------------------------------------------------------------------------------


class Counting(Executor):
    """A stand-in for the model: each computed call gives a new text, so a replay is told apart from a new call."""

    def __init__(self, truncated: int = 0):
        self.calls: list[tuple] = []
        self.truncated = truncated

    async def complete(self, messages, temperature=None, n=1, max_tokens=None, seed=None):
        self.calls.append((json.dumps(messages), temperature, n, max_tokens, seed))
        await asyncio.sleep(0)  # let a concurrent identical call arrive while this one computes
        k = len(self.calls)
        return ExecutorReply([f"reply {k}.{i}" for i in range(n)], 10, 3 * n, truncated=self.truncated)


def model_folder(path: Path, weights: bytes, **files: str) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    for name, text in files.items():
        (path / name).write_text(text)
    cache_mod.folder_fingerprint.cache_clear()
    return str(path)


def cached(cfg: ExecutorConfig, folder: Path, inner: Executor | None = None) -> CachedExecutor:
    ex = CachedExecutor.open(inner or Counting(), cfg, folder)
    assert isinstance(ex, CachedExecutor)
    return ex


def run(coro):
    return asyncio.run(coro)


def test_a_hit_computes_nothing_and_replays_the_reply(tmp_path):
    model = model_folder(tmp_path / "m", b"weights")
    cfg = ExecutorConfig(kind="local", model=model, max_tokens=32)
    ex = cached(cfg, tmp_path / "cache")
    first = run(ex.complete(MSG, 0.7, 2, seed=9))
    again = run(ex.complete(MSG, 0.7, 2, seed=9))
    assert len(ex.inner.calls) == 1 and not first.cached and again.cached
    assert again.texts == first.texts == ["reply 1.0", "reply 1.1"] and (again.tokens_in, again.tokens_out) == (10, 6)
    # another process (a new cache over the same folder) finds it too
    later = cached(cfg, tmp_path / "cache")
    assert run(later.complete(MSG, 0.7, 2, seed=9)).texts == first.texts and later.inner.calls == []
    # greedy: one answer computed, any n reuses it
    g1, g3 = run(later.complete(MSG, 0.0, 1)), run(later.complete(MSG, 0.0, 3, seed=123))
    assert len(later.inner.calls) == 1 and g3.cached and g3.texts == g1.texts * 3
    assert later.inner.calls[0][2] == 1 and later.inner.calls[0][4] is None  # asked for one, unseeded


def test_an_unseeded_sample_is_never_served_again(tmp_path):
    ex = cached(ExecutorConfig(kind="local", model=model_folder(tmp_path / "m", b"w")), tmp_path / "cache")
    texts = [run(ex.complete(MSG, 0.7, 1)).texts[0] for _ in range(2)]
    assert texts == ["reply 1.0", "reply 2.0"] and ex.hits == 0
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*.jsonl"))  # nothing kept


def test_concurrent_identical_calls_compute_once(tmp_path):
    ex = cached(ExecutorConfig(kind="local", model=model_folder(tmp_path / "m", b"w")), tmp_path / "cache")

    async def go():
        return await asyncio.gather(*(ex.complete(MSG, 0.0, 1) for _ in range(4)))
    replies = run(go())
    assert len(ex.inner.calls) == 1 and [r.cached for r in replies] == [False, True, True, True]
    assert {r.texts[0] for r in replies} == {"reply 1.0"}


def test_never_a_reply_for_another_model_adapter_dtype_or_parameter(tmp_path):
    folder = tmp_path / "cache"
    base = model_folder(tmp_path / "base", b"weights A")
    other_weights = model_folder(tmp_path / "other", b"weights B")  # same config, other weights
    adapter = {"adapter_config.json": json.dumps({"base_model_name_or_path": base})}
    lora_1 = model_folder(tmp_path / "lora1", b"lora A", **adapter)
    lora_2 = model_folder(tmp_path / "lora2", b"lora B", **adapter)  # another adapter on the same base
    served = ExecutorConfig(kind="openai", model=base, serve=ServeConfig(dtype="bfloat16"))
    configs = {"base": ExecutorConfig(kind="local", model=base), "weights": ExecutorConfig(kind="local",
               model=other_weights), "adapter 1": ExecutorConfig(kind="local", model=lora_1),
               "adapter 2": ExecutorConfig(kind="local", model=lora_2), "served bf16": served,
               "served fp16": served.model_copy(update={"serve": ServeConfig(dtype="float16")}),
               "served 4096": served.model_copy(update={"serve": ServeConfig(max_model_len=4096)})}
    # each model, adapter and dtype first computes its own reply to the same call, then is answered with it
    replies = {}
    for name, cfg in configs.items():
        ex = cached(cfg, folder)
        replies[name] = run(ex.complete(MSG, 0.7, 1, seed=3)).texts
        assert len(ex.inner.calls) == 1, name  # a miss: no other configuration's reply served
        assert run(ex.complete(MSG, 0.7, 1, seed=3)).texts == replies[name] and len(ex.inner.calls) == 1
    # every parameter of the call is in the key
    ex = cached(configs["base"], folder)
    for call in ((MSG, 0.8, 1, None, 3), (MSG, 0.7, 2, None, 3), (MSG, 0.7, 1, 64, 3), (MSG, 0.7, 1, None, 4),
                 ([{"role": "user", "content": "hi "}], 0.7, 1, None, 3), (MSG, 0.0, 1, None, 3)):
        assert not run(ex.complete(*call[:4], seed=call[4])).cached, call
    assert len(ex.inner.calls) == 6
    # an endpoint the pipeline does not start: no cache unless vouched for
    endpoint = ExecutorConfig(kind="openai", model="m", base_url="http://127.0.0.1:9/v1")
    assert executor_identity(endpoint) is None and not isinstance(CachedExecutor.open(Counting(), endpoint, folder),
                                                                  CachedExecutor)
    assert executor_identity(endpoint.model_copy(update={"cache": "on"}))["kind"] == "endpoint"
    off = ExecutorConfig(kind="local", model=base, cache="off")
    assert not isinstance(CachedExecutor.open(Counting(), off, folder), CachedExecutor)


def test_the_same_weights_written_elsewhere_and_later_are_the_same_model(tmp_path, monkeypatch):
    """Base weights are keyed by content, not path or modification time: a store's cache moved to a fresh machine,
    where setup wrote the same weights at another time, answers there (keyed by mtime it missed every call: the
    CRN bench's copy of an earlier session's cache). Other weights of the same size are another model; the content
    is hashed once per machine."""
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "home"))
    monkeypatch.setattr(cache_mod, "HASHED_FILE_MB", 0)  # every file is a "large" one here
    first = model_folder(tmp_path / "machine1" / "m", b"weights A")
    moved = model_folder(tmp_path / "machine2" / "model", b"weights A")
    os.utime(Path(moved) / "model.safetensors", ns=(10**18, 10**18))  # written at another time
    other = model_folder(tmp_path / "machine3" / "m", b"weights B")  # the same size, other weights
    ex = cached(ExecutorConfig(kind="local", model=first), tmp_path / "cache")
    reply = run(ex.complete(MSG, 0.7, 1, seed=3)).texts
    there = cached(ExecutorConfig(kind="local", model=moved), tmp_path / "cache")
    assert run(there.complete(MSG, 0.7, 1, seed=3)).texts == reply and there.inner.calls == []
    elsewhere = cached(ExecutorConfig(kind="local", model=other), tmp_path / "cache")
    assert not run(elsewhere.complete(MSG, 0.7, 1, seed=3)).cached and len(elsewhere.inner.calls) == 1  # a miss
    assert len(list((tmp_path / "home" / "fingerprints").iterdir())) == 6  # one per file (2 a folder), remembered
    cache_mod.folder_fingerprint.cache_clear()
    monkeypatch.setattr(cache_mod.hashlib, "file_digest", None)  # a second look reads the memo, hashes nothing
    assert cache_mod.executor_identity(ExecutorConfig(kind="local", model=moved)) == \
        cache_mod.executor_identity(ExecutorConfig(kind="local", model=first))


def test_a_stage_pointed_at_its_own_server_keeps_the_cache_and_auto_keys_on_the_dtype_loaded(tmp_path, monkeypatch):
    """`servers.serving` points a served section at the stage's server (base_url set, serve cleared): the cache must
    still know what answers, or no served executor would ever be cached. `auto` is keyed as the dtype this machine
    loads, never as `auto`: a store's cache moves between machines that resolve it differently."""
    from pipeline.engines import hardware, servers

    base = model_folder(tmp_path / "base", b"weights A")
    cfg = RunConfig.model_validate({"executor": {"kind": "openai", "model": base, "serve": {"dtype": "auto"}}})

    class FakeServer:  # what serving() reads of a started server (its /metrics at port 9: nothing listens)
        base_url, url, spec = "http://127.0.0.1:9/v1", "http://127.0.0.1:9", SimpleNamespace(name="base")

        def wait(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(servers, "check", lambda spec: None)
    monkeypatch.setattr(servers, "launch", lambda spec, log: FakeServer())
    monkeypatch.setenv(hardware.FORCE_ENV, "0")
    with servers.serving(cfg, ["executor"], tmp_path / "logs") as pointed:
        ex = pointed.executor
        assert (ex.serve, ex.base_url) == (None, FakeServer.base_url)
        inside = executor_identity(ex)
    assert inside == executor_identity(cfg.executor) and inside["dtype"] == "float32"
    as_fp32 = cfg.executor.model_copy(update={"serve": ServeConfig(dtype="float32")})
    assert executor_identity(as_fp32) == inside  # auto on a CPU without native bf16 is fp32, keyed as such
    monkeypatch.setenv(hardware.FORCE_ENV, "1")
    assert executor_identity(cfg.executor)["dtype"] == "bfloat16"  # where bf16 is native: another key


# ---- the shard files: concurrent writers, kill -9, SQL --------------------------------------------------------


def _writer(folder: str, tag: str, n: int) -> None:
    c = ShardCache(Path(folder))
    for i in range(n):
        c.put({"key": f"{tag}-{i}", "texts": [tag * 50], "tokens_in": i, "tokens_out": 1})
    c.close()


def test_concurrent_writer_processes_lose_nothing(tmp_path):
    # spawned, not forked: after the suite's earlier tests this process holds threads (Prefect, torch, asyncio), and
    # a forked child of a threaded process may inherit a lock some thread held
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 300)) for tag in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    c = ShardCache(tmp_path)
    assert len(c.entries) == 900 and c.torn_lines == 0 and len(list(tmp_path.glob("*.jsonl"))) == 3
    assert c.entries["b-299"]["texts"] == ["b" * 50]


KILLED_WRITER = """
import sys
import time
from pathlib import Path
from pipeline.engines.cache import ShardCache
c = ShardCache(Path(sys.argv[1]))
i = 0
while True:
    c.put({"key": f"k{i}", "texts": ["x" * 2000], "tokens_in": i, "tokens_out": 1})
    i += 1
    time.sleep(0.001)  # a few MB before the kill, not gigabytes
"""


def test_kill_9_of_a_writer_leaves_whole_entries_and_a_torn_line_is_skipped(tmp_path):
    folder = tmp_path / "executor"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(folder)], env={**os.environ,
                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})

    def lines() -> int:
        return sum(f.read_bytes().count(b"\n") for f in folder.glob("*.jsonl")) if folder.is_dir() else 0
    try:
        wait_until(lambda: lines() >= 200, 120, "the writer wrote no 200 entries")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    shard = next(folder.glob("*.jsonl"))
    with open(shard, "ab") as f:  # what a writer killed inside its write could leave: half a line
        f.write(b'{"key": "torn", "texts": ["half')
    c = ShardCache(folder)
    whole = shard.read_bytes().count(b"\n")
    assert len(c.entries) == whole >= 200 and "torn" not in c.entries
    assert all(c.entries[f"k{i}"]["tokens_in"] == i for i in range(whole))
    # the next process writes its own shard; the dead one's torn tail never joins a later line
    c.put({"key": "after", "texts": ["y"], "tokens_in": 0, "tokens_out": 0})
    c.close()
    again = ShardCache(folder)
    assert len(again.entries) == whole + 1 and again.torn_lines == 0  # the torn tail has no newline: never read
    # SQL over the same files: the torn line is left out
    st = Store(tmp_path.parent / "st")
    shutil.copytree(folder, st.root / "cache" / "executor")
    n = st.sql("SELECT count(*) AS n, count(DISTINCT key) AS k FROM executor_cache")
    assert (n["n"][0], n["k"][0]) == (whole + 1, whole + 1)


def test_a_miss_reads_what_another_process_wrote_since(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "RESCAN_S", 0.0)
    reader, writer = ShardCache(tmp_path), ShardCache(tmp_path)
    assert reader.get("k") is None
    writer.put({"key": "k", "texts": ["v"]})
    assert reader.get("k")["texts"] == ["v"]


# ---- grader verdicts ---------------------------------------------------------------------------------------------


def test_verdicts_are_computed_once_but_timeouts_every_time(tmp_path):
    cfg = RunConfig.model_validate({"benchmark": {"name": "humaneval"}})
    graded: list[str] = []

    def grader(status: str):
        async def grade():
            graded.append(status)
            return (1.0 if status == "pass" else 0.0), {"status": status}
        return grade

    v = VerdictCache(cfg, tmp_path)
    ref = {"test": "def check(f): pass"}
    assert run(v.verdict("HumanEval/0", ref, "code A", grader("pass"))) == (1.0, {"status": "pass"}, False)
    assert run(v.verdict("HumanEval/0", ref, "code A", grader("fail"))) == (1.0, {"status": "pass"}, True)
    assert run(v.verdict("HumanEval/0", ref, "code B", grader("fail")))[2] is False  # another answer
    assert run(v.verdict("HumanEval/1", ref, "code A", grader("fail")))[2] is False  # another item
    for _ in range(2):
        assert run(v.verdict("HumanEval/2", ref, "slow", grader("timeout"))) == (0.0, {"status": "timeout"}, False)
    assert graded == ["pass", "fail", "fail", "timeout", "timeout"]
    other = RunConfig.model_validate({"benchmark": {"name": "humaneval"}, "scoring": {"test_timeout_s": 9}})
    assert run(VerdictCache(other, tmp_path).verdict("HumanEval/0", ref, "code A", grader("fail")))[0] == 0.0


# ---- accounting: used against computed tokens ----------------------------------------------------------------


def test_a_workflow_run_counts_used_computed_cached_and_truncated(tmp_path, shared_sandbox):
    inner = Counting(truncated=1)
    ex = cached(ExecutorConfig(kind="local", model=model_folder(tmp_path / "m", b"w")), tmp_path / "cache", inner)
    code = ("async def solve(p):\n    a = await llm(p)\n    b = await llm(p)\n"
            "    c = await llm(p, temperature=0.5)\n    return a[0] + b[0] + c[0]\n")
    r = run(run_workflow(code, "p", executor=ex, limits=Limits(timeout_s=30), sandbox=shared_sandbox,
                         seeds=CallSeeds(None)))
    assert r.status == "ok" and len(inner.calls) == 2  # the greedy repeat was a hit; the unseeded sample computed
    # used: 3 calls x 10 in, 3 out; computed: the two that ran; truncated: every reply (one text each) hit the cap
    assert (r.llm_calls, r.tokens_in, r.tokens_out, r.cached_calls) == (3, 30, 9, 1)
    assert (r.computed_tokens_in, r.computed_tokens_out, r.truncated_calls) == (20, 6, 3)


@pytest.mark.usefixtures("shared_sandbox")
def test_score_stage_seeds_by_slot_and_a_second_store_sharing_the_cache_computes_nothing(tmp_path):
    srv = FaultServer()
    a = "async def solve(problem):\n    return (await llm(problem, temperature=0.7))[0]\n"
    b = "async def solve(problem):\n    x = await llm(problem, temperature=0.7)\n    return x[0].upper()\n"
    ex = {"kind": "openai", "model": "m", "base_url": srv.url, "max_retries": 0, "timeout_s": 5,
          "common_random_numbers": True, "cache": "on"}
    try:
        path, root = make_run(tmp_path / "a", [a, b], executor=ex, reps=2)
        assert run_score(open_run(path, "t", 0))["done"]
        first = len(srv.requests)
        df = scores(root).sort(["gen_id", "rep"])
        # slot 0 and slot 1 of a query draw different seeds; two reps too; nothing repeats, so nothing was a hit
        seeds = [r["body"]["seed"] for r in srv.requests]
        assert first == 8 and len(set(seeds)) == 8 and df["cached_calls"].to_list() == [0] * 8
        assert df["computed_tokens_in"].to_list() == df["tokens_in"].to_list() == [7] * 8
        # another arm (its store holding the same cache) with other code in the same slots: the same calls,
        # answered without the executor; the answers are the first arm's samples
        shutil.copytree(Path(root) / "cache", tmp_path / "b" / "store" / "cache")
        path_b, root_b = make_run(tmp_path / "b", [b, a], executor=ex, reps=2)
        assert run_score(open_run(path_b, "t", 0))["done"]
    finally:
        srv.close()
    assert len(srv.requests) == first
    df_b = scores(root_b).sort(["gen_id", "rep"])
    assert df_b["cached_calls"].to_list() == [1] * 8 and df_b["computed_tokens_in"].to_list() == [0] * 8
    assert df_b["tokens_in"].to_list() == [7] * 8 and df_b["tokens_out"].to_list() == [3] * 8
    assert [x.upper() for x in df["answer"]] == [x.upper() for x in df_b["answer"]]
    usage = Store(root_b).sql("SELECT * FROM query_usage WHERE run_id = 't' ORDER BY query_id").to_dicts()
    assert [(u["exec_calls"], u["exec_tokens_in"], u["exec_computed_tokens_in"], u["exec_cached_calls"])
            for u in usage] == [(4, 28, 0, 4)] * 2
    stats = round_stats(Store(root_b), "t").to_dicts()[0]
    assert (stats["cached_calls"], stats["cache_hit_rate"], stats["computed_tokens_out"]) == (8, 1.0, 0)
    assert Store(root_b).sql("SELECT count(*) AS n FROM executor_cache")["n"][0] == 8


def test_a_querys_workflows_hold_distinct_slots_under_plans_too():
    """Common random numbers pair runs by their slot within the query. Flat workflows keep theirs (a repair its
    original's); under plans (two-level, 2 plans x 3 workflows) each plan counts its workflows from 0, so the query
    slot is plan slot x 3 + slot, by hand: plan a2 (slot 1), workflow slot 2 -> 5; two plans' first workflows no
    longer share slot 0. A workflow without a slot stays unpaired."""
    from pipeline.stages.score import query_slots

    flat = pl.DataFrame({"gen_id": ["f0", "f1", "f1-r1", "fx"], "slot": [0, 1, 1, None],
                         "parent_id": [None, None, None, None]}, schema_overrides={"parent_id": pl.Utf8})
    assert query_slots(flat, {}, 3) == {"f0": 0, "f1": 1, "f1-r1": 1}
    under = pl.DataFrame({"gen_id": ["w10", "w11", "w12", "w20", "w21", "w22"], "slot": [0, 1, 2, 0, 1, 2],
                          "parent_id": ["a1", "a1", "a1", "a2", "a2", "a2"]})
    assert query_slots(under, {"a1": 0, "a2": 1}, 3) == {"w10": 0, "w11": 1, "w12": 2, "w20": 3, "w21": 4, "w22": 5}
    # the held-out shape of L = 2 (2 plans x 1 workflow): slots 0 and 1, as a flat arm's two samples
    two = pl.DataFrame({"gen_id": ["x", "y"], "slot": [0, 0], "parent_id": ["a1", "a2"]})
    assert query_slots(two, {"a1": 0, "a2": 1}, 1) == {"x": 0, "y": 1}


# ---- stores written before, and the config ---------------------------------------------------------------------


def test_old_stores_read_with_the_new_columns():
    st = Store("data/stores/gsm-learn")
    u = st.sql("SELECT * FROM query_usage WHERE run_id = 'gsm-learn-s0-eval-r2'")
    assert u.height > 0 and u["exec_cached_calls"].to_list() == [0] * u.height
    assert u["exec_computed_tokens_in"].to_list() == u["exec_tokens_in"].to_list()  # all computed then
    assert u["exec_truncated_calls"].null_count() == u.height  # not recorded then: unknown, not 0
    stats = round_stats(st, "gsm-learn-s0").to_dicts()
    assert len(stats) == 3 and all(r["cached_calls"] == 0 and r["computed_tokens_in"] == r["tokens_in"]
                                   for r in stats)


def test_common_random_numbers_and_the_cache_never_refuse_or_rerun_a_run():
    cfg = RunConfig()
    on = RunConfig.model_validate({"executor": {"common_random_numbers": True, "seed": 4, "cache": "off"},
                                   "scoring": {"cache_verdicts": False}})
    assert cfg.config_hash() == on.config_hash() and diff_configs(cfg, on) == []
    assert diff_configs(cfg, RunConfig.model_validate({"executor": {"temperature": 0.5}})) == ["executor.temperature"]
    assert eval_changes(cfg)["executor.common_random_numbers"] is True  # evaluations and references: on
    off = RunConfig.model_validate({"experiment": {"common_random_numbers": False}})
    assert eval_changes(off)["executor.common_random_numbers"] is False
    assert cfg.executor.common_random_numbers is False  # training rollouts: fresh samples unless asked


@pytest.mark.slow
def test_a_local_call_past_the_models_context_is_refused_and_its_batch_runs(tiny_model):
    """tiny_model's context is 2048 tokens: a prompt of about 2,500 is refused with the numbers, as a server refuses
    one past its max_model_len, while the call batched beside it is answered as it is alone."""
    ex = LocalExecutor(ExecutorConfig(kind="local", model=tiny_model, max_tokens=6))
    long = [{"role": "user", "content": "seven " * 2500}]

    async def go():
        await ex.start()
        alone = await ex.complete(MSG)
        both = await asyncio.gather(ex.complete(long), ex.complete(MSG), return_exceptions=True)
        return alone, both
    alone, (refused, answered) = asyncio.run(go())
    assert isinstance(refused, ExecutorError)
    assert "and 6 to generate exceed the local executor's context of 2048 tokens" in str(refused)
    assert answered.texts == alone.texts and answered.tokens_in == alone.tokens_in
    assert ex.generate_calls == 2  # the refused prompt was never computed: two calls, one each for the short prompt
