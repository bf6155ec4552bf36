"""Results in the Prefect UI: flows run on fake stages, their artifacts read back through Prefect's client and
checked against the store and the library's summaries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from fake_run import install_fake_stages, write_config
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from flows.ablate import ablate
from flows.artifacts import artifact_key
from flows.experiment import experiment
from flows.iterate import iterate
from pipeline.store import CATALOG, Store


@pytest.fixture(autouse=True)
def _no_catalog(monkeypatch):
    """The `duckdb` CLI's catalog file, which `finish` rebuilds after every stage (tested in tests/test_store.py and
    tests/test_cli.py), is not rebuilt: nothing here reads it (`Store.sql` makes its own views)."""
    monkeypatch.setattr(Store, "refresh_catalog", lambda self: self.root / CATALOG)


def artifacts_of(state) -> dict[str, object]:
    """key -> artifact of the flow run behind `state` and of its subflow runs (evaluate inside iterate)."""
    root = state.state_details.flow_run_id
    with get_client(sync_client=True) as c:
        runs = [root] + [r.id for r in c.read_flow_runs() if r.parent_task_run_id is not None
                         and c.read_task_run(r.parent_task_run_id).flow_run_id == root]
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=runs)))
    return {a.key: a for a in arts}


def linked_file(artifact) -> Path:
    """A link artifact is stored as Markdown `[text](link)`; its target here is a file:// URI."""
    m = re.fullmatch(r"\[.*\]\((file://.+)\)", artifact.data)
    assert m, artifact.data
    return Path(urlparse(m.group(1)).path)


def table(artifact) -> list[dict]:
    assert artifact.type == "table"
    return json.loads(artifact.data)


def test_key_is_what_prefect_accepts():
    assert artifact_key("Demo_2026.11", "round", 0) == "demo-2026-11-round-0"


def test_paired_rows_name_what_each_difference_pairs():
    """A round against the base model (experiment), an arm against another on another metric (compare-methods)."""
    from flows.artifacts import paired_rows
    from pipeline.studies.summaries import ArmDiff, RoundDiff

    interval = {"n": 4, "mean": 0.123456, "lo": -0.1, "hi": 0.3, "level": 0.95, "lo_by_query": -0.2}
    rows = paired_rows([RoundDiff(round=1, metric="best_at_l", base=0.25, trained=1 / 3, **interval),
                        ArmDiff(arm="two_level", against="spogw", metric="select_at_l", against_metric="mean_at_l",
                                **interval)])
    tail = {"difference": 0.1235, "lo": -0.1, "hi": 0.3, "lo (resampling queries)": -0.2,
            "hi (resampling queries)": None, "pairs": 4, "level": 0.95}
    assert rows == [{"round": 1, "metric": "Best@L", "base": 0.25, "trained": 0.3333, **tail},
                    {"arm": "two_level", "against": "spogw", "against_metric": "mean_at_l", "metric": "Sel@L",
                     **tail}]
    assert list(rows[0])[:4] == ["round", "metric", "base", "trained"]


def test_iterate_publishes_round_tables_evaluations_and_the_report(harness, tmp_path, monkeypatch):
    install_fake_stages(monkeypatch)
    state = iterate(str(write_config(tmp_path, rounds=1)), run_id="It_1", in_process=True, retry_delay_s=0,
                    evaluate_split="test", return_state=True)
    assert state.is_completed(), state.message
    arts = artifacts_of(state)
    assert {"it-1-round-0", "it-1-eval-r0", "it-1-report"} <= set(arts)
    r1 = {(x["stage"], x["figure"]): x["value"] for x in table(arts["it-1-round-0"])}
    st = Store(tmp_path / "runs")
    mean = st.sql("SELECT avg(score) FROM generation_scores WHERE run_id = 'It_1' AND round = 0").item()
    assert r1[("score", "mean score")] == pytest.approx(mean, abs=1e-4) and mean == 0.125
    assert r1[("rollout", "workflows")] == 4 and r1[("rollout", "valid share")] == 0.75
    assert r1[("score", "status of the latest runs")] == "invalid 1, ok 2, timeout 1"
    assert r1[("curate", "groups kept")] == 1 and r1[("train", "optimiser steps")] == 3
    assert r1[("train", "wall seconds")] is not None
    ev = {x["metric"]: x["value"] for x in table(arts["it-1-eval-r0"])}
    assert (ev["Mean@L"], ev["Best@L"], ev["valid share"]) == (0.25, 0.5, 0.75)
    assert linked_file(arts["it-1-report"]) == st.run_dir("It_1") / "report.html"
    assert linked_file(arts["it-1-report"]).is_file()


def test_experiment_publishes_paired_differences_and_the_report(harness, tmp_path, monkeypatch):
    install_fake_stages(monkeypatch)
    state = experiment(str(write_config(tmp_path, rounds=1)), run_id="x", return_state=True)
    assert state.is_completed(), state.message
    summary = json.loads((tmp_path / "runs" / "experiments" / "x" / "experiment.json").read_text())
    arts = artifacts_of(state)
    assert {"x-s0-round-0", "x-paired", "x-evaluations", "x-summary", "x-report"} <= set(arts)
    paired = table(arts["x-paired"])
    assert [(p["round"], p["metric"]) for p in paired] == [(0, "Mean@L"), (0, "Best@L"), (0, "Majority@L")]
    for row, p in zip(paired, summary["paired"], strict=True):
        assert (row["base"], row["trained"], row["difference"], row["lo"], row["hi"]) == pytest.approx(
            (p["base"], p["trained"], p["mean"], p["lo"], p["hi"]), abs=1e-4)
    assert paired[0]["difference"] == 0.125  # q0: 0.5 -> 1.0 on each of L=2 samples of g0/g1 averaged: +0.25 / 2
    evals = table(arts["x-evaluations"])
    assert [(e["seed"], e["round"], e["Mean@L"]) for e in evals] == [(0, "base", 0.125), (0, 0, 0.25)]
    assert "round 0 vs base, held-out Mean@L" in arts["x-summary"].data
    assert linked_file(arts["x-report"]) == tmp_path / "runs" / "experiments" / "x" / "report.html"


def test_ablate_publishes_its_table(harness, tmp_path, monkeypatch):
    install_fake_stages(monkeypatch)
    state = ablate(str(write_config(tmp_path, rounds=1)), objectives=["iogrpo_mkl", "grpo"], run_id="ab",
                   return_state=True)
    assert state.is_completed(), state.message
    arts = artifacts_of(state)
    rows = table(arts["ab-ablation-paired"])
    assert {(r["arm"], r["against"]) for r in rows} == {("iogrpo_mkl", "base"), ("grpo", "base"),
                                                        ("grpo", "iogrpo_mkl")}
    assert "| arm |" in arts["ab-ablation"].data
    assert linked_file(arts["ab-ablation-report"]).is_file()
