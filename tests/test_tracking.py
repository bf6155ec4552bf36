"""`tracking: [tensorboard]`: event files read back with TensorBoard's own reader and checked against the store."""

from __future__ import annotations

import sys

import pytest
from fake_run import install_fake_stages, write_config

from pipeline.config import ConfigError, RunConfig, config_from_dict
from pipeline.stages.rounds import direct_call, run_rounds
from pipeline.stages.runner import RetryPolicy
from pipeline.store import Store
from pipeline.studies.tracking import TRACKERS, TrackingError, check_trackers, evaluate_tracked, sync_run

pytest.importorskip("tensorboard", reason="tensorboard is a dependency: pip install -e .")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def read_events(folder) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(folder))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two fake rounds, then the base model and round 1's checkpoint evaluated on the test split. Shared: a test
    that rewrites the events leaves them as they were."""
    tmp_path = tmp_path_factory.mktemp("tracking")
    with pytest.MonkeyPatch.context() as mp:
        install_fake_stages(mp)
        call = direct_call(RetryPolicy(delay_s=0), isolate=False)
        run_rounds(write_config(tmp_path), None, "t", call, observer=TRACKERS)
        st = Store(tmp_path / "runs")
        for k in (-1, 1):
            evaluate_tracked(str(st.root), "t", k, "test", ["benchmark.max_queries=2"], call)
    return st


def test_events_match_the_store(run):
    tb = run.run_dir("t") / "tensorboard"
    ev = read_events(tb)
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    # per optimiser step, counted on over rounds: 3 steps a round -> steps 0..5
    rows = run.sql("SELECT loss, kl, clip_frac, grad_norm, lr, ratio_dev, pg_loss, tokens, wall_s FROM train_metrics "
                   "WHERE run_id = 't' ORDER BY round, step").to_dicts()
    assert len(rows) == 6
    for col in ("loss", "kl", "clip_frac", "grad_norm", "lr", "ratio_dev", "pg_loss"):
        assert ev[f"train/{col}"] == [(i, pytest.approx(r[col], rel=1e-6)) for i, r in enumerate(rows)], col
    assert ev["train/tokens_per_s"] == [(i, pytest.approx(r["tokens"] / r["wall_s"])) for i, r in enumerate(rows)]
    # per round: 3 of 4 workflows valid; latest runs ok 2, timeout 1, invalid 1
    assert ev["round/valid_share"] == [(0, 0.75), (1, 0.75)]
    assert ev["round/status/ok"] == [(0, 0.5), (1, 0.5)] and ev["round/status/timeout"] == [(0, 0.25), (1, 0.25)]
    means = run.sql("SELECT round, avg(score) AS m FROM generation_scores WHERE run_id = 't' GROUP BY round "
                    "ORDER BY round").rows()
    assert ev["round/mean_score"] == [(k, pytest.approx(m)) for k, m in means]
    assert [v for _, v in ev["round/mean_score"]] == [pytest.approx(0.5 / 4), pytest.approx(1.0 / 4)]
    assert ev["round/groups_kept"] == [(0, 1.0), (1, 1.0)]
    # held out, x = rounds trained: the base model at 0, round 1's checkpoint at 2. Per query: q0 = (g0, g1),
    # q1 = (g2 timeout, g3 invalid): base Mean@L (0.25 + 0) / 2, Best@L (0.5 + 0) / 2; trained 1.0 for g0
    assert ev["heldout/test/mean_at_l"] == [(0, 0.125), (2, 0.25)]
    assert ev["heldout/test/best_at_l"] == [(0, 0.25), (2, 0.5)]
    assert [s for s, _ in ev["heldout/test/majority_at_l"]] == [0, 2]


def test_resync_replaces_rather_than_repeats(run):
    before = read_events(run.run_dir("t") / "tensorboard")
    assert sync_run(run, "t") == {"tensorboard": str(run.run_dir("t") / "tensorboard")}
    after = read_events(run.run_dir("t") / "tensorboard")
    assert after == before and len(after["train/loss"]) == 6
    assert [p.name for p in run.run_dir("t").iterdir() if p.name.startswith(".tensorboard")] == []


def test_tracking_off_writes_no_events(tmp_path, monkeypatch):
    install_fake_stages(monkeypatch)
    run_rounds(write_config(tmp_path, "tracking: []\n", rounds=1), None, "t",
               direct_call(RetryPolicy(delay_s=0), isolate=False), observer=TRACKERS)
    assert not (tmp_path / "runs" / "t" / "tensorboard").exists()


def test_tracking_config_names():
    assert RunConfig().tracking == ["tensorboard"]
    assert config_from_dict({"tracking": "none"}).tracking == []
    assert config_from_dict({"tracking": "tensorboard"}).tracking == ["tensorboard"]
    with pytest.raises(ConfigError, match="tracking"):
        config_from_dict({"tracking": ["wandb"]})
    # trackers only copy figures out of the store: switching them re-runs no finished stage
    assert config_from_dict({"tracking": []}).config_hash() == RunConfig().config_hash()


def test_missing_tracker_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import fails as if it were not installed
    with pytest.raises(TrackingError, match=r"tracking: \[tensorboard\] needs the tensorboard package"):
        check_trackers(["tensorboard"])


def test_mlflow_run_matches_the_events(run):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed: pip install -e \".[mlflow]\"")
    from mlflow.tracking import MlflowClient

    for _ in range(2):  # the second sync replaces the first MLflow run
        out = sync_run(run, "t", ["mlflow"])
    client = MlflowClient(tracking_uri=out["mlflow"])
    runs = client.search_runs([client.get_experiment_by_name("workflow-grpo").experiment_id])
    assert [r.info.run_name for r in runs] == ["t"]
    ev = read_events(run.run_dir("t") / "tensorboard")
    for tag in ("train/loss", "round/valid_share", "heldout/test/mean_at_l"):
        got = [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, tag)]
        assert sorted(got) == [(s, pytest.approx(v, rel=1e-6)) for s, v in ev[tag]], tag


def test_track_command_rewrites_and_names_an_unknown_run(run):
    import shutil

    from typer.testing import CliRunner

    from pipeline.cli import app

    shutil.rmtree(run.run_dir("t") / "tensorboard")
    res = CliRunner().invoke(app, ["track", "t", "--store", str(run.root)])
    assert res.exit_code == 0 and f"tensorboard: {run.run_dir('t') / 'tensorboard'}" in res.output
    assert len(read_events(run.run_dir("t") / "tensorboard")["train/loss"]) == 6
    res = CliRunner().invoke(app, ["track", "nope", "--store", str(run.root)])
    assert res.exit_code != 0 and "run 'nope' not found" in res.output
