"""``auto``'s measurements in the background: the first Run on a machine never waits for them.

Before ``auto`` can choose, it needs this machine's profile (forward times per model, precision and
size) and the pair's acceptance; both are cached, and measuring them took minutes on a 2-core CPU.
``BackgroundPlanner`` measures them on a thread, timing each forward in an *idle* turn on the models
all sessions share (``ModelLock.idle_turn``: never while a session decodes, so nothing it times is
slowed by a run), while runs go on with ``auto``'s provisional plan (plain decoding at the smallest
weights). The next Run after it finishes uses the measured plan.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

from dyntree_core.interrupt import LoadStopped, stops_loads_on
from dyntree_core.process_memory import release_freed_memory

from .app_log import background_line
from .model_lock import ModelLock, TurnCancelled

#: ``measure(turn, progress)``: runs ``plan_auto`` with measuring allowed
Measure = Callable[[Callable[[], Any], Callable[[str], None]], Any]


class BackgroundPlanner:
    """One measuring thread at a time per key; ``close()`` stops and joins it."""

    def __init__(self, lock: ModelLock, idle_s: float = 1.0) -> None:
        self._lock = lock
        self._idle_s = idle_s
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._key: Optional[Hashable] = None
        self.progress = ""  # the latest line of the running measurement
        self.failed: dict[Hashable, str] = {}  # key -> why its last measurement failed
        self.not_stored: dict[Hashable, str] = {}  # key -> why its last measurement was not stored (busy)
        #: key -> [(the cached measurements' version, the plan made from them)]: one per spell of the memory's
        #: bandwidth a plan was asked in (``planning.auto.priced_for_spell``)
        self.plans: dict[Hashable, list[tuple]] = {}

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> str:
        """One line for the page: what is being measured, or why the last measurement was not stored."""
        if self.busy:
            return f"measuring this machine for auto in idle moments: {self.progress or 'starting'}"
        if self._key in self.not_stored:
            return (f"auto's last measurement was not stored ({self.not_stored[self._key]}); the next Run "
                    "measures again")
        return ""

    def start(self, key: Hashable, measure: Measure, plans_for: Optional[Hashable] = None) -> bool:
        """Start measuring ``key`` unless something is being measured already; True if started. ``plans_for``: the
        request (``plan_auto_for_app``'s key) whose plan ``measure`` returns: kept for it once the measurements are
        stored (``remember``), so the next Run does not price it again beside whatever runs then."""
        with self._guard:
            if self.busy or self._stop.is_set():
                return False
            self._key, self.progress = key, ""
            self.failed.pop(key, None)
            self.not_stored.pop(key, None)
            self._thread = threading.Thread(target=self._run, args=(key, measure, plans_for), name="dyntree-auto-measure",
                                            daemon=True)
            self._thread.start()
            return True

    def remember(self, key: Hashable, plan: Any, version: Optional[tuple] = None) -> None:
        """Keep ``plan`` for request ``key``, made from the measurements at ``version`` (default: as they are now,
        ``measurements_version``); plans kept from other versions go."""
        version = measurements_version() if version is None else version
        self.plans[key] = [m for m in self.plans.get(key, ()) if m[0] == version] + [(version, plan)]

    def _run(self, key: Hashable, measure: Measure, plans_for: Optional[Hashable] = None) -> None:
        def turn():
            return self._lock.idle_turn("measuring the machine for auto", self._idle_s, self._stop)

        def say(line: str) -> None:
            if line.strip() != self.progress:
                background_line(line)
            self.progress = line.strip()
            if "not stored" in line:  # (``profiling``: "the profile is provisional, not stored: <why>")
                why = self.progress.rpartition("not stored")[2].strip().lstrip(":").strip()
                self.not_stored[key] = why[1:-1] if why.startswith("(") and why.endswith(")") else why

        try:
            with stops_loads_on(self._stop):  # (``close`` ends a model load it is in at the load's next tensor)
                plan = measure(turn, say)
            if plans_for is not None and plan is not None and key not in self.not_stored:
                self.remember(plans_for, plan)
        except (TurnCancelled, LoadStopped):
            pass
        except Exception as e:  # noqa: BLE001 - shown on the page; auto keeps its provisional plan
            self.failed[key] = f"{type(e).__name__}: {e}"
        finally:
            release_freed_memory()  # the models it loaded are gone: their pages go back to the OS

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop the measurement at its next turn and wait for the thread; True once it is gone."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True


def measurements_version() -> tuple:
    """Names and modification times of the cached profiles and acceptances: a plan made from them stands
    until one changes (pricing takes 0.25-1.2 s of CPU on the 2-core Zen 4 VM, and the app must not show two
    predictions for one request on one profile)."""
    from dyntree_core.paths import cache_root

    folder = cache_root() / "profiles"
    try:
        return tuple(sorted((f.name, f.stat().st_mtime_ns) for f in folder.iterdir() if f.suffix == ".json"))
    except OSError:
        return ()


def plan_auto_for_app(planner: Optional[BackgroundPlanner], key: Hashable, target_precisions, draft_precisions,
                      cached: Callable[[], Any], measure: Measure, foreground: Callable[[], Any],
                      read_gb_per_s: Optional[float] = None) -> Any:
    """``auto``'s plan for a Run: ``cached()`` when everything it needs is measured (made once per ``key`` and
    spell while the measurements stay as they are: ``measurements_version``); else, with a ``planner``, the
    provisional plan while ``measure`` runs in the background (without one, ``foreground()`` measures
    first, as the CLI does). ``read_gb_per_s``: the memory's read bandwidth probed for this Run; where its spell
    has no profile yet, the nearest spell's prices the plan (it says so) and ``measure`` measures this spell's
    in the background (the three callables price and measure at that probe)."""
    from dyntree_core.planning.auto import priced_for_spell
    from dyntree_core.planning.provisional import provisional_plan
    from dyntree_core.planning.machine_profile import NotMeasuredYet

    if planner is None:
        return foreground()
    version = measurements_version()
    made = [m for m in planner.plans.get(key, ()) if m[0] == version]
    for _, plan in made:
        if priced_for_spell(plan, read_gb_per_s):
            return plan  # the same request on the same measurements in the same spell: the same plan (and prediction)
    try:
        plan = cached()
        planner.remember(key, plan, version)
        if getattr(getattr(plan, "profile", None), "other_spell", None):
            planner.start((key, "spell"), measure, plans_for=key)
        return plan
    except NotMeasuredYet as e:
        missing = e
    failed = planner.failed.get(key)
    refused = planner.not_stored.get(key)
    started = planner.start(key, measure, plans_for=key)
    if started or planner.busy:
        why = "it is being measured in idle moments (progress in the footer); a Run after that uses the measured plan"
    else:
        why = "another measurement is running; press Run again once it is done"
    if failed:
        why = f"the last measurement failed ({failed}); {why}"
    elif refused:
        why = f"the last measurement was not stored ({refused}); {why}"
    return provisional_plan(target_precisions, draft_precisions, why, missing)
