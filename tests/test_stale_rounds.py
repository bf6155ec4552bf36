"""Lost weights: a store cloned from git keeps the manifests and tables but no checkpoints, so a round whose train
stage had finished trains again with new weights. The rounds and evaluations made from the lost weights are then
moved aside (`<run>/stale/<stamp>/`, out of every view) and run again, instead of being reused: training round k+1
on samples the new checkpoint k never drew would make its importance ratios and KL wrong. Fake stages, no model:
each checkpoint holds a token, and rollout writes the token of the weights it sampled with."""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from pipeline import stages
from pipeline.engines.benchmarks import load_benchmark
from pipeline.stages.rounds import direct_call, run_rounds
from pipeline.stages.runner import RetryPolicy
from pipeline.store import ADAPTER_FILES, CATALOG, KEPT_SOURCE, Store, StoreError, round_stats, weights_sha256

WEIGHTS = "adapter_model.safetensors"  # the fake checkpoint's token is this file's text


def policy(ctx) -> str:
    """The token of the weights this rollout samples with: checkpoint k-1 in a training run, the adapter in an
    evaluation run, else the base model."""
    if ctx.cfg.generator.adapter:
        return (Path(ctx.cfg.generator.adapter) / WEIGHTS).read_text()
    if ctx.round > 0:
        return (ctx.store.checkpoint_dir(ctx.run_id, ctx.round - 1) / WEIGHTS).read_text()
    return "base"


def score_all(ctx) -> None:
    """The stand-in score stage: every generation of the round scored 1, answer "1"."""
    gens = ctx.store.read("generations", ctx.run_id, ctx.round)
    ctx.store.write("scores", [{"gen_id": g, "query_id": q, "rep": 0, "attempt": 0, "status": "ok", "score": 1.0,
                                "answer": "1"} for g, q in zip(gens["gen_id"], gens["query_id"], strict=True)],
                    ctx.run_id, ctx.round)


def make_stage(calls: list, stage: str):
    def fn(ctx, only_failed=False):
        calls.append((ctx.run_id, stage, ctx.round))
        if stage == "rollout":
            items = load_benchmark(ctx.cfg.benchmark).items()[:2]
            ctx.store.write("generations", [{"gen_id": f"g{i}", "kind": "workflow", "query_id": it.id, "slot": 0,
                                             "valid": True, "text": policy(ctx)} for i, it in enumerate(items)],
                            ctx.run_id, ctx.round)
        if stage == "score":
            score_all(ctx)
        counts = {}
        if stage == "train":  # a complete checkpoint, as Stage.done checks for the real one, named in the manifest
            ckpt = ctx.store.checkpoint_dir(ctx.run_id, ctx.round)
            ckpt.mkdir(parents=True)
            for f in ADAPTER_FILES:
                (ckpt / f).write_text(uuid.uuid4().hex if f == WEIGHTS else "{}")
            counts["weights_sha256"] = weights_sha256(ckpt)
        ctx.finish(stage, rows=1, **counts)
        return {"rows": 1}
    return fn


@pytest.fixture
def calls(monkeypatch) -> list:
    """Every stage faked in process (train keeps its checkpoint check); returns the (run, stage, round) calls. The
    `duckdb` CLI's catalog file, which `finish` rebuilds after every stage (tested in tests/test_store.py and
    tests/test_cli.py), is not rebuilt: nothing here reads it (`Store.sql` makes its own views)."""
    monkeypatch.setattr(Store, "refresh_catalog", lambda self: self.root / CATALOG)
    made: list = []
    for name, st in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=make_stage(made, name), isolated=False,
                                                                     checkpoint=name == "train"))
    return made


def write_config(tmp_path: Path, run_id: str, rounds: int = 2) -> Path:
    cfg = {"run_id": run_id, "rounds": rounds, "store": {"root": str(tmp_path / "runs")}, "tracking": [],
           "benchmark": {"name": "procedural", "tasks": ["chain_sum"], "size": 20},
           "experiment": {"seeds": [0], "eval_queries": 2, "eval_l": 1, "bootstrap": 50,
                          "eval_rounds": "all"}}
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def token(store: Store, run_id: str, round: int) -> str:
    return (store.checkpoint_dir(run_id, round) / WEIGHTS).read_text()


