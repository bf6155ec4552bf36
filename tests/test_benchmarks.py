"""Loaders on small files written here in the official formats, the procedural benchmark, and splits."""

import json
import random
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import BenchmarkConfig
from pipeline.engines.benchmarks import BenchmarkError, Item, load_benchmark, split_items
from pipeline.engines.benchmarks.procedural import answer_candidates, parse_task, task_sizes


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _bench(name, path=None, **kw):
    return load_benchmark(BenchmarkConfig(name=name, path=str(path) if path else None, **kw))


def _roundtrip(item: Item) -> Item:
    """An Item as rebuilt from the store's `queries` table."""
    return Item(item.id, item.prompt, json.loads(json.dumps(item.reference)), json.loads(json.dumps(item.meta)))


# ---------------------------------------------------------------- GSM8K

GSM = [
    {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm has 1,000 cows and sells 766.", "answer": "1000 - 766 = 234\n#### 234"},
    {"question": "Bob owes 5 and pays 12. Balance?", "answer": "5 - 12 = -7\n#### -7"},
]


def test_gsm8k_loads_and_scores(tmp_path):
    b = _bench("gsm8k", _jsonl(tmp_path / "test.jsonl", GSM))
    items = b.load()
    assert [it.id for it in items] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert items[0].prompt == GSM[0]["question"] and items[1].reference == {"answer": "234"}
    assert b.family == "math"
    assert b.score(items[0], "She ends with 7 apples.").score == 1.0
    assert b.score(items[1], "3 + 4 = 7").score == 0.0
    r = b.score(_roundtrip(items[2]), "The balance is -7.")
    assert r.score == 1.0 and r.details["extracted"] == "-7"


def test_gsm8k_parquet_same_as_jsonl(tmp_path):
    pq.write_table(pa.Table.from_pylist(GSM), tmp_path / "test.parquet")
    a = _bench("gsm8k", tmp_path / "test.parquet").load()
    b = _bench("gsm8k", _jsonl(tmp_path / "test.jsonl", GSM)).load()
    assert a == b


def test_missing_file_names_path_and_how_to_supply(tmp_path):
    with pytest.raises(BenchmarkError) as e:
        _bench("gsm8k", tmp_path / "nope.jsonl").load()
    msg = str(e.value)
    assert str(tmp_path / "nope.jsonl") in msg and "benchmark.path" in msg and "#### <number>" in msg
    with pytest.raises(BenchmarkError, match="benchmark.path and benchmark.hub_id are unset"):
        _bench("math").load()


def test_missing_field_names_file_line_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(GSM[0]) + "\n\n" + json.dumps({"question": "q?"}) + "\n")
    with pytest.raises(BenchmarkError, match=rf"{p}:3: missing field 'answer'"):
        _bench("gsm8k", p).load()
    _jsonl(p, [{"question": "q?", "answer": "no final marker 3"}])
    with pytest.raises(BenchmarkError, match=rf"{p}:1: field 'answer' has no '#### <number>'"):
        _bench("gsm8k", p).load()
    p.write_text(json.dumps(GSM[0]) + "\n{not json\n")
    with pytest.raises(BenchmarkError, match=rf"{p}:2: invalid JSON"):
        _bench("gsm8k", p).load()
    _jsonl(p, [{"question": 3, "answer": "#### 3"}])
    with pytest.raises(BenchmarkError, match="field 'question' should be str, got int"):
        _bench("gsm8k", p).load()
    pq.write_table(pa.Table.from_pylist([GSM[0], {"question": "q", "answer": None}]), tmp_path / "bad.parquet")
    with pytest.raises(BenchmarkError, match=r"bad.parquet row 1: missing field 'answer'"):
        _bench("gsm8k", tmp_path / "bad.parquet").load()


def test_unsupported_suffix(tmp_path):
    (tmp_path / "x.tsv").write_text("question\tanswer\n")
    with pytest.raises(BenchmarkError, match="unsupported file type '.tsv'"):
        _bench("gsm8k", tmp_path / "x.tsv").load()


def test_a_csv_file_is_read_with_its_line_numbers(tmp_path):
    (tmp_path / "x.csv").write_text('question,answer\n"two\nlines",#### 4\nq,no marker\n')
    with pytest.raises(BenchmarkError, match=r"x.csv:4: field 'answer' has no '#### <number>' final answer"):
        _bench("gsm8k", tmp_path / "x.csv").load()  # the second record starts on line 4: the first spans 2-3


