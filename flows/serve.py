"""Serve the deployments: `python -m flows.serve` (keeps running; Ctrl-C stops it).

Deployments: iterate/demo (embedded default, configs/demo.yaml), iterate/default (--param config=PATH),
score/rescore (re-score failed rows of a round), evaluate/default (a round's checkpoint on the test split).
Then: `prefect deployment run iterate/demo [--param run_id=R] [--watch]`.
"""

from __future__ import annotations

import argparse
import os

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.evaluate import evaluate as evaluate_flow
from flows.iterate import DEMO_CONFIG, REPO
from flows.iterate import iterate as iterate_flow
from flows.runners import task_runner_from_spec
from flows.score import score as score_flow


def deployments(task_runner: str = "thread") -> list[RunnerDeployment]:
    runner = task_runner_from_spec(task_runner)
    iterate, score, evaluate = (f.with_options(task_runner=runner) for f in (iterate_flow, score_flow, evaluate_flow))
    return [
        iterate.to_deployment("demo", parameters={"config": DEMO_CONFIG},
                              description="2 rounds of the embedded default (SmolLM2-135M, flat, procedural)."),
        iterate.to_deployment("default", description="Rounds of any config: --param config=configs/X.yaml."),
        score.to_deployment("rescore", parameters={"only_failed": True},
                            description="Re-score the failed rows of a round: --param run_id=R --param round=K."),
        evaluate.to_deployment("default", parameters={"split": "test"},
                               description="Score round K's checkpoint on the test split: --param run_id=R "
                                           "--param round=K."),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=1, help="Flow runs at once (default 1: stages share the machine).")
    ap.add_argument("--task-runner", default="thread",
                    help="Where stage tasks run: thread[:N] (default), dask[:ADDRESS], ray[:ADDRESS].")
    a = ap.parse_args()
    os.chdir(REPO)  # relative config paths and the default store root resolve against the repository
    serve(*deployments(a.task_runner), limit=a.limit)


if __name__ == "__main__":
    main()
