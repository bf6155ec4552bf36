"""The trajectory store: immutable Parquet parts, stage manifests and a DuckDB catalog of views.

Layout (docs/design.md, The store):
    <root>/<run_id>/config.yaml                              frozen run config
    <root>/<run_id>/round=<k>/<table>/part-<uuid>.parquet     one file per write, never rewritten
    <root>/<run_id>/round=<k>/_done/<stage>.json              stage manifests
    <root>/<run_id>/round=<k>/checkpoint/                     the round's LoRA adapter
    <root>/adapters/<run_id>-r<k>/                            a round's adapter kept for git (Store.keep_adapter)
    <root>/<run_id>/stale/<stamp>/                            rounds and derived runs set aside (Store.set_aside)
    <root>/<run_id>/_leases/                                  one writer per stage and round (Store.lease, lease.py)
    <root>/catalog.duckdb                                     views only, rebuilt atomically
    <root>/cache/{executor,grader}/*.jsonl                    replies and verdicts computed once (engines.cache)

Derived views (one definition each, used by every stage, the report and evaluation):
    latest_scores      the latest attempt of each (generation, rep)
    generation_scores  one row per generation: its score over reps (see GENERATION_SCORES_SQL)
    query_usage        one row per (run, round, query): generator and executor tokens and cost (QUERY_USAGE_SQL)
    executor_cache     the executor replies computed once; grader_cache: the grader verdicts (CACHE_VIEWS)

Writers never touch catalog.duckdb while working; it is rebuilt into a temp file and renamed, so a
user holding it open in the `duckdb` CLI keeps a consistent (older) copy.

The root may be a POSIX path (the default) or an `s3://bucket/prefix` URL (docs/scale-out.md, Store on object
storage): then paths are `upath.UPath` objects over s3fs (`store.fs`), every file is written as one object PUT (a
PUT, single or a completed multipart upload, becomes visible whole, which is what temp file + rename gives
locally), DuckDB reads the parts through its httpfs extension, and checkpoints are materialised into a local cache
for peft / vLLM.
Connection settings come from the standard AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_REGION, AWS_ENDPOINT_URL) or `store.endpoint_url`; no secret is ever written to the store.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store.lease import LEASES, FileLease, Lease, S3Lease
from pipeline.store.schema import TABLES, schema
from pipeline.store.views import CACHE_VIEWS, VIEWS

log = logging.getLogger(__name__)

CATALOG = "catalog.duckdb"
# The catalog's on-disk format. DuckDB 2.x writes storage version 69 by default, which no released `duckdb`
# CLI on PyPI reads (duckdb-cli 1.5.6 reads 64..68): the README's `duckdb -readonly catalog.duckdb` failed.
# It holds only views, so the oldest format (DuckDB >= 1.0 reads it) costs nothing.
CATALOG_STORAGE = "v1.0.0"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = ("adapter_config.json", ADAPTER_WEIGHTS)  # a round's checkpoint is complete with these
# On object storage a checkpoint is uploaded file by file with this one last (and deleted first on discard): its
# presence after the other files' PUTs is what makes the checkpoint complete (ADAPTER_FILES includes it).
CHECKPOINT_MARKER = "adapter_config.json"
KEPT_CONFIG = "config.yaml"  # a kept adapter's copy of its run's frozen config (Store.keep_adapter)
# a kept adapter's note of the sha256 of the checkpoint weights it was made from; the train stage's manifest records
# the same digest (`weights_sha256`), so a kept copy restores only the checkpoint that the manifest says finished
KEPT_SOURCE = "checkpoint.sha256"
ENDPOINT_ENV = "AWS_ENDPOINT_URL"

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


def weights_sha256(folder: Path) -> str:
    """The hex SHA-256 of a checkpoint's weights file (ADAPTER_WEIGHTS)."""
    import hashlib

    h = hashlib.sha256()
    with open(folder / ADAPTER_WEIGHTS, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make the entries of `path` (a rename into it, a folder created in it) survive a power loss: a file's own
    fsync covers its data, not the directory entry that names it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    count = rows.num_rows
    cols = []
    for field in sch:
        if field.name in rows.column_names:
            cols.append(rows.column(field.name).cast(field.type))
        elif field.name == "run_id":
            cols.append(pa.array([run_id] * count, pa.string()))
        elif field.name == "created_at":
            cols.append(pa.array([utcnow()] * count, field.type))
        else:
            cols.append(pa.nulls(count, field.type))
    return pa.Table.from_arrays(cols, schema=sch)


ALL_VIEWS = frozenset((*TABLES, *VIEWS, *(f"{k}_cache" for k in CACHE_VIEWS)))
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# each derived view -> the views its SQL names (read once: VIEWS is fixed)
_VIEW_DEPS = {name: {w.lower() for w in _WORD.findall(sql)} & ALL_VIEWS for name, sql in VIEWS.items()}
# words of a query that read the catalog itself (SHOW TABLES, DESCRIBE, information_schema, duckdb_views()): every view
_CATALOG_WORDS = frozenset({"show", "describe", "summarize", "information_schema", "pg_catalog"})


def views_for(query: str) -> frozenset[str] | None:
    """The views a query needs: those whose names it holds as words (case-insensitive, as DuckDB's identifiers),
    with the views they read, transitively; None (all of them) for a query that reads the catalog or names none.
    A name inside a string literal only makes a view more."""
    words = {w.lower() for w in _WORD.findall(query)}
    need = words & ALL_VIEWS
    if not need or words & _CATALOG_WORDS or any(w.startswith("duckdb_") for w in words):
        return None
    todo = list(need)
    while todo:
        for dep in _VIEW_DEPS.get(todo.pop(), set()) - need:
            need.add(dep)
            todo.append(dep)
    return frozenset(need)


class StoreError(RuntimeError):
    """An operation the store cannot do where it is (e.g. a local-only one on an s3:// store), with the fix."""


def is_remote(root: str | Path | Any) -> bool:
    """An object-storage URL (s3://...) rather than a local path; a UPath of one counts too."""
    return "://" in str(root) and not str(root).startswith("file://")


def use_endpoint(endpoint_url: str | None) -> None:
    """Make a configured `store.endpoint_url` this process's default S3 endpoint: every later `Store(root)` here
    and every child stage process (which inherits the environment) then reaches the same server. An endpoint
    already in the environment wins: the operator's shell is the more specific setting."""
    if endpoint_url:
        os.environ.setdefault(ENDPOINT_ENV, endpoint_url)


def store_for(store_cfg: Any) -> Store:
    """The store a config's `store` section names, with its endpoint (see use_endpoint)."""
    use_endpoint(store_cfg.endpoint_url)
    return Store(store_cfg.root)


def _s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(ENDPOINT_ENV) or None


def _s3_credentials() -> tuple[str | None, str | None, str | None]:
    """(key, secret, token) from botocore's chain (env vars, ~/.aws, instance roles), the one s3fs uses too."""
    import botocore.session

    creds = botocore.session.get_session().get_credentials()
    if creds is None:
        return None, None, None
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token


def _s3_client():
    """A botocore S3 client on the store's server (for what s3fs does not offer: conditional writes)."""
    import botocore.session

    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return botocore.session.get_session().create_client("s3", endpoint_url=_s3_endpoint(), region_name=region)


def _sql_str(v: str) -> str:
    return "'" + str(v).replace("'", "''") + "'"


def load_httpfs(con: duckdb.DuckDBPyConnection) -> None:
    """Load DuckDB's httpfs extension from the `duckdb-extension-httpfs` package (its binary must match this
    DuckDB's version exactly; `INSTALL httpfs` would need the extension server), else an installed one."""
    try:
        import duckdb_extension_httpfs
    except ImportError:
        path = None
    else:
        path = Path(duckdb_extension_httpfs.__file__).parent / "extensions" / f"v{duckdb.__version__}" / \
            "httpfs.duckdb_extension"
    try:
        con.execute(f"LOAD {_sql_str(path)}" if path is not None and path.is_file() else "LOAD httpfs")
    except duckdb.Error as e:
        raise StoreError(f"s3:// stores read parts through DuckDB's httpfs extension, which did not load ({e}): "
                         f"pip install duckdb-extension-httpfs=={duckdb.__version__} (the pins in pyproject.toml)"
                         ) from e


_DATABASE: list[duckdb.DuckDBPyConnection] = []  # the process's in-memory database (`_in_memory`), once made
_FORKED_AWAY: list[duckdb.DuckDBPyConnection] = []  # a parent's, in a forked child: kept, never used or closed
_DATABASE_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child makes its own database: the parent's copy (its threads were not forked) is set aside
    untouched, and the lock is new (another thread may have held it at the fork)."""
    global _DATABASE_LOCK
    _FORKED_AWAY.extend(_DATABASE)
    _DATABASE.clear()
    _DATABASE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_memory() -> duckdb.DuckDBPyConnection:
    """A new connection (a cursor) to this process's one in-memory DuckDB database. A store query opens one each: a
    cursor costs microseconds, a new database about 20 ms (a study's summary makes hundreds). Temporary views are
    their connection's own, so queries on other threads or of other stores never see each other's."""
    with _DATABASE_LOCK:
        if not _DATABASE:
            _DATABASE.append(duckdb.connect())
        return _DATABASE[0].cursor()


class Store:
    def __init__(self, root: str | Path):
        self.remote = is_remote(root)
        self._footer_ok: dict[tuple[str, int, Any], bool] = {}
        self._listed: dict[str, tuple[int, Any]] = {}  # remote part -> (size, ETag) from its listing
        self._cache_warned = False
        if self.remote:
            self.root = self._remote_root(str(root))
            self.fs = self.root.fs
        else:
            import fsspec

            self.root = Path(root).resolve()
            self.fs = fsspec.filesystem("file")

    @staticmethod
    def _remote_root(url: str):
        if urlparse(url).scheme != "s3" or not urlparse(url).netloc:
            raise StoreError(f"store.root {url!r}: only local paths and s3://bucket[/prefix] URLs are supported")
        try:
            from upath import UPath
        except ImportError as e:
            raise StoreError("an s3:// store needs s3fs and universal-pathlib: pip install the project again "
                             "(they are dependencies in pyproject.toml)") from e
        opts: dict[str, Any] = {"use_listings_cache": False}  # other processes write here: never trust old listings
        if _s3_endpoint():
            opts["client_kwargs"] = {"endpoint_url": _s3_endpoint()}
        return UPath(url.rstrip("/"), **opts)

    # ---- paths and small files ------------------------------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.root / run_id

    def round_dir(self, run_id: str, round: int) -> Path:
        return self.run_dir(run_id) / f"round={round}"

    def checkpoint_dir(self, run_id: str, round: int) -> Path:
        return self.round_dir(run_id, round) / "checkpoint"

    def adapter_dir(self, run_id: str, round: int) -> Path:
        """Where a round's adapter is kept apart from its checkpoint (`keep_adapter`): outside the run's folders, so
        that a store kept in git can keep these while it leaves the checkpoints out."""
        return self.root / "adapters" / f"{run_id}-r{round}"

    def rounds_written(self, run_id: str) -> list[int]:
        """The rounds of a run with anything in the store (a manifest, a part, a checkpoint, a train stage's
        progress), in order."""
        base = self.run_dir(run_id)
        if self.remote:  # a prefix exists on object storage only while a key is under it
            names = [k.rsplit("/", 1)[-1] for k in self.fs.glob(f"{self.url(base)}/round=*")]
        else:
            names = [d.name for d in base.glob("round=*") if any(f.is_file() for f in d.rglob("*"))]
        return sorted(int(n.split("=", 1)[1]) for n in names if n.split("=", 1)[1].isdigit())

    def set_aside(self, run_id: str, paths: list[Path], why: str) -> Path:
        """Move folders of the store (rounds, derived runs) intact to `<run_id>/stale/<UTC stamp>/<name>`, out of
        every view (`<run>/round=*` only) and stage, so that what replaces them starts clean and nothing is lost;
        returns that folder. `why` says in the error what made them stale. Local stores only: on object storage a
        move is a copy and a delete per key, left to the operator."""
        dest = self.run_dir(run_id) / "stale" / utcnow().strftime("%Y%m%dT%H%M%SZ")
        if self.remote:
            moves = "; ".join(f"{p} -> {dest / p.name}" for p in paths)
            raise StoreError(f"{why}; an s3:// store's folders are not moved for you: move them by hand (e.g. "
                             f"`aws s3 mv --recursive`), then run again: {moves}")
        taken = [p.name for p in paths if (dest / p.name).exists()]
        if taken:
            raise StoreError(f"{why}; {dest} already holds {', '.join(taken)}: run again in a second")
        dest.mkdir(parents=True, exist_ok=True)
        for p in paths:
            os.rename(p, dest / p.name)  # one rename, so a folder is either here or there, whole
            fsync_dir(p.parent)
        fsync_dir(dest)
        return dest

    def cache_dir(self) -> Path | None:
        """`<root>/cache/`: executor replies and grader verdicts computed once (pipeline.engines.cache), shared by
        every run of the store. None for an s3:// store: the cache's files are appended to, which object storage
        cannot do; its stages compute every call (logged once)."""
        if self.remote:
            if not self._cache_warned:
                log.warning("store %s: no executor or verdict cache on object storage (its shard files are appended "
                            "to); every call is computed", self.root)
                self._cache_warned = True
            return None
        return self.root / "cache"

    def url(self, path: Any) -> str:
        """The filesystem's name for a store path: a local path, or `bucket/key` for `store.fs` on S3."""
        return path.path if self.remote else str(path)

    def runs(self) -> list[str]:
        if self.remote:
            return sorted(k.rsplit("/", 2)[-2] for k in self.fs.glob(f"{self.url(self.root)}/*/config.yaml"))
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "config.yaml").is_file())

    def put_text(self, path: Any, text: str) -> None:
        """Write a small file whole or not at all: temp file + rename locally, one PUT on object storage."""
        if self.remote:
            self.fs.pipe_file(self.url(path), text.encode())
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def append_line(self, path: Any, line: str) -> None:
        """Append a line (timings.jsonl). Object storage has no append: the object is rewritten whole with one PUT
        (a crash loses no earlier line; two writers of the same file at once could lose one's line)."""
        if not self.remote:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(line + "\n")
            return
        try:
            old = self.fs.cat_file(self.url(path)).decode()
        except FileNotFoundError:
            old = ""
        self.put_text(path, old + line + "\n")

    @contextlib.contextmanager
    def output_dir(self, path: Any) -> Iterator[Path]:
        """A local folder to write a set of result files into (experiments, ablations): `path` itself locally; on
        object storage a temp folder whose files are uploaded under `path` when the block succeeds."""
        if not self.remote:
            path.mkdir(parents=True, exist_ok=True)
            yield path
            return
        with tempfile.TemporaryDirectory(prefix="store-out-") as tmp:
            yield Path(tmp)
            for f in sorted(Path(tmp).rglob("*")):
                if f.is_file() and not f.name.startswith("."):
                    self.fs.put_file(str(f), f"{self.url(path)}/{f.relative_to(tmp).as_posix()}")

    # ---- writing -------------------------------------------------------------------------------
    def write(self, table: str, rows: pa.Table | pl.DataFrame | Iterable[dict], run_id: str, round: int) -> Path | None:
        """Write one immutable part (temp file + rename, so readers never see half a file; on object storage the
        part is built in memory and sent as one PUT, which is visible whole or not at all)."""
        data = to_arrow(table, rows, run_id)
        if data.num_rows == 0:
            return None
        folder = self.round_dir(run_id, round) / table
        name = f"part-{uuid.uuid4().hex}.parquet"
        if self.remote:
            return self._write_remote(data, folder / name, table, run_id, round)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp"  # hidden: globs for *.parquet never match it
        try:
            pq.write_table(data, tmp, compression="zstd", row_group_size=128 * 1024)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, folder / name)
            fsync_dir(folder)  # the part's name must outlive a power loss as surely as the manifest written after it
        except OSError as e:  # e.g. a full disk: no part, no temp file left; say where and what was lost
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"store: {data.num_rows} {table} rows of run {run_id!r} round {round} not "
                          f"written to {folder}: {e.strerror or e}") from e
        return folder / name

    def _write_remote(self, data: pa.Table, dest: Any, table: str, run_id: str, round: int) -> Any:
        # not fs.open(..., "wb"): its close() on an exception uploads what was buffered, a visible partial part
        buf = pa.BufferOutputStream()
        pq.write_table(data, buf, compression="zstd", row_group_size=128 * 1024)
        try:
            self.fs.pipe_file(self.url(dest), buf.getvalue().to_pybytes())
        except OSError as e:
            raise OSError(e.errno, f"store: {data.num_rows} {table} rows of run {run_id!r} round {round} not "
                                   f"written to {dest}: {e.strerror or e}") from e
        return dest

    # ---- parts and reading ------------------------------------------------------------------------
    def parts(self, table: str, run_id: str | None = None, round: int | None = None) -> list[Path]:
        schema(table)
        run = run_id or "*"
        rnd = "*" if round is None else str(round)
        if not self.remote:
            return sorted(self.root.glob(f"{run}/round={rnd}/{table}/*.parquet"))
        found = self.fs.glob(f"{self.url(self.root)}/{run}/round={rnd}/{table}/*.parquet", detail=True)
        self._listed.update({k: (v["size"], v.get("ETag")) for k, v in found.items()})
        return [self.root / k[len(self.url(self.root)) + 1:] for k in sorted(found)]

    def _is_ok(self, part: Path) -> bool:
        if self.remote:  # size and ETag from the listing: no request per part
            size, stamp = self._listed.get(self.url(part)) or (self.fs.info(self.url(part))["size"], None)
        else:
            st = part.stat()
            size, stamp = st.st_size, st.st_mtime
        key = (str(part), size, stamp)
        ok = self._footer_ok.get(key)
        if ok is None:
            try:
                if self.remote:
                    with self.fs.open(self.url(part), "rb") as f:
                        pq.read_metadata(f)
                else:
                    pq.read_metadata(part)
                ok = True
            except Exception as e:  # any unreadable footer: name the file, keep going
                warnings.warn(f"corrupt Parquet part skipped (left in place): {part}: {e}", CorruptPartWarning,
                              stacklevel=3)
                ok = False
            self._footer_ok[key] = ok
        return ok

    def good_parts(self, table: str, run_id: str | None = None, round: int | None = None) -> list[Path]:
        return [p for p in self.parts(table, run_id, round) if self._is_ok(p)]

    def corrupt_parts(self) -> list[Path]:
        return [p for t in TABLES for p in self.parts(t) if not self._is_ok(p)]

    def _polars_options(self) -> dict[str, str] | None:
        """polars' object-store settings for the same server and credentials s3fs uses."""
        if not self.remote:
            return None
        key, secret, token = _s3_credentials()
        opts = {"aws_access_key_id": key, "aws_secret_access_key": secret, "aws_session_token": token,
                "aws_region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
                "aws_endpoint_url": _s3_endpoint()}
        if (_s3_endpoint() or "").startswith("http://"):
            opts["aws_allow_http"] = "true"
        return {k: v for k, v in opts.items() if v}

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
            missing_columns="insert", extra_columns="ignore", storage_options=self._polars_options(),
        )

    def read(self, table: str, run_id: str, round: int | None = None) -> pl.DataFrame:
        return self.scan(table, run_id, round).collect()

    # ---- DuckDB ----------------------------------------------------------------------------
    def _view_sql(self, table: str, run: str | None = None) -> str:
        """The table's view over every run's parts, or over run `run`'s alone."""
        files = self.parts(table, run)
        good = [p for p in files if self._is_ok(p)]
        cols = ", ".join(f"CAST(NULL AS {_duck_type(f.type)}) AS {f.name}" for f in schema(table))
        empty = f"SELECT {cols}, CAST(NULL AS INTEGER) AS round WHERE false"
        if not good:
            return empty
        opts = "hive_partitioning = true, union_by_name = true, hive_types = {'round': INTEGER}"
        if len(good) == len(files):  # glob: parts written after the refresh are visible too
            src = f"'{self.root}/{run or '*'}/round=*/{table}/*.parquet'"
        else:  # a corrupt part would fail the whole glob: list the readable ones
            src = "[" + ", ".join(f"'{p}'" for p in good) + "]"
        # the empty typed relation first: every column of the schema exists even when no part has it yet (parts
        # written before a column was added), and BY NAME never duplicates one a newer part has
        return f"{empty} UNION ALL BY NAME SELECT * FROM read_parquet({src}, {opts})"

    def _cache_view_sql(self, kind: str) -> str:
        """The `<kind>_cache` view: the cache's shard files (an empty typed relation without any, or on S3)."""
        cols = CACHE_VIEWS[kind]
        folder = None if self.remote else self.root / "cache" / kind
        if folder is None or not any(folder.glob("*.jsonl")):
            return "SELECT " + ", ".join(f"CAST(NULL AS {t}) AS {c}" for c, t in cols.items()) + " WHERE false"
        spec = ", ".join(f"{_sql_str(c)}: {_sql_str(t)}" for c, t in cols.items())
        return (f"SELECT * FROM read_json({_sql_str(str(folder / '*.jsonl'))}, format = 'newline_delimited', "
                f"ignore_errors = true, columns = {{{spec}}}) WHERE key IS NOT NULL")

    def _create_views(self, con: duckdb.DuckDBPyConnection, names: frozenset[str] | None = None,
                      temporary: bool = False, run: str | None = None) -> None:
        """The catalog's views, or only `names` (`views_for`): DuckDB binds a view when it is made, reading every
        part's schema, which is most of a small query's time. `temporary`: the connection's own (TEMP) views; `run`:
        the tables' views over that run's parts alone."""
        view = "TEMP VIEW" if temporary else "VIEW"
        for t in TABLES:
            if names is None or t in names:
                con.execute(f"CREATE OR REPLACE {view} {t} AS {self._view_sql(t, run)}")
        for name, sql in VIEWS.items():  # in dependency order
            if names is None or name in names:
                con.execute(f"CREATE OR REPLACE {view} {name} AS {sql}")
        for kind in CACHE_VIEWS:
            if names is None or f"{kind}_cache" in names:
                con.execute(f"CREATE OR REPLACE {view} {kind}_cache AS {self._cache_view_sql(kind)}")

    def _attach_s3(self, con: duckdb.DuckDBPyConnection) -> None:
        """httpfs plus a temporary (in-memory, never persisted) S3 secret for this connection."""
        load_httpfs(con)
        key, secret, token = _s3_credentials()
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        fields = {"KEY_ID": key, "SECRET": secret, "SESSION_TOKEN": token, "REGION": region}
        extra = ""
        if _s3_endpoint():  # an S3-compatible server (MinIO, moto, Ceph): path-style URLs on its host
            ep = urlparse(_s3_endpoint())
            fields["ENDPOINT"] = ep.netloc
            extra = f", URL_STYLE 'path', USE_SSL {'false' if ep.scheme == 'http' else 'true'}"
        body = ", ".join(f"{k} {_sql_str(v)}" for k, v in fields.items() if v)
        con.execute(f"CREATE OR REPLACE TEMPORARY SECRET store_s3 (TYPE s3, {body}{extra})")

    def generation_scores(self, run_id: str, round: int, reps: int, transient: Iterable[str]) -> pl.DataFrame:
        """The `generation_scores` rows of one round, ordered (query, parent, slot), with `state`:
        ok (final: scored on all `reps`, or invalid), transient (a latest run has a status in `transient`,
        which is re-run by `score --only-failed` and waited for by curation), scorer_error (a run's user scorer
        failed: status `error`, re-scored by `score --only-failed`), or unscored (reps missing)."""
        return self.sql(
            "SELECT *, CASE WHEN NOT valid THEN 'ok' "
            "WHEN transient_runs > 0 OR (list_contains($transient, 'timeout') AND timeout_runs > 0) THEN 'transient' "
            "WHEN error_runs > 0 THEN 'scorer_error' "
            "WHEN reps_scored < $reps THEN 'unscored' ELSE 'ok' END AS state "
            "FROM generation_scores WHERE run_id = $run AND round = $round "
            "ORDER BY query_id, parent_id NULLS FIRST, slot, gen_id",
            {"run": run_id, "round": round, "reps": reps, "transient": sorted(transient)}, run=run_id)

    def connect(self, names: frozenset[str] | None = None, run: str | None = None) -> duckdb.DuckDBPyConnection:
        """In-memory connection with the catalog's views, or only `names` (no lock on catalog.duckdb): locally a new
        connection to the process's one in-memory database (`_in_memory`) with the views as its own temporary ones;
        on object storage a database of its own, with httpfs and the S3 secret. `run`: the tables hold that run's
        rows alone."""
        if run is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=+-]*", run):
            raise StoreError(f"run id {run!r}: not a run folder's name")
        if self.remote:
            con = duckdb.connect()
            self._attach_s3(con)
            self._create_views(con, names, run=run)
            return con
        con = _in_memory()
        self._create_views(con, names, temporary=True, run=run)
        return con

    def sql(self, query: str, params: dict[str, Any] | list[Any] | None = None, run: str | None = None
            ) -> pl.DataFrame:
        """Run a query over the views it names (`views_for`); `params` binds `$name` parameters (a dict) or `?`
        ones (a list). `run`: a query that reads one run's rows alone says which, and its views then read that run's
        parts, not every part of the store (a query's time grows with the store's parts otherwise)."""
        con = self.connect(views_for(query), run)
        try:
            rel = con.sql(query, params=params)
            return rel.pl() if rel is not None else pl.DataFrame()
        finally:
            con.close()

    def refresh_catalog(self) -> Path:
        """Rebuild <root>/catalog.duckdb atomically for the `duckdb` CLI, in a storage version that CLI reads
        (see CATALOG_STORAGE). Local stores only: on S3 the views need httpfs and a secret in every session."""
        if self.remote:
            raise StoreError(f"refresh_catalog: {CATALOG} is a local file for the `duckdb` CLI and is not kept for "
                             f"an s3:// store ({self.root}); query it with `pipeline sql` or Store.sql, which load "
                             "httpfs and the S3 settings themselves")
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

    # ---- leases -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, run_id: str, name: str, what: str, shared: bool = False, wait: bool = False) -> Iterator[Lease]:
        """Hold the lease `<run_id>/_leases/<name>` for the block (pipeline/store/lease.py): an OS file lock here, a
        lease object with a heartbeat on S3. Another holder: `LeaseHeld` naming it, or with `wait` block until it is
        gone. `what` names what the lease guards in messages. `shared` (local stores only): several shared holders
        at once, none beside an exclusive one."""
        path = self.run_dir(run_id) / LEASES / name
        if self.remote:
            if shared:
                raise StoreError(f"{what}: an s3:// store has no shared lease")
            bucket, _, key = self.url(path).partition("/")
            held: Lease = S3Lease(_s3_client(), bucket, f"{key}.json", what).acquire(wait)
        else:
            held = FileLease(path.parent / f"{name}.lock", what, shared).acquire(wait)
        try:
            yield held
        finally:
            held.release()

    # ---- manifests and configs ----------------------------------------------------------------
    def _manifest_path(self, run_id: str, round: int, stage: str) -> Path:
        return self.round_dir(run_id, round) / "_done" / f"{stage}.json"

    def write_manifest(self, run_id: str, round: int, stage: str, config_hash: str, **counts: Any) -> dict:
        """Written after the data it covers (callers finish their writes first), whole or not at all."""
        path = self._manifest_path(run_id, round, stage)
        body = {"stage": stage, "round": round, "config_hash": config_hash, "finished_at": utcnow().isoformat(),
                "counts": counts}
        if self.remote:
            self.put_text(path, json.dumps(body, indent=2, default=str))
            return body
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:  # after a power loss a manifest is whole and present, or absent: never empty
            f.write(json.dumps(body, indent=2, default=str))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename
        fsync_dir(path.parent.parent)  # `_done` itself, when this write created it
        return body

    def manifest(self, run_id: str, round: int, stage: str) -> dict | None:
        text = self.read_text(self._manifest_path(run_id, round, stage))
        return None if text is None else json.loads(text)

    def clear_manifest(self, run_id: str, round: int, stage: str) -> None:
        path = self._manifest_path(run_id, round, stage)
        if self.remote:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.url(path))
            return
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)  # a cleared manifest must not come back after a power loss

    def read_config(self, run_id: str) -> str | None:
        """The run's frozen config.yaml text; None: no such run."""
        return self.read_text(self.run_dir(run_id) / "config.yaml")

    def read_text(self, path: Any) -> str | None:
        """A file of the store as text; None: no such file."""
        if self.remote:
            try:
                return self.fs.cat_file(self.url(path)).decode()
            except FileNotFoundError:
                return None
        return path.read_text() if path.is_file() else None

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint_complete(self, run_id: str, round: int) -> bool:
        return adapter_complete(self.checkpoint_dir(run_id, round))

    def publish_checkpoint(self, save: Callable[[Path], None], run_id: str, round: int) -> Path:
        """Save a round's adapter with `save(folder)` (e.g. peft's `model.save_pretrained`) and publish it as the
        round's checkpoint, which is whole or looks incomplete, never half of one that looks complete:
        locally into a temp folder renamed into place; on object storage into the local checkpoint cache, then
        any old checkpoint's marker and files are deleted, every other file is uploaded (one PUT each, in turn)
        and CHECKPOINT_MARKER last, so the marker exists only once the weights do."""
        from pipeline.engines.models import atomic_dir

        dest = self.checkpoint_dir(run_id, round)
        local = self._cache_path(dest) if self.remote else dest
        with atomic_dir(local, suffix=".tmp") as tmp:
            save(tmp)
            for file in ADAPTER_FILES:
                with open(tmp / file, "rb") as fh:
                    os.fsync(fh.fileno())
        if self.remote:
            self._drop_remote_checkpoint(dest)
            files = sorted((f for f in local.rglob("*") if f.is_file()), key=lambda f: f.name == CHECKPOINT_MARKER)
            for file in files:
                self.fs.put_file(str(file), f"{self.url(dest)}/{file.relative_to(local).as_posix()}")
            (local / ".source").write_text(self._remote_stamp(dest))
        return dest

    def keep_adapter(self, run_id: str, round: int, notes: dict[str, str | bytes]) -> Path:
        """Copy a round's complete checkpoint to `adapter_dir`: the LoRA files alone (ADAPTER_FILES; nothing else the
        folder may hold), the run's frozen config as KEPT_CONFIG and `notes` (file name -> text or bytes; one of
        ADAPTER_FILES there replaces the checkpoint's), whole or absent (one rename). A folder that already holds
        exactly these bytes is left as it is, so a resumed study rewrites nothing; a retrained checkpoint replaces
        it. Local stores only."""
        from pipeline.engines.models import atomic_dir

        if self.remote:
            raise StoreError(f"keep_adapter: {self.root} is an s3:// store, whose checkpoints stay in the bucket")
        src = self.checkpoint_dir(run_id, round)
        if not adapter_complete(src):
            raise StoreError(f"run {run_id!r} round {round}: no complete checkpoint to keep ({src})")
        files = {f: (src / f).read_bytes() for f in ADAPTER_FILES}
        files[KEPT_CONFIG] = (self.run_dir(run_id) / "config.yaml").read_bytes()
        files |= {name: text if isinstance(text, bytes) else text.encode() for name, text in notes.items()}
        dest = self.adapter_dir(run_id, round)
        if dest.is_dir() and {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()} == files:
            return dest
        with atomic_dir(dest, suffix=".tmp") as tmp:  # .tmp: ignored by git until renamed into place
            for name, data in files.items():
                with open(tmp / name, "wb") as f:  # on disk before the rename names them
                    f.write(data)
                    os.fsync(f.fileno())
        fsync_dir(dest.parent)
        return dest

    def restore_checkpoint(self, run_id: str, round: int) -> bool:
        """Round `round`'s checkpoint back from its kept copy (`keep_adapter`, `adapter_dir`) when it is gone: a store
        kept in git holds adapters/ but no checkpoint/, so a run cut off by the end of a machine resumes on a fresh
        clone instead of training that round again. Only a copy made from the weights the train stage's manifest
        names (KEPT_SOURCE = its `weights_sha256`) is restored; its weights may be rounded to float16
        (pipeline.studies.experiment.keep_adapter), which the loaders cast to the model's dtype. True: restored.
        Local stores only (an s3:// store keeps its checkpoints)."""
        if self.remote or self.checkpoint_complete(run_id, round):
            return False
        done, kept = self.manifest(run_id, round, "train"), self.adapter_dir(run_id, round)
        want = (done or {}).get("counts", {}).get("weights_sha256")
        if not want or not adapter_complete(kept) or not (kept / KEPT_SOURCE).is_file():
            return False
        if (kept / KEPT_SOURCE).read_text().strip() != want:
            log.warning("run %s round %d: the kept adapter %s was made from other weights than the train stage's "
                        "manifest names; not restored", run_id, round, kept)
            return False
        self.publish_checkpoint(lambda tmp: [shutil.copyfile(kept / f, tmp / f) for f in ADAPTER_FILES], run_id, round)
        return True

    def local_adapter(self, path: str | Path | Any) -> Path | None:
        """A local folder for an adapter reference (peft and vLLM read local folders): a local path as given; an
        s3:// checkpoint downloaded once into the cache ($PIPELINE_CACHE_DIR/s3/...), again when the published
        one changed; None when that checkpoint is missing or incomplete (its marker not uploaded yet)."""
        if not is_remote(path):
            return Path(path).expanduser()
        ref = self._remote_root(path) if isinstance(path, str) else path  # same server settings as the root
        if not adapter_complete(ref):
            return None
        local, stamp = self._cache_path(ref), self._remote_stamp(ref)
        src = local / ".source"
        if adapter_complete(local) and src.is_file() and src.read_text() == stamp:
            return local
        from pipeline.engines.models import atomic_dir

        with atomic_dir(local, suffix=".tmp") as tmp:
            prefix = ref.path.rstrip("/") + "/"
            for key in ref.fs.find(prefix):
                out = tmp / key[len(prefix):]
                out.parent.mkdir(parents=True, exist_ok=True)
                ref.fs.get_file(key, str(out))
            (tmp / ".source").write_text(stamp)
        return local

    def _cache_path(self, remote: Any) -> Path:
        from pipeline.engines.models import cache_dir

        return cache_dir() / "s3" / remote.path

    def _remote_stamp(self, ckpt: Any) -> str:
        """Identifies one published checkpoint: its adapter files' ETags (a re-published one has new ones)."""
        return ",".join(str(ckpt.fs.info(f"{ckpt.path}/{f}").get("ETag")) for f in ADAPTER_FILES)

    def _drop_remote_checkpoint(self, ckpt: Any) -> None:
        # the marker first: an interrupted delete leaves a checkpoint that looks incomplete, never a mixed one
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.url(ckpt)}/{CHECKPOINT_MARKER}")
        keys = self.fs.find(self.url(ckpt) + "/")
        if keys:
            self.fs.rm(keys)

    def discard_unfinished(self, run_id: str, round: int, tables: Iterable[str], checkpoint: bool = False) -> int:
        """Remove what an attempt that died before its manifest left behind (parts of `tables`, and the round's
        checkpoint folder or prefix), so the next attempt starts clean and never duplicates rows; returns parts
        removed."""
        stale = [p for t in tables for p in self.parts(t, run_id, round)]
        ckpt = self.checkpoint_dir(run_id, round)
        has_ckpt = checkpoint and (bool(self.fs.find(self.url(ckpt) + "/")) if self.remote else ckpt.exists())
        if stale or has_ckpt:
            log.warning("run %s round %d: discarding %d part(s)%s of an unfinished attempt", run_id, round, len(stale),
                        " and the checkpoint" if has_ckpt else "")
        self.discard_parts(stale)
        if has_ckpt and self.remote:
            self._drop_remote_checkpoint(ckpt)
        elif has_ckpt:
            shutil.rmtree(ckpt)
        return len(stale)

    def discard_parts(self, parts: list[Path]) -> None:
        """Remove parts for good: what an attempt that died wrote (`discard_unfinished`; an SMC run's chunk cut off
        before its final workflows, pipeline.studies.smc)."""
        if self.remote:
            if parts:
                self.fs.rm([self.url(p) for p in parts])
            return
        for p in parts:
            p.unlink(missing_ok=True)

    def part_values(self, part: Path, column: str) -> set:
        """The distinct values of one column of one part."""
        df = pl.read_parquet(str(part), columns=[column], storage_options=self._polars_options())
        return set(df[column].to_list())
