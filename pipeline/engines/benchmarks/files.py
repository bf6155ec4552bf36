"""Reading benchmark rows from local files (JSONL, JSON, CSV, Parquet, a folder of JSON files or one saved by
`datasets`) or a hub id, with errors that name the file, the line/row and the field, and say how to supply the
data."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.engines.benchmarks.base import BenchmarkError

if TYPE_CHECKING:
    from pipeline.config import BenchmarkConfig

_MISSING = object()


@dataclass(frozen=True)
class Row:
    data: dict[str, Any]
    where: str  # "file.jsonl:12" (line), "file.parquet row 12", "folder/a/1.json": for error messages
    index: int  # position in the source, the fallback item id
    key: str | None = None  # a folder's file path without suffix ("algebra/1"), a stable id for MATH
    problem: str | None = None  # why the line or file could not be read (read_rows' keep_bad); data is then empty

    def get(self, field: str, kind: type | tuple[type, ...] = str, default: Any = _MISSING) -> Any:
        """The field's value, checked against `kind`; a clear error names the row and the field."""
        value = self.data.get(field, _MISSING)
        if value is _MISSING or value is None:
            if default is not _MISSING:
                return default
            raise BenchmarkError(f"{self.where}: missing field {field!r} (has: {', '.join(sorted(self.data))})")
        if not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise BenchmarkError(f"{self.where}: field {field!r} should be {names}, got {type(value).__name__}")
        return value

    def fail(self, msg: str) -> BenchmarkError:
        return BenchmarkError(f"{self.where}: {msg}")


def read_rows(path: str | Path, keep_bad: bool = False) -> list[Row]:
    """All rows of a .jsonl/.json/.parquet file, or of every *.json file under a folder (sorted). A JSONL line or a
    folder's file that is not a JSON object does not stop the reading: with `keep_bad` it is a Row whose `problem`
    says why, in its place (so a caller reports it with the other rows' problems, in one pass); without, every such
    line is named in one BenchmarkError."""
    rows = _read_rows(Path(path))
    bad = [r for r in rows if r.problem is not None]
    if bad and not keep_bad:
        if len(bad) == 1:
            raise BenchmarkError(f"{bad[0].where}: {bad[0].problem}")
        raise BenchmarkError(f"{len(bad)} unreadable lines in {path}:\n  "
                             + "\n  ".join(f"{r.where}: {r.problem}" for r in bad))
    return rows


