"""The compute dtype follows the hardware: `auto` is bf16 only where the device computes it natively.

Why a measured probe and not a list of CPU flags: what matters is the rate torch (and vLLM's CPU kernels, built on
the same oneDNN paths) gets, and flags do not tell it. AVX512_BF16 without AMX, a hypervisor that hides AMX, or a
torch build without the kernel all fall between the flags and the speed. The probe is one matrix product of a
decoder's MLP shape (64 x 896 @ 896 x 4864, Qwen2.5-0.5B's), fp32 and bf16, on one thread: under a second on a CPU
without native bf16 (where bf16 runs ~0.8 GFLOP/s against ~36 in fp32), milliseconds elsewhere. It is cached per
machine (CPU model, flags, torch version) under the model cache, so a run pays it once.

The rule: bf16 where its measured rate is at least fp32's (it halves the weights' memory traffic on top), fp32
elsewhere. A CUDA device needs no probe: bf16 where `torch.cuda.is_bf16_supported()`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("pipeline.hardware")

PROBE_SHAPE = (64, 896, 4864)  # (rows, hidden, MLP width) of Qwen2.5-0.5B's up-projection
PROBE_VERSION = 1
FORCE_ENV = "PIPELINE_NATIVE_BF16"  # "0"/"1": skip the probe and force the answer (e.g. to measure both paths)
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DtypeProbe:
    """What the probe measured on this machine, and its verdict."""

    device: str  # "cpu" or "cuda"
    machine: str  # CPU model name (or GPU name)
    fp32_gflops: float | None  # None: not measured (CUDA, or forced by FORCE_ENV)
    bf16_gflops: float | None
    native_bf16: bool
    reason: str

    @property
    def slowdown(self) -> float | None:
        """How many times slower bf16 is than fp32 here (None when not measured)."""
        if not self.fp32_gflops or not self.bf16_gflops:
            return None
        return self.fp32_gflops / self.bf16_gflops


def _cpu_identity() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo; platform's answer where there is none."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name == (platform.processor() or platform.machine()):
                name = value.strip()
            elif key == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return name, flags


# the widest vector extension of a CPU that matters to the dtype and speed here, widest first: (flag, name)
ISA_FLAGS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def machine(flags: str | None = None, name: str | None = None, cores: int | None = None) -> str:
    """This machine in a few words, for timing records: the CPU model, its widest vector extension of ISA_FLAGS and
    the cores this process may use, e.g. "AMD EPYC (AVX2, 2 cores)". Timings from machines of two kinds do not
    compare (a bf16 product is ~45x slower without native bf16), so every stage timing says where it was taken."""
    if flags is None or name is None:
        here = _cpu_identity()
        name, flags = name if name is not None else here[0], flags if flags is not None else here[1]
    have = set(flags.split())
    isa = next((label for flag, label in ISA_FLAGS if flag in have), "no AVX2")
    if cores is None:  # the cores this process may use (Linux), else all of them
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"{name} ({isa}, {cores} cores)"


def _gflops(left, right, reps: int, min_s: float = 0.05) -> float:
    """Best of `reps` timed products (at least `min_s` each, repeated), in GFLOP/s."""
    import torch

    rows, inner = left.shape
    cols = right.shape[1]
    started = time.perf_counter()
    torch.mm(left, right)  # warm-up: first calls pick kernels and allocate
    if time.perf_counter() - started > 10 * min_s:
        reps = 1  # a path this slow (bf16 without native support: ~1 s a product) needs no best-of to be told apart
    best = float("inf")
    for _ in range(reps):
        count, started = 0, time.perf_counter()
        while True:
            torch.mm(left, right)
            count += 1
            dt = time.perf_counter() - started
            if dt >= min_s:
                break
        best = min(best, dt / count)
    return 2 * rows * inner * cols / best / 1e9


def measure_cpu(reps: int = 3) -> tuple[float, float]:
    """fp32 and bf16 GFLOP/s of the probe's product on one thread (the threads of the caller are restored)."""
    return matmul_gflops("float32", 1, reps), matmul_gflops("bfloat16", 1, reps)


