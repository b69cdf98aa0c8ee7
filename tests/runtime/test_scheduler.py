"""runtime/scheduler.py on the tiny artifact: batched requests make exactly the tokens they make alone.

"Alone" is the engine's batch-1 path (Engine.generate with one prompt), itself checked against a full torch
recompute in test_engine.py. Timings are never asserted, only the order of events where the design fixes it.
"""
from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest

from runtime import Engine, ModelOutputError, QueueFullError, RequestError
from runtime.metrics import summarize


@pytest.fixture
def engine(tiny_engine):
    yield tiny_engine
    tiny_engine.close()  # stop the scheduler's worker thread


def mixed_requests(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens): prompts of 1..60 tokens, outputs of 1..40 tokens; always fits 128."""
    rng = np.random.default_rng(seed)
    return [([1] + rng.integers(3, 512, size=int(rng.integers(0, 60))).tolist(), int(rng.integers(1, 41)))
            for _ in range(count)]


def alone(engine, prompt: list[int], max_new_tokens: int, **sampling) -> list[int]:
    return engine.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, **sampling).token_ids


def slowed(scheduler, seconds: float = 0.002):
    """Make every graph run of this scheduler take at least `seconds`: a request stays running long enough for
    the test thread to act on it, however loaded the machine."""
    run = scheduler.cache.run

    def slow_run(*args):
        time.sleep(seconds)
        return run(*args)

    scheduler.cache.run = slow_run
    return scheduler


def admitted_while_others_decode(results) -> bool:
    """Some request began its prefill after another had made a decode step and before that other finished."""
    traces = [r.timings.trace for r in results]
    return any(len(a.token_times) > 1 and a.token_times[1] < b.prefill_start < a.finish for a in traces for b in traces)


def overlapping(results) -> int:
    """The most requests that were between prefill start and finish at the same moment."""
    spans = [(r.timings.trace.prefill_start, r.timings.trace.finish) for r in results]
    return max(sum(start <= s < finish for start, finish in spans) for s, _ in spans)


def test_slot_cache_views_share_memory_and_a_prefill_writes_only_its_slot(engine):
    cache = engine.backend.allocate_slots(3)
    views = cache.views(1, 2)
    assert [v.data_ptr() for v in views] == [a[1:2].ctypes.data for a in cache.arrays]  # zero-copy
    assert all(v.shape() == [1, *a.shape[1:]] for v, a in zip(views, cache.arrays))
    prompt = [1, 17, 300, 42, 9]
    ids, positions, mask = np.array([prompt]), np.arange(5)[None], np.ones((1, 5), dtype=np.int64)
    logits = cache.run("prefill", (1, 2), ids, positions, mask)
    np.testing.assert_array_equal(logits, engine.backend.run("prefill", ids, positions, mask))
    binding = cache._bindings[("prefill", 1, 2)][0]  # its presents are the slot's views, not outputs copied back
    assert [output.data_ptr() for output in binding.get_outputs()[1:]] == [a[1:2].ctypes.data for a in cache.arrays]
    batch_one = engine.backend.cache
    for name, array in zip(cache.backend.past_names, cache.arrays):
        expected = batch_one.buffers[batch_one.past_names.index(name)].numpy()
        np.testing.assert_array_equal(array[1, :, :5], expected[0, :, :5])  # written in place, in slot 1 only
        assert not array[0].any() and not array[2].any() and not array[1, :, 5:].any()


@pytest.mark.parametrize("batching, prefill_chunk", [("continuous", None), ("continuous", 7), ("static", None)])
def test_staggered_mixed_requests_make_their_alone_tokens(engine, batching, prefill_chunk):
    requests = mixed_requests(14)
    expected = [alone(engine, prompt, n) for prompt, n in requests]
    # slowed: on a fast host a tiny request finished before the next arrived, and nothing overlapped
    slowed(engine.start_scheduler(slots=4, batching=batching, prefill_chunk=prefill_chunk))
    handles = []
    for index, (prompt, n) in enumerate(requests):  # staggered: some arrive while others decode
        handles.append(engine.submit(prompt, max_new_tokens=n, ignore_eos=True))
        time.sleep(0.003 * (index % 3))
    results = [handle.result(timeout=60) for handle in handles]
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["length"] * len(requests)
    assert 1 < overlapping(results) <= 4  # batched, never more than the slots
    # static: a fixed batch runs to completion before the next one is admitted (its prefills all come before
    # its first decode step); continuous: a freed slot is refilled while the others go on decoding
    assert admitted_while_others_decode(results) == (batching == "continuous")
    summary = summarize([r.timings.trace for r in results])
    assert summary["output_tokens"] == sum(n for _, n in requests)


def test_sampling_seeds_and_stops_are_per_request(engine):
    cases = [dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=20, seed=3), dict(temperature=1.0, top_p=0.9,
             seed=11), {}]
    prompt = [1, 30, 31, 32]
    expected = [alone(engine, prompt, 20, **case) for case in cases]
    handles = [engine.submit(prompt, max_new_tokens=20, ignore_eos=True, **case) for case in cases]
    assert [h.result().token_ids for h in handles] == expected
    greedy = expected[-1]
    by_token = engine.submit(prompt, max_new_tokens=20, stop_token_ids=(greedy[3],)).result()
    assert by_token.finish_reason == "stop" and by_token.token_ids == greedy[:3]
    assert by_token.timings.output_tokens == 4  # the stop token counts as produced, not as output
    text = engine.generate(prompt, max_new_tokens=20, ignore_eos=True).text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    reference = engine.generate(prompt, max_new_tokens=20, ignore_eos=True, stop_strings=(stop,))
    by_string = engine.submit(prompt, max_new_tokens=20, ignore_eos=True, stop_strings=(stop,)).result()
    assert (by_string.finish_reason, by_string.text, by_string.token_ids) == (
        "stop", reference.text, reference.token_ids)


def test_streamed_pieces_join_to_the_text(engine):
    handle = engine.submit("hello world", max_new_tokens=16, ignore_eos=True)
    pieces = list(handle)
    result = handle.result()
    assert "".join(pieces) == result.text == engine.generate("hello world", max_new_tokens=16, ignore_eos=True).text
    assert result.timings.output_tokens == 16 and result.prompt_token_ids == handle.prompt_token_ids


def test_streamed_pieces_stop_where_the_text_does(engine):
    full = engine.generate("hello world", max_new_tokens=16, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip()
    handle = engine.submit("hello world", max_new_tokens=16, ignore_eos=True, stop_strings=(stop,))
    pieces = list(handle)
    assert handle.result().finish_reason == "stop"
    assert "".join(pieces) == handle.result().text == full.split(stop, 1)[0]


def test_the_result_names_the_stop_string_that_ended_it_on_both_paths(engine):
    """vLLM's stop_reason: a caller passing several stops (an agent's "Observation:" and "Final Answer:") could not
    tell which fired, the text being cut before it."""
    full = engine.generate("hello world", max_new_tokens=16, ignore_eos=True).text
    later, earlier = full[len(full) // 2: len(full) // 2 + 2], full[2:4]
    assert full.find(earlier) == 2 and full.find(later) > 2 and later.strip() and earlier.strip()
    stops = dict(max_new_tokens=16, ignore_eos=True, stop_strings=(later, earlier, "never in the text"))
    alone_result = engine.generate("hello world", **stops)
    batched = engine.submit("hello world", **stops).result()
    for result in (alone_result, batched):
        assert result.stop_string == earlier and result.text == full[:2] and result.finish_reason == "stop"
    assert engine.generate("hello world", max_new_tokens=3, ignore_eos=True).stop_string is None


def test_generate_a_list_runs_through_the_scheduler(engine):
    prompts = ["one", [1, 5, 6], "three little words"]
    expected = [engine.generate(p, max_new_tokens=9, ignore_eos=True).token_ids for p in prompts]
    results = engine.generate(prompts, max_new_tokens=9, ignore_eos=True)
    assert [r.token_ids for r in results] == expected and engine._scheduler is not None
    assert engine.generate([1, 5, 6], max_new_tokens=9, ignore_eos=True).token_ids == expected[1]  # ids: one prompt


def test_cancel_frees_the_slot_and_others_are_unaffected(engine):
    scheduler = slowed(engine.start_scheduler(slots=2))
    long, other, late = [1, 7, 8, 9], [1, 40, 41], [1, 99]
    expected_other, expected_late = alone(engine, other, 110), alone(engine, late, 5)
    cancelled = engine.submit(long, max_new_tokens=110, ignore_eos=True)
    running = engine.submit(other, max_new_tokens=110, ignore_eos=True)
    waiting = engine.submit(late, max_new_tokens=5, ignore_eos=True)  # no free slot until one is cancelled
    next(iter(cancelled))  # it is running: it made a token
    cancelled.cancel()
    result = cancelled.result(timeout=30)
    assert result.finish_reason == "cancelled" and 1 <= len(result.token_ids) < 110
    assert result.token_ids == alone(engine, long, 110)[: len(result.token_ids)]
    assert waiting.result(timeout=30).token_ids == expected_late
    finished = running.result(timeout=30)
    assert finished.token_ids == expected_other
    assert waiting.result().timings.trace.prefill_start < finished.timings.trace.finish  # took the freed slot
    assert scheduler._running == [None, None]


def test_cancel_a_waiting_request_removes_it_from_the_queue(engine):
    slowed(engine.start_scheduler(slots=1, max_queue=1))
    first = engine.submit([1, 2, 3], max_new_tokens=100, ignore_eos=True)
    next(iter(first))
    queued = engine.submit([1, 4], max_new_tokens=3)
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([1, 5], max_new_tokens=3)
    queued.cancel()
    result = queued.result(timeout=1)
    assert (result.finish_reason, result.token_ids, result.timings) == ("cancelled", [], None)
    assert engine.submit([1, 5], max_new_tokens=3, ignore_eos=True).result(timeout=30).token_ids  # room again
    assert len(first.result(timeout=30).token_ids) == 100


def test_under_static_batching_free_slots_beside_a_running_batch_are_no_queue_room(engine):
    """A static batch runs to its end before the next is admitted: its free slots hold no one meanwhile, so the
    requests sent then all wait in the queue, and max_queue bounds them."""
    slowed(engine.start_scheduler(slots=2, max_queue=1, batching="static"))
    first = engine.submit([1, 2, 3], max_new_tokens=60, ignore_eos=True)
    next(iter(first))  # running, one of the two slots free
    queued = engine.submit([1, 4], max_new_tokens=3, ignore_eos=True)
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([1, 5], max_new_tokens=3, ignore_eos=True)
    assert queued.result(timeout=30).token_ids == alone(engine, [1, 4], 3)
    assert len(first.result(timeout=30).token_ids) == 60


def test_a_new_prompt_takes_the_slot_whose_prefix_was_left_longest_ago(tiny_artifact):
    """With every free slot holding a prefix, a prompt that shares none evicts the oldest: the conversation left
    last keeps its prefix for its next turn."""
    engine = Engine.load(tiny_artifact, prefix_caching=True)
    try:
        engine.start_scheduler(slots=2)
        older, newer = [1] + list(range(100, 140)), [1] + list(range(200, 240))
        for prompt in (older, newer):  # one after the other: older's slot is left first
            first_turn = engine.submit(prompt, max_new_tokens=4, ignore_eos=True).result(timeout=30)
        unrelated = engine.submit([1] + list(range(300, 340)), max_new_tokens=4, ignore_eos=True)
        unrelated.result(timeout=30)
        follow_up = newer + first_turn.token_ids + [7, 8, 9]
        result = engine.submit(follow_up, max_new_tokens=4, ignore_eos=True).result(timeout=30)
        assert result.timings.cached_prompt_tokens >= len(newer)  # newer's slot survived the unrelated prompt
        assert result.token_ids == alone(engine, follow_up, 4)
    finally:
        engine.close()


def test_the_prefix_left_longest_ago_is_evicted_not_the_lowest_slots(tiny_artifact):
    """Above, the oldest prefix was always slot 0's: evicting the lowest-numbered slot passed it (a mutation audit).
    Here slot 0's conversation comes back and is newer than slot 1's, so an unrelated prompt must take slot 1."""
    engine = Engine.load(tiny_artifact, prefix_caching=True)
    try:
        engine.start_scheduler(slots=2)
        chat, other = [1] + list(range(100, 140)), [1] + list(range(200, 240))
        first = engine.submit(chat, max_new_tokens=4, ignore_eos=True).result(timeout=30)  # slot 0
        engine.submit(other, max_new_tokens=4, ignore_eos=True).result(timeout=30)  # slot 1
        second_turn = chat + first.token_ids + [7, 8, 9]
        second = engine.submit(second_turn, max_new_tokens=4, ignore_eos=True).result(timeout=30)  # slot 0, newest
        assert second.timings.cached_prompt_tokens > 0
        engine.submit([1] + list(range(300, 340)), max_new_tokens=4, ignore_eos=True).result(timeout=30)
        third_turn = second_turn + second.token_ids + [10, 11]
        third = engine.submit(third_turn, max_new_tokens=4, ignore_eos=True).result(timeout=30)
        assert third.timings.cached_prompt_tokens >= len(second_turn)
    finally:
        engine.close()


def test_a_request_that_filled_the_context_leaves_a_record_decode_steps_can_run_beside(tiny_artifact):
    """A request ending at the max context kept a record of every position. A free row's record sets where a
    batched decode step writes its throw-away row: past the cache here (onnxruntime refused: cos_cache shorter than
    total_sequence_length), so the next request, decoding in the other slot, failed."""
    engine = Engine.load(tiny_artifact, prefix_caching=True)
    try:
        engine.start_scheduler(slots=2)
        prompt = [1] + list(range(50, 110))
        filled = engine.submit(prompt, max_new_tokens=engine.max_context + 1 - len(prompt),
                               ignore_eos=True).result(timeout=60)
        assert len(prompt) + len(filled.token_ids) - 1 == engine.max_context
        other = [1] + list(range(300, 320))  # shares nothing: the empty slot, its steps over both rows
        assert engine.submit(other, max_new_tokens=5, ignore_eos=True).result(timeout=60).token_ids == alone(
            engine, other, 5)
        again = prompt + filled.token_ids[:10]  # and the record is still there to reuse
        result = engine.submit(again, max_new_tokens=5, ignore_eos=True).result(timeout=60)
        assert result.timings.cached_prompt_tokens > 0 and result.token_ids == alone(engine, again, 5)
    finally:
        engine.close()


def test_a_full_queue_counts_requests_about_to_take_free_slots_apart(engine):
    """Requests accepted for free slots wait for the worker's next admission, not in the queue: the refusal said "4 of
    2 queue places taken, 0 of 2 slots busy"."""
    scheduler = engine.start_scheduler(slots=2, max_queue=2)
    go, work = threading.Event(), scheduler._work
    scheduler._work = lambda: (go.wait(60), work())  # the worker starts late: nothing is admitted yet
    try:
        handles = [engine.submit([1, n], max_new_tokens=3, ignore_eos=True) for n in (10, 11, 12, 13)]
        with pytest.raises(RequestError, match=r"queue is full \(2 of 2 queue places taken, 0 of 2 slots busy, 2 "
                                               r"about to take free slots\)"):
            engine.submit([1, 14], max_new_tokens=3)
    finally:
        go.set()
    assert [len(handle.result(timeout=60).token_ids) for handle in handles] == [3, 3, 3, 3]


