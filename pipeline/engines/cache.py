"""Work computed once: executor replies and grader verdicts, kept beside the store.

Layout: `<store root>/cache/<kind>/<stamp>-<host>-<pid>-<random>.jsonl`, `kind` = `executor` or `grader`. Every
process that writes has its own file and only appends to it, one JSON line per entry written with one `write`, so:
- concurrent writers never touch one file (no locks, on one machine or several sharing the folder);
- a `kill -9` loses nothing already written (the kernel holds it) and can leave at most one torn last line, which
  readers skip (it does not parse); the entry is computed again next time;
- readers load every file into a dict when a stage starts, and read what other processes appended since (each
  file from the offset they reached) when a lookup misses, at most every `RESCAN_S` seconds.
The store's DuckDB views `executor_cache` and `grader_cache` read the same files (pipeline/store/views.py).

A key is the SHA-256 of everything that determines the value: for a reply, the executor's identity (`identity`:
model weights, adapter, dtype, serve settings that change numerics, the sampler) and the call (messages,
temperature, top_p, n, max_tokens, seed); for a verdict, the grader's code, the benchmark's settings, the item and
the answer. An unseeded sampled call is never cached: its reply is one draw, and serving it again would make two
draws one. Hits are exact replays: texts and the token counts of the call that computed them.

The cache is local: an `s3://` store has none (object storage has no append; `store_cache_dir` says so once).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pipeline.config import ExecutorConfig, RunConfig
from pipeline.engines.executors import Executor, ExecutorReply, cost_usd

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # in every key: a change of what an entry means starts a new cache (2: weights by content)
RESCAN_S = 2.0
HASHED_FILE_MB = 64  # model files up to this size are hashed by content (configs, tokenizers, LoRA adapters)
SAMPLER = "row-generators-v1"  # the local executor's sampling procedure (executors._RowSampler)


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ShardCache:
    """key -> entry (a JSON object), over the append-only shard files of one folder (module doc). In-process callers
    that ask for a key being computed wait for it (`get_or_compute`) instead of computing it twice."""

    def __init__(self, folder: Path, accept: Callable[[dict], bool] = lambda e: True):
        """`accept`: which entries to keep in memory (e.g. those of one executor identity)."""
        self.folder, self.accept = Path(folder), accept
        self.entries: dict[str, dict] = {}
        self._offsets: dict[Path, int] = {}
        self._scanned = float("-inf")
        self._fd: int | None = None
        self._inflight: dict[str, asyncio.Future] = {}
        self.torn_lines = 0  # lines that did not parse (a writer killed mid-line)
        self.write_failed: str | None = None
        self.scan()

    def scan(self) -> None:
        """Read what every shard gained since the last scan (whole lines only; a partial last line is read once the
        rest of it arrives, or never if its writer died)."""
        self._scanned = time.monotonic()
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.glob("*.jsonl")):
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                try:
                    entry = json.loads(line)
                    key = entry["key"]
                except (ValueError, KeyError, TypeError):
                    self.torn_lines += 1
                    continue
                if self.accept(entry):
                    self.entries.setdefault(key, entry)  # first written wins: the same key always gives the same value
            self._offsets[path] = start + end

    def get(self, key: str) -> dict | None:
        e = self.entries.get(key)
        if e is None and time.monotonic() - self._scanned >= RESCAN_S:
            self.scan()  # another process may have computed it meanwhile
            e = self.entries.get(key)
        return e

    def put(self, entry: dict) -> None:
        """Keep `entry` (it has `key`) here and append it to this process's shard. A failed write (a full disk) is
        logged once and leaves the entry in memory only: the cache saves work, it never fails a stage."""
        self.entries.setdefault(entry["key"], entry)
        if self.write_failed is not None:
            return
        line = (json.dumps(entry, ensure_ascii=False, default=str) + "\n").encode()
        try:
            if self._fd is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
                name = f"{stamp}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
                self._fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            written = os.write(self._fd, line)  # one write per line: a kill leaves whole lines and at most one torn
            if written != len(line):
                raise OSError(f"short write ({written} of {len(line)} bytes)")
        except OSError as e:
            self.write_failed = str(e)
            log.warning("cache %s: not written any more (%s); this process keeps its entries in memory", self.folder, e)

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[dict]]) -> tuple[dict, bool]:
        """(entry, hit). `compute()` returns the entry (without `key`) or raises (nothing kept); `None` from it
        means "do not keep" (e.g. a timed-out verdict) and is returned as such with hit False."""
        hit = self.get(key)
        if hit is not None:
            return hit, True
        if key in self._inflight:  # an identical call of another workflow run in this process: its result
            shared = await asyncio.shield(self._inflight[key])
            if shared is not None:
                return shared, True
            return await self.get_or_compute(key, compute)  # that one was not kept (a timeout): compute our own
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            value = await compute()
            entry = None if value is None else {"key": key, **value}
            if entry is not None:
                self.put(entry)
            fut.set_result(entry)
            return entry, False
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        finally:
            del self._inflight[key]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---- executor identity -----------------------------------------------------------------------------------------


def large_file_digest(file: Path) -> str:
    """SHA-256 of a large file's content (base weights), computed once per machine: remembered under the pipeline's
    cache folder by (path, size, modification time, inode), which change whenever the file does. Content, not the
    modification time, is the identity, so a store's cache answers on another machine (or a fresh clone) whose
    copy of the same weights was written at another time; hashing 2.5 GB once costs a few seconds."""
    from pipeline.engines.models import cache_dir

    real = file.resolve()
    st = real.stat()
    stamp = digest([str(real), st.st_size, st.st_mtime_ns, st.st_ino])
    memo = cache_dir() / "fingerprints" / stamp
    with contextlib.suppress(OSError):
        return memo.read_text().strip()
    log.info("fingerprinting %s (%.1f GB) by its content, once on this machine", file, st.st_size / 1e9)
    with file.open("rb") as fh:
        value = hashlib.file_digest(fh, "sha256").hexdigest()
    with contextlib.suppress(OSError):  # a read-only home only costs the hash again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(value)
        os.replace(tmp, memo)
    return value


@functools.lru_cache(maxsize=64)
def folder_fingerprint(path: str) -> str:
    """A model or adapter folder's identity: its files' names and contents (files over HASHED_FILE_MB, the base
    weights, through `large_file_digest`), not where it lies nor when it was written."""
    root = Path(path)
    hasher = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        hasher.update(f.relative_to(root).as_posix().encode() + b"\0")
        if f.stat().st_size <= HASHED_FILE_MB << 20:
            hasher.update(hashlib.sha256(f.read_bytes()).digest())
        else:
            hasher.update(bytes.fromhex(large_file_digest(f)))
    return hasher.hexdigest()


def model_identity(ref: str) -> dict:
    """What a model ref loads: its folder's fingerprint (contents, not path: the same weights anywhere are the same
    model), a PEFT adapter's base included; a hub id (no folder here) is its name."""
    from pipeline.engines.models import resolve_model

    path = resolve_model(ref)
    if not Path(path).is_dir():
        return {"hub_id": path}
    out: dict[str, Any] = {"files": folder_fingerprint(path)}
    adapter_cfg = Path(path) / "adapter_config.json"
    if adapter_cfg.is_file():  # an adapter folder: its base is part of what it computes
        base = json.loads(adapter_cfg.read_text()).get("base_model_name_or_path")
        if base:
            out["base"] = model_identity(base)
    return out


