"""The routers over a menu of designs (pipeline.core.router, pipeline.studies.router) and what the policy declares
(pipeline.core.designs.declared_choice, reply_independent): hand-computed choices on small tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.config import ConfigError, config_from_dict
from pipeline.core.designs import COMBINED, OWN, declared_choice, reply_independent, tempered_draws
from pipeline.core.router import oracle_choice, part_choice, route, solved
from pipeline.studies.router import DesignTable, chances, compose, describe_features, fit_router

# 3 designs (direct, steps, pot) x 4 queries; tokens make the ties' order visible
SCORES = np.array([[1.0, 0.0, 0.5, 0.0],
                   [1.0, 1.0, 0.0, 0.0],
                   [0.0, 1.0, 0.5, 0.0]])
TOKENS = np.array([[10.0, 10.0, 10.0, 10.0],
                   [50.0, 50.0, 50.0, 50.0],
                   [20.0, 5.0, 20.0, 20.0]])


def test_oracle_takes_the_best_score_then_the_fewest_tokens():
    # q0: direct and steps tie at 1.0, direct is cheaper; q1: steps 1.0 (50) and pot 1.0 (5): pot;
    # q2: direct and pot tie at 0.5, direct (10) < pot (20); q3: all 0, direct cheapest
    assert oracle_choice(SCORES, TOKENS).tolist() == [0, 2, 0, 0]


def test_part_router_picks_the_best_mean_per_part():
    # part a = q0, q1: means direct 0.5, steps 1.0, pot 0.5 -> steps; part b = q2, q3: direct 0.25 (10 tokens),
    # steps 0, pot 0.25 (20 tokens) -> direct
    assert part_choice(SCORES, TOKENS, ["a", "a", "b", "b"]) == {"a": 1, "b": 0}
    with pytest.raises(ValueError, match="3 parts for 4 queries"):
        part_choice(SCORES, TOKENS, ["a", "a", "b"])


def test_route_takes_the_highest_chance_then_the_cheaper_design():
    chance = np.array([[0.2, 0.7, 0.1], [0.4, 0.4, 0.4], [0.3, 0.6, 0.6]])
    assert route(chance, np.array([10.0, 50.0, 20.0])).tolist() == [1, 0, 2]
    assert solved(np.array([[0.5, 0.49]])).tolist() == [[True, False]]


def table(texts, scores, parts=None) -> DesignTable:
    scores = np.asarray(scores, dtype=float)
    queries = tuple(f"q{i}" for i in range(scores.shape[1]))
    designs = ("direct", "steps")
    rows = {d: {q: {"query_id": q, "workflows": 2, "mean_at_l": scores[i, j], "best_at_l": scores[i, j],
                    "valid_share": 1.0, "pending": 0, "majority_at_l": None, "gen_tokens_in": 0, "gen_tokens_out": 0,
                    "exec_tokens_in": 10 * (i + 1), "exec_tokens_out": 0, "exec_computed_tokens_in": 0,
                    "exec_computed_tokens_out": 0, "exec_calls": 1, "exec_cached_calls": 0, "gen_cost_usd": 0.0,
                    "exec_cost_usd": 0.0}
                for j, q in enumerate(queries)} for i, d in enumerate(designs)}
    return DesignTable(designs, queries, tuple(texts), tuple(parts or ["p"] * len(texts)), scores,
                       np.array([[10.0] * len(texts), [20.0] * len(texts)]), rows,
                       {"direct": "run-d", "steps": "run-s"})


MULTIPLY = ["What is 312 * 45?", "Compute 908 * 77.", "What is 51 * 6001?", "Multiply 77 by 123."]
STORY = ["Ann has 3 apples and buys 4 bags of 6. How many apples?",
         "A train leaves at 3 and travels 2 hours at 40 mph.",
         "Tom reads 12 pages a day for a week. How many pages?", "Sara saves 5 dollars a week for 9 weeks."]


def test_learned_router_sends_each_kind_of_query_to_the_design_that_solves_it():
    """Direct solves the multiplications and steps the stories on train; the router fitted on them routes unseen
    queries of each kind to that design, and composing it gives each query its chosen design's row."""
    train = table(MULTIPLY + STORY, [[1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]])
    dev = table(["What is 611 * 42?", "Ben has 4 boxes of 7 pens and gives away 3. How many pens?"], [[1, 0], [0, 1]])
    fit = fit_router(train, dev, [1.0, 10.0], ["word"])
    assert fit.chosen.c == 1.0 and fit.chosen.dev_mean == 1.0 and len(fit.tried) == 2  # both 1.0: the first
    chance = chances(train, dev.texts, 1.0, "word")
    assert chance[0, 0] > 0.5 > chance[0, 1] and chance[1, 1] > 0.5 > chance[1, 0]
    arm = compose("router:learned", "learned_router", dev, route(chance, np.array([10.0, 20.0])), "note")
    assert [r["design"] for r in arm.per_query] == ["direct", "steps"]
    assert arm.mean_at_l == 1.0 and arm.exec_tokens_per_query == 15.0  # (10 + 20) / 2
    assert arm.extra["router"]["picked"] == {"direct": 1, "steps": 1}