def test_full_queue_refuses_and_loses_nothing(engine):
    slowed(engine.start_scheduler(slots=1, max_queue=2))
    first = engine.submit([1, 2, 3], max_new_tokens=100, ignore_eos=True)
    next(iter(first))  # admitted: the two below wait
    queued = [engine.submit([1, n], max_new_tokens=4, ignore_eos=True) for n in (10, 11)]
    with pytest.raises(RequestError, match=r"queue is full \(2 of 2 queue places taken, 1 of 1 slots busy\)"):
        engine.submit([1, 12], max_new_tokens=4)
    blocked: list = []
    thread = threading.Thread(target=lambda: blocked.append(engine.submit([1, 12], max_new_tokens=4, block=True,
                                                                            ignore_eos=True)))
    thread.start()  # waits for room instead of refusing
    thread.join(timeout=60)
    results = [h.result(timeout=30) for h in [first, *queued, *blocked]]
    assert [len(r.token_ids) for r in results] == [100, 4, 4, 4]
    assert [r.token_ids for r in results[1:]] == [alone(engine, [1, n], 4) for n in (10, 11, 12)]


def test_a_request_that_can_never_fit_is_refused_at_submit(engine):
    with pytest.raises(RequestError, match=r"prompt \(100 tokens\) \+ max_new_tokens \(40\) need 139 cache positions"
                                           r".*max context is 128; ask for at most 29"):
        engine.submit([5] * 100, max_new_tokens=40)
    with pytest.raises(RequestError, match="max context is 128"):
        engine.submit([5] * 200)
    with pytest.raises(RequestError, match="empty"):
        engine.submit([])
    exact = engine.submit([5] * 100, max_new_tokens=29, ignore_eos=True).result(timeout=30)  # the last one fits
    assert len(exact.token_ids) == 29