def executor_identity(cfg: ExecutorConfig) -> dict | None:
    """Everything besides the call that determines an executor's reply, or None when it cannot be known here (an
    endpoint the pipeline does not start, unless `executor.cache: on` vouches for it)."""
    if cfg.kind == "local":  # float32 on this process's device, sampled by _RowSampler
        return {"kind": "local", "model": model_identity(cfg.model), "dtype": "float32", "sampler": SAMPLER}
    # the server this pipeline starts (or started for this stage: servers.serving)
    served = cfg.serve or cfg._served_from
    if served is not None:  # its weights and the settings that change numerics
        import importlib.metadata as md

        try:
            vllm = md.version("vllm")
        except md.PackageNotFoundError:
            vllm = None
        from pipeline.engines.hardware import resolve_dtype

        # the dtype the server loads here, not `auto`: a store (and its cache) moves between machines that resolve
        # `auto` differently, and an fp32 reply must never answer a bf16 server's call
        dtype = resolve_dtype(served.dtype, what="executor server")
        return {"kind": "vllm", "model": model_identity(served.model or cfg.model), "dtype": dtype,
                "max_model_len": served.max_model_len, "enforce_eager": served.enforce_eager,
                "extra_args": list(served.extra_args), "vllm": vllm}
    if cfg.cache == "on":
        from pipeline.config import server_urls

        return {"kind": "endpoint", "model": cfg.model, "urls": sorted(server_urls(cfg.base_url, cfg.endpoints))}
    return None


