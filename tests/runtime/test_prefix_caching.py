"""Prefix caching on the batch-1 path (Engine.load(prefix_caching=True)): a prompt that begins with what the cache
holds from the previous request prefills only the rest, and makes the tokens a whole prefill makes."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import runtime.engine
import runtime.prefix_cache
from runtime import Engine, RequestError
from tests.runtime.faults import failing_run
from tests.runtime.test_scheduler import slowed


@pytest.fixture
def cached(tiny_artifact):
    return Engine.load(tiny_artifact, prefix_caching=True)


def turns(engine: Engine, first: list[int], count: int, seed: int = 0):
    """A conversation: each prompt is the previous prompt, its reply and a new message (10 tokens)."""
    rng, prompt, results = np.random.default_rng(seed), list(first), []
    for _ in range(count):
        results.append(engine.generate(prompt, max_new_tokens=6, ignore_eos=True))
        prompt = prompt + results[-1].token_ids + rng.integers(3, 500, size=10).tolist()
    return results


def test_each_turn_reuses_the_previous_turns_tokens_and_makes_the_same_tokens(cached, tiny_engine):
    first = [1] + list(range(40, 70))
    ours, plain = turns(cached, first, 4), turns(tiny_engine, first, 4)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
    # the cache holds the previous prompt and its output but the last token (sampled, never fed back)
    expected = [0] + [len(r.prompt_token_ids) + len(r.token_ids) - 1 for r in ours[:-1]]
    assert [r.timings.cached_prompt_tokens for r in ours] == expected
    assert [r.timings.cached_prompt_tokens for r in plain] == [0] * 4  # off by default
    assert ours[1].timings.summary()["cached_prompt_tokens"] == expected[1]


@pytest.mark.parametrize("prefill_takes_past", [True, False])
def test_the_rest_runs_after_the_cached_prefix_and_its_logits_equal_a_whole_prefill(cached, tiny_engine, monkeypatch,
                                                                                      prefill_takes_past):
    """A prefill graph that takes a past (the build checks it: manifest engines.prefill.takes_past) runs the rest in one
    run and gives a whole prefill's logits; else the decode graph runs it in bounded pieces, equal within rounding."""
    assert cached.manifest["engines"]["prefill"]["takes_past"] is True  # fused, float cache: the tiny recipe's
    monkeypatch.setattr(cached.backend, "prefill_takes_past", prefill_takes_past)
    monkeypatch.setattr(runtime.prefix_cache, "PREFIX_REST_TOKENS", 4)
    calls = []
    run = cached.backend.run
    monkeypatch.setattr(cached.backend, "run", lambda phase, ids, *rest: calls.append((phase, ids.shape[1])) or run(
        phase, ids, *rest))
    prompt = [1] + list(range(100, 140))
    cached.generate(prompt, max_new_tokens=1, ignore_eos=True)
    longer = prompt + list(range(200, 211))  # 11 more: pieces of 4, 4 and 3 through the decode graph
    calls.clear()
    written: list[int] = list(longer[:len(prompt)])
    mask = np.ones((1, cached.max_context), dtype=np.int64)
    ours = cached._prefill_rest(longer, len(prompt), mask, written)
    whole = tiny_engine.backend.run("prefill", np.array([longer]), np.arange(len(longer))[None],
                                    np.ones((1, len(longer)), dtype=np.int64))
    whole = runtime.engine.last_token_logits(whole, [len(longer)])[0]
    if prefill_takes_past:
        assert calls == [("prefill", 11)]
        np.testing.assert_allclose(ours, whole, rtol=0, atol=1e-6)
    else:
        assert calls == [("decode", 4), ("decode", 4), ("decode", 3)]
        np.testing.assert_allclose(ours, whole, atol=1e-5)


def test_the_same_prompt_again_runs_only_its_last_two_tokens(cached, tiny_engine):
    """Its last token alone through the prefill graph ran as one row, whose matrix-vector sums round otherwise: on
    INT4 weights the same greedy prompt sent twice got two replies. Two rows equal a whole prefill's bit for bit."""
    prompt = [1] + list(range(10, 50))
    first = cached.generate(prompt, max_new_tokens=5, ignore_eos=True)
    again = cached.generate(prompt, max_new_tokens=5, ignore_eos=True)
    assert cached.backend.prefill_takes_past and again.timings.cached_prompt_tokens == len(prompt) - 2
    assert again.token_ids == first.token_ids == tiny_engine.generate(prompt, max_new_tokens=5,
                                                                      ignore_eos=True).token_ids


@pytest.mark.parametrize("prefix, rest, prefill_takes_past, reused", [
    (10, 5, True, 0), (10, 5, False, 0),  # fewer than PREFIX_MIN_TOKENS: not worth it either way
    (20, 50, False, 0),  # less than half the rest, through the decode graph: a whole prefill is faster
    (20, 30, False, 20),  # at least half the rest: reused through the decode graph too
    (20, 40, False, 20),  # exactly half the rest: still reused
    (20, 50, True, 20),  # through the prefill graph, any prefix pays
    (20, 1, True, 19), (20, 1, False, 20),  # a rest of one row through the prefill graph takes a cached token too
])
def test_which_prefixes_are_worth_reusing(cached, monkeypatch, prefix, rest, prefill_takes_past, reused):
    monkeypatch.setattr(cached.backend, "prefill_takes_past", prefill_takes_past)
    common = [1] + list(range(300, 300 + prefix - 1))
    cached.generate(common + [5, 6], max_new_tokens=2, ignore_eos=True)
    result = cached.generate(common + list(range(7, 7 + rest)), max_new_tokens=2, ignore_eos=True)
    assert result.timings.cached_prompt_tokens == reused


