"""The store on object storage (`store.root: s3://bucket/prefix`) against a local S3-compatible server (moto, started
here on a free port): parts, DuckDB views through httpfs, manifests, discards, checkpoints, failures mid-upload,
and rounds run by the stage runner on an s3:// store."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import uuid
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("upath")
pytest.importorskip("moto")

from conftest import free_port  # noqa: E402

from pipeline import stages  # noqa: E402
from pipeline.store import CHECKPOINT_MARKER, Store, StoreError  # noqa: E402

KEY, SECRET = "testing-key", "testing-secret-do-not-freeze"


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on 127.0.0.1 (a free port) for the module, in its own process; yields its URL. Not in this
    process: moto's server imports flask, whose context proxies break vLLM's engine start in later tests (vLLM scans
    every loaded module's globals, and touching `flask.current_app` outside an app raises)."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # wait for it to answer (bounded)
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def bucket(s3_server, monkeypatch, tmp_path):
    """A fresh bucket per test; the AWS environment pointing at the local server; a private checkpoint cache."""
    import boto3

    for k, v in {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": s3_server, "PIPELINE_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    name = f"b{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


def _keys(bucket: str) -> list[str]:
    import boto3

    out = boto3.client("s3").list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in out.get("Contents", []))


def _score(gen, rep, attempt, status, score):
    return {"gen_id": gen, "query_id": "q", "rep": rep, "attempt": attempt, "status": status, "score": score}


def test_parts_are_single_objects_and_read_back(bucket):
    st = Store(f"s3://{bucket}/pre/")
    assert st.remote and str(st.root) == f"s3://{bucket}/pre"
    p0 = st.write("generations", [{"gen_id": "a", "kind": "workflow", "token_ids": [1, 2]}], "r1", 0)
    st.write("generations", [{"gen_id": "b", "kind": "agent"}], "r1", 1)
    st.write("generations", [{"gen_id": "z", "kind": "agent"}], "other", 0)
    keys = _keys(bucket)
    assert len(keys) == 3 and all(k.endswith(".parquet") and "/part-" in k for k in keys), keys  # no temp objects
    assert str(p0) == f"s3://{bucket}/pre/r1/round=0/generations/{p0.name}"
    df = st.read("generations", "r1").sort("gen_id")
    assert df["gen_id"].to_list() == ["a", "b"] and df["round"].to_list() == [0, 1]
    assert df["token_ids"][0].to_list() == [1, 2] and df["run_id"].to_list() == ["r1", "r1"]
    assert st.read("generations", "r1", round=1)["gen_id"].to_list() == ["b"]
    assert [p.name for p in st.parts("generations", "r1", 0)] == [p0.name]


def test_duckdb_views_read_s3_parts_through_httpfs(bucket):
    st = Store(f"s3://{bucket}/pre")
    st.write("generations", [
        {"gen_id": "a", "kind": "workflow", "query_id": "q", "slot": 0, "valid": True},
        {"gen_id": "b", "kind": "workflow", "query_id": "q", "slot": 1, "valid": False},
        {"gen_id": "c", "kind": "workflow", "query_id": "q", "slot": 2, "valid": True},
    ], "r", 0)
    st.write("scores", [_score("a", 0, 0, "executor_error", 0.0), _score("a", 1, 0, "ok", 0.3),
                        _score("c", 0, 0, "ok", 1.0)], "r", 0)
    st.write("scores", [_score("a", 0, 1, "ok", 0.9)], "r", 0)  # a later attempt, another part
    con = st.connect()
    try:
        loaded = con.execute("SELECT loaded FROM duckdb_extensions() WHERE extension_name = 'httpfs'").fetchone()
        assert loaded == (True,)
        assert con.execute("SELECT count(*) FROM scores").fetchone() == (4,)
    finally:
        con.close()
    latest = st.sql("SELECT gen_id, rep, attempt, score FROM latest_scores ORDER BY gen_id, rep")
    assert latest.rows() == [("a", 0, 1, 0.9), ("a", 1, 0, 0.3), ("c", 0, 0, 1.0)]
    rows = {r["gen_id"]: r for r in st.generation_scores("r", 0, reps=2, transient={"executor_error"}).to_dicts()}
    assert rows["a"]["score"] == pytest.approx(0.6) and rows["a"]["state"] == "ok"
    assert rows["b"]["score"] == 0.0 and rows["b"]["state"] == "ok"  # invalid counts 0
    assert rows["c"]["score"] == 1.0 and rows["c"]["state"] == "unscored"  # one rep of two
    assert st.sql("SELECT DISTINCT round FROM generations")["round"].to_list() == [0]
    with pytest.raises(StoreError, match="catalog.duckdb is a local file"):
        st.refresh_catalog()


def test_manifests_roundtrip_and_clear(bucket):
    st = Store(f"s3://{bucket}/pre")
    assert st.manifest("r", 0, "rollout") is None
    st.write_manifest("r", 0, "rollout", "abc", rows=3)
    assert "pre/r/round=0/_done/rollout.json" in _keys(bucket)
    m = Store(f"s3://{bucket}/pre").manifest("r", 0, "rollout")  # another process's view: no cached listing
    assert m["config_hash"] == "abc" and m["counts"] == {"rows": 3}
    st.clear_manifest("r", 0, "rollout")
    st.clear_manifest("r", 0, "rollout")  # clearing a missing manifest is fine
    assert st.manifest("r", 0, "rollout") is None and _keys(bucket) == []


def test_runs_lists_only_runs_with_a_frozen_config(bucket):
    st = Store(f"s3://{bucket}/pre")
    assert st.runs() == []
    st.put_text(st.run_dir("b") / "config.yaml", "run_id: b\n")
    st.put_text(st.run_dir("a") / "config.yaml", "run_id: a\n")
    st.write("groups", [{"group_id": "g"}], "no-config", 0)
    assert st.runs() == ["a", "b"] and st.read_config("a") == "run_id: a\n" and st.read_config("zz") is None


def _save_adapter(tag: str, extra: bool = True):
    def save(folder):
        (folder / "adapter_config.json").write_text(json.dumps({"tag": tag}))
        (folder / "adapter_model.safetensors").write_bytes(tag.encode() * 1000)
        if extra:
            (folder / "README.md").write_text("model card")
    return save


def test_checkpoint_publish_materialise_and_republish(bucket, monkeypatch, tmp_path):
    st = Store(f"s3://{bucket}/pre")
    uploads = []
    orig = st.fs.put_file
    monkeypatch.setattr(st.fs, "put_file", lambda lpath, rpath, **kw: (uploads.append(rpath), orig(lpath, rpath, **kw)))
    assert not st.checkpoint_complete("r", 0) and st.local_adapter(st.checkpoint_dir("r", 0)) is None
    dest = st.publish_checkpoint(_save_adapter("one"), "r", 0)
    assert str(dest) == f"s3://{bucket}/pre/r/round=0/checkpoint"
    assert len(uploads) == 3 and uploads[-1].endswith("/" + CHECKPOINT_MARKER)  # the marker last
    assert st.checkpoint_complete("r", 0)
    # another machine: an empty cache, the store's URL as an eval run's generator.adapter names it
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path / "other-cache"))
    local = Store(f"s3://{bucket}/pre").local_adapter(str(dest))
    assert local.is_relative_to(tmp_path / "other-cache")
    assert json.loads((local / "adapter_config.json").read_text()) == {"tag": "one"}
    assert (local / "adapter_model.safetensors").read_bytes() == b"one" * 1000 and (local / "README.md").is_file()
    # a re-trained round replaces the checkpoint: the cached copy is refreshed, not reused
    st.publish_checkpoint(_save_adapter("two", extra=False), "r", 0)
    assert not any(k.endswith("README.md") for k in _keys(bucket)), "the old checkpoint's files are gone"
    again = Store(f"s3://{bucket}/pre").local_adapter(str(dest))
    assert again == local and json.loads((again / "adapter_config.json").read_text()) == {"tag": "two"}


def test_half_uploaded_checkpoint_is_not_complete_and_is_discarded(bucket, monkeypatch):
    st = Store(f"s3://{bucket}/pre")
    orig, calls = st.fs.put_file, []

    def dies_after_first(lpath, rpath, **kw):  # the process "dies" after uploading one file
        calls.append(rpath)
        if len(calls) > 1:
            raise ConnectionError("network gone")
        return orig(lpath, rpath, **kw)

    monkeypatch.setattr(st.fs, "put_file", dies_after_first)
    with pytest.raises(ConnectionError):
        st.publish_checkpoint(_save_adapter("x"), "r", 0)
    left = [k for k in _keys(bucket) if "/checkpoint/" in k]
    assert len(left) == 1 and not left[0].endswith(CHECKPOINT_MARKER), left  # a partial prefix, no marker
    assert not st.checkpoint_complete("r", 0) and st.local_adapter(st.checkpoint_dir("r", 0)) is None
    train = stages.STAGES["train"]
    from pipeline.run import RunContext

    ctx = RunContext(cfg=None, store=st, run_id="r", round=0, frozen_hash="h")  # type: ignore[arg-type]
    st.write_manifest("r", 0, "train", "h")
    assert not train.done(ctx), "a manifest without a whole checkpoint: the round trains again"
    st.write("train_metrics", [{"step": 0}], "r", 0)
    st.write("groups", [{"group_id": "g"}], "r", 0)
    st.write("train_metrics", [{"step": 0}], "r", 1)  # another round: kept
    assert st.discard_unfinished("r", 0, ["train_metrics", "checkpoints"], checkpoint=True) == 1
    keys = _keys(bucket)
    assert not [k for k in keys if "/checkpoint/" in k or "round=0/train_metrics" in k], keys
    assert any("round=0/groups" in k for k in keys) and any("round=1/train_metrics" in k for k in keys)


def test_failed_upload_mid_part_leaves_no_visible_part(bucket, monkeypatch):
    """A part sent as a multipart upload whose second 5 MiB piece fails: the upload is aborted, nothing is listed,
    no upload is left pending, and the error names what was lost."""
    st = Store(f"s3://{bucket}/pre")
    st.write("generations", [{"gen_id": "kept", "kind": "workflow"}], "r", 0)
    pipe, call = st.fs.pipe_file, st.fs._call_s3
    monkeypatch.setattr(st.fs, "pipe_file", lambda path, data, **kw: pipe(path, data, chunksize=5 * 2**20, **kw))
    sent = []

    async def fail_second_piece(method, *a, **kw):
        if method == "upload_part":
            sent.append(len(kw["Body"]))
            if len(sent) == 2:
                raise ConnectionResetError("connection reset mid-upload")
        return await call(method, *a, **kw)

    monkeypatch.setattr(st.fs, "_call_s3", fail_second_piece)
    big = base64.b64encode(os.urandom(12 * 2**20)).decode()  # ~16 MiB of incompressible text: 4 pieces
    with pytest.raises(OSError, match="1 generations rows of run 'r' round 0 not written"):
        st.write("generations", [{"gen_id": "big", "kind": "workflow", "text": big}], "r", 0)
    assert sent and sent[0] == 5 * 2**20, "the upload had sent bytes before it failed"
    assert [k.rsplit("/", 1)[0] for k in _keys(bucket)] == ["pre/r/round=0/generations"]
    import boto3

    assert not boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads"), "the upload was aborted"
    assert Store(f"s3://{bucket}/pre").read("generations", "r")["gen_id"].to_list() == ["kept"]


def test_failure_while_serialising_uploads_nothing(bucket, monkeypatch):
    import pyarrow.parquet as pq

    st = Store(f"s3://{bucket}/pre")
    real = pq.write_table

    def dies_half_way(table, where, **kw):
        real(table.slice(0, 1), where, **kw)  # some bytes written, then the process "dies"
        raise MemoryError("killed")

    monkeypatch.setattr("pipeline.store.store.pq.write_table", dies_half_way)
    with pytest.raises(MemoryError):
        st.write("generations", [{"gen_id": "a", "kind": "workflow"}, {"gen_id": "b", "kind": "workflow"}], "r", 0)
    assert _keys(bucket) == [] and st.parts("generations") == []


def test_bad_roots_are_refused_clearly():
    with pytest.raises(StoreError, match="only local paths and s3://bucket"):
        Store("gs://bucket/prefix")
    with pytest.raises(StoreError, match="only local paths and s3://bucket"):
        Store("s3://")


def test_rounds_of_lost_weights_on_s3_are_an_error_naming_what_to_move(bucket):
    """Round 0 trained but its checkpoint gone, round 1 begun: the stale round is listed from the bucket and not moved
    (an s3 move is a copy and a delete per key): the error says what to move where, and nothing is touched."""
    from pipeline.stages.rounds import lost_weights, set_aside_stale_rounds

    st = Store(f"s3://{bucket}/pre")
    st.write_manifest("r", 0, "train", "h")
    st.write("generations", [{"gen_id": "g", "kind": "workflow", "query_id": "q"}], "r", 1)
    assert st.rounds_written("r") == [0, 1] and lost_weights(st, "r") == 0
    before = _keys(bucket)
    with pytest.raises(StoreError, match=rf"round 0's checkpoint is gone.*by hand.*s3://{bucket}/pre/r/round=1 -> "
                                         rf"s3://{bucket}/pre/r/stale/\d{{8}}T\d{{6}}Z/round=1"):
        set_aside_stale_rounds(st, "r", 2)
    assert _keys(bucket) == before


# ---- rounds on an s3:// store through the stage runner ----------------------------------------------------


class Fakes:
    """rollout/score/train without models: rollout reads round k-1's checkpoint as the real one does
    (`resolve_adapter`), train publishes the round's checkpoint as the real one does; curate is the real stage."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.adapters: dict[int, dict] = {}

    def rollout(self, ctx):
        from pipeline.stages.rollout import resolve_adapter

        self.calls.append(("rollout", ctx.round))
        path, rnd = resolve_adapter(ctx)
        if path is not None:
            self.adapters[ctx.round] = json.loads((Path(path) / "adapter_config.json").read_text())
        gens = [{"gen_id": f"r{ctx.round}-{q}-w{i}", "kind": "workflow", "query_id": q, "slot": i, "valid": True,
                 "prompt_token_ids": [1, 2], "token_ids": [3, 4 + i]} for q in ("qa", "qb") for i in range(4)]
        ctx.store.write("generations", gens, ctx.run_id, ctx.round)
        ctx.finish("rollout", generations=len(gens))
        return {"generations": len(gens)}

    def score(self, ctx, only_failed=False):
        self.calls.append(("score", ctx.round))
        gens = ctx.store.read("generations", ctx.run_id, ctx.round)
        rows = [{"gen_id": g, "query_id": q, "rep": 0, "attempt": 0, "status": "ok", "score": s / 4}
                for g, q, s in zip(gens["gen_id"], gens["query_id"], gens["slot"], strict=True)]
        ctx.store.write("scores", rows, ctx.run_id, ctx.round)
        ctx.finish("score", scored=len(rows))
        return {"scored": len(rows)}

    def train(self, ctx):
        self.calls.append(("train", ctx.round))
        groups = ctx.store.read("groups", ctx.run_id, ctx.round)
        kept = int((groups["kept"] & (groups["kind"] == "group")).sum())
        ctx.store.publish_checkpoint(_save_adapter(f"round{ctx.round}-{kept}"), ctx.run_id, ctx.round)
        ctx.finish("train", steps=1)
        return {"steps": 1}

    def install(self, monkeypatch):
        for name, fn in (("rollout", self.rollout), ("score", self.score), ("train", self.train)):
            monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(stages.STAGES[name], fn=fn, isolated=False))
        return self


