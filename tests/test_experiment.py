"""The learning experiment's protocol checks (pipeline.studies.experiment)."""

import pytest

from pipeline.config import ConfigError, config_from_dict, load_config
from pipeline.studies.experiment import plan


def test_experiment_refuses_an_eval_split_that_holds_training_queries():
    def cfg(train, held_out):
        return config_from_dict({"benchmark": {"train_split": train, "dev_share": 0.25},
                                 "experiment": {"eval_split": held_out, "seeds": [0, 1]}})

    assert [p.run_id for p in plan(cfg("train", "dev"))] == ["demo-s0", "demo-s1"]
    assert len(plan(cfg("validate", "test"))) == 2
    for train, held_out in (("validate", "dev"), ("dev", "dev"), ("train", "validate"), ("test", "test")):
        with pytest.raises(ConfigError, match=f"eval_split {held_out} shares queries with benchmark.train_split "
                                              f"{train}"):
            plan(cfg(train, held_out))


def test_evaluations_sample_at_the_eval_temperature_when_one_is_set():
    from pipeline.config import as_sets, with_changes
    from pipeline.studies.evaluate import eval_changes

    def cfg(**experiment):
        return config_from_dict({"experiment": {"eval_queries": 12, "eval_l": 3, **experiment},
                                 "generator": {"temperature": 1.0}})

    crn = {"executor.common_random_numbers": True}  # evaluations seed their executor calls
    assert eval_changes(cfg()) == {"benchmark.max_queries": 12, "rollout.m": 3} | crn
    cooler = eval_changes(cfg(eval_temperature=0.7))
    assert cooler == {"benchmark.max_queries": 12, "generator.temperature": 0.7, "rollout.m": 3} | crn
    assert as_sets(cooler) == ["benchmark.max_queries=12", "generator.temperature=0.7", "rollout.m=3",
                               "executor.common_random_numbers=true"]  # the text the evaluation's stages get
    # an exploring design step (rollout.choice_step at choice_temperature 4) is evaluated at the policy's own odds:
    # temperature 1.0, not the exploration's 4 nor the generator's evaluation temperature 0.7
    menu = {"rollout": {"example_menu": ["configs/programs/mixed_direct.py", "configs/programs/mixed_pot.py"],
                        "choice_step": True, "choice_temperature": 4.0}, "training": {"old_logprobs": "recompute"}}
    exploring = config_from_dict({**menu, "experiment": {"eval_queries": 12, "eval_l": 3, "eval_temperature": 0.7}})
    assert eval_changes(exploring) == {"benchmark.max_queries": 12, "generator.temperature": 0.7,
                                       "rollout.choice_temperature": 1.0, "rollout.m": 3} | crn
    # a design step left at null (which falls back to the generator's temperature) is set to 1.0 too
    unset = config_from_dict({**menu, "rollout": {**menu["rollout"], "choice_temperature": None},
                              "experiment": {"eval_temperature": 0.7}})
    assert eval_changes(unset)["rollout.choice_temperature"] == 1.0
    mixed = load_config("configs/mixed-choice.yaml")
    assert with_changes(mixed, eval_changes(mixed)).rollout.choice_temperature == 1.0
    # a reference (a fixed program) samples no design: its runs keep the unset temperature they were frozen with
    assert eval_changes(exploring, policy=False)["rollout.choice_temperature"] is None
    assert "rollout.choice_temperature" not in eval_changes(unset, policy=False)
    assert load_config("data/stores/mixed-choice/mixed-choice-baseline-cot_sc/config.yaml").rollout.choice_temperature \
        is None  # what policy=False gives, so CoT-SC's unfinished run resumes under the same hash
