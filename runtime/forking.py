"""os.fork() and onnxruntime: what a pre-fork server (gunicorn's preload_app, multiprocessing's default start method on
Linux) needs from an engine loaded in the parent.

- `RUNS`, a gate that every graph run and every load inside onnxruntime passes through: a fork waits for those under
  way and starts none until it returns. A child forked while another thread was inside a run inherited onnxruntime's
  mutex held by a thread the child does not have, and its own generate hung there (3 runs of 500 forks, a child hung
  in each); one forked during another thread's Engine.load hung in its own load.
- `keep_forever`: the child never frees the sessions it inherited. Their thread pools' condition variables still list
  the parent's threads as waiting, and freeing them hung the child's exit in pthread_cond_destroy (onnxruntime
  PR #31961): every worker of a warmed-up engine that left with sys.exit never ended. Their memory is the parent's,
  shared copy-on-write.
- Those pools' threads do not survive the fork: an inherited session runs its graphs on the calling thread alone
  (onnxruntime issue #9800). The child's first run says so, once (`note_threads_lost`).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import warnings

from runtime.errors import AotlmWarning

FORK_WAIT_S = 60.0  # how long a fork waits for the runs under way; then it goes on (a child may hang, as before)


class RunGate:
    """Runs hold a share: `running` counts them, under `lock`, and none starts while `forking`. `before_fork` waits
    for those under way and holds new ones back until `after_fork_in_parent`. A graph run takes its share inline
    (runtime/onnxruntime_backend.py, run_bound): between the count and the run's try, and in its finally, no Python
    function is called, where a KeyboardInterrupt could land (at a call's entry) and leave the count up, or a
    Python-level lock (threading.Condition's, Event's) held, which every later run then waited on. Loads take theirs
    through `share()`."""

    POLL_S = 0.001

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.forking = False
        self.held = threading.local()  # shares this thread holds through share(): a fork from it does not wait for them

    def enter(self) -> None:
        """Count a run in, once no fork waits; the caller's try must follow at once, its finally decrement."""
        while True:
            with self.lock:
                if not self.forking:
                    self.running += 1
                    return
            time.sleep(self.POLL_S)  # a fork waits for the runs under way: this one starts after it

    @contextlib.contextmanager
    def share(self):
        self.enter()
        self.held.count = getattr(self.held, "count", 0) + 1
        try:
            yield
        finally:
            self.held.count -= 1
            with self.lock:
                self.running -= 1

    def before_fork(self) -> None:
        """Waits for the other threads' runs: a fork from inside this thread's own load (a signal handler's) waited
        for itself, FORK_WAIT_S."""
        with self.lock:
            self.forking = True
        own = getattr(self.held, "count", 0)
        deadline = time.monotonic() + FORK_WAIT_S
        while self.running > own and time.monotonic() < deadline:
            time.sleep(self.POLL_S)

    def after_fork_in_parent(self) -> None:
        with self.lock:
            self.forking = False


RUNS = RunGate()  # a forked child makes its own: read it as forking.RUNS
_threads_lost_notice: str | None = None  # set in a forked child whose inherited sessions had thread pools
_inherited_pools: set[int] = set()  # the ids of those sessions (their wrappers': onnxruntime.InferenceSession)


def _start_over_in_child() -> None:
    """The child's gate starts free: no run of the parent's threads goes on here, and none waits."""
    global RUNS
    RUNS = RunGate()


def keep_forever(sessions) -> None:
    """Never free these (a forked child's inherited sessions): see the module docstring."""
    for session in sessions:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(session))


def note_threads_lost(session, threads: int) -> None:
    """In a forked child: an inherited session that had `threads` intra-op threads, which the child does not have."""
    global _threads_lost_notice
    if threads != 1:
        _inherited_pools.add(id(session))  # kept for ever (keep_forever): its id is never another's
        _threads_lost_notice = (
            "this process was forked after its Engine loaded: onnxruntime's threads did not survive the fork, so "
            "the inherited engine runs its graphs on one thread; for all of them, load the engine in each worker "
            "(gunicorn's post_fork hook, a multiprocessing Pool's initializer) instead of before the fork")


def say_threads_lost(session) -> None:
    """The notice of note_threads_lost, at an inherited session's first run in the child, once (an engine the
    child loads itself has its threads)."""
    global _threads_lost_notice
    if _threads_lost_notice and id(session) in _inherited_pools:
        notice, _threads_lost_notice = _threads_lost_notice, None
        warnings.warn(notice, AotlmWarning, stacklevel=3)


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(before=lambda: RUNS.before_fork(), after_in_parent=lambda: RUNS.after_fork_in_parent(),
                        after_in_child=_start_over_in_child)