def test_rounds_run_on_an_s3_store_with_the_endpoint_from_the_config(bucket, s3_server, monkeypatch, tmp_path):
    from pipeline.run import open_run
    from pipeline.stages.rounds import direct_call, run_rounds
    from pipeline.stages.runner import RetryPolicy
    from pipeline.studies.tracking import TRACKERS

    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the config names the server; use_endpoint exports it for the stages
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: s3run\nrounds: 2\nstore:\n  root: s3://{bucket}/runs\n  endpoint_url: {s3_server}\n"
                   "scoring:\n  reps: 1\ncuration:\n  n: 3\n  t: 1\n  top_n: 8\n")
    fakes = Fakes().install(monkeypatch)
    out = run_rounds(cfg, None, None, direct_call(RetryPolicy(retries=0, delay_s=0)), observer=TRACKERS)
    assert out.store == f"s3://{bucket}/runs" and [r.round for r in out.rounds] == [0, 1]
    assert out.rounds[1].mean_score == pytest.approx(0.375)  # slots 0..3 score 0, .25, .5, .75
    st = Store(f"s3://{bucket}/runs")
    groups = st.read("groups", "s3run")
    kept = groups.filter(groups["kept"] & (groups["kind"] == "group"))
    assert sorted(set(kept["round"])) == [0, 1] and set(kept["query_id"]) == {"qa", "qb"}
    # round 1's rollout sampled round 0's checkpoint, materialised from the bucket
    assert fakes.adapters == {1: {"tag": f"round0-{kept.filter(kept['round'] == 0).height}"}}
    assert st.checkpoint_complete("s3run", 0) and st.checkpoint_complete("s3run", 1)
    saved = st.read_config("s3run")
    assert f"endpoint_url: {s3_server}" in saved and SECRET not in saved and KEY not in saved
    timings = [json.loads(x) for x in (st.run_dir("s3run") / "timings.jsonl").read_text().splitlines()]
    assert [(t["round"], t["stage"]) for t in timings] == [(k, s) for k in (0, 1) for s in stages.ROUND_STAGES]
    assert not list(tmp_path.glob("**/*.parquet")) and not (tmp_path / "data").exists(), "nothing written locally"
    assert len(st.fs.glob(f"{st.url(st.run_dir('s3run'))}/tensorboard/events.out.tfevents.*")) == 1  # replaced
    # a second invocation skips every stage: manifests and whole checkpoints are read from the bucket (without the
    # trackers: their sync after each round, every scalar read back over S3, is checked above)
    n = len(fakes.calls)
    run_rounds(cfg, None, None, direct_call(RetryPolicy(retries=0, delay_s=0)))
    assert len(fakes.calls) == n
    assert open_run(None, "s3run", 1, store_root=f"s3://{bucket}/runs").done("curate")
    # evaluating a checkpoint: the eval run's generator.adapter is the s3:// checkpoint, materialised for rollout
    from pipeline.stages.rollout import resolve_adapter
    from pipeline.studies.evaluate import open_eval_run
    from pipeline.studies.report import build_report

    ev = open_eval_run(f"s3://{bucket}/runs", "s3run", 1)
    assert ev.cfg.generator.adapter == f"s3://{bucket}/runs/s3run/round=1/checkpoint" and st.read_config(ev.run_id)
    path, _ = resolve_adapter(ev)
    assert json.loads((Path(path) / "adapter_config.json").read_text())["tag"].startswith("round1-")
    assert str(build_report(st, "s3run")) == f"s3://{bucket}/runs/s3run/report.html"
    assert "<h1>Run s3run</h1>" in (st.run_dir("s3run") / "report.html").read_text()


