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
