"""Experiment trackers (`tracking:` in the run config, TRL's `report_to` names): a run's figures copied out of the
store into TensorBoard event files (and an MLflow file store), where people who train models look for curves.
`tensorboard --logdir <store>` then shows every run and seed side by side (`<store>/<run_id>/tensorboard/`).

The store stays the one source. `sync_run` rewrites a run's tracker output whole from its tables after each round
(`TRACKERS`, the observer `pipeline.stages.rounds.run_rounds` is given by `pipeline run`, the iterate flow and the
experiment) and each held-out evaluation (`sync_quietly` after `evaluate_round`, by its callers): a resumed or retried
stage never leaves duplicate points, and the train stage's loop needs no tracker calls (it already writes
`train_metrics`).

Tags (x axis in brackets):
  train/*            [optimiser step, counted over all rounds] loss, pg_loss, kl, kl_old, clip_frac, ratio_dev,
                     grad_norm, lr, tokens_per_s, logp_mismatch
  round/*            [round] workflows, valid_share, mean_score, best_score, status/<status> (share of the latest
                     runs), groups_kept, gen/exec_tokens_per_query, wall_s/<stage>
  heldout/<split>/*  [rounds trained: 0 = the base model, k+1 = round k's checkpoint] mean_at_l, best_at_l,
                     majority_at_l, valid_share (select_at_l for two-level runs)
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, config_from_dict, load_yaml
from pipeline.store import Store, round_stats
from pipeline.studies.evaluate import eval_summary, evaluate_round
from pipeline.studies.report import stage_timings, status_counts
from pipeline.studies.summaries import EvalSummary

log = logging.getLogger("pipeline.studies.tracking")

TRAIN_COLUMNS = ("loss", "pg_loss", "kl", "kl_old", "clip_frac", "ratio_dev", "grad_norm", "lr", "logp_mismatch")
ROUND_COLUMNS = ("workflows", "valid_share", "mean_score", "best_score", "groups_kept", "gen_tokens_per_query",
                 "exec_tokens_per_query", "cache_hit_rate")
HELDOUT_COLUMNS = ("mean_at_l", "best_at_l", "majority_at_l", "select_at_l", "valid_share")
TB_DIR = "tensorboard"


@dataclass(frozen=True)
class Scalar:
    tag: str
    step: int
    value: float


class TrackingError(RuntimeError):
    pass


def train_scalars(store: Store, run_id: str) -> list[Scalar]:
    """Per optimiser step; the step counts on over rounds so each round's curve follows the previous one."""
    df = store.sql(f"SELECT {', '.join(TRAIN_COLUMNS)}, tokens, wall_s FROM train_metrics WHERE run_id = $run "
                   "ORDER BY round, step", {"run": run_id}, run=run_id)
    out = []
    for i, r in enumerate(df.iter_rows(named=True)):
        out += [Scalar(f"train/{c}", i, r[c]) for c in TRAIN_COLUMNS if r[c] is not None]
        if r["tokens"] is not None and r["wall_s"]:
            out.append(Scalar("train/tokens_per_s", i, r["tokens"] / r["wall_s"]))
    return out


def round_scalars(store: Store, run_id: str) -> list[Scalar]:
    """Per round: rollout, scoring and curation figures (pipeline.studies.report's queries), status shares, stage
    times."""
    out = [Scalar(f"round/{c}", r["round"], r[c]) for r in round_stats(store, run_id).iter_rows(named=True)
           for c in ROUND_COLUMNS if r[c] is not None]
    st = status_counts(store, run_id)
    totals = {k: sum(n for kk, _, n in st.iter_rows() if kk == k) for k in set(st["round"].to_list())}
    out += [Scalar(f"round/status/{s}", k, n / totals[k]) for k, s, n in st.iter_rows()]
    out += [Scalar(f"round/wall_s/{r['stage']}", r["round"], r["wall_s"])
            for r in stage_timings(store, run_id).iter_rows(named=True)]
    return out


def eval_runs(store: Store, run_id: str) -> list[tuple[str, int, str]]:
    """(split, round, eval run id) of the run's held-out evaluations (pipeline.studies.evaluate's names; -1 = base)."""
    pat = re.compile(rf"^{re.escape(run_id)}-eval-(?:(validate)-)?(?:base|r(\d+))$")
    found = []
    for rid in store.runs():
        m = pat.match(rid)
        if m:
            found.append((m.group(1) or "test", int(m.group(2)) if m.group(2) else -1, rid))
    return sorted(found)


