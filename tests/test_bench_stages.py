"""`pipeline bench stages RUN`: a seed's wall time per round and stage, from hand-written timings.jsonl lines."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pipeline.cli import app


def _run(root, run_id: str, lines: list[dict]) -> None:
    folder = root / run_id
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"run_id: {run_id}\n")  # what makes a folder a run (Store.runs)
    (folder / "timings.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_seed_and_its_evaluations_per_round_and_stage(tmp_path):
    machine = "AMD EPYC (AVX2, 2 cores)"
    _run(tmp_path, "x-s0", [
        {"round": 0, "stage": "rollout", "skipped": False, "wall_s": 10.0},  # an attempt that failed: the last counts
        {"round": 0, "stage": "rollout", "skipped": False, "wall_s": 30.0, "machine": machine},
        {"round": 0, "stage": "score", "skipped": False, "wall_s": 50.0, "machine": machine},
        {"round": 0, "stage": "score", "skipped": True, "wall_s": 0.0, "machine": machine},  # a resume's skip
    ])
    _run(tmp_path, "x-s0-eval-r0", [{"round": 0, "stage": "rollout", "skipped": False, "wall_s": 10.0},
                                    {"round": 0, "stage": "score", "skipped": False, "wall_s": 10.0}])
    _run(tmp_path, "x-s01-eval-r0", [{"round": 0, "stage": "score", "skipped": False, "wall_s": 999.0}])  # not its
    res = CliRunner().invoke(app, ["bench", "stages", "x-s0", "--store", str(tmp_path)])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.output.splitlines()]
    # total 30 + 50 + 10 + 10 = 100 s: the shares are the seconds in percent
    assert res.output.splitlines()[0] == f"x-s0: 100.0 s in 4 stages on {machine}"
    assert ["run", "0", "rollout", "30.0", "30.0%"] in rows and ["run", "0", "score", "50.0", "50.0%"] in rows
    assert ["run", "all", "(total)", "80.0", "80.0%"] in rows
    assert ["eval-r0", "0", "score", "10.0", "10.0%"] in rows and ["eval-r0", "all", "(total)", "20.0", "20.0%"] in rows
    by_stage = rows[rows.index(["by", "stage:"]) + 1:]
    assert by_stage == [["rollout", "40.0", "40.0%"], ["score", "60.0", "60.0%"]]

    alone = CliRunner().invoke(app, ["bench", "stages", "x-s0", "--store", str(tmp_path), "--no-evaluations"])
    assert alone.output.splitlines()[0].startswith("x-s0: 80.0 s in 2 stages") and "eval-r0" not in alone.output


def test_an_unknown_run_is_named(tmp_path):
    _run(tmp_path, "x-s0", [])
    res = CliRunner().invoke(app, ["bench", "stages", "nope", "--store", str(tmp_path)])
    assert res.exit_code == 2 and "no run 'nope'" in res.output and "x-s0" in res.output
    empty = CliRunner().invoke(app, ["bench", "stages", "x-s0", "--store", str(tmp_path)])
    assert empty.exit_code == 0 and "no timed stage" in empty.output
