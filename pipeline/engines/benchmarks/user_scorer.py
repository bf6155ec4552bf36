"""The worker process of a user's scorer (pipeline.engines.benchmarks.tasks.ScorerWorker): standard library only, so
it starts without importing the pipeline.

    python -c "<exec this file>" SPEC SYS_PATH_JSON

It loads the function SPEC (`module:function` or `/abs/path/file.py:function`) with the parent's sys.path, writes
{"ready": true} (or {"error"}) on stdout, then answers each JSON line [answer, reference, metadata] on stdin with
{"score", "details"} or {"error"}. A return value is checked here (`checked_score`): a float in [0, 1] or a
(float, details dict) pair; anything else, NaN included, is that row's error.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_scorer(spec: str) -> Callable[..., Any]:
    """The function named by `spec` (a file path made absolute by the parent)."""
    target, _, function = spec.rpartition(":")
    if target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"user_scorer_{Path(target).stem}", target)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise AttributeError(f"{target} has no function {function!r}")
    return fn


def checked_score(value: Any) -> tuple[float, dict[str, Any]]:
    """A scorer's return value as (score, details): a float in [0, 1], or a (float, details dict) pair; anything
    else (NaN, a value outside [0, 1], a string, None) is a ValueError saying what came back."""
    details: dict[str, Any] = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], dict):
            raise ValueError(f"returned {value!r:.200}; expected a float or (float, details dict)")
        value, details = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"returned {type(value).__name__} {value!r:.200}; expected a float in [0, 1]")
    score = float(value)
    if math.isnan(score) or not 0.0 <= score <= 1.0:
        raise ValueError(f"returned {score!r}, outside [0, 1]")
    return score, details


def serve(spec: str) -> None:
    out, sys.stdout = sys.stdout, sys.stderr  # the user's prints must not corrupt the protocol
    try:
        scorer = load_scorer(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the scorer
        out.write(json.dumps({"error": f"cannot load the scorer: {type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        answer, reference, metadata = json.loads(line)
        try:
            score, details = checked_score(scorer(answer, reference, **metadata))
            reply = {"score": score, "details": json.loads(json.dumps(details, default=str))}
        except Exception as e:  # noqa: BLE001 - one row's error, not the worker's
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":  # pragma: no cover - run by ScorerWorker
    sys.path[:0] = json.loads(sys.argv[3])
    serve(sys.argv[2])