def heldout_scalars(store: Store, run_id: str) -> list[Scalar]:
    out = []
    for split, k, eid in eval_runs(store, run_id):
        summ = eval_summary(store, eid)
        out += [Scalar(f"heldout/{split}/{c}", k + 1, getattr(summ, c)) for c in HELDOUT_COLUMNS
                if getattr(summ, c) is not None]
    return out


def run_scalars(store: Store, run_id: str) -> list[Scalar]:
    return train_scalars(store, run_id) + round_scalars(store, run_id) + heldout_scalars(store, run_id)


def check_trackers(trackers: list[str]) -> None:
    """Fail before any work when a configured tracker's package is missing."""
    needs = {"tensorboard": ("tensorboard", "pip install -e . (tensorboard is a dependency)"),
             "mlflow": ("mlflow", 'pip install -e ".[mlflow]"')}
    for t in trackers:
        module, how = needs[t]
        try:
            __import__(module)
        except ImportError:
            raise TrackingError(f"tracking: [{t}] needs the {module} package: {how}; or leave it out of "
                                "`tracking`") from None


def run_trackers(store: Store, run_id: str) -> list[str]:
    text = store.read_config(run_id)
    if text is None:
        raise TrackingError(f"run {run_id!r} not found under {store.root}")
    return config_from_dict(load_yaml(text) or {}, f"{run_id}/config.yaml").tracking


def sync_run(store: Store, run_id: str, trackers: list[str] | None = None) -> dict[str, str]:
    """Rewrite the run's tracker output from the store (default trackers: the run's frozen `tracking`); returns
    tracker -> where it wrote."""
    trackers = run_trackers(store, run_id) if trackers is None else trackers
    if not trackers:
        return {}
    check_trackers(trackers)
    scalars = run_scalars(store, run_id)
    out = {}
    if "tensorboard" in trackers:
        out["tensorboard"] = str(write_tensorboard(store, run_id, scalars))
    if "mlflow" in trackers:
        from pipeline.studies.tracking_mlflow import write_mlflow

        out["mlflow"] = write_mlflow(store, run_id, scalars)
    log.debug("%s: %d scalars to %s", run_id, len(scalars), out)
    return out


def write_events(scalars: list[Scalar], folder: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(folder))
    try:
        for s in scalars:
            w.add_scalar(s.tag, s.value, s.step)
    finally:
        w.close()


def write_tensorboard(store: Store, run_id: str, scalars: list[Scalar]):
    """Event files in <store>/<run_id>/tensorboard/, replacing the previous ones (which would repeat every point
    with their own timestamps): written beside, then swapped in; on object storage the old files are deleted and
    the new ones uploaded."""
    dest = store.run_dir(run_id) / TB_DIR
    if store.remote:
        with tempfile.TemporaryDirectory(prefix="tb-") as tmp:
            write_events(scalars, Path(tmp))
            if store.fs.exists(store.url(dest)):
                store.fs.rm(store.url(dest), recursive=True)
            for f in Path(tmp).iterdir():
                store.fs.put_file(str(f), f"{store.url(dest)}/{f.name}")
        return dest
    fresh = dest.with_name(f".{TB_DIR}.{uuid.uuid4().hex}")
    write_events(scalars, fresh)
    old = dest.with_name(f".{TB_DIR}.old.{uuid.uuid4().hex}")
    if dest.exists():
        dest.rename(old)
    fresh.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def sync_quietly(store: Store, run_id: str, cfg: RunConfig | None = None) -> None:
    """`sync_run` for the loops: a missing package is an error (the config asked for it), a failure to write is
    logged, not raised, as the round it reports on is finished in the store either way (`pipeline track` retries)."""
    trackers = cfg.tracking if cfg is not None else run_trackers(store, run_id)
    check_trackers(trackers)
    try:
        sync_run(store, run_id, trackers)
    except OSError as e:
        log.warning("tracking %s: could not write %s (%s); `pipeline track %s` rewrites it", run_id, trackers, e,
                    run_id)


class Trackers:
    """The round observer of `run_rounds` (pipeline.stages.rounds.RoundObserver): the config's trackers are checked
    before any work and rewritten from the store after every round."""

    def check(self, cfg: RunConfig) -> None:
        check_trackers(cfg.tracking)

    def round_done(self, store: Store, run_id: str, cfg: RunConfig) -> None:
        sync_quietly(store, run_id, cfg)


TRACKERS = Trackers()


def evaluate_tracked(store_root: str, run_id: str, round: int, split: str = "test", sets: list[str] | None = None,
                     call=None, changes: dict[str, Any] | None = None) -> EvalSummary:
    """`evaluate_round`, then the evaluated run's trackers gain the held-out evaluation; returns its summary."""
    summary = evaluate_round(store_root, run_id, round, split, sets, call, changes)
    sync_quietly(Store(store_root), run_id)
    return summary