def test_a_failing_graph_fails_running_requests_and_serving_goes_on(engine, monkeypatch):
    scheduler = engine.start_scheduler(slots=2)
    run = scheduler.cache.run
    calls = []

    def flaky(phase, *args):
        calls.append(phase)
        if len(calls) == 3:
            raise RuntimeError("graph failed")
        return run(phase, *args)

    monkeypatch.setattr(scheduler.cache, "run", flaky)
    handle = engine.submit([1, 2, 3], max_new_tokens=10, ignore_eos=True)
    with pytest.raises(RuntimeError, match="graph failed"):
        handle.result(timeout=30)
    with pytest.raises(RuntimeError, match="graph failed"):
        list(handle)
    assert engine.submit([1, 2, 3], max_new_tokens=4, ignore_eos=True).result(timeout=30).token_ids == alone(
        engine, [1, 2, 3], 4)


def test_a_failing_prefill_fails_its_request_alone(engine, monkeypatch):
    """B's prefill fails (out of memory on a long prompt, say) while A decodes in another slot: A had been failed too,
    though its cache rows were not in B's run."""
    scheduler = engine.start_scheduler(slots=2)
    run = scheduler.cache.run

    def failing_for_b(phase, rows, ids, *args):
        if phase == "prefill" and 77 in ids:
            raise RuntimeError("prefill of B failed")
        return run(phase, rows, ids, *args)

    monkeypatch.setattr(scheduler.cache, "run", failing_for_b)
    first = engine.submit([1, 2, 3], max_new_tokens=12, ignore_eos=True)
    next(iter(first))  # A is decoding
    second = engine.submit([1, 77, 3], max_new_tokens=4, ignore_eos=True)
    with pytest.raises(RuntimeError, match="prefill of B failed"):
        second.result(timeout=30)
    assert first.result(timeout=30).token_ids == alone(engine, [1, 2, 3], 12)