# ---------------------------------------------------------------- MATH

MATH_ROWS = [
    {
        "problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.",
        "level": "Level 2",
        "type": "Prealgebra",
        "solution": "We get $\\frac{2}{4}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$.",
    },
    {
        "problem": "Simplify $\\frac{1}{\\sqrt{2}}$.",
        "level": "Level 5",
        "type": "Algebra",
        "solution": "Rationalise: $\\boxed{\\frac{\\sqrt{2}}{2}}$.",
    },
    {"problem": "Odd one.", "level": "Level ?", "type": "Algebra", "solution": "It is $\\boxed{1}$."},
    {"problem": "What is $2^{10}$?", "level": "Level 5", "type": "Algebra", "solution": "$\\boxed{1024}$"},
]


def test_math_loads_gold_from_boxed_and_filters_levels(tmp_path):
    p = _jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    items = _bench("math", p).load()
    assert [it.id for it in items] == ["math-0", "math-1", "math-2", "math-3"]
    assert items[0].reference == {"answer": "\\frac{3}{4}"} and items[0].meta == {"level": 2, "type": "Prealgebra"}
    assert items[2].meta["level"] is None  # "Level ?"
    b5 = _bench("math", p, levels=[5])
    l5 = b5.load()
    assert [it.id for it in l5] == ["math-1", "math-3"]  # ids are row indices of the file, not of the subset
    assert l5[0].reference["answer"] == "\\frac{\\sqrt{2}}{2}"
    assert b5.score(l5[0], "So the answer is $\\boxed{\\frac{1}{\\sqrt{2}}}$").score == 1.0
    assert b5.score(_roundtrip(l5[1]), "1024").score == 1.0
    assert b5.score(l5[1], "\\boxed{512}").score == 0.0
    with pytest.raises(BenchmarkError, match=r"no problems of levels \[4\]"):
        _bench("math", p, levels=[4]).load()


def test_math_folder_of_original_json_files(tmp_path):
    for sub, name, row in [("algebra", "7", MATH_ROWS[1]), ("prealgebra", "12", MATH_ROWS[0])]:
        (tmp_path / "test" / sub).mkdir(parents=True)
        (tmp_path / "test" / sub / f"{name}.json").write_text(json.dumps(row))
    items = _bench("math", tmp_path / "test").load()
    assert [it.id for it in items] == ["math-algebra/7", "math-prealgebra/12"]


def test_math500_layout_and_missing_boxed(tmp_path):
    row = {
        "problem": "p",
        "solution": "s",
        "answer": "\\frac{1}{2}",
        "subject": "Algebra",
        "level": 5,
        "unique_id": "test/algebra/1.json",
    }
    items = _bench("math", _jsonl(tmp_path / "m500.jsonl", [row]), levels=[5]).load()
    assert items[0].id == "test/algebra/1.json" and items[0].reference == {"answer": "\\frac{1}{2}"}
    assert items[0].meta == {"level": 5, "type": "Algebra"}
    bad = dict(MATH_ROWS[0], solution="no box here")
    with pytest.raises(BenchmarkError, match=r"math.jsonl:2: field 'solution' has no \\boxed"):
        _bench("math", _jsonl(tmp_path / "math.jsonl", [MATH_ROWS[0], bad])).load()


# ---------------------------------------------------------------- DROP

DROP_ROWS = [
    {
        "section_id": "nfl_1",
        "query_id": "q-1",
        "passage": "Chaz Schilens caught a 20-yard pass. Tony Scheffler caught an 11-yard pass.",
        "question": "Who scored first?",
        "answers_spans": {"spans": ["Chaz Schilens", "Schilens"], "types": ["span", "span"]},
    },
    {
        "section_id": "nfl_1",
        "query_id": "q-2",
        "passage": "Chaz Schilens caught a 20-yard pass. Tony Scheffler caught an 11-yard pass.",
        "question": "How many passes were caught?",
        "answers_spans": {"spans": ["2"], "types": ["number"]},
    },
]