def test_any_other_run_on_the_cache_ends_the_reuse(cached, tiny_engine):
    prompt = [1] + list(range(60, 100))
    cached.generate(prompt, max_new_tokens=3, ignore_eos=True)
    other = [1] + list(range(400, 440))  # as evaluation or a benchmark would, straight on the backend
    cached.backend.run("prefill", np.array([other]), np.arange(len(other))[None], np.ones((1, 41), dtype=np.int64))
    result = cached.generate(prompt, max_new_tokens=3, ignore_eos=True)
    assert result.timings.cached_prompt_tokens == 0
    assert result.token_ids == tiny_engine.generate(prompt, max_new_tokens=3, ignore_eos=True).token_ids


def test_a_stream_left_early_leaves_what_it_wrote(cached, tiny_engine):
    prompt = [1] + list(range(20, 60))
    stream = cached.stream(prompt, max_new_tokens=30, ignore_eos=True)
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()  # a loop left early leaves it open; closed, it frees the cache
    result = cached.generate(prompt + [7, 8], max_new_tokens=4, ignore_eos=True)
    assert result.timings.cached_prompt_tokens == len(prompt)  # the prompt; its outputs differ from 7, 8
    assert result.token_ids == tiny_engine.generate(prompt + [7, 8], max_new_tokens=4, ignore_eos=True).token_ids


