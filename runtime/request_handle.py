"""A submitted request's handle (iterate its text, wait for its result, cancel it) and the thread that runs the
handles' done-callbacks. The scheduler (runtime/scheduler.py) completes handles from its worker thread."""
from __future__ import annotations

import logging
import math
import numbers
import queue
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError  # the built-in TimeoutError only from 3.11
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from runtime.errors import RequestError
from runtime.results import GenerationResult

if TYPE_CHECKING:  # runtime.scheduler imports this module
    from runtime.scheduler import Scheduler

END = object()  # the last item of a handle's piece queue
LOGGER = logging.getLogger(__name__)


class PieceQueue:
    """A handle's text pieces, put by the scheduler's worker: read by a thread (get, blocking) or by an asyncio task
    (`async for`), which is woken through its event loop, not by a thread waiting for it (a thread per stream ran
    the default executor dry: running streams stalled behind queued ones)."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        # (loop, future) of each task waiting for the next item: every one is woken, and each looks again (one slot
        # for the latest left an earlier task of two reading one handle waiting for ever)
        self._waiters: set = set()

    def put(self, item) -> None:
        self._items.put(item)
        if not self._waiters:  # the decode loop's usual case; a task registering now sees the item (get_async)
            return
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # its loop was closed: nobody waits any more (the item stays for any reader)
                pass

    def get(self):
        return self._items.get()

    async def get_async(self):
        """The next item, waiting in the running event loop."""
        import asyncio

        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            loop = asyncio.get_running_loop()
            waiter = (loop, loop.create_future())
            with self._lock:
                self._waiters.add(waiter)
            try:
                if self._items.empty():  # (a put between the check above and the registration woke nobody)
                    await waiter[1]
            finally:  # woken, cancelled, or an item came meanwhile: not waiting any more
                with self._lock:
                    self._waiters.discard(waiter)


def _wake(future) -> None:
    if not future.done():
        future.set_result(None)


COMPLETING = threading.local()  # .requests: True on a thread that completes requests (the scheduler's worker)


class CallbackThread:
    """Runs requests' done-callbacks in order on a thread of their own, started when one is due and ending when none
    is. Not on the worker, which completes the requests: a callback that waits on another request (its result, a
    generate, a blocking submit) waited on the worker itself, and serving stopped for good. A callback's exception
    is logged, as concurrent.futures logs it, and the next one runs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._due: deque[Callable[[], None]] = deque()
        self._thread: threading.Thread | None = None

    def call(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._due.append(callback)
            if self._thread is not None or self._start():
                return
            # No thread could start ("can't start new thread": a pids or ulimit -u limit). A thread that never
            # started, kept as the running one, had held every later callback for good. On the thread that completes
            # requests (COMPLETING) they wait for retry(): one that waits on another request would wait on itself.
            # Elsewhere they run here, in turn.
            if getattr(COMPLETING, "requests", False):
                return
            self._thread = threading.current_thread()
        self._run()

    def _start(self) -> bool:
        """Start the thread (the lock is held: its _run waits for it); False where none can start."""
        thread = threading.Thread(target=self._run, name="aotlm-callbacks", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            return False
        self._thread = thread
        return True

    def retry(self) -> bool:
        """Start the thread for callbacks left due when it could not start (the scheduler's worker calls this each
        iteration); whether some still wait for one. Nothing due (every decode step): no lock taken."""
        if not self._due:
            return False
        with self._lock:
            return self._thread is None and bool(self._due) and not self._start()

    def call_in_turn(self, callback: Callable[[], None]) -> None:
        """Run it now, in this thread, unless callbacks are due or running: then after them, on the thread (a
        handle's callbacks run in the order they were added, as concurrent.futures runs them)."""
        with self._lock:
            idle = self._thread is None
        if not idle:
            self.call(callback)
            return
        try:
            callback()
        except Exception:  # logged, as concurrent.futures logs a callback added to a done future
            LOGGER.exception("a request's done-callback raised")

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._due:
                    self._thread = None  # under the lock: a call after this starts a new thread
                    return
                callback = self._due.popleft()
            try:
                callback()
            except BaseException:  # SystemExit too: it would end this thread with callbacks still due
                LOGGER.exception("a request's done-callback raised")


def _check_timeout(timeout) -> float | None:
    """None, or a number of seconds as a float (threading's wait raised "'>' not supported between 'str' and 'int'"
    for "1"); numpy's numbers count (an np.int64 worked before this check), and infinity waits as None does
    (threading's wait raised OverflowError for it, and for any wait past threading.TIMEOUT_MAX)."""
    if timeout is None:
        return None
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, numbers.Real) or math.isnan(timeout):
        raise RequestError(f"timeout: {timeout!r} must be a number of seconds, or None to wait until the request ends")
    # past threading.TIMEOUT_MAX (292 years) a wait overflows ("timestamp out of range"): as long as None's
    return None if timeout >= threading.TIMEOUT_MAX else float(timeout)


class LoggedPiece(str):
    """A text piece of a scheduler request (submit) that asked for logprobs, with the ids and logprobs entries of the
    output tokens sampled since the previous piece. The pieces' token_ids are the first of the result's token_ids;
    the result holds any after them (the last steps' when they released no text, as a stop string's last token
    may). Text held back (a multi-byte character, a possible stop string) comes out with a later token's piece, so
    a piece's text and its tokens may be a few tokens apart."""

    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]
    final: bool  # the text held back until generation ended (a character cut short reads U+FFFD there)

    def __new__(cls, text: str, token_ids, logprobs, final: bool = False) -> "LoggedPiece":
        piece = super().__new__(cls, text)
        piece.token_ids, piece.logprobs, piece.final = tuple(token_ids), tuple(logprobs), final
        return piece

    def __reduce__(self):  # copy and pickle call __new__ with these (str's own would pass the text alone)
        return LoggedPiece, (str(self), self.token_ids, self.logprobs, self.final)


