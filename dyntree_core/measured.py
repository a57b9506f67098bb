"""Measured once per machine: the key, the timer and the quiet-machine check every cache of this
machine's measurements goes through (the machine profile, the quantized-kernel table, the
``attention="auto"`` table).

* **The key** (``measure_key``): what is measured, the machine's identity (``machine_identity``: CPU
  model and flags, CPUs, torch threads, and the GPU for a CUDA measurement), the library versions
  that matter (torch, plus what the caller adds), a digest of the code that produces the
  measurement (``code_digest`` of the functions, modules, files or strings the caller names) and
  the caller's own fields. One JSON file per key (``MeasureKey.path``) under ``paths.cache_root()``,
  holding the key's fields, the quiet check's verdict and the value; written atomically
  (``write_json``: a temporary file in the same folder, then ``os.replace``), so a reader never sees
  half a file and a writer that fails leaves the previous file as it was.
* **The timer** (``time_call``; ``summarize`` for samples timed elsewhere, e.g. by CUDA events):
  ``Timing`` = median, fastest, slowest and the spread of the repeats (interquartile range over the
  median).
* **The quiet check** (``watch``): a measurement runs inside ``with watch() as w:``; every ``Timing``
  made inside is recorded, and the machine's counters are sampled before and after.
  ``w.verdict()`` asks ``busy_detector`` (a module-level hook; tests replace it, ``watch(busy=...)``
  overrides it for one measurement) whether the machine was busy: by default when other processes
  used more than ``OTHERS_LIMIT`` of the CPUs while it ran (``/proc/stat`` minus this process's own
  CPU time; the 1-minute load average per CPU before it when the window is too short or there is no
  ``/proc/stat``), or, only where those counters do not cover the window, when a timing's repeats spread
  more than ``SPREAD_LIMIT``. A busy measurement
  is returned marked provisional with the reason and **not** stored (``store``): the next call
  measures again.

``measure_once`` puts the three together for a value measured in one go; the incremental caches
(profile rows, kernel shapes) use ``load`` / ``watch`` / ``store`` themselves.

A leaf module: it imports only ``machine`` and ``paths`` of the project.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Mapping, Optional, Sequence, TypeVar

from .machine import MachineInfo, machine_info
from .paths import cache_root

#: busy when other processes used more than this fraction of the CPUs while a measurement ran
OTHERS_LIMIT = 0.25
#: a run whose threads take every CPU is crowded when other processes use more cores than its threads leave free
#: plus this many: a browser redrawing the app's page took 0.24-0.32 of a core of the 2-core AVX2 machine while
#: plain decoding on 2 threads ran 1.5-1.9x slower than the profile (its idle page takes ~0.1)
SPARE_SLACK_CORES = 0.15
#: busy when a timing's interquartile range exceeds this fraction of its median
SPREAD_LIMIT = 0.5
#: repeats of calls shorter than this say nothing of other processes (timer and scheduler jitter: a 0.02 ms kernel
#: call's repeats spread 50-300% on the quiet 2-core Zen 4 VM, so its table shape was never stored and was measured
#: again by every process); the load average before still decides for them
MIN_SPREAD_CALL_S = 1e-4
#: busy when the 1-minute load average per CPU before a short measurement exceeds this
LOAD_LIMIT = 1.0
#: below this many seconds the CPU-time counters (10 ms ticks) say too little; the load average decides
MIN_COUNTER_WINDOW_S = 0.5

T = TypeVar("T")


# --------------------------------------------------------------------------------------- timer
@dataclass(frozen=True)
class Timing:
    """Repeats of one call: median, fastest and slowest seconds, how many, and their spread
    (interquartile range / median; the whole range for 2 or 3 samples)."""

    median_s: float
    min_s: float
    max_s: float
    samples: int
    spread: float

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def min_ms(self) -> float:
        return self.min_s * 1e3


def summarize(samples_s: Sequence[float]) -> Timing:
    """The ``Timing`` of samples (seconds) timed by the caller, recorded in the active ``watch``es."""
    xs = sorted(float(x) for x in samples_s)
    if not xs:
        raise ValueError("no samples")
    n = len(xs)
    median = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    lo, hi = xs[int(0.25 * (n - 1))], xs[-1 - int(0.25 * (n - 1))]
    t = Timing(median, xs[0], xs[-1], n, (hi - lo) / median if median > 0 else 0.0)
    for w in _active():
        w.timings.append(t)
    return t


def time_call(fn: Callable[[], object], repeats: int = 5, budget_s: float = 2.0, warmup: int = 1,
              give_up_s: Optional[float] = None) -> Timing:
    """Wall-clock ``Timing`` of ``fn`` after ``warmup`` untimed calls; fewer repeats (at least one)
    when ``repeats`` calls would take longer than ``budget_s``, one when the last warm-up call took longer than
    ``give_up_s`` (a candidate already out of the running)."""
    first = None
    for _ in range(max(0, warmup)):
        start = time.perf_counter()
        fn()
        first = time.perf_counter() - start
    if first is not None:
        repeats = max(1, min(repeats, int(budget_s / max(first, 1e-6))))
        if give_up_s is not None and first > give_up_s:
            repeats = 1
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return summarize(times)


# -------------------------------------------------------------------------------- quiet check
@dataclass(frozen=True)
class Sample:
    """The machine's counters at one moment (None where this OS has none)."""

    wall: float
    own_cpu_s: float
    busy_s: Optional[float]  # all processes' CPU time on every CPU (/proc/stat, without idle/iowait)
    cpus_counted: Optional[int]  # CPUs /proc/stat counts
    load_1min: Optional[float]
    cpus: int