def _read_rows(source: Path) -> list[Row]:
    if source.is_dir() and any((source / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
        return _read_saved_dataset(source)
    if source.is_dir():
        files = sorted(source.rglob("*.json"))
        if not files:
            raise BenchmarkError(f"{source}: folder holds no *.json files")
        rows, good = [], 0
        for file in files:
            try:
                obj = json.loads(file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                rows.append(_bad_row(f"{file}:{e.lineno}", f"invalid JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict):
                rows.append(_bad_row(str(file), "expected one JSON object per file"))
                continue
            rows.append(Row(obj, str(file), good, file.relative_to(source).with_suffix("").as_posix()))
            good += 1
        return rows
    suffix = source.suffix.lower()
    if suffix == ".jsonl":
        rows, good = [], 0
        with source.open(encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    rows.append(_bad_row(f"{source}:{lineno}", f"invalid JSON ({e.msg})"))
                    continue
                if not isinstance(obj, dict):
                    rows.append(_bad_row(f"{source}:{lineno}", "expected a JSON object per line"))
                    continue
                rows.append(Row(obj, f"{source}:{lineno}", good))
                good += 1
        return rows
    if suffix == ".json":
        obj = _load_json(source)
        if isinstance(obj, dict):  # one record, e.g. a single MATH problem file
            obj = [obj]
        if not isinstance(obj, list) or not all(isinstance(o, dict) for o in obj):
            raise BenchmarkError(f"{source}: expected a JSON array of objects")
        return [Row(o, f"{source} item {i}", i) for i, o in enumerate(obj)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(source)
        except Exception as e:
            raise BenchmarkError(f"{source}: unreadable Parquet file ({e})") from None
        return [Row(o, f"{source} row {i}", i) for i, o in enumerate(table.to_pylist())]
    if suffix == ".csv":
        with source.open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None:
                raise BenchmarkError(f"{source}:1: empty CSV file (no header line)")
            rows = []
            for record in reader:  # line_num: the record's last line (a quoted field may span lines)
                rows.append(Row(dict(record), f"{source}:{reader.line_num}", len(rows)))
        return rows
    raise BenchmarkError(f"{source}: unsupported file type {suffix!r}; use .jsonl, .json, .csv, .parquet, a folder of "
                         ".json or a folder saved by `datasets` (save_to_disk)")


def _bad_row(where: str, problem: str) -> Row:
    return Row({}, where, -1, problem=problem)


def _read_saved_dataset(folder: Path) -> list[Row]:
    """The rows of a folder written by `datasets`' save_to_disk (a DatasetDict: its `train` split, else its only
    one)."""
    try:
        import datasets
    except ImportError:
        raise BenchmarkError(f"{folder}: a folder saved by `datasets` needs the `datasets` library (pip install "
                             "datasets); or save the data as JSONL, CSV or Parquet") from None
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as e:
        raise BenchmarkError(f"{folder}: unreadable `datasets` folder ({type(e).__name__}: {e})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset and len(dataset) != 1:
            raise BenchmarkError(f"{folder}: a DatasetDict of splits {sorted(dataset)}: save the one split to use")
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    return [Row(dict(o), f"{folder} row {i}", i) for i, o in enumerate(dataset)]


def _load_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BenchmarkError(f"{p}:{e.lineno}: invalid JSON ({e.msg})") from None


def parse_hub_id(hub_id: str, default_split: str) -> tuple[str, str | None, str]:
    """ "owner/name[:config][@split]" -> (name, config, split)."""
    rest, _, split = hub_id.partition("@")
    name, _, config = rest.partition(":")
    return name, config or None, split or default_split


def read_hub(hub_id: str, default_split: str) -> list[Row]:
    """Rows of a hub dataset through the `datasets` library (where installed and the hub reachable)."""
    name, config, split = parse_hub_id(hub_id, default_split)
    try:
        import datasets
    except ImportError:
        raise BenchmarkError(
            f"benchmark.hub_id={hub_id!r} needs the `datasets` library (pip install datasets) and a reachable "
            "hub; offline, download the file once and set benchmark.path instead"
        ) from None
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        raise BenchmarkError(
            f"benchmark.hub_id={hub_id!r}: could not load {name} (config {config}, split {split}): "
            f"{type(e).__name__}: {e}. Offline? Set benchmark.path to a local file instead (see data/README.md)"
        ) from None
    return [Row(dict(o), f"{hub_id} row {i}", i) for i, o in enumerate(dataset)]


def load_rows(cfg: BenchmarkConfig, fmt: str, default_split: str) -> list[Row]:
    """The benchmark's rows from cfg.path (preferred) or cfg.hub_id; `fmt` describes the expected
    record format in the error that tells the user how to supply the data."""
    how = (
        f"Supply a local .jsonl/.json/.parquet file of records {fmt} with `--set benchmark.path=FILE` "
        f"(or `benchmark.path:` in the config), or a hub dataset with `benchmark.hub_id` where the hub is "
        f"reachable. See data/README.md."
    )
    if cfg.path:
        p = Path(cfg.path).expanduser()
        if not p.exists():
            raise BenchmarkError(f"benchmark {cfg.name!r}: data file {p} not found. {how}")
        rows = read_rows(p)
    elif cfg.hub_id:
        rows = read_hub(cfg.hub_id, default_split)
    else:
        raise BenchmarkError(f"benchmark {cfg.name!r} needs data: benchmark.path and benchmark.hub_id are unset. {how}")
    if not rows:
        raise BenchmarkError(f"benchmark {cfg.name!r}: {cfg.path or cfg.hub_id} holds no records. {how}")
    return rows


def unique_ids(ids: list[str], rows: list[Row]) -> None:
    """Item ids key the split and the store: a duplicate is a data error, reported with both rows."""
    seen: dict[str, Row] = {}
    for i, r in zip(ids, rows, strict=True):
        if i in seen:
            raise BenchmarkError(f"{r.where}: duplicate id {i!r} (first at {seen[i].where})")
        seen[i] = r
