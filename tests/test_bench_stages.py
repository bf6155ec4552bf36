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


def test_against_a_baseline_store_each_stage_is_a_ratio(tmp_path):
    base, new = tmp_path / "base", tmp_path / "new"
    _run(base, "x-s0", [{"round": 0, "stage": "rollout", "skipped": False, "wall_s": 40.0},
                        {"round": 0, "stage": "train", "skipped": False, "wall_s": 200.0}])
    _run(base, "x-s0-eval-r0", [{"round": 0, "stage": "score", "skipped": False, "wall_s": 60.0}])
    _run(new, "x-s0", [{"round": 0, "stage": "rollout", "skipped": False, "wall_s": 40.0},
                       {"round": 0, "stage": "train", "skipped": False, "wall_s": 50.0}])
    _run(new, "x-s0-eval-r0", [{"round": 0, "stage": "score", "skipped": False, "wall_s": 30.0}])
    _run(new, "x-s0-eval-base", [{"round": 0, "stage": "score", "skipped": False, "wall_s": 5.0},  # not in the base
                                 {"round": 0, "stage": "rollout", "skipped": False, "wall_s": 5.0}])
    res = CliRunner().invoke(app, ["bench", "stages", "x-s0", "--store", str(new), "--against", str(base)])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.output.splitlines()]
    assert ["run", "0", "train", "200.0", "50.0", "0.25"] in rows
    assert ["run", "0", "rollout", "40.0", "40.0", "1.00"] in rows
    assert ["run", "all", "(total)", "240.0", "90.0", "0.38"] in rows  # 90 / 240 = 0.375
    assert ["eval-base", "0", "score", "-", "5.0", "-"] in rows
    assert ["eval-base", "all", "(total)", "-", "10.0", "-"] in rows  # a part the baseline never ran: not 0 s
    assert ["eval-r0", "0", "score", "60.0", "30.0", "0.50"] in rows
    by_stage = rows[rows.index(["by", "stage:"]) + 1:]
    # rollout: 40 against 40 + 5; score: 60 against 30 + 5; the whole: 300 against 130
    assert by_stage == [["rollout", "40.0", "45.0", "1.12"], ["train", "200.0", "50.0", "0.25"],
                        ["score", "60.0", "35.0", "0.58"], ["(whole)", "300.0", "130.0", "0.43"]]
    missing = CliRunner().invoke(app, ["bench", "stages", "x-s0", "--store", str(new), "--against", str(tmp_path)])
    assert missing.exit_code == 2 and "no run 'x-s0' in store" in missing.output
