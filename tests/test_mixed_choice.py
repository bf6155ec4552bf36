"""configs/mixed-choice.yaml: a test split nobody has read (no query of it in any committed store), dev large enough
per part, the policy's choice (nothing drawn, nothing forced), and the routers as references."""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import duckdb
import pytest

from pipeline.config import ConfigError, config_from_dict, load_config
from pipeline.engines.benchmarks import load_benchmark
from pipeline.engines.prompting import load_design
from pipeline.studies.experiment import plan, router_designs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "mixed-choice.yaml"


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)


@pytest.fixture(scope="module")
def splits(cfg):
    bench = load_benchmark(cfg.benchmark.model_copy(update={"max_queries": None}))
    return {s: bench.items(s) for s in ("train", "dev", "test")}


@cache  # one scan of every committed store's queries for the module's tests
def committed_prompts(split: str | None = None) -> set[str]:
    """Every query text of the stores committed under data/ (of `split`, or of any split), this task's own aside."""
    parts = [str(p) for p in (ROOT / "data").rglob("queries/*.parquet") if "mixed-choice" not in p.parts]
    assert len(parts) > 50  # the committed stores are there to compare with
    where = "" if split is None else f"WHERE split = '{split}'"
    return {row[0] for row in duckdb.sql(f"SELECT DISTINCT prompt FROM read_parquet({parts!r}, union_by_name=true) "
                                         f"{where}").fetchall()}


def test_no_test_query_of_the_new_split_is_in_any_committed_store(splits):
    """None was in a committed test split; of every committed query (any split), only one generic calendar question
    recurs ("Is 2020 a leap year?", on earlier dev splits): the generator's space of such questions is small."""
    read_on_test = committed_prompts("test")
    assert len(read_on_test) > 100  # gsm-learn's, mixed3's and HumanEval's test queries
    assert not [it.id for it in splits["test"] if it.prompt in read_on_test]
    anywhere = committed_prompts()
    recurring = [it.prompt for it in splits["test"] if it.prompt in anywhere]
    assert recurring == ["Is 2020 a leap year? Answer with Yes or No."]


def test_dev_holds_at_least_30_queries_of_every_part_and_the_evaluated_test_about_30(cfg, splits):
    per_part = Counter(it.meta["task"] for it in splits["dev"])
    assert set(per_part) == {"gsm_symbolic", "products", "calendar_arithmetic"} and min(per_part.values()) >= 30
    evaluated = Counter(it.meta["task"] for it in splits["test"][: cfg.experiment.eval_queries])
    assert min(evaluated.values()) >= 25, evaluated
    assert len(splits["train"]) == 216 and len(splits["dev"]) == 144 and len(splits["test"]) == 120


def test_the_policy_chooses_and_the_routers_route_among_the_menu(cfg):
    assert cfg.rollout.menu_choice == "policy" and cfg.rollout.menu_prefix_lines is None
    # the format and what every design shares (the signature, the names' common prefix), not a design
    assert cfg.rollout.workflow_prefix == "```python\nasync def solve(problem):\n    # design:"
    assert cfg.rollout.choice_step and cfg.training.old_logprobs == "recompute"
    assert all(d.code.startswith("async def solve(problem):\n") for d in map(load_design, cfg.rollout.example_menu))
    assert all(Path(p).stem.startswith("mixed_") for p in cfg.rollout.example_menu)
    assert router_designs(cfg) == [f"program:{p}" for p in cfg.rollout.example_menu]
    assert len(plan(cfg)) == 3


def test_a_router_over_a_design_that_is_no_reference_is_refused():
    cfg = config_from_dict({"benchmark": {"train_split": "train", "dev_share": 0.5},
                            "rollout": {"example_menu": ["configs/programs/mixed_pot.py",
                                                         "configs/programs/mixed_steps.py"]},
                            "experiment": {"references": ["program:configs/programs/mixed_pot.py"],
                                           "select_split": "dev", "router": {}}})
    with pytest.raises(ConfigError, match="mixed_steps.py not among experiment.references"):
        plan(cfg)
    with pytest.raises(ValueError, match="set experiment.select_split: dev"):
        config_from_dict({"experiment": {"router": {}}})


def test_a_menu_config_of_before_the_choice_still_draws_and_hashes_as_it_did():
    """A config written while every menu sample's design was drawn (it opens with the drawn design's lines) stays
    drawn; a policy config hashes apart from the same config drawn; without a menu the field changes no hash."""
    menu = ["configs/programs/mixed_pot.py", "configs/programs/mixed_steps.py"]
    drawn = config_from_dict({"rollout": {"example_menu": menu, "menu_prefix_lines": 1}})
    assert drawn.rollout.menu_choice == "drawn"
    explicit = config_from_dict({"rollout": {"example_menu": menu, "menu_prefix_lines": 1, "menu_choice": "drawn"}})
    assert explicit.config_hash() == drawn.config_hash()
    policy = config_from_dict({"rollout": {"example_menu": menu}})
    assert policy.rollout.menu_choice == "policy"
    assert policy.config_hash() != config_from_dict({"rollout": {"example_menu": menu, "menu_choice": "drawn"}}
                                                    ).config_hash()
    assert config_from_dict({}).config_hash() == config_from_dict({"rollout": {"menu_choice": "drawn"}}).config_hash()
    with pytest.raises(ValueError, match="chooses for the policy"):
        config_from_dict({"rollout": {"example_menu": menu, "menu_prefix_lines": 1, "menu_choice": "policy"}})


