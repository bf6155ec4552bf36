"""Opening a run: config resolution (a run's saved config is the default) and stage bookkeeping."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_from_dict,
    diff_configs,
    load_config,
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
    return config_from_dict(yaml.safe_load(text), str(store.run_dir(run_id) / "config.yaml"))


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
    # the store root may itself come from a --set (a new run can be put anywhere)
    named = load_config(config, sets).store if given else RunConfig().store
    use_endpoint(named.endpoint_url)
    store = Store(store_root or named.root)
    saved_path = store.run_dir(run_id) / "config.yaml"
    saved_text = store.read_config(run_id)
    if saved_text is not None:
        frozen = config_from_dict(yaml.safe_load(saved_text) or {}, str(saved_path))
        if given is not None:
            # the CONFIG matches if it alone, or with this invocation's --set, gives the saved config
            candidates = [given, load_config(config, sets)] if sets else [given]
            changed = min((diff_configs(frozen, c.model_copy(update={"run_id": run_id})) for c in candidates), key=len)
            if changed:
                raise ConfigError(
                    f"run {run_id!r} was started with {saved_path}; {config} differs in: {', '.join(changed)}. "
                    "Use a new --run-id, or --set for a deliberate per-invocation change."
                )
    elif given is None:
        raise ConfigError(f"run {run_id!r} not found under {store.root}; give its CONFIG file to start it")
    else:
        frozen = load_config(config, sets)
        frozen = frozen.model_copy(update={"run_id": run_id})
        frozen = config_from_dict(frozen.model_dump(), str(config))
        store.put_text(saved_path, frozen.to_yaml())  # whole or absent (temp + rename, or one PUT)
        sets = []  # already frozen into the saved config
    cfg = frozen
    if sets:
        cfg = config_from_dict(apply_overrides(frozen.model_dump(mode="json"), sets), f"{saved_path} + --set")
    return RunContext(cfg=cfg, store=store, run_id=run_id, round=round, frozen_hash=frozen.config_hash())
