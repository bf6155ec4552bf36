"""Your own task (docs/tasks.md): a dataset in any of the supported formats with a column map, the built-in scorers,
a user's scorer in its worker process (its failures as status `error`, re-scored by --only-failed), the entry-point
registry with a plugin package built here, `pipeline validate` and `pipeline tasks`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import BenchmarkConfig, ConfigError, config_from_dict, task_entry_points
from pipeline.engines.benchmarks import BenchmarkError, load_benchmark
from pipeline.engines.benchmarks.base import Item, ScorerError, ScorerStopped
from pipeline.engines.benchmarks.metrics import choice_letter
from pipeline.engines.benchmarks.tasks import FileTask, ScorerWorker, check_task, list_tasks, regex_candidate
from pipeline.engines.benchmarks.user_scorer import checked_score

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "unit-conversion"
runner = CliRunner()

ROWS = [
    {"id": "q1", "question": "How many grams are in 2 kilograms?", "answer": "2000", "kind": "mass", "unit": "grams"},
    {"id": "q2", "question": "How many minutes are in 3 hours?", "answer": "180", "kind": "time", "unit": "minutes"},
    {"id": "q3", "question": "How many metres are in 4 kilometres?", "answer": "4000", "kind": "length",
     "unit": "metres"},
]
COLUMNS = {"query": "question", "answer": "answer", "id": "id", "label": "kind"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task(path: Path, **fields) -> FileTask:
    return load_benchmark(BenchmarkConfig(name="file", path=str(path), columns=COLUMNS, **fields))


# ---- the dataset: formats and the column map -----------------------------------------------------------------------


def _write(fmt: str, folder: Path) -> Path:
    if fmt == "jsonl":
        return write_jsonl(folder / "d.jsonl", ROWS)
    if fmt == "json":
        (folder / "d.json").write_text(json.dumps(ROWS))
        return folder / "d.json"
    if fmt == "csv":
        with (folder / "d.csv").open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(ROWS[0]))
            w.writeheader()
            w.writerows(ROWS)
        return folder / "d.csv"
    pl.DataFrame(ROWS).write_parquet(folder / "d.parquet")
    return folder / "d.parquet"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_format_gives_the_same_items(tmp_path, fmt):
    items = task(_write(fmt, tmp_path)).load()
    assert [it.id for it in items] == ["q1", "q2", "q3"]
    assert items[1].prompt == "How many minutes are in 3 hours?"
    # the answer is the reference; the unmapped column is metadata; the label is the item's part
    assert items[1].reference == {"answer": "180", "metadata": {"unit": "minutes"}}
    assert items[1].meta["label"] == "time"


def test_a_folder_saved_by_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    items = task(tmp_path / "saved").load()
    assert [(it.id, it.reference["answer"], it.meta["label"]) for it in items] == [
        ("q1", "2000", "mass"), ("q2", "180", "time"), ("q3", "4000", "length")]


def test_without_an_id_column_the_row_index_names_the_item(tmp_path):
    path = write_jsonl(tmp_path / "units.jsonl", ROWS)
    items = load_benchmark(BenchmarkConfig(name="file", path=str(path))).load()  # columns question/answer by default
    assert [it.id for it in items] == ["units-0", "units-1", "units-2"]
    assert items[0].reference["metadata"] == {"id": "q1", "kind": "mass", "unit": "grams"}


def test_bad_rows_are_all_named_with_file_line_and_field_in_one_pass(tmp_path):
    rows = [ROWS[0], {"id": "q2", "answer": "180", "kind": "time"},  # no question
            {**ROWS[2], "answer": "  "},  # an empty answer
            {**ROWS[1], "id": "q1"}]  # the id of line 1 again
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in rows]
    # line 2 is not JSON: the other lines are still read and checked (they were hidden behind it)
    path.write_text("\n".join([lines[0], '{"id": "q9" "question": "a comma left out"}', *lines[1:]]) + "\n")
    with pytest.raises(BenchmarkError) as err:
        task(path).load()
    msg = str(err.value)
    assert "4 bad row(s)" in msg
    assert f"{path}:2: invalid JSON (Expecting ',' delimiter)" in msg
    assert f"{path}:3: missing column 'question' (benchmark.columns.query); the row has: answer, id, kind" in msg
    assert f"{path}:4: field 'answer' (benchmark.columns.answer) is empty" in msg
    assert f"{path}:5: field 'id' (benchmark.columns.id): duplicate id 'q1' (first at {path}:1)" in msg
    assert msg.index(f"{path}:2:") < msg.index(f"{path}:3:")  # in file order


def test_unreadable_lines_are_all_named_and_do_not_shift_the_row_index(tmp_path):
    from pipeline.engines.benchmarks.files import read_rows

    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\n{"a": 2}\n{oops\n')
    with pytest.raises(BenchmarkError) as err:  # a shipped benchmark's read: every unreadable line at once
        read_rows(path)
    assert str(err.value) == (f"2 unreadable lines in {path}:\n  {path}:2: expected a JSON object per line\n  "
                              f"{path}:4: invalid JSON (Expecting property name enclosed in double quotes)")
    rows = read_rows(path, keep_bad=True)
    assert [(r.where, r.problem) for r in rows if r.problem] == [
        (f"{path}:2", "expected a JSON object per line"),
        (f"{path}:4", "invalid JSON (Expecting property name enclosed in double quotes)")]
    assert [(r.data, r.index) for r in rows if not r.problem] == [({"a": 1}, 0), ({"a": 2}, 1)]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.json").write_text('{"a": 1}')
    (folder / "b.json").write_text('{"a": \n')
    (folder / "c.json").write_text("[]")
    rows = read_rows(folder, keep_bad=True)
    assert [(Path(r.where).name, r.problem) for r in rows] == [
        ("a.json", None), ("b.json:2", "invalid JSON (Expecting value)"),
        ("c.json", "expected one JSON object per file")]


def test_csv_errors_name_the_line(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("id,question,answer,kind\nq1,How many grams are in 2 kilograms?,2000,mass\nq2,,180,time\n")
    with pytest.raises(BenchmarkError, match=rf"{path}:3: field 'question' \(benchmark.columns.query\) is empty"):
        task(path).load()


def test_missing_data_file_and_unknown_format(tmp_path):
    with pytest.raises(BenchmarkError, match="benchmark.path .*nope.jsonl not found"):
        task(tmp_path / "nope.jsonl").load()
    (tmp_path / "d.xlsx").write_text("x")
    with pytest.raises(BenchmarkError, match=r"unsupported file type '.xlsx'; use .jsonl, .json, .csv"):
        task(tmp_path / "d.xlsx").load()


def test_splits_work_as_for_shipped_benchmarks(tmp_path):
    rows = [{"id": f"r{i}", "question": f"q{i}", "answer": "1", "kind": "k"} for i in range(10)]
    bench = task(write_jsonl(tmp_path / "d.jsonl", rows), test_share=0.5)
    # 10 rows, test_share 0.5: round(10 * 0.5) = 5 validate, 5 test, disjoint, every row in one of them
    validate, test = {it.id for it in bench.items("validate")}, {it.id for it in bench.items("test")}
    assert len(validate) == 5 and len(test) == 5 and validate | test == {f"r{i}" for i in range(10)}


# ---- built-in scorers ----------------------------------------------------------------------------------------------


def _item(answer, **metadata) -> Item:
    return Item("i", "q", {"answer": answer, "metadata": metadata}, {})


def test_builtin_scorers_by_hand(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    exact, text = task(path, scorer="exact"), task(path, scorer="text")
    assert exact.score(_item("Paris"), " Paris\n").score == 1.0 and exact.score(_item("Paris"), "paris").score == 0.0
    assert text.score(_item("The Eiffel Tower"), "eiffel tower.").score == 1.0  # case, article, punctuation
    assert text.score(_item("Eiffel Tower"), "Tower").score == 0.0
    number = task(path, scorer="number", tolerance=0.01)
    assert number.score(_item("2000"), "That is 2,010 grams").score == 1.0  # |2010 - 2000| = 10 <= 0.01 * 2010
    assert number.score(_item("2000"), "That is 2,030 grams").score == 0.0  # 30 > 20.3
    choice = task(path, scorer="choice")
    assert choice.score(_item("B"), "The answer is (B).").score == 1.0
    assert choice.score(_item("(C)"), "A is wrong, so B").score == 0.0
    regex = task(path, scorer="regex", pattern=r"answer: (\w+)")
    assert regex.score(_item("Blue"), "I think answer: red. No, answer: blue").score == 1.0  # the last match
    assert regex.score(_item("Blue"), "blue").score == 0.0  # nothing matches the pattern
    assert task(path, scorer="math").score(_item("\\frac{1}{2}"), "so \\boxed{0.5}").score == 1.0


def test_choice_letter_and_regex_candidate():
    assert choice_letter("**D**") == "D" and choice_letter("Answer: C.") == "C" and choice_letter("none") is None
    assert regex_candidate(r"\d+", "3 then 41") == "41" and regex_candidate(r"x=(\d)", "x=1, x=2") == "2"


def test_regex_scorer_needs_a_pattern_and_unknown_scorers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="scorer regex needs benchmark.pattern"):
        BenchmarkConfig(name="file", scorer="regex")
    with pytest.raises(ValueError, match="scorer 'fuzzy': use a built-in .* or your function as module:function"):
        BenchmarkConfig(name="file", scorer="fuzzy")


@pytest.mark.usefixtures("shared_sandbox")  # unit tests run in the default sandbox
def test_unit_tests_scorer_runs_the_tests_in_the_sandbox(tmp_path):
    rows = [{"id": "add", "question": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
             "entry_point": "add", "solution": "def add(a, b):\n    return a + b\n"}]
    bench = load_benchmark(BenchmarkConfig(name="file", path=str(write_jsonl(tmp_path / "c.jsonl", rows)),
                                           columns={"answer": "tests", "query": "question", "id": "id"},
                                           scorer="unit_tests"))
    assert bench.family == "code"
    item = bench.load()[0]
    good = bench.score(item, "```python\ndef add(a, b):\n    return a + b\n```")
    assert good.score == 1.0 and good.details["passed"] == 2
    bad = bench.score(item, "def add(a, b):\n    return a - b\n")
    assert bad.score == 0.0 and bad.details["status"] == "fail"
    check = check_task(bench)  # the `solution` column is the reference answer validate runs the tests against
    assert check.checked == 1 and check.problems == []


# ---- the user's scorer ---------------------------------------------------------------------------------------------

BROKEN = '''import time


def score(answer, reference, mode="ok", **metadata):
    if mode == "raise":
        raise ValueError("no unit in " + answer)
    if mode == "nan":
        return float("nan")
    if mode == "range":
        return 1.5
    if mode == "text":
        return "yes"
    if mode == "hang":
        time.sleep(3600)
    return (float(answer.strip() == reference), {"seen": metadata})
'''
FIXED = '''def score(answer, reference, **metadata):
    return float(answer.strip() == reference)
'''


def test_checked_score_by_hand():
    assert checked_score(1) == (1.0, {}) and checked_score((0.25, {"a": 1})) == (0.25, {"a": 1})
    for bad, said in [(float("nan"), "nan, outside [0, 1]"), (-0.1, "-0.1, outside [0, 1]"), (True, "bool"),
                      ("1", "str '1'"), ((1.0, "x"), "expected a float or (float, details dict)"), (None, "NoneType")]:
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            checked_score(bad)


def test_user_scorer_failures_are_row_errors_and_a_hang_is_killed(tmp_path):
    scorer = tmp_path / "scorer.py"
    scorer.write_text(BROKEN)
    worker = ScorerWorker(f"{scorer}:score", timeout_s=1)
    try:
        ok = worker("42", "42", {"unit": "m"})
        assert ok.score == 1.0 and ok.details == {"seen": {"unit": "m"}}
        with pytest.raises(ScorerError, match="ValueError: no unit in 42"):
            worker("42", "42", {"mode": "raise"})
        with pytest.raises(ScorerError, match=r"returned nan, outside \[0, 1\]"):
            worker("42", "42", {"mode": "nan"})
        with pytest.raises(ScorerError, match=r"returned 1.5, outside \[0, 1\]"):
            worker("42", "42", {"mode": "range"})
        pid = worker._proc.pid
        with pytest.raises(ScorerError, match=r"ran past its timeout of 1 s \(benchmark.scorer_timeout_s\) and was "
                                              "killed"):
            worker("42", "42", {"mode": "hang"})
        assert worker._proc is None and not Path(f"/proc/{pid}").exists()  # killed and reaped, not waited on
        assert worker("41", "42", {}).score == 0.0  # a new worker answers the next row
    finally:
        worker.stop()


def test_a_scorer_that_cannot_load_says_so(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    worker = ScorerWorker(f"{tmp_path / 'broken.py'}:score", timeout_s=3)
    with pytest.raises(ScorerError, match="cannot load the scorer: ModuleNotFoundError: No module named "
                                          "'no_such_module_here'"):
        worker("1", "1", {})
    with pytest.raises(BenchmarkError, match=r"benchmark.scorer '.*missing.py:score': file .*missing.py not found"):
        task(write_jsonl(tmp_path / "d.jsonl", ROWS), scorer=str(tmp_path / "missing.py") + ":score")
    with pytest.raises(BenchmarkError, match="no module 'no_such_module_here' on the path"):
        task(write_jsonl(tmp_path / "d.jsonl", ROWS), scorer="no_such_module_here:score")


def counting_scorer(folder: Path, body: str) -> tuple[str, Path]:
    """A scorer file whose every call first appends a line to a counter file, then runs `body`: (its spec, the
    counter)."""
    counter = folder / "calls.txt"
    (folder / "counted.py").write_text(
        "import time\n\n\ndef score(answer, reference, **metadata):\n"
        f"    with open({str(counter)!r}, 'a') as fh:\n        fh.write('call\\n')\n    {body}\n")
    return f"{folder / 'counted.py'}:score", counter


def calls(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def test_a_hanging_scorer_is_called_on_its_first_rows_only(tmp_path):
    spec, counter = counting_scorer(tmp_path, "time.sleep(3600)")
    data = write_jsonl(tmp_path / "d.jsonl", [{**ROWS[i % 3], "id": f"r{i}"} for i in range(6)])
    bench = task(data, scorer=spec, scorer_timeout_s=0.2, scorer_stop_after=2)
    check = check_task(bench)
    assert calls(counter) == 2  # rows 1-2 timed out; rows 3-6 were never sent to it
    assert (check.checked, check.failed, check.not_scored) == (2, 2, 4)
    timeout = f"ScorerError: scorer {spec}: ran past its timeout of 0.2 s (benchmark.scorer_timeout_s) and was killed"
    assert [p.message for p in check.problems[:2]] == [timeout] * 2
    stopped = check.problems[2:]
    assert [p.item_id for p in stopped] == ["r2", "r3", "r4", "r5"] and not any(p.scored for p in stopped)
    assert stopped[0].message == ("not scored: the scorer failed the same way on its first 2 calls, so it is called "
                                  f"no more (benchmark.scorer_stop_after): {timeout.removeprefix('ScorerError: ')}")
    # a new task (as the next `pipeline validate` or `pipeline score --only-failed` makes) calls the fixed scorer again
    (tmp_path / "counted.py").write_text(FIXED)
    again = task(data, scorer=spec, scorer_timeout_s=0.2, scorer_stop_after=2)
    assert again.score(again.load()[3], "2000").score == 1.0  # r3: q1's answer


def test_the_scorer_is_stopped_only_when_its_first_calls_fail_the_same_way(tmp_path):
    scorer = tmp_path / "scorer.py"
    scorer.write_text(BROKEN)
    mixed = ScorerWorker(f"{scorer}:score", timeout_s=3, stop_after=3)
    modes = ["raise", "nan", "raise", "raise", "raise", "raise"]  # calls 1-3 fail in two ways: row-dependent
    for mode in modes:
        with pytest.raises(ScorerError) as err:
            mixed("42", "42", {"mode": mode})
        assert not isinstance(err.value, ScorerStopped)
    one_ok = ScorerWorker(f"{scorer}:score", timeout_s=3, stop_after=3)
    assert one_ok("42", "42", {}).score == 1.0  # one of the first calls scored: never stopped
    for _ in range(4):
        with pytest.raises(ScorerError, match="returned nan") as err:
            one_ok("42", "42", {"mode": "nan"})
        assert not isinstance(err.value, ScorerStopped)
    same = ScorerWorker(f"{scorer}:score", timeout_s=3, stop_after=2)
    for _ in range(3):  # one input thrice counts once: it says nothing of the other answers
        with pytest.raises(ScorerError, match="returned nan") as err:
            same("junk", "42", {"mode": "nan"})
        assert not isinstance(err.value, ScorerStopped)
    with pytest.raises(ScorerError, match="returned nan"):
        same("other junk", "42", {"mode": "nan"})  # the second input failing the same way: stopped
    with pytest.raises(ScorerStopped, match="not scored: the scorer failed the same way on its first 2 calls"):
        same("42", "42", {})  # not called (it would have scored 1.0)
    never = ScorerWorker(f"{scorer}:score", timeout_s=3, stop_after=0)
    for _ in range(4):
        with pytest.raises(ScorerError, match="returned nan") as err:
            never("42", "42", {"mode": "nan"})
        assert not isinstance(err.value, ScorerStopped)
    for worker in (mixed, one_ok, same, never):
        worker.stop()


def test_validate_groups_identical_errors_with_their_count_and_first_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec, counter = counting_scorer(tmp_path, "return float('nan')")
    data = write_jsonl(tmp_path / "q.jsonl", [{**ROWS[i % 3], "id": f"r{i}"} for i in range(5)])
    base = ["validate", "examples/unit-conversion/config.yaml", "--set", f"benchmark.path={data}",
            "--set", f"benchmark.scorer={spec}"]
    nan = f"ScorerError: scorer {spec}: ValueError: returned nan, outside [0, 1]"
    r = runner.invoke(app, [*base, "--set", "benchmark.scorer_stop_after=0"])  # never stopped: called on every row
    assert r.exit_code == 1 and calls(counter) == 5
    assert "5 of 5 reference answers do not score 1.0 with the scorer:" in r.output
    assert f"  5 rows: {nan}\n    at {data}:1 (id r0), {data}:2 (id r1), {data}:3 (id r2) and 2 more\n" in r.output
    assert r.output.count("returned nan") == 1  # one entry, not five
    counter.unlink()
    r = runner.invoke(app, base)  # the default: stopped after its first 3 calls
    assert r.exit_code == 1 and calls(counter) == 3
    assert "3 of 3 reference answers do not score 1.0 with the scorer; 2 not scored:" in r.output
    assert f"  3 rows: {nan}\n    at {data}:1 (id r0), {data}:2 (id r1), {data}:3 (id r2)\n" in r.output
    assert (f"  2 rows: not scored: the scorer failed the same way on its first 3 calls, so it is called no more "
            f"(benchmark.scorer_stop_after): {nan.removeprefix('ScorerError: ')}\n    at {data}:4 (id r3), "
            f"{data}:5 (id r4)\n") in r.output


def test_group_errors_keeps_the_order_count_and_first_rows():
    from pipeline.engines.benchmarks.base import ErrorGroup, group_errors

    pairs = [("a", "x"), ("b", "y"), ("c", "x"), ("d", "x"), ("e", "x")]
    assert group_errors(pairs, shown=2) == [ErrorGroup("x", 4, ("a", "c")), ErrorGroup("y", 1, ("b",))]


# ---- the score stage with a failing scorer: status error, the stage goes on, --only-failed re-scores ---------------


def _stored_round(tmp_path: Path, workflow: str, benchmark: dict, limit: int | None = None) -> tuple[Path, str]:
    """A run whose round 0 holds the task's first `limit` items as queries and `workflow` once per query (no
    rollout)."""
    from pipeline.run import open_run

    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg.update(run_id="t", store={"root": str(tmp_path / "store")}, benchmark=benchmark,
               scoring={"timeout_s": 20, "cpu_time_s": 10, "concurrency": 2},
               executor={"kind": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1", "max_retries": 0,
                         "timeout_s": 2})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ctx = open_run(path, "t", 0)
    items = load_benchmark(ctx.cfg.benchmark).load()[:limit]
    ctx.store.write("queries", [{"split": "validate", "query_id": it.id, "benchmark": ctx.cfg.benchmark.name,
                                 "prompt": it.prompt, "reference": json.dumps(it.reference),
                                 "meta": json.dumps(it.meta)} for it in items], "t", 0)
    ctx.store.write("generations", [{"gen_id": f"{it.id}#0", "kind": "workflow", "query_id": it.id, "slot": 0,
                                     "text": workflow} for it in items], "t", 0)
    return path, str(tmp_path / "store")


ANSWER_42 = "async def solve(problem):\n    return '42'\n"


@pytest.mark.usefixtures("shared_sandbox")
def test_score_stage_stores_scorer_failures_as_errors_and_only_failed_rescores_them(tmp_path):
    from pipeline.run import open_run
    from pipeline.stages.score import run_score
    from pipeline.store import Store

    scorer = tmp_path / "scorer.py"
    scorer.write_text(BROKEN)
    rows = [{"id": "ok", "question": "Say 42.", "answer": "42"},
            {"id": "raises", "question": "Say 42.", "answer": "42", "mode": "raise"},
            {"id": "nan", "question": "Say 42.", "answer": "42", "mode": "nan"},
            {"id": "text", "question": "Say 42.", "answer": "42", "mode": "text"},
            {"id": "hangs", "question": "Say 42.", "answer": "42", "mode": "hang"},
            {"id": "wrong", "question": "Say 41.", "answer": "41"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    bench = {"name": "file", "path": str(data), "columns": {"id": "id"}, "scorer": f"{scorer}:score",
             "scorer_timeout_s": 1}
    path, root = _stored_round(tmp_path, ANSWER_42, bench)
    out = run_score(open_run(path, "t", 0))
    # every row has its final status: the stage finished (manifest written) with the scorer's failures in it
    assert out["done"] is True and out["by_status"] == {"ok": 2, "error": 4}
    st = Store(root)
    errors = st.sql("SELECT query_id, error, answer FROM latest_scores WHERE status = 'error' ORDER BY query_id")
    by_query = dict(zip(errors["query_id"], errors["error"], strict=True))
    assert sorted(by_query) == ["hangs", "nan", "raises", "text"]
    assert by_query["raises"].endswith("ValueError: no unit in 42")
    assert "returned nan, outside [0, 1]" in by_query["nan"] and "returned str 'yes'" in by_query["text"]
    assert "ran past its timeout of 1 s (benchmark.scorer_timeout_s) and was killed" in by_query["hangs"]
    assert errors["answer"].to_list() == ["42"] * 4  # the workflow's answer is kept with the error
    ok = st.sql("SELECT query_id, metric FROM latest_scores WHERE status = 'ok' ORDER BY query_id")
    assert dict(zip(ok["query_id"], ok["metric"], strict=True)) == {"ok": 1.0, "wrong": 0.0}
    # curation leaves a query whose scorer failed out, rather than reading the failure as a wrong answer
    states = st.generation_scores("t", 0, 1, set())
    assert dict(zip(states["query_id"], states["state"], strict=True))["raises"] == "scorer_error"

    # a plain re-run re-scores nothing; after the fix, --only-failed re-scores the four as attempt 1
    assert run_score(open_run(path, "t", 0))["ran"] == 0
    scorer.write_text(FIXED)
    again = run_score(open_run(path, "t", 0), only_failed=True)
    assert again["ran"] == 4 and again["by_status"] == {"ok": 6}
    latest = st.sql("SELECT query_id, attempt, metric FROM latest_scores ORDER BY query_id")
    assert latest.rows() == [("hangs", 1, 1.0), ("nan", 1, 1.0), ("ok", 0, 1.0), ("raises", 1, 1.0),
                             ("text", 1, 1.0), ("wrong", 0, 0.0)]
    assert st.sql("SELECT count(*) AS n FROM scores")["n"][0] == 10  # the failed attempts are kept


@pytest.mark.usefixtures("shared_sandbox")
def test_score_stage_stops_a_hanging_scorer(tmp_path, caplog):
    """The stage's rows of a stopped scorer are status `error` like any scorer failure, which --only-failed re-scores
    (test_score_stage_stores_scorer_failures_as_errors_and_only_failed_rescores_them)."""
    from pipeline.run import open_run
    from pipeline.stages.score import run_score
    from pipeline.store import Store

    spec, counter = counting_scorer(tmp_path, "time.sleep(3600)")
    # three references: three different inputs to the scorer (the workflow answers 42 to each)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "question": "Say 42.", "answer": f"4{i}"}
                                              for i in range(3)])
    bench = {"name": "file", "path": str(data), "columns": {"id": "id"}, "scorer": spec, "scorer_timeout_s": 0.2,
             "scorer_stop_after": 2}
    path, root = _stored_round(tmp_path, ANSWER_42, bench)
    with caplog.at_level("WARNING", logger="pipeline.stages.score"):
        out = run_score(open_run(path, "t", 0))
    assert out["done"] is True and out["by_status"] == {"error": 3}
    assert calls(counter) == 2  # 2 timeouts, then no more calls
    errors = Store(root).sql("SELECT error FROM latest_scores")["error"].to_list()
    assert sum("ran past its timeout of 0.2 s" in e and "not scored" not in e for e in errors) == 2
    assert sum(e.startswith("metric failed: ScorerStopped: not scored: the scorer failed the same way on its first 2 "
                            "calls") for e in errors) == 1
    # one log line per distinct error, with its count
    grouped = sorted(r.getMessage().split(": ")[1] for r in caplog.records if "with status error" in r.getMessage())
    assert grouped == ["1 run(s) with status error", "2 run(s) with status error"]


# ---- the registry: names, plugins ----------------------------------------------------------------------------------


def test_unknown_task_names_the_installed_ones():
    with pytest.raises(ConfigError, match=r"unknown task 'gsm9k'; installed tasks: .*file, gsm8k, hotpotqa, humaneval"):
        config_from_dict({"benchmark": {"name": "gsm9k"}}, "c.yaml")


def test_an_install_older_than_the_entry_points_reads_them_from_pyproject(monkeypatch, tmp_path):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])  # metadata without the group
    monkeypatch.syspath_prepend(str(tmp_path))  # another sys.path: the entry points are read anew
    found = task_entry_points()
    assert sorted(found) == ["drop", "file", "gsm8k", "hotpotqa", "humaneval", "math", "mbpp", "procedural"]
    assert found["file"].value == "pipeline.engines.benchmarks.tasks:file_task"


PLUGIN_INIT = '''from pathlib import Path

from pipeline.engines.benchmarks.tasks import file_task


def task(cfg):
    return file_task(cfg, path=Path(__file__).with_name("questions.jsonl"), scorer="unit_plugin.scoring:score",
                     columns={"query": "question", "answer": "answer", "id": "id", "label": "kind"})
'''
PLUGIN_PYPROJECT = '''[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "unit-plugin"
version = "0.1"

[project.entry-points."workflow_grpo.tasks"]
unit-conversion = "unit_plugin:task"
broken = "unit_plugin.missing:task"

[tool.setuptools]
packages = ["unit_plugin"]

[tool.setuptools.package-data]
unit_plugin = ["questions.jsonl"]
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The example task as a plugin package, built and installed (pip --target) into a folder of its own."""
    src = tmp_path_factory.mktemp("plugin-src")
    (src / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    pkg = src / "unit_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGIN_INIT)
    (pkg / "scoring.py").write_text((EXAMPLE / "score.py").read_text())
    (pkg / "questions.jsonl").write_text((EXAMPLE / "questions.jsonl").read_text())
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return site


def test_an_installed_plugin_task_is_found_listed_and_scored(plugin_site, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(plugin_site))
    cfg = config_from_dict({"benchmark": {"name": "unit-conversion", "test_share": 0.5}}, "c.yaml").benchmark
    bench = load_benchmark(cfg)
    items = bench.load()
    assert len(items) == 100 and bench.family == "procedural" and bench.scorer_name == "unit_plugin.scoring:score"
    assert items[0].id == "length-000" and items[0].reference["metadata"] == {"unit": "metres"}
    assert cfg.test_share == 0.5  # the config's fields win over the plugin's defaults; the rest are the plugin's
    by_id = {it.id: it for it in items}
    assert bench.score(by_id["length-000"], "It is 2500 metres.").score == 1.0  # 2.5 km
    assert bench.score(by_id["length-000"], "It is 250 metres.").score == 0.0
    bench.close()
    listed = {t.name: t for t in list_tasks()}
    assert listed["unit-conversion"].size == 100 and listed["unit-conversion"].scorer == "unit_plugin.scoring:score"
    assert listed["unit-conversion"].source == "unit_plugin:task (unit-plugin)"
    assert listed["procedural"].source.startswith("pipeline.engines.benchmarks.procedural:Procedural (workflow")
    # a plugin whose entry point does not import is listed with its error, and refused by name when used
    assert listed["broken"].size is None and "No module named 'unit_plugin.missing'" in listed["broken"].note
    with pytest.raises(BenchmarkError, match=r"task 'broken': its entry point 'unit_plugin.missing:task' does not "
                                             r"load: ModuleNotFoundError"):
        load_benchmark(BenchmarkConfig(name="broken"))


@pytest.mark.usefixtures("shared_sandbox")
def test_a_plugin_task_runs_the_score_stage(plugin_site, monkeypatch, tmp_path):
    from pipeline.run import open_run
    from pipeline.stages.score import run_score
    from pipeline.store import Store

    monkeypatch.syspath_prepend(str(plugin_site))
    workflow = "async def solve(problem):\n    return '2500' if 'kilometres' in problem else 'no idea'\n"
    path, root = _stored_round(tmp_path, workflow, {"name": "unit-conversion"}, limit=4)
    out = run_score(open_run(path, "t", 0))
    assert out["done"] is True and out["by_status"] == {"ok": 4}
    got = Store(root).sql("SELECT query_id, metric FROM latest_scores WHERE metric = 1 ORDER BY query_id")
    # the one question whose answer is 2500: 2.5 kilometres (examples/unit-conversion/questions.jsonl line 1)
    assert got["query_id"].to_list() == ["length-000"]


# ---- the commands --------------------------------------------------------------------------------------------------


def test_validate_prints_the_task_and_scores_every_reference(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = runner.invoke(app, ["validate", "examples/unit-conversion/config.yaml"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "task file: 100 rows, scorer examples/unit-conversion/score.py:score"
    # 100 rows, test_share 0.4: validate round(100 * 0.6) = 60, test 40; dev_share 0.5: dev 30, train 30
    assert lines[1] == "splits: validate 60, train 30, dev 30, test 40 (benchmark.train_split train: 6 queries a round)"
    assert lines[2] == "labels: length 20, mass 20, time 20, volume 20, data 20"
    assert lines[3] == "references: 100 of 100 score 1.0"


def test_validate_names_each_row_whose_reference_does_not_score_one(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = [json.loads(x) for x in (EXAMPLE / "questions.jsonl").read_text().splitlines()]
    rows[4]["answer"] = "7000.5"
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    # a pattern that misses decimals: from "7000.5" it extracts the last run of digits, "5"
    r = runner.invoke(app, ["validate", "examples/unit-conversion/config.yaml", "--set", f"benchmark.path={data}",
                            "--set", "benchmark.scorer=regex", "--set", r"benchmark.pattern=\d+"])
    assert r.exit_code == 1
    assert "1 of 100 reference answers do not score 1.0 with the scorer:" in r.output
    assert f"{data}:5 (id {rows[4]['id']}): its reference answer '7000.5' scores 0" in r.output
    # a scorer that raises on a reference is named with its row too
    broken = tmp_path / "s.py"
    broken.write_text("def score(answer, reference, **metadata):\n    return float(answer) / 0\n")
    r = runner.invoke(app, ["validate", "examples/unit-conversion/config.yaml",
                            "--set", f"benchmark.scorer={broken}:score"])
    # failing the same way on its first 3 rows, it is called on no other: 97 rows not scored
    assert r.exit_code == 1 and "3 of 3 reference answers do not score 1.0 with the scorer; 97 not scored" in r.output
    assert "  3 rows: ScorerError: scorer" in r.output and "ZeroDivisionError: float division by zero" in r.output
    assert ("    at examples/unit-conversion/questions.jsonl:1 (id length-000), examples/unit-conversion/questions."
            "jsonl:2 (id length-001), examples/unit-conversion/questions.jsonl:3 (id length-002)\n") in r.output
    assert "  97 rows: not scored: the scorer failed the same way on its first 3 calls" in r.output


def test_validate_refuses_bad_rows_before_scoring(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = write_jsonl(tmp_path / "q.jsonl", [ROWS[0], {**ROWS[1], "id": "q1"}])
    r = runner.invoke(app, ["validate", "examples/unit-conversion/config.yaml", "--set", f"benchmark.path={data}"])
    assert r.exit_code == 2 and f"{data}:2: field 'id' (benchmark.columns.id): duplicate id 'q1'" in r.output


def test_tasks_lists_every_installed_task(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = runner.invoke(app, ["tasks", "examples/unit-conversion/config.yaml"])
    assert r.exit_code == 0, r.output
    lines = {line.split()[0]: line for line in r.output.splitlines() if line.strip()}
    assert {"file", "gsm8k", "humaneval", "mbpp", "math", "drop", "hotpotqa", "procedural"} <= set(lines)
    assert "100 items" in lines["file"] and "examples/unit-conversion/score.py:score" in lines["file"]
    assert "164 items" in lines["humaneval"] and "unit tests (sandbox)" in lines["humaneval"]
    assert "needs data" in lines["gsm8k"] or "benchmark.path" in lines["gsm8k"]


# ---- the worked example, one round end to end ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_example_runs_a_round_on_the_smoke_model(tmp_path, monkeypatch):
    """examples/unit-conversion/config.yaml as `pipeline run` runs it (the smoke model offline), at tiny sizes: the
    task comes from the JSONL file and the five-line scorer, with no edit under pipeline/."""
    from pipeline.stages.rounds import direct_call, run_rounds
    from pipeline.stages.runner import RetryPolicy
    from pipeline.store import Store

    monkeypatch.chdir(ROOT)
    sets = [f"store.root={tmp_path / 'runs'}", "benchmark.max_queries=2", "rollout.m=2", "generator.max_new_tokens=48",
            "executor.max_tokens=16", "scoring.max_llm_calls=2"]
    call = direct_call(RetryPolicy(delay_s=0), isolate=False)  # every stage in this process: no child's imports
    out = run_rounds("examples/unit-conversion/config.yaml", 1, "uc", call, sets=sets)
    st = Store(tmp_path / "runs")
    assert [st.manifest("uc", 0, s) is not None for s in ("rollout", "score", "curate", "train")] == [True] * 4
    queries = st.read("queries", "uc", 0)
    file_ids = {json.loads(x)["id"] for x in (EXAMPLE / "questions.jsonl").read_text().splitlines()}
    assert queries.height == 2 and set(queries["query_id"]) <= file_ids and set(queries["benchmark"]) == {"file"}
    assert set(queries["split"]) == {"train"}  # the config trains on `train`
    runs = st.sql("SELECT status FROM latest_scores WHERE run_id = 'uc'")
    assert runs.height == 4  # 2 queries x 2 workflows x 1 rep, each with a final status
    assert set(runs["status"]) <= {"ok", "invalid", "exec_error", "timeout", "killed"}  # no scorer error
    assert len(out.rounds) == 1
