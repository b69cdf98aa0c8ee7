"""The scheduler's lifecycle across the process: what becomes of its worker thread and requests when the program ends.

Each test runs a short script in a fresh interpreter on the tiny artifact, since what is checked is the exit itself.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tests.conftest import REPO

# The program ends (its last line, or Ctrl-C's KeyboardInterrupt) while the worker thread is inside a request: every
# graph run waits until the exit has begun. The handler registered first runs last, after the runtime's own, and says
# what the request had become by then; the one registered last runs first and lets the graph runs go on.
EXIT_WHILE_SERVING = """
    import atexit, os, signal, sys, threading

    def report():
        print("at exit:", repr(handle.exception(timeout=0)) if handle.done() else "running", flush=True)
        try:  # a daemon thread's late submit (a done-callback resubmitting): no worker may start in the teardown
            engine.submit([1, 7], max_new_tokens=2)
            print("late submit: started", flush=True)
        except Exception as error:
            print("late submit:", repr(error), flush=True)

    atexit.register(report)
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    scheduler = engine.start_scheduler(slots=2)
    run, running, exiting = scheduler.cache.run, threading.Event(), threading.Event()

    def held_run(*args):
        running.set()
        exiting.wait(60)
        return run(*args)

    scheduler.cache.run = held_run
    handle = engine.submit([1] + [7] * 60, max_new_tokens=60, stop_token_ids=())
    assert running.wait(30)
    atexit.register(exiting.set)
    if sys.argv[2] == "ctrl-c":
        os.kill(os.getpid(), signal.SIGINT)
        handle.result()  # interrupted
"""


def test_a_program_that_ends_while_the_scheduler_serves_stops_its_worker_and_exits_cleanly(tiny_artifact):
    """The worker is a daemon thread, so it did not hold the process; but the interpreter then tore down onnxruntime
    under a graph run still going on in it, and the process aborted ("terminate called without an active
    exception", SIGABRT, exit status 134) instead of exiting: a script that ended, or was stopped with Ctrl-C
    (engine.generate([...]) interrupted), while its requests ran. Now the worker stops after the step under way, and
    the requests it held fail as at close()."""
    for how, status in (("end", 0), ("ctrl-c", -signal.SIGINT)):  # Python ends by SIGINT after the traceback
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_WHILE_SERVING), str(tiny_artifact), how],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert "at exit: RequestError('the scheduler was closed before this request finished')" in done.stdout, (
            how, done.stdout, done.stderr[-2000:])
        assert "late submit: RequestError('the program is exiting: no request starts now')" in done.stdout, (
            how, done.stdout)
        assert done.returncode == status and "terminate called" not in done.stderr, (how, done.stderr[-2000:])
        assert ("KeyboardInterrupt" in done.stderr) == (how == "ctrl-c")
