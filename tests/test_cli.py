import json
import re

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.store import Store

runner = CliRunner()


def test_every_command_has_help():
    for args in [[], ["validate"], ["rollout"], ["score"], ["curate"], ["train"], ["sql"], ["prepare-model"],
                 ["bench"], ["bench", "store"]]:
        r = runner.invoke(app, [*args, "--help"])
        assert r.exit_code == 0, (args, r.output)
        assert re.search(rf"Usage: \S+ {' '.join(args)}".rstrip(), r.output), r.output  # this command's usage


def test_validate_reports_field(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("scoring:\n  reps: 0\n")
    r = runner.invoke(app, ["validate", str(p)])
    assert r.exit_code == 2 and "scoring.reps" in r.output


def test_sql_prints_and_writes(tmp_path):
    st = Store(tmp_path)
    st.write("generations", [{"gen_id": f"g{i}", "kind": "workflow", "query_id": "q"} for i in range(3)], "r", 0)
    r = runner.invoke(app, ["sql", "select count(*) as n from generations", "--store", str(tmp_path)])
    assert r.exit_code == 0 and re.search(r"┃\s*n\s*┃", r.output) and re.search(r"│\s*3\s*│", r.output), r.output
    out = tmp_path / "o.json"
    r = runner.invoke(app, ["sql", "select gen_id from generations order by 1", "--store", str(tmp_path),
                            "--out", str(out)])
    assert r.exit_code == 0
    assert [row["gen_id"] for row in json.loads(out.read_text())] == ["g0", "g1", "g2"]
    assert (tmp_path / "catalog.duckdb").is_file()
    r = runner.invoke(app, ["sql", "select nope from generations", "--store", str(tmp_path)])
    assert r.exit_code == 2 and "SQL error" in r.output
