"""Serve the deployments: `python -m flows.serve` (keeps running; Ctrl-C stops it).

Deployments: experiment/demo (the README's demo: configs/demo.yaml, one seed, held-out gain over the base
model), experiment/learn (configs/learn.yaml, 3 seeds: docs/learning.md), experiment/humaneval and experiment/gsm
(configs/humaneval-learn.yaml and configs/gsm-learn.yaml: docs/learning.md), experiment/default (--param
config=PATH), iterate/smoke (the whole loop in minutes, configs/smoke.yaml), iterate/default (--param
config=PATH), score/rescore (re-score failed rows of a round), evaluate/default (a round's checkpoint on the
test split), ablate/objectives (docs/objectives.md: one round's data trained with every objective),
compare-methods/default (--param config=PATH), compare-methods/gsm (docs/methods.md: every method on
configs/gsm-learn.yaml, 3 seeds), and headroom/default (--param config=PATH), headroom/gsm, headroom/humaneval and
headroom/mixed (docs/learning.md, Room to learn: the gate before training). Then:
`prefect deployment run experiment/demo [--param run_id=R] [--watch]`.
With `--task-runner dask:tcp://HOST:8786`, `--param shards=N` on iterate or score spreads each round's scoring
over the Dask workers (docs/scale-out.md, Sharded scoring).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import threading
from pathlib import Path

from prefect.deployments.runner import RunnerDeployment
from prefect.runner import Runner

from flows.ablate import ablate as ablate_flow
from flows.evaluate import evaluate as evaluate_flow
from flows.experiment import experiment as experiment_flow
from flows.headroom import headroom as headroom_flow
from flows.iterate import SMOKE_CONFIG
from flows.iterate import iterate as iterate_flow
from flows.methods import compare_methods as methods_flow
from flows.runners import task_runner_from_spec
from flows.score import score as score_flow
from pipeline.stages.runner import REPO


def deployments(task_runner: str = "thread") -> list[RunnerDeployment]:
    runner = task_runner_from_spec(task_runner)
    iterate, score, evaluate, experiment, ablate, methods, headroom = (
        f.with_options(task_runner=runner) for f in (iterate_flow, score_flow, evaluate_flow, experiment_flow,
                                                      ablate_flow, methods_flow, headroom_flow))
    return [
        experiment.to_deployment("demo", parameters={"config": "configs/demo.yaml"},
                                 description="The README's demo: one seed of SPOGW on Qwen2.5-Coder-0.5B, held-out "
                                             "Mean@L of the base model and of the trained round, paired interval."),
        experiment.to_deployment("learn", parameters={"config": "configs/learn.yaml"},
                                 description="docs/learning.md: 3 seeds, held-out gain over the base model."),
        experiment.to_deployment("humaneval", parameters={"config": "configs/humaneval-learn.yaml"},
                                 description="docs/learning.md: HumanEval with a served 0.5B executor, 3 seeds x 3 "
                                             "rounds against its references (made first: `pipeline baseline`)."),
        experiment.to_deployment("gsm", parameters={"config": "configs/gsm-learn.yaml"},
                                 description="docs/learning.md: gsm_symbolic word problems, 3 seeds x 3 rounds "
                                             "against IO, CoT, CoT-SC, PoT and PoT-SC."),
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
        headroom.to_deployment("default", description="docs/learning.md, Room to learn: every design of a config's "
                                                      "menu on dev, the cross-fitted per-query oracle against the "
                                                      "best single design, the gate: --param config=PATH."),
        headroom.to_deployment("gsm", parameters={"config": "configs/gsm-menu.yaml"},
                               description="The headroom study on word problems (configs/gsm-menu.yaml)."),
        headroom.to_deployment("humaneval", parameters={"config": "configs/humaneval-menu.yaml"},
                               description="The headroom study on HumanEval (configs/humaneval-menu.yaml)."),
        headroom.to_deployment("mixed", parameters={"config": "configs/mixed-learn.yaml"},
                               description="The headroom study on the mixed task (configs/mixed-learn.yaml)."),
        methods.to_deployment("default", description="Every method (docs/methods.md) on any config: --param "
                                                     "config=PATH [--param seeds=N] [--param lr_sweep=[...]]."),
        methods.to_deployment("gsm", parameters={"config": "configs/gsm-learn.yaml", "seeds": 3},
                              description="docs/methods.md: SPOGW, two-level, W4S, ScoreFlow, FlowReasoner, SMC and "
                                          "the best fixed program on gsm_symbolic, 3 seeds, held-out paired intervals"),
    ]


SHUTDOWN_GRACE_S = 20.0


class BoundedRunner(Runner):
    """Prefect's runner with a SIGTERM shutdown that cannot hang. Its graceful shutdown may call the API (pausing
    deployments, reporting runs); with the API server gone (`demo.sh stop` stopped both at once) the client retries
    each call for about a minute and the process stays. After SHUTDOWN_GRACE_S it ends its flow-run processes (their
    stage children and model servers follow them) and exits."""

    def handle_sigterm(self, *args, **kwargs) -> None:
        timer = threading.Timer(SHUTDOWN_GRACE_S, _force_exit)
        timer.daemon = True  # a shutdown that finishes in time exits without waiting for it
        timer.start()
        super().handle_sigterm(*args, **kwargs)


def _force_exit() -> None:
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(128 + signal.SIGTERM)


def _children() -> list[int]:
    """Pids of this process's children (Linux /proc; none elsewhere)."""
    me, out = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:  # field 4: the parent's pid
                out.append(int(stat.parent.name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=1, help="Flow runs at once (default 1: stages share the machine).")
    ap.add_argument("--task-runner", default="thread",
                    help="Where stage tasks run: thread[:N] (default), dask[:ADDRESS], ray[:ADDRESS].")
    a = ap.parse_args()
    os.chdir(REPO)  # relative config paths and the default store root resolve against the repository
    # what prefect.serve() does, with this runner; no pausing on shutdown: the deployments have no schedules to
    # pause, and it is the API call that hangs when the server is gone
    runner = BoundedRunner(limit=a.limit, pause_on_shutdown=False)
    served = deployments(a.task_runner)
    for d in served:
        runner.add_deployment(d)
    print(f"deployments being served: {' '.join(f'{d.flow_name}/{d.name}' for d in served)}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(runner.start())


if __name__ == "__main__":
    main()
