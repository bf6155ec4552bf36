"""Leases: one writer per (run, round, stage[, shard]) of a store, and one round loop per run.

A second command that would write what a running one is writing (the same stage of the same round, re-run in
another shell or re-triggered as a deployment) is refused before it does any work, with `LeaseHeld` naming the
holder (host, pid, command line, since when, and a note such as the Prefect flow run), or waits for it
(`wait=True`, the CLI's `--wait`). What a lease does not cover runs in parallel as before.

Local store: an OS file lock, flock(2), on `<run>/_leases/<name>.lock`. The kernel frees it when the last process
holding the open file closes it or dies (`kill -9` included), so a dead holder never leaves a stale lease; a waiter
blocks in flock(2) and is woken by the kernel. flock, not fcntl(2) record locks: record locks belong to a process,
so two leases taken in one process (threads, in-process flows) would not exclude each other; flock locks belong to
the open file, which a stage child shares (`Lease.fds`, passed to it), so the lease lives until the holder and
its child are both gone. Lock files are never deleted: unlinking a lock file lets a later opener lock a new file
at the same name while an older holder still locks the old one. The holder's record is `<name>.holder.json`,
written after the lock is taken (only read to name the holder in an error).

S3 store: a lease object `<run>/_leases/<name>.json` created with a conditional PUT (`If-None-Match: *`): S3 lets
one of several concurrent creators win. A heartbeat thread renews it every ttl/3 with `If-Match: <its ETag>`;
a lease whose object has not been renewed for its ttl (measured on the server's clock: the response's `Date`
against the object's `Last-Modified`, so skewed client clocks do not matter) is taken over with `If-Match` on the
ETag that was read, so of two takers one wins. A holder whose renewal fails because another took over has lost
the lease (`LeaseLost`, raised by `check()`). Release deletes the object with `If-Match`, so a holder never
deletes a lease that is no longer its own. Object storage has no shared lease: `shared=True` is refused there.
The ttl is $PIPELINE_LEASE_TTL_S (default 60 s): after `kill -9` of the holder the next taker waits that long.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import email.utils
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LEASES = "_leases"  # <run>/_leases/: outside the round folders, which a re-run may set aside while one is held
TTL_ENV = "PIPELINE_LEASE_TTL_S"
DEFAULT_TTL_S = 60.0
# Who holds a lease besides the process: set by the Prefect wiring to the flow run (several flow runs may share a
# process and thread pool, so a context variable, not a global).
NOTE: contextvars.ContextVar[str] = contextvars.ContextVar("lease_note", default="")


@contextlib.contextmanager
def noting(note: str) -> Iterator[None]:
    """Leases taken inside the block name `note` as part of their holder (e.g. "Prefect flow run 'x' (id)")."""
    token = NOTE.set(note)
    try:
        yield
    finally:
        NOTE.reset(token)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: enough for a user to find the process (host, pid, command line) and judge it (since)."""

    host: str
    pid: int
    command: str
    since: str  # ISO 8601, UTC
    note: str = ""
    token: str = ""  # one acquisition: a renewal or release checks it is still the one it took (S3)
    ttl_s: float = 0.0  # S3: the holder's own ttl, which a taker honours

    @classmethod
    def me(cls, ttl_s: float = 0.0) -> Holder:
        since = _utcnow().isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), shlex.join(sys.orig_argv), since, NOTE.get(), uuid.uuid4().hex,
                   ttl_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Holder | None:
        """None for a record that is not one (empty, half-written by an older version, foreign)."""
        try:
            body = json.loads(text)
            return cls(**{k: body[k] for k in cls.__dataclass_fields__ if k in body})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        try:
            age = f" ({(_utcnow() - dt.datetime.fromisoformat(self.since)).total_seconds():.0f} s ago)"
        except ValueError:
            age = ""
        note = f", {self.note}" if self.note else ""
        return f"pid {self.pid} on host {self.host}{note}, command `{self.command}`, since {self.since}{age}"


class LeaseHeld(RuntimeError):
    """Another process holds the lease: nothing was done. The message names the holder and how to wait."""

    def __init__(self, what: str, holder: Holder | None, where: str):
        self.what, self.holder, self.where = what, holder, where
        who = holder.describe() if holder is not None else "a process that has not recorded itself yet"
        super().__init__(f"{what} is being written by another process: {who} (lease {where}). This command did "
                         "nothing; run it again with --wait to wait for that process (a stage it finishes is then "
                         "skipped), or stop that process first")

    def __reduce__(self):  # picklable across Prefect's result handling and Dask workers
        return (LeaseHeld, (self.what, self.holder, self.where))


class LeaseLost(RuntimeError):
    """An S3 lease that another process took over while this one held it (its renewals failed for a whole ttl)."""


