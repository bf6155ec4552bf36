"""A train stage's progress between optimiser steps (`training.save_steps`), so that a killed stage (the out-of-memory
killer, a lost session) resumes at its last saved step instead of step 0.

Once its π_old / reference passes are done (step 0), then every `save_steps` steps, rank 0 writes
`<run>/round=<k>/_train_progress.pt`: the trainable weights, the optimiser's and the scheduler's state, the metrics
of the steps done, torch's RNG state, and π_old / reference log-probs (so a resumed stage skips those passes: on the
2-core AVX2 EPYC they took 20-40 minutes of a two-level round). The file is written whole or not at all (temp file +
rename). The step plan is a function of the seed and the round's rows, so the resumed loop runs the same remaining
steps: the adapter at the end equals an uninterrupted run's (tests/test_train.py). A file of another config (its
hash) or another step plan (its step count) is ignored and overwritten; the file is removed once the stage has
written its checkpoint. Object-storage stores keep no progress (their stages restart from step 0, as before).

Beside it, `_train_progress.pt.json` says how far the saved progress is (the next step and the plan's steps), so
`pipeline experiment --status` shows a running or stopped train stage's step without loading torch or the file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "_train_progress.pt"
STEPS = NAME + ".json"  # the saved progress's step, beside it (and in the .gitignore's `_train_progress.pt*`)


def progress_path(store, run_id: str, round: int) -> Path | None:
    """Where a round's progress is kept; None on object storage."""
    return None if store.remote else store.round_dir(run_id, round) / NAME


def save_progress(path: Path, state: dict) -> None:
    """`state` to `path`, whole or not at all; then its step beside it (`saved_steps`)."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)
    steps, steps_tmp = path.with_name(STEPS), path.with_name(STEPS + ".tmp")
    steps_tmp.write_text(json.dumps({"next_step": state.get("next_step"), "n_steps": state.get("n_steps")}))
    os.replace(steps_tmp, steps)


def saved_steps(path: Path | None) -> tuple[int, int] | None:
    """(the next step, the plan's steps) of the progress saved at `path`, from the file beside it; None where
    there is none (or it cannot be read: it only informs `--status`)."""
    if path is None:
        return None
    try:
        body = json.loads(path.with_name(STEPS).read_text())
        return int(body["next_step"]), int(body["n_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_progress(path: Path | None, config_hash: str, n_steps: int) -> dict | None:
    """The saved progress when it belongs to this config and step plan and is not finished; else None."""
    if path is None or not path.is_file():
        return None
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn file cannot happen (rename), a foreign or corrupt one can: start over
        log.warning("ignoring unreadable train progress %s (%s)", path, e)
        return None
    if state.get("config_hash") != config_hash or state.get("n_steps") != n_steps:
        log.warning("ignoring train progress %s: it belongs to another config or step plan", path)
        return None
    if not 0 <= state.get("next_step", -1) < n_steps:
        return None
    return state


def clear_progress(path: Path | None) -> None:
    if path is not None:
        for name in (path.name, path.name + ".tmp", STEPS, STEPS + ".tmp"):
            path.with_name(name).unlink(missing_ok=True)