def texts(store: Store, run_id: str, round: int) -> list[str]:
    """What the views show of a round's samples: the token of each generation's weights."""
    df = store.sql("SELECT text FROM generations WHERE run_id = $run AND round = $round ORDER BY gen_id",
                   {"run": run_id, "round": round})
    return df["text"].to_list()


def stale(store: Store, run_id: str) -> list[str]:
    """What was set aside under the run, as `<name>` of each `stale/<stamp>/<name>`."""
    return sorted(p.name for p in store.run_dir(run_id).glob("stale/*/*"))


def test_rounds_made_from_lost_weights_are_set_aside_and_run_again(tmp_path, calls):
    """Round 0 trained, round 1's rollout done, then checkpoint 0 lost (a fresh clone): round 0 trains again, and
    round 1 samples again with the new weights instead of keeping samples of the lost ones."""
    path, call = write_config(tmp_path, "r"), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")
    run_rounds(path, 1, "r", call)
    call(stage="rollout", run_id="r", round=1, store_root=str(store.root))
    old = token(store, "r", 0)
    assert texts(store, "r", 1) == [old, old]
    shutil.rmtree(store.checkpoint_dir("r", 0))
    calls.clear()

    run_rounds(path, 2, "r", call)
    assert [(s, k) for _, s, k in calls] == [("train", 0), ("rollout", 1), ("score", 1), ("curate", 1), ("train", 1)]
    new = token(store, "r", 0)
    assert new != old and texts(store, "r", 1) == [new, new], "round 1 sampled with the new checkpoint 0"
    # the old round 1 is kept whole, where no view reads it
    (moved,) = store.run_dir("r").glob("stale/*/round=1")
    assert (moved / "_done" / "rollout.json").is_file() and list((moved / "generations").glob("*.parquet"))
    assert store.sql("SELECT count(*) AS n FROM generations WHERE run_id = 'r'")["n"][0] == 4
    assert round_stats(store, "r")["workflows"].to_list() == [2, 2]

    # the last round's weights lost: it trains again, nothing after it to set aside
    shutil.rmtree(store.checkpoint_dir("r", 1))
    calls.clear()
    run_rounds(path, 2, "r", call)
    assert [(s, k) for _, s, k in calls] == [("train", 1)] and stale(store, "r") == ["round=1"]
    # weights intact: every stage skipped, nothing moved
    calls.clear()
    run_rounds(path, 2, "r", call)
    assert calls == [] and stale(store, "r") == ["round=1"]


def test_a_lost_round_not_run_now_moves_nothing(tmp_path, calls):
    """`--rounds 1` over a run whose round 1 lost its weights: round 1 is not trained again here, so round 2 stays."""
    path, call = write_config(tmp_path, "n", rounds=3), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")
    run_rounds(path, 3, "n", call)
    shutil.rmtree(store.checkpoint_dir("n", 1))
    calls.clear()
    run_rounds(path, 1, "n", call)
    assert calls == [] and stale(store, "n") == []


def test_a_finished_run_without_its_earlier_checkpoints_trains_nothing_again(tmp_path, calls):
    """A clone of a finished run keeps only its last round's weights (data/README.md): re-entering it (a methods
    comparison reusing a seed) trains nothing and moves nothing, as nothing left to run reads round 0's weights. One
    more round then starts from the last checkpoint; round 0 stays as it was."""
    path, call = write_config(tmp_path, "f", rounds=3), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")
    run_rounds(path, 2, "f", call)
    last = token(store, "f", 1)
    shutil.rmtree(store.checkpoint_dir("f", 0))
    calls.clear()
    run_rounds(path, 2, "f", call)
    assert calls == [] and stale(store, "f") == []
    run_rounds(path, 3, "f", call)
    assert [(s, k) for _, s, k in calls] == [(s, 2) for s in ("rollout", "score", "curate", "train")]
    assert texts(store, "f", 2) == [last, last] and stale(store, "f") == []
    assert not store.checkpoint_dir("f", 0).exists()


