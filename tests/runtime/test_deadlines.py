"""runtime/deadlines.py: the server's connection deadlines on one thread."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from runtime.deadlines import Deadlines


def test_deadlines_fire_in_time_order_and_cancelled_ones_never():
    deadlines, fired, done = Deadlines(), [], threading.Event()
    deadlines.add(0.3, lambda: (fired.append("late"), done.set()))
    cancelled = deadlines.add(0.1, lambda: fired.append("cancelled"))
    deadlines.add(0.2, lambda: fired.append("early"))
    deadlines.add(0.15, lambda: 1 / 0)  # a failing action: the later deadlines still fire
    deadlines.cancel(cancelled)
    assert done.wait(10) and fired == ["early", "late"] and deadlines.pending() == 0


def test_a_deadline_added_while_the_thread_waits_for_a_later_one_fires_first():
    deadlines, fired = Deadlines(), []
    deadlines.add(30.0, lambda: fired.append("later"))
    time.sleep(0.05)  # its thread now waits for the 30 s one
    started, done = time.monotonic(), threading.Event()
    deadlines.add(0.05, done.set)
    assert done.wait(10) and time.monotonic() - started < 5 and fired == [] and deadlines.pending() == 1


def test_a_cancelled_deadline_lets_go_of_its_action_behind_a_later_one():
    """cancel() only forgot the token: the heap kept the action (a handler's bound method) until every earlier entry
    came up, so one idle connection's minute pinned every later connection's handler (3 KB each)."""
    import gc
    import weakref

    class Handler:
        def cut(self):
            pass

    deadlines = Deadlines()
    deadlines.add(60.0, lambda: None)  # the idle connection's
    handlers = [Handler() for _ in range(500)]
    for handler in handlers:
        deadlines.cancel(deadlines.add(30.0, handler.cut))
    alive = [weakref.ref(handler) for handler in handlers]
    del handlers, handler
    gc.collect()
    assert not any(ref() for ref in alive) and deadlines.pending() == 1 and len(deadlines._heap) < 200


def test_a_deadline_this_process_slept_through_is_put_off_once(monkeypatch):
    """A 70 s SIGSTOP: every deadline came due at once on SIGCONT, and the deadline thread cut connections whose
    bytes had all arrived meanwhile, before their own threads read them (a 408 saying the body never came)."""
    import runtime.deadlines as deadlines_module

    stopped = [0.0]  # seconds the process "was stopped": the monotonic clock went on meanwhile
    monkeypatch.setattr(deadlines_module, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + stopped[0]))
    deadlines, fired = Deadlines(), threading.Event()
    start = time.perf_counter()
    deadlines.add(0.2, fired.set)
    stopped[0] = 70.0  # resumed: 70 s later by the clock, before the thread's wait for 0.2 s ended
    assert not fired.wait(0.2 + deadlines_module.LATE_S / 2)
    assert fired.wait(5) and time.perf_counter() - start >= deadlines_module.LATE_S
