import os
import warnings

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.run import open_run
from pipeline.store import CorruptPartWarning, Store, StoreError
from pipeline.store.store import views_for


def _score(gen, rep, attempt, status, score):
    return {"gen_id": gen, "query_id": "q", "rep": rep, "attempt": attempt, "status": status, "score": score}


def test_write_is_immutable_parts_with_round_partition(tmp_path):
    st = Store(tmp_path)
    p1 = st.write("generations", [{"gen_id": "a", "kind": "workflow", "token_ids": [1, 2]}], "r1", 0)
    p2 = st.write("generations", [{"gen_id": "b", "kind": "agent"}], "r1", 1)
    assert p1 != p2 and p1.parent == tmp_path / "r1" / "round=0" / "generations"
    assert not list(tmp_path.rglob("*.tmp")), "temp files must be renamed away"
    df = st.read("generations", "r1").sort("gen_id")
    assert df["gen_id"].to_list() == ["a", "b"] and df["round"].to_list() == [0, 1]
    assert df["run_id"].to_list() == ["r1", "r1"] and df["token_ids"][0].to_list() == [1, 2]
    assert st.read("generations", "r1", round=1)["gen_id"].to_list() == ["b"]


def test_unknown_column_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown columns"):
        Store(tmp_path).write("scores", [{"gen_id": "a", "bogus": 1}], "r", 0)


def test_empty_store_views_have_schema(tmp_path):
    st = Store(tmp_path)
    assert st.sql("select count(*) as n from generations")["n"][0] == 0
    assert "round" in st.sql("select * from latest_scores").columns
    assert st.read("scores", "r").height == 0


def test_latest_scores_takes_last_attempt(tmp_path):
    st = Store(tmp_path)
    st.write("scores", [_score("a", 0, 0, "executor_error", 0.0), _score("b", 0, 0, "ok", 1.0)], "r", 0)
    st.write("scores", [_score("a", 0, 1, "ok", 0.5)], "r", 0)
    df = st.sql("select gen_id, attempt, status, score from latest_scores order by gen_id")
    assert df.rows() == [("a", 1, "ok", 0.5), ("b", 0, "ok", 1.0)]


def test_a_query_makes_only_the_views_it_reads():
    # latest_scores reads scores; generation_scores reads generations and latest_scores (so scores too)
    assert views_for("SELECT * FROM Generations WHERE run_id = 'r'") == {"generations"}
    assert views_for("select * from latest_scores") == {"latest_scores", "scores"}
    assert views_for("select g.gen_id from generation_scores g") == {"generation_scores", "generations",
                                                                       "latest_scores", "scores"}
    assert views_for("select count(*) from executor_cache") == {"executor_cache"}
    # the catalog itself, or no view named: every view
    assert views_for("show tables") is None and views_for("describe scores") is None
    assert views_for("select 1") is None


def test_a_query_sees_its_views_and_the_catalog_all_of_them(tmp_path):
    st = Store(tmp_path)
    st.write("scores", [_score("a", 0, 0, "ok", 1.0)], "r", 0)
    assert st.sql("select count(*) as n from latest_scores")["n"][0] == 1
    con = st.connect(views_for("select * from latest_scores"))
    made = {r[0] for r in con.execute("select view_name from duckdb_views() where not internal").fetchall()}
    con.close()
    assert made == {"latest_scores", "scores"}
    names = set(st.sql("show tables")["name"])
    assert {"generations", "generation_scores", "query_usage", "executor_cache", "grader_cache"} <= names


def test_catalog_opens_read_only_in_duckdb(tmp_path):
    st = Store(tmp_path)
    st.write("generations", [{"gen_id": "a", "kind": "workflow"}], "r", 0)
    path = st.refresh_catalog()
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("select count(*) from generations").fetchone()[0] == 1
    # parts written after the refresh are visible through the glob views
    st.write("generations", [{"gen_id": "b", "kind": "workflow"}], "r", 0)
    assert con.execute("select count(*) from generations").fetchone()[0] == 2
    con.close()
    assert st.refresh_catalog() == path  # rebuilt in place while nobody holds it
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("select gen_id from generations order by 1").fetchall() == [("a",), ("b",)]
    con.close()


def test_corrupt_part_is_named_skipped_and_kept(tmp_path):
    st = Store(tmp_path)
    st.write("generations", [{"gen_id": "a", "kind": "workflow"}], "r", 0)
    bad = st.write("generations", [{"gen_id": "b", "kind": "workflow"}], "r", 0)
    bad.write_bytes(b"PAR1 this is not parquet")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fresh = Store(tmp_path)
        assert fresh.read("generations", "r")["gen_id"].to_list() == ["a"]
        assert fresh.sql("select gen_id from generations")["gen_id"].to_list() == ["a"]
        fresh.refresh_catalog()
    assert any(issubclass(x.category, CorruptPartWarning) and str(bad) in str(x.message) for x in w)
    assert bad.exists(), "corrupt parts are never deleted"
    assert fresh.corrupt_parts() == [bad]