def matmul_gflops(dtype: str = "float32", threads: int | None = None, reps: int = 3) -> float:
    """GFLOP/s of the probe's product (PROBE_SHAPE) in `dtype` on `threads` threads (default: as many as torch uses
    now, as a training step here does); the caller's threads are restored. The rate a step's utilisation is taken
    against (`pipeline bench train`)."""
    import torch

    m, k, n = PROBE_SHAPE
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        return _gflops(a.to(getattr(torch, dtype)), b.to(getattr(torch, dtype)), reps)
    finally:
        torch.set_num_threads(before)


def _probe_path(key: str) -> Path:
    from pipeline.engines.models import cache_dir

    return cache_dir() / "hardware" / f"dtype-probe-{key}.json"


def probe(device: str = "cpu", *, refresh: bool = False) -> DtypeProbe:
    """This machine's verdict on bf16 for `device`, measured once and cached (see the module's docstring)."""
    import torch

    forced = os.environ.get(FORCE_ENV)
    if forced in ("0", "1"):
        return DtypeProbe(device, _cpu_identity()[0], None, None, forced == "1", f"forced by {FORCE_ENV}={forced}")
    if device.startswith("cuda"):
        native = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        return DtypeProbe("cuda", torch.cuda.get_device_name() if torch.cuda.is_available() else "none", None, None,
                          native, "CUDA device " + ("supports bf16" if native else "has no bf16"))
    name, flags = _cpu_identity()
    key = hashlib.sha256(f"{PROBE_VERSION}|{name}|{flags}|{torch.__version__}".encode()).hexdigest()[:16]
    path = _probe_path(key)
    if path.is_file() and not refresh:
        try:
            return DtypeProbe(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a torn or old file: measure again
    fp32, bf16 = measure_cpu()
    native = bf16 >= fp32
    reason = (f"bf16 {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f} on this CPU ({name}): "
              + ("bf16 is native here" if native else f"bf16 is {fp32 / bf16:.1f}x slower, no native bf16"))
    result = DtypeProbe("cpu", name, round(fp32, 2), round(bf16, 2), native, reason)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(result)))
    os.replace(tmp, path)  # atomic: concurrent stages never read half a file
    return result


def local_device() -> str:
    """Where this process's models run: cuda when torch sees a GPU, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_said: set[tuple[str, ...]] = set()  # log lines already given in this process: a stage resolves a dtype several times


def _once(level: int, msg: str, *args: str) -> None:
    if (key := (msg, *args)) not in _said:
        _said.add(key)
        log.log(level, msg, *args)


def resolve_dtype(requested: str, device: str | None = None, *, what: str = "model") -> str:
    """The dtype to load `what` in: `auto` becomes bfloat16 where the device computes it natively, else float32,
    with one log line saying why; an explicit bfloat16 where it is not native is honoured with a warning that names
    the measured slowdown. float32 and float16 pass through unmeasured."""
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; use one of {', '.join(DTYPES)}")
    if requested in ("float32", "float16"):
        return requested
    measured = probe(device or local_device())
    if requested == "auto":
        chosen = "bfloat16" if measured.native_bf16 else "float32"
        _once(logging.INFO, "%s dtype auto -> %s (%s)", what, chosen, measured.reason)
        return chosen
    if not measured.native_bf16:
        slower = f"{measured.slowdown:.0f}x slower than fp32 here" if measured.slowdown else "not native here"
        _once(logging.WARNING, "%s dtype bfloat16 is honoured, but bf16 is %s (%s); `auto` would pick float32",
              what, slower, measured.reason)
    return requested


def resolve_bf16(requested: bool | str, device: str | None = None) -> bool:
    """training.bf16 (true / false / auto) as the autocast switch of this device."""
    if isinstance(requested, bool):
        if requested:
            resolve_dtype("bfloat16", device, what="training autocast")  # the warning where bf16 is slow
        return requested
    return resolve_dtype("auto", device, what="training autocast") == "bfloat16"
