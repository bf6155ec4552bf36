"""The config hash over the `not_hashed` marks and the StudyConfig split (docs/design.md §9): every saved and shipped
config hashes as the code before them did (tests/data/config_hashes.json), what the hash and the resume check leave
out is what they left out then, and a field marked once is left out of both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
import yaml
from pydantic import Field

from pipeline.config import (
    DRAW_ONLY,
    NOT_HASHED_KINDS,
    PLAN_ONLY,
    ComputeConfig,
    NotHashed,
    RunConfig,
    StudyConfig,
    config_from_dict,
    diff_configs,
    load_config,
    not_hashed,
    not_hashed_paths,
    read_yaml,
)

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "data" / "config_hashes.json").read_text())["hashes"]


def test_the_recorded_hashes_cover_every_saved_and_shipped_config_of_then():
    """31 frozen configs under data/stores/ and the 13 shipped ones, as committed when the hashes were recorded."""
    assert sum(p.startswith("data/stores/") and p.endswith("/config.yaml") for p in RECORDED) == 31
    assert sum(p.startswith("configs/") for p in RECORDED) == 13
    assert {p for p in RECORDED if p.startswith("configs/")} <= {f"configs/{p.name}" for p in
                                                                 (ROOT / "configs").glob("*.yaml")}


@pytest.mark.parametrize("path", sorted(RECORDED))
def test_saved_and_shipped_configs_keep_the_hash_recorded_before_the_marks(path):
    """The hash the code of commit 212ca80 gave each config (its stage manifests hold it): a frozen one read as
    `open_run` reads it, a shipped one as `load_config` does."""
    file = ROOT / path
    assert file.is_file(), f"{path} is gone: drop it from tests/data/config_hashes.json"
    cfg = config_from_dict(yaml.safe_load(file.read_text()) or {}, path)
    assert cfg.config_hash() == RECORDED[path]
    assert load_config(file).config_hash() == RECORDED[path]


def _leaves(d: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in d.items():
        out |= _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


def test_what_is_not_hashed_is_what_the_lists_of_then_named():
    """The marks give the paths the hand-written lists gave before: the hash's `exclude` (experiment, tracking,
    headroom, training.save_steps and the draw fields) and the resume check's PLAN_ONLY and DRAW_ONLY; the routers
    (experiment.router) came later and are a plan of references like the others, and so is the success criterion
    (experiment.criterion: it reads the results, it computes none); the vLLM engines' prefix caching (a prompt's KV
    blocks reused rather than computed again, and the KV block they are reused in) later still, a draw like the
    executor's reply cache, and so are how many samples a generation call gathers (each prompt keeps its seed) and
    the served executor's n-gram speculation (a greedy reply's tokens proposed several a step); where a seed starts
    from, whose base evaluation it borrows and which references run on dev (start_from, base_from, select_references)
    later again, plans too."""
    assert not_hashed_paths() == {
        "generator.enable_prefix_caching": "draw", "generator.serve.enable_prefix_caching": "draw",
        "generator.block_size": "draw", "generator.call_samples": "draw",
        "executor.serve.enable_prefix_caching": "draw", "executor.serve.ngram_speculation": "draw",
        "generator.serve.ngram_speculation": "draw",
        "executor.common_random_numbers": "draw", "executor.seed": "draw", "executor.cache": "draw",
        "scoring.cache_verdicts": "draw", "training.save_steps": "plan", "experiment": "study",
        "experiment.references": "plan", "experiment.references_from": "plan", "experiment.select_split": "plan",
        "experiment.select_queries": "plan", "experiment.select_eval": "plan", "experiment.budget_slack": "plan",
        "experiment.shared_base": "plan", "experiment.start_from": "plan", "experiment.base_from": "plan",
        "experiment.select_references": "plan",
        "experiment.common_random_numbers": "plan", "experiment.criterion": "plan", "experiment.router": "plan",
        "headroom": "plan", "tracking": "study"}
    leaves = _leaves(RunConfig().model_dump(mode="json"))
    under = {s: {p for p in leaves if p.startswith(s + ".")} for s in ("experiment", "headroom")}
    assert len(under["experiment"]) == 21 and len(under["headroom"]) == 6

    def covered(paths: set[str] | frozenset[str]) -> set[str]:
        return {p for p in leaves if any(p == q or p.startswith(q + ".") for q in paths)}

    draw_then = {"executor.common_random_numbers", "executor.seed", "executor.cache", "scoring.cache_verdicts",
                 "generator.enable_prefix_caching", "generator.block_size",
                 "generator.call_samples"}  # the serve sections' are null by default
    plan_then = {"experiment.references", "experiment.references_from", "experiment.shared_base",
                 "experiment.select_split", "experiment.select_queries", "experiment.select_eval",
                 "experiment.budget_slack", "experiment.common_random_numbers", "experiment.criterion",
                 "experiment.router", "experiment.start_from", "experiment.base_from",
                 "experiment.select_references", "training.save_steps",
                 "headroom.designs", "headroom.queries", "headroom.reps", "headroom.gate", "headroom.budget_rule",
                 "headroom.folds"}
    assert covered(DRAW_ONLY) == draw_then and covered(PLAN_ONLY) == plan_then
    assert covered(set(not_hashed_paths())) == (under["experiment"] | under["headroom"]
                                                | {"tracking", "training.save_steps"} | draw_then)


@pytest.mark.parametrize(("sets", "hashed", "refused"), [
    ({"rollout": {"m": 3}}, True, ["rollout.m"]),
    ({"smc": {"N": 8}}, True, ["smc.N"]),  # a study's section, but what an <run>-smc run's rollout computes
    ({"experiment": {"eval_l": 2}}, False, ["experiment.eval_l"]),  # study: its runs carry it; a resume keeps it
    ({"tracking": ["mlflow"]}, False, ["tracking"]),
    ({"experiment": {"references": ["io"], "shared_base": True}}, False, []),  # plan
    ({"headroom": {"gate": 0.2, "reps": 3}}, False, []),  # a section marked plan as a whole
    ({"training": {"save_steps": 0}}, False, []),
    ({"executor": {"seed": 3, "cache": "off"}, "scoring": {"cache_verdicts": False}}, False, []),  # draw
    ({"generator": {"enable_prefix_caching": False}}, False, []),  # draw: KV blocks reused or computed again
])
def test_a_mark_decides_the_hash_and_the_resume_check(sets, hashed, refused):
    base, other = RunConfig(), config_from_dict(sets)
    assert (base.config_hash() != other.config_hash()) is hashed
    assert diff_configs(base, other) == refused


def test_a_served_sections_prefix_caching_changes_no_hash():
    """Marked inside a section that is null by default: left out where the section is set."""
    def served(caching: bool) -> RunConfig:
        return config_from_dict({"executor": {"kind": "openai", "serve": {"enable_prefix_caching": caching}},
                                 "generator": {"backend": "openai", "serve": {"enable_prefix_caching": caching}}})

    assert served(True).config_hash() == served(False).config_hash() != RunConfig().config_hash()
    assert diff_configs(served(True), served(False)) == []


def test_a_field_marked_once_is_left_out_of_the_hash_and_the_resume_check():
    """No list to extend: a new field's mark is all the hash and the resume check need."""
    class Extended(RunConfig):
        planned: int = Field(0, description="A plan.", json_schema_extra=not_hashed("plan"))
        kept: int = Field(0, description="A study's plan.", json_schema_extra=not_hashed("study"))
        computed: int = Field(0, description="What a run computes.")

    base = Extended()
    planned, kept, computed = Extended(planned=1), Extended(kept=1), Extended(computed=1)
    assert base.config_hash() == planned.config_hash() == kept.config_hash() != computed.config_hash()
    assert (diff_configs(base, planned), diff_configs(base, kept), diff_configs(base, computed)) == \
           ([], ["kept"], ["computed"])
    assert base.config_hash() == RunConfig().config_hash()  # at their defaults the new fields change no hash
    assert not_hashed_paths(Extended)["planned"] == "plan" and "computed" not in not_hashed_paths(Extended)