def test_manifest_roundtrip(tmp_path):
    st = Store(tmp_path)
    assert st.manifest("r", 0, "rollout") is None
    st.write_manifest("r", 0, "rollout", "abc", rows=3)
    m = st.manifest("r", 0, "rollout")
    assert m["config_hash"] == "abc" and m["counts"] == {"rows": 3}


def test_manifests_parts_and_their_folders_are_fsynced(tmp_path, monkeypatch):
    """Power loss: the manifest's bytes, its `_done` folder (the rename) and the round folder (a new `_done`) are
    fsynced, and so is a part's folder before any manifest can cover it; a cleared manifest's folder too."""
    synced: list[tuple[int, int]] = []  # (device, inode) of each fsynced file or folder
    real = os.fsync

    def spy(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real(fd)
    monkeypatch.setattr(os, "fsync", spy)

    def ident(p):
        st = os.stat(p)
        return (st.st_dev, st.st_ino)
    st = Store(tmp_path)
    part = st.write("scores", [{"gen_id": "g", "status": "ok"}], "r", 0)
    assert {ident(part), ident(part.parent)} <= set(synced)
    synced.clear()
    st.write_manifest("r", 0, "score", "abc", rows=1)
    done = st.round_dir("r", 0) / "_done"
    assert {ident(done / "score.json"), ident(done), ident(done.parent)} <= set(synced)
    synced.clear()
    st.clear_manifest("r", 0, "score")
    assert synced == [ident(done)] and st.manifest("r", 0, "score") is None


def test_schema_types_survive(tmp_path):
    st = Store(tmp_path)
    p = st.write("groups", [{"group_id": "g", "members": ["a", "b"], "advantages": [1.0, -1.0],
                             "kl_mask": [True, False], "kept": True}], "r", 2)
    sch = pq.read_schema(p)
    assert str(sch.field("kl_mask").type) == "list<element: bool>"
    df = st.read("groups", "r")
    assert df.schema["advantages"] == pl.List(pl.Float64) and df["round"][0] == 2


def test_open_run_freezes_config_and_refuses_changes(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: x\nstore:\n  root: {tmp_path / 'store'}\nrollout:\n  m: 4\n")
    ctx = open_run(cfg, round=0, sets=["rollout.m=6"])
    assert ctx.cfg.rollout.m == 6 and (tmp_path / "store" / "x" / "config.yaml").is_file()
    # the saved config is the default for an existing run id
    again = open_run(None, run_id="x", round=1, store_root=str(tmp_path / "store"))
    assert again.cfg.rollout.m == 6 and again.frozen_hash == ctx.frozen_hash
    # a per-invocation --set applies without changing the frozen hash
    o = open_run(None, run_id="x", sets=["executor.timeout_s=5"], store_root=str(tmp_path / "store"))
    assert o.cfg.executor.timeout_s == 5 and o.frozen_hash == ctx.frozen_hash
    with pytest.raises(ConfigError, match="differs in: rollout.m"):
        open_run(cfg, round=0)
    # the same CONFIG with the --set it was started with reopens the run
    assert open_run(cfg, round=1, sets=["rollout.m=6"]).frozen_hash == ctx.frozen_hash
    # ... and with one more --set, for this invocation only
    more = open_run(cfg, round=1, sets=["rollout.m=6", "executor.timeout_s=5"])
    assert more.cfg.executor.timeout_s == 5 and more.cfg.rollout.m == 6 and more.frozen_hash == ctx.frozen_hash
    # a --set that changes what a default is derived from: the CONFIG derives scoring.concurrency anew from
    # executor.kind=openai (executor.concurrency, 32), the run keeps the 2 it saved; that is no change of the CONFIG
    down = ["rollout.m=6", "executor.kind=openai", "executor.base_url=http://127.0.0.1:9/v1"]
    assert load_config(cfg, down).scoring.concurrency == 32
    moved = open_run(cfg, round=1, sets=down)
    assert (moved.cfg.executor.kind, moved.cfg.scoring.concurrency, moved.frozen_hash) == ("openai", 2, ctx.frozen_hash)
    cfg.write_text(cfg.read_text().replace("m: 4", "m: 4\n  n_agents: 3"))  # a change no --set covers is refused
    with pytest.raises(ConfigError, match="differs in: rollout.n_agents"):
        open_run(cfg, round=1, sets=["rollout.m=6", "executor.timeout_s=5"])
    with pytest.raises(ConfigError, match="not found"):
        open_run(None, run_id="nope", store_root=str(tmp_path / "store"))


def test_stage_done_tracks_config_hash(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: x\nstore:\n  root: {tmp_path}\n")
    ctx = open_run(cfg)
    assert not ctx.done("rollout")
    ctx.finish("rollout", rows=0)
    assert ctx.done("rollout") and (tmp_path / "catalog.duckdb").is_file()
    assert not ctx.at_round(1).done("rollout")


def test_set_store_root_places_a_new_run(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run_id: x\nstore:\n  root: {tmp_path / 'yaml-root'}\n")
    ctx = open_run(cfg, sets=[f"store.root={tmp_path / 'set-root'}"])
    assert ctx.store.root == tmp_path / "set-root" and (tmp_path / "set-root" / "x" / "config.yaml").is_file()
    assert not (tmp_path / "yaml-root").exists()


def test_generation_scores_view_is_the_one_score_definition(tmp_path):
    """Hand-computed: the mean over reps of the latest attempts; invalid counts 0; transient runs are left out
    of the mean and make the state transient; missing reps leave it unscored."""
    st = Store(tmp_path)
    st.write("generations", [
        {"gen_id": "a", "kind": "workflow", "query_id": "q", "slot": 0, "valid": True},
        {"gen_id": "b", "kind": "workflow", "query_id": "q", "slot": 1, "valid": True},
        {"gen_id": "c", "kind": "workflow", "query_id": "q", "slot": 2, "valid": False},  # never scored: 0
        {"gen_id": "d", "kind": "workflow", "query_id": "q", "slot": 3, "valid": True},
        {"gen_id": "e", "kind": "workflow", "query_id": "q", "slot": 4, "valid": True},
    ], "r", 0)
    st.write("scores", [
        {"gen_id": "a", "rep": 0, "attempt": 0, "status": "executor_error", "score": 0.0},
        {"gen_id": "a", "rep": 0, "attempt": 1, "status": "ok", "score": 0.9},  # the latest attempt counts
        {"gen_id": "a", "rep": 1, "attempt": 0, "status": "ok", "score": 0.3},
        {"gen_id": "b", "rep": 0, "attempt": 0, "status": "ok", "score": 0.8},
        {"gen_id": "b", "rep": 1, "attempt": 0, "status": "executor_error", "score": 0.1},
        {"gen_id": "d", "rep": 0, "attempt": 0, "status": "invalid", "score": 0.7},
        {"gen_id": "d", "rep": 1, "attempt": 0, "status": "timeout", "score": None},
        {"gen_id": "e", "rep": 0, "attempt": 0, "status": "ok", "score": 1.0},
    ], "r", 0)
    rows = {r["gen_id"]: r for r in st.generation_scores("r", 0, reps=2, transient={"executor_error"}).to_dicts()}
    assert [g for g in rows] == ["a", "b", "c", "d", "e"]  # ordered by slot
    assert rows["a"]["score"] == pytest.approx(0.6) and rows["a"]["state"] == "ok"
    assert rows["b"]["score"] == pytest.approx(0.8) and rows["b"]["transient_runs"] == 1
    assert rows["b"]["state"] == "transient"
    assert rows["c"]["score"] == 0.0 and rows["c"]["state"] == "ok" and rows["c"]["reps_scored"] == 0
    assert rows["d"]["score"] == 0.0 and rows["d"]["timeout_runs"] == 1 and rows["d"]["state"] == "ok"
    assert rows["e"]["score"] == 1.0 and rows["e"]["state"] == "unscored"
    # timeouts are transient only where configured (scoring.retry_timeouts)
    again = st.generation_scores("r", 0, reps=2, transient={"executor_error", "timeout"})
    assert dict(zip(again["gen_id"], again["state"], strict=True))["d"] == "transient"
    # the same view in plain SQL, for users
    assert st.sql("select score from generation_scores where gen_id = 'a'")["score"][0] == pytest.approx(0.6)


def test_discard_unfinished_removes_only_the_named_tables_and_the_checkpoint(tmp_path):
    st = Store(tmp_path)
    st.write("groups", [{"group_id": "g"}], "r", 0)
    st.write("groups", [{"group_id": "g"}], "r", 1)  # another round: kept
    st.write("train_metrics", [{"step": 0}], "r", 0)
    st.checkpoint_dir("r", 0).mkdir(parents=True)
    assert st.discard_unfinished("r", 0, ["groups"]) == 1
    assert st.parts("groups", "r", 0) == [] and len(st.parts("groups", "r", 1)) == 1
    assert len(st.parts("train_metrics", "r", 0)) == 1 and st.checkpoint_dir("r", 0).is_dir()
    assert st.discard_unfinished("r", 0, ["train_metrics"], checkpoint=True) == 1
    assert not st.checkpoint_dir("r", 0).exists()


def test_a_query_scoped_to_a_run_reads_that_runs_parts_alone(tmp_path):
    st = Store(tmp_path)
    st.write("scores", [_score("a", 0, 0, "ok", 1.0), _score("b", 0, 0, "ok", 0.0)], "r1", 0)
    st.write("scores", [_score("c", 0, 0, "ok", 0.5)], "r2", 1)
    everything = "SELECT run_id, count(*) AS n FROM latest_scores GROUP BY run_id ORDER BY run_id"
    assert st.sql(everything).rows() == [("r1", 2), ("r2", 1)]
    assert st.sql(everything, run="r2").rows() == [("r2", 1)]  # no filter in the query: the views hold r2's rows
    assert st.sql(everything, run="r3").rows() == []  # a run with no parts: the empty typed views
    with pytest.raises(StoreError, match="not a run folder's name"):
        st.sql(everything, run="r1/../*")
