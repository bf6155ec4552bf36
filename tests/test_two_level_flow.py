"""The two-level demo configuration (configs/two-level.yaml): one real round of every stage on the embedded model.

The stages run in this process (`pipeline run`'s path): that the same stages run through the Prefect `iterate`
flow in child processes is tests/test_flows.py::test_one_real_round_end_to_end's check, and the Prefect start and
four child processes (each importing torch and loading the model) cost two minutes here for nothing more."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.stages.rounds import direct_call, run_rounds
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_level_config_runs_a_round_of_every_stage(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "two-level.yaml").read_text())
    data["store"] = {"root": str(tmp_path / "runs")}
    # shorter samples than the demo's (every one of which runs to its cap: 48-token plans, 64-token workflows): a
    # decode step costs the same whatever the text, and nothing below depends on what the plans or workflows say
    # (a plan is valid when not empty; an invalid workflow is still scored, 0, curated and trained on)
    data["rollout"]["max_plan_tokens"] = 16
    data["generator"]["max_new_tokens"] = 32
    cfg = tmp_path / "two-level.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = run_rounds(cfg, 1, "tl", direct_call(isolate=False))
    st = Store(tmp_path / "runs")
    for stage in ("rollout", "score", "curate", "train"):
        assert st.manifest("tl", 0, stage) is not None, stage
    gens = st.read("generations", "tl", 0)
    agents, wfs = gens.filter(gens["kind"] == "agent"), gens.filter(gens["kind"] == "workflow")
    assert agents.height == 2 * 2 and wfs.height == 2 * 2 * 2  # 2 queries x N_A plans x N_W workflows
    plan_query = dict(zip(agents["gen_id"], agents["query_id"], strict=True))
    assert all(plan_query[p] == q for p, q in zip(wfs["parent_id"], wfs["query_id"], strict=True))
    assert all("Plan to follow:" in p for p in wfs["prompt_text"])
    groups = st.read("groups", "tl", 0).filter("kept")
    assert set(groups["level"]) == {"agent", "workflow"}
    metrics = st.read("train_metrics", "tl", 0).sort("step")
    # π_θ = π_old before the first update: the same computation (same micro-batches, eval = train mode, no dropout)
    assert metrics.height > 0 and metrics["ratio_dev"][0] <= 1e-6 and metrics["clip_frac"][0] == 0.0
    assert (st.checkpoint_dir("tl", 0) / "adapter_config.json").is_file()
    assert out.rounds[0].mean_score is not None
