"""Your own task from files (`benchmark.name: file`, docs/tasks.md): a local dataset, a column map and a scorer.

The dataset is JSONL, JSON, CSV, Parquet or a folder saved by `datasets` (files.read_rows); `benchmark.columns`
names the query, the reference answer, an optional id and an optional part label; every other column is metadata.
The scorer is a built-in (SCORER_BUILTINS: the shipped metrics) or the user's function, named `module:function` or
`path/to/file.py:function` and called as `score(answer, reference, **metadata)`, returning a float in [0, 1] or
(float, details).

A user's function is untrusted for the run's sake: it runs in a worker process of its own (ScorerWorker), one call at
a time under `benchmark.scorer_timeout_s`; a call that raises, returns no number in [0, 1] (NaN included) or runs past
its timeout (the worker is killed and restarted) raises ScorerError, which the score stage stores as status `error`
with the message, and goes on. When its first `benchmark.scorer_stop_after` calls all fail the same way, it is called
no more (ScorerStopped: the other rows are `error`, not scored), so a scorer that hangs costs a few timeouts, not one
per row.

A plugin package registers a task as an entry point of the group `workflow_grpo.tasks` (a Benchmark class, or a
function of the BenchmarkConfig returning one): `file_task(cfg, path=..., scorer=...)` makes a file task whose
defaults come from the package and whose config fields, where set, win.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import subprocess
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import SCORER_BUILTINS, BenchmarkConfig, task_entry_points
from pipeline.engines.benchmarks.base import (
    Benchmark,
    BenchmarkError,
    Item,
    MetricResult,
    ScorerError,
    ScorerStopped,
    group_errors,
    split_items,
)
from pipeline.engines.benchmarks.code import CodeBenchmark, Suite
from pipeline.engines.benchmarks.files import Row, read_rows
from pipeline.engines.benchmarks.metrics import (
    choice_letter,
    math_score,
    normalize_answer,
    numeric_score,
    stop_worker,
)

if TYPE_CHECKING:
    from collections.abc import Callable

_USER_SCORER = Path(__file__).with_name("user_scorer.py")  # the worker's program
_LOAD_TIMEOUT_S = 120  # importing the user's module in the worker (it may import torch or sympy)
_MAX_ERRORS_SHOWN = 20


# ---------------------------------------------------------------- the user's scorer, in a worker process


def split_scorer_spec(spec: str) -> tuple[str, str]:
    """`module:function` or `path/to/file.py:function` -> (target, function); the function name is what follows
    the last colon."""
    target, sep, function = spec.rpartition(":")
    if not sep or not target or not function.isidentifier():
        raise BenchmarkError(f"benchmark.scorer {spec!r}: expected module:function or path/to/file.py:function")
    return target, function


def resolve_scorer_spec(spec: str) -> str:
    """The spec with a file path made absolute (the worker may start elsewhere); a missing file or module is an
    error now, before any row is scored."""
    target, function = split_scorer_spec(spec)
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise BenchmarkError(f"benchmark.scorer {spec!r}: file {path} not found (relative paths start at the "
                                 f"working directory, {Path.cwd()})")
        return f"{path}:{function}"
    import importlib.util

    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as e:
        raise BenchmarkError(f"benchmark.scorer {spec!r}: module {target!r} cannot be found ({e})") from None
    if found is None:
        raise BenchmarkError(f"benchmark.scorer {spec!r}: no module {target!r} on the path; use path/to/file.py:"
                             f"{function} for a file, or install the module")
    return spec


class ScorerWorker:
    """The user's scorer in a child Python process (plain subprocess: it never re-imports the caller's __main__),
    one call at a time. A call past `timeout_s` kills the child, which restarts at the next call.

    When its first `stop_after` calls on different inputs all fail with the same message (a hang, a NaN, the same
    exception), the scorer is called no more: every later call raises ScorerStopped with that reason at once, so a
    scorer that hangs costs `stop_after` timeouts, not one per row (0: never stop). Only the first calls decide: a
    scorer that has scored one of them, or failed them in different ways, is row-dependent and keeps being called. A
    call on an input seen before does not count (three workflows giving the same junk answer that the scorer
    cannot read say nothing of the other answers)."""

    def __init__(self, spec: str, timeout_s: float, stop_after: int = 0):
        self.spec, self.timeout_s, self.stop_after = spec, timeout_s, stop_after
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._load_error: str | None = None
        self._first: list[str | None] = []  # the first `stop_after` calls' errors (None: it scored)
        self._first_inputs: set[str] = set()  # and their inputs
        self.stopped: str | None = None  # why the scorer is called no more
        _workers.add(self)

    def _start(self) -> None:
        # user_scorer.py needs the standard library only: the worker starts without importing this package
        code = "import sys; exec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'))"
        self._proc = subprocess.Popen([sys.executable, "-c", code, str(_USER_SCORER), self.spec, json.dumps(sys.path)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self._read(max(self.timeout_s, _LOAD_TIMEOUT_S))
        if first is None or "error" in first:
            self.stop()
            self._load_error = (first or {}).get("error") or "the scorer's worker did not start"

    def _read(self, timeout_s: float) -> dict | None:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def stop(self) -> None:
        self._proc = stop_worker(self._proc)

    def __call__(self, answer: str, reference: Any, metadata: dict[str, Any]) -> MetricResult:
        with self._lock:
            if self.stopped is not None:
                raise ScorerStopped(self.stopped)
            key = json.dumps([answer, reference, metadata], sort_keys=True, default=str)
            try:
                result = self._call(answer, reference, metadata)
            except ScorerError as e:
                self._note(key, str(e))
                raise
            self._note(key, None)
            return result

    def _note(self, key: str, error: str | None) -> None:
        """Count one of the first `stop_after` calls on different inputs; stop the scorer when they all failed with
        one message."""
        if len(self._first) >= self.stop_after or key in self._first_inputs:
            return
        self._first_inputs.add(key)
        self._first.append(error)
        if len(self._first) == self.stop_after and error is not None and set(self._first) == {error}:
            self.stopped = (f"not scored: the scorer failed the same way on its first {self.stop_after} calls, so it "
                            f"is called no more (benchmark.scorer_stop_after): {error}")
            self.stop()

    def _call(self, answer: str, reference: Any, metadata: dict[str, Any]) -> MetricResult:
        """One call of the scorer (the lock held)."""
        if self._load_error is None and (self._proc is None or self._proc.poll() is not None):
            self.stop()
            self._start()
        if self._load_error is not None:
            raise ScorerError(f"scorer {self.spec}: {self._load_error}")
        try:
            self._proc.stdin.write(json.dumps([answer, reference, metadata], default=str) + "\n")
            self._proc.stdin.flush()
            reply = self._read(self.timeout_s)
        except OSError as e:  # broken pipe: the worker died (e.g. the scorer called os._exit)
            reply, died = None, f"its worker died ({e})"
        else:
            died = "its worker died" if reply is None and self._proc.poll() is not None else None
        if reply is None:
            self.stop()
            raise ScorerError(f"scorer {self.spec}: " + (died or f"ran past its timeout of {self.timeout_s:g} s "
                                                          "(benchmark.scorer_timeout_s) and was killed"))
        if "error" in reply:
            raise ScorerError(f"scorer {self.spec}: {reply['error']}")
        return MetricResult(float(reply["score"]), reply.get("details") or {})


_workers: weakref.WeakSet[ScorerWorker] = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    for worker in list(_workers):
        worker.stop()


# ---------------------------------------------------------------- built-in scorers


def regex_candidate(pattern: str, answer: str) -> str | None:
    """The last match of `pattern` in the answer: its group 1 when the pattern has a group, else the whole match."""
    matches = list(re.finditer(pattern, answer))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def builtin_score(cfg: BenchmarkConfig, answer: str, reference: Any) -> MetricResult:
    """A built-in scorer (`benchmark.scorer`, not unit_tests) on one answer, from the shipped metrics."""
    gold = reference if isinstance(reference, str) else json.dumps(reference)
    name = cfg.scorer
    if name == "exact":
        ok = answer.strip() == gold.strip()
        return MetricResult(float(ok), {"scorer": name})
    if name == "text":
        ok = normalize_answer(answer) == normalize_answer(gold)
        return MetricResult(float(ok), {"scorer": name, "normalized": normalize_answer(answer)})
    if name == "number":
        res = numeric_score(answer, gold, rel_tol=cfg.tolerance)
        return MetricResult(res.score, {"scorer": name, **res.details})
    if name == "math":
        res = math_score(answer, gold)
        return MetricResult(res.score, {"scorer": name, **res.details})
    if name == "choice":
        want, got = choice_letter(gold), choice_letter(answer)
        if want is None:
            raise ValueError(f"reference {gold!r} holds no choice letter (A-Z)")
        return MetricResult(float(got == want), {"scorer": name, "extracted": got, "gold": want})
    if name == "regex":
        got = regex_candidate(cfg.pattern, answer)
        ok = got is not None and normalize_answer(got) == normalize_answer(gold)
        return MetricResult(float(ok), {"scorer": name, "extracted": got})
    raise BenchmarkError(f"benchmark.scorer {name!r} is no built-in of this task ({', '.join(SCORER_BUILTINS)})")


# ---------------------------------------------------------------- the task


def _family(cfg: BenchmarkConfig) -> str:
    if cfg.family is not None:
        return cfg.family
    return {"unit_tests": "code", "math": "math"}.get(cfg.scorer, "procedural")


class FileTask(Benchmark):
    """A task from a local dataset, a column map and a scorer (module doc)."""

    def __init__(self, cfg: BenchmarkConfig):
        super().__init__(cfg)
        self.name = cfg.name
        self.family = _family(cfg)
        self.scorer_name = cfg.scorer
        self.where: dict[str, str] = {}  # item id -> "file:line", for messages
        self._items: list[Item] | None = None
        self._worker: ScorerWorker | None = None
        if cfg.scorer not in SCORER_BUILTINS:
            self.scorer_spec = resolve_scorer_spec(cfg.scorer)

    def load(self) -> list[Item]:
        if self._items is None:
            self._items = self._read()
        return self._items

    def _read(self) -> list[Item]:
        cfg, cols = self.cfg, self.cfg.columns
        if not cfg.path:
            raise BenchmarkError(f"task {self.name!r} needs data: set benchmark.path to a JSONL, JSON, CSV or Parquet "
                                 "file or a folder saved by `datasets` (docs/tasks.md)")
        path = Path(cfg.path).expanduser()
        if not path.exists():
            raise BenchmarkError(f"task {self.name!r}: benchmark.path {path} not found (relative paths start at the "
                                 f"working directory, {Path.cwd()})")
        rows = read_rows(path, keep_bad=True)  # a malformed line is one bad row among the others, not the end
        if not rows:
            raise BenchmarkError(f"task {self.name!r}: {path} holds no rows")
        errors: list[str] = []
        items: list[Item] = []
        first_at: dict[str, str] = {}
        mapped = {c for c in (cols.query, cols.answer, cols.id, cols.label) if c}
        for row in rows:
            if row.problem is not None:
                errors.append(f"{row.where}: {row.problem}")
                continue
            try:
                item = self._item(row, path, mapped)
            except BenchmarkError as e:
                errors.append(str(e))
                continue
            if item.id in first_at:
                errors.append(f"{row.where}: field {cols.id!r} (benchmark.columns.id): duplicate id {item.id!r} "
                              f"(first at {first_at[item.id]})")
                continue
            first_at[item.id] = row.where
            items.append(item)
        if errors:
            shown = "\n  ".join(errors[:_MAX_ERRORS_SHOWN])
            more = f"\n  ... and {len(errors) - _MAX_ERRORS_SHOWN} more" if len(errors) > _MAX_ERRORS_SHOWN else ""
            raise BenchmarkError(f"task {self.name!r}: {len(errors)} bad row(s) in {path}:\n  {shown}{more}")
        self.where = first_at
        return items

    def _field(self, row: Row, column: str, role: str) -> Any:
        value = row.data.get(column)
        if column not in row.data:
            raise row.fail(f"missing column {column!r} (benchmark.columns.{role}); the row has: "
                           f"{', '.join(sorted(row.data)) or 'nothing'}")
        if value is None or (isinstance(value, str) and not value.strip()) or value == []:
            raise row.fail(f"field {column!r} (benchmark.columns.{role}) is empty")
        return value

    def _item(self, row: Row, path: Path, mapped: set[str]) -> Item:
        cols = self.cfg.columns
        query = self._field(row, cols.query, "query")
        answer = self._field(row, cols.answer, "answer")
        if not isinstance(query, str):
            raise row.fail(f"field {cols.query!r} (benchmark.columns.query) should be text, got "
                           f"{type(query).__name__}")
        item_id = str(self._field(row, cols.id, "id")) if cols.id else f"{path.stem}-{row.index}"
        meta: dict[str, Any] = {"where": row.where}
        if cols.label:
            meta["label"] = str(self._field(row, cols.label, "label"))
        metadata = {k: v for k, v in row.data.items() if k not in mapped}
        if self.cfg.scorer == "unit_tests":
            self._tests(answer, row)  # checked now: a malformed test list is a data error, not a failed answer
            if "entry_point" in metadata:
                meta["entry_point"] = metadata["entry_point"]
        return Item(id=item_id, prompt=query, reference={"answer": answer, "metadata": metadata}, meta=meta)

    def _tests(self, answer: Any, row: Row | None = None) -> list[str]:
        tests = answer if isinstance(answer, list) else [t for t in str(answer).splitlines() if t.strip()]
        if not all(isinstance(t, str) for t in tests):
            raise (row.fail if row else BenchmarkError)(f"field {self.cfg.columns.answer!r}: unit tests should be a "
                                                        "list of strings or lines of asserts")
        return tests

    def score(self, item: Item, answer: str) -> MetricResult:
        text = "" if answer is None else str(answer)
        reference, metadata = item.reference["answer"], item.reference.get("metadata") or {}
        if self.cfg.scorer in SCORER_BUILTINS:
            return builtin_score(self.cfg, text, reference)
        if self._worker is None:
            self._worker = ScorerWorker(self.scorer_spec, self.cfg.scorer_timeout_s, self.cfg.scorer_stop_after)
        return self._worker(text, reference, metadata)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()


class FileCodeTask(FileTask, CodeBenchmark):
    """A file task scored by `unit_tests`: the answer column holds assert lines (a list, or one per line) run in the
    sandbox against the workflow's program; a metadata column `entry_point` names the function the tests call."""

    def suite(self, item: Item, code: str) -> Suite:
        ep = item.meta.get("entry_point")
        return Suite(f"{code}\n", self._tests(item.reference["answer"]), "", (ep,) if ep else ())

    def score(self, item: Item, answer: str) -> MetricResult:
        return CodeBenchmark.score(self, item, answer)

    def reference_answer(self, item: Item) -> str | None:
        return item.reference.get("metadata", {}).get("solution")


