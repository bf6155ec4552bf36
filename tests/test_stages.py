"""The stage runner's contract (pipeline.stages): failure classes, retries, discards, options (the layering
rules are tests/test_layout.py's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.run import open_run
from pipeline.stages.runner import RetryPolicy, StageError, execute, is_transient, run_stage

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(f"run_id: t\nrounds: 1\nstore:\n  root: {tmp_path / 'runs'}\n")
    return p


def test_transient_is_decided_by_type_not_by_name():
    import httpx
    import openai

    class ConnectionError(Exception):  # noqa: A001 - same name as the builtin, unrelated type
        pass

    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert is_transient(openai.APIConnectionError(request=httpx.Request("GET", "http://x")))
    assert is_transient(httpx.ReadTimeout("slow"))
    assert not is_transient(ConnectionError("a lookalike")) and not is_transient(ValueError("bad config"))
    assert is_transient(StageError("score", 0, "work left", transient=True))
    assert not is_transient(StageError("train", 0, "bug", transient=False))


def test_a_collective_broken_by_a_dead_peer_is_transient_in_a_launched_stage_only(monkeypatch):
    # the message DDP's reducer raised on rank 0 when rank 1 was killed (torch 2.x, gloo)
    lost = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:29873: Connection reset by peer")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not is_transient(lost)  # one process: no peer to lose, a RuntimeError is a bug
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert is_transient(lost)
    assert not is_transient(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))  # a rank's own bug


def test_retry_policy_retries_transient_errors_only_and_prefect_gets_the_same_rule():
    calls = []

    def flaky(fail_with):
        calls.append(1)
        if len(calls) <= 2:
            raise fail_with
        return "ok"

    assert RetryPolicy(retries=2, delay_s=0).call(flaky, TimeoutError("slow")) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(TimeoutError):  # the third failure is the last attempt of retries=1
        RetryPolicy(retries=1, delay_s=0).call(flaky, TimeoutError("slow"))
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(ValueError):
        RetryPolicy(retries=5, delay_s=0).call(flaky, ValueError("permanent"))
    assert len(calls) == 1

    opts = RetryPolicy(retries=3, delay_s=7).prefect_options()
    assert (opts["retries"], opts["retry_delay_seconds"]) == (3, 7)

    class State:
        def __init__(self, data):
            self.data = data

    cond = opts["retry_condition_fn"]
    assert cond(None, None, State(StageError("s", 0, "x", transient=True)))
    assert not cond(None, None, State(StageError("s", 0, "x", transient=False)))
    assert not cond(None, None, State(KeyError("bug")))


def test_execute_discards_an_unfinished_attempt_then_reports_work_left(tmp_path):
    ctx = open_run(_config(tmp_path), "t")
    ctx.store.write("groups", [{"group_id": "stale"}], "t", 0)  # a crashed attempt's rows
    seen = []

    def curate_without_manifest(ctx):
        seen.append(ctx.store.read("groups", "t", 0).height)
        return {"groups": 0}

    st = dataclasses.replace(stages.STAGES["curate"], fn=curate_without_manifest)
    with pytest.raises(StageError, match="work left") as e:
        execute(ctx, st)
    assert seen == [0] and e.value.transient  # the stale part was gone before the stage ran

    def rollout_writes(ctx):
        ctx.store.write("generations", [{"gen_id": "g"}], "t", 0)
        ctx.finish("rollout", generations=1)
        return {"generations": 1}

    ctx.store.write("generations", [{"gen_id": "kept"}], "t", 0)  # rollout resumes its rows: nothing discarded
    assert execute(ctx, dataclasses.replace(stages.STAGES["rollout"], fn=rollout_writes)) == {"generations": 1}
    assert sorted(ctx.store.read("generations", "t", 0)["gen_id"]) == ["g", "kept"]


def test_train_is_done_only_with_a_whole_checkpoint(tmp_path):
    ctx = open_run(_config(tmp_path), "t")
    ctx.finish("train", steps=1)
    train = stages.STAGES["train"]
    assert not train.done(ctx)  # manifest without adapter files: a retry trains again
    ckpt = ctx.store.checkpoint_dir("t", 0)
    ckpt.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (ckpt / f).write_text("x")
    assert train.done(ctx)


def test_run_stage_refuses_unknown_stages_options_and_runs(tmp_path):
    open_run(_config(tmp_path), "t")
    root = str(tmp_path / "runs")
    with pytest.raises(ValueError, match="unknown stage 'eval'"):
        run_stage("eval", "t", 0, root)
    with pytest.raises(ValueError, match="no only_failed option"):
        run_stage("curate", "t", 0, root, only_failed=True)
    with pytest.raises(StageError, match="not found") as e:
        run_stage("curate", "nope", 0, root)
    assert not e.value.transient  # a missing run does not appear on a retry