def test_drop_parquet_prompt_golds_and_score(tmp_path):
    pq.write_table(pa.Table.from_pylist(DROP_ROWS), tmp_path / "drop.parquet")  # nested struct column
    b = _bench("drop", tmp_path / "drop.parquet")
    items = b.load()
    assert [it.id for it in items] == ["q-1", "q-2"] and b.family == "qa"
    assert DROP_ROWS[0]["passage"] in items[0].prompt and "Who scored first?" in items[0].prompt
    assert items[0].reference == {"answers": ["Chaz Schilens", "Schilens"]}
    assert items[0].meta == {"section_id": "nfl_1", "types": ["span", "span"]}
    # "answer is chaz schilens" vs "chaz schilens": P 2/4, R 1 -> F1 2/3 (vs "schilens": 0.4); max wins
    assert b.score(items[0], "The answer is Chaz Schilens.").score == pytest.approx(2 / 3)
    assert b.score(items[0], "Chaz Schilens").details["exact_match"] is True
    assert b.score(_roundtrip(items[1]), "2.0").score == 1.0
    assert b.score(items[1], "3").score == 0.0


def test_drop_errors(tmp_path):
    bad = dict(DROP_ROWS[0], answers_spans={"spans": [], "types": []})
    with pytest.raises(BenchmarkError, match=r"drop.jsonl:1: field 'answers_spans.spans' holds no answer"):
        _bench("drop", _jsonl(tmp_path / "drop.jsonl", [bad])).load()
    with pytest.raises(BenchmarkError, match=r"drop.jsonl:2: duplicate id 'q-1' \(first at .*drop.jsonl:1\)"):
        _bench("drop", _jsonl(tmp_path / "drop.jsonl", [DROP_ROWS[0], DROP_ROWS[0]])).load()


# ---------------------------------------------------------------- HotpotQA

HOTPOT_ORIGINAL = [
    {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Which magazine was started first, Arthur's Magazine or First for Women?",
        "answer": "Arthur's Magazine",
        "type": "comparison",
        "level": "medium",
        "supporting_facts": [["Arthur's Magazine", 0], ["First for Women", 0]],
        "context": [
            [
                "Arthur's Magazine",
                ["Arthur's Magazine (1844-1846) was a literary periodical.", " It was in Philadelphia."],
            ],
            ["First for Women", ["First for Women is a woman's magazine started in 1989."]],
        ],
    }
]


def _hotpot_hf(row):
    return {
        "id": row["_id"],
        "question": row["question"],
        "answer": row["answer"],
        "type": row["type"],
        "level": row["level"],
        "supporting_facts": {"title": ["Arthur's Magazine"], "sent_id": [0]},
        "context": {"title": [t for t, _ in row["context"]], "sentences": [s for _, s in row["context"]]},
    }


def test_hotpotqa_original_and_hf_formats_agree(tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps(HOTPOT_ORIGINAL))  # original: one JSON array
    orig = _bench("hotpotqa", tmp_path / "dev.json").load()
    pq.write_table(pa.Table.from_pylist([_hotpot_hf(r) for r in HOTPOT_ORIGINAL]), tmp_path / "dev.parquet")
    hf = _bench("hotpotqa", tmp_path / "dev.parquet").load()
    assert orig == hf
    it = orig[0]
    assert it.id == "5a8b57f25542995d1e6f1371" and it.reference == {"answers": ["Arthur's Magazine"]}
    assert "Arthur's Magazine: Arthur's Magazine (1844-1846) was a literary periodical. It was in Philadelphia." in (
        it.prompt
    )
    assert "First for Women: First for Women is a woman's magazine started in 1989." in it.prompt
    assert it.prompt.rstrip().endswith("Question: " + HOTPOT_ORIGINAL[0]["question"])
    b = _bench("hotpotqa", tmp_path / "dev.json")
    assert b.score(it, "arthurs magazine").score == 1.0  # punctuation stripped
    assert b.score(it, "First for Women").score == 0.0


def test_hotpotqa_bad_context(tmp_path):
    bad = dict(HOTPOT_ORIGINAL[0], context=[["title only"]])
    with pytest.raises(BenchmarkError, match=r"hot.jsonl:1: field 'context' should be a list of \[title"):
        _bench("hotpotqa", _jsonl(tmp_path / "hot.jsonl", [bad])).load()


# ---------------------------------------------------------------- hub ids


def test_hub_id_through_datasets(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return GSM[:2]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    items = _bench("gsm8k", hub_id="openai/gsm8k:main@train").load()
    assert calls == [("openai/gsm8k", "main", "train")] and [it.reference["answer"] for it in items] == ["7", "234"]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: DROP_ROWS))
    assert [it.id for it in _bench("drop", hub_id="ucinlp/drop").load()] == ["q-1", "q-2"]