class CachedExecutor(Executor):
    """An executor whose replies are computed once (module doc). Greedy calls and seeded sampled calls are looked
    up by key; an unseeded sampled call goes to the executor every time. A hit returns the stored texts and token
    counts with `cached=True` (the workflow used those tokens; nothing was computed) and their price at the
    configured prices."""

    def __init__(self, inner: Executor, cfg: ExecutorConfig, identity: dict, cache: ShardCache):
        self.inner, self.cfg, self.cache = inner, cfg, cache
        self.identity = digest({"v": CACHE_VERSION, **identity})
        self.model_name = cfg.model
        self.calls = self.hits = 0

    @classmethod
    def open(cls, inner: Executor, cfg: ExecutorConfig, folder: Path) -> Executor:
        """`inner` with the cache of `folder` when `cfg.cache` allows and the identity is known, else `inner`."""
        if cfg.cache == "off":
            return inner
        identity = executor_identity(cfg)
        if identity is None:
            log.info("executor cache off: %s is an endpoint this pipeline does not start, so what model and settings "
                     "answer is not known here (executor.cache: on to use it anyway)", cfg.model)
            return inner
        ident = digest({"v": CACHE_VERSION, **identity})
        return cls(inner, cfg, identity, ShardCache(folder, accept=lambda e: e.get("identity") == ident))

    def key(self, messages: list[dict], temperature: float, n: int, max_tokens: int, seed: int | None) -> str:
        greedy = temperature == 0  # n identical answers: one computed (executors ask once), any n reuses it
        return digest({"v": CACHE_VERSION, "identity": self.identity, "messages": messages,
                       "temperature": float(temperature), "top_p": 1.0, "n": 1 if greedy else int(n),
                       "max_tokens": int(max_tokens), "seed": None if greedy else seed})

    async def start(self) -> None:
        await self.inner.start()

    async def complete(self, messages: list[dict], temperature: float | None = None, n: int = 1,
                       max_tokens: int | None = None, seed: int | None = None) -> ExecutorReply:
        temperature = self.cfg.temperature if temperature is None else float(temperature)
        max_tokens = max_tokens or self.cfg.max_tokens
        greedy = temperature == 0
        self.calls += 1
        if not greedy and seed is None:
            return await self.inner.complete(messages, temperature, n, max_tokens, seed)

        async def compute() -> dict:
            r = await self.inner.complete(messages, temperature, 1 if greedy else n, max_tokens, seed)
            return {"identity": self.identity, "model": self.model_name, "messages": json.dumps(messages),
                    "temperature": temperature, "n": 1 if greedy else n, "max_tokens": max_tokens,
                    "seed": None if greedy else seed, "texts": list(r.texts), "tokens_in": int(r.tokens_in),
                    "tokens_out": int(r.tokens_out), "truncated": int(r.truncated),
                    "created_at": dt.datetime.now(dt.UTC).isoformat()}

        entry, hit = await self.cache.get_or_compute(self.key(messages, temperature, n, max_tokens, seed), compute)
        self.hits += hit
        texts, truncated = list(entry["texts"]), int(entry["truncated"])
        if greedy:
            texts, truncated = texts * n, truncated * n
        tin, tout = int(entry["tokens_in"]), int(entry["tokens_out"])
        return ExecutorReply(texts, tin, tout, cost_usd(self.cfg.prices, tin, tout), truncated, cached=hit)

    async def aclose(self) -> None:
        self.cache.close()
        await self.inner.aclose()


def make_cached_executor(cfg: ExecutorConfig, cache_dir: Path | None) -> Executor:
    """The run's executor (`make_executor`), through the reply cache under `cache_dir` (None: no cache)."""
    from pipeline.engines.executors import make_executor

    inner = make_executor(cfg)
    return inner if cache_dir is None else CachedExecutor.open(inner, cfg, Path(cache_dir) / "executor")


# ---- grader verdicts -------------------------------------------------------------------------------------------

UNCACHED_VERDICTS = ("timeout", "no_verdict")  # a timeout may pass on a less loaded machine; no verdict is no result


@functools.lru_cache(maxsize=1)
def grader_code() -> str:
    """The grader's own code: a fix to it must not meet verdicts of the code before."""
    from pipeline.engines.benchmarks import code
    from pipeline.engines.sandbox import candidate, grader, values

    return hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (grader, candidate, values, code))
                          ).hexdigest()


class VerdictCache:
    """Verdicts of a code benchmark's grader for (benchmark, item, answer), computed once; timeouts and missing
    verdicts are never kept."""

    def __init__(self, cfg: RunConfig, folder: Path):
        self.scope = digest({"v": CACHE_VERSION, "grader": grader_code(),
                             "benchmark": cfg.benchmark.model_dump(mode="json"),
                             "test_timeout_s": cfg.scoring.test_timeout_s})
        self.cache = ShardCache(Path(folder) / "grader", accept=lambda e: e.get("scope") == self.scope)

    async def verdict(self, item_id: str, reference: dict, answer: str,
                      compute: Callable[[], Awaitable[tuple[float, dict]]]) -> tuple[float, dict, bool]:
        """(score, details, hit) of `answer` to the item; `compute()` grades it."""
        key = digest({"scope": self.scope, "item": item_id, "reference": reference, "answer": answer})
        own: list[tuple[float, dict]] = []

        async def run() -> dict | None:
            score, details = await compute()
            own.append((score, details))
            if details.get("status") in UNCACHED_VERDICTS:
                return None
            return {"scope": self.scope, "item": item_id, "score": score, "details": details,
                    "created_at": dt.datetime.now(dt.UTC).isoformat()}

        entry, hit = await self.cache.get_or_compute(key, run)
        if entry is None:  # not kept (a timeout): this call's own result
            return (*own[0], False)
        return float(entry["score"]), entry["details"], hit

    def close(self) -> None:
        self.cache.close()
