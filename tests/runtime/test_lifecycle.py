"""The scheduler's lifecycle across the process: what becomes of its worker thread and requests when the program ends.

Each test runs a short script in a fresh interpreter on the tiny artifact, since what is checked is the exit itself.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap

import pytest

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
    handle = engine.submit([1] + [7] * 60, max_new_tokens=60, ignore_eos=True)
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


# A daemon thread (as ThreadingHTTPServer's handlers are) generating on the batch-1 cache, graph run after graph run,
# when the program ends.
EXIT_WHILE_GENERATING = """
    import sys, threading, time
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    started = threading.Event()

    def loop():
        while True:
            for _ in engine.stream([5, 6, 7], max_new_tokens=100, ignore_eos=True):
                started.set()

    threading.Thread(target=loop, daemon=True).start()
    assert started.wait(30)
    time.sleep(0.2)
    print("ending", flush=True)
"""


def test_a_program_that_ends_while_a_daemon_thread_generates_exits_cleanly(tiny_artifact):
    """_close_at_exit stopped schedulers only: a daemon thread's generate on the batch-1 cache was inside onnxruntime
    as the interpreter tore it down, and the process aborted (SIGABRT, "terminate called without an active
    exception"), 15 runs of 15. Now the exit waits for the step under way and no other starts."""
    for _ in range(3):
        done = run_script(EXIT_WHILE_GENERATING, tiny_artifact)
        assert done.returncode == 0 and done.stdout == "ending\n", (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


# A daemon thread loading engines (a server that loads its model in the background while /health says so) when the
# program ends.
EXIT_WHILE_LOADING = """
    import sys, threading, time
    from runtime import Engine

    started = threading.Event()

    def loop():
        while True:
            started.set()
            Engine.load(sys.argv[1], huge_pages=False)

    threading.Thread(target=loop, daemon=True).start()
    assert started.wait(30)
    time.sleep(float(sys.argv[2]))
    print("ending", flush=True)
"""


def test_a_program_that_ends_while_a_daemon_thread_loads_an_engine_exits_cleanly(tiny_artifact):
    """The exit waited for graph runs, not loads: onnxruntime building sessions as the interpreter tore it down
    aborted the process (SIGABRT; 4 of 8 runs of this script on the tiny model before the exit waited for loads)."""
    for wait in (0.05, 0.2, 0.3, 0.7):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_WHILE_LOADING), str(tiny_artifact),
                               str(wait)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == "ending\n", (wait, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def run_script(script: str, artifact) -> subprocess.CompletedProcess:
    """`script` (indented, as the constants here are) in a fresh interpreter, the artifact as its argument."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(artifact)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


# The process may allocate 512 MiB more (RLIMIT_AS, as `ulimit -v` or `prlimit --as` set it), far less than the machine
# has available; 16384 of the tiny model's 64 KiB slots need 1 GiB.
SLOTS_PAST_THE_ADDRESS_SPACE_LIMIT = """
    import resource, sys
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + 768 * 2**20, resource.RLIM_INFINITY))  # 384 MiB kept for work
    try:
        engine.start_scheduler(slots=16384)
    except Exception as error:
        print(f"{type(error).__name__}: {error}", flush=True)
        most = int(str(error).split("use at most ")[1].split(",")[0])
    # a restart with the same slots: the running scheduler's cache, freed first, counts as room
    for attempt in (1, 2):
        engine.start_scheduler(slots=most * 2 // 3)
        print("started", attempt, flush=True)
    print("serves on:", engine.generate([[1, 5, 9]], max_new_tokens=3)[0].finish_reason, flush=True)
"""


def test_slots_past_the_process_memory_limit_are_refused_at_start_saying_what_fits(tiny_artifact):
    """Under a process address-space limit the check read only the machine's MemAvailable: the slot cache's
    allocation then failed inside numpy ("MemoryError: Unable to allocate 256. MiB for an array with shape (16384,
    2, 128, 16)": one layer's array, not the slots, their bytes or what fits; `aotlm serve` printed it as a
    traceback). The limit counts now, and the engine serves on."""
    done = run_script(SLOTS_PAST_THE_ADDRESS_SPACE_LIMIT, tiny_artifact)
    said = re.search(r"RequestError: slots: 16384 sequences need 1\.0 GiB of KV cache \(64\.0 KiB each\), and this "
                     r"process can allocate (\d+\.\d) MiB now beside 384\.0 MiB for onnxruntime's own work; use at "
                     r"most (\d+)", done.stdout)
    assert said, (done.stdout, done.stderr)
    available_mib, most = float(said.group(1)), int(said.group(2))
    assert available_mib <= 768 - 384 and most * 64 / 1024 <= available_mib + 0.1  # advice that fits (a mutation audit)
    assert "started 1" in done.stdout and "started 2" in done.stdout, done.stderr[-2000:]
    assert "serves on: length" in done.stdout, done.stderr[-2000:]


# A pre-fork server (gunicorn with preload_app) warms the engine up and forks while the scheduler's worker is alive
# (idle_exit_s=math.inf keeps it so; the default 1 s idle life makes it a race).
FORK_WHILE_THE_WORKER_LIVES = """
    import math, os, sys
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    engine.start_scheduler(slots=2, idle_exit_s=math.inf)
    expected = engine.submit([1, 5, 9], max_new_tokens=4, ignore_eos=True).result().token_ids
    pid = os.fork()
    if pid == 0:
        try:
            got = engine.submit([1, 5, 9], max_new_tokens=4, ignore_eos=True).result(timeout=20).token_ids
            print("child:", "same tokens" if got == expected else got, flush=True)
        except BaseException as error:
            print("child:", repr(error), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("parent:", "same tokens" if engine.submit([1, 5, 9], max_new_tokens=4, ignore_eos=True).result(
        timeout=20).token_ids == expected else "other tokens", flush=True)
    engine.close()
"""


# A thread streams on the batch-1 cache (holding its lock) when the main thread forks.
FORK_WHILE_A_STREAM_RUNS = """
    import os, signal, sys, threading, time
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    expected = engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids
    started, forked = threading.Event(), threading.Event()

    def stream():
        for piece in engine.stream([1, 5, 9], max_new_tokens=6, ignore_eos=True):
            started.set()
            forked.wait()

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    started.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a held lock: the child's generate waits forever
        got = engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids
        print("child:", "same tokens" if got == expected else got, flush=True)
        os._exit(0)
    forked.set()
    os.waitpid(pid, 0)
    streaming.join()
    print("parent:", "same tokens" if engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids
          == expected else "other tokens", flush=True)
"""


@pytest.mark.parametrize("script", [FORK_WHILE_THE_WORKER_LIVES, FORK_WHILE_A_STREAM_RUNS],
                         ids=["scheduler-worker", "batch-one-stream"])
def test_a_child_forked_while_another_thread_serves_serves_too(tiny_artifact, script):
    """A forked child has only the thread that forked. Its copy of the scheduler named the parent's worker thread,
    so no worker started and its requests waited forever (TimeoutError); it inherited the batch-1 lock held by the
    parent's streaming thread, and its generate waited forever (killed by the alarm)."""
    done = run_script(script, tiny_artifact)
    assert "child: same tokens" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "parent: same tokens" in done.stdout, (done.stdout, done.stderr[-2000:])


# The main thread itself is iterating a stream when it forks: the child goes on with it.
FORK_IN_THE_MIDDLE_OF_ITS_OWN_STREAM = """
    import os, sys
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    expected = engine.generate([1, 5, 9], max_new_tokens=4, ignore_eos=True).token_ids
    stream = engine.stream([1, 5, 9], max_new_tokens=4, ignore_eos=True)
    next(stream)
    pid = os.fork()
    if pid == 0:
        for piece in stream:
            pass
        print("child:", "same tokens" if stream.result.token_ids == expected else stream.result.token_ids, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    stream.close()
"""


def test_a_child_forked_in_the_middle_of_its_own_stream_finishes_it(tiny_artifact):
    """The fork handler reset the batch-1 state of every engine, this thread's open stream too: its next step failed
    ("'frozenset' object has no attribute 'add'")."""
    done = run_script(FORK_IN_THE_MIDDLE_OF_ITS_OWN_STREAM, tiny_artifact)
    assert "child: same tokens" in done.stdout, (done.stdout, done.stderr[-2000:])


# The parent forks with a request of its own still running, and the child waits on its handle, or goes on with a
# stream another thread of the parent had open.
FORK_WITH_THE_PARENTS_REQUESTS_OPEN = """
    import math, os, signal, sys, threading
    from runtime import Engine

    engine = Engine.load(sys.argv[1])
    scheduler = engine.start_scheduler(slots=1, idle_exit_s=math.inf)
    held, resume, run, runs = threading.Event(), threading.Event(), scheduler.cache.run, []

    def held_run(*args, **keywords):  # the worker stops at its third graph run until the fork is done
        runs.append(1)
        if len(runs) == 3:
            held.set()
            resume.wait()
        return run(*args, **keywords)

    scheduler.cache.run = held_run
    running = engine.submit([1, 5, 9], max_new_tokens=20, ignore_eos=True)  # one slot: the other one waits
    waiting = engine.submit([1, 5, 9], max_new_tokens=4, ignore_eos=True)
    held.wait()
    started, forked, streams = threading.Event(), threading.Event(), []

    def stream():
        streams.append(engine.stream([1, 5, 9], max_new_tokens=6, ignore_eos=True))
        next(streams[0])
        started.set()
        forked.wait()

    threading.Thread(target=stream, daemon=True).start()
    started.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # iterating a handle of the parent waited forever too
        for name, handle in (("running", running), ("waiting", waiting)):
            try:
                handle.result(timeout=5)  # waited forever
                print("child:", name, "finished", flush=True)
            except BaseException as error:
                print("child:", name, type(error).__name__, error, flush=True)
        try:
            list(running)
        except BaseException as error:
            print("child: iterating", type(error).__name__, flush=True)
        try:
            list(streams[0])
            print("child: stream finished", flush=True)
        except BaseException as error:
            print("child: stream", type(error).__name__, error, flush=True)
        print("child: own request", engine.generate([1, 5, 9], max_new_tokens=3).finish_reason, flush=True)
        os._exit(0)
    forked.set()
    resume.set()
    os.waitpid(pid, 0)
    print("parent:", running.result().finish_reason, waiting.result().finish_reason, flush=True)
    engine.close()
"""


def test_a_forked_child_refuses_the_parents_open_requests_instead_of_hanging(tiny_artifact):
    """The child's copies of the parent's handles never completed (result() waited forever), and a stream another
    thread of the parent had open failed in the child with "'frozenset' object has no attribute 'add'"."""
    done = run_script(FORK_WITH_THE_PARENTS_REQUESTS_OPEN, tiny_artifact)
    for name in ("running", "waiting"):
        assert f"child: {name} RequestError this request was submitted in the parent process before os.fork()" \
            in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "child: stream RequestError this stream was started by another thread of the parent process" \
        in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "child: iterating RequestError" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "child: own request length" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "parent: length length" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_a_child_forked_while_another_thread_loads_does_not_wait_for_that_load_at_exit():
    """The exit waits for loads under way (EXIT_WAIT_S): a child forked during another thread's load counted it for
    ever, and its exit waited the whole 30 s."""
    import os

    import runtime.engine

    with runtime.engine._loads_lock:
        runtime.engine._loads += 1  # another thread's load, under way at the fork
    try:
        child = os.fork()
        if child == 0:
            os._exit(0 if runtime.engine._loads == 0 and runtime.engine._loads_lock.acquire(timeout=1) else 1)
        _, status = os.waitpid(child, 0)
    finally:
        with runtime.engine._loads_lock:
            runtime.engine._loads -= 1
    assert os.waitstatus_to_exitcode(status) == 0


# gunicorn's preload_app: load and warm up in the parent, fork; the worker serves and later leaves with sys.exit.
FORKED_WORKER_EXITS = """
    import os, sys, time, warnings
    from runtime import Engine
    from runtime.cpus import usable_cpus

    threads = min(2, usable_cpus())
    engine = Engine.load(sys.argv[1], intra_op_threads=threads)
    expected = engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids  # warmed up: pools ran
    print("threads", threads, flush=True)
    pid = os.fork()
    if pid == 0:
        with warnings.catch_warnings(record=True) as own:  # an engine the child loads has its threads: no notice
            warnings.simplefilter("always")
            Engine.load(sys.argv[1], intra_op_threads=threads).generate([1, 5, 9], max_new_tokens=2)
        print("own engine's warnings:", [str(w.message)[:60] for w in own], flush=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids
            engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True)
        print("child:", "same tokens" if got == expected else got, flush=True)
        print("child warnings:", [str(w.message)[:60] for w in caught], flush=True)
        sys.exit(0)  # the interpreter's exit frees the engine: it hung in pthread_cond_destroy
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.05)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
            print("parent: the child did not exit", flush=True)
    print("parent:", "same tokens" if engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids
          == expected else "other tokens", flush=True)
"""


def test_a_worker_forked_from_a_warmed_up_engine_serves_says_it_runs_on_one_thread_and_exits(tiny_artifact):
    """Freeing the sessions a child inherited (at its exit, or `del engine`) waited in onnxruntime's thread pool for
    the parent's threads: every gunicorn worker of a preloaded, warmed-up engine hung when it left. Those threads do
    not exist in the child, whose runs use its one thread: said once, at its first run."""
    done = run_script(FORKED_WORKER_EXITS, tiny_artifact)
    assert "child: same tokens" in done.stdout and "parent: same tokens" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "did not exit" not in done.stdout, (done.stdout, done.stderr[-2000:])
    warned = "['this process was forked after its Engine loaded: onnxruntime']"
    assert ("child warnings: " + (warned if "threads 2" in done.stdout else "[]")) in done.stdout, done.stdout
    assert "own engine's warnings: []" in done.stdout, done.stdout


def test_a_fork_waits_for_the_graph_runs_under_way_and_starts_none_until_it_returns():
    """A child forked while another thread was inside onnxruntime's run inherited onnxruntime's mutex held by a
    thread it does not have: its own generate hung there (a child in each of 3 runs of 500 forks)."""
    import os
    import threading
    import time

    from runtime import forking

    inside, release, after_fork = threading.Event(), threading.Event(), []

    def a_run():  # holds the gate as a load does, until released
        with forking.RUNS.share():
            inside.set()
            release.wait()
        with forking.RUNS.share():  # a run that starts while the fork waits: after the fork
            after_fork.append((time.monotonic(), forking.RUNS.forking))

    running = threading.Thread(target=a_run)
    running.start()
    inside.wait()
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    child = os.fork()
    if child == 0:
        os._exit(0 if not forking.RUNS.running and not forking.RUNS.forking else 1)  # the child's gate starts free
    forked = time.monotonic()
    _, status = os.waitpid(child, 0)
    running.join()
    assert os.waitstatus_to_exitcode(status) == 0
    assert forked - started >= 0.25 and after_fork and after_fork[0][0] >= forked - 0.01
    assert after_fork[0][1] is False  # it did not start while the fork waited


def test_what_cannot_go_to_another_process_says_what_to_send_and_errors_come_back_whole(tiny_artifact):
    """multiprocessing pickles what it sends: an Engine failed with "cannot pickle 'InferenceSession'", a handle with
    "cannot pickle 'weakref.ReferenceType'"; a BodyError did not unpickle (a Pool's parent then hangs or dies)."""
    import pickle

    from runtime import Engine
    from runtime.http_body import BodyError

    engine = Engine.load(tiny_artifact)
    try:
        handle = engine.submit([1, 5, 9], max_new_tokens=2)
        generation = engine.stream([1, 5, 9], max_new_tokens=2)
        for value, message in ((engine, "an Engine cannot be sent to another process: load it there"),
                               (handle, "a RequestHandle belongs to the process that submitted it: send handle.result()"),
                               (generation, "a Generation belongs to the process and engine that started it")):
            with pytest.raises(TypeError, match=re.escape(message)):
                pickle.dumps(value)
        generation.close()
        result = pickle.loads(pickle.dumps(handle.result()))
        assert result.token_ids == handle.result().token_ids and result.timings.ttft_s == handle.result().timings.ttft_s
    finally:
        engine.close()
    error = pickle.loads(pickle.dumps(BodyError("a malformed chunk", 400, 77)))
    assert (str(error), error.status, error.unread, error.body()) == (
        "a malformed chunk", 400, 77, BodyError("a malformed chunk", 400, 77).body())


def test_an_engine_dropped_after_its_scheduler_ran_is_freed_by_the_next_load_and_its_memory_given_back(tiny_artifact,
                                                                                                       monkeypatch):
    """An engine and its scheduler refer to each other: only a full garbage collection freed an engine that had
    batched, so a model switcher kept every earlier model (2.0 -> 8.0 GB over 4 switches of the default model).
    Engine.load collects first. What the sessions held stayed in glibc's heap until some engine ran a prefill
    (230-320 MB): given back when the engine goes."""
    import gc
    import time
    import weakref

    from runtime import Engine, onnxruntime_backend

    trims = []
    monkeypatch.setattr(onnxruntime_backend.FREED_MEMORY, "trim", lambda pad: trims.append(pad))
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic collection here: only the load's own (gc.disable() turns that off too)
    gc.collect()  # an earlier test's engine left in a cycle: freed now, not by the load below (a second trim)
    try:
        engine = Engine.load(tiny_artifact)
        scheduler = engine.start_scheduler(slots=2, idle_exit_s=0.05)
        engine.generate([[1, 5, 9], [2, 6]], max_new_tokens=3, ignore_eos=True)
        dropped = weakref.ref(engine)
        deadline = time.monotonic() + 10
        while scheduler._worker is not None and time.monotonic() < deadline:  # a worker that runs holds them
            time.sleep(0.01)
        del engine, scheduler
        trims.clear()
        assert dropped() is not None  # the cycle
        kept = Engine.load(tiny_artifact)  # a model switcher's next model
        assert dropped() is None and trims == [0]
        scheduler = kept.start_scheduler(slots=1)  # a caller may keep the scheduler alone
        del kept
        assert scheduler.submit([1, 5, 9], max_new_tokens=2).result().finish_reason == "length"
        scheduler.close()
    finally:
        gc.set_threshold(*thresholds)


def test_a_fork_waits_for_a_graph_run_another_thread_has_under_way(tiny_artifact):
    """run_bound's share of the gate, not only the gate: a run held inside onnxruntime's call, the fork from another
    thread returns only after it."""
    import threading

    from runtime import Engine

    engine = Engine.load(tiny_artifact)
    inside, release = threading.Event(), threading.Event()
    session = engine.backend.sessions["prefill"]
    real = session.run_with_iobinding

    def held(binding, options=None):
        inside.set()
        release.wait()
        return real(binding, options)

    session.run_with_iobinding = held
    assert seconds_a_fork_waits(lambda: engine.generate([1, 5, 9], max_new_tokens=2), inside, release) >= 0.25


def seconds_a_fork_waits(work, inside, release) -> float:
    """Run `work` in a thread until it is `inside` (held there until `release`, 0.3 s later), and fork meanwhile:
    how long os.fork() took."""
    import threading

    running = threading.Thread(target=work)
    running.start()
    assert inside.wait(30)
    threading.Timer(0.3, release.set).start()
    waited = seconds_to_fork()
    running.join()
    return waited


def seconds_to_fork() -> float:
    """How long os.fork() took (its child exits at once)."""
    import os
    import time

    started = time.monotonic()
    child = os.fork()
    if child == 0:
        os._exit(0)
    waited = time.monotonic() - started
    os.waitpid(child, 0)
    return waited


def test_an_engine_is_not_copied(tiny_artifact):
    import copy

    from runtime import Engine

    engine = Engine.load(tiny_artifact)
    for copier in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="an Engine is not copied: share the one you have"):
            copier(engine)