def test_a_failed_run_ends_the_reuse(cached, monkeypatch):
    """A run that fails inside onnxruntime may have written part of the rows: it still counts as a run."""
    import runtime.onnxruntime_backend as backend_module

    prompt = [1] + list(range(60, 100))
    cached.generate(prompt, max_new_tokens=3, ignore_eos=True)
    run_bound = backend_module.run_bound

    def failing(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(backend_module, "run_bound", failing)
    with pytest.raises(RuntimeError):
        cached.generate(prompt + list(range(5, 25)), max_new_tokens=3, ignore_eos=True)
    monkeypatch.setattr(backend_module, "run_bound", run_bound)
    assert cached.generate(prompt, max_new_tokens=3, ignore_eos=True).timings.cached_prompt_tokens == 0


def test_a_replaced_cache_is_freed_not_kept_by_the_record(cached):
    """The record held the batch-1 cache itself: after the backend allocated another batch size, the old cache
    (GPU memory on TensorRT) stayed alive until the next request."""
    import gc
    import weakref

    cached.generate([1] + list(range(60, 100)), max_new_tokens=3, ignore_eos=True)
    old = weakref.ref(cached.backend.cache)
    cached.backend.allocate_cache(batch=4)
    gc.collect()
    assert old() is None
    assert cached.generate([1] + list(range(60, 100)), max_new_tokens=3,
                           ignore_eos=True).timings.cached_prompt_tokens == 0


def test_an_engine_that_bounds_its_decode_calls_reuses_only_a_rest_of_one_call(cached, monkeypatch):
    """TensorRT's decode engine takes decode_max_tokens per call, 1 by default: a rest of many tokens would run as
    many calls, slower than one prefill of the whole prompt."""
    from runtime.prefix_cache import reusable_prefix

    cached_ids = list(range(100))
    bounded = SimpleNamespace(max_decode_tokens=4, prefill_takes_past=False)
    assert reusable_prefix(cached_ids, cached_ids[:60] + [7] * 5) == 60
    assert reusable_prefix(cached_ids, cached_ids[:60] + [7] * 5, bounded) == 0
    assert reusable_prefix(cached_ids, cached_ids[:60] + [7] * 4, bounded) == 60
    monkeypatch.setattr(cached.backend, "max_decode_tokens", 1)
    monkeypatch.setattr(cached.backend, "prefill_takes_past", False)  # as TensorRT's
    prompt = [1] + list(range(60, 100))
    cached.generate(prompt, max_new_tokens=3, ignore_eos=True)
    assert cached.generate(prompt, max_new_tokens=3, ignore_eos=True).timings.cached_prompt_tokens == 40
    assert cached.generate(prompt + [5, 6], max_new_tokens=3, ignore_eos=True).timings.cached_prompt_tokens == 0


def test_without_a_backend_a_prefix_follows_the_decode_graphs_rule():
    """reusable_prefix with no backend (its default) judges as for a decode graph: a prefix at least half the rest."""
    from runtime.prefix_cache import reusable_prefix

    cached_ids = list(range(100))
    assert reusable_prefix(cached_ids, cached_ids[:20] + [7] * 40) == 20
    assert reusable_prefix(cached_ids, cached_ids[:20] + [7] * 41) == 0
    assert reusable_prefix(cached_ids, cached_ids[:20] + [7] * 41, SimpleNamespace(prefill_takes_past=True)) == 20


def test_pieces_of_a_rest_stay_within_the_decode_engines_tokens_per_call():
    """A piece is at most the caller's limit (PREFIX_REST_TOKENS by default) and at most what the decode engine takes
    per call where it bounds that (TensorRT's decode_max_tokens): a scored prompt's pieces of 128 positions run
    through it too."""
    from runtime.prefix_cache import PREFIX_REST_TOKENS, rest_piece_tokens

    unbounded, bounded = SimpleNamespace(max_decode_tokens=None), SimpleNamespace(max_decode_tokens=4)
    assert rest_piece_tokens(unbounded) == PREFIX_REST_TOKENS and rest_piece_tokens(unbounded, 12) == 12
    assert rest_piece_tokens(bounded) == rest_piece_tokens(bounded, 128) == 4 and rest_piece_tokens(bounded, 3) == 3


def test_prefix_caching_must_be_a_bool(tiny_artifact):
    with pytest.raises(RequestError, match="prefix_caching must be True or False, got 'yes'"):
        Engine.load(tiny_artifact, prefix_caching="yes")


# -- the scheduler's slots -------------------------------------------------------------------------------------
def test_scheduled_conversations_find_their_turns_in_the_slots_they_left(cached, tiny_engine):
    """Three chats of three turns through 4 slots, each turn submitted when the last one finished: a turn lands in
    the slot its previous turn left, reuses what it holds, and makes the tokens a whole prefill makes."""
    rng = np.random.default_rng(1)
    chats = [[1] + rng.integers(3, 500, size=24).tolist() for _ in range(3)]
    expected_cached, results, previous = [], [], []
    try:
        cached.start_scheduler(slots=4)
        for turn in range(3):
            handles = [cached.submit(prompt, max_new_tokens=5, ignore_eos=True) for prompt in chats]
            done = [handle.result(timeout=60) for handle in handles]
            results.append(done)
            expected_cached.append([len(p) + 5 - 1 for p in previous] if previous else [0] * 3)
            previous = [r.prompt_token_ids for r in done]
            chats = [r.prompt_token_ids + r.token_ids + rng.integers(3, 500, size=6).tolist() for r in done]
    finally:
        cached.close()
    assert [[r.timings.cached_prompt_tokens for r in done] for done in results] == expected_cached
    for done in results:
        assert [r.token_ids for r in done] == [tiny_engine.generate(r.prompt_token_ids, max_new_tokens=5,
                                                                    ignore_eos=True).token_ids for r in done]


def test_a_free_slots_prefix_survives_other_rows_decode_steps(cached, tiny_engine):
    """A decode step runs every row up to the highest decoding slot; a free row writes a throw-away key and value.
    It went to position 0 of a free slot, which would spoil the prefix it holds; it goes after the prefix now."""
    first = [1] + list(range(30, 60))
    try:
        scheduler = cached.start_scheduler(slots=2)
        done = cached.submit(first, max_new_tokens=3, ignore_eos=True).result(timeout=60)  # leaves slot 0
        held = [array[0, :, :len(first) + 2].copy() for array in scheduler.cache.arrays]
        long = cached.submit([1, 7, 8], max_new_tokens=60, ignore_eos=True)  # slot 1: decode steps over 0..1
        assert long.result(timeout=60).finish_reason == "length"
        assert scheduler._running == [None, None] and scheduler._slot_ids[0] is not None  # slot 0 kept its prefix
        for before, array in zip(held, scheduler.cache.arrays):
            np.testing.assert_array_equal(array[0, :, :len(first) + 2], before)
        follow_up = first + done.token_ids + [9, 10]
        again = cached.submit(follow_up, max_new_tokens=8, ignore_eos=True)
        result = again.result(timeout=60)
        assert long.result().token_ids == tiny_engine.generate([1, 7, 8], max_new_tokens=60,
                                                               ignore_eos=True).token_ids
    finally:
        cached.close()
    assert result.timings.cached_prompt_tokens == len(first) + 2  # the prompt and the two outputs fed back
    assert result.token_ids == tiny_engine.generate(follow_up, max_new_tokens=8, ignore_eos=True).token_ids


def test_a_request_that_failed_leaves_no_prefix(cached, monkeypatch):
    prompt = [1] + list(range(30, 60))
    try:
        scheduler = cached.start_scheduler(slots=1)
        run = scheduler.cache.run
        scheduler.cache.run = failing_run(run, "decode", at=2)
        with pytest.raises(RuntimeError, match="out of memory"):
            cached.submit(prompt, max_new_tokens=5, ignore_eos=True).result(timeout=60)
        assert all(ids is None for ids in scheduler._slot_ids)
        scheduler.cache.run = run
        again = cached.submit(prompt + [5], max_new_tokens=2, ignore_eos=True).result(timeout=60)
    finally:
        cached.close()
    assert again.timings.cached_prompt_tokens == 0


def test_the_scheduler_reuses_nothing_without_prefix_caching(tiny_engine):
    prompt = [1] + list(range(30, 60))
    try:
        first = tiny_engine.submit(prompt, max_new_tokens=3, ignore_eos=True).result(timeout=60)
        again = tiny_engine.submit(prompt + first.token_ids, max_new_tokens=3, ignore_eos=True).result(timeout=60)
    finally:
        tiny_engine.close()
    assert again.timings.cached_prompt_tokens == 0 and tiny_engine._scheduler is None


# -- prefix sharing between the scheduler's requests ------------------------------------------------------------
def _burst(engine: Engine, prompts: list[list[int]], **sampling) -> list:
    """Submit every prompt while the worker is held, so that they are admitted in one iteration."""
    scheduler = engine._scheduler
    with scheduler._lock:  # the worker takes it at the start of each iteration
        handles = [engine.submit(prompt, ignore_eos=True, **sampling) for prompt in prompts]
    return handles


def _prompts_sharing(prefix_length: int, tails: int, tail_length: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = [1] + rng.integers(3, 500, size=prefix_length - 1).tolist()
    return [shared + [100 + tail] + rng.integers(3, 500, size=tail_length - 1).tolist() for tail in range(tails)]


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_requests_that_arrive_together_compute_their_shared_prefix_once(cached, tiny_engine, batching):
    """Four prompts that share a 40-token start, submitted together: the first is prefilled whole, the other three
    wait one iteration, copy its keys and values for those 40 positions and prefill only their own 6 tokens. Each
    makes the tokens it makes alone."""
    prompts = _prompts_sharing(40, 4, 6)
    try:
        scheduler = cached.start_scheduler(slots=4, batching=batching)
        run, computed = scheduler.cache.run, []
        scheduler.cache.run = lambda phase, rows, ids, *rest: (computed.append((phase, ids.shape)),
                                                               run(phase, rows, ids, *rest))[1]
        results = [handle.result(timeout=60) for handle in _burst(cached, prompts, max_new_tokens=5)]
    finally:
        cached.close()
    assert [r.timings.cached_prompt_tokens for r in results] == [0, 40, 40, 40]
    prompt_tokens = sum(shape[0] * shape[1] for phase, shape in computed if shape[1] > 1 or phase == "prefill")
    assert prompt_tokens == 46 + 3 * 6  # not 4 x 46
    for result in results:
        alone = tiny_engine.generate(result.prompt_token_ids, max_new_tokens=5, ignore_eos=True)
        assert result.token_ids == alone.token_ids
    try:  # without prefix caching, each is prefilled whole
        tiny_engine.start_scheduler(slots=4, batching=batching)
        plain = [handle.result(timeout=60) for handle in _burst(tiny_engine, prompts, max_new_tokens=5)]
    finally:
        tiny_engine.close()
    assert [r.timings.cached_prompt_tokens for r in plain] == [0] * 4
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]


def test_a_running_requests_rows_are_shared_with_a_request_that_begins_the_same(cached, tiny_engine):
    first, second = _prompts_sharing(36, 2, 8, seed=5)
    try:
        scheduler = cached.start_scheduler(slots=2)
        copies = []
        copy = scheduler.cache.copy_rows
        scheduler.cache.copy_rows = lambda *args: (copies.append(args), copy(*args))[1]
        long = cached.submit(first, max_new_tokens=80, ignore_eos=True)
        next(iter(long))  # decoding: its rows hold its prompt
        later = _burst(cached, [second], max_new_tokens=6)[0].result(timeout=60)
        assert long.result(timeout=60).finish_reason == "length"
    finally:
        cached.close()
    assert copies == [(0, 1, 0, 36)]  # from the running request's slot, not a slot it left
    assert later.timings.cached_prompt_tokens == 36
    assert later.token_ids == tiny_engine.generate(second, max_new_tokens=6, ignore_eos=True).token_ids
    assert long.result().token_ids == tiny_engine.generate(first, max_new_tokens=80, ignore_eos=True).token_ids


def test_a_request_waiting_for_a_prefill_that_fails_prefills_its_own(cached, tiny_engine):
    prompts = _prompts_sharing(40, 2, 6, seed=7)
    try:
        scheduler = cached.start_scheduler(slots=2)
        scheduler.cache.run = failing_run(scheduler.cache.run, "prefill", at=1)
        failing, waiting = _burst(cached, prompts, max_new_tokens=5)
        with pytest.raises(RuntimeError, match="out of memory"):
            failing.result(timeout=60)
        result = waiting.result(timeout=60)
    finally:
        cached.close()
    assert result.timings.cached_prompt_tokens == 0
    assert result.token_ids == tiny_engine.generate(prompts[1], max_new_tokens=5, ignore_eos=True).token_ids


def test_samples_of_one_prompt_submitted_together_prefill_it_once(cached, tiny_engine):
    """Parallel sampling (vLLM's n) is n requests of one prompt with their own seeds: the first prefills it, the
    others copy all but its last two tokens, which they run through the prefill graph for their first logits."""
    prompt = _prompts_sharing(30, 1, 4, seed=11)[0]
    try:
        cached.start_scheduler(slots=4)
        scheduler = cached._scheduler
        with scheduler._lock:
            handles = [cached.submit(prompt, max_new_tokens=8, temperature=0.9, seed=seed, ignore_eos=True)
                       for seed in range(4)]
        results = [handle.result(timeout=60) for handle in handles]
    finally:
        cached.close()
    assert [r.timings.cached_prompt_tokens for r in results] == [0] + [len(prompt) - 2] * 3
    for seed, result in enumerate(results):
        alone = tiny_engine.generate(prompt, max_new_tokens=8, temperature=0.9, seed=seed, ignore_eos=True)
        assert result.token_ids == alone.token_ids
    assert len({tuple(r.token_ids) for r in results}) > 1  # the seeds differ


def test_a_request_waiting_to_share_is_not_overtaken_and_waits_only_for_a_worthwhile_gain(cached, tiny_engine):
    """A (S + 5 tokens) is prefilled first; B (S + 15) waits for it to copy S; D (unrelated, admitted after B) waits
    too rather than being prefilled before B's rest. C shares only 8 tokens more with B than with A: it does not wait
    for B's rest (under PREFIX_MIN_TOKENS), and copies S from A."""
    rng = np.random.default_rng(13)
    shared = [1] + rng.integers(3, 500, size=29).tolist()
    extra = rng.integers(3, 500, size=8).tolist()
    a = shared + [200] + rng.integers(3, 500, size=4).tolist()
    b = shared + extra + [201] + rng.integers(3, 500, size=6).tolist()
    c = shared + extra + [202] + rng.integers(3, 500, size=6).tolist()
    d = [2] + rng.integers(3, 500, size=40).tolist()
    try:
        cached.start_scheduler(slots=4)
        results = [handle.result(timeout=60) for handle in _burst(cached, [a, b, d, c], max_new_tokens=4)]
    finally:
        cached.close()
    assert [r.timings.cached_prompt_tokens for r in results] == [0, 30, 0, 30]
    first_token = [r.timings.trace.first_token for r in results]
    assert first_token[0] < first_token[1] < first_token[2]  # D after B
    for result in results:
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=4,
                                                        ignore_eos=True).token_ids


