"""Evaluation of a round's generator on a held-out split, without touching the run's training data.

The evaluation is its own run, `<run_id>-eval-r<k>` (`-eval-<split>-r<k>` for a split other than
test, `-eval-base` / `-eval-<split>-base` for the base model, k = -1): the trained run's config with
`benchmark.train_split=<split>` and `generator.adapter=<checkpoint of round k>`, rolled out and
scored at its round 0. Queries, generations and scores of the trained run are never written.
"""

from __future__ import annotations

from pipeline.config import ConfigError
from pipeline.run import RunContext, open_run
from pipeline.store import Store

EVAL_STAGES = ("rollout", "score")


def eval_run_id(run_id: str, round: int, split: str = "test") -> str:
    tag = "base" if round < 0 else f"r{round}"
    return f"{run_id}-eval-{tag}" if split == "test" else f"{run_id}-eval-{split}-{tag}"


def open_eval_run(store_root: str, run_id: str, round: int, split: str = "test",
                  sets: list[str] | None = None) -> RunContext:
    """Create (first call) or reopen the evaluation run of round `round`'s checkpoint (-1: base model)."""
    if split not in ("validate", "test"):
        raise ConfigError(f"split must be 'validate' or 'test', got {split!r}")
    store = Store(store_root)
    saved = store.run_dir(run_id) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"run {run_id!r} not found under {store.root}")
    eid = eval_run_id(run_id, round, split)
    if (store.run_dir(eid) / "config.yaml").is_file():
        return open_run(None, eid, 0, sets, str(store.root))
    adapter = "null"
    if round >= 0:
        ckpt = store.checkpoint_dir(run_id, round)
        if not ckpt.is_dir():
            raise ConfigError(f"run {run_id!r} has no checkpoint for round {round} ({ckpt}); train that round first")
        adapter = str(ckpt)
    frozen = [f"benchmark.train_split={split}", f"generator.adapter={adapter}", "rounds=1",
              f"store.root={store.root}"]
    return open_run(saved, eid, 0, frozen + list(sets or []), str(store.root))


def eval_summary(store: Store, eval_id: str) -> dict:
    """Mean and best per-workflow score (mean over reps of the latest attempt) of an evaluation run."""
    df = store.sql(
        "SELECT count(*) AS workflows, avg(s) AS mean_score, max(s) AS best_score FROM ("
        " SELECT gen_id, avg(score) AS s FROM latest_scores WHERE run_id = ? AND round = 0 GROUP BY gen_id)",
        [eval_id])
    return {"eval_run_id": eval_id, **df.row(0, named=True)}