def file_task(cfg: BenchmarkConfig, **defaults: Any) -> FileTask:
    """The `file` task of `cfg`; a plugin's entry point calls it with its own defaults (path, columns, scorer, ...),
    which the config's fields override where the config gives them a value other than the field's default (a saved
    config lists every field, so "set in the file" cannot tell)."""
    if defaults:
        given = cfg.model_dump(exclude_defaults=True)
        cfg = BenchmarkConfig.model_validate({**{k: _plain(v) for k, v in defaults.items()}, **given})
    return (FileCodeTask if cfg.scorer == "unit_tests" else FileTask)(cfg)


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


# ---------------------------------------------------------------- `pipeline validate` and `pipeline tasks`


@dataclass
class RowProblem:
    """A row whose reference answer does not score 1.0 with the task's scorer (a scorer or mapping bug), or was not
    scored (the scorer was stopped: ScorerStopped)."""

    where: str
    item_id: str
    score: float | None  # None: the scorer failed on it, or was not called
    message: str
    scored: bool = True  # False: not sent to the scorer, which had failed the same way on its first calls


@dataclass
class TaskCheck:
    """What `pipeline validate` reports of a task: its rows, split sizes, label mix, and the rows whose own reference
    answer does not score 1.0."""

    name: str
    scorer: str
    rows: int
    splits: dict[str, int]
    labels: dict[str, int]  # label -> rows; empty without a label column
    checked: int  # references scored (the scorer called)
    problems: list[RowProblem] = field(default_factory=list)
    note: str = ""  # why references were not scored, where they were not

    @property
    def failed(self) -> int:
        """References the scorer was called on that do not score 1.0."""
        return sum(p.scored for p in self.problems)

    @property
    def not_scored(self) -> int:
        return sum(not p.scored for p in self.problems)