class RequestHandle:
    """One submitted request. Iterate (one consumer) for its text pieces; `result()` waits for the whole result.

    A cancelled request's result has finish_reason "cancelled", the tokens made so far, and timings None when it
    made none. A request that failed (the graph raised) raises that error from `result()` and from iteration.
    """

    def __init__(self, scheduler: "Scheduler", request_id: int, prompt_token_ids: list[int], pieces=None):
        self.id = request_id
        self.prompt_token_ids = prompt_token_ids
        # With the prompt_logprobs option: the prompt tokens' entries (result.prompt_logprobs), set once the prompt
        # is scored, before its first text piece is handed out (a stream that echoes the prompt sends them first).
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        # Weakly: a finished handle a caller keeps (a request log, a list of futures) held the scheduler, its engine
        # and their sessions after engine.close() (1.1 GB on the default model). A running request's scheduler is
        # alive anyway: its worker thread holds it.
        self._scheduler = weakref.ref(scheduler)
        # The text pieces, then END; `pieces` (a queue-like with put(): a server's stream) takes them instead, and
        # the handle is then not iterated: its consumer reads them there, without a thread to carry them over.
        self._pieces = PieceQueue() if pieces is None else pieces
        self._future: Future = Future()
        # True once cancel() reached the request before it finished (a cancel after the end leaves it False, as
        # concurrent.futures' does). The result's finish_reason says how it ended: a request the cancel reached in
        # its last step may still end "stop" or "length".
        self.cancelled = False
        # Callbacks added before the result is set; when it is, they are queued in order, under the lock, so that
        # one added after that (it sees _fired) is queued or run behind them, never ahead.
        self._callbacks_lock = threading.Lock()
        self._waiting_callbacks: list[Callable[[RequestHandle], None]] = []
        self._fired = False
        # Through a weak reference: the future keeps its done-callbacks once done, and a bound method would make a
        # cycle (handle -> future -> handle) that held the scheduler, its engine and their sessions after close()
        # until a full collection (1.4 GB on the default model). The scheduler holds the handle until it is done.
        handle = weakref.ref(self)
        self._future.add_done_callback(lambda future: (live := handle()) is not None and live._fire(future))

    def __iter__(self) -> Iterator[str]:
        """The text pieces as they arrive. Leaving the loop early does not stop the request (the handle is its
        result too, and `next(iter(handle))` waits for the first piece): call cancel() to free its slot."""
        if not isinstance(self._pieces, PieceQueue):  # (it had read the sink's reader's pieces, or failed inside)
            raise RequestError("this request's pieces go to the `pieces` sink it was submitted with: read them there")
        while (piece := self._pieces.get()) is not END:
            yield piece
        self._pieces.put(END)  # a later iteration ends at once instead of waiting forever
        self._future.result()  # raises the request's error, if it failed

    async def __aiter__(self):
        """`async for piece in handle`, in an asyncio task: the text pieces as they arrive, the event loop never
        blocked and no thread held per stream. The task cancelled while it waits (a client that disconnected, a
        timeout around it) or leaving the loop early cancels the request, as vLLM's aborts on disconnect: its
        slot is free at the next step."""
        if not isinstance(self._pieces, PieceQueue):
            raise RequestError("this request's pieces go to the `pieces` sink it was submitted with: read them there")
        ended = False
        try:
            while (piece := await self._pieces.get_async()) is not END:
                yield piece
            ended = True
        finally:
            if not ended:  # cancelled, or the consumer left the loop: the request stops
                self.cancel()
        self._pieces.put(END)  # a later iteration ends at once
        self._future.result()  # raises the request's error, if it failed

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The result, waiting for it at most `timeout` seconds (None: as long as it takes); after that,
        concurrent.futures.TimeoutError (the built-in TimeoutError from Python 3.11)."""
        wait = _check_timeout(timeout)
        try:
            return self._future.result(wait)
        except FutureTimeoutError:  # the same class, with a message: what callers catch (runtime/server.py)
            raise FutureTimeoutError(self._not_done(timeout)) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the request failed with (after waiting for it), or None."""
        wait = _check_timeout(timeout)
        try:
            return self._future.exception(wait)
        except FutureTimeoutError:  # the same class, with a message: what callers catch (runtime/server.py)
            raise FutureTimeoutError(self._not_done(timeout)) from None

    def _not_done(self, timeout: float) -> str:  # concurrent.futures' TimeoutError says nothing
        return (f"request {self.id} has not finished after {timeout} s; wait longer (result(timeout=None) waits "
                f"until it ends), or cancel() it")

    def __reduce__(self):  # "cannot pickle 'weakref.ReferenceType' object" said nothing of what to do
        raise TypeError("a RequestHandle belongs to the process that submitted it: send handle.result() (a "
                        "GenerationResult pickles) instead")

    def __repr__(self) -> str:
        """As concurrent.futures' Future shows its state (a notebook shows this)."""
        if not self.done():
            state = "pending"
        elif self._future.exception() is not None:
            state = "failed"
        else:
            state = f"finished ({self._future.result().finish_reason})"
        return f"<RequestHandle {self.id} {state}>"

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Stop the request: a waiting one leaves the queue now, a running one frees its slot at the next step."""
        scheduler = self._scheduler()
        if scheduler is not None:  # else it was collected, its requests all ended: nothing to stop
            scheduler._cancel(self)

    def add_done_callback(self, callback: Callable[["RequestHandle"], None]) -> None:
        """callback(handle) once the result (or error) is set: on the scheduler's callback thread (never its worker:
        a callback may wait on other requests), or at once in this thread if the result is set and no callback is
        due. One handle's callbacks run in the order they were added. One that raises is logged."""
        if not callable(callback):  # else only logged, as a TypeError, once the request ends
            raise RequestError(f"add_done_callback: callback must be callable (it is called with the handle), got "
                               f"{type(callback).__name__}")
        with self._callbacks_lock:
            if not self._fired:
                self._waiting_callbacks.append(callback)
                return
        self._callbacks().call_in_turn(lambda: callback(self))

    def _callbacks(self) -> CallbackThread:
        """The scheduler's callback thread; once the scheduler is gone, one of this module's (idle: runs them now)."""
        scheduler = self._scheduler()
        return scheduler._callbacks if scheduler is not None else _ORPHANS_CALLBACKS

    def _fail_after_fork(self, error: BaseException) -> None:
        """In a forked child, for a request of the parent (Scheduler._start_over_after_fork): done with `error`, its
        iteration ends, and the parent's callbacks do not run here. Fresh objects: a thread of the parent may have
        held their locks at the fork."""
        self._future = Future()
        self._future.set_exception(error)
        self._pieces = PieceQueue()
        self._pieces.put(END)
        self._callbacks_lock = threading.Lock()
        self._waiting_callbacks = []
        self._fired = True

    def _fire(self, _future: Future) -> None:
        """The result is set (on the worker): queue the callbacks added so far, in order, on the callback thread."""
        with self._callbacks_lock:
            self._fired = True
            for callback in self._waiting_callbacks:
                self._callbacks().call(lambda callback=callback: callback(self))
            self._waiting_callbacks.clear()


_ORPHANS_CALLBACKS = CallbackThread()  # for handles whose scheduler was collected (RequestHandle._callbacks)
