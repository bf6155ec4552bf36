import hashlib
import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, apply_overrides, config_from_dict, diff_configs, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("name", "run_id"), [("demo.yaml", "demo"), ("smoke.yaml", "smoke"), ("learn.yaml", "learn"),
                                              ("spogw-humaneval.yaml", "spogw-humaneval"),
                                              ("two-level.yaml", "two-level"), ("refine.yaml", "refine"),
                                              ("humaneval-served.yaml", "humaneval-served"),
                                              ("gsm-served.yaml", "gsm-served"),
                                              ("humaneval-learn.yaml", "he-learn-lr1e-4"),
                                              ("gsm-learn.yaml", "gsm-learn")])
def test_shipped_configs_validate(name, run_id):
    assert load_config(ROOT / "configs" / name).run_id == run_id


def test_paper_settings():
    cfg = load_config(ROOT / "configs" / "spogw-humaneval.yaml")
    assert (cfg.rollout.m, cfg.curation.n, cfg.curation.t, cfg.training.beta, cfg.rounds) == (16, 14, 4, 0.1, 3)
    assert cfg.generator.model == "Qwen/Qwen2.5-7B-Instruct"
    assert (cfg.executor.model, cfg.executor.temperature) == ("gpt-4o-mini-2024-07-18", 0.0)  # the pinned snapshot
    assert cfg.rollout.exemplars == "none"  # SPOGW prompts carry no exemplars
    assert (cfg.curation.top_n, cfg.scoring.reps, cfg.training.reference, cfg.training.kl_mask) == (100, 3, "previous",
                                                                                                    True)