def test_a_fork_from_inside_its_own_thread_s_load_does_not_wait_for_itself(monkeypatch):
    """A signal handler (or a finalizer) forking while its thread was inside Engine.load waited FORK_WAIT_S."""
    from runtime import forking

    monkeypatch.setattr(forking, "FORK_WAIT_S", 3.0)
    with forking.RUNS.share():
        waited = seconds_to_fork()
    assert waited < 1.0, waited


def test_aotlm_s_own_files_name_their_encoding_and_the_cli_prints_its_notices_under_w_error(tiny_artifact, tmp_path):
    """PEP 597's -X warn_default_encoding with EncodingWarning as an error: Engine.load failed in runtime/cpus.py.
    Under -W error the commands ended in a traceback (status 1) at aotlm's own notices (a recipe's thread count above
    this machine's), which print as `warning:` lines; a library user's -W error still raises them (AotlmWarning)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    script = ("import sys; from runtime import Engine; "
              "print(len(Engine.load(sys.argv[1]).generate([1, 5, 9], max_new_tokens=2).token_ids))")
    done = subprocess.run([sys.executable, "-X", "warn_default_encoding", "-W", "error::EncodingWarning", "-c", script,
                           str(tiny_artifact)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-2000:]

    crowded = shutil.copytree(tiny_artifact, tmp_path / "threads")
    manifest = json.loads((crowded / "manifest.json").read_text())
    manifest["backend"]["session"]["intra_op_threads"] = (os.cpu_count() or 1) + 8
    (crowded / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run([sys.executable, "-W", "error", "-m", "compiler.cli", "run", str(crowded), "--prompt", "hi",
                           "--max-new-tokens", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "warning: the artifact's recipe sets backend.intra_op_threads" in done.stderr, \
        done.stderr[-2000:]
    from runtime import AotlmWarning, Engine

    with pytest.warns(AotlmWarning, match="the artifact's recipe sets backend.intra_op_threads"):
        Engine.load(crowded)


def test_a_fork_waits_for_a_load_another_thread_has_under_way(tiny_artifact, monkeypatch):
    """A child forked during another thread's Engine.load hung in its own load (onnxruntime's lock, held)."""
    import threading

    from runtime import Engine

    inside, release, opened = threading.Event(), threading.Event(), Engine._open.__func__

    def held_open(cls, *args):
        inside.set()
        release.wait()
        return opened(cls, *args)

    monkeypatch.setattr(Engine, "_open", classmethod(held_open))
    assert seconds_a_fork_waits(lambda: Engine.load(tiny_artifact), inside, release) >= 0.25


# gunicorn's preload_app with Engine.load's defaults: intra_op_num_threads 0 (onnxruntime's own count)
FORKED_DEFAULT_THREADS = """
    import os, sys, warnings
    from runtime import Engine
    from runtime.cpus import usable_cpus

    engine = Engine.load(sys.argv[1])
    engine.generate([1, 5, 9], max_new_tokens=2)
    pid = os.fork()
    if pid == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate([1, 5, 9], max_new_tokens=2)
        print("usable", usable_cpus(), "warned", len(caught), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def test_a_child_of_an_engine_loaded_with_default_threads_is_told_too(tiny_artifact):
    done = run_script(FORKED_DEFAULT_THREADS, tiny_artifact)
    said = re.search(r"usable (\d+) warned (\d+)", done.stdout)
    assert said and int(said.group(2)) == (1 if int(said.group(1)) > 1 else int(said.group(2))), (
        done.stdout, done.stderr[-2000:])


def test_a_dropped_engine_lets_go_of_its_scheduler_and_sessions_before_it_trims(tiny_artifact, monkeypatch):
    """Trimmed while the scheduler's slot cache still bound the sessions, the memory they held stayed in the heap."""
    from runtime import Engine, onnxruntime_backend

    engine = Engine.load(tiny_artifact)
    engine.start_scheduler(slots=1)
    held = []
    monkeypatch.setattr(onnxruntime_backend.FREED_MEMORY, "trim",
                        lambda pad: held.append({"_scheduler", "backend"} & set(vars(engine))))
    engine.__del__()
    assert held == [set()]


def test_loads_on_huge_pages_run_one_at_a_time(tiny_artifact, monkeypatch):
    """Each counts what appeared in the process while it loaded as its own: two at once each reported, and
    collapsed, both engines' memory."""
    import threading
    import time

    from runtime import Engine

    opened, inside, most = Engine._open.__func__, [0], [0]

    def counted(cls, *args):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        try:
            return opened(cls, *args)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(Engine, "_open", classmethod(counted))
    loads = [threading.Thread(target=lambda: Engine.load(tiny_artifact, huge_pages=True)) for _ in range(2)]
    for thread in loads:
        thread.start()
    for thread in loads:
        thread.join()
    assert most[0] == 1