def test_a_scored_request_copies_nothing_and_waits_behind_one_admitted_before_it(cached, tiny_engine):
    """A (S + 5) is prefilled first; B (S + 15) waits for it to copy S; D, scored (prompt_logprobs), shares S as well
    and is admitted after B: it copies nothing (it computes every position) and does not overtake B."""
    rng = np.random.default_rng(13)
    shared = [1] + rng.integers(3, 500, size=29).tolist()
    a = shared + [200] + rng.integers(3, 500, size=4).tolist()
    b = shared + rng.integers(3, 500, size=8).tolist() + [201] + rng.integers(3, 500, size=6).tolist()
    d = shared + [203] + rng.integers(3, 500, size=9).tolist()
    try:
        scheduler = cached.start_scheduler(slots=3)
        with scheduler._lock:  # admitted in one iteration
            handles = [cached.submit(a, max_new_tokens=4, ignore_eos=True),
                       cached.submit(b, max_new_tokens=4, ignore_eos=True),
                       cached.submit(d, max_new_tokens=4, ignore_eos=True, prompt_logprobs=1)]
        results = [handle.result(timeout=60) for handle in handles]
    finally:
        cached.close()
    assert [r.timings.cached_prompt_tokens for r in results] == [0, 30, 0]
    assert results[1].timings.trace.prefill_start < results[2].timings.trace.prefill_start  # D after B
    expected = tiny_engine.generate(d, max_new_tokens=4, ignore_eos=True, prompt_logprobs=1)
    assert results[2].token_ids == expected.token_ids and len(results[2].prompt_logprobs) == len(d)
    assert [list(e) for e in results[2].prompt_logprobs[1:]] == [list(e) for e in expected.prompt_logprobs[1:]]