def test_its_split_was_made_by_item_id_alone_and_one_query_text_is_in_test_and_dev(cfg, splits):
    """The store was split before benchmark.one_split_per_text, and the config keeps that (its runs' hashes): one
    test query is word for word a dev query. With the flag on, that query's test copy goes to dev, where the first of
    the two in the seeded ranking is, and no text is in two splits."""
    from pipeline.engines.benchmarks.base import normalised_text

    assert cfg.benchmark.one_split_per_text is False

    def shared(split_of):
        texts = {s: {normalised_text(it.prompt) for it in items} for s, items in split_of.items()}
        return sorted(t for t in texts["test"] if t in texts["dev"] | texts["train"]) + sorted(
            t for t in texts["dev"] if t in texts["train"])

    assert shared(splits) == ["is 2101 a leap year? answer with yes or no"]
    bench = load_benchmark(cfg.benchmark.model_copy(update={"max_queries": None, "one_split_per_text": True}))
    distinct = {s: bench.items(s) for s in ("train", "dev", "test")}
    assert shared(distinct) == []
    moved = [it.prompt for it in splits["test"] if it not in distinct["test"]]
    assert moved == ["Is 2101 a leap year? Answer with Yes or No."]
    assert [len(distinct[s]) for s in ("train", "dev", "test")] == [216, 145, 119]


def test_the_second_verdicts_test_split_is_fresh_and_its_train_and_dev_are_mixed_choices(splits):
    """configs/mixed-route.yaml (benchmark.test_seed): the test split drawn at another seed holds no query text of any
    committed store, nor of mixed-choice's 480 items; train and dev are mixed-choice's, so its designs' runs there
    serve as logged rows and references."""
    route = load_config(ROOT / "configs" / "mixed-route.yaml")
    bench = load_benchmark(route.benchmark.model_copy(update={"max_queries": None}))
    fresh = bench.items("test")
    assert [it.id for it in bench.items("train")] == [it.id for it in splits["train"]]
    assert [it.id for it in bench.items("dev")] == [it.id for it in splits["dev"]]
    old = {it.prompt for s in splits.values() for it in s}
    assert len(fresh) == 120 and not [it.id for it in fresh if it.prompt in old]
    assert not [it.id for it in fresh if it.prompt in committed_prompts()]
    assert min(Counter(it.meta["task"] for it in fresh[: route.experiment.eval_queries]).values()) >= 25


def test_the_per_part_table_reads_the_committed_evaluations_labels_odds_and_tokens():
    """pipeline.studies.choices.part_rows on seed 0's round-1 evaluation: the numbers `pipeline report` shows of it
    (choice_mix: calendar 68 workflows all declaring direct at 0.067, gsm 48 direct and 2 pot of 50; policy_odds:
    calendar direct 0.990, products direct 1.0)."""
    from pipeline.store import Store
    from pipeline.studies.choices import part_rows

    rows = {r["part"]: r for r in part_rows(Store(ROOT / "data/stores/mixed-choice"), ["mixed-choice-s0-eval-r1"])}
    assert sorted(rows) == ["calendar_arithmetic", "gsm_symbolic", "products"]
    cal, gsm, prod = rows["calendar_arithmetic"], rows["gsm_symbolic"], rows["products"]
    assert cal["workflows"] == 68 and cal["labels"]["mixed_direct"]["share"] == 1.0
    assert cal["mean_score"] == pytest.approx(0.0674, abs=1e-4) and cal["exec_tokens"] == pytest.approx(16.16, abs=0.01)
    assert cal["labels"]["mixed_direct"]["odds"] == pytest.approx(0.9905, abs=1e-4)
    assert cal["labels"]["mixed_pot"] == {"share": 0.0, "mean_score": None, "odds": pytest.approx(0.00143, abs=1e-5)}
    assert (gsm["workflows"], gsm["labels"]["mixed_direct"]["share"], gsm["labels"]["mixed_pot"]["share"]) == (
        50, 0.96, 0.04)
    assert prod["mean_score"] == 1.0 and prod["labels"]["mixed_direct"]["odds"] == 1.0
    assert cal["gen_tokens"] == pytest.approx(675.76, abs=0.01)  # the prompt (the whole menu) and the completion
