"""The trajectory store: immutable Parquet parts, stage manifests and a DuckDB catalog of views.

Layout (DESIGN.md §2):
    <root>/<run_id>/config.yaml                              frozen run config
    <root>/<run_id>/round=<k>/<table>/part-<uuid>.parquet     one file per write, never rewritten
    <root>/<run_id>/round=<k>/_done/<stage>.json              stage manifests
    <root>/<run_id>/round=<k>/checkpoint/                     the round's LoRA adapter
    <root>/catalog.duckdb                                     views only, rebuilt atomically

Derived views (one definition each, used by every stage, the report and evaluation):
    latest_scores      the latest attempt of each (generation, rep)
    generation_scores  one row per generation: its score over reps (see GENERATION_SCORES_SQL)
    query_usage        one row per (run, round, query): generator and executor tokens and cost (QUERY_USAGE_SQL)

Writers never touch catalog.duckdb while working; it is rebuilt into a temp file and renamed, so a
user holding it open in the `duckdb` CLI keeps a consistent (older) copy.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.schema import TABLES, TRANSIENT_STATUSES, schema

log = logging.getLogger(__name__)

CATALOG = "catalog.duckdb"
# The catalog's on-disk format. DuckDB 2.x writes storage version 69 by default, which no released `duckdb`
# CLI on PyPI reads (duckdb-cli 1.5.6 reads 64..68): the README's `duckdb -readonly catalog.duckdb` failed.
# It holds only views, so the oldest format (DuckDB >= 1.0 reads it) costs nothing.
CATALOG_STORAGE = "v1.0.0"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a round's checkpoint is complete with these

# A generation's score, the one definition: the mean over its reps' latest attempts, where an invalid workflow
# (or a run with status `invalid`) counts 0 and a missing score 0; runs whose latest status is transient
# (an executor outage) are left out of the mean and counted in `transient_runs`. NULL: no final run yet.
GENERATION_SCORES_SQL = f"""
WITH g AS (
    SELECT run_id, round, gen_id, any_value(kind) AS kind, any_value(parent_id) AS parent_id,
           any_value(query_id) AS query_id, min(slot) AS slot, bool_and(coalesce(valid, true)) AS valid,
           any_value(repair_of) AS repair_of, coalesce(max(attempt), 0) AS attempt
    FROM generations GROUP BY run_id, round, gen_id),
repaired AS (SELECT DISTINCT run_id, round, repair_of AS gen_id FROM generations WHERE repair_of IS NOT NULL),
s AS (
    SELECT run_id, round, gen_id, count(DISTINCT rep) AS reps_scored,
           count(*) FILTER (WHERE status IN ({", ".join(f"'{t}'" for t in TRANSIENT_STATUSES)})) AS transient_runs,
           count(*) FILTER (WHERE status = 'timeout') AS timeout_runs,
           avg(CASE WHEN status = 'invalid' THEN 0 ELSE coalesce(score, 0) END)
               FILTER (WHERE status NOT IN ({", ".join(f"'{t}'" for t in TRANSIENT_STATUSES)})) AS score,
           sum(llm_calls) AS llm_calls, sum(tokens_in) AS tokens_in, sum(tokens_out) AS tokens_out,
           sum(cost_usd) AS cost_usd
    FROM latest_scores GROUP BY run_id, round, gen_id)
SELECT g.*, r.gen_id IS NULL AS final, coalesce(s.reps_scored, 0) AS reps_scored,
       coalesce(s.transient_runs, 0) AS transient_runs, coalesce(s.timeout_runs, 0) AS timeout_runs,
       CASE WHEN NOT g.valid THEN 0.0 ELSE s.score END AS score,
       s.llm_calls, s.tokens_in, s.tokens_out, s.cost_usd
FROM g LEFT JOIN s USING (run_id, round, gen_id) LEFT JOIN repaired r USING (run_id, round, gen_id)
"""

# What answering one query cost, the one definition (evaluation summaries, baselines, the report): generator tokens
# of every generation of the query (any kind: plans, workflows, repairs, SMC rollouts; the prompt counted once per
# sample, as n separate requests would be billed), and executor tokens of its scoring runs (latest attempts, all
# reps) plus its generation-time runs (`checks`: self-repair's self-checks, SMC's look-ahead scoring).
QUERY_USAGE_SQL = """
WITH g AS (
    SELECT run_id, round, gen_id, any_value(query_id) AS query_id, any_value(kind) AS kind,
           any_value(coalesce(len(prompt_token_ids), 0)) AS tin, any_value(coalesce(len(token_ids), 0)) AS tout,
           any_value(coalesce(cost_usd, 0)) AS cost
    FROM generations GROUP BY run_id, round, gen_id),
