"""Kept adapters: an experiment keeps each seed's last-round LoRA adapter apart from its checkpoint
(`<store>/adapters/<seed run>-r<k>/`, which a store kept in git commits), and `pipeline evaluate-adapter` evaluates
such a folder alone on new problems. The stages are stand-ins (no rollout, no scoring) whose train stage saves a real
LoRA adapter of the tiny random llama, beside a file the keep step must leave out; the rollout writes the benchmark's
queries of its split, so the queries an evaluation drew are read back from the store."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import shutil
import zlib
from pathlib import Path

import pytest
import yaml
from test_stale_rounds import score_all
from typer.testing import CliRunner

from pipeline import stages
from pipeline.cli import app
from pipeline.config import RunConfig, config_from_dict
from pipeline.engines.benchmarks import load_benchmark
from pipeline.stages.rounds import direct_call
from pipeline.stages.runner import RetryPolicy
from pipeline.store import ADAPTER_FILES, ADAPTER_WEIGHTS, CATALOG, KEPT_CONFIG, KEPT_SOURCE, Store, StoreError
from pipeline.studies.experiment import keep_adapter, run_experiment
from pipeline.studies.summaries import ExperimentSummary

KEPT = sorted([*ADAPTER_FILES, KEPT_CONFIG, KEPT_SOURCE, "README.md"])
LEFT_OUT = "optimizer.pt"  # what a checkpoint folder may hold beside the adapter: never kept
# sums of 3-4 digit numbers: a question drawn twice by chance is out of reach (1-digit sums repeat)
TASK = "chain_sum:min_digits=3,max_digits=4"


def save_lora(model: str, dest: Path, seed: int):
    """A LoRA adapter of `model` with random B weights (so that it changes the logits), saved as the train stage saves
    one (pipeline.engines.models.save_adapter: its base named as the config names it)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from pipeline.engines.models import load_causal_lm, save_adapter

    torch.manual_seed(seed)
    lora = get_peft_model(load_causal_lm(model, device="cpu"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    save_adapter(lora, dest, model)
    return lora


def kept_folder(root: str | Path, model: str, save) -> str:
    """Seed 0's one round of an experiment `e` on `model`, its checkpoint saved by `save(folder)`, kept as the
    experiment keeps it (keep_adapter); returns the kept folder. The vLLM tests serve it (tests/test_vllm.py)."""
    cfg = RunConfig(run_id="e", rounds=1, store={"root": str(root)}, generator={"model": model})
    store = Store(root)
    store.put_text(store.run_dir("e-s0") / "config.yaml", cfg.model_copy(update={"run_id": "e-s0"}).to_yaml())
    save(store.checkpoint_dir("e-s0", 0))
    keep_adapter(store, cfg, 0)
    return str(store.adapter_dir("e-s0", 0))


def make_stage(stage: str, model: str):
    def fn(ctx, only_failed=False):
        if stage == "rollout":  # the split's first two queries, each sampled once by the policy named in `text`
            items = load_benchmark(ctx.cfg.benchmark).items()[:2]
            ctx.store.write("queries", [{"query_id": it.id, "split": ctx.cfg.benchmark.train_split,
                                         "prompt": it.prompt} for it in items], ctx.run_id, ctx.round)
            ctx.store.write("generations", [{"gen_id": f"g{i}", "kind": "workflow", "query_id": it.id, "slot": 0,
                                             "valid": True, "text": ctx.cfg.generator.adapter or "base"}
                                            for i, it in enumerate(items)], ctx.run_id, ctx.round)
        if stage == "score":
            score_all(ctx)
        if stage == "train":
            def save(d: Path) -> None:
                save_lora(model, d, zlib.crc32(f"{ctx.run_id}:{ctx.round}".encode()))
                (d / LEFT_OUT).write_bytes(b"optimiser state")
            ctx.store.publish_checkpoint(save, ctx.run_id, ctx.round)
        ctx.finish(stage, rows=1)
        return {"rows": 1}
    return fn


@pytest.fixture
def lora_stages(monkeypatch, tiny_model):
    """Every stage a stand-in, in this process; the train stage saves a LoRA adapter of the tiny model. The catalog
    file for the `duckdb` CLI is not rebuilt (nothing here reads it)."""
    monkeypatch.setattr(Store, "refresh_catalog", lambda self: self.root / CATALOG)
    for name, st in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, dataclasses.replace(st, fn=make_stage(name, tiny_model),
                                                                     isolated=False))
    return tiny_model


def write_config(tmp_path: Path, model: str, seeds=(0, 1)) -> Path:
    cfg = {"run_id": "e", "rounds": 2, "store": {"root": str(tmp_path / "runs")}, "tracking": [],
           "generator": {"model": model}, "benchmark": {"name": "procedural", "tasks": [TASK], "size": 20},
           "experiment": {"seeds": list(seeds), "eval_queries": 2, "eval_l": 1, "bootstrap": 50}}
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_half_of(kept: Path, ckpt: Path) -> None:
    """The kept weights are the checkpoint's rounded to float16, every tensor, at half the bytes."""
    import numpy as np
    from safetensors.numpy import load_file

    want, got = load_file(ckpt), load_file(kept)
    assert sorted(got) == sorted(want) and all(w.dtype == np.float32 for w in want.values())
    for name, w in want.items():
        assert got[name].dtype == np.float16 and np.array_equal(got[name], w.astype(np.float16)), name
    assert 2 * sum(g.nbytes for g in got.values()) == sum(w.nbytes for w in want.values())


def files(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (inode, mtime): what a rewrite would change."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_the_experiment_keeps_each_seeds_last_adapter_alone_and_rewrites_nothing_on_resume(tmp_path, lora_stages):
    path, call = write_config(tmp_path, lora_stages), direct_call(RetryPolicy(delay_s=0))
    store = Store(tmp_path / "runs")
    out = run_experiment(path, call)
    for seed in (0, 1):
        run = f"e-s{seed}"
        kept, ckpt = store.adapter_dir(run, 1), store.checkpoint_dir(run, 1)
        assert kept == store.root / "adapters" / f"{run}-r1"
        assert LEFT_OUT in {p.name for p in ckpt.iterdir()}  # the checkpoint holds more than the adapter
        assert sorted(p.name for p in kept.iterdir()) == KEPT
        assert (kept / "adapter_config.json").read_bytes() == (ckpt / "adapter_config.json").read_bytes()
        assert_half_of(kept / ADAPTER_WEIGHTS, ckpt / ADAPTER_WEIGHTS)
        assert (kept / KEPT_CONFIG).read_bytes() == (store.run_dir(run) / "config.yaml").read_bytes()
        # the digest of the fp32 weights it was made from (Store.restore_checkpoint matches it to the manifest's)
        digest = hashlib.sha256((ckpt / ADAPTER_WEIGHTS).read_bytes()).hexdigest()
        assert (kept / KEPT_SOURCE).read_text() == digest + "\n"
        readme = (kept / "README.md").read_text()
        assert f"round 1, the last of 2,\nof run `{run}` trained: seed {seed} of the experiment `e`" in readme
        assert f"base model is `{lora_stages}`" in readme
        assert f"    pipeline evaluate-adapter {kept} --set benchmark.split_seed=20\n" in readme  # 0 + size
        assert (f"    python -m vllm.entrypoints.openai.api_server --model <the base model's folder> \\\n"
                f"        --enable-lora --max-lora-rank 16 --lora-modules {kept.name}={kept}\n") in readme  # lora_r 16
        assert not store.adapter_dir(run, 0).exists()  # the last round only
    assert [(a.seed, a.run_id, a.round, a.folder) for a in out.adapters] == [
        (0, "e-s0", 1, "adapters/e-s0-r1"), (1, "e-s1", 1, "adapters/e-s1-r1")]
    assert out.adapters[0].mb == pytest.approx(sum(p.stat().st_size for p in kept.parent.glob("e-s0-r1/*")) / 1e6,
                                               abs=0.01)
    stored = ExperimentSummary.read(Path(out.results) / "experiment.json")
    assert [a.folder for a in stored.adapters] == ["adapters/e-s0-r1", "adapters/e-s1-r1"]
    assert stored.headline()[-1].startswith("seed 1: round 1's adapter kept in adapters/e-s1-r1 (")

    # resumed: every seed finished, so none is re-entered; the keep step runs again and rewrites nothing
    before = {s: files(store.adapter_dir(f"e-s{s}", 1)) for s in (0, 1)}
    run_experiment(path, call)
    cfg = config_from_dict(yaml.safe_load(path.read_text()))
    keep_adapter(store, cfg, 0)
    assert {s: files(store.adapter_dir(f"e-s{s}", 1)) for s in (0, 1)} == before

    # a checkpoint trained again (new weights) replaces the kept copy, whole
    ckpt = store.checkpoint_dir("e-s0", 1)
    save_lora(lora_stages, ckpt, seed=99)
    keep_adapter(store, cfg, 0)
    kept = store.adapter_dir("e-s0", 1)
    assert_half_of(kept / ADAPTER_WEIGHTS, ckpt / ADAPTER_WEIGHTS)
    assert sorted(p.name for p in kept.iterdir()) == KEPT and not list(kept.parent.glob(".*"))


def test_nothing_is_kept_without_a_checkpoint_or_on_object_storage(tmp_path, caplog):
    cfg = RunConfig(run_id="e", rounds=1)
    assert keep_adapter(Store(tmp_path), cfg, 0) is None and not (tmp_path / "adapters").exists()
    s3 = Store("s3://bucket/pre")
    with caplog.at_level("INFO", "pipeline.studies.experiment"):
        assert keep_adapter(s3, cfg, 0) is None
    assert "s3:// store keeps its adapter as round 0's checkpoint only" in caplog.text
    with pytest.raises(StoreError, match="s3:// store"):
        s3.keep_adapter("e-s0", 0, {})
    with pytest.raises(StoreError, match="no complete checkpoint"):
        Store(tmp_path).keep_adapter("e-s0", 0, {})


def test_a_kept_adapter_moved_to_a_fresh_clone_loads_in_peft_with_the_same_logits(tmp_path, monkeypatch):
    """The base named by its portable id (the embedded model), the store named relative to the working folder as a
    committed store is: nothing in the folder names this machine's model cache or folders, and peft loads the folder
    from wherever it lies."""
    import torch
    from peft import PeftModel

    from pipeline.engines.models import cache_dir, load_causal_lm

    model = "embedded:smollm2-135m-instruct"
    monkeypatch.chdir(tmp_path)
    saved = []
    kept = kept_folder("runs", model, lambda d: saved.append(save_lora(model, d, seed=3)))
    trained = saved[0].eval()

    clone = tmp_path / "elsewhere" / "e-s0-r0"
    shutil.copytree(kept, clone)
    shutil.rmtree(tmp_path / "runs")
    for f in clone.iterdir():
        text = f.read_bytes().decode(errors="replace")
        assert str(cache_dir()) not in text and str(tmp_path) not in text, f.name
    base = json.loads((clone / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == model and "    pipeline evaluate-adapter runs/adapters/e-s0-r0 " in (clone / "README.md").read_text()

    loaded = PeftModel.from_pretrained(load_causal_lm(base, device="cpu"), str(clone)).eval()
    ids = torch.tensor([[1, 42, 314, 1000, 7]])
    with torch.no_grad():
        with trained.disable_adapter():
            plain = trained(ids).logits
        for name, p in trained.named_parameters():  # the kept weights are the trained ones rounded to float16
            if "lora_" in name:
                p.copy_(p.half().float())
        want, got = trained(ids).logits, loaded(ids).logits
    assert torch.equal(got, want) and not torch.allclose(want, plain)  # the adapter's, not the base model's


def test_evaluate_adapter_runs_the_readmes_command_on_new_problems(tmp_path, monkeypatch, lora_stages):
    """The README's command, as written: a run of its own whose queries are none of the experiment's questions
    (a split_seed `size` further on draws other problems), sampled with the kept folder; without --set, the
    experiment's own test queries again; the same command again reopens the same run."""
    path = write_config(tmp_path, lora_stages, seeds=(0,))
    run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    kept = Store(tmp_path / "runs").adapter_dir("e-s0", 1)
    command = next(line.strip() for line in (kept / "README.md").read_text().splitlines()
                   if line.strip().startswith("pipeline evaluate-adapter"))
    monkeypatch.chdir(tmp_path)  # the default store, data/runs, is the working folder's

    def queries(run_id: str, root: Path = tmp_path / "data" / "runs") -> dict[str, str]:
        df = Store(root).read("queries", run_id, 0)
        return dict(zip(df["query_id"], df["prompt"], strict=True))

    res = CliRunner().invoke(app, shlex.split(command)[1:])
    assert res.exit_code == 0, res.output
    eid = res.stdout.split(":", 1)[0]
    assert eid.startswith("e-s0-r1-eval-") and "2 queries, Mean@L 1.000" in res.output
    new, held_out = queries(eid), queries("e-s0-eval-r1", tmp_path / "runs")
    assert len(new) == len(held_out) == 2
    assert not set(new) & set(held_out)
    drawn = load_benchmark(config_from_dict(yaml.safe_load(path.read_text())).benchmark).load()  # every split
    assert not set(new.values()) & {it.prompt for it in drawn}
    run = config_from_dict(yaml.safe_load((tmp_path / "data" / "runs" / eid / "config.yaml").read_text()))
    assert (run.generator.adapter, run.benchmark.split_seed, run.benchmark.train_split, run.rounds) == (
        str(kept), 20, "test", 1)
    gens = Store(tmp_path / "data" / "runs").read("generations", eid, 0)
    assert set(gens["text"]) == {str(kept)}  # sampled with the kept folder

    again = CliRunner().invoke(app, shlex.split(command)[1:])
    assert again.exit_code == 0 and again.stdout.split(":", 1)[0] == eid
    assert Store(tmp_path / "data" / "runs").read("generations", eid, 0).height == 2  # reopened, nothing redone

    same = CliRunner().invoke(app, ["evaluate-adapter", str(kept)])
    assert same.exit_code == 0 and same.stdout.startswith("e-s0-r1-eval: 2 queries")
    assert queries("e-s0-r1-eval") == held_out


def test_evaluate_adapter_refuses_what_it_cannot_evaluate(tmp_path, lora_stages):
    path = write_config(tmp_path, lora_stages, seeds=(0,))
    run_experiment(path, direct_call(RetryPolicy(delay_s=0)))
    kept = Store(tmp_path / "runs").adapter_dir("e-s0", 1)

    def refused(folder: Path, *args: str) -> str:
        res = CliRunner().invoke(app, ["evaluate-adapter", str(folder), "--store", str(tmp_path / "evals"), *args])
        assert res.exit_code == 2
        return " ".join(res.output.split())

    assert "not a kept adapter folder (no config.yaml)" in refused(Store(tmp_path / "runs").checkpoint_dir("e-s0", 1))
    lost = tmp_path / "lost"
    shutil.copytree(kept, lost)
    (lost / "adapter_config.json").unlink()
    assert "not a kept adapter folder (no adapter_config.json)" in refused(lost)
    moved = tmp_path / "moved"
    shutil.copytree(kept, moved)
    (moved / KEPT_CONFIG).write_text((kept / KEPT_CONFIG).read_text().replace(lora_stages, "/nowhere/tiny-llama"))
    assert "its base model '/nowhere/tiny-llama' cannot be loaded here" in refused(moved)
    assert "ask a question run e-s0 trained on: not new problems" in refused(kept, "--split", "validate")
    # a split_seed one further on: reasoning-gym draws item i with the seed + i, so the same questions under new ids
    msg = refused(kept, "--set", "benchmark.split_seed=1", "--set", "benchmark.max_queries=null")
    assert "ask a question run e-s0 trained on" in msg and "--set benchmark.split_seed=20" in msg
    assert not (tmp_path / "evals").exists() or not any((tmp_path / "evals").iterdir())  # nothing frozen


def test_weights_that_are_not_safetensors_are_kept_as_trained_with_a_warning(tmp_path, caplog):
    cfg = RunConfig(run_id="e", rounds=1, store={"root": str(tmp_path)})
    store = Store(tmp_path)
    store.put_text(store.run_dir("e-s0") / "config.yaml", cfg.model_copy(update={"run_id": "e-s0"}).to_yaml())
    ckpt = store.checkpoint_dir("e-s0", 0)
    ckpt.mkdir(parents=True)
    for f in ADAPTER_FILES:
        (ckpt / f).write_text("{}")
    with caplog.at_level("WARNING", "pipeline.studies.experiment"):
        kept = keep_adapter(store, cfg, 0)
    assert (tmp_path / kept.folder / ADAPTER_WEIGHTS).read_text() == "{}"
    assert f"{ckpt / ADAPTER_WEIGHTS}: not a safetensors file (2 bytes)" in caplog.text
    assert "kept as it is" in caplog.text