def test_the_kinds_of_mark():
    assert get_args(NotHashed) == tuple(NOT_HASHED_KINDS) == ("plan", "draw", "study")
    with pytest.raises(ValueError, match="unknown kind 'later'"):
        not_hashed("later")  # type: ignore[arg-type]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_one_file_holds_both_parts_split_by_section_name(path):
    """A config file's top-level sections named by StudyConfig are its study part, the rest what the run computes:
    each part validates alone and is what RunConfig read; `cfg.study` is that part."""
    data = read_yaml(path)
    study = {k: v for k, v in data.items() if k in StudyConfig.model_fields}
    compute = {k: v for k, v in data.items() if k not in StudyConfig.model_fields}
    cfg = load_config(path)
    assert StudyConfig.model_validate(study).model_dump() == cfg.study.model_dump()
    assert ComputeConfig.model_validate(compute).model_dump() == cfg.model_dump(exclude=set(StudyConfig.model_fields))
    assert cfg.study.experiment is cfg.experiment and set(StudyConfig.model_fields) == {
        "experiment", "smc", "headroom", "tracking"}
    # the frozen config keeps both, in the order of then: the run's sections, then the study's
    assert list(yaml.safe_load(cfg.to_yaml())) == ["run_id", "rounds", "store", "generator", "executor", "benchmark",
                                                   "rollout", "scoring", "curation", "training", "experiment", "smc",
                                                   "headroom", "tracking"]
