"""Operating-system limits a server meets: a process at its thread limit (a container's pids.max) and one out of file
descriptors (systemd's LimitNOFILE). Thread starts are refused by name, as CPython refuses them there."""
from __future__ import annotations

import errno
import resource
import socket
import threading
import time

import pytest

from runtime import Engine
from runtime import descriptors
from runtime.errors import AotlmRuntimeError, ThreadLimitError
from runtime.request_handle import CallbackThread
from tests.runtime.test_server import request, serve, stop


@pytest.fixture
def refuse_thread(monkeypatch) -> set[str]:
    """Names of threads whose next start() raises "can't start new thread" (once each)."""
    refused: set[str] = set()
    real_start = threading.Thread.start

    def start(thread):
        if thread.name in refused:
            refused.discard(thread.name)
            raise RuntimeError("can't start new thread")
        return real_start(thread)
    monkeypatch.setattr(threading.Thread, "start", start)
    return refused


def test_a_worker_that_cannot_start_leaves_the_request_unqueued(tiny_engine, refuse_thread):
    """The request was queued before the worker's start failed: the caller got an error (no handle to cancel), and
    the next request's worker ran the refused one's 40 tokens too."""
    scheduler = tiny_engine.start_scheduler(slots=2)
    refuse_thread.add("aotlm-scheduler")
    with pytest.raises(ThreadLimitError, match="was not queued: retry, or raise the limit"):
        tiny_engine.submit("refused", max_new_tokens=40, ignore_eos=True)
    assert scheduler.counts() == (0, 0)
    tiny_engine.submit("next", max_new_tokens=2, ignore_eos=True).result(timeout=60)
    assert scheduler.token_counts()["generation_tokens"] == 2


def test_done_callbacks_run_when_their_thread_cannot_start(refuse_thread):
    """A thread that never started was kept as the running one: no later callback ran (aotlm bench hung)."""
    callbacks, ran = CallbackThread(), []
    refuse_thread.add("aotlm-callbacks")
    callbacks.call(lambda: ran.append(1))  # here, in this thread
    assert ran == [1]
    done = threading.Event()
    callbacks.call(lambda: ran.append(threading.current_thread().name) or done.set())
    assert done.wait(10) and ran == [1, "aotlm-callbacks"]


def test_callbacks_whose_thread_cannot_start_wait_for_it_never_run_on_the_worker(tiny_engine, refuse_thread):
    """Run in place on the scheduler's worker, a callback that waited on another request waited on the worker
    itself: every request stalled. They wait until the worker starts their thread again (each iteration)."""
    tiny_engine.start_scheduler(slots=2)
    ran, nested = [], []
    refuse_thread.add("aotlm-callbacks")
    first = tiny_engine.submit("hello", max_new_tokens=100, ignore_eos=True)  # running while the callback is added
    first.add_done_callback(lambda handle: ran.append(threading.current_thread().name) or nested.append(
        tiny_engine.submit("world", max_new_tokens=3).result(timeout=30)))
    first.result(timeout=30)
    deadline = time.monotonic() + 30
    while not nested and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ran == ["aotlm-callbacks"] and len(nested) == 1 and nested[0].token_ids


def test_the_server_answers_503_when_no_thread_can_start_for_a_request(tiny_artifact, refuse_thread):
    engine = Engine.load(tiny_artifact)
    server, lines = serve(engine)  # the first request starts the default scheduler, and its worker
    try:
        refuse_thread.add("aotlm-scheduler")
        status, headers, body = request(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and headers["Retry-After"] == "1" and "thread limit" in body["error"]["message"]
        status, _, body = request(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] <= 2
    finally:
        stop(server)


def test_onnxruntime_without_threads_is_the_thread_limit_not_a_broken_graph(tiny_artifact, monkeypatch):
    import onnxruntime as ort

    def refused(*args, **kwargs):
        raise ort.capi.onnxruntime_pybind11_state.Fail(
            "env.cc:327 PosixThread pthread_create failed, error code: 11 error msg: Resource temporarily unavailable")
    monkeypatch.setattr(ort, "InferenceSession", refused)
    with pytest.raises(AotlmRuntimeError, match=r"thread limit .*\(--threads 1") as raised:
        Engine.load(tiny_artifact)
    assert "cannot load this graph" not in str(raised.value)


def test_an_accept_out_of_descriptors_waits_and_says_so_once(tiny_artifact, monkeypatch):
    """socketserver retried a refused accept at once, for ever: a core busy and no word of it."""
    engine = Engine.load(tiny_artifact)
    server, lines = serve(engine)
    real_accept, refusals, sleeps = socket.socket.accept, [3], []

    def accept(sock):
        if refusals[0]:
            refusals[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(sock)
    monkeypatch.setattr(socket.socket, "accept", accept)
    real_sleep = time.sleep
    monkeypatch.setattr("runtime.server.time.sleep", lambda s: sleeps.append(s) or real_sleep(s))
    try:
        status, _, _ = request(server, "GET", "/health")
        assert status == 200 and sleeps[:3] == [0.1] * 3, sleeps
        refused = [line for line in lines if line.startswith("cannot accept connections")]
        assert refused == ["cannot accept connections: Too many open files (0 open); new ones wait until some "
                           "close (raise ulimit -n, or lower --max-connections)"]
        assert "accepting connections again (0 open)" in lines
    finally:
        monkeypatch.undo()
        stop(server)


def test_connections_are_fitted_to_the_open_file_limit(monkeypatch):
    monkeypatch.setattr(descriptors, "raised_descriptor_limit", lambda: 64)
    monkeypatch.setattr(descriptors, "open_descriptors", lambda: 7)
    fit, said = descriptors.connections_that_fit(1024)
    assert fit == 64 - 7 - descriptors.SPARE_DESCRIPTORS and f"at most {fit} connections" in said
    assert descriptors.connections_that_fit(10) == (10, None)


def test_the_soft_open_file_limit_is_raised_toward_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, soft), hard))
        limit = descriptors.raised_descriptor_limit()
        expected = descriptors.RAISED_LIMIT if hard == resource.RLIM_INFINITY else min(hard, descriptors.RAISED_LIMIT)
        assert limit == max(expected, min(256, soft)) == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