def test_a_scored_prompt_whose_piece_fails_leaves_no_prefix(cached, monkeypatch):
    from runtime import evaluate

    monkeypatch.setattr(evaluate, "PROMPT_PIECE_TOKENS", 8)
    prompt = [1] + list(range(30, 60))
    try:
        scheduler = cached.start_scheduler(slots=1)
        run = scheduler.cache.run
        scheduler.cache.run = failing_run(run, "decode", at=2)  # the prompt's second piece of 8
        handle = cached.submit(prompt, max_new_tokens=5, ignore_eos=True, prompt_logprobs=1)
        with pytest.raises(RuntimeError, match="out of memory"):
            handle.result(timeout=60)
        assert all(ids is None for ids in scheduler._slot_ids) and handle.prompt_logprobs is None
        scheduler.cache.run = run
        again = cached.submit(prompt + [5], max_new_tokens=2, ignore_eos=True).result(timeout=60)
    finally:
        cached.close()
    assert again.timings.cached_prompt_tokens == 0 and len(again.token_ids) == 2


def _fail_the_first_copy(scheduler) -> list:
    """The scheduler's first row copy raises, as a lost device would; returns the list of every copy's arguments."""
    copy, copies = scheduler.cache.copy_rows, []

    def fail_the_first(*args):
        copies.append(args)
        if len(copies) == 1:
            raise RuntimeError("device lost")
        return copy(*args)

    scheduler.cache.copy_rows = fail_the_first
    return copies


def test_a_copy_that_fails_fails_its_request_alone(cached, tiny_engine):
    prompts = _prompts_sharing(40, 3, 6, seed=17)
    try:
        _fail_the_first_copy(cached.start_scheduler(slots=3))
        first, failing, third = _burst(cached, prompts, max_new_tokens=5)
        with pytest.raises(RuntimeError, match="device lost"):
            failing.result(timeout=60)
        done = [first.result(timeout=60), third.result(timeout=60)]
    finally:
        cached.close()
    assert [r.timings.cached_prompt_tokens for r in done] == [0, 40]
    for result in done:
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=5,
                                                        ignore_eos=True).token_ids


def test_sharing_with_a_prompt_prefilled_in_chunks(cached, tiny_engine):
    """While another request decodes, prompts are prefilled 8 tokens per iteration: the followers copy the first
    one's rows as its chunks land (only the rows they lack each time) and wait for the rest of the shared start."""
    prompts = _prompts_sharing(40, 3, 6, seed=19)
    busy = [2] + list(range(60, 70))
    try:
        scheduler = cached.start_scheduler(slots=4, prefill_chunk=8)
        copy, copies = scheduler.cache.copy_rows, []
        scheduler.cache.copy_rows = lambda *args: (copies.append(args), copy(*args))[1]
        long = cached.submit(busy, max_new_tokens=100, ignore_eos=True)
        next(iter(long))  # decoding: the prompts below are prefilled in chunks
        results = [handle.result(timeout=60) for handle in _burst(cached, prompts, max_new_tokens=5)]
        long.result(timeout=60)
    finally:
        cached.close()
    assert [r.timings.cached_prompt_tokens for r in results] == [0, 40, 40]
    for target in (2, 3):  # each follower's copies tile 0..40 without overlap
        spans = [(start, stop) for source, slot, start, stop in copies if slot == target]
        assert spans == [(0, 16), (16, 24), (24, 32), (32, 40)]  # 16 is the least worth taking, then each chunk
    for result in results:
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=5,
                                                        ignore_eos=True).token_ids


