"""Serve the deployments: `python -m flows.serve` (keeps running; Ctrl-C stops it).

Deployments: experiment/demo (the README's demo: configs/demo.yaml, one seed, held-out gain over the base
model), experiment/learn (configs/learn.yaml, 3 seeds: docs/learning.md), experiment/default (--param
config=PATH), iterate/smoke (the whole loop in minutes, configs/smoke.yaml), iterate/default (--param
config=PATH), score/rescore (re-score failed rows of a round), evaluate/default (a round's checkpoint on the
test split), ablate/objectives (docs/objectives.md: one round's data trained with every objective). Then:
`prefect deployment run experiment/demo [--param run_id=R] [--watch]`.
With `--task-runner dask:tcp://HOST:8786`, `--param shards=N` on iterate or score spreads each round's scoring
over the Dask workers (docs/scale-out.md, Sharded scoring).
"""

from __future__ import annotations

import argparse
import os

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.ablate import ablate as ablate_flow
from flows.evaluate import evaluate as evaluate_flow
from flows.experiment import experiment as experiment_flow
from flows.iterate import SMOKE_CONFIG
from flows.iterate import iterate as iterate_flow
from flows.runners import task_runner_from_spec
from flows.score import score as score_flow
from pipeline.stages.runner import REPO


def deployments(task_runner: str = "thread") -> list[RunnerDeployment]:
    runner = task_runner_from_spec(task_runner)
    iterate, score, evaluate, experiment, ablate = (f.with_options(task_runner=runner) for f in
                                                    (iterate_flow, score_flow, evaluate_flow, experiment_flow,
                                                     ablate_flow))
    return [
        experiment.to_deployment("demo", parameters={"config": "configs/demo.yaml"},
                                 description="The README's demo: one seed of SPOGW on Qwen2.5-Coder-0.5B, held-out "
                                             "Mean@L of the base model and of the trained round, paired interval."),
        experiment.to_deployment("learn", parameters={"config": "configs/learn.yaml"},
                                 description="docs/learning.md: 3 seeds, held-out gain over the base model."),
        experiment.to_deployment("default", description="A learning experiment of any config: --param config=PATH."),
        iterate.to_deployment("smoke", parameters={"config": SMOKE_CONFIG},
                              description="2 rounds of the whole loop in minutes (SmolLM2-135M, flat, procedural)."),
        iterate.to_deployment("default", description="Rounds of any config: --param config=configs/X.yaml."),
        score.to_deployment("rescore", parameters={"only_failed": True},
                            description="Re-score the failed rows of a round: --param run_id=R --param round=K."),
        evaluate.to_deployment("default", parameters={"split": "test"},
                               description="Score round K's checkpoint on the test split: --param run_id=R "
                                           "--param round=K."),
        ablate.to_deployment("objectives", parameters={"config": "configs/learn.yaml"},
                             description="docs/objectives.md: round 0 of configs/learn.yaml trained with each "
                                         "objective, held-out Mean@L / Best@L with paired intervals."),
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