def test_an_s3_store_asks_for_the_move_by_hand():
    st = Store("s3://bucket/pre")
    with pytest.raises(StoreError, match=r"run r: lost; .*by hand.*s3://bucket/pre/r/round=1 -> "
                                         r"s3://bucket/pre/r/stale/\d{8}T\d{6}Z/round=1"):
        st.set_aside("r", [st.round_dir("r", 1)], "run r: lost")


def test_a_re_entered_seed_sets_aside_the_evaluations_of_its_lost_checkpoints(tmp_path, calls):
    """A seed cut short during its last evaluation, resumed on a fresh clone. With its last round's kept copy (what
    a finished seed keeps), that checkpoint comes back and only the evaluation's unfinished stage runs: round 0's
    lost weights are read by nothing left to run. Without it, its rounds retrain from round 0, and the evaluations
    of checkpoints 0 and 1 run again with the new weights; the base model's is kept. A seed whose every evaluation
    is in the store is still not re-entered without its weights."""
    from pipeline.studies.experiment import run_experiment

    path, call = write_config(tmp_path, "e"), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")
    run_experiment(path, call)
    kept = token(store, "e-s0", 1)

    def cut_and_clone() -> None:
        store.clear_manifest("e-s0-eval-r1", 0, "score")  # killed before its last evaluation finished
        for k in (0, 1):
            shutil.rmtree(store.checkpoint_dir("e-s0", k), ignore_errors=True)
        calls.clear()

    cut_and_clone()
    run_experiment(path, call)
    assert calls == [("e-s0-eval-r1", "score", 0)] and stale(store, "e-s0") == []
    assert token(store, "e-s0", 1) == kept and not store.checkpoint_dir("e-s0", 0).exists()

    cut_and_clone()
    shutil.rmtree(store.adapter_dir("e-s0", 1))
    out = run_experiment(path, call)
    assert sorted({(r, s, k) for r, s, k in calls}) == sorted(
        [("e-s0", "train", 0)] + [("e-s0", s, 1) for s in ("rollout", "score", "curate", "train")]
        + [(f"e-s0-eval-r{k}", s, 0) for k in (0, 1) for s in ("rollout", "score")])
    assert stale(store, "e-s0") == ["e-s0-eval-r0", "e-s0-eval-r1", "round=1"]
    assert texts(store, "e-s0-eval-r0", 0) == [token(store, "e-s0", 0)] * 2
    assert texts(store, "e-s0-eval-r1", 0) == [token(store, "e-s0", 1)] * 2
    assert [(a.round, a.queries) for a in out.arms] == [(-1, 2), (0, 2), (1, 2)]

    # finished now: without its weights again, not re-entered, nothing moved
    for k in (0, 1):
        shutil.rmtree(store.checkpoint_dir("e-s0", k))
    calls.clear()
    run_experiment(path, call)
    assert calls == [] and stale(store, "e-s0") == ["e-s0-eval-r0", "e-s0-eval-r1", "round=1"]


def test_a_store_cloned_mid_seed_restores_its_kept_checkpoints_and_trains_nothing_again(tmp_path, calls):
    """The experiment keeps each round's checkpoint as soon as it is trained. A store cut off mid-seed and cloned
    from git (adapters/ kept, checkpoint/ left out) restores both checkpoints from those copies: no round trains
    again, nothing is set aside, and the evaluations sample with the restored weights. Once the seed is evaluated
    only the last round's copy stays."""
    from pipeline.studies.experiment import run_experiment

    path, call = write_config(tmp_path, "c"), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")

    def cut(**kw):  # the machine ends before the base model's evaluation
        if kw["run_id"] == "c-s0-eval-base":
            raise RuntimeError("cut off")
        return call(**kw)

    with pytest.raises(RuntimeError, match="cut off"):
        run_experiment(path, cut)
    trained = {k: token(store, "c-s0", k) for k in (0, 1)}
    for k in (0, 1):
        assert (store.adapter_dir("c-s0", k) / WEIGHTS).read_text() == trained[k]
        shutil.rmtree(store.checkpoint_dir("c-s0", k))  # what git leaves out
    calls.clear()

    run_experiment(path, call)
    assert {s for _, s, _ in calls} == {"rollout", "score"} and {r for r, _, _ in calls} == {
        "c-s0-eval-base", "c-s0-eval-r0", "c-s0-eval-r1"}
    assert {k: token(store, "c-s0", k) for k in (0, 1)} == trained and stale(store, "c-s0") == []
    assert texts(store, "c-s0-eval-r1", 0) == [trained[1]] * 2
    assert not store.adapter_dir("c-s0", 0).exists() and store.adapter_dir("c-s0", 1).is_dir()


