import json
import re
from pathlib import Path

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


def test_every_option_is_defined_once_and_every_stage_takes_the_same_ones():
    from pathlib import Path

    import pipeline.cli

    text = Path(pipeline.cli.__file__).read_text()
    written = re.findall(r'typer\.Option\(\s*"(--[a-z-]+)"', text)
    assert sorted(o for o in set(written) if written.count(o) > 1) == []
    common = {"--run-id", "--round", "--set", "--store", "--wait"}
    for stage in ("rollout", "score", "curate", "train"):
        names = {p.opts[0] for p in pipeline.cli.typer.main.get_command(app).commands[stage].params if p.opts}
        assert common <= names, (stage, common - names)


def test_curate_and_train_take_the_store_of_another_run(tmp_path):
    """A run in another store is reached by --store on every stage, as on score (not its frozen config's path)."""
    for stage in ("curate", "train"):
        r = runner.invoke(app, [stage, "--run-id", "nope", "--store", str(tmp_path)])
        assert "No such option" not in r.output and r.exit_code == 2, r.output
        assert "nope" in r.output


def test_smc_plain_l_points_at_sample():
    r = runner.invoke(app, ["smc", "c.yaml", "--plain-l", "12"])
    assert r.exit_code == 2 and "pipeline sample c.yaml --l 12" in r.output


def test_the_commands_that_run_work_go_through_the_api():
    """One door: a command runs a stage, a study or an evaluation only through pipeline.api (what a notebook
    calls), so cli.py takes from the studies and the stage loop only their errors, records and formatting helpers,
    never a runner."""
    import ast

    import pipeline.cli

    tree = ast.parse(Path(pipeline.cli.__file__).read_text())
    taken = {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith(("pipeline.studies", "pipeline.stages")) for alias in node.names}
    allowed = {"pipeline.stages.runner.StageError", "pipeline.stages.runner.RetryPolicy",
               "pipeline.stages.rounds.direct_call",  # `bench seed` measures the stage loop itself (pipeline.perf)
               "pipeline.studies.formatting.num", "pipeline.studies.methods.parse_arm_sets",
               "pipeline.studies.headroom.markdown", "pipeline.studies.tracking.TrackingError",
               "pipeline.studies.experiment.status_table", "pipeline.studies.experiment.time_left",
               "pipeline.studies.experiment.timing_machines"}
    assert sorted(taken - allowed - {n for n in taken if n.startswith("pipeline.studies.summaries.")}) == []
