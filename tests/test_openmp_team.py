"""OpenMP worker threads are released by whoever started them: a thread's turn on the models (``ModelLock``) and
a Gradio handler (``Controller.bound``) leave none behind (``dyntree_core.openmp_team``)."""

from __future__ import annotations

import threading

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


def threads_on(work) -> tuple[int, int, int]:
    """The process's thread count before, during (right after ``work()`` ran) and after ``work`` on a fresh
    thread; ``work(during)`` receives a callback that records the count."""
    counts: dict[str, int] = {}

    def body() -> None:
        counts["before"] = process_threads()
        work(lambda: counts.setdefault("during", process_threads()))
        counts["after"] = process_threads()

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
    assert during >= before + TEAM - 1  # the team started, and stayed after its regions
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
    assert during > before
    assert after == before


def test_a_gradio_handler_leaves_no_openmp_workers_behind() -> None:
    from ui.controller import Controller

    ctl = Controller.__new__(Controller)  # (only ``bound`` and its session registry are used)
    from ui.session import SessionRegistry

    ctl.sessions = SessionRegistry()
    seen: list[int] = []

    def draw(state, n):
        parallel_work()
        seen.append(process_threads())
        return n

    def stream(state, n):
        parallel_work()
        seen.append(process_threads())
        yield n

    class Request:
        session_hash = "tab"

    def work(during) -> None:
        assert ctl.bound(draw)(Request(), 3) == 3
        assert list(ctl.bound(stream)(Request(), 4)) == [4]
        during()

    before, _, after = threads_on(work)
    assert all(n > before for n in seen)
    assert after == before