def test_hub_id_offline_or_without_datasets_is_a_clear_error(monkeypatch):
    def offline(*a, **k):
        raise ConnectionError("hub unreachable")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(BenchmarkError, match=r"hub_id='openai/gsm8k'.*ConnectionError.*benchmark.path"):
        _bench("gsm8k", hub_id="openai/gsm8k").load()
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(BenchmarkError, match="needs the `datasets` library"):
        _bench("gsm8k", hub_id="openai/gsm8k").load()


# ---------------------------------------------------------------- procedural


def test_task_sizes_and_task_specs():
    assert task_sizes(["a", "b", "c"], 10) == {"a": 4, "b": 3, "c": 3}
    assert task_sizes(["a", "b"], 1) == {"a": 1, "b": 0}
    assert parse_task("chain_sum") == ("chain_sum", {})
    assert parse_task("chain_sum:max_terms=3, max_digits=1") == ("chain_sum", {"max_terms": 3, "max_digits": 1})
    with pytest.raises(BenchmarkError, match="expected name:key=value"):
        parse_task("chain_sum:max_terms")


def test_answer_candidates():
    assert answer_candidates("The answer is 42.") == {"raw": "The answer is 42.", "last_number": "42"}
    assert answer_candidates("work: 3*4=12\nfinal: -5\n") == {
        "raw": "work: 3*4=12\nfinal: -5",
        "last_line": "final: -5",
        "last_number": "-5",
    }
    assert answer_candidates("no idea") == {"raw": "no idea"}


@pytest.fixture(scope="module")
def procedural():
    cfg = BenchmarkConfig(name="procedural", tasks=["chain_sum", "basic_arithmetic", "gsm_symbolic"], size=10)
    b = load_benchmark(cfg)
    return b, b.load()


def test_procedural_items_deterministic_and_interleaved(procedural):
    b, items = procedural
    assert len(items) == 10 and b.family == "procedural"
    assert [it.meta["task"] for it in items[:4]] == ["chain_sum", "basic_arithmetic", "gsm_symbolic", "chain_sum"]
    assert [it.id for it in items if it.meta["task"] == "chain_sum"] == [f"chain_sum-0-{i}" for i in range(4)]
    assert b.load() == items  # same config -> the same items
    json.dumps([it.reference for it in items])  # references are plain JSON
    # the arithmetic golds are the value of their expression
    arithmetic = [it for it in items if it.meta["task"] in ("chain_sum", "basic_arithmetic")]
    assert len(arithmetic) == 7
    for it in arithmetic:
        assert float(it.reference["answer"]) == eval(it.reference["metadata"]["expression"]), it.id
    other = load_benchmark(b.cfg.model_copy(update={"split_seed": 1})).load()
    assert [it.prompt for it in other] != [it.prompt for it in items]


def test_procedural_scores_free_form_answers_with_the_generators_check(procedural):
    b, items = procedural
    for it in items:
        gold = it.reference["answer"]
        rebuilt = _roundtrip(it)
        assert b.score(rebuilt, gold).score == 1.0
        r = b.score(rebuilt, f"Let me compute step by step: 1 + 2 = 3.\nThe answer is {gold}.")
        wrong = b.score(rebuilt, str(int(gold) + 1))
        assert r.score == 1.0 and wrong.score == 0.0 and wrong.details["gold"] == gold
        if it.meta["task"] == "gsm_symbolic":  # scored by the exact final number (the next test)
            assert r.details["metric"] == wrong.details["metric"] == "exact_number"
            continue
        assert r.details["candidates"]["last_number"] == 1.0 and r.details["matched"] in ("last_line", "last_number")
        assert r.details["candidates"]["raw"] < 1.0  # the generator's own check alone would not give credit


@pytest.fixture(scope="module")
def word_problems():
    """Six real gsm_symbolic items (split seed 0): gold answers 28080, 44, 104, 78000, 14, 41."""
    b = _bench("procedural", tasks=["gsm_symbolic"], size=6)
    return b, {it.reference["answer"]: _roundtrip(it) for it in b.load()}


