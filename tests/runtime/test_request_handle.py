"""runtime/request_handle.py on its own: a handle completed by hand (as the scheduler's worker completes it), its
done-callbacks on the callback thread, and the text pieces that carry tokens. With a scheduler: test_scheduler.py."""
from __future__ import annotations

import concurrent.futures
import copy
import pickle
import re
import threading
import time

import pytest

from runtime.request_handle import CallbackThread, LoggedPiece, RequestHandle


class FakeScheduler:
    """What a handle asks of its scheduler (held weakly: the test's handle keeps this one alive)."""

    def __init__(self, callbacks: CallbackThread):
        self._callbacks = callbacks

    def _cancel(self, handle) -> None:
        pass


def handle_of(callbacks: CallbackThread | None = None) -> RequestHandle:
    scheduler = FakeScheduler(callbacks or CallbackThread())
    handle = RequestHandle(scheduler, request_id=7, prompt_token_ids=[1, 2])
    handle.test_scheduler = scheduler
    return handle


def test_waiting_on_an_unfinished_request_honours_the_timeout():
    handle = handle_of()
    late = threading.Timer(2.0, handle._future.set_result, ["late"])  # a wait that ignored its timeout would end here
    late.start()
    try:
        with pytest.raises(concurrent.futures.TimeoutError):
            handle.result(timeout=0.01)
        with pytest.raises(concurrent.futures.TimeoutError):
            handle.exception(timeout=0.01)
        assert not handle.done() and handle.cancelled is False
    finally:
        late.cancel()


def test_callbacks_added_before_the_result_each_run_once_in_order_with_the_handle():
    handle, ran, finished = handle_of(), [], threading.Event()
    handle.add_done_callback(lambda h: ran.append(("first", h.id)))
    handle.add_done_callback(lambda h: ran.append(("second", h.id)))
    handle.add_done_callback(lambda h: finished.set())
    handle._future.set_result("done")  # as the worker sets it
    assert finished.wait(timeout=10)
    assert ran == [("first", 7), ("second", 7)]


def test_a_callback_that_raises_system_exit_does_not_stop_the_ones_after_it(caplog):
    """SystemExit would end the callback thread with callbacks still due, and no later one would ever run."""
    callbacks, first, later = CallbackThread(), threading.Event(), threading.Event()

    def leave():
        raise SystemExit(1)

    for callback in (leave, first.set):
        callbacks.call(callback)
    assert first.wait(timeout=10)
    callbacks.call(later.set)  # after the thread ended (or while it ends): a new one runs it
    assert later.wait(timeout=10)
    assert "done-callback raised" in caplog.text and "SystemExit" in caplog.text


def test_a_logged_piece_keeps_its_tokens_and_whether_it_is_final_when_copied_or_pickled():
    piece = LoggedPiece("\ufffd", [5, 6], [{5: -0.5}, {6: -1.0}], final=True)
    for kept in (copy.copy(piece), copy.deepcopy(piece), pickle.loads(pickle.dumps(piece))):
        assert type(kept) is LoggedPiece and kept == "\ufffd"
        assert (kept.token_ids, kept.logprobs, kept.final) == ((5, 6), ({5: -0.5}, {6: -1.0}), True)
    assert LoggedPiece("a", [1], [{1: 0.0}]).final is False


def test_callbacks_queued_while_one_runs_run_after_it_on_the_same_thread():
    callbacks, ran, second_ran = CallbackThread(), [], threading.Event()

    def first():
        second_ran.wait(timeout=0.5)  # time for a second thread, if there were one, to run the next callback now
        ran.append(("first", threading.current_thread()))

    def second():
        ran.append(("second", threading.current_thread()))
        second_ran.set()

    callbacks.call(first)
    callbacks.call(second)  # queued while the first runs (or is about to)
    assert second_ran.wait(timeout=10)
    assert [name for name, _ in ran] == ["first", "second"] and ran[0][1] is ran[1][1]
    assert ran[0][1].name == "aotlm-callbacks"


def test_a_callback_run_at_once_that_raises_is_logged_not_raised_into_the_caller(caplog):
    handle = handle_of()
    handle._future.set_result("done")
    ran = []
    handle.add_done_callback(lambda h: ran.append(threading.current_thread()))  # idle thread: runs here, at once
    assert ran == [threading.current_thread()]
    handle.add_done_callback(lambda h: {}["missing"])  # a KeyError, not only the ZeroDivisionError of other tests
    assert "done-callback raised" in caplog.text and "KeyError: 'missing'" in caplog.text


def test_a_handles_timeout_and_callback_are_checked_when_given():
    from runtime import RequestError

    handle = handle_of()
    for timeout in ("1", True, float("nan"), [1]):  # "1": threading's "'>' not supported between 'str' and 'int'"
        for wait in (handle.result, handle.exception):
            with pytest.raises(RequestError, match=re.escape(f"timeout: {timeout!r} must be a number of seconds, or None")):
                wait(timeout=timeout)
    with pytest.raises(concurrent.futures.TimeoutError, match=r"request 7 has not finished after 0.01 s; wait longer"):
        handle.result(timeout=0.01)  # concurrent.futures' TimeoutError has no message
    for callback in (5, "print", None):  # was accepted, then logged as a TypeError when the request ended
        with pytest.raises(RequestError, match="add_done_callback: callback must be callable"):
            handle.add_done_callback(callback)
    handle._future.set_result("done")
    assert handle.result(timeout=0) == "done" and handle.exception(timeout=-1) is None


def test_a_timeout_is_concurrent_futures_timeout_error_which_python_3_10_keeps_apart(monkeypatch):
    """runtime/server.py polls handle.result(timeout=POLL_S) and catches concurrent.futures.TimeoutError; before
    Python 3.11 that is not the built-in TimeoutError, so a handle raising the built-in one failed every request
    that took longer than one poll (its `except Exception` answered an error). Python 3.10's classes, simulated."""
    import runtime.request_handle as request_handle

    class FuturesTimeoutError(concurrent.futures._base.Error):  # Python 3.10's concurrent.futures.TimeoutError
        pass

    class Unfinished:
        def result(self, timeout=None):
            raise FuturesTimeoutError()

        exception = result

    monkeypatch.setattr(request_handle, "FutureTimeoutError", FuturesTimeoutError)
    handle = handle_of()
    handle._future = Unfinished()
    for wait in (handle.result, handle.exception):
        with pytest.raises(FuturesTimeoutError, match="request 7 has not finished after 0.25 s"):
            wait(timeout=0.25)


def test_numpy_and_infinite_timeouts_wait_as_numbers_do():
    """handle.result(timeout=np.int64(1)) waited before the timeout check and was then refused as "not a number";
    timeout=inf raised OverflowError from threading's wait."""
    import numpy as np

    handle = handle_of()
    for timeout in (np.int64(0), np.float32(0.01), np.float64(0.01)):
        with pytest.raises(concurrent.futures.TimeoutError):
            handle.result(timeout=timeout)
    started = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):  # -inf is no wait at all, not "for ever" as +inf is
        handle.result(timeout=float("-inf"))
    assert time.monotonic() - started < 5
    threading.Timer(0.05, handle._future.set_result, ["done"]).start()
    assert handle.result(timeout=float("inf")) == "done"
    other = handle_of()  # past threading.TIMEOUT_MAX: an OverflowError from threading's wait, as inf's had been
    threading.Timer(0.05, other._future.set_result, ["done"]).start()
    assert other.result(timeout=1e10) == "done" and other.exception(timeout=1e300) is None
