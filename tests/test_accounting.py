"""Majority@L, answer votes and per-query token accounting, on hand-computed cases."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import RunConfig
from pipeline.core.learning import majority_at_l, query_metrics, split_summary
from pipeline.engines.benchmarks.metrics import vote_key
from pipeline.store import Store
from pipeline.store.schema import schema
from pipeline.studies.evaluate import eval_summary, generation_votes

# ---- Majority@L -------------------------------------------------------------------------------------------------


def test_majority_is_the_most_frequent_answer():
    # "42" twice (both right), "41" once (wrong), one workflow without an answer: the majority answer is right
    assert majority_at_l([("42", 1.0), ("42", 1.0), ("41", 0.0), (None, 0.0)]) == 1.0
    # the wrong answer is the more frequent one: Majority@L = 0 although one workflow is right (Best@L = 1)
    assert majority_at_l([("7", 0.0), ("7", 0.0), ("8", 1.0)]) == 0.0


def test_majority_tie_is_the_expected_score_of_a_random_tie_break():
    # "7" and "8" twice each: (value of "7" + value of "8") / 2 = (0 + 1) / 2
    assert majority_at_l([("7", 0.0), ("8", 1.0), ("8", 1.0), ("7", 0.0)]) == 0.5
    # three answers once each, one right: 1/3
    assert majority_at_l([("1", 0.0), ("2", 1.0), ("3", 0.0)]) == pytest.approx(1 / 3)


def test_majority_value_of_an_answer_is_the_mean_score_of_its_voters():
    # with reward penalties the voters of one answer can score differently: "5" is worth (1.0 + 0.5) / 2
    assert majority_at_l([("5", 1.0), ("5", 0.5), ("6", 0.0)]) == 0.75


def test_majority_without_any_vote_is_zero():
    assert majority_at_l([(None, 0.0), (None, 0.0)]) == 0.0 and majority_at_l([]) == 0.0


def test_query_metrics_majority_only_with_votes():
    rows = [{"query_id": "a", "score": 1.0, "valid": True, "vote": "3"},
            {"query_id": "a", "score": 0.0, "valid": True, "vote": "4"},
            {"query_id": "a", "score": 0.0, "valid": True, "vote": "4"},
            {"query_id": "a", "score": None, "valid": True, "vote": "3"},  # pending: neither in L nor a vote
            {"query_id": "b", "score": 0.0, "valid": False, "vote": "9"},  # invalid: counts 0, never votes
            {"query_id": "b", "score": 1.0, "valid": True, "vote": "2"}]
    a, b = query_metrics(rows)
    assert (a.workflows, a.mean_at_l, a.best_at_l, a.majority_at_l, a.pending) == (3, 1 / 3, 1.0, 0.0, 1)
    assert (b.workflows, b.mean_at_l, b.majority_at_l) == (2, 0.5, 1.0)
    assert split_summary([a, b])["majority_at_l"] == 0.5
    old = query_metrics([{"query_id": "a", "score": 1.0, "valid": True}])  # rows without votes (older callers)
    assert old[0].majority_at_l is None and split_summary(old)["majority_at_l"] is None


def test_vote_keys():
    assert vote_key("The answer is 1,444.", "procedural") == "1444"
    assert vote_key("[-67]", "procedural") == "-67" and vote_key("-67.0", "math") == "-67"
    assert vote_key("2.50", "gsm8k") == "2.5"
    assert vote_key(r"so \boxed{\frac{1}{2}}", "math") == r"\frac{1}{2}"
    assert vote_key("The  Eiffel tower!", "qa") == "eiffel tower"
    assert vote_key("def f():\n    return 1\n", "code") == "def f(): return 1"
    assert vote_key("", "qa") is None and vote_key(None, "math") is None and vote_key("  ", "code") is None


# ---- the store: query_usage, older parts, eval_summary --------------------------------------------------------------


def _gen(gid, qid, slot, prompt_len, out_len, valid=True, **kw):
    return {"gen_id": gid, "kind": "workflow", "query_id": qid, "slot": slot, "valid": valid,
            "prompt_token_ids": list(range(prompt_len)), "token_ids": list(range(out_len)), **kw}


def _run(gid, qid, status, score, answer, tin=0, tout=0, calls=0):
    return {"gen_id": gid, "query_id": qid, "rep": 0, "attempt": 0, "status": status, "score": score,
            "answer": answer, "tokens_in": tin, "tokens_out": tout, "llm_calls": calls}


@pytest.fixture
def eval_store(tmp_path):
    """Run `e`, round 0: q1 with four workflows, q2 with four slots of which slot 2 was repaired once."""
    st = Store(tmp_path)
    st.run_dir("e").mkdir(parents=True)
    (st.run_dir("e") / "config.yaml").write_text(RunConfig(run_id="e").to_yaml())
    st.write("generations", [
        _gen("a", "q1", 0, 10, 5), _gen("b", "q1", 1, 10, 7), _gen("c", "q1", 2, 10, 3),
        _gen("d", "q1", 3, 10, 9, valid=False),
        _gen("e", "q2", 0, 20, 1), _gen("f", "q2", 1, 20, 2), _gen("g", "q2", 2, 20, 4, attempt=0),
        _gen("g-fix1", "q2", 2, 30, 6, repair_of="g", attempt=1, cost_usd=0.5), _gen("h", "q2", 3, 20, 8),
    ], "e", 0)
    st.write("scores", [
        _run("a", "q1", "ok", 1.0, "42", 100, 10, 1), _run("b", "q1", "ok", 1.0, "The answer is 42."),
        _run("c", "q1", "ok", 0.0, "41", 50, 5, 1), _run("d", "q1", "invalid", 0.0, None),
        _run("e", "q2", "ok", 0.0, "7"), _run("f", "q2", "ok", 1.0, "8"), _run("g", "q2", "exec_error", 0.0, None),
        _run("g-fix1", "q2", "ok", 1.0, "8.0", 7, 3, 1), _run("h", "q2", "ok", 0.0, "7"),
    ], "e", 0)
    # the self-checks of g (failed: it was repaired) and of its repair, before scoring
    st.write("checks", [
        {"gen_id": "g", "query_id": "q2", "purpose": "repair", "status": "exec_error", "tokens_in": 11,
         "tokens_out": 2, "llm_calls": 1},
        {"gen_id": "g-fix1", "query_id": "q2", "purpose": "repair", "status": "ok", "tokens_in": 13, "tokens_out": 4,
         "llm_calls": 1, "cost_usd": 0.25},
    ], "e", 0)
    return st


def test_query_usage_view_hand_computed(eval_store):
    rows = {r["query_id"]: r for r in eval_store.sql("SELECT * FROM query_usage WHERE run_id = 'e'").to_dicts()}
    q1, q2 = rows["q1"], rows["q2"]
    # q1: prompts 4 x 10, completions 5 + 7 + 3 + 9; executor 100 + 50 in, 10 + 5 out, 2 calls
    assert (q1["workflows"], q1["gen_tokens_in"], q1["gen_tokens_out"]) == (4, 40, 24)
    assert (q1["exec_tokens_in"], q1["exec_tokens_out"], q1["exec_calls"], q1["checks"]) == (150, 15, 2, 0)
    # q2: prompts 4 x 20 + the repair's 30, completions 1 + 2 + 4 + 6 + 8; executor: the repair's scoring run
    # (7 in, 3 out) plus both self-checks (11 + 13 in, 2 + 4 out); cost: the repair's 0.5 and its check's 0.25
    assert (q2["workflows"], q2["gen_tokens_in"], q2["gen_tokens_out"]) == (5, 110, 21)
    assert (q2["exec_tokens_in"], q2["exec_tokens_out"], q2["exec_calls"], q2["checks"]) == (31, 9, 3, 2)
    assert (q2["gen_cost_usd"], q2["exec_cost_usd"]) == (0.5, 0.25)


def test_generation_scores_marks_the_last_attempt_of_a_repair_chain_final(eval_store):
    rows = {r["gen_id"]: r for r in eval_store.generation_scores("e", 0, 1, {"executor_error"}).to_dicts()}
    assert rows["g"]["final"] is False and rows["g-fix1"]["final"] is True and rows["a"]["final"] is True
    assert (rows["g-fix1"]["repair_of"], rows["g-fix1"]["attempt"], rows["a"]["attempt"]) == ("g", 1, 0)


def test_eval_summary_majority_and_tokens_hand_computed(eval_store):
    assert generation_votes(eval_store, "e", 0, "procedural")["b"] == "42"
    s = eval_summary(eval_store, "e")
    q1, q2 = s.per_query
    # q1: scores 1, 1, 0, invalid 0 -> Mean 0.5, Best 1; votes 42, 42, 41 -> Majority 1
    assert (q1["workflows"], q1["mean_at_l"], q1["best_at_l"], q1["majority_at_l"]) == (4, 0.5, 1.0, 1.0)
    # q2: L = e, f, g-fix1, h (g was repaired: not final) -> Mean 0.5; votes 7, 8, 8, 7: a tie -> (0 + 1) / 2
    assert (q2["workflows"], q2["mean_at_l"], q2["best_at_l"], q2["majority_at_l"]) == (4, 0.5, 1.0, 0.5)
    assert (s.mean_at_l, s.best_at_l, s.majority_at_l) == (0.5, 1.0, 0.75)
    # tokens per query: generator (64 + 131) / 2, executor (165 + 40) / 2; calls (2 + 3) / 2; cost 0.75 / 2
    assert (s.gen_tokens_per_query, s.exec_tokens_per_query) == (97.5, 102.5)
    assert (s.exec_calls_per_query, s.cost_usd_per_query) == (2.5, 0.375)
    assert (q2["gen_tokens_in"], q2["exec_tokens_out"]) == (110, 9)


def test_parts_written_before_the_new_columns_still_read(tmp_path):
    """A store from before cost accounting: generation parts without cost_usd / repair_of / attempt, no checks table."""
    st = Store(tmp_path)
    old = pa.schema([f for f in schema("generations") if f.name not in ("cost_usd", "repair_of", "attempt")])
    part = tmp_path / "r" / "round=0" / "generations" / "part-old.parquet"
    part.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"run_id": "r", "gen_id": "a", "kind": "workflow", "query_id": "q",
                                          "valid": True, "token_ids": [1, 2, 3]}], schema=old), part)
    st.write("generations", [{"gen_id": "b", "kind": "workflow", "query_id": "q", "valid": True,
                              "repair_of": "a", "attempt": 1}], "r", 0)
    df = st.read("generations", "r").sort("gen_id")
    assert df["repair_of"].to_list() == [None, "a"] and df["attempt"].to_list() == [None, 1]
    assert st.sql("SELECT gen_tokens_out, checks FROM query_usage").rows() == [(3, 0)]
    part2 = st.parts("generations", "r")
    for p in part2:
        if p != part:
            p.unlink()
    only_old = st.sql("SELECT gen_id, repair_of, attempt, final FROM generation_scores")
    assert only_old.rows() == [("a", None, 0, True)]