def check_task(bench: Benchmark, progress: Callable[[int, int], None] | None = None) -> TaskCheck:
    """Load the task and score every row's reference answer with its scorer (no model, no executor); a scorer that
    fails the same way on its first calls is not called on the other rows (ScorerWorker), which are not scored."""
    items = bench.load()
    cfg = bench.cfg
    splits = {k: len(v) for k, v in split_items(items, cfg.split_seed, cfg.test_share, cfg.dev_share,
                                                cfg.one_split_per_text).items()}
    labels = dict(Counter(it.meta.get("label") for it in items if "label" in it.meta).most_common())
    where = getattr(bench, "where", {})
    check = TaskCheck(bench.name, getattr(bench, "scorer_name", "its own"), len(items), splits, labels, 0)
    pairs = [(it, answer) for it in items if (answer := bench.reference_answer(it)) is not None]
    if len(pairs) < len(items):
        check.note = (f"{len(items) - len(pairs)} rows have no reference answer to score (a code task's reference "
                      "is its tests" + ("; a `solution` column gives validate one to run them against)"
                                         if isinstance(bench, FileCodeTask) else ")"))
    for done, (item, answer) in enumerate(pairs, 1):
        location = where.get(item.id, item.id)
        try:
            res = bench.score(item, answer)
        except ScorerStopped as e:  # not called: the scorer failed the same way on its first calls
            check.problems.append(RowProblem(location, item.id, None, str(e), scored=False))
        except Exception as e:  # noqa: BLE001 - a scorer failing on a reference is what validate is for
            check.problems.append(RowProblem(location, item.id, None, f"{type(e).__name__}: {e}"))
            check.checked += 1
        else:
            check.checked += 1
            if res.score < 1.0:
                check.problems.append(RowProblem(location, item.id, res.score,
                                                 f"its reference answer {answer!r:.80} scores {res.score:g}"))
        if progress is not None:
            progress(done, len(pairs))
    if isinstance(bench, FileTask):
        bench.close()
    return check


