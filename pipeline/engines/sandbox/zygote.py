"""The zygote: a small stdlib-only supervisor that forks one sandboxed child per run.

It is started once per parent process with a scrubbed environment, pre-imports what a child needs
(so a run costs a fork, not an interpreter start) and, where the OS allows it, moves itself into new
network and mount namespaces: children then see no network interfaces but a down loopback, a read-only
root file system and small private tmpfs mounts for /tmp, /var/tmp and /dev/shm.

Per run (root): a private tmpfs work dir, a fresh session (process group), rlimits, then the child
drops to a per-slot unprivileged uid. When the child exits, every process of that uid is killed
(`kill(-1)` from a helper running as the uid), so detached grandchildren cannot outlive the run.
Untrusted code runs only in the children, never here.

Protocol: the control socket (SOCK_SEQPACKET) carries one JSON request per run with two fds attached:
the child's end of the run channel and a status socket, on which the zygote reports `{"pid": ...}`
and later `{"exit": ...}`. Closing the control socket makes the zygote kill all runs and exit.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import tempfile
import time

# Pre-imported for the children (a fork inherits them).
from pipeline.engines.sandbox import child  # noqa: F401  (stdlib-only module)
from pipeline.engines.sandbox.view import PRIVATE_TMP_OPTS, View

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
NO_VIEW = ("NO FILE VIEW: workflows can read every file the sandbox uid can read, e.g. world-readable benchmark "
           "hidden tests in site-packages, the store's Parquet parts, configs and the repository")
SWEEP_ROUNDS = 1000  # ~20 s of waiting for killed processes to exit before giving up on a uid
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _err(what: str) -> str:
    e = ctypes.get_errno()
    return f"{what}: {os.strerror(e)} (errno {e})"


def _mount_tmpfs(target: str, opts: str) -> bool:
    return _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) == 0


def _prctl(option: int, arg: int) -> int:
    return _libc.prctl(option, arg, 0, 0, 0)


class Zygote:
    def __init__(self, ctl: socket.socket, deny: list[str] | None = None):
        self.ctl = ctl
        self.privileged = os.geteuid() == 0
        self.iso: dict = {"privilege_drop": self.privileged, "uid_sweep": self.privileged, "notes": []}
        self.runs: dict[int, dict] = {}  # pid -> {status: socket, uid, workdir, exit}
        self.tmp_mounts = False
        self._isolate(deny or [])

    # ---- one-time isolation of the zygote (inherited by every child) -------------------------
    def _isolate(self, deny: list[str]) -> None:
        notes = self.iso["notes"]
        if not self.privileged:
            notes.append("not root: no privilege drop; runs share the user's uid (kill by process group only)")
        net = _libc.unshare(CLONE_NEWNET) == 0
        self.iso["net_namespace"] = net
        if not net:
            notes.append(_err("no network namespace (children can open connections)"))
        mnt = _libc.unshare(CLONE_NEWNS) == 0 and _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
        self.iso["mount_namespace"] = mnt
        readonly = tmp = False
        if mnt:
            readonly = self._file_system(deny)
            done = self.iso.get("view", {}).get("private_tmp", [])  # the view mounts them under what it exposes
            tmp = all(_mount_tmpfs(d, PRIVATE_TMP_OPTS) for d in ("/tmp", "/var/tmp", "/dev/shm")
                      if os.path.isdir(d) and d not in done)
            if not tmp:
                notes.append(_err("shared tmp dirs stay on disk"))
        else:
            self.iso["file_view"], self.iso["hidden_dirs"] = False, []
            notes.append(_err("no mount namespace: work dirs are plain dirs without a size quota"))
            notes.append(NO_VIEW)
        self.iso["readonly_root"], self.iso["private_tmp"] = readonly, tmp
        self.tmp_mounts = mnt and tmp
        base = tempfile.gettempdir() if tmp else tempfile.mkdtemp(prefix="pipeline-sbx-")
        self.base = os.path.join(base, ".runs") if tmp else base
        os.makedirs(self.base, mode=0o711, exist_ok=True)
        if _prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
            notes.append(_err("not a subreaper: orphans are reaped by init"))

    def _file_system(self, deny: list[str]) -> bool:
        """The deny-by-default view (view.py); failing that, the whole root read-only, with the Python
        install exposed where its ancestors are closed. Returns whether the root is read-only."""
        notes = self.iso["notes"]
        try:
            self.iso["view"] = View(deny).build()
            self.iso["file_view"], self.iso["hidden_dirs"] = True, []
            if self.iso["view"]["not_masked"]:
                notes.append(f"file view: could not hide {self.iso['view']['not_masked']} (they hold Python)")
            return True
        except OSError as e:
            self.iso["file_view"] = False
            notes.append(f"file view failed ({e}); {NO_VIEW}")
        self.iso["hidden_dirs"] = hidden = _expose_python()
        if self.privileged and not hidden and _blocked(_python_paths()):
            notes.append("the Python install is not readable by the sandbox uid: only pre-imported modules work")
        ro = _libc.mount(b"none", b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0
        if not ro:
            notes.append(_err("root file system stays writable"))
        return ro

    # ---- per run ---------------------------------------------------------------------------------
    def _workdir(self, uid: int, disk_mb: int) -> str:
        d = tempfile.mkdtemp(dir=self.base)
        if self.tmp_mounts and _mount_tmpfs(d, f"size={disk_mb}m,mode=0700,uid={uid},gid={uid}"):
            return d
        if self.privileged:
            os.chown(d, uid, uid)
        return d

    def _cleanup_workdir(self, d: str) -> None:
        _libc.umount2(d.encode(), MNT_DETACH)
        shutil.rmtree(d, ignore_errors=True)

    def start(self, req: dict, run_fd: int, status_fd: int) -> None:
        status = socket.socket(fileno=status_fd)
        uid = int(req["uid"]) if self.privileged else os.getuid()
        workdir = self._workdir(uid, int(req["limits"]["disk_mb"]))
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:  # child: never returns
            try:
                self.ctl.close()
                status.close()
                _child_setup(uid, workdir, req["limits"], self.privileged, zygote)
                child.main(run_fd, req.get("mode", "workflow"))
            finally:
                os._exit(70)
        os.close(run_fd)
        self.runs[pid] = {"status": status, "uid": uid, "workdir": workdir, "exit": None}
        _send(status, {"pid": pid, "workdir": workdir})

    # ---- reaping and sweeping -------------------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            run = self.runs.get(pid)
            if run is not None and run["exit"] is None:
                run["exit"] = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                               else {"code": os.WEXITSTATUS(status)})

    def sweep(self, run: dict, pid: int) -> int:
        """Kill every process left by a run and wait until they are gone; returns the kill rounds used.
        SIGKILL is not death: a killed process runs its exit path for a while (long on a loaded machine,
        with another sandbox's fork bomb competing for the CPU) and is counted against its uid's
        RLIMIT_NPROC until it is reaped. Reporting the run's end before that let a reused uid start with
        a dying predecessor still on the books, so a run ends only once its uid holds no process."""
        if self.privileged:
            for rounds in range(1, SWEEP_ROUNDS + 1):
                if self._kill_uid(run["uid"]):
                    return rounds
                self.reap()  # zombies of the uid re-parented to us count until reaped
                time.sleep(0.001 * min(rounds, 20))  # let the dying exit; no hot loop on a busy machine
            run["unswept"] = True
            return SWEEP_ROUNDS
        for rounds in range(500):
            found = _kill_group(pid) | self._kill_orphans()
            self.reap()
            if not found:
                return rounds
            time.sleep(0.001)
        return 500

    def _kill_uid(self, uid: int) -> bool:
        """A helper with the run's uid calls kill(-1): that signals exactly the processes of that uid,
        atomically w.r.t. fork (a forking parent hit by SIGKILL aborts the fork). kill(-1) reports success
        whenever other processes exist, so it cannot tell whether it found any: the helper then probes
        whether it is the uid's sole process (see _sole_process). True when the uid is empty."""
        helper = os.fork()
        if helper == 0:
            code = 1
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                for _ in range(2):
                    os.kill(-1, signal.SIGKILL)
                code = 0 if _sole_process() else 1
            finally:
                os._exit(code)
        _, st = os.waitpid(helper, 0)
        return os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0

    def _kill_orphans(self) -> bool:
        """Unprivileged fallback: orphans re-parented to this subreaper that are not runs."""
        found = False
        for k in self._children():
            if k not in self.runs:
                found |= _kill_group(k)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)
                    found = True
        return found

    def _children(self) -> list[int]:
        me = os.getpid()
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                return [int(k) for k in f.read().split()]
        except OSError:
            return []

    def _leftovers(self, uid: int) -> int:
        """Processes of a finished run still alive: its orphans were re-parented to us (subreaper)."""
        count = 0
        for k in self._children():
            if k in self.runs:
                continue
            with contextlib.suppress(OSError), open(f"/proc/{k}/status") as f:
                count += any(ln.startswith("Uid:") and int(ln.split()[1]) == uid for ln in f)
        return count

    def finish_exited(self) -> None:
        for pid in [p for p, r in self.runs.items() if r["exit"] is not None]:
            run = self.runs.pop(pid)
            if self.privileged:
                run["exit"]["leftover"] = self._leftovers(run["uid"])
            swept = self.sweep(run, pid)
            if run.get("unswept"):  # the parent keeps this uid out of its pool
                run["exit"]["unswept"] = True
            self._cleanup_workdir(run["workdir"])
            with contextlib.suppress(OSError):
                _send(run["status"], {"exit": run["exit"], "swept_rounds": swept})
            run["status"].close()

    def kill_all(self) -> None:
        # every run first, then the sweeps: a sweep can wait seconds for a uid's dying processes on a loaded
        # machine, and the runs after it must not keep running meanwhile
        for pid in self.runs:
            # the pid itself too: a run forked just before the parent left may not have its own group or
            # uid yet, so neither the group kill nor the uid sweep would reach it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _kill_group(pid)
        for pid, run in list(self.runs.items()):
            self.sweep(run, pid)
            self._cleanup_workdir(run["workdir"])
        self.runs.clear()

    # ---- main loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        _send(self.ctl, {"hello": self.iso})
        while True:
            ready, _, _ = select.select([self.ctl, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
            if self.ctl in ready:
                fds = array.array("i")
                try:
                    data, anc, _, _ = self.ctl.recvmsg(65536, socket.CMSG_SPACE(2 * fds.itemsize))
                except ConnectionResetError:
                    data = b""
                if not data:  # parent gone: nothing may outlive it
                    self.kill_all()
                    return
                for level, kind, raw in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                if len(fds) == 2:
                    try:
                        self.start(json.loads(data), fds[0], fds[1])
                    except Exception as e:  # e.g. fork failing under memory pressure: report, keep serving
                        with contextlib.suppress(OSError):
                            os.write(fds[1], json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                            os.close(fds[1])
                            os.close(fds[0])
                else:
                    for fd in fds:
                        os.close(fd)
            self.reap()
            self.finish_exited()


def _python_paths() -> list[str]:
    paths = {sys.prefix, sys.base_prefix, *[p for p in sys.path if p and os.path.isdir(p)]}
    return sorted(os.path.realpath(p) for p in paths)


def _blocked(paths: list[str]) -> dict[str, list[str]]:
    """{ancestor that others cannot traverse: [paths under it the sandbox must still read]}."""
    out: dict[str, list[str]] = {}
    for p in paths:
        parts = p.split("/")
        for i in range(2, len(parts)):
            a = "/".join(parts[:i])
            if not os.stat(a).st_mode & 0o001:
                out.setdefault(a, []).append(p)
                break
    return out


def _expose_python() -> list[str]:
    """Children run as another uid: a Python installed under e.g. /root (0700) would be unreadable. In
    our mount namespace, cover each such ancestor with an empty read-only tmpfs and bind back only the
    Python dirs; the rest of it (home dirs, keys) stays hidden. Returns the covered dirs."""
    covered = []
    for anc, paths in _blocked(_python_paths()).items():
        keep = [p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)]
        staged = []
        for i, path in enumerate(keep):  # bind the originals aside before the ancestor is covered
            staging = tempfile.mkdtemp(prefix=f".keep{i}-")
            _libc.mount(path.encode(), staging.encode(), None, MS_BIND | MS_REC, None)
            staged.append((staging, path))
        if not _mount_tmpfs(anc, "size=1m,mode=0755"):
            continue
        for staging, path in staged:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _libc.mount(staging.encode(), path.encode(), None, MS_BIND | MS_REC, None)
            _libc.umount2(staging.encode(), MNT_DETACH)
            os.rmdir(staging)
        _libc.mount(b"none", anc.encode(), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
        covered.append(anc)
    return covered


def _sole_process() -> bool:
    """Whether the calling process is the only one of its uid. Under RLIMIT_NPROC=2 a new process can be
    created only if the uid has no other (dying and zombie processes count until reaped). posix_spawn
    clones with CLONE_VM (no page tables copied, unlike a fork of the zygote, which doubled the cost of a
    sweep) and spawns a path that does not exist: ENOENT means the process was created, EAGAIN that the
    limit refused it."""
    resource.setrlimit(resource.RLIMIT_NPROC, (2, 2))
    try:
        os.posix_spawn("/nonexistent/pipeline-sandbox-probe", ["probe"], {})
    except BlockingIOError:
        return False
    except FileNotFoundError:
        return True
    probe = os.fork()  # posix_spawn failed otherwise (unexpected): the plain probe
    if probe == 0:
        os._exit(0)
    os.waitpid(probe, 0)
    return True


def _kill_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _child_setup(uid: int, workdir: str, limits: dict, privileged: bool, zygote: int) -> None:
    """In the forked child, before any untrusted code: session, signals, limits, identity, env."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(s, signal.SIG_DFL)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot regain privileges
    cpu = int(limits["cpu_s"])
    mb = 1024 * 1024
    for res, val in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (limits["file_mb"] * mb,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, val)
    if privileged:  # RLIMIT_NPROC counts the uid's processes: only meaningful for a dedicated uid
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # after the uid change, which clears a parent-death signal set before it (prctl(2)); and a zygote
    # that left before this line would never send it, hence the parent check
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote:
        os._exit(70)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
    tempfile.tempdir = workdir


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    deny = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []  # paths the view must not show
    Zygote(ctl, deny).serve()


if __name__ == "__main__":
    main()