gq AS (
    SELECT run_id, round, query_id, count(*) FILTER (WHERE kind = 'workflow') AS workflows, count(*) AS generations,
           sum(tin)::BIGINT AS gen_tokens_in, sum(tout)::BIGINT AS gen_tokens_out, sum(cost) AS gen_cost_usd
    FROM g GROUP BY run_id, round, query_id),
sq AS (
    SELECT run_id, round, query_id, sum(llm_calls)::BIGINT AS calls, sum(tokens_in)::BIGINT AS tin,
           sum(tokens_out)::BIGINT AS tout, sum(cost_usd) AS cost
    FROM latest_scores GROUP BY run_id, round, query_id),
cq AS (
    SELECT run_id, round, query_id, count(*) AS checks, sum(llm_calls)::BIGINT AS calls,
           sum(tokens_in)::BIGINT AS tin, sum(tokens_out)::BIGINT AS tout, sum(cost_usd) AS cost
    FROM checks GROUP BY run_id, round, query_id)
SELECT gq.run_id, gq.round, gq.query_id, gq.workflows, gq.generations, coalesce(cq.checks, 0) AS checks,
       gq.gen_tokens_in, gq.gen_tokens_out, gq.gen_cost_usd,
       coalesce(sq.calls, 0) + coalesce(cq.calls, 0) AS exec_calls,
       coalesce(sq.tin, 0) + coalesce(cq.tin, 0) AS exec_tokens_in,
       coalesce(sq.tout, 0) + coalesce(cq.tout, 0) AS exec_tokens_out,
       coalesce(sq.cost, 0) + coalesce(cq.cost, 0) AS exec_cost_usd