def test_scored_rows_are_reusable_on_a_float_cache_only():
    """The int8 rule alone (tests/compiler/test_kv_cache_build.py shows why, end to end)."""
    from types import SimpleNamespace

    from runtime.prefix_cache import scored_rows_reusable

    assert scored_rows_reusable(SimpleNamespace(cache_dtype=np.float32))
    assert scored_rows_reusable(SimpleNamespace(cache_dtype=np.float16))
    assert not scored_rows_reusable(SimpleNamespace(cache_dtype=np.int8))


def test_a_new_chat_sharing_only_a_header_leaves_a_conversations_slot_alone(cached, tiny_engine):
    """Every chat of one template shares its header (SmolLM2's: 24 tokens). A new chat went to the free slot that
    held most of its start, a conversation's, and wrote over the conversation while another slot sat empty. It now
    takes the empty slot, copies the header from the conversation's record, and the conversation's next turn still
    finds all of it; the counters (vLLM's prefix_cache_queries and _hits, in tokens) say what happened."""
    rng = np.random.default_rng(5)
    header = [1] + rng.integers(3, 500, size=19).tolist()
    conversation = header + rng.integers(3, 500, size=40).tolist()
    newcomer = header + rng.integers(3, 500, size=8).tolist()
    try:
        scheduler = cached.start_scheduler(slots=2)
        first = cached.submit(conversation, max_new_tokens=5, ignore_eos=True).result(timeout=60)
        other = cached.submit(newcomer, max_new_tokens=5, ignore_eos=True).result(timeout=60)
        follow_up = conversation + first.token_ids + [9, 10]
        again = cached.submit(follow_up, max_new_tokens=5, ignore_eos=True).result(timeout=60)
        counts = scheduler.token_counts()
    finally:
        cached.close()
    assert other.timings.cached_prompt_tokens == len(header)  # copied from the conversation's record
    assert again.timings.cached_prompt_tokens == len(conversation) + 5 - 1  # the record is whole
    for result in (other, again):
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=5,
                                                        ignore_eos=True).token_ids
    assert counts["prefix_cache_queries"] == len(conversation) + len(newcomer) + len(follow_up)
    assert counts["prefix_cache_hits"] == len(header) + len(conversation) + 5 - 1


@pytest.mark.parametrize("slots", [2, 3])
def test_requests_admitted_together_keep_the_record_one_of_them_copies_from(cached, tiny_engine, slots):
    """A request sent away from a long record to copy its shared start lost both when a request admitted with it
    took the record's slot: with room for every waiting request it is sent away and the record kept for the copy
    (3 slots); without (2 slots), it reuses the record's start in its slot."""
    rng = np.random.default_rng(6)
    header = [1] + rng.integers(3, 500, size=19).tolist()
    conversation = header + rng.integers(3, 500, size=40).tolist()
    newcomer = header + rng.integers(3, 500, size=8).tolist()
    unrelated = [1] + rng.integers(3, 500, size=12).tolist()
    try:
        cached.start_scheduler(slots=slots)
        first = cached.submit(conversation, max_new_tokens=5, ignore_eos=True).result(timeout=60)
        if slots == 3:  # an older record in another slot: the one an unrelated request takes
            cached.submit([1] + rng.integers(3, 500, size=30).tolist(), max_new_tokens=2).result(timeout=60)
        handles = _burst(cached, [newcomer, unrelated], max_new_tokens=5)
        other, _ = [handle.result(timeout=60) for handle in handles]
        follow_up = conversation + first.token_ids + [9, 10]
        again = cached.submit(follow_up, max_new_tokens=5, ignore_eos=True).result(timeout=60)
    finally:
        cached.close()
    assert other.timings.cached_prompt_tokens == len(header)  # copied, or reused in place: never lost
    assert again.timings.cached_prompt_tokens == (len(conversation) + 5 - 1 if slots == 3 else len(header))
    for result in (other, again):
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=5,
                                                        ignore_eos=True).token_ids


def test_more_conversations_than_slots_keep_the_records_their_next_turns_find(cached, tiny_engine):
    """Five chats of one template on 4 slots: the first chat's record is gone by turn 2, and its turn took the slot
    of the next chat's record for the shared header, which then took the next one's, and so on: no turn 2 found its
    own record (each reused only the 20-token header). A record a request placed after it reuses much more of is
    left to that request: only the first chat's turn loses its record, and it copies the header."""
    rng = np.random.default_rng(8)
    header = [1] + rng.integers(3, 500, size=19).tolist()
    chats = [header + rng.integers(3, 500, size=30).tolist() for _ in range(5)]
    try:
        cached.start_scheduler(slots=4)
        firsts = [cached.submit(chat, max_new_tokens=4, ignore_eos=True).result(timeout=60) for chat in chats]
        follow_ups = [chat + first.token_ids + rng.integers(3, 500, size=6).tolist()
                      for chat, first in zip(chats, firsts)]
        order = [0, 4, 1, 2, 3]  # the first chat's turn ties on the header with the last chat's record, slot 0
        seconds = [handle.result(timeout=60)
                   for handle in _burst(cached, [follow_ups[i] for i in order], max_new_tokens=4)]
    finally:
        cached.close()
    # 4 placed at once: chats 0, 4, 1 and 2. Chat 0's record is gone; it copies the header into the slot of the chat
    # left for the next admission (3), whose record is the one lost
    whole = len(chats[0]) + 4 - 1
    assert [result.timings.cached_prompt_tokens for result in seconds] == [len(header), whole, whole, whole,
                                                                           len(header)]
    for result in seconds:
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=4,
                                                        ignore_eos=True).token_ids