def _proc_stat() -> tuple[Optional[float], Optional[int]]:
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None, None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = [int(v) for v in lines[0].split()[1:]] if lines and lines[0].startswith("cpu ") else []
    if len(total) < 4:
        return None, None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    busy = sum(total[:8]) - total[3] - (total[4] if len(total) > 4 else 0)
    return busy / ticks, sum(1 for line in lines[1:] if line.startswith("cpu"))


def sample() -> Sample:
    """The counters now."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        own = ru.ru_utime + ru.ru_stime
    except (ImportError, OSError):
        own = time.process_time()
    busy, counted = _proc_stat()
    try:
        load: Optional[float] = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return Sample(time.perf_counter(), own, busy, counted, load, cpus)


def others_share(before: Optional[Sample], after: Optional[Sample]) -> Optional[float]:
    """The share of all CPUs that other processes used between two samples (this process's own CPU time left
    out); None where ``/proc/stat`` does not count them or the window is under ``MIN_COUNTER_WINDOW_S``."""
    if before is None or after is None or before.busy_s is None or after.busy_s is None or not after.cpus_counted:
        return None
    wall = after.wall - before.wall
    if wall < MIN_COUNTER_WINDOW_S:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_cpu_s - before.own_cpu_s)
    return max(0.0, others / (wall * after.cpus_counted))


def crowding(share: Optional[float], cpus: Optional[int] = None, threads: Optional[int] = None) -> Optional[str]:
    """How other processes crowded work that ran on ``threads`` threads of ``cpus`` CPUs while they used ``share``
    of the CPUs (None: they did not, or nothing was counted): more than ``OTHERS_LIMIT`` of the CPUs, or, given
    ``cpus`` and ``threads``, more cores than the threads left free plus ``SPARE_SLACK_CORES``."""
    if share is None:
        return None
    if share > OTHERS_LIMIT:
        return f"other processes used {share:.0%} of {cpus or 'the'} CPUs (limit {OTHERS_LIMIT:.0%})"
    if cpus and threads:
        cores, spare = share * cpus, max(0, cpus - threads)
        if cores > spare + SPARE_SLACK_CORES:
            return (f"other processes used {cores:.2f} of a core beside its {threads} threads on {cpus} CPUs "
                    f"(limit: the {spare} cores they leave free + {SPARE_SLACK_CORES:g})")
    return None


def default_busy_reason(w: "Watch") -> Optional[str]:
    """Why the machine was busy during ``w`` (None: quiet); see the module docstring. Where the CPU-time
    counters cover the window they alone decide: they see other processes directly, while repeats spread
    without any load (the first forwards of a model just loaded touch its weights for the first time: two
    forwards of the 1.5B target at int8 spread 67% on a quiet 2-core EPYC). The spread of the repeats
    decides only where the counters cannot."""
    b, a = w.before, w.after
    if b is not None and a is not None:
        share = others_share(b, a)
        if share is not None:  # (the share of the CPUs alone; the spare-cores rule is the prediction check's)
            why = crowding(share, a.cpus_counted)
            return f"busy: {why} while it ran" if why else None
        if b.load_1min is not None and b.load_1min / max(1, b.cpus) > LOAD_LIMIT:
            return f"busy: load {b.load_1min:.1f} on {b.cpus} CPUs before it ran (limit {LOAD_LIMIT:g} per CPU)"
    for t in w.timings:
        if t.samples >= 2 and t.median_s >= MIN_SPREAD_CALL_S and t.spread > SPREAD_LIMIT:
            return (f"busy: repeats of a {t.median_s * 1e3:.3g} ms call spread {t.spread:.0%} of their median "
                    f"(limit {SPREAD_LIMIT:.0%})")
    return None


#: the busy detector every ``watch`` asks (a ``Watch`` -> the reason it was busy, or None when quiet);
#: replace it to simulate load (tests) or to switch the check off
busy_detector: Callable[["Watch"], Optional[str]] = default_busy_reason


@dataclass(frozen=True)
class Verdict:
    """Whether a measurement was taken on a quiet machine; ``reason`` says why not."""

    quiet: bool
    reason: str = ""

    @property
    def provisional(self) -> bool:
        return not self.quiet

    def to_dict(self) -> dict[str, Any]:
        return {"quiet": self.quiet, "reason": self.reason}


_local = threading.local()


def _active() -> list["Watch"]:
    stack = getattr(_local, "watches", None)
    if stack is None:
        stack = _local.watches = []
    return stack


class Watch:
    """A measurement's window: the counters before and after and the ``Timing``s made inside it (on
    this thread). Use as ``with watch() as w: ...; w.verdict()``."""

    def __init__(self, busy: Optional[Callable[["Watch"], Optional[str]]] = None):
        self.busy = busy
        self.timings: list[Timing] = []
        self.before: Optional[Sample] = None
        self.after: Optional[Sample] = None

    def __enter__(self) -> "Watch":
        _active().append(self)
        self.before = sample()
        return self

    def __exit__(self, *exc) -> None:
        self.after = sample()
        stack = _active()
        if self in stack:
            stack.remove(self)

    def verdict(self) -> Verdict:
        reason = (self.busy or busy_detector)(self)
        return Verdict(True, "") if reason is None else Verdict(False, reason)


def watch(busy: Optional[Callable[[Watch], Optional[str]]] = None) -> Watch:
    """A new ``Watch`` (``busy`` replaces ``busy_detector`` for it)."""
    return Watch(busy)


# ----------------------------------------------------------------------------------------- key
def machine_identity(device: str = "cpu", info: Optional[MachineInfo] = None) -> dict[str, Any]:
    """What decides a measurement's speed on this machine: the CPU model and flags, the CPUs this
    process may use, torch's thread count now, and for a CUDA ``device`` the GPU."""
    import torch

    mi = info or machine_info()
    ident: dict[str, Any] = {"cpu_model": mi.cpu_model, "cpu_flags": list(mi.cpu_flags), "cpus": mi.logical_cpus,
                             "torch_threads": torch.get_num_threads()}
    if str(device).startswith("cuda"):
        ident["gpu"] = mi.gpu
    return ident


