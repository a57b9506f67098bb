"""The OpenMP worker threads a thread keeps after it ran torch's or the native kernels' parallel code.

The OpenMP runtime torch loads (GNU libgomp on Linux) gives every thread that starts a parallel region a team of
worker threads of its own and keeps it until that thread exits. Once the process holds more such threads than
there are CPUs, libgomp stops spinning at the barriers that end each region (it spins 100 times, then sleeps in
the kernel), in every team: each of the hundreds of regions of a forward then costs two context switches.
Measured on the 2-core AVX2 EPYC (int4 target, one token after 128): 55 ms and 2 context switches per forward on
one thread, 70-82 ms and ~335 on a second thread while the first one's team lived, 54 ms and 2 once the first
thread had released it (``scripts/openmp_teams.py``).

So a thread whose turn on the models ends releases its team (``release_thread_team``): the app's handler
threads, its background measurer and each run's worker take turns on one set of models, and only the thread
holding the turn keeps workers. Starting a team again costs ~0.15 ms, against a 50 ms forward.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Optional

#: ``omp_pause_soft`` (OpenMP 5.0): the runtime's threads stop and its resources go; the next region restarts them
OMP_PAUSE_SOFT = 1
#: the OpenMP runtimes torch's wheels link, by the names their shared objects are loaded under
RUNTIMES = ("libgomp", "libomp", "libiomp5")


_found: Optional[ctypes.CDLL | bool] = None  # the runtime; False once torch is loaded and none can pause


def _runtime() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime already loaded into this process that can release a thread's team (None if none; until
    torch is imported it is asked again, since torch loads one)."""
    global _found
    if _found is not None:
        return _found or None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # (not Linux: nothing to find this way)
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.strip() else ""
        name = os.path.basename(path)
        if any(name.startswith(lib + ".") or name.startswith(lib + "-") for lib in RUNTIMES):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                _found = lib
                return lib
    if "torch" in sys.modules:
        _found = False
    return None


def release_thread_team() -> bool:
    """Stop the OpenMP worker threads the calling thread keeps; True if the runtime did so (False where no
    OpenMP runtime is loaded, or inside a parallel region). The thread's next parallel region starts a new team."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def process_threads() -> int:
    """How many threads this process has now (0 where ``/proc`` is not there)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def voluntary_switches() -> int:
    """Context switches this process's threads made by waiting, so far (0 where ``/proc`` is not there)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            for line in Path(f"/proc/self/task/{task}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:  # (a thread that ended meanwhile)
            pass
    return total
