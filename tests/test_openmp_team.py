"""OpenMP worker threads are released by whoever started them: a thread's turn on the models (``ModelLock``) and
a Gradio handler (``Controller.bound``) leave none behind (``dyntree_core.openmp_team``).

The counts are of one probe thread's own team: the probe takes a name no other thread has and its OpenMP workers
inherit it (Linux copies a thread's name to the threads it creates), so threads that other tests left in this
process starting or ending meanwhile do not move them (counting the whole process did: a CI run once saw the
same count during a team as before it)."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time

import pytest
import torch

from dyntree_core.openmp_team import _runtime, process_threads, release_thread_team
from conftest import torch_threads
from ui.model_lock import ModelLock

pytestmark = pytest.mark.skipif(_runtime() is None or process_threads() == 0,
                                reason="needs an OpenMP runtime that can pause, and /proc")

TEAM = 2  # torch's threads inside these tests (a pytest-xdist worker on 2 CPUs has 1: no team to start)


@pytest.fixture(autouse=True)
def two_threads():
    with torch_threads(TEAM):
        yield


def parallel_work() -> None:
    """torch ops large enough to run as parallel regions (a team of ``TEAM`` threads)."""
    x = torch.ones(1 << 22)
    for _ in range(3):
        x.add_(1.0)


_PR_SET_NAME = 15
_probes = itertools.count()


def own_team() -> int:
    """Threads of this process named as the calling thread: itself and the OpenMP workers it started."""
    try:
        name = open("/proc/thread-self/comm").read()
    except OSError:
        return 0
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read() == name
        except OSError:  # (a thread that ended meanwhile)
            pass
    return n


def settled_team(seconds: float = 5.0) -> int:
    """``own_team()`` once the released workers have exited: a release tells them to exit and returns after
    they leave its barrier, before the kernel has removed them (a CI run counted one still there), so this
    waits until only the calling thread is left or ``seconds`` pass; a release that did nothing keeps the
    workers, and the count stays above 1."""
    deadline = time.monotonic() + seconds
    while (n := own_team()) > 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    return n


def threads_on(work) -> tuple[int, int, int]:
    """The probe thread's team (``own_team``) before, during (right after ``work()`` ran) and after ``work`` on a
    fresh, uniquely named thread; ``work(during)`` receives a callback that records the count."""
    counts: dict[str, int] = {}
    name = f"omp-probe-{next(_probes)}".encode()  # (at most 15 bytes)

    def body() -> None:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name, 0, 0, 0)
        counts["before"] = own_team()
        work(lambda: counts.setdefault("during", own_team()))
        counts["after"] = settled_team()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return counts["before"], counts["during"], counts["after"]


def test_a_thread_keeps_its_openmp_workers_until_it_releases_them() -> None:
    def work(during) -> None:
        parallel_work()
        during()
        assert release_thread_team()

    before, during, after = threads_on(work)
    assert before == 1 and during == before + TEAM - 1  # the team started, and stayed after its regions
    assert after == before


def test_a_turn_on_the_models_leaves_no_openmp_workers_behind() -> None:
    lock = ModelLock()

    def in_turns(during) -> None:
        with lock.turn("a step"):
            parallel_work()
            during()
        with lock:
            parallel_work()
        with lock.idle_turn("background", idle_s=0.0):
            parallel_work()

    before, during, after = threads_on(in_turns)
    assert before == 1 and during == before + TEAM - 1
    assert after == before


def test_a_gradio_handler_leaves_no_openmp_workers_behind() -> None:
    from ui.controller import Controller

    ctl = Controller.__new__(Controller)  # (only ``bound`` and its session registry are used)
    from ui.session import SessionRegistry

    ctl.sessions = SessionRegistry()
    seen: list[int] = []

    def draw(state, n):
        parallel_work()
        seen.append(own_team())
        return n

    def stream(state, n):
        parallel_work()
        seen.append(own_team())
        yield n

    class Request:
        session_hash = "tab"

    def work(during) -> None:
        assert ctl.bound(draw)(Request(), 3) == 3
        assert list(ctl.bound(stream)(Request(), 4)) == [4]
        during()

    before, _, after = threads_on(work)
    assert before == 1 and seen == [before + TEAM - 1] * 2
    assert after == before