def test_a_design_that_solves_all_or_nothing_gets_its_rate():
    train = table(MULTIPLY, [[1, 1, 1, 1], [0, 0, 0, 0]])
    assert chances(train, ["anything"], 1.0, "char_wb").tolist() == [[1.0, 0.0]]


# a probe's features by hand: the first coordinate says "direct solves it", the second "steps does"; the words do not
FEATURES = {"q one": [3.0, 0.0], "q two": [2.5, 0.2], "q three": [0.1, 3.0], "q four": [0.3, 2.8],
            "q five": [2.8, 0.1], "q six": [0.0, 2.9]}


def test_a_hidden_state_probe_routes_by_the_models_features_and_is_chosen_on_dev_over_tf_idf():
    """`hidden:<layer>` reads the base model's hidden states at that layer (here a hand table): the dev queries share
    no word with train (TF-IDF drops the one-letter "q"), so the word router sends both to one design (dev 0.5) and
    the probe sends each to the design that solves it (dev 1.0): it is the setting chosen on dev."""
    layers = []

    def embed(texts, layer):
        layers.append(layer)
        return np.array([FEATURES[t] for t in texts])

    train = table(["q one", "q two", "q three", "q four"], [[1, 1, 0, 0], [0, 0, 1, 1]])
    dev = table(["q five", "q six"], [[1, 0], [0, 1]])
    fit = fit_router(train, dev, [1.0], ["word", "hidden:3"], embed)
    assert [(s.analyzer, s.dev_mean) for s in fit.tried] == [("word", 0.5), ("hidden:3", 1.0)]
    assert fit.chosen.analyzer == "hidden:3" and set(layers) == {3}
    assert describe_features("hidden:3") == "the base model's hidden states (layer 3, mean-pooled over the query, " \
                                            "standardised)" and describe_features("word") == "TF-IDF (word)"
    with pytest.raises(ValueError, match="analyzer hidden:3 reads the base model's hidden states; none were given"):
        chances(train, dev.texts, 1.0, "hidden:3")
    with pytest.raises(ConfigError, match="analyzers.0: String should match pattern"):
        config_from_dict({"experiment": {"select_split": "dev", "router": {"analyzers": ["hidden:last"]}}})