# ---- one writer per stage on an s3:// store -----------------------------------------------------------------

HOLD_S3_LEASE = """
import sys
from pipeline.store import Store
with Store(sys.argv[1]).lease("r", "round-0.score", "r 0 score"):
    print("held", flush=True)
    sys.stdin.read()  # until killed
"""


def test_s3_lease_is_a_conditional_put_refused_to_a_second_holder_and_deleted_on_release(bucket):
    from pipeline.store import LeaseHeld

    st = Store(f"s3://{bucket}/pre")
    with st.lease("r", "round-0.score", "run 'r' round 0 score") as held:
        assert _keys(bucket) == ["pre/r/_leases/round-0.score.json"]
        with pytest.raises(LeaseHeld, match=rf"run 'r' round 0 score is being written by another process: pid "
                                            rf"{os.getpid()} on host .* \(lease s3://{bucket}/pre/r/_leases/"), \
                Store(f"s3://{bucket}/pre").lease("r", "round-0.score", "run 'r' round 0 score"):
            pass
        with st.lease("r", "round-1.score", "another round"):  # other names are free
            pass
        assert held.etag
    assert _keys(bucket) == [], "released: the lease object is gone"
    with st.lease("r", "round-0.score", "again"):
        pass


def test_s3_lease_of_a_killed_holder_is_renewed_while_it_lives_and_taken_over_once_it_expires(bucket, monkeypatch,
                                                                                               tmp_path):
    """A holder process (ttl 3 s, heartbeat every 1 s) is refused to run_stage while it lives; after its kill -9 the
    lease is no longer renewed, and run_stage with wait=True takes it over once it expired and runs the stage once."""
    import subprocess
    import sys

    import boto3
    from conftest import wait_until

    from pipeline.run import open_run
    from pipeline.stages.runner import StageError, run_stage

    monkeypatch.setenv("PIPELINE_LEASE_TTL_S", "3")
    root = f"s3://{bucket}/pre"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: r\nrounds: 1\nstore:\n  root: {root}\nscoring:\n  reps: 1\n")
    open_run(cfg, "r")
    Fakes().install(monkeypatch).rollout(open_run(None, "r", 0, store_root=root))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_S3_LEASE, root], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        s3, key = boto3.client("s3"), "pre/r/_leases/round-0.score.json"
        first = s3.head_object(Bucket=bucket, Key=key)["ETag"]
        with pytest.raises(StageError, match=f"round 0 score: run 'r' round 0 score is being written by another "
                                             f"process: pid {holder.pid}") as e:
            run_stage("score", "r", 0, root)
        assert not e.value.transient and Store(root).read("scores", "r", 0).height == 0
        wait_until(lambda: s3.head_object(Bucket=bucket, Key=key)["ETag"] != first, 60, "no heartbeat renewed it")
    finally:
        holder.kill()
        holder.wait()
    res = run_stage("score", "r", 0, root, wait=True)  # waits out the ttl, then takes the lease over
    assert not res.skipped and res.counts == {"scored": 8}
    assert Store(root).read("scores", "r", 0).height == 8 and Store(root).manifest("r", 0, "score")
    assert not [k for k in _keys(bucket) if "/_leases/" in k], "released after the stage"


REPO = Path(__file__).resolve().parents[1]
