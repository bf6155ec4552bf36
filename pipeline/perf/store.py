"""`pipeline bench store`: write N synthetic `generations` rows through the store, then aggregate them.

Baseline in the same run: pyarrow's plain `write_table` of the same data to one file, so the ratio
shows what the store's schema coercion, part files and fsync cost on this machine.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.store import Store

TOKENS_PER_ROW = 32
PART_ROWS = 100_000


def synthetic_generations(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    query_numbers = rng.integers(0, max(1, rows // 16), rows)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * TOKENS_PER_ROW)
    ids = pa.array(rng.integers(0, 49152, rows * TOKENS_PER_ROW, dtype=np.int32))
    lps = pa.array(-rng.exponential(1.0, rows * TOKENS_PER_ROW).astype(np.float32))
    texts = [f"async def solve(problem):\n    return (await llm(problem))[{i % 7}]\n" for i in range(64)]
    return pa.table({
        "gen_id": pa.array([f"g{i:08d}" for i in range(rows)]),
        "kind": pa.array(np.where(rng.random(rows) < 0.2, "agent", "workflow")),
        "query_id": pa.array([f"q{x:06d}" for x in query_numbers]),
        "slot": pa.array((np.arange(rows) % 16).astype(np.int32)),
        "text": pa.array([texts[i % 64] for i in range(rows)]),
        "token_ids": pa.ListArray.from_arrays(offsets, ids),
        "token_logprobs": pa.ListArray.from_arrays(offsets, lps),
        "model": pa.array(["smollm2"] * rows),
        "valid": pa.array(rng.random(rows) < 0.8),
        "latency_s": pa.array(rng.random(rows)),
    })


AGG = """
SELECT kind, valid, count(*) AS n, avg(len(token_ids)) AS tokens, avg(latency_s) AS latency,
       count(DISTINCT query_id) AS queries
FROM generations WHERE run_id = 'bench' GROUP BY ALL ORDER BY ALL
"""


def main(rows: int = 1_000_000, root: Path | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        root = Path(root or tmp)
        began = time.perf_counter()
        data = synthetic_generations(rows)
        t_gen = time.perf_counter() - began

        began = time.perf_counter()
        pq.write_table(data, root / "baseline.parquet", compression="zstd")
        t_base = time.perf_counter() - began

        store = Store(root / "store")
        began = time.perf_counter()
        for start in range(0, rows, PART_ROWS):
            store.write("generations", data.slice(start, PART_ROWS), "bench", 0)
        t_write = time.perf_counter() - began

        began = time.perf_counter()
        store.refresh_catalog()
        t_cat = time.perf_counter() - began

        con = store.connect()
        began = time.perf_counter()
        res = con.execute(AGG).fetchall()
        t_agg = time.perf_counter() - began
        con.close()
        assert sum(r[2] for r in res) == rows, "aggregate lost rows"

    print(f"rows                      {rows:,} ({TOKENS_PER_ROW} tokens each, {rows // PART_ROWS or 1} parts)")
    print(f"synthesise                {t_gen:7.2f} s")
    print(f"baseline pq.write_table   {t_base:7.2f} s   {rows / t_base:12,.0f} rows/s")
    print(f"store.write (goal <=10 s) {t_write:7.2f} s   {rows / t_write:12,.0f} rows/s   "
          f"ratio vs baseline {t_write / t_base:.2f}x")
    print(f"refresh catalog           {t_cat:7.3f} s")
    print(f"aggregate SQL (goal <=1s) {t_agg:7.3f} s   ({len(res)} result rows)")