def test_a_kept_copy_of_other_weights_is_not_restored(tmp_path, calls, caplog):
    """A copy whose source digest is not the one the train manifest names (kept before the round trained again) is
    left alone: the round counts as lost and trains again."""
    path, call = write_config(tmp_path, "o", rounds=1), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")
    run_rounds(path, 1, "o", call)
    kept = store.adapter_dir("o", 0)
    shutil.copytree(store.checkpoint_dir("o", 0), kept)
    (kept / KEPT_SOURCE).write_text("0" * 64 + "\n")
    shutil.rmtree(store.checkpoint_dir("o", 0))
    calls.clear()
    with caplog.at_level("WARNING"):
        run_rounds(path, 1, "o", call)
    assert [(s, k) for _, s, k in calls] == [("train", 0)]
    assert "made from other weights than the train stage's manifest names; not restored" in caplog.text
    # a copy of the retrained weights with their digest is restored; without a train manifest naming one, not
    new = store.checkpoint_dir("o", 0)
    shutil.rmtree(kept)
    shutil.copytree(new, kept)
    (kept / KEPT_SOURCE).write_text(weights_sha256(new) + "\n")
    shutil.rmtree(new)
    assert store.restore_checkpoint("o", 0) and token(store, "o", 0) == (kept / WEIGHTS).read_text()
    shutil.rmtree(new)
    store.clear_manifest("o", 0, "train")
    assert not store.restore_checkpoint("o", 0) and not new.exists()


def test_a_methods_arm_cut_off_mid_seed_resumes_on_a_clone_from_its_kept_checkpoints(tmp_path, calls):
    """A trained arm of `compare-methods` keeps its checkpoints as the experiment's seeds do: cut off before its
    held-out evaluation and cloned from git, it restores both rounds' weights and trains nothing again; once
    evaluated, only its last round's copy stays (with the command that evaluates it)."""
    from pipeline.studies.methods import run_methods

    path, call = write_config(tmp_path, "m"), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")

    def cut(**kw):  # the machine ends before the arm's evaluation
        if kw["run_id"] == "m-scoreflow-s0-eval-r1":
            raise RuntimeError("cut off")
        return call(**kw)

    with pytest.raises(RuntimeError, match="cut off"):
        run_methods(path, cut, ["scoreflow"], seeds=1)
    trained = {k: token(store, "m-scoreflow-s0", k) for k in (0, 1)}
    for k in (0, 1):
        assert (store.adapter_dir("m-scoreflow-s0", k) / WEIGHTS).read_text() == trained[k]
        shutil.rmtree(store.checkpoint_dir("m-scoreflow-s0", k))  # what git leaves out
    calls.clear()

    run_methods(path, call, ["scoreflow"], seeds=1)
    assert calls == [("m-scoreflow-s0-eval-r1", s, 0) for s in ("rollout", "score")]
    assert texts(store, "m-scoreflow-s0-eval-r1", 0) == [trained[1]] * 2 and stale(store, "m-scoreflow-s0") == []
    assert not store.adapter_dir("m-scoreflow-s0", 0).exists()
    readme = (store.adapter_dir("m-scoreflow-s0", 1) / "README.md").read_text()
    assert "round 1, the last of 2,\nof run `m-scoreflow-s0`" in readme and "pipeline evaluate-adapter" in readme