@dataclass
class FileLease:
    """flock(2) on a local lock file (see the module docstring)."""

    lock: Path
    what: str
    shared: bool = False
    fd: int = -1

    @property
    def record(self) -> Path:
        return self.lock.with_name(self.lock.name.removesuffix(".lock") + ".holder.json")

    @property
    def fds(self) -> tuple[int, ...]:
        """The open lock file: a child process given it (subprocess `pass_fds`) holds the lease with this one."""
        return (self.fd,) if self.fd >= 0 else ()

    def acquire(self, wait: bool) -> FileLease:
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        try:
            try:
                fcntl.flock(lock_fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                held = LeaseHeld(self.what, self.holder(), str(self.lock))
                if not wait:
                    raise held from None
                log.warning("waiting for %s: held by %s", self.what, held.holder.describe() if held.holder else "?")
                t0 = time.monotonic()
                fcntl.flock(lock_fd, mode)  # the kernel wakes this when the holder releases or dies
                log.warning("%s: lease taken after %.1f s of waiting", self.what, time.monotonic() - t0)
        except BaseException:
            os.close(lock_fd)
            raise
        self.fd = lock_fd
        tmp = self.record.with_name(f".{self.record.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(Holder.me().to_json())
        os.replace(tmp, self.record)  # whole or absent: a contender never reads half a record
        return self

    def holder(self) -> Holder | None:
        try:
            h = Holder.from_json(self.record.read_text())
        except OSError:
            return None
        # the record of a holder that is gone (its lock freed by the kernel) names no one: the lock was just taken
        # by a process that has not written its own record yet
        return h if h is not None and (h.host != socket.gethostname() or _alive(h.pid)) else None

    def check(self) -> None:
        """A local lease cannot be lost while its file is open."""

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the last descriptor of the open file (a child's ended before)
            self.fd = -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def ttl_s() -> float:
    raw = os.environ.get(TTL_ENV, "").strip()
    try:
        ttl = float(raw) if raw else DEFAULT_TTL_S
    except ValueError:
        raise ValueError(f"${TTL_ENV}={raw!r}: expected a number of seconds") from None
    if ttl <= 0:
        raise ValueError(f"${TTL_ENV}={raw!r}: must be > 0")
    return ttl


@dataclass
class S3Lease:
    """A lease object on S3 (see the module docstring); `client` is a botocore S3 client."""

    client: object
    bucket: str
    key: str
    what: str
    ttl_s: float = field(default_factory=ttl_s)
    etag: str = ""
    lost: str = ""
    _mine: Holder | None = None
    _writes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _beat: threading.Thread | None = None

    fds: tuple[int, ...] = ()  # nothing to pass to a child: the heartbeat runs here

    def acquire(self, wait: bool) -> S3Lease:
        self._mine = Holder.me(self.ttl_s)
        waited: float | None = None
        while True:
            try:  # create: exactly one concurrent creator wins
                self.etag = self._put(IfNoneMatch="*")
                break
            except _Refused:
                pass
            cur = self._current()
            if cur is None:  # released between the two calls: create again
                continue
            holder, etag, age = cur
            expiry = (holder.ttl_s if holder and holder.ttl_s > 0 else self.ttl_s) - age
            if expiry < 0:
                try:  # take over the expired lease: of several takers, the one whose If-Match still holds wins
                    self.etag = self._put(IfMatch=etag)
                except _Refused:
                    continue
                log.warning("%s: took over a lease not renewed for %.0f s (its holder: %s)", self.what, age,
                            holder.describe() if holder else "?")
                break
            held = LeaseHeld(self.what, holder, f"s3://{self.bucket}/{self.key}")
            if not wait:
                raise held
            if waited is None:
                log.warning("waiting for %s: held by %s (S3 has no blocking lock: checked every few seconds, "
                            "taken over %.0f s after its last renewal)", self.what,
                            holder.describe() if holder else "?", self.ttl_s)
                waited = time.monotonic()
            time.sleep(min(max(expiry, 0.0) + 0.5, self.ttl_s / 4, 5.0))  # no blocking primitive exists on S3
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease {self.key}", daemon=True)
        self._beat.start()
        return self

    def _put(self, **condition: str) -> str:
        from botocore.exceptions import ClientError

        try:
            self._writes += 1  # in the body, so that each renewal has a new ETag (an ETag is the content's MD5)
            body = json.dumps({**asdict(self._mine), "writes": self._writes}).encode()
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                          ContentType="application/json", **condition)["ETag"]
        except ClientError as e:
            # 412: the condition failed; 409: a concurrent conditional write won; 404: If-Match on a deleted key
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict",
                                                           "NoSuchKey", "404", "409", "412"):
                raise _Refused from e
            raise

    def _current(self) -> tuple[Holder | None, str, float] | None:
        """(holder, ETag, seconds since its last write by the server's clock), None if there is no lease."""
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        date = response["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
        now = email.utils.parsedate_to_datetime(date) if date else _utcnow()
        age = (now - response["LastModified"]).total_seconds()
        return Holder.from_json(response["Body"].read()), response["ETag"], age

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.etag = self._put(IfMatch=self.etag)
            except _Refused:
                cur = self._current()
                self.lost = (f"{self.what}: lease lost, taken over by "
                             f"{cur[0].describe() if cur and cur[0] else 'another process'}")
                log.error("%s (renewals failed for longer than its ttl of %.0f s)", self.lost, self.ttl_s)
                return
            except Exception as e:  # a network error: retried at the next beat, before the ttl runs out
                log.warning("%s: lease renewal failed (%s: %s); retrying", self.what, type(e).__name__, e)

    def check(self) -> None:
        if self.lost:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        from botocore.exceptions import ClientError

        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self.lost or not self.etag:
            return
        with contextlib.suppress(ClientError):  # already taken over or gone: not ours to delete
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
        self.etag = ""


class _Refused(Exception):
    """A conditional S3 write whose condition did not hold."""


Lease = FileLease | S3Lease