def _source(obj: object) -> str:
    if isinstance(obj, Path):
        try:
            return obj.name + ":" + hashlib.sha256(obj.read_bytes()).hexdigest()
        except OSError:
            return f"missing:{obj.name}"
    if isinstance(obj, (str, bytes)):
        return obj.decode() if isinstance(obj, bytes) else obj
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return repr(obj)


@functools.lru_cache(maxsize=256)
def _cached_digest(parts: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def code_digest(code: Iterable[object]) -> str:
    """A digest of the code that produces a measurement: the source of each function, class or module,
    the bytes of each ``Path``, each string as it is (e.g. a native library's own digest)."""
    return _cached_digest(tuple(_source(c) for c in code))


@dataclass(frozen=True)
class MeasureKey:
    """One cached measurement's key: ``fields`` (what, machine, versions, code, extra), their
    ``digest`` and the file they name."""

    what: str
    fields: dict[str, Any] = field(hash=False)
    digest: str
    prefix: str = ""

    @property
    def path(self) -> Path:
        return cache_root() / self.what / f"{self.prefix}{self.digest}.json"


def measure_key(what: str, *, device: str = "cpu", code: Iterable[object] = (), extra: Optional[Mapping[str, Any]] = None,
                versions: Optional[Mapping[str, str]] = None, info: Optional[MachineInfo] = None,
                prefix: str = "") -> MeasureKey:
    """The key of measurement ``what`` (also its folder under the cache root) on ``device`` of this
    machine (``info`` replaces ``machine_info()``), produced by ``code``; ``extra``: the caller's own
    fields (pair, version number, ...); ``versions``: libraries beyond torch that matter."""
    import torch

    fields = {"what": what, "machine": machine_identity(device, info),
              "versions": {"torch": torch.__version__, **dict(versions or {})}, "code": code_digest(code),
              "extra": dict(extra or {})}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return MeasureKey(what, json.loads(json.dumps(fields, default=str)), digest, prefix)


# --------------------------------------------------------------------------------------- store
def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically: into a temporary file beside it, then
    ``os.replace``; when anything raises, the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def load(key: MeasureKey, strict: bool = False) -> Optional[Any]:
    """The value stored under ``key``, or None (no file, another key's file, or unreadable; ``strict``
    raises ``ValueError`` for an unreadable file instead)."""
    path = key.path
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        if strict:
            raise ValueError(f"{path}: unreadable ({e})") from e
        return None
    if data.get("key") != key.fields or "value" not in data:
        return None
    return data["value"]


def store(key: MeasureKey, value: Any, verdict: Verdict) -> bool:
    """Write ``value`` under ``key`` when ``verdict`` is quiet; a busy measurement is not written.
    Returns whether it was written."""
    if not verdict.quiet:
        return False
    write_json(key.path, {"key": key.fields, "digest": key.digest, "verdict": verdict.to_dict(),
                          "written": time.strftime("%Y-%m-%d %H:%M:%S"), "value": value})
    return True


@dataclass(frozen=True)
class Measured(Generic[T]):
    """A value and how it was obtained: read from the cache (``cached``), or measured now on a quiet
    machine (stored), or measured on a busy one (``provisional``, not stored; ``reason`` says why)."""

    value: T
    quiet: bool
    reason: str
    cached: bool
    key: MeasureKey

    @property
    def provisional(self) -> bool:
        return not self.quiet


def measure_once(key: MeasureKey, measure: Callable[[], T], *, encode: Callable[[T], Any] = lambda v: v,
                 decode: Callable[[Any], T] = lambda v: v, busy: Optional[Callable[[Watch], Optional[str]]] = None,
                 refresh: bool = False) -> Measured[T]:
    """The value cached under ``key``, or ``measure()`` now inside a ``watch``: stored when the
    machine was quiet, else returned provisional and not stored. ``refresh`` measures anyway."""
    if not refresh:
        got = load(key)
        if got is not None:
            return Measured(decode(got), True, "", True, key)
    with watch(busy) as w:
        value = measure()
    verdict = w.verdict()
    store(key, encode(value), verdict)
    return Measured(value, verdict.quiet, verdict.reason, False, key)
