"""The SQL shells the README promises, run exactly as the README writes them, on a store made here; and the
store's Parquet parts read by polars, pandas and DuckDB alike."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pytest

from pipeline.store import Store

REPO = Path(__file__).resolve().parents[1]


def readme_line(prefix: str) -> list[str]:
    """The README's command line starting with `prefix`, comment stripped."""
    lines = [ln.strip() for ln in (REPO / "README.md").read_text().splitlines()]
    line = next((ln for ln in lines if ln.startswith(prefix)), None)
    assert line is not None, f"the README no longer shows `{prefix} ...`"
    return shlex.split(line.split("#")[0])


@pytest.fixture()
def workdir(tmp_path):
    """A working directory whose data/runs holds two generations, one agent, and two score attempts of one
    generation (latest_scores keeps the second)."""
    st = Store(tmp_path / "data" / "runs")
    st.write("generations", [{"gen_id": "g1", "kind": "workflow", "query_id": "q"},
                             {"gen_id": "g2", "kind": "workflow", "query_id": "q"},
                             {"gen_id": "a1", "kind": "agent", "query_id": "q"}], "r1", 0)
    st.write("scores", [{"gen_id": "g1", "rep": 0, "attempt": 0, "status": "executor_error"}], "r1", 0)
    st.write("scores", [{"gen_id": "g1", "rep": 0, "attempt": 1, "status": "ok"}], "r1", 0)
    st.refresh_catalog()
    return tmp_path


SQL = (".mode csv\nselect kind, count(*) as n from generations group by 1 order by 1;\n"
       "select gen_id, status from latest_scores;\n")


def test_readme_duckdb_cli_reads_the_catalog(workdir):
    cmd = readme_line("duckdb -readonly")
    exe = shutil.which(cmd[0])
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("the duckdb CLI (duckdb-cli, a pinned dependency) is not installed")
        pytest.skip("the duckdb CLI is not installed here (scripts/setup.sh installs it)")
    r = subprocess.run([exe, *cmd[1:]], cwd=workdir, input=SQL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["kind,n", "agent,1", "workflow,2", "gen_id,status", "g1,ok"], r.stdout + r.stderr


def test_readme_pipeline_sql_shell(workdir):
    cmd = readme_line("pipeline sql   ")  # the interactive line, not the one-query line
    assert cmd == ["pipeline", "sql"]
    stmts = "select kind, count(*) as n from generations\n group by 1 order by 1;\nselect nope;\n" \
            "select status from latest_scores;\n.quit\nselect 'after quit';\n"
    exe = shutil.which("pipeline", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert exe is not None, "the `pipeline` command is not installed"
    r = subprocess.run([exe, *cmd[1:]], cwd=workdir, input=stmts,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "workflow" in out and "│ 2 " in out and "agent" in out  # a statement over two lines
    assert "SQL error" in r.stderr and "nope" in r.stderr  # a bad statement costs only itself
    assert "executor_error" not in out and "│ ok " in out  # the view, not the raw attempts
    assert "after quit" not in out


def test_parquet_parts_read_by_polars_pandas_and_duckdb(workdir):
    st = Store(workdir / "data" / "runs")
    part = st.parts("generations", "r1", 0)[0]
    by_polars = pl.read_parquet(part).sort("gen_id")["gen_id"].to_list()
    by_pandas = pd.read_parquet(part).sort_values("gen_id")["gen_id"].tolist()
    by_duckdb = [r[0] for r in duckdb.sql(f"select gen_id from read_parquet('{part}') order by 1").fetchall()]
    assert by_polars == by_pandas == by_duckdb == ["a1", "g1", "g2"]
