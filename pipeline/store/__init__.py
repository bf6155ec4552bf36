"""The store: immutable Parquet parts per (run, round, table), stage manifests, checkpoints, and the DuckDB
catalog of views. `store.py` reads and writes, `lease.py` keeps one writer per stage, `schema.py` declares the
tables, `views.py` holds every SQL view."""

from pipeline.store.lease import Holder, LeaseHeld, LeaseLost, noting
from pipeline.store.store import (
    ADAPTER_FILES,
    ADAPTER_WEIGHTS,
    CATALOG,
    CATALOG_STORAGE,
    CHECKPOINT_MARKER,
    ENDPOINT_ENV,
    KEPT_CONFIG,
    KEPT_SOURCE,
    CorruptPartWarning,
    Store,
    StoreError,
    adapter_complete,
    is_remote,
    load_httpfs,
    store_for,
    to_arrow,
    use_endpoint,
    utcnow,
    weights_sha256,
)
from pipeline.store.views import GENERATION_SCORES_SQL, QUERY_USAGE_SQL, round_stats

__all__ = [
    "CATALOG",
    "CATALOG_STORAGE",
    "ADAPTER_FILES",
    "ADAPTER_WEIGHTS",
    "CHECKPOINT_MARKER",
    "ENDPOINT_ENV",
    "KEPT_CONFIG",
    "KEPT_SOURCE",
    "weights_sha256",
    "CorruptPartWarning",
    "adapter_complete",
    "utcnow",
    "to_arrow",
    "StoreError",
    "is_remote",
    "use_endpoint",
    "store_for",
    "load_httpfs",
    "Store",
    "Holder",
    "LeaseHeld",
    "LeaseLost",
    "noting",
    "GENERATION_SCORES_SQL",
    "QUERY_USAGE_SQL",
    "round_stats",
]