FROM gq LEFT JOIN sq USING (run_id, round, query_id) LEFT JOIN cq USING (run_id, round, query_id)
"""

_DUCK_TYPES = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
}


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return _duck_type(t.value_type) + "[]"
    if pa.types.is_timestamp(t):
        return "TIMESTAMPTZ"
    return _DUCK_TYPES[t]


class CorruptPartWarning(UserWarning):
    pass


def adapter_complete(path: Path) -> bool:
    """The folder holds every file a LoRA checkpoint needs (checkpoints are written whole or not at all)."""
    return all((path / f).is_file() for f in ADAPTER_FILES)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def to_arrow(table: str, rows: pa.Table | pl.DataFrame | Iterable[dict], run_id: str) -> pa.Table:
    """Coerce rows to the table's schema; fills run_id and created_at; unknown columns are an error."""
    sch = schema(table)
    if isinstance(rows, pl.DataFrame):
        rows = rows.to_arrow()
    if not isinstance(rows, pa.Table):
        rows = list(rows)
        unknown = {k for r in rows for k in r} - set(sch.names)
        if unknown:
            raise ValueError(f"{table}: unknown columns {sorted(unknown)}")
        present = [f for f in sch if any(f.name in r for r in rows)]
        rows = pa.Table.from_pylist(rows, schema=pa.schema(present))
    unknown = set(rows.column_names) - set(sch.names)
    if unknown:
        raise ValueError(f"{table}: unknown columns {sorted(unknown)}")
    n = rows.num_rows
    cols = []
    for f in sch:
        if f.name in rows.column_names:
            cols.append(rows.column(f.name).cast(f.type))
        elif f.name == "run_id":
            cols.append(pa.array([run_id] * n, pa.string()))
        elif f.name == "created_at":
            cols.append(pa.array([utcnow()] * n, f.type))
        else:
            cols.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(cols, schema=sch)


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self._footer_ok: dict[tuple[str, int, float], bool] = {}

    # ---- paths -------------------------------------------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.root / run_id

    def round_dir(self, run_id: str, round: int) -> Path:
        return self.run_dir(run_id) / f"round={round}"

    def checkpoint_dir(self, run_id: str, round: int) -> Path:
        return self.round_dir(run_id, round) / "checkpoint"

    def runs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "config.yaml").is_file())

    # ---- writing -------------------------------------------------------------------------------
    def write(self, table: str, rows: pa.Table | pl.DataFrame | Iterable[dict], run_id: str, round: int) -> Path | None:
        """Write one immutable part (temp file + rename, so readers never see half a file)."""
        data = to_arrow(table, rows, run_id)
        if data.num_rows == 0:
            return None
        d = self.round_dir(run_id, round) / table
        d.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex}.parquet"
        tmp = d / f".{name}.tmp"  # hidden: globs for *.parquet never match it
        try:
            pq.write_table(data, tmp, compression="zstd", row_group_size=128 * 1024)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, d / name)
        except OSError as e:  # e.g. a full disk: no part, no temp file left; say where and what was lost
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"store: {data.num_rows} {table} rows of run {run_id!r} round {round} not "
                                   f"written to {d}: {e.strerror or e}") from e
        return d / name

    # ---- parts and reading ------------------------------------------------------------------------
    def parts(self, table: str, run_id: str | None = None, round: int | None = None) -> list[Path]:
        schema(table)
        run = run_id or "*"
        rnd = "*" if round is None else str(round)
        return sorted(self.root.glob(f"{run}/round={rnd}/{table}/*.parquet"))

    def _is_ok(self, p: Path) -> bool:
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime)
        ok = self._footer_ok.get(key)
        if ok is None:
            try:
                pq.read_metadata(p)
                ok = True
            except Exception as e:  # any unreadable footer: name the file, keep going
                warnings.warn(f"corrupt Parquet part skipped (left in place): {p}: {e}", CorruptPartWarning,
                              stacklevel=3)
                ok = False
            self._footer_ok[key] = ok
        return ok

    def good_parts(self, table: str, run_id: str | None = None, round: int | None = None) -> list[Path]:
        return [p for p in self.parts(table, run_id, round) if self._is_ok(p)]

    def corrupt_parts(self) -> list[Path]:
        return [p for t in TABLES for p in self.parts(t) if not self._is_ok(p)]

    def scan(self, table: str, run_id: str, round: int | None = None) -> pl.LazyFrame:
        """Lazy frame over a table's readable parts, with `round` from the partition path."""
        files = self.good_parts(table, run_id, round)
        if not files:
            empty = pl.from_arrow(schema(table).empty_table())
            return empty.with_columns(pl.lit(None, pl.Int32).alias("round")).lazy()
        # the full schema: columns added later read as null from older parts, whichever part comes first
        full = dict(pl.from_arrow(schema(table).empty_table()).schema)
        return pl.scan_parquet(
            [str(f) for f in files], hive_partitioning=True, hive_schema={"round": pl.Int32}, schema=full,
            missing_columns="insert", extra_columns="ignore",
        )

    def read(self, table: str, run_id: str, round: int | None = None) -> pl.DataFrame:
        return self.scan(table, run_id, round).collect()

    # ---- DuckDB ----------------------------------------------------------------------------
    def _view_sql(self, table: str) -> str:
        files = self.parts(table)
        good = [p for p in files if self._is_ok(p)]
        cols = ", ".join(f"CAST(NULL AS {_duck_type(f.type)}) AS {f.name}" for f in schema(table))
        empty = f"SELECT {cols}, CAST(NULL AS INTEGER) AS round WHERE false"
        if not good:
            return empty
        opts = "hive_partitioning = true, union_by_name = true, hive_types = {'round': INTEGER}"
        if len(good) == len(files):  # glob: parts written after the refresh are visible too
            src = f"'{self.root}/*/round=*/{table}/*.parquet'"
        else:  # a corrupt part would fail the whole glob: list the readable ones
            src = "[" + ", ".join(f"'{p}'" for p in good) + "]"
        # the empty typed relation first: every column of the schema exists even when no part has it yet (parts
        # written before a column was added), and BY NAME never duplicates one a newer part has
        return f"{empty} UNION ALL BY NAME SELECT * FROM read_parquet({src}, {opts})"

    def _create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        for t in TABLES:
            con.execute(f"CREATE OR REPLACE VIEW {t} AS {self._view_sql(t)}")
        con.execute(
            "CREATE OR REPLACE VIEW latest_scores AS SELECT * FROM scores "
            "QUALIFY row_number() OVER (PARTITION BY run_id, round, gen_id, rep "
            "ORDER BY attempt DESC, created_at DESC) = 1"
        )
        con.execute(f"CREATE OR REPLACE VIEW generation_scores AS {GENERATION_SCORES_SQL}")
        con.execute(f"CREATE OR REPLACE VIEW query_usage AS {QUERY_USAGE_SQL}")

    def generation_scores(self, run_id: str, round: int, reps: int, transient: Iterable[str]) -> pl.DataFrame:
        """The `generation_scores` rows of one round, ordered (query, parent, slot), with `state`:
        ok (final: scored on all `reps`, or invalid), transient (a latest run has a status in `transient`,
        which is re-run by `score --only-failed` and waited for by curation), or unscored (reps missing)."""
        return self.sql(
            "SELECT *, CASE WHEN NOT valid THEN 'ok' "
            "WHEN transient_runs > 0 OR (list_contains($transient, 'timeout') AND timeout_runs > 0) THEN 'transient' "
            "WHEN reps_scored < $reps THEN 'unscored' ELSE 'ok' END AS state "
            "FROM generation_scores WHERE run_id = $run AND round = $round "
            "ORDER BY query_id, parent_id NULLS FIRST, slot, gen_id",
            {"run": run_id, "round": round, "reps": reps, "transient": sorted(transient)})

    def connect(self) -> duckdb.DuckDBPyConnection:
        """In-memory connection with the catalog's views (no lock on catalog.duckdb)."""
        con = duckdb.connect()
        self._create_views(con)
        return con

    def sql(self, query: str, params: dict[str, Any] | list[Any] | None = None) -> pl.DataFrame:
        """Run a query over the views; `params` binds `$name` parameters (a dict) or `?` ones (a list)."""
        con = self.connect()
        try:
            rel = con.sql(query, params=params)
            return rel.pl() if rel is not None else pl.DataFrame()
        finally:
            con.close()

    def refresh_catalog(self) -> Path:
        """Rebuild <root>/catalog.duckdb atomically for the `duckdb` CLI, in a storage version that CLI reads
        (see CATALOG_STORAGE)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / CATALOG
        tmp = self.root / f".{CATALOG}.{uuid.uuid4().hex}.tmp"
        con = duckdb.connect()
        try:
            path = str(tmp).replace("'", "''")
            con.execute(f"ATTACH '{path}' AS cat (STORAGE_VERSION '{CATALOG_STORAGE}')")
            con.execute("USE cat")
            self._create_views(con)
            con.execute("USE memory")
            con.execute("DETACH cat")
        finally:
            con.close()
        os.replace(tmp, final)
        Path(str(tmp) + ".wal").unlink(missing_ok=True)
        return final

    # ---- manifests and configs ----------------------------------------------------------------
    def _manifest_path(self, run_id: str, round: int, stage: str) -> Path:
        return self.round_dir(run_id, round) / "_done" / f"{stage}.json"

    def write_manifest(self, run_id: str, round: int, stage: str, config_hash: str, **counts: Any) -> dict:
        path = self._manifest_path(run_id, round, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"stage": stage, "round": round, "config_hash": config_hash, "finished_at": utcnow().isoformat(),
                "counts": counts}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(body, indent=2, default=str))
        os.replace(tmp, path)
        return body

    def manifest(self, run_id: str, round: int, stage: str) -> dict | None:
        path = self._manifest_path(run_id, round, stage)
        return json.loads(path.read_text()) if path.is_file() else None

    def clear_manifest(self, run_id: str, round: int, stage: str) -> None:
        self._manifest_path(run_id, round, stage).unlink(missing_ok=True)

    def checkpoint_complete(self, run_id: str, round: int) -> bool:
        return adapter_complete(self.checkpoint_dir(run_id, round))

    def discard_unfinished(self, run_id: str, round: int, tables: Iterable[str], checkpoint: bool = False) -> int:
        """Remove what an attempt that died before its manifest left behind (parts of `tables`, and the round's
        checkpoint folder), so the next attempt starts clean and never duplicates rows; returns parts removed."""
        stale = [p for t in tables for p in self.parts(t, run_id, round)]
        ckpt = self.checkpoint_dir(run_id, round)
        if stale or (checkpoint and ckpt.exists()):
            log.warning("run %s round %d: discarding %d part(s)%s of an unfinished attempt", run_id, round, len(stale),
                        " and the checkpoint" if checkpoint and ckpt.exists() else "")
        for p in stale:
            p.unlink(missing_ok=True)
        if checkpoint and ckpt.exists():
            shutil.rmtree(ckpt)
        return len(stale)
