"""ModelLock's turns: sessions first come, first served; background work only in idle moments."""

import threading
import time

from ui.model_lock import ModelLock


def test_background_turns_follow_each_other_without_the_idle_wait():
    lock = ModelLock()
    time.sleep(0.3)
    t0 = time.monotonic()
    for _ in range(5):
        with lock.idle_turn("background", idle_s=0.25):
            pass
    assert time.monotonic() - t0 < 0.2 + 0.25  # before: each turn waited 0.25 s after the previous one (>= 1.25 s)


def test_a_sessions_turn_restarts_the_idle_clock():
    lock = ModelLock()
    with lock.turn("session 1: step"):
        pass
    t0 = time.monotonic()
    with lock.idle_turn("background", idle_s=0.5):
        waited = time.monotonic() - t0
    assert waited >= 0.45


def test_a_waiting_session_goes_before_the_next_background_turn():
    lock = ModelLock()
    order = []
    session_waiting = threading.Event()

    def session():
        session_waiting.set()
        with lock.turn("session 1: step"):
            order.append("session")

    time.sleep(0.05)
    with lock.idle_turn("background", idle_s=0.01):
        order.append("background 1")
        worker = threading.Thread(target=session)
        worker.start()
        session_waiting.wait(5)
        while not lock.waiting:
            time.sleep(0.001)
    with lock.idle_turn("background", idle_s=0.3):
        order.append("background 2")
    worker.join(5)
    assert order == ["background 1", "session", "background 2"]


def test_a_turn_waited_for_with_a_timeout_gives_up_and_leaves_the_queue_in_order():
    """``Controller.close``'s last turn on the models waits at most its timeout: a step that never ends must not hang
    the app's exit. The caller that gave up leaves the queue, and the one behind it is served next."""
    lock = ModelLock()
    lock.acquire("a step that hangs")
    order = []
    behind = threading.Thread(target=lambda: (lock.acquire("session 2"), order.append("session 2"), lock.release()))
    t0 = time.monotonic()
    giving_up = threading.Thread(target=lambda: order.append(lock.acquire("the app shutting down", timeout_s=0.3)))
    giving_up.start()
    while not lock.waiting:
        time.sleep(0.001)
    behind.start()
    giving_up.join(5)
    assert order == [None] and 0.25 <= time.monotonic() - t0 < 2.0 and lock.waiting == 1
    lock.release()
    behind.join(5)
    assert order == [None, "session 2"] and lock.waiting == 0
    assert lock.acquire("free", timeout_s=0.1) is not None  # (a free lock is taken at once)
    lock.release()


def test_close_gives_up_on_a_turn_that_never_comes(tmp_path, monkeypatch):
    from ui.controller import Controller
    from ui.tiny import TinyModelProvider

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    ctl = Controller(TinyModelProvider(), None, [], stream_interval_s=0.5)
    ctl.model_lock.acquire("a step that hangs")
    t0 = time.monotonic()
    assert ctl.close(timeout_s=0.3) is False and time.monotonic() - t0 < 2.0
    ctl.model_lock.release()