def test_word_problems_score_by_the_exact_final_number(word_problems):
    b, items = word_problems
    assert sorted(items) == ["104", "14", "28080", "41", "44", "78000"]
    big, small = items["28080"], items["44"]
    cases = [(big, "28080", 1.0), (big, "The carpenter earns £28,080 in a year.", 1.0), (big, "28,080.00", 1.0),
             (small, "$44.00", 1.0), (small, "He has 72 - 36 + 17 - 9 = 44 pebbles", 1.0),
             (big, "28081", 0.0), (big, "28,079", 0.0), (small, "45", 0.0),  # near misses: no credit
             (small, "44 pebbles at first, then 45", 0.0),  # the final number counts, not the first
             (small, "forty-four", 0.0), (small, "", 0.0)]
    for item, answer, want in cases:
        got = b.score(item, answer)
        assert (got.score, got.details["metric"]) == (want, "exact_number"), answer
    assert b.score(big, "28,080").details["extracted"] == "28080"
    # the generator's own check (exact_number: false) gives a near miss 0.01 and reads the first number
    own = _bench("procedural", tasks=["gsm_symbolic"], size=6, exact_number=False)
    assert own.score(big, "28081").score == 0.01 and own.score(small, "44 pebbles at first, then 45").score == 1.0


def test_exact_number_switch_for_other_generators():
    b = _bench("procedural", tasks=["chain_sum"], size=2)
    item = b.load()[0]
    gold = item.reference["answer"]
    assert not b.exact_number("chain_sum") and b.exact_number("gsm_symbolic")  # null: gsm_symbolic only
    assert "metric" not in b.score(item, gold).details  # the generator's own check
    exact = _bench("procedural", tasks=["chain_sum"], size=2, exact_number=True)
    assert exact.score(item, f"so it is {gold}").details["metric"] == "exact_number"
    assert exact.score(item, f"{int(gold) + 1}").score == 0.0
    words = _bench("procedural", tasks=["word_sorting"], size=1, exact_number=True)
    with pytest.raises(BenchmarkError, match=r"benchmark.exact_number: item word_sorting-0-0 \(word_sorting\) has "
                                             r"the gold answer"):
        words.score(words.load()[0], "a, b")


def test_procedural_exact_number_metric_gives_no_partial_credit(procedural):
    b, items = procedural
    exact = load_benchmark(b.cfg.model_copy(update={"exact_number": True}))
    gsm = [it for it in items if it.meta["task"] == "gsm_symbolic"]
    assert gsm
    for it in gsm:
        gold = it.reference["answer"]
        assert exact.score(_roundtrip(it), f"Half of 10 is 5, so the total is {gold}").score == 1.0  # the last number
        assert exact.score(_roundtrip(it), str(int(gold) + 1)).score == 0.0  # the task's own check: 0.01
        assert exact.score(_roundtrip(it), f"{gold}, no wait, {int(gold) - 3}").score == 0.0  # its first number: 1


def test_procedural_task_options_and_errors():
    b = _bench("procedural", tasks=["chain_sum:max_terms=2,max_digits=1"], size=3)
    items = b.load()
    assert [it.id for it in items] == [f"chain_sum[max_digits=1,max_terms=2]-0-{i}" for i in range(3)]
    assert all(len(it.reference["metadata"]["expression"].split()) == 3 for it in items)  # "a + b"
    assert all(int(it.reference["answer"]) == eval(it.reference["metadata"]["expression"]) for it in items)
    assert b.score(_roundtrip(items[0]), items[0].reference["answer"]).score == 1.0
    with pytest.raises(BenchmarkError, match="unknown reasoning-gym generator 'nope'"):
        _bench("procedural", tasks=["nope"], size=2).load()
    with pytest.raises(BenchmarkError, match="chain_sum with options"):
        _bench("procedural", tasks=["chain_sum:bogus=1"], size=2).load()
    with pytest.raises(BenchmarkError, match="duplicate entries"):
        _bench("procedural", tasks=["chain_sum", "chain_sum"], size=2).load()


# ---------------------------------------------------------------- splits


def _items(n, prefix="q"):
    return [Item(f"{prefix}{i}", f"prompt {i}", {"answer": str(i)}) for i in range(n)]


def test_split_is_deterministic_one_to_four_and_a_partition():
    items = _items(100)
    s = split_items(items, seed=0)
    assert len(s["validate"]) == 20 and len(s["test"]) == 80  # 1:4
    ids_v, ids_t = {it.id for it in s["validate"]}, {it.id for it in s["test"]}
    assert not ids_v & ids_t and ids_v | ids_t == {it.id for it in items}
    assert split_items(items, seed=0) == s
    assert {it.id for it in split_items(items, seed=1)["validate"]} != ids_v  # the seed matters
    assert [it.id for it in s["test"]] == [it.id for it in items if it.id in ids_t]  # original order kept


