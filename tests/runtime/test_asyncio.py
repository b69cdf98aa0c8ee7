"""The runtime in an asyncio app: `async for piece in handle` streams without blocking the loop or holding a thread,
cancels its request when its task is cancelled; a pieces sink that fails ends its own request alone."""
from __future__ import annotations

import asyncio
import time

import pytest

from runtime import Engine


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    with Engine.load(tiny_artifact) as loaded:
        loaded.start_scheduler(slots=2)  # at startup: the first submit would allocate the cache on the caller
        yield loaded


def test_async_streams_equal_their_results_and_the_loop_keeps_ticking(engine):
    async def stream(prompt):
        handle = engine.submit(prompt, max_new_tokens=12, ignore_eos=True)
        pieces = [piece async for piece in handle]
        return "".join(pieces), handle.result().text

    async def app():
        lag, stop = [], asyncio.Event()

        async def ticker():
            while not stop.is_set():
                before = time.perf_counter()
                await asyncio.sleep(0.005)
                lag.append(time.perf_counter() - before - 0.005)

        ticking = asyncio.create_task(ticker())
        results = await asyncio.gather(*(stream([1 + i, 2, 3]) for i in range(5)))  # more streams than slots
        stop.set()
        await ticking
        return results, max(lag)

    results, worst_lag = asyncio.run(app())
    assert all(streamed == whole and whole for streamed, whole in results)
    assert worst_lag < 1.0  # the loop was never held for a graph run (a blocking next() would hold it each token)


def test_a_cancelled_task_cancels_its_request_and_frees_its_slot(engine):
    """A client that disconnects (its task cancelled) kept its slot until the user cancelled by hand."""
    async def app():
        handle = engine.submit([5, 6, 7], max_new_tokens=engine.max_context - 4, ignore_eos=True)
        first = asyncio.Event()

        async def consume():  # a client that writes each piece out slowly, then disconnects
            async for _ in handle:
                first.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return handle

    handle = asyncio.run(app())
    assert handle.result(timeout=30).finish_reason == "cancelled" and handle.cancelled
    assert engine.scheduler.counts() == (0, 0)


def test_a_sink_that_fails_ends_its_own_request_and_no_other(engine):
    """A sink whose event loop closed raised on the worker: the error failed every running request, and its own
    handle never finished."""
    class ClosedLoop:
        def put(self, item):
            raise RuntimeError("Event loop is closed")

    other = engine.submit([1, 2, 3], max_new_tokens=20, ignore_eos=True)
    broken = engine.submit([4, 5, 6], max_new_tokens=20, ignore_eos=True, pieces=ClosedLoop())
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        broken.result(timeout=30)
    assert other.result(timeout=30).finish_reason == "length"
    assert engine.generate([7, 8], max_new_tokens=2, ignore_eos=True).finish_reason == "length"


def test_two_tasks_reading_one_handle_both_end_and_a_sinks_handle_is_not_iterated(engine):
    """One waiter slot: the second task's registration replaced the first's, which then waited for ever."""
    from runtime import RequestError

    async def app():
        handle = engine.submit([1, 2, 3], max_new_tokens=40, ignore_eos=True)

        async def read():
            return [piece async for piece in handle]

        first, second = await asyncio.wait_for(asyncio.gather(read(), read()), 30)
        return handle, first + second

    handle, pieces = asyncio.run(app())
    assert sorted("".join(pieces)) == sorted(handle.result().text)  # every piece went to one of the two

    class Sink:
        def put(self, item):
            pass

    sunk = engine.submit([4, 5], max_new_tokens=2, ignore_eos=True, pieces=Sink())
    with pytest.raises(RequestError, match="read them there"):
        next(iter(sunk))
    sunk.result(timeout=30)
