"""runtime/deadlines.py: the server's connection deadlines on one thread."""
from __future__ import annotations

import threading
import time

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