def test_paper_config_says_where_every_value_comes_from():
    """Each value of the SPOGW config is marked "paper §x" (stated by the paper, in that section) or "ours"."""
    import re

    lines = (ROOT / "configs" / "spogw-humaneval.yaml").read_text().splitlines()
    values = [ln for ln in lines if re.match(r"^\s*[a-z_]+:\s*[^\s#]", ln)]
    assert len(values) >= 40
    for ln in values:
        assert re.search(r"#\s*(paper §\d(\.\d)?(-\d\.\d)?\b|ours\b)", ln), f"unmarked value: {ln!r}"
    marks, path = {}, []
    for ln in lines:
        if m := re.match(r"^( *)([a-z_]+):", ln):
            path = path[: len(m.group(1)) // 2] + [m.group(2)]
            if "#" in ln and ln in values:
                marks[".".join(path)] = ln.split("#", 1)[1].strip()
    # values the paper does not give are ours, not "paper settings"
    for key in ("training.clip_eps", "training.lr", "training.lora_r", "training.lora_alpha", "training.epochs",
                "generator.temperature", "generator.max_new_tokens", "scoring.timeout_s"):
        assert marks[key].startswith("ours"), key
    for key in ("rollout.m", "curation.n", "curation.t", "training.beta", "curation.top_n", "scoring.reps",
                "executor.model", "executor.temperature", "generator.model", "rounds"):
        assert marks[key].startswith("paper §"), key


def test_exemplars_names_and_legacy_booleans(tmp_path):
    assert RunConfig().rollout.exemplars == "buckets"
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  exemplars: none\n")
    assert load_config(p).rollout.exemplars == "none"
    assert load_config(p, ["rollout.exemplars=buckets"]).rollout.exemplars == "buckets"
    # configs frozen while the field was a bool: true showed bucket exemplars, false none
    p.write_text("rollout:\n  exemplars: true\n")
    assert load_config(p).rollout.exemplars == "buckets"
    p.write_text("rollout:\n  exemplars: false\n")
    assert load_config(p).rollout.exemplars == "none"
    p.write_text("rollout:\n  exemplars: random\n")
    with pytest.raises(ConfigError, match=r"rollout\.exemplars: .*'none' or 'buckets'.*'random'"):
        load_config(p)
    # a run frozen with `exemplars: false` (and the then defaults, saved with every field: lora_dropout 0.05, fp32
    # weights, no bf16 autocast) keeps its config hash: sha256 of its one non-default field, as before
    legacy = hashlib.sha256(json.dumps({"rollout": {"exemplars": False}}, sort_keys=True).encode()).hexdigest()[:16]
    frozen = {"rollout": {"exemplars": False}, "training": {"lora_dropout": 0.05, "bf16": False},
              "executor": {"concurrency": 8}, "generator": {"dtype": "float32"},
              "benchmark": {"one_split_per_text": False}}
    assert RunConfig.model_validate(frozen).config_hash() == legacy



def test_config_hash_of_runs_frozen_before_the_lora_dropout_default_changed():
    """lora_dropout's default went from 0.05 to 0: runs frozen before keep their hash (manifests stay valid)."""
    def sha(body: dict) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    # a frozen config holds every field: executor.concurrency at its default of then, 8 (moved to 32 later), fp32
    # weights and no bf16 autocast (both `auto` later), splits by item id alone (one_split_per_text, true later)
    then = {"executor": {"concurrency": 8}, "generator": {"dtype": "float32"},
            "benchmark": {"one_split_per_text": False}}
    assert RunConfig.model_validate({"training": {"lora_dropout": 0.05, "bf16": False},
                                     **then}).config_hash() == sha({})
    assert RunConfig.model_validate({"training": {"lora_dropout": 0.0, "bf16": False}, **then}).config_hash() == sha(
        {"training": {"lora_dropout": 0.0}})
    assert RunConfig.model_validate({"training": {"lora_dropout": 0.0, "lr": 0.1, "bf16": False},
                                     **then}).config_hash() == sha({"training": {"lora_dropout": 0.0, "lr": 0.1}})
    # a served executor frozen at the then default bf16 hashes without it; `auto`, now the default, is a change
    served = {"kind": "openai", "model": "m", "concurrency": 8}
    old = {"training": {"lora_dropout": 0.05, "bf16": False}, "generator": {"dtype": "float32"},
           "scoring": {"concurrency": 2}, "benchmark": {"one_split_per_text": False}}
    assert RunConfig.model_validate({**old, "executor": {**served, "serve": {"dtype": "bfloat16"}}}).config_hash() \
        == sha({"executor": {"kind": "openai", "model": "m", "serve": {}}})
    assert RunConfig.model_validate({**old, "executor": {**served, "serve": {"dtype": "auto"}}}).config_hash() \
        == sha({"executor": {"kind": "openai", "model": "m", "serve": {"dtype": "auto"}}})


def test_demo_and_smoke_are_embedded():
    for name in ("demo.yaml", "smoke.yaml", "learn.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.generator.model.startswith("embedded:") and cfg.executor.kind == "local"
    assert load_config(ROOT / "configs" / "smoke.yaml").generator.backend == "transformers"
    two = load_config(ROOT / "configs" / "two-level.yaml")
    assert two.rollout.mode == "two_level" and two.generator.model.startswith("embedded:")
    assert (two.curation.agent_adv_stats, two.training.two_level.agent_weight, two.training.two_level.agent_kl_mask) \
        == ("workflows", 1.0, False)  # the proposal's advantages, loss weights and unmasked KL
    demo, learn = load_config(ROOT / "configs" / "demo.yaml"), load_config(ROOT / "configs" / "learn.yaml")
    assert demo.experiment.seeds == [0] and learn.experiment.seeds == [0, 1, 2]  # docs/learning.md: 3 seeds


def test_malformed_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run_id: x\nrollout:\n  m: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: malformed YAML"):
        load_config(p)


def test_unknown_field_names_path(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  mm: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "c.yaml" in str(e.value) and "rollout.mm: unknown field" in str(e.value)


def test_wrong_type_names_path_and_value(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("training:\n  beta: lots\n")
    with pytest.raises(ConfigError, match=r"training\.beta: .*'lots'"):
        load_config(p)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/x.yaml")


def test_sharpening_constraint(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("curation:\n  n: 8\n  t: 4\n")
    with pytest.raises(ConfigError, match="2\\*t < n"):
        load_config(p)


def test_set_overrides_typed_and_nested(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  m: 4\n")
    cfg = load_config(p, ["rollout.m=8", "training.kl_mask=false", "benchmark.tasks=[chain_sum]",
                          "executor.base_url=http://127.0.0.1:8000/v1"])
    assert cfg.rollout.m == 8 and cfg.training.kl_mask is False
    assert cfg.benchmark.tasks == ["chain_sum"] and cfg.executor.base_url == "http://127.0.0.1:8000/v1"
    with pytest.raises(ConfigError, match="rollout.nope: unknown field"):
        load_config(p, ["rollout.nope=1"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides({}, ["rollout.m"])


def test_set_with_an_empty_value_is_the_empty_string_never_null(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  workflow_prefix: '```python'\n")
    assert apply_overrides({"a": {"b": 1}}, ["a.b="]) == {"a": {"b": ""}}
    assert load_config(p, ["rollout.workflow_prefix="]).rollout.workflow_prefix == ""  # not null, not left as it was
    assert load_config(p, ["generator.adapter=null"]).generator.adapter is None  # null only when asked for by name
    with pytest.raises(ConfigError, match="rollout.m: .*got ''"):  # a number field says what it got
        load_config(p, ["rollout.m="])


def test_served_sections_are_checked(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("executor:\n  kind: openai\n  model: embedded:smollm2-135m-instruct\n  serve: {dtype: float32}\n")
    cfg = load_config(p)
    assert cfg.executor.serve.dtype == "float32" and cfg.executor.serve.max_model_len == 2048
    with pytest.raises(ConfigError, match="executor.serve needs executor.kind: openai"):
        load_config(p, ["executor.kind=local"])
    with pytest.raises(ConfigError, match="leave executor.base_url and executor.endpoints unset"):
        load_config(p, ["executor.base_url=http://127.0.0.1:8000/v1"])
    with pytest.raises(ConfigError, match="executor.serve.gpus: unknown field"):
        load_config(p, ["executor.serve.gpus=2"])
    with pytest.raises(ConfigError, match="generator.serve needs generator.backend: openai"):
        load_config(p, ["generator.serve={}"])
    assert load_config(p, ["generator.backend=openai", "generator.serve={}"]).generator.serve.port is None


def test_diff_and_hash():
    a, b = RunConfig(), RunConfig()
    assert diff_configs(a, b) == [] and a.config_hash() == b.config_hash()
    b.rollout.m = 3
    assert diff_configs(a, b) == ["rollout.m"] and a.config_hash() != b.config_hash()
    # which references an experiment runs, and whether its seeds share the base evaluation, change no run: a run
    # frozen without them resumes with them (and the reverse)
    b.experiment.references, b.experiment.shared_base, b.experiment.eval_l = ["io"], True, 2
    assert diff_configs(a, b) == ["experiment.eval_l", "rollout.m"]


def test_config_hash_ignores_defaults_and_the_experiment_section():
    """Manifests carry the config hash. A field added to the schema later (at its default) must not invalidate a
    finished run's manifests, nor must a change of evaluation plans (experiment.*); any other change must."""
    from pipeline.config import config_from_dict

    base = config_from_dict({"run_id": "r"})
    assert config_from_dict({"run_id": "r", "rollout": {"m": 16}}).config_hash() == base.config_hash()  # default
    assert config_from_dict({"run_id": "r", "experiment": {"eval_l": 9}}).config_hash() == base.config_hash()
    assert config_from_dict({"run_id": "r", "rollout": {"m": 8}}).config_hash() != base.config_hash()
    assert config_from_dict({"run_id": "r", "training": {"lr": 2e-5}}).config_hash() != base.config_hash()


def test_objective_names_come_from_the_registry(tmp_path, monkeypatch):
    from pipeline.core import objectives

    p = tmp_path / "c.yaml"
    p.write_text("run_id: x\ntraining:\n  objective: my_loss\n")
    with pytest.raises(ConfigError, match=r"training\.objective.*unknown objective 'my_loss'.*iogrpo_mkl"):
        load_config(p)
    # a newly registered objective validates with no change to the config module
    monkeypatch.setitem(objectives.OBJECTIVES, "my_loss", objectives.OBJECTIVES["rwr"])
    assert load_config(p).training.objective == "my_loss"


def test_a_config_validates_its_objective_without_importing_torch(tmp_path):
    """Opening a config (every CLI and stage process does) reads the built-in objectives' names from the registry's
    source; they are the registry's own, in its order."""
    import subprocess
    import sys

    from pipeline.config import builtin_objectives
    from pipeline.core.objectives import OBJECTIVES

    assert builtin_objectives() == tuple(OBJECTIVES) == ("iogrpo_mkl", "grpo", "rwr", "sft_best", "score_dpo")
    p = tmp_path / "c.yaml"
    p.write_text("run_id: x\ntraining:\n  objective: score_dpo\n")
    code = ("import sys; from pipeline.config import load_config, ConfigError\n"
            f"assert load_config({str(p)!r}).training.objective == 'score_dpo'\n"
            "try:\n    load_config(sys.argv[1])\nexcept ConfigError as e:\n    print(e)\n"
            "print('torch' in sys.modules, 'pipeline.core.objectives' in sys.modules)\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_id: x\ntraining:\n  objective: ppo\n")
    out = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, check=True).stdout
    assert "unknown objective 'ppo'; registered: iogrpo_mkl, grpo, rwr, sft_best, score_dpo" in out
    assert out.strip().endswith("False False")


def test_the_studies_status_and_summaries_import_no_torch():
    """`experiment --status` and `compare-methods --status` were 13 s here, 5 of them torch's import."""
    import subprocess
    import sys

    code = ("import sys, pipeline.studies.experiment, pipeline.studies.methods, pipeline.studies.report\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_rollout_modes_a_config_accepts_are_the_registered_ones():
    from typing import get_args

    from pipeline.config import RolloutConfig
    from pipeline.stages.modes import MODES

    assert set(get_args(RolloutConfig.model_fields["mode"].annotation)) == set(MODES) == {"flat", "two_level", "refine"}


def test_concurrency_defaults_follow_the_executor_and_keep_the_hash_of_runs_saved_before():
    served = {"kind": "openai", "base_url": "http://x/v1"}
    assert config_from_dict({"executor": served}).scoring.concurrency == 32  # as many workflows as requests
    assert config_from_dict({}).scoring.concurrency == 2  # the in-process executor
    assert config_from_dict({"executor": served, "scoring": {"concurrency": 5}}).scoring.concurrency == 5
    # a config saved before the defaults moved holds the old ones (executor 8, scoring 2; fp32 weights and no bf16
    # autocast before `auto`): its hash, by the code of commit c668463, must not move, or every finished stage of
    # that run would run again
    old = {"executor": {"concurrency": 8}, "scoring": {"concurrency": 2}, "generator": {"dtype": "float32"},
           "training": {"bf16": False}, "benchmark": {"one_split_per_text": False}}
    assert config_from_dict(old).config_hash() == "3f5ee1602261f17c"
    assert config_from_dict({**old, "executor": {**served, **old["executor"]}}).config_hash() == "e269505f6e2a1030"


def test_rollout_old_logprobs_need_the_models_own_distribution(tmp_path):
    """Stored log-probs are of the sampling distribution: at temperature 0.7 they are not π_old's."""
    assert load_config(ROOT / "configs" / "learn.yaml", ["training.old_logprobs=rollout"]).training.old_logprobs == \
        "rollout"  # learn.yaml samples at temperature 1, top_p 1
    for bad in ("generator.temperature=0.7", "generator.top_p=0.9"):
        with pytest.raises(ConfigError,
                           match="training.old_logprobs: rollout needs generator.temperature 1 and top_p 1"):
            load_config(ROOT / "configs" / "learn.yaml", ["training.old_logprobs=rollout", bad])


def test_the_config_reference_in_docs_matches_the_models():
    """docs/config.md is generated from the models (pipeline.config.config_reference): every field, under its
    section's heading, with its default and help. Regenerate with
    python -c "from pipeline.config import config_reference as r; open('docs/config.md', 'w').write(r())"."""
    from pathlib import Path

    from pipeline.config import config_reference

    text = config_reference()
    assert (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text() == text
    assert "| `training.lr_schedule` | `\"constant\"` |" in text and "## scoring.reward.judge" in text
    assert "| `scoring.reward.judge.model` | (required) |" in text


def test_a_typed_variant_crosses_a_process_boundary_as_the_same_values():
    """A study's variant as a typed copy (`with_changes`) and as the `--set` text a child process gets (`as_sets`):
    the text reads back as the same config, a float a float, the string "true" a string, null null."""
    from pipeline.config import as_sets, variant_sets, with_changes

    base = load_config("configs/smoke.yaml")
    changes = {"training.lr": 1e-5, "rounds": 1, "generator.seed": 3, "training.objective": "grpo",
               "benchmark.tasks": ["chain_sum"], "experiment.eval_queries": None, "run_id": "true"}
    variant = with_changes(base, changes)
    assert (variant.training.lr, variant.rounds, variant.experiment.eval_queries, variant.run_id) == (1e-5, 1, None,
                                                                                                      "true")
    assert base.training.lr != 1e-5 and base.run_id != "true"  # a copy: the base is untouched
    assert as_sets({"training.lr": 1e-5, "run_id": "true", "experiment.eval_queries": None}) == [
        "training.lr=1.0e-05", "run_id='true'", "experiment.eval_queries=null"]
    assert load_config("configs/smoke.yaml", as_sets(changes)) == variant
    with pytest.raises(ConfigError, match="lr"):
        with_changes(base, {"training.lr": "fast"})
    # at a boundary the variant's text sits between the user's text it changes and the user's text that wins
    text = variant_sets({"training.lr": 2e-4, "rounds": 1}, before=["rounds=5"], after=["training.lr=1e-3"])
    assert text == ["rounds=5", "training.lr=0.0002", "rounds=1", "training.lr=1e-3"]
    assert (load_config("configs/smoke.yaml", text).training.lr, load_config("configs/smoke.yaml", text).rounds) == (
        1e-3, 1)
    assert variant_sets(None) == [] and variant_sets({}, after=["rounds=2"]) == ["rounds=2"]