def test_default_split_keeps_the_former_validate_items():
    # the validate items of 10 ids at seed 0 under the former validate_fraction=0.2 code (commit c8b2f1f): stores
    # made before test_share/dev_share existed keep their queries
    assert [it.id for it in split_items(_items(10), seed=0)["validate"]] == ["q4", "q6"]
    assert [it.id for it in split_items(_items(10), 0, 0.8, 0.5)["dev"]] == ["q6"]  # the later of the two by hash


def test_a_query_text_goes_to_one_split_only_when_asked():
    # at seed 0 the ranking of q0..q9 opens with q4 (train), then q6 (dev, with dev_share 0.5), the eight others test
    # (test_default_split_keeps_the_former_validate_items); q2 (test) is q6's text once normalised, q8 and q9 (both
    # test) share one text
    items = _items(10)
    texts = {"q6": "Is 2101 a leap year?", "q2": "  IS 2101 a leap   year ", "q8": "What is 3 + 4?",
             "q9": "what is 3 + 4"}
    items = [Item(it.id, texts.get(it.id, it.prompt), it.reference) for it in items]
    by_id = split_items(items, 0, 0.8, 0.5)
    assert ([it.id for it in by_id["dev"]], "q2" in _ids(by_id["test"])) == (["q6"], True)  # as before the flag
    one = split_items(items, 0, 0.8, 0.5, one_split_per_text=True)
    assert [it.id for it in one["train"]] == ["q4"]
    assert [it.id for it in one["dev"]] == ["q2", "q6"]  # q2 follows q6, the first of the two in the ranking
    assert [it.id for it in one["test"]] == ["q0", "q1", "q3", "q5", "q7", "q8", "q9"]  # q8, q9: one split already
    assert [it.id for it in one["validate"]] == ["q2", "q4", "q6"]


def test_normalised_text_ignores_case_spacing_and_end_punctuation():
    from pipeline.engines.benchmarks.base import normalised_text

    assert normalised_text("  Is 2101 a\tLeap  year?! ") == "is 2101 a leap year"
    assert normalised_text("(x + y) = 3.") == "x + y) = 3"  # only the ends: the inner ")" stays
    assert normalised_text("3 - 4") != normalised_text("3 + 4")


def test_one_split_per_text_is_on_for_new_configs_and_off_for_saved_ones():
    from pipeline.config import RunConfig, config_from_dict

    assert RunConfig().benchmark.one_split_per_text is True
    assert config_from_dict({"benchmark": {"tasks": ["chain_sum"], "size": 40}}).benchmark.one_split_per_text is True
    saved = RunConfig().model_dump(mode="json")
    del saved["benchmark"]["one_split_per_text"]  # a run frozen before the field: every other field spelt out
    frozen = config_from_dict(saved)
    assert frozen.benchmark.one_split_per_text is False
    # its hash is the one it had: the field at its former default is left out, as if it did not exist
    assert frozen.config_hash() == config_from_dict({"benchmark": {"one_split_per_text": False}}).config_hash()
    assert frozen.config_hash() != RunConfig().config_hash()


def test_a_benchmark_splits_by_its_configs_flag():
    from pipeline.config import BenchmarkConfig
    from pipeline.engines.benchmarks.base import Benchmark

    class Listed(Benchmark):
        name, family = "listed", "procedural"

        def load(self):
            return [Item(it.id, "Same?" if it.id in ("q2", "q6") else it.prompt, it.reference) for it in _items(10)]

        def score(self, item, answer):
            raise NotImplementedError

    for flag, dev in ((True, ["q2", "q6"]), (False, ["q6"])):
        cfg = BenchmarkConfig(test_share=0.8, dev_share=0.5, one_split_per_text=flag)
        assert [it.id for it in Listed(cfg).items("dev")] == dev


def _ids(split):
    return {it.id for it in split}