def test_a_later_requests_claim_is_its_own_best_record_not_any_it_shares_a_header_with(cached, tiny_engine):
    """Two chat templates' headers over 4 slots (the default and a custom system prompt): a later request's header
    match on another chat's record counted as a claim on it, so every record was claimed and the first turn took a
    conversation's slot after all (a review's 5 chats on the default model: every second turn reused only 24 tokens)."""
    rng = np.random.default_rng(9)
    headers = [[1] + rng.integers(3, 500, size=19).tolist() for _ in range(2)]
    chats = [headers[0] + rng.integers(3, 500, size=30).tolist() for _ in range(3)]
    chats += [headers[1] + rng.integers(3, 500, size=30).tolist() for _ in range(2)]
    try:
        cached.start_scheduler(slots=4)
        firsts = [cached.submit(chat, max_new_tokens=4, ignore_eos=True).result(timeout=60) for chat in chats]
        follow_ups = [chat + first.token_ids + rng.integers(3, 500, size=6).tolist()
                      for chat, first in zip(chats, firsts)]
        seconds = [handle.result(timeout=60) for handle in _burst(cached, follow_ups, max_new_tokens=4)]
    finally:
        cached.close()
    whole = len(chats[0]) + 4 - 1
    assert [result.timings.cached_prompt_tokens for result in seconds] == [20, whole, whole, whole, 20]
    for result in seconds:
        assert result.token_ids == tiny_engine.generate(result.prompt_token_ids, max_new_tokens=4,
                                                        ignore_eos=True).token_ids


def test_the_scheduler_compares_only_prompts_and_records_whose_first_ids_match(cached, tiny_engine, monkeypatch):
    """reusable_prefix is 0 unless a prompt and a record share their first PREFIX_MIN_TOKENS ids, so the scheduler
    compares only those (prefix_key): 256 distinct prompts admitted onto 256 slots' records had made 65,536
    comparisons and a 1.4 s admission under the lock. Prompts sharing a start are still found."""
    from runtime import scheduler as scheduler_module

    compared = []
    real = scheduler_module.reusable_prefix
    monkeypatch.setattr(scheduler_module, "reusable_prefix", lambda c, p, b=None: compared.append(1) or real(c, p, b))
    rng = np.random.default_rng(7)
    distinct = [rng.integers(3, 500, size=24).tolist() for _ in range(6)]  # first ids differ (with all but certainty)
    sharing = _prompts_sharing(20, 2, 6, seed=11)
    try:
        cached.start_scheduler(slots=6)
        for handle in _burst(cached, distinct, max_new_tokens=3):
            handle.result(timeout=60)  # every slot now holds a record
        compared.clear()
        results = [h.result(timeout=60) for h in _burst(cached, [p[:4] + p[4:][::-1] for p in distinct],
                                                         max_new_tokens=3)]
        assert compared == [] and all(r.timings.cached_prompt_tokens == 0 for r in results)
        results = [h.result(timeout=60) for h in _burst(cached, sharing, max_new_tokens=3)]
    finally:
        cached.close()
    assert compared and results[1].timings.cached_prompt_tokens == 20  # the second copies the first's 20 ids
    assert results[1].token_ids == tiny_engine.generate(sharing[1], max_new_tokens=3, ignore_eos=True).token_ids


def test_prefix_key_is_the_first_ids_as_bytes():
    ids = np.arange(40, dtype=np.int64)
    assert runtime.prefix_cache.prefix_key(ids) == ids[:16].tobytes()
    assert runtime.prefix_cache.prefix_key(ids[:15]) is None  # fewer than PREFIX_MIN_TOKENS: nothing to reuse
    assert runtime.prefix_cache.prefix_key(ids[:16]) == ids[:16].tobytes()  # exactly as many: reusable
    assert runtime.prefix_cache.prefix_key(ids) != runtime.prefix_cache.prefix_key(ids[::-1].copy())


def test_a_scored_request_placed_first_leaves_the_later_requests_their_records(cached):
    """A conversation's next turn keeps its slot's record though a scored request (prompt_logprobs) and an unrelated
    one are admitted with it, the scored one first: its admission, holding no record, had moved every later request
    past its own records, and the unrelated request took the turn's record (0 tokens reused, not 33)."""
    rng = np.random.default_rng(0)
    first = [[1] + rng.integers(3, 500, size=29).tolist() for _ in range(3)]
    try:
        scheduler = cached.start_scheduler(slots=3)
        replies = [cached.submit(p, max_new_tokens=4, ignore_eos=True).result(timeout=60) for p in first]
        assert all(ids is not None for ids in scheduler._slot_ids)  # each slot holds a conversation's record
        scored = [1] + rng.integers(3, 500, size=20).tolist()
        unrelated = [1] + rng.integers(3, 500, size=20).tolist()
        next_turn = first[1] + replies[1].token_ids + rng.integers(3, 500, size=10).tolist()
        with scheduler._lock:
            handles = [cached.submit(scored, max_new_tokens=2, ignore_eos=True, prompt_logprobs=1),
                       cached.submit(unrelated, max_new_tokens=2, ignore_eos=True),
                       cached.submit(next_turn, max_new_tokens=2, ignore_eos=True)]
        results = [h.result(timeout=60) for h in handles]
    finally:
        cached.close()
    assert results[2].timings.cached_prompt_tokens == len(first[1]) + 3  # its prompt and reply but the last token


