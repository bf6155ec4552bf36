"""Opening a run: config resolution (a run's saved config is the default) and stage bookkeeping."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    diff_configs,
    load_config,
    load_yaml,
)
from pipeline.store import Store, use_endpoint


def derived_seed(seed: int, *keys: object) -> int:
    """A seed for one use of a configured seed (e.g. round k's sampling of one batch), by hashing, not adding:
    `seed + k` would make seed 1 at round 0 replay seed 0 at round 1, and vLLM's per-sample `seed + j` would
    make seed s+1's samples seed s's shifted by one, so runs with nearby seeds would share most samples."""
    return zlib.crc32(":".join(str(x) for x in (seed, *keys)).encode()) % 2**31


@dataclass
class RunContext:
    cfg: RunConfig  # the frozen config plus this invocation's --set overrides
    store: Store
    run_id: str
    round: int
    frozen_hash: str  # hash of the saved config: manifests compare against it

    def done(self, stage: str) -> bool:
        m = self.store.manifest(self.run_id, self.round, stage)
        return m is not None and m["config_hash"] == self.frozen_hash

    def finish(self, stage: str, **counts: Any) -> dict:
        body = self.store.write_manifest(self.run_id, self.round, stage, self.frozen_hash, **counts)
        if not self.store.remote:  # the CLI's catalog file is local-only (Store.refresh_catalog)
            self.store.refresh_catalog()
        return body

    def at_round(self, round: int) -> RunContext:
        return RunContext(self.cfg, self.store, self.run_id, round, self.frozen_hash)


def run_config(store: Store, run_id: str) -> RunConfig:
    """The run's frozen config (`<store>/<run_id>/config.yaml`, written by its first stage); a ConfigError when the
    run is not in the store or its config does not validate."""
    text = store.read_config(run_id)
    if text is None:
        raise ConfigError(f"run {run_id!r} not found under {store.root}")
    return config_from_dict(load_yaml(text), str(store.run_dir(run_id) / "config.yaml"))


def open_run(
    config: str | Path | None,
    run_id: str | None = None,
    round: int = 0,
    sets: list[str] | None = None,
    store_root: str | None = None,
) -> RunContext:
    """Resolve the config of a run and freeze it on first use.

    For an existing run the saved config is the default; a CONFIG that differs from it is refused
    (naming the fields) so a resumed run never silently changes settings. `--set` overrides apply
    on top for this invocation only (e.g. a new executor endpoint for re-scoring).
    """
    sets = sets or []
    if round < 0:
        raise ConfigError(f"--round must be >= 0, got {round}")
    given = load_config(config) if config else None
    run_id = run_id or (given.run_id if given else None)
    if not run_id:
        raise ConfigError("give a CONFIG file or --run-id of an existing run")
    given_set = load_config(config, sets) if given else None  # the CONFIG with this invocation's --set
    # the store root may itself come from a --set (a new run can be put anywhere)
    named = given_set.store if given_set else RunConfig().store
    use_endpoint(named.endpoint_url)
    store = Store(store_root or named.root)
    saved_path = store.run_dir(run_id) / "config.yaml"
    saved_text = store.read_config(run_id)
    if saved_text is not None:
        frozen = config_from_dict(load_yaml(saved_text) or {}, str(saved_path))
        cfg = config_from_dict(apply_overrides(frozen.model_dump(mode="json"), sets), f"{saved_path} + --set") \
            if sets else frozen
        if given_set is not None:
            # A field is a change only if it differs both bare (the CONFIG against the saved config: a run frozen
            # with --set A differs there in A) and under this invocation's --set (where A is given again, but a
            # default derived from a field the --set changes, e.g. scoring.concurrency from executor.kind, is
            # derived anew in the CONFIG and kept as saved in the run's)
            bare = diff_configs(frozen, given.model_copy(update={"run_id": run_id}))
            changed = [f for f in diff_configs(cfg, given_set.model_copy(update={"run_id": run_id})) if f in bare]
            if changed:
                raise ConfigError(
                    f"run {run_id!r} was started with {saved_path}; {config} differs in: {', '.join(changed)}. "
                    "Use a new --run-id, or --set for a deliberate per-invocation change."
                )
    elif given_set is None:
        raise ConfigError(f"run {run_id!r} not found under {store.root}; give its CONFIG file to start it")
    else:
        frozen = given_set.model_copy(update={"run_id": run_id})
        frozen = config_from_dict(frozen.model_dump(), str(config))
        store.put_text(saved_path, frozen.to_yaml())  # whole or absent (temp + rename, or one PUT)
        cfg = frozen  # this invocation's --set is frozen into the saved config
    return RunContext(cfg=cfg, store=store, run_id=run_id, round=round, frozen_hash=frozen.config_hash())