def test_hidden_states_pool_each_layer_over_the_texts_tokens_and_are_computed_once(tiny_model, tmp_path, monkeypatch):
    """Layer 0 is the token embeddings: its pooled state is the mean of the text's embedding rows (by hand from the
    weights). A second reader with the same cache loads no model; a layer past the model's is refused by name."""
    import torch

    from pipeline.engines.hidden import HiddenStates
    from pipeline.engines.models import load_causal_lm, load_tokenizer

    states = HiddenStates(tiny_model, tmp_path / "cache")
    got = states(["What is 312 * 45?", "Ann has 3 apples."], 0)
    ids = load_tokenizer(tiny_model)("What is 312 * 45?").input_ids
    weights = load_causal_lm(tiny_model, "float32", "cpu").get_input_embeddings().weight
    with torch.no_grad():
        by_hand = weights[ids].mean(dim=0).numpy()
    assert got.shape == (2, 16) and np.allclose(got[0], by_hand, atol=1e-6)
    assert not np.allclose(got[0], got[1])
    last = states(["What is 312 * 45?"], 2)
    monkeypatch.setattr(HiddenStates, "_load", lambda self: pytest.fail("the cache should have answered"))
    again = HiddenStates(tiny_model, tmp_path / "cache")
    assert np.array_equal(again(["What is 312 * 45?"], 2), last) and np.array_equal(again(["Ann has 3 apples."], 0),
                                                                                      got[1:])
    with pytest.raises(ValueError, match="layer 3 of .*, which has layers 0 \\(the token embeddings\\) to 2"):
        again(["What is 312 * 45?"], 3)


@pytest.mark.parametrize("text, choice", [
    ("```python\n# design: mixed_pot\nasync def solve(p):", "mixed_pot"),
    ("```python\n# Design:  MIXED_STEPS\n", "mixed_steps"),
    ("```python\n# design: mixed_pot + mixed_steps\n", COMBINED),
    ("```python\n# design: mixed_potato\n", OWN),  # a whole name only
    ("```python\nasync def solve(p):\n", OWN),  # no declaration
    ("```python\n# design: own\n", OWN),
])
def test_declared_choice(text, choice):
    assert declared_choice(text, ["mixed_direct", "mixed_steps", "mixed_pot"]) == choice


@pytest.mark.parametrize("code, independent", [
    # the answer is the reply, through a chain of names
    ("async def solve(p):\n    r = await llm(p)\n    x = r[0].strip()\n    return x", False),
    # the reply is asked for, then the query's numbers are multiplied in the code: the answer ignores the reply
    ("async def solve(p):\n    r = await llm(p)\n    return str(312 * 45)", True),
    # no call at all
    ("async def solve(p):\n    a, b = p.split('*')\n    return str(int(a) * int(b))", True),
    # a reply appended to a list that is returned
    ("async def solve(p):\n    out = []\n    for x in await llm(p, n=3):\n        out.append(x)\n    return out[0]",
     False),
    # an expression the reply wrote, evaluated
    ("async def solve(p):\n    e = (await llm(p))[0]\n    try:\n        return str(eval(e))\n    except Exception:\n"
     "        return e", False),
    ("async def solve(p:\n", None),
])
def test_reply_independent(code, independent):
    assert reply_independent(code) is independent


def test_tempered_draws_flatten_the_policys_odds_over_the_labels():
    """Policy odds 0.6 / 0.15 / 0.05 over three labels (0.2 elsewhere): renormalised 0.75 / 0.1875 / 0.0625; at
    temperature 2 the square roots 0.8660 / 0.4330 / 0.2500 (sum 1.5490), i.e. 0.5591 / 0.2795 / 0.1614 (by hand)."""
    logprobs = [math.log(0.6), math.log(0.15), math.log(0.05)]
    want = [0.5591, 0.2795, 0.1614]
    draws = tempered_draws(logprobs, 2.0, 6000, seed=7)
    for index, logprob in draws[:20]:
        assert math.exp(logprob) == pytest.approx(want[index], abs=1e-4)
    shares = [sum(i == k for i, _ in draws) / len(draws) for k in range(3)]
    assert shares == pytest.approx(want, abs=0.02)
    assert tempered_draws(logprobs, 2.0, 6000, seed=7) == draws  # seeded
    at_one = tempered_draws(logprobs, 1.0, 200, seed=1)  # temperature 1: the renormalised odds themselves
    assert {i for i, _ in at_one} == {0, 1, 2}
    for index, logprob in at_one:
        assert math.exp(logprob) == pytest.approx([0.75, 0.1875, 0.0625][index], abs=1e-9)
    assert tempered_draws(logprobs, 0.0, 3, seed=0) == [(0, 0.0)] * 3  # greedy: the likeliest, with probability 1
    with pytest.raises(ValueError, match="temperature > 0"):
        tempered_draws(logprobs, -1.0, 1, seed=0)