def problem_lines(problems: list[RowProblem], shown: int = 3) -> list[str]:
    """`pipeline validate`'s lines for the problems: identical messages grouped, with their count and first `shown`
    rows (a scorer returning NaN on 120 rows is one group, not 120 lines); a message of one row as `row: message`."""
    out = []
    for group in group_errors(((f"{p.where} (id {p.item_id})", p.message) for p in problems), shown):
        if group.count == 1:
            out.append(f"{group.rows[0]}: {group.message}")
            continue
        more = f" and {group.count - len(group.rows)} more" if group.count > len(group.rows) else ""
        out += [f"{group.count} rows: {group.message}", f"  at {', '.join(group.rows)}{more}"]
    return out


@dataclass(frozen=True)
class TaskInfo:
    """One line of `pipeline tasks`."""

    name: str
    source: str  # the entry point's target and the package that registers it
    size: int | None  # items with this config's data; None: not loadable as configured
    scorer: str
    note: str = ""


def list_tasks(cfg: BenchmarkConfig | None = None) -> list[TaskInfo]:
    """Every installed task with its size and scorer: the task of `cfg` as configured, the others with their
    defaults (a task that needs data it was not given says so instead of a size)."""
    from pipeline.engines.benchmarks.base import load_benchmark

    out = []
    for name, ep in sorted(task_entry_points().items()):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "pyproject.toml, not installed"
        source = f"{ep.value} ({dist})"
        try:
            task_cfg = cfg if cfg is not None and cfg.name == name else BenchmarkConfig(name=name)
            bench = load_benchmark(task_cfg)
            scorer = getattr(bench, "scorer_name", "its own")
        except Exception as e:  # noqa: BLE001 - a broken plugin is listed with its error, not a crash
            out.append(TaskInfo(name, source, None, "?", f"{type(e).__name__}: {e}"))
            continue
        try:
            size, note = len(bench.load()), ""
        except Exception as e:  # noqa: BLE001 - e.g. a benchmark whose data file is not given
            size, note = None, str(e).split(". ")[0]
        out.append(TaskInfo(name, source, size, scorer, note))
    return out