def test_a_request_whose_copy_failed_delays_no_later_request(cached):
    """A request whose row copy failed is gone from its slot: a later request sharing its start prefills in the same
    step rather than wait for a prefill that will not come (it had waited one step)."""
    rng = np.random.default_rng(1)
    shared = [1] + rng.integers(3, 500, size=19).tolist()
    first = shared + rng.integers(3, 500, size=40).tolist()
    later = first + rng.integers(3, 500, size=5).tolist()
    try:
        scheduler = cached.start_scheduler(slots=4)
        cached.submit(shared + rng.integers(3, 500, size=30).tolist(), max_new_tokens=4, ignore_eos=True).result(60)
        copies = _fail_the_first_copy(scheduler)
        deferred, share = [], scheduler._share_prefixes
        scheduler._share_prefixes = lambda: (lambda d: deferred.append(len(d)) or d)(share())
        failing, served = _burst(cached, [first, later], max_new_tokens=3)
        with pytest.raises(RuntimeError, match="device lost"):
            failing.result(timeout=60)
        served.result(timeout=60)
    finally:
        cached.close()
    assert len(copies) == 2 and deferred[0] == 0  # the later one copied the shared start in the failing one's step


def _running_until(scheduler, ready, timeout=30.0):
    """Wait until ready(sequence) holds for a sequence in a slot (the graph runs slowed, so it stays there)."""
    deadline = time.monotonic() + timeout
    while not any(s is not None and ready(s) for s in scheduler._running):
        assert time.monotonic() < deadline, "the request never got there"
        time.sleep(0.0005)


def test_a_running_scored_request_is_no_donor_where_its_rows_are_not_reusable(cached):
    """On an int8 cache a scored request's rows (prompt_logprobs) are no prefix for another prompt
    (scored_rows_reusable): not while it runs either."""
    prompt = [1] + np.random.default_rng(0).integers(3, 500, size=19).tolist()
    try:
        scheduler = slowed(cached.start_scheduler(slots=2))
        scheduler._scored_rows_reusable = False  # what scored_rows_reusable() says of an int8 cache
        scored = cached.submit(prompt, max_new_tokens=60, ignore_eos=True, prompt_logprobs=1)
        _running_until(scheduler, lambda s: len(s.output) >= 5)
        later = cached.submit(prompt[:18] + list(range(300, 310)), max_new_tokens=2, ignore_eos=True).result(60)
        assert not scored.done()  # it was running throughout
        scored.cancel()
    finally:
        cached.close()
    assert later.timings.cached_prompt_tokens == 0


def test_a_running_requests_output_is_shared_and_its_record_is_whole_after_it(cached, tiny_engine):
    """A running request whose prompt is short (8 ids) shares its prompt and output so far with a prompt that begins
    with them (its held ids past the prompt); when it ends, its record holds every id it wrote, made again at its
    final length (not the length another request first read it at)."""
    prompt = [1] + np.random.default_rng(0).integers(3, 500, size=7).tolist()
    reply = tiny_engine.generate(prompt, max_new_tokens=60, ignore_eos=True).token_ids
    try:
        scheduler = slowed(cached.start_scheduler(slots=2))
        running = cached.submit(prompt, max_new_tokens=60, ignore_eos=True)
        _running_until(scheduler, lambda s: len(s.output) >= 30)
        sharing = prompt + reply[:24] + list(range(300, 306))
        shared = cached.submit(sharing, max_new_tokens=2, ignore_eos=True).result(timeout=60)
        assert not running.done()
        first = running.result(timeout=60)
        next_turn = cached.submit(prompt + first.token_ids + list(range(400, 410)), max_new_tokens=2,
                                  ignore_eos=True).result(timeout=60)
    finally:
        cached.close()
    assert shared.timings.cached_prompt_tokens == len(prompt) + 24  # its rows, copied while it ran
    assert shared.token_ids == tiny_engine.generate(sharing, max_new_tokens=2, ignore_eos=True).token_ids
    assert next_turn.timings.cached_prompt_tokens == len(prompt) + len(first.token_ids) - 1  # the whole record


def test_a_request_cancelled_before_holding_anything_leaves_no_record(cached):
    """A request cancelled while it waits to share another's chunked prefill holds no rows: its slot keeps no
    (empty) record, so it counts as free of one, not as holding a prefix."""
    rng = np.random.default_rng(0)
    long_prompt = [1] + rng.integers(3, 500, size=100).tolist()
    try:
        scheduler = slowed(cached.start_scheduler(slots=3, prefill_chunk=16))
        decoding = cached.submit([2] + rng.integers(3, 500, size=20).tolist(), max_new_tokens=40, ignore_eos=True)
        _running_until(scheduler, lambda s: s.next_token is not None)
        chunked = cached.submit(long_prompt, max_new_tokens=2, ignore_eos=True)  # in chunks beside the decoding one
        waiting = cached.submit(long_prompt[:80] + [7, 8, 9], max_new_tokens=2, ignore_eos=True)  # waits to copy
        _running_until(scheduler, lambda s: s.handle is waiting)
        waiting.cancel()
        for handle in (chunked, decoding):
            handle.result(timeout=60)
        assert waiting.result(timeout=60).finish_reason == "cancelled"
        records = list(scheduler._slot_ids)
    finally:
        cached.close()
    assert all(ids is None or len(ids) for ids in records), [None if r is None else len(r) for r in records]