def test_a_failing_batched_prefill_fails_only_the_prompt_that_fails_alone(engine, monkeypatch):
    """Prompts admitted together are prefilled as one batch padded to the longest: its run out of memory failed
    the short prompts beside the long one, which went through when submitted again."""
    scheduler = engine.start_scheduler(slots=4)
    run = scheduler.cache.run
    batched = []

    def out_of_memory_when_wide(phase, rows, ids, *args):
        batched.append(phase == "prefill" and ids.shape[0] > 1)
        if phase == "prefill" and ids.shape[1] >= 60:
            raise MemoryError("prefill too wide")
        return run(phase, rows, ids, *args)

    monkeypatch.setattr(scheduler.cache, "run", out_of_memory_when_wide)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [3] * 70]
    with scheduler._lock:  # submitted together: admitted in one iteration, into slots 0 to 3
        handles = [engine.submit(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
    with pytest.raises(MemoryError, match="prefill too wide"):
        handles[3].result(timeout=30)
    assert batched[0]  # they were tried as one batch first
    monkeypatch.setattr(scheduler.cache, "run", run)
    for prompt, handle in zip(prompts[:3], handles):
        assert handle.result(timeout=30).token_ids == alone(engine, prompt, 5)


def test_nan_logits_in_one_row_fail_that_request_alone(engine, monkeypatch):
    scheduler = engine.start_scheduler(slots=2)
    run = scheduler.cache.run
    decodes = []

    def nan_in_slot_one(phase, rows, *args):
        logits = run(phase, rows, *args)
        if phase == "decode" and rows == (0, 2):
            decodes.append(rows)
            if len(decodes) == 2:  # both are decoding: poison the second slot's row only
                logits = logits.copy()
                logits[1] = np.nan
        return logits

    monkeypatch.setattr(scheduler.cache, "run", nan_in_slot_one)
    with scheduler._lock:  # submitted together: admitted in one iteration, into slots 0 and 1
        healthy = engine.submit([1, 2, 3], max_new_tokens=8, ignore_eos=True)
        poisoned = engine.submit([1, 4, 5, 6], max_new_tokens=8, ignore_eos=True)
    with pytest.raises(ModelOutputError, match="logits contain NaN"):
        poisoned.result(timeout=30)
    assert healthy.result(timeout=30).token_ids == alone(engine, [1, 2, 3], 8)


def test_a_list_generate_names_the_prompt_that_failed(engine, monkeypatch):
    """Refusals at submit said prompts[i]; a failure while running (NaN logits) named none of hundreds."""
    scheduler = engine.start_scheduler(slots=2)
    run = scheduler.cache.run

    def nan_for_the_second(phase, rows, ids, *args):
        logits = run(phase, rows, ids, *args)
        if phase == "prefill" and 77 in ids:  # its row alone: the two may be prefilled as one batch
            logits = logits.copy()
            logits[[77 in row for row in ids]] = np.nan
        return logits

    monkeypatch.setattr(scheduler.cache, "run", nan_for_the_second)
    with pytest.raises(ModelOutputError, match=r"^prompts\[1\]: the model's logits contain NaN"):
        engine.generate([[1, 2, 3], [1, 77, 3]], max_new_tokens=4, ignore_eos=True)


def test_close_fails_unfinished_requests_and_refuses_new_ones(engine):
    scheduler = slowed(engine.start_scheduler(slots=1))
    handles = [engine.submit([1, n], max_new_tokens=100, ignore_eos=True) for n in (5, 6)]
    next(iter(handles[0]))
    scheduler.close()
    for handle in handles:
        with pytest.raises(RequestError, match="closed before this request finished"):
            handle.result(timeout=30)
    with pytest.raises(RequestError, match="scheduler is closed"):
        scheduler.submit([1, 2], max_new_tokens=2)


@pytest.mark.parametrize("options, message", [
    (dict(slots=0), "slots: 0 must be an integer >= 1"), (dict(batching="dynamic"), "not one of continuous, static"),
    (dict(max_queue=0), "max_queue: 0 must be an integer >= 1"),
    (dict(prefill_chunk=0), "prefill_chunk: 0 must be an integer >= 1"), (dict(slots=2.5), "slots: 2.5 must be an integer"),
    (dict(max_queue=None), "max_queue: None must be an integer >= 1"),  # was int(None)'s TypeError
    (dict(slotz=2), r"start_scheduler: unknown option 'slotz'; the options are slots, batching, max_queue, "
                    r"prefill_chunk, idle_exit_s"),
    (dict(idle_exit_s=-1), r"idle_exit_s: -1 must be a number of seconds from 0 to \d+, or math.inf"),
    (dict(idle_exit_s=1e12), r"idle_exit_s: 1000000000000.0 must be a number of seconds from 0 to"),  # overflowed
    (dict(slots=10**9), r"slots: 1000000000 sequences need .* GiB of KV cache"),  # closed the running one, then refused
])
def test_bad_scheduler_options_are_refused_and_the_running_scheduler_serves_on(engine, options, message):
    running = slowed(engine.start_scheduler(slots=2))
    handle = engine.submit([1, 5, 9], max_new_tokens=20, ignore_eos=True)
    with pytest.raises(RequestError, match=message):
        engine.start_scheduler(**options)
    assert engine._scheduler is running  # refused before anything stopped: the request in flight completes
    assert handle.result(timeout=60).finish_reason == "length"


def test_a_scheduler_stays_within_the_rows_and_tokens_the_engines_run(engine, monkeypatch):
    """TensorRT's engines run at most export.max_batch rows and decode_max_tokens tokens per decode call (their
    optimization profile; onnxruntime's: no limit). Slots or prompt chunks beyond them are refused at start with
    the fix, and the default slots shrink to fit (before, the first step over the limit failed inside TensorRT)."""
    monkeypatch.setattr(engine.backend, "max_batch", 4)
    monkeypatch.setattr(engine.backend, "max_decode_tokens", 16)
    monkeypatch.setattr(engine.backend, "prefill_takes_past", False)  # as TensorRT's: later chunks run the decode engine
    with pytest.raises(RequestError, match=r"slots: 6, but this artifact's engines run at most 4 sequences per step; "
                                           r"use slots <= 4, or rebuild with export.max_batch: 6"):
        engine.start_scheduler(slots=6)
    with pytest.raises(RequestError, match=r"prefill_chunk: 32, but .* at most 16 tokens per call; use prefill_chunk "
                                           r"<= 16, or rebuild with backend.tensorrt.decode_max_tokens: 32"):
        engine.start_scheduler(slots=2, prefill_chunk=32)
    assert engine.start_scheduler().slots == 4
    scheduler = slowed(engine.start_scheduler(slots=2, prefill_chunk=16), seconds=0.01)
    calls = []  # (graph, tokens per row) of every graph run
    run = scheduler.cache.run
    scheduler.cache.run = lambda phase, rows, ids, *rest: calls.append((phase, ids.shape[1])) or run(phase, rows, ids,
                                                                                                         *rest)
    short, long = ([1, 9, 10], 100), ([1] + list(range(3, 63)), 5)  # 100 steps of >= 10 ms: still decoding
    alone = [engine.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids for prompt, n in (short, long)]
    first = scheduler.submit(short[0], max_new_tokens=short[1], ignore_eos=True)
    deadline = time.monotonic() + 30
    while not scheduler._running[0] or scheduler._running[0].next_token is None:  # until it decodes (100 steps of
        assert time.monotonic() < deadline, "the short request never started decoding"  # >= 10 ms: it still
        time.sleep(0.001)                                                                 # does when the long comes)
    second = scheduler.submit(long[0], max_new_tokens=long[1], ignore_eos=True)
    assert [first.result(timeout=60).token_ids, second.result(timeout=60).token_ids] == alone
    # The 61-token prompt arrived while the short request decoded: 16 tokens through the prefill graph, then
    # chunks of 16, 16 and 13 through the decode graph at batch 1, between the short request's steps.
    chunks = [(phase, tokens) for phase, tokens in calls if tokens > 1 or phase == "prefill"]
    assert chunks == [("prefill", 3), ("prefill", 16), ("decode", 16), ("decode", 16), ("decode", 13)], chunks


def test_requests_admitted_together_prefill_as_one_padded_batch(engine):
    """Eight prompts of near lengths submitted at once land in neighbouring slots: one right-padded prefill run
    (the same prefill start for all), and still each request's alone tokens."""
    rng = np.random.default_rng(3)
    requests = [([1] + rng.integers(3, 512, size=int(rng.integers(40, 49))).tolist(), int(rng.integers(1, 41)))
                for _ in range(8)]
    expected = [alone(engine, prompt, new) for prompt, new in requests]
    scheduler = engine.start_scheduler(slots=8)
    with scheduler._lock:  # re-entrant: submit takes it too; the worker waits until all eight are queued
        handles = [scheduler.submit(prompt, max_new_tokens=new, ignore_eos=True) for prompt, new in requests]
    results = [handle.result(timeout=60) for handle in handles]
    assert [r.token_ids for r in results] == expected
    starts = {r.timings.trace.prefill_start for r in results}
    assert len(starts) == 1, "the eight queued requests did not share one prefill run"


def test_a_long_prompt_beside_short_ones_is_not_padded_into_their_batch(engine):
    """Seven 4-token prompts and a 100-token one admitted together were one [8 x 100] run: every short prompt (and
    every decoding request) waited for 800 rows of work where 128 were real (6 s against 0.09 s on the default
    model). A batch's rows stay within 1.25 times its tokens: the long prompt runs on its own."""
    rng = np.random.default_rng(4)
    prompts = [[1] + rng.integers(3, 512, size=3).tolist() for _ in range(7)] + [[1] * 100]
    expected = [alone(engine, prompt, 2) for prompt in prompts]
    scheduler = engine.start_scheduler(slots=8)
    runs = []
    run = scheduler.cache.run
    scheduler.cache.run = lambda phase, rows, ids, *rest: (runs.append((phase, ids.shape)), run(phase, rows, ids,
                                                                                                   *rest))[1]
    with scheduler._lock:
        handles = [scheduler.submit(prompt, max_new_tokens=2, ignore_eos=True) for prompt in prompts]
    assert [handle.result(timeout=60).token_ids for handle in handles] == expected
    assert [shape for phase, shape in runs if phase == "prefill"] == [(7, 4), (1, 100)]


def test_prompts_admitted_into_slots_apart_are_not_one_batch(engine):
    """Two prompts admitted together into slots 0 and 2, a request decoding in slot 1 between them: a padded batch
    runs a contiguous block of rows, which would take in slot 1's, so each is prefilled alone in its own slot."""
    prompts = [[1, 17, 42, 99], [1, 60, 61, 62, 63, 64]]
    expected = [alone(engine, prompt, 6) for prompt in prompts]
    scheduler = slowed(engine.start_scheduler(slots=3), seconds=0.01)
    with scheduler._lock:  # into slots 0, 1 and 2; the first and the last finish at their first token
        first, decoding, last = [engine.submit(prompt, max_new_tokens=n, ignore_eos=True)
                                 for prompt, n in (([1, 2], 1), ([1, 3, 4], 100), ([1, 5], 1))]
    for finished in (first, last):
        finished.result(timeout=30)
    prefill_rows = []
    run = scheduler.cache.run
    scheduler.cache.run = lambda phase, rows, *rest: (phase == "prefill" and prefill_rows.append(rows),
                                                      run(phase, rows, *rest))[1]
    with scheduler._lock:  # admitted in one iteration, into the free slots 0 and 2
        handles = [engine.submit(prompt, max_new_tokens=6, ignore_eos=True) for prompt in prompts]
    assert [handle.result(timeout=30).token_ids for handle in handles] == expected
    assert sorted(prefill_rows) == [(0, 1), (2, 3)] and not decoding.done()  # slot 1 was busy throughout


def prompt_chunked_behind_a_decode(engine, prefill_chunk: int) -> list[tuple[str, int, bool]]:
    """A 100-token prompt submitted while a short request decodes (5 tokens, every run slowed by 50 ms), with
    prefill_chunk; both must make their alone tokens. Returns the prefill graph's runs and the decode graph's over
    more than one token per row: (graph, tokens per row, whether the short request had finished)."""
    scheduler = slowed(engine.start_scheduler(slots=2, prefill_chunk=prefill_chunk), seconds=0.05)
    calls = []
    run = scheduler.cache.run
    short, long = [1, 9, 10], [1] + list(range(3, 102))
    alone_tokens = [alone(engine, short, 5), alone(engine, long, 3)]
    first = scheduler.submit(short, max_new_tokens=5, ignore_eos=True)
    scheduler.cache.run = lambda phase, rows, ids, *rest: calls.append((phase, ids.shape[1], first.done())) or run(
        phase, rows, ids, *rest)
    deadline = time.monotonic() + 30
    while not scheduler._running[0] or scheduler._running[0].next_token is None:
        assert time.monotonic() < deadline, "the short request never started decoding"
        time.sleep(0.001)
    second = scheduler.submit(long, max_new_tokens=3, ignore_eos=True)
    assert [first.result(timeout=60).token_ids, second.result(timeout=60).token_ids] == alone_tokens
    return [(phase, tokens, done) for phase, tokens, done in calls if tokens > 1 or phase == "prefill"]


@pytest.mark.parametrize("max_decode_tokens, prefill_chunk", [(16, 16), (None, 16), (32, 12)])
def test_the_rest_of_a_chunked_prompt_stays_within_the_decode_graphs_tokens(engine, monkeypatch, max_decode_tokens,
                                                                             prefill_chunk):
    """A prompt chunked while another request decoded: once that request finishes, the rest of the prompt still
    goes through the decode graph, in chunks of at most prefill_chunk tokens, and of at most decode_max_tokens
    where TensorRT bounds a call (onnxruntime: None). Before, the whole rest went in one call (here 36 tokens):
    onnxruntime's decode runs over many tokens hold memory faster than their count grows (+1.5 GB for 1000)."""
    monkeypatch.setattr(engine.backend, "max_decode_tokens", max_decode_tokens)
    monkeypatch.setattr(engine.backend, "prefill_takes_past", False)  # the decode graph's path (TensorRT's)
    short_prefill, *chunks = prompt_chunked_behind_a_decode(engine, prefill_chunk)
    assert short_prefill == ("prefill", 3, False), short_prefill
    assert chunks[0][:2] == ("prefill", prefill_chunk) and sum(tokens for _, tokens, _ in chunks) == 100, chunks
    assert any(done for _, _, done in chunks), f"the short request never finished mid-prompt: {chunks}"
    assert max(tokens for phase, tokens, _ in chunks if phase == "decode") == prefill_chunk, chunks


def test_a_prefill_graph_that_takes_a_past_runs_every_chunk_of_a_prompt(engine):
    """Where the build found the prefill graph attends to a past (engines.prefill.takes_past), a prompt chunked
    while another request decodes goes on through it, not the decode graph (which computes the lm_head at every
    position), and its rest in one run once nothing decodes; the tokens are the ones it makes alone."""
    assert engine.backend.prefill_takes_past
    chunks = prompt_chunked_behind_a_decode(engine, 16)[1:]  # after the short request's prefill
    assert {phase for phase, _, _ in chunks} == {"prefill"} and sum(tokens for _, tokens, _ in chunks) == 100, chunks
    assert all(tokens == 16 for _, tokens, done in chunks[:-1] if not done), chunks  # chunks while it decoded
    assert chunks[-1][2] and chunks[-1][1] <= 100 - 16, chunks  # then the rest at once


@pytest.mark.parametrize("prefill_chunk", [1, 3])
def test_no_piece_of_a_chunked_prompt_runs_the_prefill_graph_as_one_row(engine, prefill_chunk):
    """A one-row run takes matrix-vector kernels that round otherwise: a prompt of 100 in chunks of 3 left its last
    token alone (and chunks of 1 were all alone), which on INT4 weights changed the greedy reply. A chunk then takes
    a token or two past prefill_chunk rather than leave one."""
    chunks = prompt_chunked_behind_a_decode(engine, prefill_chunk)[1:]
    assert sum(tokens for _, tokens, _ in chunks) == 100 and min(tokens for _, tokens, _ in chunks) >= 2, chunks
    assert all(tokens <= prefill_chunk + 2 for _, tokens, done in chunks if not done), chunks


def test_a_prompt_with_nothing_decoding_beside_it_is_prefilled_whole_despite_prefill_chunk(engine):
    """prefill_chunk bounds a prompt's tokens per iteration only while other requests decode (so that their tokens
    do not stall): a prompt alone runs in one prefill, however long."""
    scheduler = engine.start_scheduler(slots=2, prefill_chunk=8)
    calls = []
    run = scheduler.cache.run
    scheduler.cache.run = lambda phase, rows, ids, *rest: calls.append((phase, ids.shape[1])) or run(phase, rows, ids,
                                                                                                         *rest)
    prompt = [1] + list(range(3, 43))
    result = scheduler.submit(prompt, max_new_tokens=3, ignore_eos=True).result(timeout=30)
    assert result.token_ids == alone(engine, prompt, 3)
    assert calls == [("prefill", 41), ("decode", 1), ("decode", 1)]


def test_a_done_callback_that_waits_on_another_request_does_not_block_the_scheduler(engine):
    """cancel() of a waiting request, and close(), complete handles after releasing the scheduler's lock, so a
    callback may wait on a running request or submit another (it used to block the worker forever)."""
    scheduler = slowed(engine.start_scheduler(slots=1), seconds=0.01)
    first = engine.submit([1, 2, 3], max_new_tokens=40, ignore_eos=True)
    next(iter(first))
    queued = engine.submit([1, 4], max_new_tokens=3)
    queued.add_done_callback(lambda _: first.result(timeout=60))
    canceller = threading.Thread(target=queued.cancel, daemon=True)
    canceller.start()
    assert len(first.result(timeout=60).token_ids) == 40
    canceller.join(timeout=60)
    assert not canceller.is_alive() and queued.result(timeout=1).finish_reason == "cancelled"
    resubmitted = []
    running = engine.submit([1, 5], max_new_tokens=100, ignore_eos=True)
    next(iter(running))
    running.add_done_callback(lambda _: resubmitted.append(engine.submit([1, 6], max_new_tokens=2)))
    closer = threading.Thread(target=scheduler.close, daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() blocked on a done-callback"
    with pytest.raises(RequestError, match="closed before this request finished"):
        running.result(timeout=1)
    deadline = time.monotonic() + 30  # the callback runs on the callback thread
    while not resubmitted:
        assert time.monotonic() < deadline, "the done-callback never ran"
        time.sleep(0.01)
    assert len(resubmitted) == 1 and resubmitted[0].result(timeout=60).finish_reason in ("length", "stop")


def test_a_handles_callbacks_run_in_the_order_they_were_added(engine):
    """One added after the result was set ran at once, in the caller's thread, ahead of one added before it that
    was still due on the callback thread behind another request's slow callback."""
    engine.start_scheduler(slots=2)
    order = []
    first = engine.submit([1, 2], max_new_tokens=2, ignore_eos=True)
    first.add_done_callback(lambda _: time.sleep(0.5))
    second = engine.submit([1, 3], max_new_tokens=2, ignore_eos=True)
    second.add_done_callback(lambda _: order.append("added first"))
    second.result(timeout=30)
    first.result(timeout=30)
    second.add_done_callback(lambda _: order.append("added second"))
    deadline = time.monotonic() + 30
    while len(order) < 2:
        assert time.monotonic() < deadline, order
        time.sleep(0.01)
    assert order == ["added first", "added second"]


def test_submit_after_the_scheduler_was_closed_directly_starts_a_new_one(engine):
    closed = engine.start_scheduler(slots=2)
    closed.close()
    result = engine.submit([1, 2], max_new_tokens=3, ignore_eos=True).result(timeout=60)
    assert result.token_ids == alone(engine, [1, 2], 3) and engine._scheduler is not closed


def test_generate_a_list_interrupted_cancels_the_requests_left(engine, monkeypatch):
    from runtime.request_handle import RequestHandle

    slowed(engine.start_scheduler(slots=1), seconds=0.01)
    handles = []
    submit = engine._scheduler.submit
    monkeypatch.setattr(engine._scheduler, "submit", lambda *a, **kw: handles.append(submit(*a, **kw)) or handles[-1])
    real_result = RequestHandle.result

    def interrupted(self, timeout=None):  # the caller's Ctrl-C while waiting for the first result
        raise KeyboardInterrupt

    monkeypatch.setattr(RequestHandle, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3], [1, 4], [1, 5]], max_new_tokens=60, ignore_eos=True)
    monkeypatch.setattr(RequestHandle, "result", real_result)
    assert len(handles) == 3
    assert [h.result(timeout=60).finish_reason for h in handles] == ["cancelled"] * 3


def test_a_worker_that_never_idles_out_serves_on(engine):
    """idle_exit_s=math.inf (never exit) made the idle worker's wait overflow: the thread died, and every later
    request waited forever."""
    import math

    engine.start_scheduler(slots=2, idle_exit_s=math.inf)
    assert engine.submit([1, 2], max_new_tokens=3, ignore_eos=True).result(timeout=30).finish_reason == "length"
    time.sleep(0.05)  # the worker is idle now, waiting
    assert engine.submit([1, 3], max_new_tokens=3, ignore_eos=True).result(timeout=30).finish_reason == "length"
    assert engine._scheduler._worker.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # re-raised there, as it should
def test_a_worker_stopped_by_a_base_exception_fails_its_requests_and_a_new_one_serves(engine):
    """A BaseException (SystemExit) passes every `except Exception` and stops the worker thread: the requests behind
    it waited forever, and no submit started another worker."""
    scheduler = slowed(engine.start_scheduler(slots=1))
    run, calls = scheduler.cache.run, []

    def exit_on_the_fourth_run(*args):
        calls.append(args[0])
        if len(calls) == 4:
            raise SystemExit(1)
        return run(*args)

    scheduler.cache.run = exit_on_the_fourth_run
    first = engine.submit([1, 2], max_new_tokens=5, ignore_eos=True)
    behind = engine.submit([1, 3], max_new_tokens=5, ignore_eos=True)  # waits for the one slot
    for handle in (first, behind):
        with pytest.raises(RequestError, match=r"worker thread stopped \(SystemExit\(1\)\)"):
            handle.result(timeout=30)
    assert scheduler.submit([1, 4], max_new_tokens=2, ignore_eos=True).result(timeout=30).finish_reason == "length"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # re-raised there, as it should
def test_a_stopped_worker_failing_its_requests_leaves_a_new_workers_request_in_its_slot(engine):
    """The stopped worker fails its requests after it let go of the lock: a submit may by then have started a new
    worker that admitted a request into a slot the failed one held. Freeing that slot again would drop the new request,
    which would never finish."""
    later_prompt = [1, 4, 5]
    expected = alone(engine, later_prompt, 20)
    scheduler = slowed(engine.start_scheduler(slots=1), seconds=0.01)
    run, calls, later = scheduler.cache.run, [], []

    def exit_on_the_third_run(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise SystemExit(1)
        return run(*args)

    fail = scheduler._fail

    def fail_once_a_new_worker_runs_a_request(sequence, error):  # the stopped worker's first failure waits for it
        if not later:
            later.append(scheduler.submit(later_prompt, max_new_tokens=20, ignore_eos=True))
            deadline = time.monotonic() + 30
            while scheduler._running[0] is None:  # admitted into slot 0 by the new worker
                assert time.monotonic() < deadline, "the new worker never admitted the request"
                time.sleep(0.001)
        fail(sequence, error)

    scheduler.cache.run = exit_on_the_third_run
    scheduler._fail = fail_once_a_new_worker_runs_a_request
    first = engine.submit([1, 2], max_new_tokens=5, ignore_eos=True)
    with pytest.raises(RequestError, match=r"worker thread stopped \(SystemExit\(1\)\)"):
        first.result(timeout=30)
    assert later[0].result(timeout=30).token_ids == expected


def test_a_callback_added_while_the_result_is_being_set_runs_after_the_earlier_ones(engine, monkeypatch, caplog):
    """Future.set_result marks the future done before it runs the callbacks added earlier: one added in between
    saw a done handle and an idle callback thread and ran at once, ahead of them (the sleep widens that window).
    And one that raised, added to a finished handle, raised into the caller instead of being logged."""
    import concurrent.futures._base as futures_base

    invoke = futures_base.Future._invoke_callbacks
    monkeypatch.setattr(futures_base.Future, "_invoke_callbacks", lambda future: time.sleep(0.3) or invoke(future))
    engine.start_scheduler(slots=2)
    order = []
    handle = engine.submit([1, 5, 7], max_new_tokens=3, ignore_eos=True)
    handle.add_done_callback(lambda _: order.append("added first"))
    deadline = time.monotonic() + 30
    while not handle.done():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    handle.add_done_callback(lambda _: order.append("added second"))
    while len(order) < 2:
        assert time.monotonic() < deadline, order
        time.sleep(0.01)
    assert order == ["added first", "added second"]
    monkeypatch.setattr(futures_base.Future, "_invoke_callbacks", invoke)
    time.sleep(0.05)  # the callback thread has ended, so the next one runs here, at once: it must not raise here
    handle.add_done_callback(lambda _: 1 / 0)
    while "ZeroDivisionError" not in caplog.text:
        assert time.monotonic() < deadline, "the raising callback was not logged"
        time.sleep(0.01)
    assert "done-callback raised" in caplog.text


def test_a_done_callback_that_waits_on_the_scheduler_runs_off_its_worker(engine, caplog):
    """Done-callbacks ran on the worker thread, which completes requests: one that waited on another request
    (here a follow-up generate, as a server chains requests) waited on the worker itself, and nothing was served
    again. They run on a thread of their own now; one that raises (SystemExit too) is logged, and serving goes on."""
    engine.start_scheduler(slots=2)
    threads, follow_ups = [], []

    def follow_up(handle):
        threads.append(threading.current_thread().name)
        follow_ups.append(engine.generate([handle.result().token_ids[-3:]], max_new_tokens=3, ignore_eos=True))

    first = engine.submit([1, 5, 6], max_new_tokens=4, ignore_eos=True)
    first.add_done_callback(follow_up)
    first.add_done_callback(lambda _: (_ for _ in ()).throw(SystemExit(1)))
    assert first.result(timeout=30).finish_reason == "length"
    other = engine.submit([1, 7], max_new_tokens=2, ignore_eos=True)
    assert other.result(timeout=30).token_ids == alone(engine, [1, 7], 2)
    deadline = time.monotonic() + 30
    while not follow_ups:
        assert time.monotonic() < deadline, "the follow-up request never finished"
        time.sleep(0.01)
    assert follow_ups[0][0].token_ids == alone(engine, first.result().token_ids[-3:], 3)
    assert threads == ["aotlm-callbacks"]
    deadline = time.monotonic() + 30
    while "done-callback raised" not in caplog.text:
        assert time.monotonic() < deadline, "the raising callback was not logged"
        time.sleep(0.01)
    # With none due, a callback added to a done handle runs at once, here. (Asked while the callback thread still
    # ran the raising one, it went there, after it, as call_in_turn says: under load that had failed this test.)
    while engine._scheduler._callbacks._thread is not None:
        assert time.monotonic() < deadline, "the callback thread did not end"
        time.sleep(0.01)
    done_already = []
    first.add_done_callback(lambda _: done_already.append(threading.current_thread().name))
    assert done_already == [threading.current_thread().name]
    assert engine.submit([1, 8], max_new_tokens=2, ignore_eos=True).result(timeout=30).finish_reason == "length"


def test_a_closed_schedulers_slot_cache_is_freed_though_its_handles_are_kept(engine):
    """Handles refer to their scheduler: held by a caller, they kept each closed scheduler's whole slot cache."""
    kept = [engine.submit([1, 2], max_new_tokens=2, ignore_eos=True)]
    kept[0].result(timeout=30)
    first = engine._scheduler
    engine.start_scheduler(slots=2)  # closes the first
    kept.append(engine.submit([1, 2], max_new_tokens=2, ignore_eos=True))
    kept[1].result(timeout=30)
    second = engine._scheduler
    engine.close()
    assert first.cache is None and second.cache is None


def test_a_finished_handle_kept_does_not_keep_its_engine_alive(tiny_artifact):
    """A finished handle held its scheduler, which holds the engine and its sessions: 1.1 GB of the default model
    after close() and del, for each handle a caller kept (a request log, a list of futures). A callback added then
    still runs, and cancel() is a no-op, as on a done concurrent.futures.Future."""
    import gc
    import weakref

    engine = Engine.load(tiny_artifact)
    handle = engine.submit([1, 2, 3], max_new_tokens=2, ignore_eos=True)
    handle.result(timeout=30)
    alive = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert alive() is None
    seen = []
    handle.add_done_callback(seen.append)
    handle.cancel()
    assert seen == [handle] and handle.result().finish_reason == "length" and not handle.cancelled


def test_generate_a_list_counts_each_requests_wait_for_room_from_the_call(engine):
    """More prompts than slots + queue: each submit waits for room, and a later prompt's arrival was taken after
    that wait, so its TTFT left the wait out."""
    slowed(engine.start_scheduler(slots=1, max_queue=1), 0.005)
    called = time.perf_counter()
    results = engine.generate([[1, 2 + i] for i in range(4)], max_new_tokens=4, ignore_eos=True)
    for result in results:
        trace = result.timings.trace
        assert called <= trace.arrival <= results[0].timings.trace.prefill_start  # all from the call
        assert trace.first_token - trace.arrival == pytest.approx(result.timings.ttft_s)


def test_pieces_of_a_request_with_logprobs_carry_their_tokens(engine):
    from runtime import LoggedPiece

    handle = engine.submit([5, 6, 7], max_new_tokens=10, ignore_eos=True, logprobs=1, temperature=0.8, seed=3)
    pieces = list(handle)
    result = handle.result()
    assert pieces and all(isinstance(piece, LoggedPiece) for piece in pieces)
    assert "".join(pieces) == result.text
    carried = [token for piece in pieces for token in piece.token_ids]
    assert carried and carried == result.token_ids[:len(carried)]  # the rest, if any, made no text to stream
    assert [entry for piece in pieces for entry in piece.logprobs] == result.logprobs[:len(carried)]
    kept = pickle.loads(pickle.dumps(pieces[0]))
    assert (kept, kept.token_ids, kept.logprobs) == (pieces[0], pieces[0].token_ids, pieces[0].logprobs)
    plain = engine.submit([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    assert not any(isinstance(piece, LoggedPiece) for piece in plain)


def test_a_stop_tokens_logprobs_come_with_the_result_as_alone(engine):
    """The stop token is sampled but not output: its entry is the result's stop_token_logprobs (an API reports it, as
    vLLM does), as on the batch-1 path."""
    prompt = [1, 30, 31, 32]
    greedy = alone(engine, prompt, 12)
    stop = next(token for index, token in enumerate(greedy) if index >= 3 and token not in greedy[:index])
    options = dict(max_new_tokens=12, stop_token_ids=(stop,), logprobs=2)
    expected = engine.generate(prompt, **options)
    result = engine.submit(prompt, **options).result(timeout=30)
    assert (result.token_ids, result.stop_token_id) == (expected.token_ids, stop) == (greedy[:greedy.index(stop)], stop)
    entry, reference = result.stop_token_logprobs, expected.stop_token_logprobs
    assert list(entry) == list(reference) and list(entry)[0] == stop  # itself first, then the likeliest
    assert list(entry.values()) == pytest.approx(list(reference.values()), abs=1e-5)


@pytest.mark.parametrize("prefix_caching, prefill_chunk", [(False, None), (False, 5), (True, None)])
def test_scored_prompts_amid_other_requests_match_the_batch_one_path(tiny_artifact, monkeypatch, prefix_caching,
                                                                      prefill_chunk):
    """prompt_logprobs through the scheduler: the prompt's decode-graph pieces (4 positions here, fewer where a chunk
    budget cuts them) give the entries and tokens the batch-1 path gives, while other requests decode beside them;
    with prefix caching a scored prompt reuses nothing, and a later request reuses what it left."""
    from runtime import Engine, evaluate

    monkeypatch.setattr(evaluate, "PROMPT_PIECE_TOKENS", 4)
    engine = Engine.load(tiny_artifact, prefix_caching=prefix_caching)
    try:
        # the third: a prefix of the first
        scored_prompts = [[1, *range(30, 53)], [1, *range(60, 71)], [1, *range(30, 45)]]
        options = dict(max_new_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=2)
        expected = [engine.generate(prompt, **options) for prompt in scored_prompts]
        slowed(engine.start_scheduler(slots=3, prefill_chunk=prefill_chunk))
        others = [engine.submit(prompt, max_new_tokens=n, ignore_eos=True) for prompt, n in mixed_requests(4)]
        handles = [engine.submit(prompt, **options) for prompt in scored_prompts]
        [handle.result(timeout=60) for handle in others]
        for handle, reference in zip(handles, expected):
            result = handle.result(timeout=60)
            assert result.token_ids == reference.token_ids and result.timings.cached_prompt_tokens == 0
            assert len(result.prompt_logprobs) == len(reference.prompt_logprobs) and result.prompt_logprobs[0] is None
            for ours, theirs in zip(result.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
                assert list(ours) == list(theirs)  # the prompt token, then the two likeliest others
                assert list(ours.values()) == pytest.approx(list(theirs.values()), abs=1e-5)
            assert [list(e) for e in result.logprobs] == [list(e) for e in reference.logprobs]
        if prefix_caching:  # the scored requests' slots hold their prompts: a plain request takes the first's start
            again = engine.submit(scored_prompts[0], max_new_tokens=6, ignore_eos=True).result(timeout=60)
            assert again.timings.cached_prompt_tokens > 0 and again.token_ids == expected[0].token_ids
    finally:
        engine.close()


def test_a_scored_request_cancelled_in_its_prompt_has_no_prompt_logprobs(engine, monkeypatch):
    from runtime import evaluate
    from tests.runtime.test_server import wait_for

    monkeypatch.setattr(evaluate, "PROMPT_PIECE_TOKENS", 2)
    scheduler = slowed(engine.start_scheduler(slots=2, prefill_chunk=2), 0.05)
    running = engine.submit([1, 5, 6], max_new_tokens=60, ignore_eos=True)  # decoding: the chunk budget applies
    next(iter(running))
    scored = engine.submit([1, *range(40, 80)], max_new_tokens=4, prompt_logprobs=1)
    assert wait_for(lambda: scheduler.counts() == (2, 0))
    time.sleep(0.2)  # a few of its 20 pieces
    scored.cancel()
    result = scored.result(timeout=30)
    assert result.finish_reason == "cancelled" and result.prompt_logprobs is None
    assert running.result(timeout=60).finish_reason == "length"


def test_a_request_that_got_past_the_capacity_check_ends_at_the_cache_not_in_everyones_step(engine, monkeypatch):
    """Submit's check keeps prompt + max_new_tokens within the cache; should a request ever get past it (a numpy
    max_new_tokens once wrapped around there), it ends with "max_context" at the cache's end, and the requests
    decoding beside it keep their own tokens, instead of failing with it in onnxruntime's decode step."""
    from runtime.scheduler import Scheduler

    scheduler = engine.start_scheduler(slots=2)
    monkeypatch.setattr(Scheduler, "_check_fits", lambda self, prompt_ids, params: None)
    overlong = scheduler.submit([1, 5, 6, 7], max_new_tokens=500, ignore_eos=True)
    other = scheduler.submit([1, 9, 10], max_new_tokens=40, ignore_eos=True)
    long_result, other_result = overlong.result(), other.result()
    assert long_result.finish_reason == "max_context"
    assert len(long_result.token_ids) == engine.max_context - 4 + 1  # the last token is sampled, never fed back
    assert other_result.token_ids == alone(engine, [1, 9, 10], 40)


def test_an_engine_that_served_requests_is_freed_when_its_last_reference_goes(tiny_artifact):
    """A handle's future kept a bound method of the handle among its done-callbacks: a cycle that held the
    scheduler, the engine and its sessions after close() until a full collection (1.4 GB on the default model;
    a program that swaps models held both)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()  # the engine must go by reference counting alone
    try:
        engine = Engine.load(tiny_artifact)
        handle = engine.submit("Hi", max_new_tokens=2, ignore_eos=True)
        handle.add_done_callback(lambda done: None)
        handle.result(timeout=60)
        callbacks = engine.scheduler._callbacks
        deadline = time.monotonic() + 10
        while callbacks._thread is not None and time.monotonic() < deadline:  # its thread ends once idle
            time.sleep(0.01)
        engine.close()
        gone = weakref.ref(engine)
        del engine, handle
        assert gone() is None
    finally:
        gc.enable()


def test_a_worker_interrupted_before_it_started_is_replaced(tiny_engine):
    """Ctrl-C between the worker's creation and its start() (a notebook's interrupt) left a thread that never ran:
    every later request waited for ever, and close() raised "cannot join thread before it is started"."""
    import threading

    scheduler = tiny_engine.start_scheduler(slots=2)
    try:
        assert scheduler.submit(tiny_engine.prompt_ids("Hi"), max_new_tokens=2).result(timeout=60)
        with scheduler._lock:
            while scheduler._worker is not None:  # the idle worker's exit, else a never-started one could not be
                scheduler._lock.wait(0.05)        # told from it
            scheduler._worker = threading.Thread(target=lambda: None)  # created, never started
        result = scheduler.submit(tiny_engine.prompt_ids("Hi"), max_new_tokens=2, ignore_eos=True).result(timeout=30)
        assert len(result.token_ids) == 2
        with scheduler._lock:
            while scheduler._worker is not None:
                scheduler._lock.wait(0.05)
            scheduler._worker = threading.Thread(target=scheduler._work, daemon=True)  # never started, again
    finally:
        tiny_engine.close()  # starts it to end, then joins it (joining it unstarted raised RuntimeError)


def test_submits_during_start_scheduler_wait_for_the_new_scheduler(tiny_artifact, monkeypatch):
    """start_scheduler closed the old scheduler, then built the new one outside the lock: a submit from another
    thread in between started a default one (a max-context cache per slot, both caches held at once), whose requests
    failed when start_scheduler displaced it; a submit that met the closed scheduler was told to start another."""
    import runtime.scheduler

    created = []
    original = runtime.scheduler.Scheduler.__init__

    def recording(self, engine, *args, **kwargs):
        created.append(kwargs.get("slots"))
        original(self, engine, *args, **kwargs)

    monkeypatch.setattr(runtime.scheduler.Scheduler, "__init__", recording)
    engine = Engine.load(tiny_artifact)
    errors, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            try:
                engine.submit("Hi", max_new_tokens=2, ignore_eos=True).result(timeout=60)
            except RequestError as error:
                errors.append(str(error))

    try:
        engine.submit("Hi", max_new_tokens=1).result(timeout=60)  # the default scheduler, before the clients
        clients = [threading.Thread(target=client) for _ in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(0.2)
        engine.start_scheduler(slots=4)
        time.sleep(0.2)
        stop.set()
        for thread in clients:
            thread.join(60)
    finally:
        engine.close()
    assert created == [None, 4]  # nothing started between the close and the new scheduler
    # only requests the old scheduler held when it closed fail (documented), never one submitted after
    assert set(errors) <= {"the scheduler was closed before this request finished"}, errors


def test_blocked_submitters_get_in_in_the_order_they_blocked_and_no_one_overtakes_them(engine):
    """notify_all woke every blocked submitter at once and whichever ran first took the room (the first to block
    came in 8th of 12), and a block=False submit could take room a blocked one waited for."""
    scheduler = slowed(engine.start_scheduler(slots=1, max_queue=1), seconds=0.005)
    running = scheduler.submit([1, 2, 3], max_new_tokens=40, ignore_eos=True)
    queued = scheduler.submit([1, 2, 4], max_new_tokens=2, ignore_eos=True)
    order, threads = [], []

    def blocked(index):
        handle = scheduler.submit([1, 5, index], max_new_tokens=1, ignore_eos=True, block=True)
        order.append((handle.result(timeout=60).timings.trace.prefill_start, index))

    for index in range(6):
        threads.append(threading.Thread(target=blocked, args=(index,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(scheduler._blocked) < index + 1 and time.monotonic() < deadline:  # it waits before the next one
            time.sleep(0.001)
    assert len(scheduler._blocked) == 6 and not running.done()
    with pytest.raises(QueueFullError, match=r"6 submitters blocked for room"):  # not ahead of them
        scheduler.submit([1, 6], max_new_tokens=1)
    for thread in threads:
        thread.join(60)
    queued.result(timeout=60)
    assert [index for _, index in sorted(order)] == list(range(6))


def test_a_cancelled_requests_slot_takes_a_waiting_request_in_the_same_step(engine):
    """Admission ran before the step's sweep of cancelled requests: a freed slot sat empty for a decode step."""
    scheduler = slowed(engine.start_scheduler(slots=2), seconds=0.01)
    runs = []
    run = scheduler.cache.run
    scheduler.cache.run = lambda phase, *rest: (runs.append(phase), run(phase, *rest))[1]
    long = scheduler.submit([1, 2, 3], max_new_tokens=60, ignore_eos=True)
    cancelled = scheduler.submit([1, 2, 4], max_new_tokens=60, ignore_eos=True)
    waiting = scheduler.submit([1, 2, 5], max_new_tokens=1, ignore_eos=True)
    deadline = time.monotonic() + 10
    while runs.count("decode") < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    with scheduler._lock:  # between steps: the cancel is seen at the next one
        cancelled.cancel()
        mark = len(runs)
    waiting.result(timeout=60)
    assert runs[mark] == "prefill", runs[mark:mark + 3]  # the waiting request's prefill, before any decode
    long.cancel()


def test_a_non_blocking_submit_is_refused_while_blocked_submitters_wait_even_with_room(engine):
    """Room that frees mid-step is the blocked submitters' before anyone new: a block=False submit is refused."""
    scheduler = engine.start_scheduler(slots=2, max_queue=4)
    with scheduler._lock:
        scheduler._blocked.append(object())  # one waits (its turn comes at the next admission)
        try:
            with pytest.raises(QueueFullError, match="1 submitters blocked for room"):
                scheduler.submit([1, 2], max_new_tokens=1)
        finally:
            scheduler._blocked.clear()
    assert scheduler.submit([1, 2], max_new_tokens=1).result(timeout=60)


def test_a_submit_that_meets_a_scheduler_closed_under_it_goes_to_the_next(tiny_artifact):
    """engine.close() on another thread between Engine.submit's choice of scheduler and its submit: the request
    failed with "the scheduler is closed; start another", where a later submit starts a default scheduler."""
    engine = Engine.load(tiny_artifact)
    try:
        first = engine.start_scheduler(slots=2)
        original = type(first).submit

        def closed_under_it(self, *args, **kwargs):
            if self is first:
                self.close()
            return original(self, *args, **kwargs)

        type(first).submit = closed_under_it
        try:
            result = engine.submit([1, 2, 3], max_new_tokens=2, ignore_eos=True).result(timeout=60)
        finally:
            type(first).submit = original
        assert len(result.token_ids) == 2 and engine.scheduler is not first
    finally:
        engine.close()


def test_prefix_cache_queries_count_only_with_prefix_caching(engine):
    scheduler = engine.start_scheduler(slots=2)
    scheduler.submit([1] + list(range(3, 40)), max_new_tokens=2).result(timeout=60)
    counts = scheduler.token_counts()
    assert counts["prompt_tokens"] == 38 and counts["prefix_cache_queries"] == counts["prefix_cache_hits"] == 0