def test_train_dev_test_are_disjoint_train_and_dev_make_validate_and_test_does_not_move():
    items = _items(100)
    s = split_items(items, seed=0, test_share=0.8, dev_share=0.25)
    # 100 x 0.2 = 20 non-test items; 20 x 0.25 = 5 of them dev, 15 train
    assert [len(s[k]) for k in ("validate", "train", "dev", "test")] == [20, 15, 5, 80]
    train, dev, test = _ids(s["train"]), _ids(s["dev"]), _ids(s["test"])
    assert not train & dev and not (train | dev) & test and train | dev == _ids(s["validate"])
    assert train | dev | test == _ids(items)
    for dev_share in (0.0, 0.5, 0.9):
        other = split_items(items, seed=0, test_share=0.8, dev_share=dev_share)
        assert other["test"] == s["test"] and other["validate"] == s["validate"]
    # a larger dev_share only moves items from train to dev
    wider = split_items(items, seed=0, test_share=0.8, dev_share=0.5)
    assert dev < _ids(wider["dev"]) and _ids(wider["train"]) < train
    assert [it.id for it in s["dev"]] == [it.id for it in items if it.id in dev]  # original order kept


def test_humaneval_test_share_holds_out_at_least_64_problems():
    bench = _bench("humaneval", test_share=0.4, dev_share=0.5)
    # 164 x 0.6 = 98.4 -> 98 non-test (66 test); 98 x 0.5 = 49 dev, 49 train
    sizes = {k: len(bench.items(k)) for k in ("validate", "train", "dev", "test")}
    assert sizes == {"validate": 98, "train": 49, "dev": 49, "test": 66} and sizes["test"] >= 64
    assert _bench("humaneval", train_split="train", test_share=0.4, dev_share=0.5).items() == bench.items("train")
    # the default keeps today's 1:4 split: 164 x 0.2 = 32.8 -> 33 validate, 131 test
    assert [len(_bench("humaneval").items(k)) for k in ("validate", "test")] == [33, 131]


def test_split_settings_errors_name_the_field(tmp_path):
    from pipeline.config import ConfigError, load_config

    assert BenchmarkConfig(validate_fraction=0.3).test_share == 0.7  # the former field of saved configs
    with pytest.raises(ValueError, match="validate_fraction 0.3 and test_share 0.5 disagree"):
        BenchmarkConfig(validate_fraction=0.3, test_share=0.5)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("benchmark:\n  train_split: dev\n")
    with pytest.raises(ConfigError, match=r"c.yaml: invalid config\n  benchmark: .*train_split dev needs dev_share"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"benchmark.train_split: Input should be"):
        load_config(cfg, ["benchmark.train_split=holdout"])
    p = _jsonl(tmp_path / "gsm.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)])
    with pytest.raises(BenchmarkError, match=r"split 'dev' is empty \(benchmark.test_share 0.8, benchmark.dev_share "
                                             r"0.1\)"):
        _bench("gsm8k", p, dev_share=0.1).items("dev")  # 1 validate item x 0.1 rounds to 0


def test_saved_configs_with_validate_fraction_keep_their_hash():
    from pipeline.config import RunConfig, config_from_dict

    saved = RunConfig().model_dump(mode="json")
    del saved["benchmark"]["test_share"], saved["benchmark"]["dev_share"], saved["benchmark"]["exact_number"]
    saved["benchmark"]["validate_fraction"] = 0.2  # as every run saved before test_share existed
    assert config_from_dict(saved).config_hash() == RunConfig().config_hash()


def test_split_membership_depends_on_ids_not_on_order_or_payload():
    items = _items(50)
    shuffled = items[:]
    random.Random(3).shuffle(shuffled)
    ids = {it.id for it in split_items(items, 7)["validate"]}
    assert {it.id for it in split_items(shuffled, 7)["validate"]} == ids
    edited = [Item(it.id, "another prompt", {"answer": "x"}) for it in items]
    assert {it.id for it in split_items(edited, 7)["validate"]} == ids


def test_items_respects_max_queries_and_train_split(tmp_path):
    p = _jsonl(tmp_path / "gsm.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)])
    full = _bench("gsm8k", p)
    validate, test = full.items("validate"), full.items("test")
    assert len(validate) == 4 and len(test) == 16 and full.items() == validate  # train split: validate
    capped = _bench("gsm8k", p, max_queries=3)
    assert capped.items() == validate[:3] and capped.items("test") == test[:3]
    assert _bench("gsm8k", p, train_split="test").items() == test


@pytest.mark.parametrize("name", ["gsm8k", "math", "drop", "hotpotqa", "procedural"])
def test_registry_resolves(name):
    b = load_benchmark(BenchmarkConfig(name=name))
    assert b.name == name
